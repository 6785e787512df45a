"""``fanin bench overload``: allreduce through an overloaded switch, with and
without trimming, and with marking, side by side in one run (issue 7, item
6; issue 28).

Three switch processes run at once with the same configuration except
``[trim]``: the *drop* arm (an overflowing receive queue loses datagrams
silently; workers find out by fast retransmit or their stall timer), the
*trim* arm (above the watermark, data contributions come back as
header-only Trimmed nacks; workers resend at once and halve their window)
and the *mark* arm (above half the watermark, contributions are aggregated
as usual and their blocks' results marked congested, ATP's switch-side
ECN: every member cuts its window at the marked result, nothing is
discarded or resent). Every worker process holds one session per arm and alternates the
arms iteration by iteration (order reversed every other iteration), so both
see the same machine noise. Overload comes from many workers with full
windows of 4 KiB datagrams converging on one shard whose receive buffer is
deliberately small.

Reported per arm: completion time of each allreduce (the slowest worker's),
and the switch's ``socket_drops`` (kernel drops: the silent losses),
``trimmed`` and the workers' retransmissions, all over the whole run (both
arms do exactly the same allreduces). Ratios are trim / drop and mark /
drop.
"""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import sys
import time
from typing import Any

import numpy as np

from fanin.proc import SwitchProcess, check_result, worker_inputs
from fanin.switch import job_config, switch_config
from fanin_bench.plotting import save_figure

JOB = 1
ARMS = ("drop", "trim", "mark")


def _worker(rank: int, addrs: dict[str, str], point: dict[str, Any], iters: int, results: Any) -> None:
    try:
        from fanin import Session

        sessions = {arm: Session(addrs[arm], JOB, rank, elems_per_packet=point["elems_per_packet"],
                                 window=point["window"]) for arm in ARMS}
        x = worker_inputs(rank, point["elements"], "int32")
        sync = np.zeros(1, dtype=np.int32)
        report: dict[str, Any] = {"rank": rank, "ok": True, "checks": {}}
        for arm in ARMS:  # correctness first, outside the timed loop
            report["checks"][arm] = check_result(sessions[arm].allreduce(x), point["workers"], "int32",
                                                 point["elems_per_packet"])
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        retrans = {arm: 0 for arm in ARMS}
        trimmed = {arm: 0 for arm in ARMS}
        for i in range(iters):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                s = sessions[arm]
                s.allreduce(sync)  # barrier: everyone starts together
                t0 = time.perf_counter()
                s.allreduce(x)
                times[arm].append(time.perf_counter() - t0)
                st = s.last_stats
                retrans[arm] += st["retransmissions"]
                trimmed[arm] += st["trimmed"]
        report.update(times=times, retransmissions=retrans, trimmed=trimmed)
        results.put(report)
    except BaseException as e:  # reported to the parent, which fails the run
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def run_point(point: dict[str, Any], iters: int, seed: int = 1) -> dict[str, Any]:
    """One load point: both switches, `workers` processes, `iters` timed
    allreduces per arm. Raises if a worker fails or a result is wrong."""
    job = job_config(JOB, point["workers"], block_cnt_max=point["window"], block_grad_max=point["elems_per_packet"])
    switches = {}
    try:
        for arm in ARMS:
            cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0",
                                memory_mb=512, seed=seed, trim=(arm == "trim"),
                                trim_watermark=point["watermark"], socket_buffer=point["socket_buffer"], jobs=[job],
                                mark_watermark=point["watermark"] / 2 if arm == "mark" else None)
            switches[arm] = SwitchProcess(cfg)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        addrs = {arm: sw.data_addr for arm, sw in switches.items()}
        procs = [ctx.Process(target=_worker, args=(r, addrs, point, iters, results), daemon=True)
                 for r in range(point["workers"])]
        for pr in procs:
            pr.start()
        reports = []
        deadline = time.monotonic() + 120 + iters * 60
        while len(reports) < point["workers"]:
            try:
                reports.append(results.get(timeout=1.0))
            except queue_mod.Empty:
                if time.monotonic() > deadline or all(not pr.is_alive() for pr in procs):
                    raise RuntimeError("overload bench: workers did not report") from None
        for pr in procs:
            pr.join(timeout=30)
        counters = {arm: sw.counters() for arm, sw in switches.items()}
    finally:
        for sw in switches.values():
            sw.stop()
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise RuntimeError("; ".join(f"worker {r['rank']}: {r['error']}" for r in failed))
    bad = [(r["rank"], arm) for r in reports for arm, c in r["checks"].items() if not c["ok"]]
    if bad:
        raise RuntimeError(f"overload bench: wrong results (rank, arm): {bad}")
    out: dict[str, Any] = dict(point, iters=iters, verified=True)
    for arm in ARMS:
        # an allreduce ends when the slowest worker has its result
        t = [max(r["times"][arm][i] for r in reports) for i in range(iters)]
        c = counters[arm]
        out[arm] = {
            "median_s": statistics.median(t),
            "times_s": t,
            "socket_drops": c.get("socket_drops", 0),
            "trimmed": c.get("trimmed", 0),
            "worker_trims_acted_on": sum(r["trimmed"][arm] for r in reports),
            "retransmissions": sum(r["retransmissions"][arm] for r in reports),
            "switch_retransmissions_seen": c.get("retransmissions", 0),
            "queue_marked": c.get("queue_marked", 0),
            "blocks_marked": c.get("congestion_marked", 0),
        }
    d, tr = out["drop"], out["trim"]
    out["ratio_time_trim_vs_drop"] = tr["median_s"] / d["median_s"]
    out["ratio_drops_trim_vs_drop"] = tr["socket_drops"] / d["socket_drops"] if d["socket_drops"] else None
    out["ratio_retransmissions_trim_vs_drop"] = (tr["retransmissions"] / d["retransmissions"]
                                                 if d["retransmissions"] else None)
    m = out["mark"]
    out["ratio_time_mark_vs_drop"] = m["median_s"] / d["median_s"]
    out["ratio_time_mark_vs_trim"] = m["median_s"] / tr["median_s"]
    return out


