"""`fanin bench gloo-compare`: torch.distributed Gloo allreduce (what a
PyTorch user has today) and fanin allreduce at the same N and size, side by
side in one run: exactly ``--iters`` timed allreduces of each, in blocks
whose first system alternates (`blocks`). Every result is checked, Gloo's
against the per-element bound of a recursive sum (net_worker.gloo_bound), and
a wrong one fails the run before any figure is reported."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

from fanin.proc import format_size, parse_size, worker_inputs
from fanin_bench.bench.net_worker import gloo_bound
from fanin_bench.bench.runner import AllreduceParams, run_allreduce


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, n: int, iters: int, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        x = torch.from_numpy(worker_inputs(rank, n, "float32"))
        buf = x.clone()
        dist.all_reduce(buf)  # warm-up and correctness
        ref, allowed = gloo_bound(world, n, "float32")
        got = buf.numpy().astype(np.float64)
        err = np.abs(got - ref)
        # every element within its own bound (an error in a small element
        # is one, however large the others)
        ok = bool(np.all(err <= allowed))
        worst = float(np.max(err / allowed)) if n else 0.0
        verified = buf.numpy().copy()
        timed_checked, timed_full_checks = 0, 0
        times, cpu = [], []
        for _ in range(iters):
            buf.copy_(x)
            dist.barrier()
            c0 = time.process_time()  # every thread of this rank, Gloo's included
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            # outside the clock, once every rank is out of its allreduce:
            # the same bits as the verified result, or the full check
            dist.barrier()
            timed_checked += 1
            if not np.array_equal(buf.numpy().view(np.uint32), verified.view(np.uint32)):
                timed_full_checks += 1
                e = np.abs(buf.numpy().astype(np.float64) - ref)
                ok = ok and bool(np.all(e <= allowed))
                err = np.maximum(err, e)
        dist.destroy_process_group()
        results.put({"rank": rank, "ok": True, "times": times, "cpu": cpu, "verified": ok,
                     "max_abs_error": float(err.max()) if n else 0.0, "worst_fraction_of_bound": worst,
                     "timed_checked": timed_checked, "timed_full_checks": timed_full_checks})
    except BaseException as e:
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def run_gloo(workers: int, elements: int, iters: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, workers, port, elements, iters, results)) for r in range(workers)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    bad = [r for r in reports if not r["ok"]]
    if bad:
        raise RuntimeError("gloo: " + "; ".join(f"rank {r['rank']}: {r['error']}" for r in bad))
    times = [max(r["times"][i] for r in reports) for i in range(iters)]
    cpu = [sum(r["cpu"][i] for r in reports) for i in range(iters)]
    return {"median_s": statistics.median(times), "times_s": times, "cpu_s": cpu,
            "verified": all(r["verified"] for r in reports),
            "max_abs_error": max(r["max_abs_error"] for r in reports),
            "worst_fraction_of_bound": max(r["worst_fraction_of_bound"] for r in reports),
            "timed_results_checked": sum(r["timed_checked"] for r in reports)}


def blocks(iters: int) -> list[tuple[int, str]]:
    """(timed iterations, the system that goes first) per block: exactly
    `iters` in all, split over 2 blocks (4 from 4 iterations on), and the
    system that goes first alternating, so drift on a noisy machine hits
    both. (Each block is a Gloo process group and a switch with its
    workers, started afresh: finer alternation would cost a start per
    allreduce.)"""
    rounds = min(iters, 2 if iters < 4 else 4)
    sizes = [iters // rounds + (1 if i < iters % rounds else 0) for i in range(rounds)]
    return [(k, "gloo" if i % 2 == 0 else "fanin") for i, k in enumerate(sizes)]


def run_gloo_compare(args: Any) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("fanin bench gloo-compare: PyTorch is not installed (pip install -r requirements-bench.txt)", file=sys.stderr)
        return 2
    size = parse_size(args.size) if args.size else (16_000_000 if args.quick else 100_000_000)
    n = max(1, size // 4)
    iters = args.iters or (3 if args.quick else 7)
    if iters < 1:
        print(f"fanin bench gloo-compare: --iters {iters} must be at least 1", file=sys.stderr)
        return 2
    plan = blocks(iters)
    print(f"gloo-compare: {args.workers} workers x {format_size(size)} float32, {iters} iterations each, in "
          f"{len(plan)} blocks of {'/'.join(str(k) for k, _ in plan)}, the first system alternating",
          file=sys.stderr)
    gloo_runs, fanin_runs = [], []
    for count, first in plan:
        for system in (("gloo", "fanin") if first == "gloo" else ("fanin", "gloo")):
            if system == "gloo":
                gloo_runs.append(run_gloo(args.workers, n, count))
            else:
                p = AllreduceParams(workers=args.workers, elements=n, dtype="float32",
                                    elems_per_packet=args.elems_per_packet, window=args.window, iters=count,
                                    shards=args.shards, seed=args.seed, noaggr=False, results=args.results)
                fanin_runs.append(run_allreduce(p, label="fanin").summary())
    gloo_times = [t for r in gloo_runs for t in r["times_s"]]
    fanin_times = [t for r in fanin_runs for t in r["times_s"]]
    if len(gloo_times) != iters or len(fanin_times) != iters:
        raise RuntimeError(f"gloo-compare: {len(gloo_times)} Gloo and {len(fanin_times)} fanin timed allreduces, "
                           f"not {iters} each")
    gloo_verified = all(r["verified"] for r in gloo_runs)
    fanin_verified = all(r["verified"] for r in fanin_runs)
    # a wrong sum fails the run before any figure is reported
    if not gloo_verified:
        raise RuntimeError(f"gloo-compare: a Gloo rank's sum is outside the per-element bound of a recursive sum "
                           f"(max abs error {max(r['max_abs_error'] for r in gloo_runs):.3g})")
    if not fanin_verified:
        raise RuntimeError("gloo-compare: a fanin worker's sum is outside its block floating point bound")
    result = {
        "workers": args.workers,
        "size_bytes": size,
        "dtype": "float32",
        "elems_per_packet": args.elems_per_packet,
        "window": args.window,
        "iters": iters,
        "blocks": [{"iters": k, "first": first} for k, first in plan],
        "gloo_median_s": statistics.median(gloo_times),
        "gloo_times_s": gloo_times,
        "gloo_verified": gloo_verified,
        # Gloo's warm-up result against the per-element bound (<= 1), and the
        # timed results compared with it (bit for bit, else the full check)
        "gloo_worst_fraction_of_bound": max(r["worst_fraction_of_bound"] for r in gloo_runs),
        "gloo_timed_results_checked": sum(r["timed_results_checked"] for r in gloo_runs),
        "fanin_median_s": statistics.median(fanin_times),
        "fanin_times_s": fanin_times,
        "fanin_verified": fanin_verified,
        "fanin_retransmissions": sum(r["retransmissions"] for r in fanin_runs),
        # CPU seconds per allreduce, all processes together (fanin: the
        # workers and the switch). On this 2-core machine every arm is
        # CPU-bound, so this is the efficiency figure with the least noise.
        "gloo_cpu_s_per_allreduce": statistics.median(c for r in gloo_runs for c in r["cpu_s"]),
        "fanin_cpu_s_per_allreduce": statistics.median(c for r in fanin_runs for c in r["cpu_s_times"]),
    }
    result["speedup_vs_gloo"] = result["gloo_median_s"] / result["fanin_median_s"]
    result["cpu_ratio_vs_gloo"] = result["gloo_cpu_s_per_allreduce"] / result["fanin_cpu_s_per_allreduce"]
    human = (f"{args.workers} workers x {format_size(size)} float32: Gloo {result['gloo_median_s']:.3f} s, "
             f"fanin {result['fanin_median_s']:.3f} s -> fanin is {result['speedup_vs_gloo']:.2f}x Gloo's speed; "
             f"CPU per allreduce Gloo {result['gloo_cpu_s_per_allreduce']:.3f} s, fanin "
             f"{result['fanin_cpu_s_per_allreduce']:.3f} s "
             f"(verified: gloo={result['gloo_verified']}, fanin={result['fanin_verified']})")
    if args.json:
        print(json.dumps(result))
        print(human, file=sys.stderr)
    else:
        print(human)
    return 0
