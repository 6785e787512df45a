"""fanin.spark.aggregate: DataFrame groupBy().agg() through fanin with Arrow
batches end to end, on a real local Spark, a real switch and kv daemon;
every result must equal Spark's own groupBy().agg()."""

from __future__ import annotations

import math
import os
import sys

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
pytest.importorskip("pandas")  # PySpark's mapInArrow imports it

from fanin.kv import DaemonProcess, KvError  # noqa: E402
from fanin.proc import SwitchProcess  # noqa: E402
from fanin.spark import aggregate, ensure_java_home  # noqa: E402
from fanin.switch import switch_config  # noqa: E402


@pytest.fixture(scope="module")
def service():
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr=None))
    d = DaemonProcess(sw.control_addr)
    yield d
    d.stop()
    sw.stop()


@pytest.fixture(scope="module")
def spark():
    ensure_java_home()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2,4]").appName("fanin-frame-test")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4").getOrCreate())
    session.sparkContext.setLogLevel("FATAL")
    yield session
    session.stop()


def spark_agg(df, by, pairs):
    from pyspark.sql import functions as F

    exprs = [(F.count(F.lit(1)).alias("count(1)") if col == "*" else
              getattr(F, fn)(col).alias(f"{fn}({col})")) for col, fn in pairs]
    return df.groupBy(*by).agg(*exprs)


def rows_of(df):
    return sorted(map(tuple, df.collect()), key=repr)


@pytest.mark.parametrize("input_partitions", [2, 5])
def test_nullable_string_and_int_groups_with_every_aggregate_equal_spark(spark, service, input_partitions):
    """2 partitions: one barrier stage; 5 (more than the 2 slots): encoded
    first, then moved to the barrier tasks. Null keys form a group, null
    values are skipped, a group whose values are all null keeps its row."""
    rows = [(f"k{i % 37}" if i % 11 else None, i % 5, (i * 7) - 300 if i % 13 else None) for i in range(20_000)]
    rows += [("all-null", 9, None)] * 3
    df = spark.createDataFrame(rows, "k string, g int, v long").repartition(input_partitions)
    pairs = [("v", "sum"), ("v", "count"), ("v", "min"), ("v", "max"), ("*", "count")]
    got = aggregate(df, by=["k", "g"], agg=pairs, socket_path=service.socket_path)
    assert got.columns == ["k", "g", "sum(v)", "count(v)", "min(v)", "max(v)", "count(1)"]
    assert got.schema == spark_agg(df, ["k", "g"], pairs).schema
    assert rows_of(got) == rows_of(spark_agg(df, ["k", "g"], pairs))
    assert got.filter("k = 'all-null'").collect()[0][2:] == (None, 0, None, None, 3)
    assert got.limit(2).count() == 2  # an ordinary DataFrame: partial jobs work


def test_binary_long_and_invalid_utf8_keys_and_small_integer_types(spark, service):
    keys = [b"\xff\xfe", b"L" * 5000, bytes(range(256)) * 8, b"", b"plain"]
    rows = [(keys[i % len(keys)], -(i % 3), i % 128 - 64, i - 1000) for i in range(5000)]
    df = spark.createDataFrame(rows, "b binary, n long, s short, v int").repartition(2)
    pairs = [("v", "sum"), ("s", "min"), ("s", "max"), ("v", "max")]
    got = aggregate(df, by=["b", "n"], agg=pairs, socket_path=service.socket_path)
    assert got.schema == spark_agg(df, ["b", "n"], pairs).schema
    assert rows_of(got) == rows_of(spark_agg(df, ["b", "n"], pairs))


def test_word_count_and_num_partitions(spark, service):
    words = spark.createDataFrame([(w,) for w in ("to be or not to be " * 2000).split()], "word string")
    got = aggregate(words, by="word", agg={"*": "count"}, num_partitions=3, socket_path=service.socket_path)
    assert got.rdd.getNumPartitions() == 3
    assert dict(map(tuple, got.collect())) == {"to": 4000, "be": 4000, "or": 2000, "not": 2000}


