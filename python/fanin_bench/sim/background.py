"""`fanin sim background`: how fanin's aggregation tree and ring allreduce
fare as other tenants load an oversubscribed leaf-spine, one root against a
root spread over the spines with equal shares and with shares weighed by the
port counters (docs/simulator.md, "Background traffic and oversubscription",
"One job, many roots", "Weighted roots").

Per background load: ring allreduce, and fanin with one root (`one-root`),
with every spine a root of an equal share (`many-roots`, `--multi-root`) and
with the shares weighed by spare capacity (`weighted-roots`, `--root-weights
spare`), each one `fanin sim allreduce` run on the same network, workers,
seed and background; with `--seeds N`, each over N seeds (other background
phases and destinations, other ECMP collisions), reported as the median and
the tail (the slowest seed). Outputs in `--out` (default
out/sim-background): every run's own files under `L<load>/<arm>/s<seed>/`,
`background.json` (the table, every seed's figures in it),
`background.csv` and `background.png` (completion time and fraction of line
rate against the load, the seeds' range as error bars, the 0.9 target line
beside).

A ring run that has not finished within `--time-limit-ms` (default 50 ms of
simulated time, hundreds of times an allreduce here) is reported as
unfinished: a ring hop that background traffic starves can hold it for
simulated seconds (docs/simulator.md, "Weighted roots"). A fanin run that
does not finish, or a wrong sum, fails the command (exit 1) after the
table is written.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
from typing import Optional

from fanin._cli_util import Parser
from fanin.topology import load as load_topology
from fanin_bench.sim import out_of_range
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
    p = Parser(prog="fanin sim background", description=__doc__.split("\n\n")[0],
                                epilog="example:\n  fanin sim background --json   (leaf-spine:5,16,10, 128 workers x "
                                       "1 MiB, background 0 / 10 / 25 / 50 %%)")
    p.add_argument("--topology",
                   help="a topology whose root's children share several parents (default leaf-spine:5,16,10: 2:1 "
                        "oversubscribed, 160 hosts; leaf-spine:3,4,4 with --quick)")
    p.add_argument("--workers", type=int,
                   help="workers, taken evenly from every leaf; the other hosts carry the background (default "
                        "128; 8 with --quick)")
    p.add_argument("--size", type=int, help=f"int32 elements per worker (default {1 << 18}; {1 << 14} with --quick)")
    p.add_argument("--loads", type=_loads,
                   help="background loads, fractions of the link rate (default 0,0.1,0.25,0.5; 0,0.5 with --quick)")
    p.add_argument("--seed", type=int, default=1, help="the first seed (default %(default)s)")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per arm and load, seeds --seed, --seed + 1, ...: the median and the tail (default "
                        "%(default)s)")
    p.add_argument("--queue-pkts", type=int, default=1000, help="every switch port's buffer in datagrams")
    p.add_argument("--trimming", nargs="?", const="ndp", choices=["ndp", "tofino"],
                   help="trimming on every switch (see fanin sim allreduce --help)")
    p.add_argument("--no-ring", action="store_true", help="fanin's arms only (the ring is the slowest run)")
    p.add_argument("--time-limit-ms", type=int, default=50,
                   help="simulated time per run after which it counts as unfinished (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="leaf-spine:3,4,4, 8 workers, 16384 elements, loads 0,0.5, each unless its flag says "
                        "otherwise")
    p.add_argument("--json", action="store_true", help="the table as JSON on stdout")
    p.add_argument("--out", default="out/sim-background")
    p.add_argument("--no-plot", action="store_true")
    return p


def _aggregate(runs: list[dict]) -> dict:
    """One arm at one load over its seeds: medians, the tail (slowest seed)
    and every seed's figures; unfinished runs are counted, not averaged."""
    done = [r for r in runs if r["finished"]]
    times = [r["completion_us"] for r in done]
    fractions = [r["goodput_fraction_of_line_rate"] for r in done]
    return {
        "runs": len(runs),
        "finished": len(done),
        "exact": all(r["exact"] for r in done) if done else None,
        "completion_us": statistics.median(times) if times else None,
        "completion_us_max": max(times) if times else None,
        "completion_us_min": min(times) if times else None,
        "goodput_fraction_of_line_rate": statistics.median(fractions) if fractions else None,
        "goodput_fraction_min": min(fractions) if fractions else None,
        "retransmissions": statistics.median([r["retransmissions"] for r in done]) if done else None,
        "queue_drops": statistics.median([r["queue_drops"] for r in done]) if done else None,
        "trims": statistics.median([r["trims"] for r in done]) if done else None,
        "per_seed": runs,
    }


