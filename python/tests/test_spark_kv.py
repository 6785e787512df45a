"""fanin.spark.reduce_by_key on a real local Spark (PySpark from PyPI, the
machine's Java): executors stream their partitions to a real kv daemon and
switch; the result must equal Spark's own reduceByKey."""

from __future__ import annotations

import operator
import os
import sys

import pytest

pyspark = pytest.importorskip("pyspark")

from fanin.kv import DaemonProcess  # noqa: E402
from fanin.proc import SwitchProcess  # noqa: E402
from fanin.spark import ensure_java_home, reduce_by_key, reduce_by_key_as_map  # noqa: E402
from fanin.switch import switch_config  # noqa: E402


@pytest.fixture(scope="module")
def service():
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr=None))
    # longest key 1 KiB (the default is 64 MiB), so that a 5 000-byte key is
    # a partition's bad input in the failure test
    d = DaemonProcess(sw.control_addr, max_key_len=1024)
    yield d
    d.stop()
    sw.stop()


@pytest.fixture(scope="module")
def sc():
    ensure_java_home()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Executors are Python workers forked by Spark: they must import the
    # same fanin as this test.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    from pyspark import SparkConf, SparkContext

    conf = SparkConf().setMaster("local[2]").setAppName("fanin-test").set("spark.ui.enabled", "false")
    ctx = SparkContext.getOrCreate(conf)
    ctx.setLogLevel("ERROR")
    yield ctx
    ctx.stop()


def test_reduce_by_key_equals_spark(sc, service):
    words = [f"w{(i * 7919) % 997}" for i in range(50_000)] + ["a-medium-word", "a-very-long-key-beyond-fifteen-bytes"] * 100
    rdd = sc.parallelize(words, 4).map(lambda w: (w, 1))
    expected = rdd.reduceByKey(operator.add).collectAsMap()
    got = reduce_by_key(rdd, socket_path=service.socket_path, aa_size=256)
    assert got.getNumPartitions() == 4
    assert dict(got.collect()) == expected


def test_bytes_keys_and_negative_values(sc, service):
    rdd = sc.parallelize([(b"k%d" % (i % 10), i - 500) for i in range(1000)], 3)
    expected = rdd.reduceByKey(operator.add).collectAsMap()
    assert reduce_by_key_as_map(rdd, socket_path=service.socket_path) == expected


def test_empty_partitions(sc, service):
    rdd = sc.parallelize([("x", 1)], 3)
    assert reduce_by_key_as_map(rdd, socket_path=service.socket_path) == {"x": 1}


def test_a_failed_partition_is_named_and_the_others_partial_sums_are_kept(sc, service):
    """A partition whose sender fails (a key over the daemon's 1024-byte limit) ends
    the task with SenderFailed naming its channel; the other partition's
    sums come back exactly (docs/kv.md, "Failed senders")."""
    from fanin.kv import SenderFailed

    good = [("a", 1), ("b", 2)] * 50
    bad = [("x" * 5000, 1)]
    rdd = sc.parallelize([good, bad], 2).flatMap(lambda part: part)
    with pytest.raises(SenderFailed) as info:
        reduce_by_key_as_map(rdd, socket_path=service.socket_path)
    assert [f["channel"] for f in info.value.failed] == [1], info.value.failed
    assert "exceeds the limit" in info.value.failed[0]["reason"]
    partial = {(k.decode() if isinstance(k, bytes) else k): v for k, v in info.value.partial.items()}
    assert partial == {"a": 50, "b": 100}


def test_a_spark_job_that_fails_before_sending_is_aborted_promptly(sc, service):
    """No partition reaches the daemon (the job fails upstream): Spark's
    error comes back at once, not after silence_ms, and the task is gone."""
    import time

    def boom(x):
        raise ValueError("upstream failure")

    rdd = sc.parallelize([1, 2], 2).map(boom).map(lambda x: (str(x), 1))
    with service.client() as c:
        before = c.request({"op": "stats"})
    t0 = time.monotonic()
    with pytest.raises(Exception, match="upstream failure"):
        reduce_by_key_as_map(rdd, socket_path=service.socket_path)
    assert time.monotonic() - t0 < 60
    with service.client() as c:
        after = c.request({"op": "stats"})
    assert after["tasks_created"] == before["tasks_created"] + 1
    assert after["tasks_active"] <= before["tasks_active"], "the task was aborted"
