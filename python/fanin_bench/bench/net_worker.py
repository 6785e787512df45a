"""Long-lived workers of `fanin bench network`, one per testbed host: they
start once, say {"ready": true}, then answer one JSON line per "go" line
read on stdin (the allreduce's time), and one per "check" line (whether
that allreduce's sum was right), so the driver can alternate fanin and
Gloo allreduce by allreduce without paying a process start (or a Gloo
rendezvous) each time, and every check runs after every rank's timed
allreduce, never inside one.

    python -m fanin_bench.bench.net_worker fanin --addr 10.1.0.1:9000 --rank 0 --workers 4 --elements 2000000
    python -m fanin_bench.bench.net_worker gloo --master 10.1.0.2:29500 --rank 0 --workers 4 --elements 2000000
    python -m fanin_bench.bench.net_worker blast --to 10.1.0.1:9999 --mbit 250

A blaster says {"sending": true, ...} once its first datagrams are out
(`_blast`), then {"sent_bytes": ...} when it stops.

Both allreduce kinds reduce the same tensor (`fanin.proc.worker_inputs`;
float32, float16 or bfloat16 with --dtype) and check the sum against the
float64 reference: fanin within its block floating point bound, Gloo within
the per-element bound of a recursive sum (`gloo_bound`). fanin's session is
made with every tunable left at its default unless the driver passes one.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any, Optional

import numpy as np

from fanin.proc import HALF_DTYPES, ResultChecker, half_values, reference_sum, worker_inputs


def cpu_ticks() -> list[int]:
    """The machine's CPU time so far, by kind (/proc/stat's first line:
    user, nice, system, idle, iowait, irq, softirq, steal), in clock ticks.
    Namespaces share it: read around an allreduce, it is what the whole
    testbed (workers, switch, veths) spent meanwhile."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def _ticks_since(t0: list[int]) -> list[int]:
    return [b - a for a, b in zip(t0, cpu_ticks())]

# socket.UDP_SEGMENT (Linux >= 4.18, Python >= 3.12 names it): one send of up
# to 64 KB that the kernel cuts into MTU-sized datagrams, so a Python blaster
# can fill a 10 Gbit/s link.
_UDP_SEGMENT = 103
# a keyed job's member key (hex), from the driver's environment: the name
# the tree benchmark's workers read too (tree_worker.py)
MEMBER_KEY_ENV = "FANIN_MEMBER_KEY"


def _fanin(a: argparse.Namespace) -> int:
    import os

    overrides = {k: v for k, v in (("elems_per_packet", a.elems_per_packet), ("window", a.window),
                                   ("lanes", a.lanes), ("result_group", a.result_group)) if v is not None}
    # one session on this thread, as a user's script has it
    session = open_session(a.addr, a.job, a.rank, os.environ.get(MEMBER_KEY_ENV) or None, overrides)
    if a.result_group and not session.params["results_on_group"]:
        raise SystemExit(f"job {a.job}: the switch does not send results to {a.result_group}")
    x = worker_inputs(a.rank, a.elements, a.dtype)
    # bfloat16 travels as its bits (numpy has no bfloat16)
    kw: dict[str, Any] = {"dtype": "bfloat16"} if a.dtype == "bfloat16" else {}
    per = session.elems_per_packet if a.dtype == "float32" else session.half_elems_per_packet
    keep = shard_range(a.rank, a.workers, a.elements) if a.collective == "reduce-scatter" else None
    if keep is not None:
        kw["keep"] = keep
    # the result goes into one buffer allocated here, as a training loop's
    # gradient buffer is, and as Gloo's arm reduces in place: a fresh 16 MB
    # array per call costs its page faults (milliseconds, more than the
    # whole allreduce's slack at 10 Gbit/s) inside the timed region
    out = np.empty_like(x)
    # every "go" reduces the same inputs: the reference is built once
    checker = ResultChecker(a.workers, a.elements, a.dtype, per)
    lanes = session.socket_stats()["lanes"]
    print(json.dumps({"ready": True, "params": session.params, "elems_per_packet": per, "lanes": lanes}),
          flush=True)
    barrier_in, barrier_out = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            # only once every worker has answered "go" (trees.step_workers)
            print(json.dumps({"verified": checker.check(out, keep=keep)["ok"]}), flush=True)
            continue
        if command != "go":
            break
        # every rank starts together, as the Gloo arm's dist.barrier() makes
        # its ranks do: a one-element allreduce, outside the timed region
        session.allreduce(barrier_in, out=barrier_out)
        c0, t0 = cpu_ticks(), time.perf_counter()
        out = session.allreduce(x, out=out, **kw)
        dt = time.perf_counter() - t0
        cpu = _ticks_since(c0)
        stats = session.last_stats or {}
        print(json.dumps({"s": dt, "cpu_ticks": cpu, "elems_per_packet": per,
                          **{k: stats.get(k, 0) for k in ("retransmissions", "trimmed", "fast_retransmits", "timeouts")},
                          "window": stats.get("window"), "lanes": lanes,
                          "datagrams_from_group": session.socket_stats().get("datagrams_from_group", 0)}), flush=True)
    return 0


