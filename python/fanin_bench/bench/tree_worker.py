"""A long-lived worker for the tree benchmarks: it joins once, then runs
one allreduce per "go" line it reads on stdin and answers with one JSON
line (seconds, the smallest source count, retransmissions); a "check"
line then checks that allreduce's sum and answers whether it was exact. Run
inside a testbed namespace so the driver can interleave configurations
allreduce by allreduce without paying a process start each time.

    FANIN_MEMBER_KEY=<32 hex digits> python -m fanin_bench.bench.tree_worker --addr 10.1.0.2:9000 --job 1 --rank 0 \
        --workers 2 --elements 10752

In a keyed job (the controller's default) the worker's member key comes in
the environment (FANIN_MEMBER_KEY, hex), not on the command line, which
other local users can read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import fanin
from fanin_bench.bench.net_worker import MEMBER_KEY_ENV


def contribution(rank: int, elements: int, step: int) -> np.ndarray:
    """Deterministic int32 data of worker `rank` at `step`, so the driver-free
    check below knows every worker's input."""
    return (np.arange(elements, dtype=np.int64) * (rank + 1) + step * 7919 + rank).astype(np.int32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--addr", required=True)
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True, help="ranks 0..workers-1 take part")
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--send-drop", type=float, default=0.0)
    p.add_argument("--recv-drop", type=float, default=0.0)
    p.add_argument("--rto-ms", type=float, default=5.0)
    p.add_argument("--rto-min-ms", type=float, default=2.0)
    p.add_argument("--rto-max-ms", type=float, default=10.0,
                   help="backoff cap: with 30%% loss each way a block often fails several times in a row, and "
                        "an uncapped exponential backoff would measure the backoff, not the tree")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    key = os.environ.get(MEMBER_KEY_ENV)
    s = fanin.Session(a.addr, a.job, a.rank, elems_per_packet=a.elems_per_packet, window=a.window,
                      send_drop=a.send_drop, recv_drop=a.recv_drop, seed=a.seed, rto_ms=a.rto_ms,
                      rto_min_ms=a.rto_min_ms, rto_max_ms=a.rto_max_ms, dead_after_s=60,
                      auth_key=bytes.fromhex(key) if key else None)
    print(json.dumps({"ready": True}), flush=True)
    step = 0
    out = None
    barrier = np.zeros(1, dtype=np.int32)
    for line in sys.stdin:
        command = line.strip()
        if command == "check" and out is not None:
            # told once every worker has answered "go": a check here never
            # runs inside another worker's timed allreduce (trees.step_workers)
            expected = sum(contribution(r, a.elements, step - 1).astype(np.int64)
                           for r in range(a.workers)).astype(np.int32)
            print(json.dumps({"exact": bool(np.array_equal(out, expected))}), flush=True)
            continue
        if command != "go":
            break
        x = contribution(a.rank, a.elements, step)
        # a barrier through the tree (one int32): the clock starts when
        # every worker is here, not when the driver's "go" reached this one
        # (it writes them one after another; the slowest worker's time then
        # held the dispatch and wake-up skew)
        s.allreduce(barrier)
        t0 = time.perf_counter()
        out = s.allreduce(x)
        dt = time.perf_counter() - t0
        stats = s.last_stats or {}
        print(json.dumps({"s": dt, "min_src_cnt": stats.get("min_src_cnt"),
                          "retransmissions": stats.get("retransmissions")}), flush=True)
        step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
