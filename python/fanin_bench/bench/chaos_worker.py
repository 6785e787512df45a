"""A free-running worker for the chaos soak (``fanin bench chaos``).

It joins its job and runs allreduce after allreduce until it is told to
stop (SIGTERM) or its session fails, printing one JSON line per allreduce.
Every result is verified here, by the worker itself, so a wrong sum is
caught where it happens:

worker ``r`` contributes ``x[i] = 2**r * g(i, step)`` with
``g = 1 + (31 i + 17 step) mod 97``. Any sum over a subset ``S`` of the
workers is then ``mask(S) * g(i, step)``: dividing by ``g`` names exactly
which workers a block summed. A result is correct when, in every block,
the quotient is exact, the same over the block, a subset of the job's
ranks, and has as many members as the block's ``src_cnt`` (the job size,
or what the switch reported for a degraded block). Double-counted,
mixed-generation or forged data fails one of these checks. The values are
small integers, exact in float32 block floating point too.

    python -m fanin_bench.bench.chaos_worker --addr 10.1.0.2:9000 --job 1 --rank 0 --workers 3 --blocks 24
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from typing import Any, Optional

import numpy as np

import fanin

_stop = False


def chaos_input(rank: int, elements: int, step: int, dtype: str) -> np.ndarray:
    """Worker `rank`'s contribution at `step` (see the module docstring)."""
    return ((1 << rank) * _g(elements, step)).astype(dtype)


def _g(elements: int, step: int) -> np.ndarray:
    i = np.arange(elements, dtype=np.int64)
    return 1 + (31 * i + 17 * step) % 97


def verify(out: np.ndarray, *, step: int, workers: int, epp: int,
           degraded_blocks: list[tuple[int, int]]) -> Optional[str]:
    """None if `out` is a correct (possibly degraded) sum, else what is wrong."""
    g = _g(out.size, step)
    vals = np.asarray(out, dtype=np.float64)
    if not np.all(np.isfinite(vals)):
        return "non-finite element"
    mask = np.rint(vals / g).astype(np.int64)
    off = np.nonzero(mask * g != vals)[0]
    if off.size:
        i = int(off[0])
        return f"element {i} is not a whole multiple of its input pattern ({vals[i]} / {g[i]})"
    full = (1 << workers) - 1
    partial_counts: Counter = Counter()
    for start in range(0, out.size, epp):
        m = mask[start:start + epp]
        if np.any(m != m[0]):
            return f"block at element {start} mixes different sets of workers"
        mk = int(m[0])
        if mk & ~full:
            return f"block at element {start} has data from ranks outside the job (mask {mk:#x})"
        if mk != full:
            partial_counts[bin(mk).count("1")] += 1
    reported = Counter(cnt for _, cnt in degraded_blocks if cnt < workers)
    if partial_counts != reported:
        return (f"partial blocks by source count {dict(partial_counts)} differ from the switch's degraded "
                f"blocks {dict(reported)}")
    return None


def _ready(s: "fanin.Session", step: int, **extra: Any) -> None:
    """Tells the driver the session is up, at which step, with how many send lanes."""
    print(json.dumps({"event": "ready", "step": step, **extra, "lanes": s.socket_stats()["lanes"]}), flush=True)


def _injected(s: "fanin.Session") -> dict[str, int]:
    st = s.socket_stats()
    return {k: st.get(f"{k}_by_fault_injection", 0) for k in ("dropped", "duplicated", "reordered")}


def _past_stop_step(path: Optional[str], step: int) -> bool:
    """Whether the stop file names a step before `step`. The driver writes it
    by rename, so it is whole or absent; an empty or unreadable one is read as
    absent (reading an empty file as "stop now" once stopped one worker a step
    before the others, which then waited for it until the member timeout)."""
    try:
        with open(path or "") as f:
            text = f.read().strip()
        return bool(text) and step > int(text)
    except (OSError, ValueError):
        return False


