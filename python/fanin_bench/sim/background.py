"""`fanin sim background`: how fanin's aggregation tree and ring allreduce
fare as other tenants load an oversubscribed leaf-spine, one root against a
root spread over the spines with equal shares and with shares weighed by the
port counters (docs/simulator.md, "Background traffic and oversubscription",
"One job, many roots", "Weighted roots").

Per background load: ring allreduce, and fanin with one root (`one-root`),
with every spine a root of an equal share (`many-roots`, `--multi-root`) and
with the shares weighed by spare capacity (`weighted-roots`, `--root-weights
spare`), each one `fanin sim allreduce` run on the same network, workers,
seed and background. Outputs in `--out` (default out/sim-background): every
run's own files under `L<load>/<arm>/`, `background.json` (the table),
`background.csv` and `background.png` (completion time and fraction of line
rate against the load, the 0.9 target line beside).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from typing import Optional

from fanin_bench.sim.allreduce import run_report

__all__ = ["main", "ARMS"]

#: fanin's arms: name -> extra `fanin sim allreduce` arguments.
ARMS = {
    "one-root": [],
    "many-roots": ["--multi-root"],
    "weighted-roots": ["--multi-root", "--root-weights", "spare"],
}


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loads {text!r}: give fractions of the link rate, e.g. 0,0.25,0.5")
    if not loads or any(not 0.0 <= x <= 1.0 for x in loads):
        raise argparse.ArgumentTypeError(f"--loads {text!r}: every load is a fraction of the link rate in [0, 1]")
    return loads


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fanin sim background", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  fanin sim background --json   (leaf-spine:5,16,10, 128 workers x "
                                       "1 MiB, background 0 / 10 / 25 / 50 %%)")
    p.add_argument("--topology", default="leaf-spine:5,16,10",
                   help="a topology whose root's children share several parents (default %(default)s: 2:1 "
                        "oversubscribed, 160 hosts)")
    p.add_argument("--workers", type=int, default=128,
                   help="workers, taken evenly from every leaf; the other hosts carry the background (default "
                        "%(default)s)")
    p.add_argument("--size", type=int, default=1 << 18, help="int32 elements per worker (default %(default)s)")
    p.add_argument("--loads", type=_loads, default=[0.0, 0.1, 0.25, 0.5],
                   help="background loads, fractions of the link rate (default 0,0.1,0.25,0.5)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--queue-pkts", type=int, default=1000, help="every switch port's buffer in datagrams")
    p.add_argument("--trimming", nargs="?", const="ndp", choices=["ndp", "tofino"],
                   help="trimming on every switch (see fanin sim allreduce --help)")
    p.add_argument("--no-ring", action="store_true", help="fanin's arms only (the ring is the slowest run)")
    p.add_argument("--time-limit-ms", type=int, default=60_000, help="per run (see fanin sim allreduce --help)")
    p.add_argument("--quick", action="store_true", help="leaf-spine:3,4,4, 8 workers, 16384 elements, loads 0,0.5")
    p.add_argument("--json", action="store_true", help="the table as JSON on stdout")
    p.add_argument("--out", default="out/sim-background")
    p.add_argument("--no-plot", action="store_true")
    return p


def _arm_row(summary: dict) -> dict:
    keys = ("completion_us", "goodput_fraction_of_line_rate", "exact", "retransmissions", "queue_drops", "trims")
    return {k: summary.get(k) for k in keys}


def main(binary: str, argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.topology, args.workers, args.size, args.loads = "leaf-spine:3,4,4", 8, min(args.size, 1 << 14), [0.0, 0.5]
    common = ["--topology", args.topology, "--workers", str(args.workers), "--spread", "--size", str(args.size),
              "--seed", str(args.seed), "--queue-pkts", str(args.queue_pkts), "--time-limit-ms",
              str(args.time_limit_ms), "--no-plot"]
    if args.trimming:
        common += ["--trimming", args.trimming]
    rows = []
    for load in args.loads:
        bg = ["--background-load", str(load)] if load > 0 else []
        row: dict = {"background_load": load, "arms": {}}
        for arm, extra in ARMS.items():
            algorithms = "fanin" if arm != "one-root" or args.no_ring else "fanin,ring"
            out = os.path.join(args.out, f"L{load:g}", arm)
            print(f"fanin sim background: load {load:g}, {arm}" + (" and ring" if "ring" in algorithms else ""),
                  file=sys.stderr)
            code, report = run_report(binary, common + bg + extra + ["--algorithms", algorithms, "--out", out])
            if code != 0 or report is None:
                print(f"fanin sim background: the {arm} run at load {load:g} failed (exit {code}); its files are in "
                      f"{out}", file=sys.stderr)
                return code or 1
            by = {a["algorithm"]: a for a in report["scenarios"][0]["algorithms"]}
            row["arms"][arm] = _arm_row(by["fanin"])
            if "root_weights" in report:
                row["arms"][arm]["root_shards"] = report["root_weights"]["shards"]
            if "ring" in by:
                row["arms"]["ring"] = _arm_row(by["ring"])
        ring = row["arms"].get("ring")
        if ring:
            row["speedup_over_ring"] = {arm: ring["completion_us"] / row["arms"][arm]["completion_us"] for arm in ARMS}
        rows.append(row)
    table = {"bench": "sim-background", "topology": args.topology, "workers": args.workers,
             "size_elements": args.size, "seed": args.seed, "queue_pkts": args.queue_pkts,
             "trimming": args.trimming, "rows": rows}
    _write(args.out, table)
    if not args.no_plot:
        try:
            path = _plot(args.out, table)
            print(f"fanin sim background: wrote {path}", file=sys.stderr)
        except ImportError as e:
            print(f"fanin sim background: no PNG ({e})", file=sys.stderr)
    _summary(table)
    if args.json:
        print(json.dumps(table))
    return 0


def _write(out: str, table: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "background.json"), "w") as f:
        json.dump(table, f)
    with open(os.path.join(out, "background.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["background_load", "arm", "completion_us", "fraction_of_line_rate", "exact", "retransmissions",
                    "queue_drops", "trims"])
        for row in table["rows"]:
            for arm, a in row["arms"].items():
                w.writerow([row["background_load"], arm, a["completion_us"], a["goodput_fraction_of_line_rate"],
                            a["exact"], a["retransmissions"], a["queue_drops"], a["trims"]])


def _summary(table: dict) -> None:
    arms = [*ARMS, "ring"]
    print(f"{'load':>6} " + " ".join(f"{a:>16}" for a in arms) + "   (µs, fraction of line rate)", file=sys.stderr)
    for row in table["rows"]:
        cells = []
        for arm in arms:
            a: Optional[dict] = row["arms"].get(arm)
            cells.append(f"{a['completion_us']:8.1f} ({a['goodput_fraction_of_line_rate']:.2f})" if a else f"{'-':>16}")
        print(f"{row['background_load']:>6g} " + " ".join(f"{c:>16}" for c in cells), file=sys.stderr)


def _plot(out: str, table: dict) -> str:
    from fanin_bench.sim.plots import _plt, _save

    plt = _plt()
    loads = [r["background_load"] for r in table["rows"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for arm in [*ARMS, "ring"]:
        pts = [(r["background_load"], r["arms"][arm]) for r in table["rows"] if arm in r["arms"]]
        if not pts:
            continue
        xs = [100 * x for x, _ in pts]
        a1.plot(xs, [a["completion_us"] for _, a in pts], marker="o", label=arm)
        a2.plot(xs, [a["goodput_fraction_of_line_rate"] for _, a in pts], marker="o", label=arm)
    a1.set_yscale("log")
    a1.set_xlabel("background load (% of each tenant host's link rate)")
    a1.set_ylabel("completion time (µs, last worker)")
    a1.set_title(f"allreduce on {table['topology']}, {table['workers']} workers")
    a2.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="target 0.9")
    a2.set_xlabel("background load (% of each tenant host's link rate)")
    a2.set_ylabel("tensor bytes / (link rate x completion)")
    a2.set_ylim(0, 1)
    a2.set_title("fraction of line rate")
    for ax in (a1, a2):
        ax.set_xticks([100 * x for x in loads])
        ax.legend()
    return _save(plt, fig, os.path.join(out, "background.png"))