def close(a, b, count_and_magnitude):
    """float64 sums within rounding: both systems add in an order of their own."""
    if a is None or b is None or isinstance(a, (str, bytes)) or isinstance(a, int):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    n, magnitude = count_and_magnitude
    return abs(a - b) <= max(n, 1) * 2**-52 * magnitude


@pytest.mark.parametrize("input_partitions", [2, 5])
def test_float_and_int_columns_together_equal_spark_within_rounding(spark, service, input_partitions):
    """A double column (nulls, negatives, NaN, ±inf in some groups), a float
    column and an int column in one call: two key-value tasks per receiver
    (int64 and float64 registers). Sums within the bound of docs/kv.md,
    min/max/count exact; Spark's types (sum of float is double)."""
    import random

    rng = random.Random(5)
    rows = []
    for i in range(30_000):
        g = f"g{i % 101}"
        x = None if i % 17 == 0 else rng.uniform(-1e6, 1e6)
        if g == "g7":
            x = float("nan") if i % 2 else 1.0
        if g == "g8":
            x = float("inf") if i % 3 == 0 else -2.5
        rows.append((g, x, rng.uniform(-10, 10), i % 1000 - 500))
    df = spark.createDataFrame(rows, "g string, x double, f float, n long").repartition(input_partitions)
    pairs = [("x", "sum"), ("x", "min"), ("x", "max"), ("x", "count"), ("f", "sum"), ("f", "min"), ("f", "max"),
             ("n", "sum"), ("n", "max"), ("*", "count")]
    got = aggregate(df, by="g", agg=pairs, socket_path=service.socket_path)
    want = spark_agg(df, ["g"], pairs)
    assert got.schema == want.schema
    got_rows, want_rows = rows_of(got), rows_of(want)
    assert [r[0] for r in got_rows] == [r[0] for r in want_rows]
    magnitude = {}
    for g, x, f, _ in rows:
        m = magnitude.setdefault(g, [0, 0.0, 0, 0.0])
        if x is not None and math.isfinite(x):
            m[0] += 1
            m[1] += abs(x)
        m[2] += 1
        m[3] += abs(f)
    for a, b in zip(got_rows, want_rows):
        m = magnitude[a[0]]
        assert close(a[1], b[1], (m[0], m[1])), (a, b)  # sum(x)
        assert a[2:5] == b[2:5] or (a[0] == "g7" and math.isnan(a[3]) and math.isnan(b[3])), (a, b)
        assert close(a[5], b[5], (m[2], m[3])), (a, b)  # sum(f)
        assert a[6:] == b[6:], (a, b)
    g7 = got.filter("g = 'g7'").collect()[0]
    assert g7["min(x)"] == 1.0 and math.isnan(g7["max(x)"]), "NaN is above every number, as in Spark"
    assert got.filter("g = 'g8'").collect()[0]["sum(x)"] == float("inf")


def test_bad_requests_are_refused_at_once_with_what_to_change(spark, service):
    from decimal import Decimal

    df = spark.createDataFrame([("a", 1.5, 1, Decimal("1.5"))], "k string, x double, v long, d decimal(4,2)")
    with pytest.raises(TypeError, match="'d' is decimal\\(4,2\\); fanin aggregates integer and float columns"):
        aggregate(df, by="k", agg={"d": "sum"}, socket_path=service.socket_path)
    with pytest.raises(TypeError, match="group column 'x' is double"):
        aggregate(df, by="x", agg={"v": "sum"}, socket_path=service.socket_path)
    with pytest.raises(ValueError, match="no column 'nope'"):
        aggregate(df, by="k", agg={"nope": "sum"}, socket_path=service.socket_path)
    with pytest.raises(ValueError, match="'avg' for 'v'; fanin computes sum, count, min, max"):
        aggregate(df, by="k", agg={"v": "avg"}, socket_path=service.socket_path)
    with pytest.raises(ValueError, match="'\\*' takes only 'count'"):
        aggregate(df, by="k", agg={"*": "sum"}, socket_path=service.socket_path)


def test_an_int64_overflow_raises_instead_of_a_wrapped_sum(spark, service):
    df = spark.createDataFrame([("k", 2**62)] * 4, "k string, v long").repartition(2)
    with pytest.raises(KvError, match="overflowed"):
        aggregate(df, by="k", agg={"v": "sum"}, socket_path=service.socket_path)


