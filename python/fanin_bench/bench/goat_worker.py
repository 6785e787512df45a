"""A GOAT deployment worker: one fanin session per sub-model, each to the
sub-model's aggregation node (a switch, or the PS's host aggregator). Joins
once, then per line "go" on stdin allreduces every sub-model in sub-model
order (the same order on every worker, so no job waits on another), or
with --parallel N up to N at once, and
answers one JSON line: seconds, whether every sum was exact (int32, the
sum over all workers), retransmissions.

    python -m fanin_bench.bench.goat_worker --rank 0 --workers 8 --targets '[[100, "10.1.0.9:9000", 16384], ...]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import queue
import threading
import time

import numpy as np

import fanin
from fanin_bench.bench.tree_worker import contribution


class Lane:
    """A thread that owns the sessions of some sub-models (a fanin Session
    must stay on the thread that made it) and allreduces them in order when
    asked; lanes run side by side, their allreduces release the GIL."""

    def __init__(self, make_sessions):
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(make_sessions,), daemon=True)
        self.thread.start()
        self.joined = self.replies.get()  # 0 once joined, or the exception

    def _run(self, make_sessions) -> None:
        try:
            sessions = make_sessions()
        except Exception as e:
            self.replies.put(e)
            return
        self.replies.put(0)
        while (inputs := self.requests.get()) is not None:
            try:
                outs = [s.allreduce(x) for s, x in zip(sessions, inputs)]
                self.replies.put((outs, sum((s.last_stats or {}).get("retransmissions") or 0 for s in sessions)))
            except Exception as e:
                self.replies.put(e)

    @staticmethod
    def _check(reply):
        if isinstance(reply, Exception):
            raise reply
        return reply


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True, help="ranks 0..workers-1 take part in every sub-model")
    p.add_argument("--targets", required=True, help="JSON [[job_id, addr, elements], ...] in sub-model order")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="allreduce up to N sub-models at once (threads; 0 or 1: one after the other)")
    a = p.parse_args()
    targets = json.loads(a.targets)
    lanes_n = max(1, min(a.parallel, len(targets)))
    # sub-model g on lane g % lanes_n, in sub-model order: the same on every worker, so no job waits on another
    owned = [[g for g in range(len(targets)) if g % lanes_n == k] for k in range(lanes_n)]

    # {job_id: member key hex} of keyed jobs (the deployment's, docs/security.md)
    keys = {int(j): bytes.fromhex(k) for j, k in json.loads(os.environ.get("FANIN_MEMBER_KEYS", "{}")).items()}

    def sessions_of(gs):
        return lambda: [fanin.Session(targets[g][1], targets[g][0], a.rank, elems_per_packet=a.elems_per_packet,
                                      window=a.window, seed=a.seed * 1000 + targets[g][0], rto_ms=20, rto_min_ms=5,
                                      rto_max_ms=200, dead_after_s=60, auth_key=keys.get(targets[g][0]))
                        for g in gs]

    lanes = [Lane(sessions_of(gs)) for gs in owned]
    for lane in lanes:
        Lane._check(lane.joined)
    print(json.dumps({"ready": True}), flush=True)
    step = 0
    for line in sys.stdin:
        if line.strip() != "go":
            break
        inputs = [contribution(a.rank, elements, step * 4096 + g)  # different data per sub-model and step
                  for g, (_, _, elements) in enumerate(targets)]
        t0 = time.perf_counter()
        for lane, gs in zip(lanes, owned):
            lane.requests.put([inputs[g] for g in gs])
        outs: list = [None] * len(targets)
        retx = 0
        for lane, gs in zip(lanes, owned):
            lane_outs, lane_retx = Lane._check(lane.replies.get())
            retx += lane_retx
            for g, out in zip(gs, lane_outs):
                outs[g] = out
        dt = time.perf_counter() - t0
        exact = all(np.array_equal(out, sum(contribution(r, elements, step * 4096 + g).astype(np.int64)
                                            for r in range(a.workers)).astype(np.int32))
                    for g, (out, (_, _, elements)) in enumerate(zip(outs, targets)))
        print(json.dumps({"s": dt, "exact": bool(exact), "retransmissions": retx}), flush=True)
        step += 1
    for lane in lanes:
        lane.requests.put(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
