"""``fanin bench kv-groupby``: a DataFrame group-by through fanin vs Spark's own.

A generated table (``--rows`` rows of ``k long, v double``, ``--groups``
distinct keys drawn uniformly or Zipf-like) is cached in Spark on
``local[2]``; then, alternating, Spark's ``groupBy("k").agg(sum, count,
min, max of v)`` (written to Spark's ``noop`` sink, which computes every
column and keeps nothing) and ``fanin.spark.aggregate`` with the same
aggregates (a real switch and kv daemon; receivers on the executors; the
call computes and caches its result), and a floor: the table handed to
Python as Arrow and dropped, what any design fed by Arrow pays before it
aggregates (``spark_floors.py``; the JSON's ``ceiling_vs_dataframe``). Both results are compared in Spark
once per table: the same keys, count, min and max equal, and each sum
within the rounding bound of docs/kv.md (|a - b| <= count x 2^-52 x
sum |v|: the two systems add in orders of their own); ``--value-type
int64`` makes v a long and the comparison exact. A difference fails the
run.

The values of the double column are full-precision doubles (a uniform
draw in ±1000 with 52 random bits), not values whose sums happen to be
exact in any order.

Zipf-like keys: ``k = floor(G^u) - 1`` for uniform ``u``, so
P(k) ∝ log((k + 2) / (k + 1)) ≈ 1/(k + 1): Zipf with s = 1, hot keys low.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from fanin_bench.bench.kv_wordcount import SENDERS, _write_csv, kv_service, spark_for_bench, spark_label
from fanin_bench.bench.spark_floors import arrow_drain, barrier_sync_seconds
from fanin_bench.plotting import save_figure

__all__ = ["run_kv_groupby"]

AGGS = [("v", "sum"), ("v", "count"), ("v", "min"), ("v", "max")]


def _table(spark: Any, rows: int, groups: int, dist: str, seed: int, value_type: str) -> Any:
    from pyspark.sql import functions as F

    base = spark.range(0, rows, numPartitions=SENDERS)
    if dist == "uniform":
        key = F.pmod(F.xxhash64("id"), F.lit(groups))
    elif dist == "zipf":
        key = F.least(F.floor(F.exp(F.rand(seed) * F.log(F.lit(float(groups))))), F.lit(groups)) - 1
    else:
        raise SystemExit(f"kv-groupby: unknown distribution {dist!r}; use uniform or zipf")
    if value_type == "int64":
        value = (F.pmod(F.xxhash64("id", F.lit(1)), F.lit(2_000_001)) - 1_000_000).cast("long")
    else:
        value = (F.rand(seed + 1) * 2000.0 - 1000.0).cast("double")
    return base.select(key.cast("long").alias("k"), value.alias("v"))


def _spark_groupby(table: Any) -> Any:
    from pyspark.sql import functions as F

    return table.groupBy("k").agg(*[getattr(F, fn)(col).alias(f"{fn}({col})") for col, fn in AGGS])


def _differences(table: Any, got: Any, expected: Any, value_type: str) -> int:
    """Groups where fanin's result is not Spark's: a key in one only, a
    count, min or max that differs, or a sum beyond the rounding bound
    (float64; int64 sums must be equal)."""
    from pyspark.sql import functions as F

    magnitude = table.groupBy("k").agg(F.sum(F.abs("v")).alias("abs_sum"))
    g = got.select("k", *[F.col(f"`{fn}(v)`").alias(f"{fn}_a") for _, fn in AGGS])
    e = expected.select("k", *[F.col(f"`{fn}(v)`").alias(f"{fn}_b") for _, fn in AGGS])
    both = g.join(e, "k", "full_outer").join(magnitude, "k", "left")
    exact = [F.col(f"{fn}_a").eqNullSafe(F.col(f"{fn}_b")) for fn in ("count", "min", "max")]
    if value_type == "int64":
        sums = F.col("sum_a").eqNullSafe(F.col("sum_b"))
    else:
        sums = F.abs(F.col("sum_a") - F.col("sum_b")) <= F.col("count_b") * F.lit(2.0 ** -52) * F.col("abs_sum")
    ok = exact[0] & exact[1] & exact[2] & F.coalesce(sums, F.lit(False))
    return both.filter(~ok).count()


def run_kv_groupby(args: Any) -> int:
    from fanin.spark import aggregate

    rows_n = args.rows or (1_000_000 if args.quick else 10_000_000)
    groups_list = [int(g) for g in (args.groups or ("100000" if args.quick else "100000,1000000")).split(",")]
    dists = (args.dists or ("uniform,zipf")).split(",")
    repeats = args.repeats or (1 if args.quick else 3)
    value_type = getattr(args, "value_type", None) or "float64"
    os.makedirs(args.out, exist_ok=True)
    results = []
    with kv_service(send_channels=SENDERS) as svc, spark_for_bench(svc, getattr(args, "cluster", False)) as bench_spark:
        spark, socket_path = bench_spark.spark, bench_spark.socket_path
        barrier_s = barrier_sync_seconds(spark.sparkContext, SENDERS)
        for dist in dists:
            for groups in groups_list:
                table = _table(spark, rows_n, groups, dist, args.seed, value_type).cache()
                table.count()
                expected = _spark_groupby(table)
                got = aggregate(table, by="k", agg=AGGS, socket_path=socket_path)
                distinct = got.count()
                differ = _differences(table, got, expected, value_type)
                got.unpersist()
                if differ:
                    raise SystemExit(f"kv-groupby: fanin's result differs from Spark's in {differ} groups "
                                     f"({dist}, {groups} groups)")
                times: dict[str, list[float]] = {"spark": [], "fanin": [], "arrow_floor": []}
                for i in range(repeats):
                    # alternating, so drift in the machine's speed hits both
                    t0 = time.perf_counter()
                    _spark_groupby(table).write.format("noop").mode("overwrite").save()
                    times["spark"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    aggregate(table, by="k", agg=AGGS, socket_path=socket_path).unpersist()
                    times["fanin"].append(time.perf_counter() - t0)
                    # the floor: the table's rows reach Python as Arrow and
                    # are dropped (spark_floors.py)
                    t0 = time.perf_counter()
                    arrow_drain(table)
                    times["arrow_floor"].append(time.perf_counter() - t0)
                    print(f"kv-groupby: {dist}, {groups} groups, run {i + 1}/{repeats}: Spark "
                          f"{times['spark'][-1]:.2f} s, fanin {times['fanin'][-1]:.2f} s, Arrow hand-over "
                          f"{times['arrow_floor'][-1]:.2f} s", file=sys.stderr)
                table.unpersist()
                med = {k: statistics.median(v) for k, v in times.items()}
                # the floor's fastest run: the ceilings below err high
                med["arrow_floor"] = min(times["arrow_floor"])
                results.append({"dist": dist, "groups": groups, "distinct_keys": distinct, "rows": rows_n,
                                "spark_s": round(med["spark"], 3), "fanin_s": round(med["fanin"], 3),
                                "spark_runs_s": [round(x, 3) for x in times["spark"]],
                                "fanin_runs_s": [round(x, 3) for x in times["fanin"]],
                                "arrow_floor_s": round(med["arrow_floor"], 3),  # the fastest run
                                "arrow_floor_runs_s": [round(x, 3) for x in times["arrow_floor"]],
                                "speedup_vs_dataframe": round(med["spark"] / med["fanin"], 2),
                                # the most any design fed by Arrow could reach, were
                                # everything after the hand-over free; a barrier
                                # stage adds barrier_sync_s per sync on top
                                "ceiling_vs_dataframe": round(med["spark"] / med["arrow_floor"], 2),
                                "ceiling_vs_dataframe_one_sync": round(
                                    med["spark"] / (med["arrow_floor"] + barrier_s), 2),
                                "equal": True})
    csv_path = os.path.join(args.out, "kv-groupby.csv")
    _write_csv(csv_path, [{k: v for k, v in r.items() if not k.endswith("runs_s")} for r in results])
    png_path = os.path.join(args.out, "kv-groupby.png")
    _plot(results, png_path, rows_n, spark_label(args))
    out = {"benchmark": "kv-groupby", "rows": rows_n, "cores": SENDERS, "spark": spark_label(args), "repeats": repeats,
           "aggregates": AGGS,
           "value_type": value_type, "all_equal": True, "results": results, "barrier_sync_s": round(barrier_s, 3),
           "target_1_5x_dataframe": all(r["speedup_vs_dataframe"] >= 1.5 for r in results),
           "csv": csv_path, "png": png_path}
    if args.json:
        print(json.dumps(out))
    print(f"group-by of {rows_n} rows, sum/count/min/max of a {value_type} column, {SENDERS} cores, Spark on "
          f"{spark_label(args)}, median of {repeats}; results equal (float sums within rounding):", file=sys.stderr)
    for r in results:
        print(f"  {r['dist']:8} {r['groups']:>8} groups  Spark {r['spark_s']:6.2f} s  fanin {r['fanin_s']:6.2f} s  "
              f"{r['speedup_vs_dataframe']:.2f}x  (Arrow hand-over {r['arrow_floor_s']:.2f} s: at most "
              f"{r['ceiling_vs_dataframe']:.2f}x, {r['ceiling_vs_dataframe_one_sync']:.2f}x with one barrier sync)",
              file=sys.stderr)
    print(f"  one barrier sync: {barrier_s:.2f} s", file=sys.stderr)
    return 0


def _plot(results: list[dict], path: str, rows_n: int, spark: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['dist']}\n{r['groups']:,} groups" for r in results]
    x = range(len(results))
    ax.bar([i - 0.27 for i in x], [r["spark_s"] for r in results], 0.27, label="Spark DataFrame groupBy().agg()")
    ax.bar(list(x), [r["fanin_s"] for r in results], 0.27, label="fanin.spark.aggregate")
    ax.bar([i + 0.27 for i in x], [r["arrow_floor_s"] for r in results], 0.27, color="0.7",
           label="floor: rows handed to Python as Arrow, dropped")
    for i, r in enumerate(results):
        ax.text(i, r["fanin_s"], f"{r['speedup_vs_dataframe']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("wall seconds (median)")
    ax.set_title(f"group-by of {rows_n / 1e6:g} M rows: sum, count, min, max (2 cores, Spark on {spark})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
