"""Straggler mitigation benchmarks, through the real daemon (Trio §6.2).

* ``straggler-recovery`` (Trio Fig. 14): one member of the job never sends;
  for each timeout the others stream back-to-back blocks and measure, per
  block, the time from its first transmission to its (partial) result. Run
  with the detector configured as Trio's single REF flag (``checks=1``) and
  as fanin's default (``checks=4``) side by side.
* ``straggler-iterations`` (Trio Fig. 13): worker processes run iterations
  of compute + allreduce under the Slow Worker Pattern; fanin with
  mitigation vs fanin without (everyone waits, as in SwitchML) vs an ideal
  run without stragglers, all in one run.
"""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from fanin.proc import SwitchProcess, worker_inputs
from fanin.switch import job_config, switch_config
from fanin_bench.plotting import save_figure

JOB = 1


# ---------------------------------------------------------------- recovery

def _recovery_point(timeout_ms: int, checks: int, rounds: int, blocks: int, epp: int,
                    scanner_threads: bool = False) -> dict[str, Any]:
    """Two active workers and one silent member; `rounds` allreduces of
    `blocks` back-to-back blocks each. `scanner_threads`: the scanners run as timer
    threads of their own (Trio's design) instead of on the shard thread."""
    from fanin import Session

    job = job_config(JOB, members=[0, 1, 2], block_cnt_max=max(blocks, 8), block_grad_max=epp,
                     block_exp_ms=timeout_ms, slow_after_windows=0)
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", checks=checks,
                        scanner_threads=scanner_threads, jobs=[job])
    with SwitchProcess(cfg) as sw:
        inputs = [worker_inputs(r, blocks * epp, "int32") for r in (0, 1)]
        expected = (inputs[0].astype(np.int64) + inputs[1]).astype(np.int32)
        samples: list[list[tuple[float, float]]] = [[], []]
        errors: list[str] = []

        def worker(i: int) -> None:
            try:
                # a session belongs to the thread that made it
                sess = Session(sw.data_addr, JOB, i, elems_per_packet=epp, window=blocks)
                for _ in range(rounds):
                    out = sess.allreduce(inputs[i])
                    st = sess.last_stats
                    if not np.array_equal(out, expected):
                        errors.append(f"worker {i}: the partial result is not the sum of the two active workers")
                    if st["min_src_cnt"] != 2 or len(st["degraded_blocks"]) != blocks:
                        errors.append(f"worker {i}: expected {blocks} degraded blocks of src_cnt 2, got {st}")
                    samples[i].append((st["latency_mean_ms"], st["latency_max_ms"]))
            except BaseException as e:  # reported below
                errors.append(f"worker {i}: {type(e).__name__}: {e}")

        done = threading.Event()

        def silent() -> None:
            # the third member joins (a job's round starts only when every
            # member has, docs/protocol.md 4.12) and then never sends
            try:
                Session(sw.data_addr, JOB, 2, elems_per_packet=epp, window=blocks)
                done.wait(600)
            except BaseException as e:  # reported below
                errors.append(f"silent member: {type(e).__name__}: {e}")

        quiet = threading.Thread(target=silent)
        quiet.start()
        threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        quiet.join()
        counters = sw.counters()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    means = [m for s in samples for m, _ in s]
    maxes = [x for s in samples for _, x in s]
    mean = statistics.mean(means)
    return {
        "timeout_ms": timeout_ms,
        "checks": checks,
        "scanners": "threads" if scanner_threads else "shard",
        "rounds": rounds,
        "blocks_per_round": blocks,
        "latency_mean_ms": mean,
        "latency_max_ms": max(maxes),
        "ratio_mean": mean / timeout_ms,
        "ratio_max": max(maxes) / timeout_ms,
        "blocks_aged": counters.get("blocks_aged", 0),
        "late": counters.get("late", 0),
    }