def open_session(addr: str, job: int, rank: int, key: Optional[str], overrides: dict[str, Any]) -> Any:
    """The worker's session on one job (`key`: its member key, if keyed)."""
    import fanin

    return fanin.Session(addr, job, rank, dead_after_s=60, **dict(overrides, **({"auth_key": key} if key else {})))


def shard_range(rank: int, workers: int, elements: int) -> tuple[int, int]:
    """Rank `rank`'s shard of a reduce-scatter (the last rank takes the rest)."""
    k = elements // workers
    return rank * k, elements if rank == workers - 1 else (rank + 1) * k


def gloo_bound(workers: int, elements: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference sum of `fanin.proc.worker_inputs` and the error
    each element of Gloo's sum may have: Gloo adds in the tensor's own
    precision along the ring, so the classic bound of a recursive sum,
    N * u * sum(|x_i|) (u the unit roundoff), plus the last rounding, and
    the spacing of the type's subnormals (float16's, 2**-24, are within
    reach of these inputs). Per element: a wrong small element is caught
    however large the others."""
    ref = reference_sum(workers, elements, dtype)
    u = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype]
    tiny = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}[dtype]
    abs_sum = np.zeros(elements)
    for r in range(workers):
        xr = worker_inputs(r, elements, dtype)
        abs_sum += np.abs(half_values(xr, dtype) if dtype in HALF_DTYPES else xr)
    return ref, workers * u * abs_sum + 2 * u * np.abs(ref) + tiny


def _gloo(a: argparse.Namespace) -> int:
    import os

    import torch
    import torch.distributed as dist

    host, port = a.master.rsplit(":", 1)
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=a.rank, world_size=a.workers)
    x = worker_inputs(a.rank, a.elements, a.dtype)
    if a.dtype == "bfloat16":
        x = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(x)
    ref, allowed = gloo_bound(a.workers, a.elements, a.dtype)
    buf = x.clone()
    scatter = a.collective == "reduce-scatter"
    if scatter:
        # torch's reduce_scatter_tensor wants equal shards: the last rank's
        # remainder (shard_range) is reduced by a second, small all_reduce
        k = a.elements // a.workers
        shard = torch.empty(k, dtype=buf.dtype)
        lo, hi = shard_range(a.rank, a.workers, a.elements)
    print(json.dumps({"ready": True}), flush=True)
    got: Optional[Any] = None
    for line in sys.stdin:
        command = line.strip()
        if command == "check" and got is not None:
            # only once every rank has answered "go" (trees.step_workers)
            want, bound = (ref[lo:hi], allowed[lo:hi]) if scatter else (ref, allowed)
            print(json.dumps({"verified": bool(np.all(np.abs(got.double().numpy() - want) <= bound))}), flush=True)
            continue
        if command != "go":
            break
        buf.copy_(x)
        dist.barrier()
        c0, t0 = cpu_ticks(), time.perf_counter()
        if scatter:
            dist.reduce_scatter_tensor(shard, buf[:k * a.workers])
            tail = buf[k * a.workers:]
            if tail.numel():
                dist.all_reduce(tail)
            dt = time.perf_counter() - t0
            cpu = _ticks_since(c0)
            got = torch.cat([shard, tail]) if a.rank == a.workers - 1 else shard
        else:
            dist.all_reduce(buf)
            dt = time.perf_counter() - t0
            cpu = _ticks_since(c0)
            got = buf
        print(json.dumps({"s": dt, "cpu_ticks": cpu}), flush=True)
    dist.destroy_process_group()
    return 0


def _blast(a: argparse.Namespace) -> int:
    """Send UDP as fast as `--mbit` allows (paced, so a slow link's queue is
    kept full without burning the CPU the other senders need) for
    `--seconds`, to every `--to` address in turn. What the link really
    carried is read from its interface counters by the driver.

    Once the first datagrams are out it says so on stdout,
    ``{"sending": true, "t0": ..., "until": ...}``: the monotonic clock
    (one per machine, the same in every network namespace) at its first
    send and when it stops, so the driver counts only while every blaster
    is sending, however long each took to start. Its last line is
    ``{"sent_bytes": ...}``."""
    targets = []
    for t in a.to:
        h, p = t.rsplit(":", 1)
        targets.append((h, int(p)))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    payload, per_send = a.payload, 1
    try:
        s.setsockopt(socket.SOL_UDP, _UDP_SEGMENT, payload)
        per_send = max(1, min(64, 65000 // payload))  # under the 64 KB (and 64 segments) a send may carry
    except OSError:
        pass
    buf = bytes(payload * per_send)
    # per target: bytes per second it should get, with IP/UDP headers counted
    rate = a.mbit * 1e6 / 8 / len(targets)
    sent = [0] * len(targets)
    t0 = time.monotonic()
    end = t0 + a.seconds
    announced = False
    while True:
        now = time.monotonic()
        if now >= end:
            break
        for i, dst in enumerate(targets):
            if sent[i] < rate * (now - t0) + len(buf):
                try:
                    s.sendto(buf, dst)
                    sent[i] += len(buf) + 28 * per_send
                except (BlockingIOError, OSError):
                    pass  # a full queue: the link is the limit, which is the point
        if not announced:
            print(json.dumps({"sending": True, "t0": t0, "until": end}), flush=True)
            announced = True
        if all(sent[i] >= rate * (now - t0) + len(buf) for i in range(len(targets))):
            time.sleep(0.0005)
    print(json.dumps({"sent_bytes": sum(sent)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fanin_bench.bench.net_worker")
    sub = p.add_subparsers(dest="kind", required=True)
    f = sub.add_parser("fanin")
    f.add_argument("--addr", required=True, help="the switch's data address")
    f.add_argument("--job", type=int, default=1, help="job id (a keyed job's member key: in the environment)")
    f.add_argument("--elems-per-packet", type=int)
    f.add_argument("--window", type=int)
    f.add_argument("--lanes", type=int, help="the session's send lanes (fanin.Session(lanes=...))")
    f.add_argument("--result-group", help="IPV4:PORT the job's results come on (fanin.Session(result_group=...))")
    g = sub.add_parser("gloo")
    g.add_argument("--master", required=True, help="HOST:PORT of rank 0's TCP store")
    g.add_argument("--ifname", required=True, help="the interface Gloo's ring uses")
    for q in (f, g):
        q.add_argument("--rank", type=int, required=True)
        q.add_argument("--workers", type=int, required=True)
        q.add_argument("--elements", type=int, required=True)
        q.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
        q.add_argument("--collective", choices=("allreduce", "reduce-scatter"), default="allreduce")
    b = sub.add_parser("blast")
    b.add_argument("--to", action="append", required=True, help="HOST:PORT (repeat for several)")
    b.add_argument("--mbit", type=float, required=True, help="total send rate over every --to")
    b.add_argument("--seconds", type=float, default=2.0)
    b.add_argument("--payload", type=int, default=1472)
    a = p.parse_args(argv)
    return {"fanin": _fanin, "gloo": _gloo, "blast": _blast}[a.kind](a)


if __name__ == "__main__":
    sys.exit(main())
