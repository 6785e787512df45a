"""Curves like Trio's Figs 15 and 16, measured through the real daemon with
the NoAggr baseline beside each point.

* epp-sweep (Fig. 15): window 1, so one block is in flight per worker; the
  per-block latency is the time per block of a long allreduce.
* window-sweep (Fig. 16): 512 and 1024 elements per packet; throughput and
  per-block latency as the window grows.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Any

from fanin_bench.bench.runner import AllreduceParams, run_allreduce
from fanin_bench.plotting import save_figure


def _point(workers: int, epp: int, window: int, blocks: int, iters: int, seed: int) -> dict[str, Any]:
    p = AllreduceParams(workers=workers, elements=epp * blocks, dtype="int32", elems_per_packet=epp, window=window,
                        iters=iters, seed=seed, progress=False)
    s = run_allreduce(p).summary()
    per_block = lambda t: t / blocks * 1e6  # noqa: E731
    return {
        "elems_per_packet": epp,
        "window": window,
        "blocks": blocks,
        "latency_us": per_block(s["median_s"]) * window,  # time a block spends in flight
        "noaggr_latency_us": per_block(s["noaggr_median_s"]) * window,
        "goodput_gbps": s["goodput_gbps"],
        "noaggr_goodput_gbps": s["size_bytes"] * 8 / s["noaggr_median_s"] / 1e9,
        "ratio_vs_noaggr": s["ratio_vs_noaggr"],
        "verified": s["verified"],
        "retransmissions": s["retransmissions"],
    }


def run_sweep(args: Any) -> int:
    quick = args.quick
    points: list[dict[str, Any]] = []
    if args.sweep == "epp-sweep":
        epps = [64, 256, 1024, 4096] if quick else [64, 128, 256, 512, 1024, 2048, 4096, 8192]
        grid = [(e, 1) for e in epps]
        blocks = 300 if quick else 1000
    else:
        windows = [1, 4, 16, 64, 256] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        grid = [(e, w) for e in (512, 1024) for w in windows]
        blocks = 2000 if quick else 8000
    try:
        from tqdm import tqdm

        it = tqdm(grid, desc=args.sweep, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        it = grid
    for epp, window in it:
        points.append(_point(args.workers, epp, window, max(blocks, window * 4), 3 if quick else 5, args.seed))
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{args.sweep}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(points)
    png_path = os.path.join(args.out, f"{args.sweep}.png")
    _plot(args.sweep, points, png_path, args.workers)
    result = {"sweep": args.sweep, "workers": args.workers, "csv": csv_path, "png": png_path, "points": points}
    human = f"{args.sweep}: {len(points)} points, all verified={all(p['verified'] for p in points)}; wrote {csv_path} and {png_path}"
    if args.json:
        print(json.dumps(result))
        print(human, file=sys.stderr)
    else:
        for p in points:
            print(f"  epp {p['elems_per_packet']:5d} window {p['window']:5d}: latency {p['latency_us']:9.1f} us "
                  f"(NoAggr {p['noaggr_latency_us']:9.1f}), goodput {p['goodput_gbps']:.2f} Gbit/s "
                  f"(NoAggr {p['noaggr_goodput_gbps']:.2f})")
        print(human)
    return 0


def _plot(sweep: str, points: list[dict[str, Any]], path: str, workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep == "epp-sweep":
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [p["elems_per_packet"] for p in points]
        ax.plot(x, [p["latency_us"] for p in points], "o-", label="fanin (aggregation)")
        ax.plot(x, [p["noaggr_latency_us"] for p in points], "s--", label="NoAggr (forwarding)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements per packet")
        ax.set_ylabel("per-block latency (us)")
        ax.set_title(f"Aggregation latency, window 1, {workers} workers (cf. Trio Fig. 15)")
        ax.legend()
    else:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for epp, marker in ((512, "o"), (1024, "s")):
            pts = [p for p in points if p["elems_per_packet"] == epp]
            x = [p["window"] for p in pts]
            a1.plot(x, [p["latency_us"] for p in pts], marker + "-", label=f"fanin-{epp}")
            a2.plot(x, [p["goodput_gbps"] for p in pts], marker + "-", label=f"fanin-{epp}")
            a2.plot(x, [p["noaggr_goodput_gbps"] for p in pts], marker + ":", alpha=0.6, label=f"NoAggr-{epp}")
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xlabel("window (blocks in flight)")
            a.legend()
        a1.set_ylabel("per-block latency (us)")
        a2.set_ylabel("goodput per worker (Gbit/s)")
        fig.suptitle(f"Latency and throughput vs window, {workers} workers (cf. Trio Fig. 16)")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