def points_for(args: Any) -> list[dict[str, Any]]:
    """One point per (receive buffer, window). The buffer sets the overload:
    4 workers x 256 blocks of 4 KiB is a ~4 MiB burst, against a buffer the
    kernel doubles; 4 MiB is not overloaded, 1 MiB and 512 KiB are."""
    buffers = args.socket_buffers or ([1 << 20] if args.quick else [4 << 20, 1 << 20, 512 << 10])
    windows = args.windows or [256]
    size = args.size or 4_000_000
    return [{"workers": args.workers, "window": w, "elements": size // 4, "elems_per_packet": 1024,
             "socket_buffer": b, "watermark": args.watermark} for b in buffers for w in windows]


def run_overload(args: Any) -> int:
    iters = args.iters or (3 if args.quick else 7)
    if not 1 <= args.workers <= 64:
        raise ValueError(f"--workers {args.workers} is out of range (1..64)")
    if not 0.0 <= args.watermark < 1.0:
        raise ValueError(f"--watermark {args.watermark} is out of range: a fraction of the receive buffer in 0.0..1.0")
    if iters < 1:
        raise ValueError("--iters must be at least 1")
    points = [run_point(p, iters, args.seed) for p in _bar(points_for(args))]
    paths = _write_csv(args.out, points)
    _plot(points, paths["png"])
    result = {"bench": "overload", "points": points, **paths}
    lines = []
    for p in points:
        d, t, m = p["drop"], p["trim"], p["mark"]
        lines.append(
            f"  {p['workers']} workers, window {p['window']}, buffer {p['socket_buffer'] >> 10} KiB, "
            f"{p['elements'] * 4 / 1e6:.0f} MB: "
            f"drop {d['median_s'] * 1e3:.0f} ms ({d['socket_drops']} kernel drops, {d['retransmissions']} retx) | "
            f"trim {t['median_s'] * 1e3:.0f} ms ({t['socket_drops']} kernel drops, {t['trimmed']} trimmed, "
            f"{t['retransmissions']} retx) | mark {m['median_s'] * 1e3:.0f} ms ({m['socket_drops']} kernel drops, "
            f"{m['queue_marked']} marked, {m['retransmissions']} retx) | time trim/drop "
            f"{p['ratio_time_trim_vs_drop']:.2f}, mark/drop {p['ratio_time_mark_vs_drop']:.2f}")
    human = f"overload: wrote {paths['csv']} and {paths['png']}"
    if args.json:
        print(json.dumps(result))
        for line in lines:
            print(line, file=sys.stderr)
        print(human, file=sys.stderr)
    else:
        print("\n".join(lines + [human]))
    return 0


def _write_csv(out: str, points: list[dict[str, Any]]) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "overload.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workers", "window", "socket_buffer", "elements", "arm", "median_s", "times_s", "socket_drops", "trimmed",
                    "queue_marked", "retransmissions"])
        for p in points:
            for arm in ARMS:
                a = p[arm]
                w.writerow([p["workers"], p["window"], p["socket_buffer"], p["elements"], arm, f"{a['median_s']:.6f}",
                            " ".join(f"{x:.6f}" for x in a["times_s"]), a["socket_drops"], a["trimmed"],
                            a["queue_marked"], a["retransmissions"]])
    return {"csv": path, "png": os.path.join(out, "overload.png")}


def _plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"buffer {p['socket_buffer'] >> 10} KiB\nwindow {p['window']}" for p in points]
    xs = np.arange(len(points))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = {"drop": "drop-tail (trimming off)", "trim": "trimming on", "mark": "marking (ECN at the switch)"}
    for k, (arm, colour) in enumerate((("drop", "tab:red"), ("trim", "tab:blue"), ("mark", "tab:green"))):
        med = [p[arm]["median_s"] * 1e3 for p in points]
        lo = [m - min(p[arm]["times_s"]) * 1e3 for m, p in zip(med, points)]
        hi = [max(p[arm]["times_s"]) * 1e3 - m for m, p in zip(med, points)]
        ax1.bar(xs + (k - 1) * 0.27, med, 0.27, yerr=[lo, hi], capsize=3, color=colour, label=names[arm])
        ax2.bar(xs + (k - 1) * 0.27, [p[arm]["socket_drops"] for p in points], 0.27, color=colour,
                label=f"{arm}: kernel drops")
    ax2.bar(xs, [p["trim"]["trimmed"] for p in points], 0.27, color="none", edgecolor="black", hatch="//",
            label="trim: trimmed (returned to sender)")
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels)
    ax1.set_yscale("log")  # the drop arm's tail is orders of magnitude longer
    ax1.set_ylabel("allreduce completion (ms, log; median, bar = min..max)", fontsize=8)
    ax2.set_ylabel("datagrams over the run")
    w = points[0]["workers"]
    ax1.set_title(f"{w} workers, one shard; smaller buffer = more overload", fontsize=9)
    ax2.set_title("silent kernel drops vs trims", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _bar(items: list[Any]) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(items, desc="overload", file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return items
