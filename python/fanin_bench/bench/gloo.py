"""`fanin bench gloo-compare`: torch.distributed Gloo allreduce (what a
PyTorch user has today) and fanin allreduce at the same N and size, side by
side in one run."""

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

from fanin.proc import format_size, parse_size, reference_sum, worker_inputs
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
        ref = reference_sum(world, n, "float32")
        err = float(np.max(np.abs(buf.numpy().astype(np.float64) - ref))) if n else 0.0
        ok = bool(np.allclose(buf.numpy(), ref, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(ref)) or 1)))
        times, cpu = [], []
        for _ in range(iters):
            buf.copy_(x)
            dist.barrier()
            c0 = time.process_time()  # every thread of this rank, Gloo's included
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        dist.destroy_process_group()
        results.put({"rank": rank, "ok": True, "times": times, "cpu": cpu, "verified": ok, "max_abs_error": err})
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
            "max_abs_error": max(r["max_abs_error"] for r in reports)}


def run_gloo_compare(args: Any) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("fanin bench gloo-compare: PyTorch is not installed (pip install -r requirements-bench.txt)", file=sys.stderr)
        return 2
    size = parse_size(args.size) if args.size else (16_000_000 if args.quick else 100_000_000)
    n = max(1, size // 4)
    iters = args.iters or (3 if args.quick else 7)
    print(f"gloo-compare: {args.workers} workers x {format_size(size)} float32, {iters} iterations each", file=sys.stderr)
    # Alternate the two systems so drift on a noisy machine hits both.
    gloo_runs, fanin_runs = [], []
    rounds = 2
    for _ in range(rounds):
        gloo_runs.append(run_gloo(args.workers, n, max(1, iters // rounds)))
        p = AllreduceParams(workers=args.workers, elements=n, dtype="float32", elems_per_packet=args.elems_per_packet,
                            window=args.window, iters=max(1, iters // rounds), shards=args.shards, seed=args.seed,
                            noaggr=False, results=args.results)
        fanin_runs.append(run_allreduce(p, label="fanin").summary())
    gloo_times = [t for r in gloo_runs for t in r["times_s"]]
    fanin_times = [t for r in fanin_runs for t in r["times_s"]]
    result = {
        "workers": args.workers,
        "size_bytes": size,
        "dtype": "float32",
        "elems_per_packet": args.elems_per_packet,
        "window": args.window,
        "gloo_median_s": statistics.median(gloo_times),
        "gloo_times_s": gloo_times,
        "gloo_verified": all(r["verified"] for r in gloo_runs),
        "fanin_median_s": statistics.median(fanin_times),
        "fanin_times_s": fanin_times,
        "fanin_verified": all(r["verified"] for r in fanin_runs),
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