def test_a_second_call_reads_its_input_again_not_the_first_call_s_cached_result(spark, service, tmp_path):
    """aggregate caches its result, and Spark's cache answers any later plan
    equal to a cached one: a second call over the same files, replaced
    meanwhile by another job, returned the first call's sums (no error)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(v):
        pq.write_table(pa.table({"k": ["a", "b"], "v": pa.array([v, 2 * v], pa.int64())}), str(tmp_path / "p.parquet"))

    write(1)
    first = aggregate(spark.read.parquet(str(tmp_path)), by="k", agg={"v": "sum"}, socket_path=service.socket_path)
    assert rows_of(first) == [("a", 1), ("b", 2)]
    write(100)
    df = spark.read.parquet(str(tmp_path))
    assert rows_of(aggregate(df, by="k", agg={"v": "sum"}, socket_path=service.socket_path)) == [("a", 100), ("b", 200)]
    assert rows_of(first) == [("a", 1), ("b", 2)]  # a result stays what its call computed


def test_the_kv_groupby_bench_checks_results_and_prints_json(tmp_path):
    """A small `fanin bench kv-groupby` run: its own Spark and switch, the
    result compared with Spark's in Spark, JSON with the speed-up."""
    import json
    import subprocess

    import fanin

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fanin.__file__)))
    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "kv-groupby", "--rows", "20000", "--groups", "500",
                        "--dists", "uniform,zipf", "--repeats", "1", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["all_equal"] and [x["dist"] for x in out["results"]] == ["uniform", "zipf"]
    assert out["value_type"] == "float64"
    assert all(x["speedup_vs_dataframe"] > 0 and x["distinct_keys"] <= 500 for x in out["results"])
    # the Arrow hand-over floor ran beside them, and the barrier sync was timed
    assert all(x["arrow_floor_s"] > 0 and x["ceiling_vs_dataframe"] > 0 for x in out["results"])
    assert out["barrier_sync_s"] > 0
    assert (tmp_path / "kv-groupby.png").stat().st_size > 0 and (tmp_path / "kv-groupby.csv").exists()


def test_each_floor_hands_over_every_row(spark):
    """A floor is a lower bound only if Spark computes and hands over every
    row: a failure in the last row must surface through each of them."""
    from pyspark.sql import functions as F

    from fanin_bench.bench.spark_floors import arrow_drain, jvm_drain, rdd_drain

    last = 9_999
    frame = spark.range(0, last + 1, numPartitions=2).select(
        F.when(F.col("id") == last, F.raise_error(F.lit("the last row was computed"))).otherwise(F.col("id"))
        .alias("id"))
    for drain in (arrow_drain, jvm_drain):
        with pytest.raises(Exception, match="the last row was computed"):
            drain(frame)
    rdd = spark.sparkContext.parallelize(range(last + 1), 2).map(lambda i: 1 // (i - last))
    with pytest.raises(Exception, match="ZeroDivisionError"):
        rdd_drain(rdd)


def test_the_kv_wordcount_bench_checks_every_system_and_reports_its_floors(tmp_path):
    """A small `fanin bench kv-wordcount`: every system's counts checked
    against the reference, and beside them the hand-over floors with the
    ceilings they put on the Spark forms' speed-ups."""
    import json
    import subprocess

    import fanin

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fanin.__file__)))
    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "kv-wordcount", "--corpus-mb", "1", "--repeats", "1",
                        "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    systems = {row["system"]: row for row in out["rows"]}
    assert {"fanin", "PySpark RDD reduceByKey", "fanin.spark.reduce_by_key", "fanin.spark.aggregate",
            "floor: RDD pairs reach Python", "floor: words reach Python as Arrow",
            "floor: words computed in the JVM"} <= set(systems)
    assert out["all_equal"] and all(row["median_s"] > 0 for row in out["rows"])
    assert out["ceiling_rdd_form_vs_rdd"] > 0 and out["ceiling_dataframe_form_vs_dataframe"] > 0
    assert out["barrier_sync_s"] > 0
    assert (tmp_path / "kv-wordcount.png").stat().st_size > 0
