"""fanin.spark on a Spark standalone cluster: a master and two worker JVMs
(separate processes, each with its own kv daemon, found by its executors
through FANIN_KV_SOCKET; the driver has none), started by
fanin.spark.cluster from the PySpark wheel. Receivers run on the executors,
and an executor SIGKILLed mid-stream gives an exact result."""

from __future__ import annotations

import operator
import threading
import time

import pytest

pytest.importorskip("pyspark")

from fanin.control import ControlClient  # noqa: E402
from fanin.spark import reduce_by_key  # noqa: E402
from fanin.spark.cluster import StandaloneCluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(switch):
    with StandaloneCluster(switch.control_addr, workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def sc(cluster):
    ctx = cluster.context("fanin-cluster-test", **{"spark.task.maxFailures": "4"})
    yield ctx
    ctx.stop()


def daemon_stats(cluster) -> list[dict]:
    out = []
    for d in cluster.daemons:
        with d.client() as c:
            out.append(c.stats())
    return out


def settle(cluster, switch, timeout: float = 60) -> None:
    """Every daemon's tasks ended and every switch region released (a
    receiver of a killed attempt whose sender never joined ends after
    2 x silence_ms, 20 s)."""
    deadline = time.monotonic() + timeout
    with ControlClient(switch.control_addr) as control:
        while time.monotonic() < deadline:
            if all(s["tasks_active"] == 0 for s in daemon_stats(cluster)) and not control.kv_regions():
                return
            time.sleep(0.2)
        raise AssertionError(f"left behind: {daemon_stats(cluster)}, regions {control.kv_regions()}")


WORDS = [f"w{(i * 7919) % 99991}" for i in range(200_000)]


def test_each_worker_host_runs_a_receiver_and_the_sums_equal_spark(sc, cluster, switch):
    rdd = sc.parallelize(WORDS, 2).map(lambda w: (w, 1))
    expected = rdd.reduceByKey(operator.add).collectAsMap()
    before = daemon_stats(cluster)
    got = reduce_by_key(rdd)  # socket from each worker's FANIN_KV_SOCKET
    assert got.collectAsMap() == expected
    after = daemon_stats(cluster)
    # one receiver task on each worker's daemon, two sender channels at each
    assert [a["tasks_created"] - b["tasks_created"] for a, b in zip(after, before)] == [1, 1]
    assert [a["sends_finished"] - b["sends_finished"] for a, b in zip(after, before)] == [2, 2]
    settle(cluster, switch)


def test_a_dataframe_group_by_on_the_cluster_equals_spark(sc, cluster, switch):
    pytest.importorskip("pyarrow")
    pytest.importorskip("pandas")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from fanin.spark import aggregate

    spark = SparkSession(sc)
    df = spark.createDataFrame([(f"k{i % 101}", i % 7, i) for i in range(30_000)], "k string, g long, v long")
    got = aggregate(df.repartition(2), by=["k", "g"], agg={"v": ["sum", "max"], "*": "count"})
    expected = df.groupBy("k", "g").agg(F.sum("v").alias("sum(v)"), F.max("v").alias("max(v)"),
                                        F.count(F.lit(1)).alias("count(1)"))
    assert sorted(map(tuple, got.collect())) == sorted(map(tuple, expected.collect()))
    settle(cluster, switch)


def test_an_executor_killed_mid_stream_gives_the_exact_sums_once(sc, cluster, switch):
    """SIGKILL worker 1's executor JVM while its daemon streams: Spark loses
    the executor, retries the barrier stage on the new one, and the killed
    attempt's key-value tasks are aborted: the sums are exact, none counted
    twice, and no task or region is left."""
    rdd = sc.parallelize(WORDS, 2).map(lambda w: (w, 1))
    expected = rdd.reduceByKey(operator.add).collectAsMap()
    result: dict = {}

    def run() -> None:
        try:
            # a small window: the stream lasts long enough to be cut
            result["sums"] = reduce_by_key(rdd, window=4).collectAsMap()
        except BaseException as e:  # reported by the asserts below
            result["error"] = e

    start = daemon_stats(cluster)[1]
    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = daemon_stats(cluster)[1]
        # a receiver exists at worker 1 and its daemon has moved 200 datagrams
        if now["tasks_active"] > 0 and now["rx_datagrams"] - start["rx_datagrams"] > 200:
            break
        time.sleep(0.01)
    else:
        pytest.fail("worker 1's daemon never started streaming")
    assert now["tasks_finished"] == start["tasks_finished"], "too late: the stream had finished"
    cluster.kill_executor(1)
    job.join(timeout=300)
    assert "error" not in result, result.get("error")
    assert result["sums"] == expected
    settle(cluster, switch)
    end = daemon_stats(cluster)[1]
    # two attempts reached worker 1's daemon: the killed one (aborted when
    # its Python worker died, or finished if its stream ended first: either
    # way nothing of it is returned) and the retry
    assert end["tasks_created"] - start["tasks_created"] == 2
    assert (end["tasks_finished"] + end["tasks_failed"]) - (start["tasks_finished"] + start["tasks_failed"]) == 2
    cluster.wait_for_executors(sc)


def test_the_kv_benchmarks_run_their_spark_systems_on_a_standalone_cluster(tmp_path):
    """`fanin bench kv-wordcount --cluster`: the Spark systems and both
    fanin.spark forms on a master and two worker JVMs with a daemon each,
    every result checked against the reference (kv-groupby's --cluster
    uses the same `spark_for_bench`)."""
    import json
    import os
    import subprocess
    import sys

    import fanin

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fanin.__file__)))
    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "kv-wordcount", "--cluster", "--corpus-mb", "1",
                        "--repeats", "1", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["spark"].startswith("a standalone cluster of 2 workers") and out["all_equal"]
    assert {"fanin.spark.reduce_by_key", "fanin.spark.aggregate"} <= {row["system"] for row in out["rows"]}