def _one_run(binary: str, argv: list[str], seed: int, algorithm: str) -> dict:
    code, report = run_report(binary, argv + ["--algorithms", algorithm])
    if code != 0 or report is None:
        return {"seed": seed, "finished": False, "exit": code}
    (a,) = report["scenarios"][0]["algorithms"]
    run = {"seed": seed, "finished": True}
    run.update({k: a.get(k) for k in ("completion_us", "goodput_fraction_of_line_rate", "exact", "retransmissions",
                                      "queue_drops", "trims")})
    if "root_weights" in report:
        run["root_shards"] = report["root_weights"]["shards"]
    return run


def main(binary: str, argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # --quick fills in what the command line left out, and overrides nothing it gave
    quick = {"topology": "leaf-spine:3,4,4", "workers": 8, "size": 1 << 14, "loads": [0.0, 0.5]}
    full = {"topology": "leaf-spine:5,16,10", "workers": 128, "size": 1 << 18, "loads": [0.0, 0.1, 0.25, 0.5]}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    bad = out_of_range(args, workers="count", size="count", seeds="count", queue_pkts="count",
                       time_limit_ms="count")
    if bad:
        print(f"fanin sim background: {bad}", file=sys.stderr)
        return 2
    try:
        hosts = len(load_topology(args.topology).hosts)
    except ValueError as e:
        print(f"fanin sim background: --topology {args.topology}: {e}", file=sys.stderr)
        return 2
    if args.workers > hosts:
        print(f"fanin sim background: --workers {args.workers} is out of range: {args.topology} has {hosts} hosts "
              "(give fewer workers than hosts, the others carry the background)", file=sys.stderr)
        return 2
    common = ["--topology", args.topology, "--workers", str(args.workers), "--spread", "--size", str(args.size),
              "--queue-pkts", str(args.queue_pkts), "--time-limit-ms", str(args.time_limit_ms), "--no-plot"]
    if args.trimming:
        common += ["--trimming", args.trimming]
    arms = dict(ARMS) if args.no_ring else {**ARMS, "ring": []}
    seeds = range(args.seed, args.seed + args.seeds)
    rows = []
    failed = []
    for load in args.loads:
        bg = ["--background-load", str(load)] if load > 0 else []
        row: dict = {"background_load": load, "arms": {}}
        for arm, extra in arms.items():
            runs = []
            for seed in seeds:
                out = os.path.join(args.out, f"L{load:g}", arm, f"s{seed}")
                print(f"fanin sim background: load {load:g}, {arm}, seed {seed}", file=sys.stderr)
                run = _one_run(binary, common + bg + extra + ["--seed", str(seed), "--out", out], seed,
                               "ring" if arm == "ring" else "fanin")
                if arm != "ring" and not (run["finished"] and run["exact"]):
                    failed.append(f"{arm} at load {load:g}, seed {seed} ({out})")
                runs.append(run)
            row["arms"][arm] = _aggregate(runs)
        ring = row["arms"].get("ring")
        if ring and ring["finished"] == ring["runs"]:
            row["speedup_over_ring"] = {arm: ring["completion_us"] / row["arms"][arm]["completion_us"]
                                        for arm in ARMS if row["arms"][arm]["completion_us"]}
        rows.append(row)
    table = {"bench": "sim-background", "topology": args.topology, "workers": args.workers,
             "size_elements": args.size, "seeds": list(seeds), "queue_pkts": args.queue_pkts,
             "trimming": args.trimming, "time_limit_ms": args.time_limit_ms, "rows": rows}
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
    if failed:
        print("fanin sim background: fanin did not finish exact in: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def _write(out: str, table: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "background.json"), "w") as f:
        json.dump(table, f)
    with open(os.path.join(out, "background.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["background_load", "arm", "seed", "finished", "completion_us", "fraction_of_line_rate", "exact",
                    "retransmissions", "queue_drops", "trims"])
        for row in table["rows"]:
            for arm, a in row["arms"].items():
                for r in a["per_seed"]:
                    w.writerow([row["background_load"], arm, r["seed"], r["finished"], r.get("completion_us"),
                                r.get("goodput_fraction_of_line_rate"), r.get("exact"), r.get("retransmissions"),
                                r.get("queue_drops"), r.get("trims")])


def _cell(a: Optional[dict]) -> str:
    if a is None:
        return "-"
    if a["completion_us"] is None:
        return f"none of {a['runs']} done"
    cell = f"{a['completion_us']:.1f} ({a['goodput_fraction_of_line_rate']:.2f})"
    if a["runs"] > 1:
        cell += f" max {a['completion_us_max']:.1f}"
    if a["finished"] < a["runs"]:
        cell += f" {a['runs'] - a['finished']} unfinished"
    return cell


def _summary(table: dict) -> None:
    arms = [*ARMS, "ring"]
    many = len(table["seeds"]) > 1
    unit = "median µs (fraction of line rate), slowest seed" if many else "µs (fraction of line rate)"
    width = 32 if many else 16
    print(f"{'load':>6} " + " ".join(f"{a:>{width}}" for a in arms) + f"   ({unit})", file=sys.stderr)
    for row in table["rows"]:
        cells = [_cell(row["arms"].get(arm)) for arm in arms]
        print(f"{row['background_load']:>6g} " + " ".join(f"{c:>{width}}" for c in cells), file=sys.stderr)


def _plot(out: str, table: dict) -> str:
    from fanin_bench.sim.plots import _plt, _save

    plt = _plt()
    loads = [r["background_load"] for r in table["rows"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for arm in [*ARMS, "ring"]:
        pts = [(r["background_load"], r["arms"][arm]) for r in table["rows"]
               if arm in r["arms"] and r["arms"][arm]["completion_us"] is not None]
        if not pts:
            continue
        xs = [100 * x for x, _ in pts]
        med = [a["completion_us"] for _, a in pts]
        a1.errorbar(xs, med, yerr=[[m - a["completion_us_min"] for m, (_, a) in zip(med, pts)],
                                   [a["completion_us_max"] - m for m, (_, a) in zip(med, pts)]],
                    marker="o", capsize=3, label=arm)
        frac = [a["goodput_fraction_of_line_rate"] for _, a in pts]
        a2.errorbar(xs, frac, yerr=[[f - a["goodput_fraction_min"] for f, (_, a) in zip(frac, pts)],
                                    [0.0] * len(pts)], marker="o", capsize=3, label=arm)
    a1.set_yscale("log")
    a1.set_xlabel("background load (% of each tenant host's link rate)")
    a1.set_ylabel("completion time (µs, last worker)")
    seeds = table["seeds"]
    a1.set_title(f"allreduce on {table['topology']}, {table['workers']} workers"
                 + (f", median of {len(seeds)} seeds (bars: range)" if len(seeds) > 1 else ""))
    a2.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="target 0.9")
    a2.set_xlabel("background load (% of each tenant host's link rate)")
    a2.set_ylabel("tensor bytes / (link rate x completion)")
    a2.set_ylim(0, 1)
    a2.set_title("fraction of line rate")
    for ax in (a1, a2):
        ax.set_xticks([100 * x for x in loads])
        ax.legend()
    return _save(plt, fig, os.path.join(out, "background.png"))