def _on_term(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--addr", required=True)
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True, help="the job's ranks are 0..workers-1")
    p.add_argument("--blocks", type=int, default=24, help="blocks per allreduce")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--dtype", choices=["int32", "float32"], default="int32")
    p.add_argument("--lanes", type=int, default=1, help="send lanes (fanin.Session(lanes=...))")
    p.add_argument("--sync-join", action="store_true",
                   help="join the running stream (SwitchML++ sync join): a restarted worker spliced back in")
    p.add_argument("--rejoin", action="store_true",
                   help="when a member of the job restarted or failed (MemberRestarted, MemberFailed), start a new "
                        "Session and go on, as torch elastic restarts its group; without it such an error ends "
                        "the worker")
    p.add_argument("--auth-key", default=None, help="member key, hex (authenticated jobs)")
    p.add_argument("--dead-after-s", type=float, default=20.0)
    p.add_argument("--stop-file", default=None,
                   help="when this file appears it holds a step number: stop after that step (every worker "
                        "of the job stops after the same allreduce, so none is left waiting for the others)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--send-drop", type=float, default=0.0, help="drop probability of this worker's sends")
    p.add_argument("--recv-drop", type=float, default=0.0)
    p.add_argument("--recv-duplicate", type=float, default=0.0)
    p.add_argument("--recv-reorder", type=float, default=0.0)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, _on_term)
    elements = a.blocks * a.elems_per_packet
    kwargs: dict[str, Any] = dict(elems_per_packet=a.elems_per_packet, window=a.window, lanes=a.lanes, seed=a.seed,
                                  send_drop=a.send_drop, recv_drop=a.recv_drop, recv_duplicate=a.recv_duplicate,
                                  recv_reorder=a.recv_reorder, rto_ms=20.0, rto_min_ms=5.0, rto_max_ms=200.0, dead_after_s=a.dead_after_s)
    if a.auth_key:
        kwargs["auth_key"] = bytes.fromhex(a.auth_key)
    def connect(sync: bool) -> Optional["fanin.Session"]:
        opts = dict(kwargs, sync_join=True, align_blocks=a.blocks) if sync else kwargs
        try:
            return fanin.Session(a.addr, a.job, a.rank, members=a.workers, **opts)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
            print(json.dumps({"event": "join_failed", "error": str(e)}), flush=True)
            return None

    s = connect(a.sync_join)
    if s is None:
        return 3
    carried: Counter = Counter()  # faults injected by this worker's earlier sessions
    # The stream position tells the step: allreduce k covers blocks [k*n, (k+1)*n)
    # from where the session joined (every member of a round joins at one block).
    step = int(s.params.get("next_block", 0)) // a.blocks
    _ready(s, step)
    while not _stop and not _past_stop_step(a.stop_file, step):
        x = chaos_input(a.rank, elements, step, a.dtype)
        t0 = time.monotonic()
        try:
            out = s.allreduce(x)
        except (fanin.MemberRestarted, fanin.MemberFailed) as e:
            if not a.rejoin:
                print(json.dumps({"event": "error", "step": step, "error": str(e),
                                  "s": time.monotonic() - t0}), flush=True)
                return 4
            # Another member restarted (or died): this round is over and this
            # call raised rather than return anything. Start over in a new
            # Session (a new incarnation), as an elastic agent restarts its
            # group; the job's next round starts when every member is back.
            print(json.dumps({"event": "raised", "step": step, "kind": type(e).__name__, "error": str(e)[:300],
                              "s": time.monotonic() - t0}), flush=True)
            carried.update(_injected(s))
            s = None
            s = connect(False)
            if s is None:
                return 3
            step = int(s.params.get("next_block", 0)) // a.blocks
            _ready(s, step, rejoined=True)
            continue
        except Exception as e:  # noqa: BLE001 - a clean failure is a result too
            print(json.dumps({"event": "error", "step": step, "error": str(e),
                              "s": time.monotonic() - t0}), flush=True)
            return 4
        stats = s.last_stats or {}
        problem = verify(out, step=step, workers=a.workers, epp=a.elems_per_packet,
                         degraded_blocks=[tuple(b) for b in stats.get("degraded_blocks", [])])
        print(json.dumps({"event": "done", "step": step, "ok": problem is None, "problem": problem,
                          "s": time.monotonic() - t0, "degraded": len(stats.get("degraded_blocks", [])),
                          "retransmissions": stats.get("retransmissions", 0),
                          "faults": dict(carried + Counter(_injected(s)))}), flush=True)
        step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