def run_recovery(args: Any) -> int:
    timeouts = [1, 2, 5, 10, 20, 50]
    rounds = 5 if args.quick else 20
    blocks, epp = 20, 256  # Trio sends 20 back-to-back packets
    # Trio's single flag, fanin's default, and the default with the
    # scanners as timer threads of their own
    grid = [(t, c, th) for t in timeouts for c, th in ((1, False), (4, False), (4, True))]
    points = []
    for t, c, th in _bar(grid, "straggler-recovery"):
        points.append(_recovery_point(t, c, rounds, blocks, epp, th))
    fanin = [p for p in points if p["checks"] == 4 and p["scanners"] == "shard"]
    met = all(p["ratio_mean"] <= 1.5 for p in fanin)
    met_max = all(p["ratio_max"] <= 1.5 for p in fanin)
    result = {
        "bench": "straggler-recovery",
        "points": points,
        "target": "time to the partial result <= 1.5 x timeout at every point (fanin default checks=4)",
        "target_met_mean": met,
        "target_met_max": met_max,
    }
    paths = _write(args.out, "straggler-recovery", points)
    _plot_recovery(points, paths["png"])
    result.update(paths)
    lines = [f"  timeout {p['timeout_ms']:3d} ms, checks {p['checks']}, scanners on {p['scanners']:7}: "
             f"mean {p['latency_mean_ms']:7.2f} ms "
             f"({p['ratio_mean']:.2f}x), max {p['latency_max_ms']:7.2f} ms ({p['ratio_max']:.2f}x)" for p in points]
    human = (f"straggler-recovery: target (mean <= 1.5x timeout) {'met' if met else 'NOT met'}, "
             f"max <= 1.5x {'met' if met_max else 'NOT met'}; wrote {paths['csv']} and {paths['png']}")
    _emit(args, result, lines, human)
    return 0


