"""``fanin bench kv-groupby``: a DataFrame group-by through fanin vs Spark's own.

A generated table (``--rows`` rows of ``k long, v long``, ``--groups``
distinct keys drawn uniformly or Zipf-like) is cached in Spark on
``local[2]``; then, alternating, Spark's ``groupBy("k").agg(sum, count,
min, max of v)`` (written to Spark's ``noop`` sink, which computes every
column and keeps nothing) and ``fanin.spark.aggregate`` with the same
aggregates (a real switch and kv daemon; receivers on the executors; the
call computes and caches its result). Both results are compared in Spark
(``exceptAll`` both ways) once per table; a difference fails the run.

The issue asks for a float column; fanin sums int64 (the switch's
aggregators are integer registers), so ``v`` is int64 here and float
values are refused by ``aggregate`` with that reason (docs/kv.md §10).

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

from fanin_bench.bench.kv_wordcount import SENDERS, _spark_session, _write_csv, kv_service
from fanin_bench.plotting import save_figure

__all__ = ["run_kv_groupby"]

AGGS = [("v", "sum"), ("v", "count"), ("v", "min"), ("v", "max")]


def _table(spark: Any, rows: int, groups: int, dist: str, seed: int) -> Any:
    from pyspark.sql import functions as F

    base = spark.range(0, rows, numPartitions=SENDERS)
    if dist == "uniform":
        key = F.pmod(F.xxhash64("id"), F.lit(groups))
    elif dist == "zipf":
        key = F.least(F.floor(F.exp(F.rand(seed) * F.log(F.lit(float(groups))))), F.lit(groups)) - 1
    else:
        raise SystemExit(f"kv-groupby: unknown distribution {dist!r}; use uniform or zipf")
    value = F.pmod(F.xxhash64("id", F.lit(1)), F.lit(2_000_001)) - 1_000_000
    return base.select(key.cast("long").alias("k"), value.cast("long").alias("v"))


def _spark_groupby(table: Any) -> Any:
    from pyspark.sql import functions as F

    return table.groupBy("k").agg(*[getattr(F, fn)(col).alias(f"{fn}({col})") for col, fn in AGGS])


def run_kv_groupby(args: Any) -> int:
    from fanin.spark import aggregate

    rows_n = args.rows or (1_000_000 if args.quick else 10_000_000)
    groups_list = [int(g) for g in (args.groups or ("100000" if args.quick else "100000,1000000")).split(",")]
    dists = (args.dists or ("uniform,zipf")).split(",")
    repeats = args.repeats or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    spark = _spark_session()
    spark.sparkContext.setLogLevel("ERROR")
    results = []
    with kv_service(send_channels=SENDERS) as svc:
        for dist in dists:
            for groups in groups_list:
                table = _table(spark, rows_n, groups, dist, args.seed).cache()
                table.count()
                expected = _spark_groupby(table)
                got = aggregate(table, by="k", agg=AGGS, socket_path=svc.daemon.socket_path)
                distinct = got.count()
                equal = got.exceptAll(expected).count() == 0 and expected.exceptAll(got).count() == 0
                got.unpersist()
                if not equal:
                    raise SystemExit(f"kv-groupby: fanin's result differs from Spark's ({dist}, {groups} groups)")
                times: dict[str, list[float]] = {"spark": [], "fanin": []}
                for i in range(repeats):
                    # alternating, so drift in the machine's speed hits both
                    t0 = time.perf_counter()
                    _spark_groupby(table).write.format("noop").mode("overwrite").save()
                    times["spark"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    aggregate(table, by="k", agg=AGGS, socket_path=svc.daemon.socket_path).unpersist()
                    times["fanin"].append(time.perf_counter() - t0)
                    print(f"kv-groupby: {dist}, {groups} groups, run {i + 1}/{repeats}: Spark "
                          f"{times['spark'][-1]:.2f} s, fanin {times['fanin'][-1]:.2f} s", file=sys.stderr)
                table.unpersist()
                med = {k: statistics.median(v) for k, v in times.items()}
                results.append({"dist": dist, "groups": groups, "distinct_keys": distinct, "rows": rows_n,
                                "spark_s": round(med["spark"], 3), "fanin_s": round(med["fanin"], 3),
                                "spark_runs_s": [round(x, 3) for x in times["spark"]],
                                "fanin_runs_s": [round(x, 3) for x in times["fanin"]],
                                "speedup_vs_dataframe": round(med["spark"] / med["fanin"], 2), "equal": True})
    spark.stop()
    csv_path = os.path.join(args.out, "kv-groupby.csv")
    _write_csv(csv_path, [{k: v for k, v in r.items() if not k.endswith("runs_s")} for r in results])
    png_path = os.path.join(args.out, "kv-groupby.png")
    _plot(results, png_path, rows_n)
    out = {"benchmark": "kv-groupby", "rows": rows_n, "cores": SENDERS, "repeats": repeats, "aggregates": AGGS,
           "value_type": "int64", "all_equal": True, "results": results,
           "target_1_5x_dataframe": all(r["speedup_vs_dataframe"] >= 1.5 for r in results),
           "csv": csv_path, "png": png_path}
    if args.json:
        print(json.dumps(out))
    print(f"group-by of {rows_n} rows, sum/count/min/max of an int64 column, {SENDERS} cores, median of {repeats}; "
          "results equal:", file=sys.stderr)
    for r in results:
        print(f"  {r['dist']:8} {r['groups']:>8} groups  Spark {r['spark_s']:6.2f} s  fanin {r['fanin_s']:6.2f} s  "
              f"{r['speedup_vs_dataframe']:.2f}x", file=sys.stderr)
    return 0


def _plot(results: list[dict], path: str, rows_n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['dist']}\n{r['groups']:,} groups" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["spark_s"] for r in results], 0.4, label="Spark DataFrame groupBy().agg()")
    ax.bar([i + 0.2 for i in x], [r["fanin_s"] for r in results], 0.4, label="fanin.spark.aggregate")
    for i, r in enumerate(results):
        ax.text(i + 0.2, r["fanin_s"], f"{r['speedup_vs_dataframe']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("wall seconds (median)")
    ax.set_title(f"group-by of {rows_n / 1e6:g} M rows: sum, count, min, max (2 cores)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
