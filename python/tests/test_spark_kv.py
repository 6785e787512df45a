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
    d = DaemonProcess(sw.control_addr)
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
