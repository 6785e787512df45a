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

  The headline ``iteration_s`` is the job's iteration time, the quantity
  Trio-ML's Fig. 13 compares across arms: how fast the training job gets
  through an iteration. No one can speed up a straggler's own delay; what
  mitigation changes is whether the others wait for it. So per iteration
  it is the wall time of the slowest worker that the schedule did not delay
  in that iteration (from the start of its compute to the end of its
  allreduce), averaged over the iterations. Which workers count is the
  schedule's choice, the same in every arm, never the outcome's: without
  mitigation the on-time workers wait for the straggler inside the
  allreduce, with it they wait for the timeout and carry on with a partial
  sum, and a worker catching up on an earlier delay counts as it is. (Only
  where the schedule delayed every worker, which takes N <= 3, the fastest
  worker's time stands in; ``iterations_all_straggled`` counts those.) The
  fraction of the contributions the results left out
  (``contributions_dropped_fraction``) is reported beside it, as is the
  former figure, a mean over worker iterations without own delay or missed
  blocks (``iteration_in_sync_mean_s``): secondary, because it is selected
  by outcome (only the mitigation arm can miss blocks, so it drops exactly
  that arm's slow iterations).

  Results are checked (``_Results``): the untimed warm-up's, and three
  timed ones per worker and arm (the first, middle and last iteration),
  copied in the loop (a memcpy, taken from the next compute's sleep;
  ``check_overrun_s`` says whether it ever did not fit) and checked after
  it: each block bit for bit against the values already seen for it, a
  value not seen before against the block floating point bound of the sum
  over as many workers' inputs as the block summed (partial sums
  included); a missed block must be zero. (Checking every result in the
  loop took more CPU than the compute's sleep leaves on 2 cores: the
  checking workers fell behind, the mitigation arm aged their blocks, and
  the benchmark measured its own checks.) A wrong result fails the run
  before any figure is reported. At every p the ideal and both arms each
  run the first half of the iterations, then the second half in the
  reverse order (arms cannot alternate per iteration: each has its own
  switch, and a straggler's lag carries from one iteration to the next).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np

from fanin.proc import SwitchProcess, float_error_bound, worker_inputs
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
        "target": "time to the partial result <= 1.5 x timeout at every point (fanin's default: checks=4, "
                  "scanners on the shard; the other rows are for comparison)",
        "target_met_mean": met,
        "target_met_max": met_max,
    }
    paths = _write(args.out, "straggler-recovery", points)
    _plot_recovery(points, paths["png"])
    result.update(paths)
    lines = [f"  timeout {p['timeout_ms']:3d} ms, checks {p['checks']}, scanners on {p['scanners']:7}: "
             f"mean {p['latency_mean_ms']:7.2f} ms "
             f"({p['ratio_mean']:.2f}x), max {p['latency_max_ms']:7.2f} ms ({p['ratio_max']:.2f}x)" for p in points]
    human = (f"straggler-recovery: target for fanin's default (checks=4, scanners on the shard; the checks=1 and "
             f"timer-thread rows are for comparison): mean <= 1.5x timeout {'met' if met else 'NOT met'}, "
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

#: The job's largest block: on loopback (MTU 65536) also the packet size
#: every session takes, so a block of the result is this many elements.
BLOCK_GRAD_MAX = 1024
_EPS32 = float(np.finfo(np.float32).eps)
#: What `iteration_s` is (also in the JSON).
ITERATION_DEFINITION = ("per iteration, the wall time of the slowest worker that the schedule did not delay in that "
                        "iteration (from the start of its compute to the end of its allreduce), averaged over the "
                        "iterations; where the schedule delayed every worker, the fastest worker's wall time")


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


class _Results:
    """One worker's allreduce results (means: each block divided by the
    sources it summed), checked with no float64 work between iterations.

    Each block is compared bit for bit with the values kept so far for that
    block and src_cnt: fanin's sum of the same inputs is the same bits every
    time, so a repeat needs nothing more. A value not seen before is kept,
    once, for `verify` after the timed loop: it must be within the block
    floating point bound (docs/protocol.md) of the sum over `src_cnt` of the
    workers' inputs, all of them for a full block (the bound of all N
    sources covers a partial sum of fewer). A missed block (src_cnt 0) must
    be zero, and an arm without aging must have no degraded block.

    All of it works on whole blocks, rows of a (blocks, epp) array:
    `buffer` gives the worker its result array with the last block padded,
    so that comparing a 25M-element result costs milliseconds."""

    def __init__(self, n: int, epp: int, workers: int, aging: bool) -> None:
        self.n, self.epp, self.workers, self.aging = n, epp, workers, aging
        self.blocks = -(-n // epp)
        # kept values: (values, held per block, src_cnt per block); a block's
        # second distinct value goes to the next layer
        self.layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.errors: list[str] = []
        self.results = 0

    def buffer(self) -> tuple[np.ndarray, np.ndarray]:
        """(the n-element result array for `out=`, the same memory as blocks)."""
        padded = np.zeros((self.blocks, self.epp), dtype=np.float32)
        return padded.reshape(-1)[:self.n], padded

    def _rows(self, out: np.ndarray) -> np.ndarray:
        if out.shape == (self.blocks, self.epp):
            return out
        padded = np.zeros(self.blocks * self.epp, dtype=np.float32)
        padded[:self.n] = out
        return padded.reshape(self.blocks, self.epp)

    def observe(self, label: str, out: np.ndarray, degraded: list[tuple[int, int]]) -> None:
        """Compare one result (n elements, or `buffer`'s blocks) with the
        values kept; keep what `verify` must check."""
        self.results += 1
        rows = self._rows(out)
        cnt = np.full(self.blocks, self.workers, dtype=np.int64)
        if degraded:
            idx, c = (np.asarray(v, dtype=np.int64) for v in zip(*degraded))
            if idx.min() < 0 or idx.max() >= self.blocks or c.max() >= self.workers:
                self.errors.append(f"{label}: degraded blocks {degraded[:4]} outside {self.blocks} blocks of "
                                   f"{self.workers} sources")
                return
            cnt[idx] = c
            if not self.aging:
                self.errors.append(f"{label}: {len(degraded)} blocks degraded in an arm without straggler aging")
        missed = np.flatnonzero(cnt == 0)
        if len(missed):
            nonzero = missed[(rows[missed] != 0).any(axis=1)]
            if len(nonzero):
                self.errors.append(f"{label}: {len(nonzero)} missed blocks (src_cnt 0) are not zero, "
                                   f"e.g. block {int(nonzero[0])}")
        pending = cnt > 0
        bits = rows.view(np.uint32)
        for values, held, kcnt in self.layers:
            same = pending & held & (kcnt == cnt)
            if same.any():
                pending &= ~(same & ~(bits != values.view(np.uint32)).any(axis=1))
        for values, held, kcnt in self.layers:
            room = pending & ~held
            if room.any():
                np.copyto(values, rows, where=room[:, None])
                held |= room
                kcnt[room] = cnt[room]
                pending &= ~room
        if pending.any():
            values = np.zeros_like(rows)
            np.copyto(values, rows, where=pending[:, None])
            self.layers.append((values, pending.copy(), np.where(pending, cnt, 0)))

    def verify(self, inputs: list[np.ndarray], bound: np.ndarray, chunk: int = 1024) -> int:
        """Check every kept value (`bound`: per block); the blocks checked."""
        checked = 0
        for values, held, kcnt in self.layers:
            for k in (int(v) for v in np.unique(kcnt[held])):
                blocks = np.flatnonzero(held & (kcnt == k))
                ok = np.zeros(len(blocks), dtype=bool)
                for subset in itertools.combinations(range(self.workers), k):
                    todo = np.flatnonzero(~ok)
                    for lo in range(0, len(todo), chunk):
                        part = todo[lo:lo + chunk]
                        ok[part] = self._within(values, blocks[part], k, subset, inputs, bound)
                    if ok.all():
                        break
                if not ok.all():
                    bad = blocks[~ok]
                    what = "the sum of every worker's input" if k == self.workers else \
                        f"the sum of any {k} of the {self.workers} workers' inputs"
                    self.errors.append(f"{len(bad)} blocks that summed {k} sources are not within the bound of "
                                       f"{what} (blocks {bad[:5].tolist()})")
                checked += len(blocks)
        return checked

    def _within(self, values: np.ndarray, blocks: np.ndarray, k: int, subset: tuple[int, ...],
                inputs: list[np.ndarray], bound: np.ndarray) -> np.ndarray:
        idx = (blocks[:, None] * self.epp + np.arange(self.epp)).ravel()
        owner = np.repeat(np.arange(len(blocks)), self.epp)
        inside = idx < self.n
        idx, owner = idx[inside], owner[inside]
        got = values.reshape(-1)[idx].astype(np.float64) * k  # the mean back to the sum it came from
        want = np.zeros(len(idx))
        for r in subset:
            want += inputs[r][idx]
        allowed = bound[blocks][owner] + np.abs(got) * _EPS32
        bad = ~(np.abs(got - want) <= allowed)  # NaN is bad
        return np.bincount(owner[bad], minlength=len(blocks)) == 0


def _reference(shared: Optional[str], workers: int, n: int, epp: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Every worker's input and the bound per block: from the files
    `_write_reference` left in `shared` (memory-mapped: one copy in the page
    cache for every worker), or computed here."""
    if shared:
        inputs = [np.load(os.path.join(shared, f"input{r}.npy"), mmap_mode="r") for r in range(workers)]
        path = os.path.join(shared, f"bound{epp}.npy")
        if os.path.exists(path):
            return inputs, np.load(path)
    else:
        inputs = [worker_inputs(r, n, "float32") for r in range(workers)]
    return inputs, float_error_bound(workers, n, epp)[::epp]


def _write_reference(shared: str, workers: int, n: int, epp: int) -> None:
    for r in range(workers):
        np.save(os.path.join(shared, f"input{r}.npy"), worker_inputs(r, n, "float32"))
    np.save(os.path.join(shared, f"bound{epp}.npy"), float_error_bound(workers, n, epp)[::epp])


def _iter_worker(rank: int, workers: int, switch: str, elements: int, first: int, compute_s: float,
                 schedule: list[list[Optional[tuple[int, float]]]], aging: bool, shared: Optional[str],
                 results: Any, barrier: Any) -> None:
    try:
        from fanin import Session

        sess = Session(switch, JOB, rank, dead_after_s=120.0)
        epp = sess.elems_per_packet
        inputs, bound = _reference(shared, workers, elements, epp)
        x = np.array(inputs[rank], dtype=np.float32)
        log = _Results(elements, epp, workers, aging)
        out, blocks = log.buffer()
        sync = np.zeros(1, dtype=np.float32)
        sess.allreduce(sync)  # everyone starts together
        # untimed warm-up: the first full result of each block, which every
        # later one is compared with
        sess.allreduce(x, average=True, out=out)
        log.observe("warm-up", blocks, list(sess.last_stats["degraded_blocks"]))
        sess.allreduce(sync)
        rows = []
        # Three timed results (the first, middle and last iteration) are
        # copied and checked in full after the loop. Checking every result
        # in the loop cost more CPU than the compute's sleep leaves on 2
        # cores: the checking workers fell behind, the mitigation arm aged
        # their blocks, and it measured the checks (65 % of contributions
        # dropped with no straggler at all).
        sample = {0, len(schedule) // 2, len(schedule) - 1}
        kept: list[tuple[str, np.ndarray, list[tuple[int, int]]]] = []
        # their memory touched now: a fresh 100 MB array's page faults in
        # the loop took longer than a compute's sleep
        spare = [np.ones_like(blocks) for _ in sample]
        copying = 0.0  # the last copy's time, taken from the next compute's sleep
        for i, events in enumerate(schedule):
            t0 = time.perf_counter()
            own, spent, debt = 0.0, copying, copying
            for event in events:  # compute in thirds, a delay point before each
                if event is not None and event[0] == rank:
                    _busy(event[1])
                    own += event[1]
                take = min(compute_s / 3, debt)
                debt -= take
                time.sleep(compute_s / 3 - take)
            sess.allreduce(x, average=True, out=out)
            wall = time.perf_counter() - t0
            st = sess.last_stats
            degraded = [(int(b), int(c)) for b, c in st["degraded_blocks"]]
            copying = 0.0
            if i in sample:
                # a memcpy (~20 ms for 25M elements), as a GPU's compute
                # would hide it: it comes out of the next compute's sleep
                c0 = time.perf_counter()
                copy = spare.pop()
                np.copyto(copy, blocks)
                kept.append((f"iteration {first + i}", copy, degraded))
                copying = time.perf_counter() - c0
            rows.append({"iter": first + i, "wall_s": wall, "own_delay_s": own,
                         "min_src_cnt": st["min_src_cnt"], "missed_blocks": st["missed_blocks"],
                         "degraded_blocks": len(degraded), "blocks": st["blocks"], "degraded": degraded,
                         "check_s": spent, "check_overrun_s": debt})
            if rank == 0:
                results.put({"progress": 1})
        for label, values, degraded in kept:
            log.observe(label, values, degraded)
        barrier.wait(timeout=600)  # the full checks only once every worker's timed loop is over
        checked = log.verify(inputs, bound)
        results.put({"rank": rank, "ok": True, "rows": rows, "result_errors": log.errors,
                     "results_checked": log.results, "blocks_verified": checked, "blocks": log.blocks})
    except BaseException as e:
        barrier.abort()
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def _run_arm(arm: str, prob: float, workers: int, elements: int, schedule: list[list[Optional[tuple[int, float]]]],
             compute_s: float, block_exp_ms: int, slow_after_windows: int = 2, first: int = 0,
             shared: Optional[str] = None) -> dict[str, Any]:
    """One arm through its own switch: iterations `first`.. of `schedule`
    (the events of those iterations). Raises if a worker failed or a result
    is wrong."""
    exp = block_exp_ms if arm == "mitigation" else 0
    job = job_config(JOB, workers, block_cnt_max=256, block_grad_max=BLOCK_GRAD_MAX, block_exp_ms=exp,
                     slow_after_windows=slow_after_windows)
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", memory_mb=1024,
                        jobs=[job])
    longest = max((e[1] for it in schedule for e in it if e is not None), default=0.0)
    ctx = mp.get_context("spawn")
    with SwitchProcess(cfg) as sw:
        results = ctx.Queue()
        barrier = ctx.Barrier(workers)
        procs = [ctx.Process(target=_iter_worker, args=(r, workers, sw.data_addr, elements, first, compute_s, schedule,
                                                        exp > 0, shared, results, barrier), daemon=True)
                 for r in range(workers)]
        for pr in procs:
            pr.start()
        reports = []
        deadline = time.monotonic() + 300 + len(schedule) * (10 + 6 * longest)
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
    wrong = [f"{arm} worker {r['rank']}: {e}" for r in reports for e in r["result_errors"]]
    if wrong:
        raise RuntimeError(f"{arm} at p = {prob}: wrong results: " + "; ".join(wrong[:6]))
    return {"arm": arm, "p": prob, "reports": reports, "counters": counters}


def _arm_point(arm: str, prob: float, runs: list[dict[str, Any]], schedule: list[list[Optional[tuple[int, float]]]],
               workers: int) -> dict[str, Any]:
    """The figures of one arm at one p, from its runs (the iterations of
    `schedule` between them). `iteration_s` is ITERATION_DEFINITION: which
    workers count in an iteration is the schedule's doing, the same in every
    arm, never the outcome's."""
    reports = [r for run in runs for r in run["reports"]]
    rows = [row | {"rank": r["rank"]} for r in reports for row in r["rows"]]
    by_iter: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_iter.setdefault(row["iter"], []).append(row)
    if sorted(by_iter) != list(range(len(schedule))) or any(len(v) != workers for v in by_iter.values()):
        raise RuntimeError(f"{arm}: {len(rows)} rows do not cover {len(schedule)} iterations of {workers} workers")
    job_s, all_straggled = [], 0
    dropped, contributions = 0, 0
    for i in sorted(by_iter):
        its = by_iter[i]
        # own_delay_s is the schedule's (the delays it gave this worker)
        on_time = [row["wall_s"] for row in its if row["own_delay_s"] == 0]
        if on_time:
            job_s.append(max(on_time))
        else:
            all_straggled += 1
            job_s.append(min(row["wall_s"] for row in its))
        # the sources each block's result summed: the most any member saw
        # (a member that missed the block saw 0)
        blocks = its[0]["blocks"]
        summed = np.zeros(blocks, dtype=np.int64)
        for row in its:
            view = np.full(blocks, workers, dtype=np.int64)
            if row["degraded"]:
                idx, c = zip(*row["degraded"])
                view[list(idx)] = c
            np.maximum(summed, view, out=summed)
        dropped += int((workers - summed).sum())
        contributions += blocks * workers
    in_sync = [row["wall_s"] for row in rows if row["own_delay_s"] == 0 and row["missed_blocks"] == 0]
    per_worker_total: dict[int, float] = {}
    for row in rows:
        per_worker_total[row["rank"]] = per_worker_total.get(row["rank"], 0.0) + row["wall_s"]
    counters: dict[str, int] = {}
    for run in runs:
        for k in ("blocks_aged", "declared_slow", "readmitted"):
            counters[k] = counters.get(k, 0) + run["counters"].get(k, 0)
    return {
        "arm": arm,
        "p": prob,
        "iters": len(schedule),
        "straggle_events": sum(e is not None for it in schedule for e in it),
        "iteration_s": statistics.mean(job_s),
        "iterations_all_straggled": all_straggled,
        # contributions (a worker's share of a block) the results left out
        "contributions_dropped_fraction": dropped / contributions,
        # secondary, selected by outcome: workers that neither straggled nor
        # missed blocks in the iteration (only the mitigation arm can miss
        # any, so its slow iterations drop out and the others' stay)
        "iteration_in_sync_mean_s": statistics.mean(in_sync) if in_sync else None,
        "iteration_in_sync_rows": len(in_sync),
        "iteration_excl_own_delay_s": statistics.mean(row["wall_s"] - row["own_delay_s"] for row in rows),
        "wall_per_iteration_s": statistics.mean(per_worker_total.values()) / len(schedule),
        "degraded_iterations": sum(row["min_src_cnt"] < workers for row in rows),
        "missed_blocks": sum(row["missed_blocks"] for row in rows),
        **counters,
        # every result compared with the verified one bit for bit, the
        # others checked against the bound (the warm-ups' included)
        "results_checked": sum(r["results_checked"] for r in reports),
        "blocks_verified": sum(r["blocks_verified"] for r in reports),
        # what the comparisons between iterations took beyond the compute
        # they run in (0: they never lengthened an iteration)
        "check_overrun_s": sum(row["check_overrun_s"] for row in rows),
    }


def _plan(probs: list[float], arms: list[str], iters: int) -> list[tuple[float, str, int, int]]:
    """(p, arm, first iteration, iterations) in running order: at every p
    the ideal and the arms each run the first half of the iterations, then
    the second half in the reverse order, so drift over the run hits them
    alike. (Arms cannot alternate per iteration: each is its own switch, and
    a straggler's lag carries over from one iteration to the next within
    an arm.)"""
    half = (iters + 1) // 2
    halves = [(0, half)] + ([(half, iters - half)] if iters > half else [])
    plan = []
    for p in probs:
        for h, (first, count) in enumerate(halves):
            order = ["ideal"] + list(arms)
            plan += [(p, arm, first, count) for arm in (order if h % 2 == 0 else order[::-1])]
    return plan


def run_iterations(args: Any) -> int:
    workers = args.workers
    elements = 2_000_000 if args.quick else 25_000_000
    iters = args.iters or (10 if args.quick else 20)
    probs = args.probs or ([0.16] if args.quick else [0.0, 0.04, 0.08, 0.16, 0.32])
    compute_s = args.compute_ms / 1e3
    k = args.slow_after_windows
    arms = args.arms or ["mitigation", "none"]
    plan = _plan(probs, arms, iters)
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    typical: Optional[float] = None
    with tempfile.TemporaryDirectory(prefix="fanin-stragglers-") as shared:
        _write_reference(shared, workers, elements, BLOCK_GRAD_MAX)
        for p, arm, first, count in _bar(plan, "straggler-iterations"):
            prob = 0.0 if arm == "ideal" else p
            # the first ideal run sets the typical iteration time the delays scale with
            if prob > 0 and typical is None:
                raise RuntimeError("an arm with stragglers ran before the ideal run that scales them")
            schedule = _straggle_schedule(args.seed, iters, workers, prob, typical or 1.0)
            runs.setdefault((arm, p), []).append(
                _run_arm(arm, prob, workers, elements, schedule[first:first + count], compute_s, args.block_exp_ms, k,
                         first, shared))
            if typical is None:
                typical = _arm_point(arm, prob, runs[(arm, p)], schedule[first:first + count], workers)["iteration_s"]
    points = []
    for p in probs:
        ideal = None
        for arm in ["ideal"] + arms:
            prob = 0.0 if arm == "ideal" else p
            pt = _arm_point(arm, prob, runs[(arm, p)], _straggle_schedule(args.seed, iters, workers, prob, typical),
                            workers) | {"beside_p": p}
            ideal = ideal or pt
            pt["vs_ideal"] = pt["iteration_s"] / ideal["iteration_s"]
            points.append(pt)
    summary = []
    for p in probs if len(arms) == 2 else []:
        m = next(x for x in points if x["arm"] == "mitigation" and x["beside_p"] == p)
        n = next(x for x in points if x["arm"] == "none" and x["beside_p"] == p)
        summary.append({"p": p, "mitigation_vs_ideal": m["vs_ideal"], "none_vs_ideal": n["vs_ideal"],
                        "speedup_over_no_mitigation": n["iteration_s"] / m["iteration_s"],
                        "mitigation_contributions_dropped_fraction": m["contributions_dropped_fraction"]})
    at16 = next((s for s in summary if abs(s["p"] - 0.16) < 1e-9), None)
    met = at16 is not None and at16["mitigation_vs_ideal"] <= 1.15
    result = {"bench": "straggler-iterations", "workers": workers, "elements": elements,
              "compute_ms": args.compute_ms, "block_exp_ms": args.block_exp_ms, "slow_after_windows": k,
              "typical_iteration_s": typical, "iteration_definition": ITERATION_DEFINITION,
              "points": points, "summary": summary,
              "target": "with mitigation within 1.15x of ideal at p = 16%", "target_met": met}
    _finite(result)  # before any figure leaves
    paths = _write(args.out, "straggler-iterations", points)
    _plot_iterations(points, probs, paths["png"])
    result.update(paths)
    lines = [f"  p {s['p']:.2f}: mitigation {s['mitigation_vs_ideal']:.2f}x ideal "
             f"({s['mitigation_contributions_dropped_fraction']:.1%} of contributions dropped), no mitigation "
             f"{s['none_vs_ideal']:.2f}x, speed-up {s['speedup_over_no_mitigation']:.2f}x" for s in summary]
    human = (f"straggler-iterations: ideal iteration {typical * 1e3:.0f} ms; target (<= 1.15x ideal at p=16%) "
             f"{'met' if met else 'NOT met'}; results checked; wrote {paths['csv']} and {paths['png']}")
    _emit(args, result, lines, human)
    return 0


def _plot_iterations(points: list[dict[str, Any]], probs: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    pct = [p * 100 for p in probs]
    for arm, label, style in (("mitigation", "fanin, straggler mitigation", "o-"),
                              ("none", "fanin, no mitigation (SwitchML)", "s-"),
                              ("ideal", "ideal (no stragglers), run beside each p", "k--")):
        found = [next((x for x in points if x["arm"] == arm and x["beside_p"] == p), None) for p in probs]
        if all(found):
            ax.plot(pct, [x["iteration_s"] * 1e3 for x in found], style, lw=1 if arm == "ideal" else 1.5, label=label)
    ax.set_xlabel("straggling probability p (%)")
    ax.set_ylabel("iteration time (ms; slowest on-time worker)")
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


def _finite(value: Any, where: str = "result") -> None:
    """Raise, naming the field, where a figure is NaN or infinite: JSON has
    neither (json.dumps would write a bare NaN, which no parser takes)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: not a figure to report")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(v, f"{where}[{i}]")


def _emit(args: Any, result: dict[str, Any], lines: list[str], human: str) -> None:
    _finite(result)
    if args.json:
        print(json.dumps(result, allow_nan=False))
        print(human, file=sys.stderr)
    else:
        for line in lines:
            print(line)
        print(human)