def _plot_recovery(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    arms = ((1, "shard", "Trio's single REF flag (checks=1)"), (4, "shard", "fanin default (checks=4)"),
            (4, "threads", "checks=4, scanners as timer threads"))
    for checks, where, label in arms:
        ps = [p for p in points if p["checks"] == checks and p.get("scanners", "shard") == where]
        if not ps:
            continue
        t = [p["timeout_ms"] for p in ps]
        ax.errorbar(t, [p["latency_mean_ms"] for p in ps],
                    yerr=[[0] * len(ps), [p["latency_max_ms"] - p["latency_mean_ms"] for p in ps]],
                    marker="o", capsize=3, label=label)
    t = sorted({p["timeout_ms"] for p in points})
    ax.plot(t, t, "k--", lw=1, label="timeout")
    ax.plot(t, [1.5 * x for x in t], "r:", lw=1, label="1.5 x timeout (target)")
    ax.plot(t, [2 * x for x in t], color="grey", ls=":", lw=1, label="2 x timeout (Trio)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("timeout block_exp (ms)")
    ax.set_ylabel("send to partial result (ms; bar = max)")
    ax.set_title("Straggler recovery, one silent worker (cf. Trio Fig. 14)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------- iterations

def _straggle_schedule(seed: int, iters: int, workers: int, p: float, typical_s: float) -> list[list[Optional[tuple[int, float]]]]:
    """The Slow Worker Pattern (Trio §6.1, after FlexRR): three delay points
    per iteration; at each, with probability p, one worker (uniform) sleeps
    U(0.5, 2) x the typical iteration time. Returns, per iteration, the
    (worker, seconds) event or None of each delay point. The same seed gives
    the same schedule in every arm."""
    rng = np.random.default_rng([seed, 0x5107])
    schedule = []
    for _ in range(iters):
        points: list[Optional[tuple[int, float]]] = []
        for _point in range(3):
            hit = rng.random() < p
            who = int(rng.integers(workers))
            length = float(rng.uniform(0.5, 2.0)) * typical_s
            points.append((who, length) if hit else None)
        schedule.append(points)
    return schedule


def _busy(seconds: float) -> None:
    """A straggling worker keeps its core busy (a slowed-down worker is still
    working). Sleeping instead would hand its CPU to the others, which on a
    2-core machine would make degraded iterations look faster than ideal."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _iter_worker(rank: int, switch: str, elements: int, iters: int, compute_s: float,
                 schedule: list[list[Optional[tuple[int, float]]]], results: Any) -> None:
    try:
        from fanin import Session

        sess = Session(switch, JOB, rank, dead_after_s=120.0)
        x = worker_inputs(rank, elements, "float32")
        sess.allreduce(np.zeros(1, dtype=np.float32))  # everyone starts together
        rows = []
        for i in range(iters):
            t0 = time.perf_counter()
            own = 0.0
            for event in schedule[i]:  # compute in thirds, a delay point before each
                if event is not None and event[0] == rank:
                    _busy(event[1])
                    own += event[1]
                time.sleep(compute_s / 3)
            sess.allreduce(x, average=True)
            st = sess.last_stats
            rows.append({"iter": i, "wall_s": time.perf_counter() - t0, "own_delay_s": own,
                         "min_src_cnt": st["min_src_cnt"], "missed_blocks": st["missed_blocks"],
                         "degraded_blocks": len(st["degraded_blocks"])})
            if rank == 0:
                results.put({"progress": 1})
        results.put({"rank": rank, "ok": True, "rows": rows})
    except BaseException as e:
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def _run_arm(arm: str, p: float, workers: int, elements: int, iters: int, compute_s: float, typical_s: float,
             block_exp_ms: int, seed: int, slow_after_windows: int = 2) -> dict[str, Any]:
    exp = block_exp_ms if arm == "mitigation" else 0
    job = job_config(JOB, workers, block_cnt_max=256, block_grad_max=1024, block_exp_ms=exp,
                     slow_after_windows=slow_after_windows)
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", memory_mb=1024,
                        jobs=[job])
    prob = 0.0 if arm == "ideal" else p
    schedule = _straggle_schedule(seed, iters, workers, prob, typical_s)
    ctx = mp.get_context("spawn")
    with SwitchProcess(cfg) as sw:
        results = ctx.Queue()
        procs = [ctx.Process(target=_iter_worker, args=(r, sw.data_addr, elements, iters, compute_s, schedule, results),
                             daemon=True) for r in range(workers)]
        for pr in procs:
            pr.start()
        reports = []
        deadline = time.monotonic() + 300 + iters * (10 + 6 * typical_s)
        while len(reports) < workers:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline or all(not pr.is_alive() for pr in procs):
                    raise RuntimeError(f"{arm}: workers did not report") from None
                continue
            if "progress" not in msg:
                reports.append(msg)
        for pr in procs:
            pr.join(timeout=30)
        counters = sw.counters()
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise RuntimeError("; ".join(f"{arm} worker {r['rank']}: {r['error']}" for r in failed))
    rows = [row | {"rank": r["rank"]} for r in reports for row in r["rows"]]
    in_sync = [row["wall_s"] for row in rows if row["own_delay_s"] == 0 and row["missed_blocks"] == 0]
    per_worker_total = [sum(row["wall_s"] for row in r["rows"]) for r in reports]
    return {
        "arm": arm,
        "p": prob,
        "iters": iters,
        "straggle_events": sum(e is not None for it in schedule for e in it),
        # what the job waits per iteration: workers that neither straggled
        # themselves nor were catching up (missed blocks) in that iteration
        "iteration_s": statistics.mean(in_sync) if in_sync else float("nan"),
        "iteration_excl_own_delay_s": statistics.mean(row["wall_s"] - row["own_delay_s"] for row in rows),
        "wall_per_iteration_s": statistics.mean(per_worker_total) / iters,
        "degraded_iterations": sum(row["min_src_cnt"] < workers for row in rows),
        "missed_blocks": sum(row["missed_blocks"] for row in rows),
        "blocks_aged": counters.get("blocks_aged", 0),
        "declared_slow": counters.get("declared_slow", 0),
        "readmitted": counters.get("readmitted", 0),
    }


def run_iterations(args: Any) -> int:
    workers = args.workers
    elements = 2_000_000 if args.quick else 25_000_000
    iters = args.iters or (10 if args.quick else 20)
    probs = args.probs or ([0.16] if args.quick else [0.0, 0.04, 0.08, 0.16, 0.32])
    compute_s = args.compute_ms / 1e3
    # the ideal run first: it defines the typical iteration time
    k = args.slow_after_windows
    ideal = _run_arm("ideal", 0.0, workers, elements, iters, compute_s, 1.0, args.block_exp_ms, args.seed, k)
    typical = ideal["iteration_s"]
    points = [ideal]
    arms = args.arms or ["mitigation", "none"]
    grid = [(arm, p) for p in probs for arm in arms]
    for arm, p in _bar(grid, "straggler-iterations"):
        points.append(_run_arm(arm, p, workers, elements, iters, compute_s, typical, args.block_exp_ms, args.seed, k))
    for pt in points:
        pt["vs_ideal"] = pt["iteration_s"] / typical
    summary = []
    for p in probs if len(arms) == 2 else []:
        m = next(x for x in points if x["arm"] == "mitigation" and x["p"] == p)
        n = next(x for x in points if x["arm"] == "none" and x["p"] == p)
        summary.append({"p": p, "mitigation_vs_ideal": m["vs_ideal"], "none_vs_ideal": n["vs_ideal"],
                        "speedup_over_no_mitigation": n["iteration_s"] / m["iteration_s"]})
    at16 = next((s for s in summary if abs(s["p"] - 0.16) < 1e-9), None)
    met = at16 is not None and at16["mitigation_vs_ideal"] <= 1.15
    result = {"bench": "straggler-iterations", "workers": workers, "elements": elements,
              "compute_ms": args.compute_ms, "block_exp_ms": args.block_exp_ms, "slow_after_windows": k,
              "typical_iteration_s": typical,
              "points": points, "summary": summary,
              "target": "with mitigation within 1.15x of ideal at p = 16%", "target_met": met}
    paths = _write(args.out, "straggler-iterations", points)
    _plot_iterations(points, probs, typical, paths["png"])
    result.update(paths)
    lines = [f"  p {s['p']:.2f}: mitigation {s['mitigation_vs_ideal']:.2f}x ideal, no mitigation "
             f"{s['none_vs_ideal']:.2f}x, speed-up {s['speedup_over_no_mitigation']:.2f}x" for s in summary]
    human = (f"straggler-iterations: ideal iteration {typical * 1e3:.0f} ms; target (<= 1.15x ideal at p=16%) "
             f"{'met' if met else 'NOT met'}; wrote {paths['csv']} and {paths['png']}")
    _emit(args, result, lines, human)
    return 0


def _plot_iterations(points: list[dict[str, Any]], probs: list[float], typical: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    pct = [p * 100 for p in probs]
    for arm, label in (("mitigation", "fanin, straggler mitigation"), ("none", "fanin, no mitigation (SwitchML)")):
        found = [next((x for x in points if x["arm"] == arm and x["p"] == p), None) for p in probs]
        if all(found):
            ax.plot(pct, [x["iteration_s"] * 1e3 for x in found], marker="o", label=label)
    ax.axhline(typical * 1e3, color="k", ls="--", lw=1, label="ideal (no stragglers)")
    ax.set_xlabel("straggling probability p (%)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("Iteration time under the Slow Worker Pattern (cf. Trio Fig. 13)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------- helpers

def _bar(items: list[Any], label: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=label, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return items


def _write(out: str, name: str, points: list[dict[str, Any]]) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, f"{name}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(points)
    return {"csv": csv_path, "png": os.path.join(out, f"{name}.png")}


def _emit(args: Any, result: dict[str, Any], lines: list[str], human: str) -> None:
    if args.json:
        print(json.dumps(result))
        print(human, file=sys.stderr)
    else:
        for line in lines:
            print(line)
        print(human)
