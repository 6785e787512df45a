"""A GOAT deployment worker: one fanin session per sub-model, each to the
sub-model's aggregation node (a switch, or the PS's host aggregator). Joins
once, then per line "go" on stdin allreduces every sub-model in sub-model
order (the same order on every worker, so no job waits on another) and
answers one JSON line: seconds, whether every sum was exact (int32, the
sum over all workers), retransmissions.

    python -m fanin.bench.goat_worker --rank 0 --workers 8 --targets '[[100, "10.1.0.9:9000", 16384], ...]'
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import fanin
from fanin.bench.tree_worker import contribution


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True, help="ranks 0..workers-1 take part in every sub-model")
    p.add_argument("--targets", required=True, help="JSON [[job_id, addr, elements], ...] in sub-model order")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    targets = json.loads(a.targets)
    sessions = [fanin.Session(addr, job, a.rank, elems_per_packet=a.elems_per_packet, window=a.window,
                              seed=a.seed * 1000 + job, rto_ms=20, rto_min_ms=5, rto_max_ms=200, dead_after_s=60)
                for job, addr, _ in targets]
    print(json.dumps({"ready": True}), flush=True)
    step = 0
    for line in sys.stdin:
        if line.strip() != "go":
            break
        exact, retx = True, 0
        t0 = time.perf_counter()
        for g, (s, (job, _, elements)) in enumerate(zip(sessions, targets)):
            data_step = step * 4096 + g  # different data per sub-model and step
            out = s.allreduce(contribution(a.rank, elements, data_step))
            expected = sum(contribution(r, elements, data_step).astype(np.int64)
                           for r in range(a.workers)).astype(np.int32)
            exact = exact and bool(np.array_equal(out, expected))
            retx += (s.last_stats or {}).get("retransmissions") or 0
        print(json.dumps({"s": time.perf_counter() - t0, "exact": exact, "retransmissions": retx}), flush=True)
        step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
