"""``fanin bench flood``: does one flooding sender take another job's share?

One switch process (one shard, so everything competes for one thread) runs
three jobs: job A (``--workers`` worker processes doing allreduces), and two
one-source jobs B and C that a flooder process hits with a raw UDP flood of
valid contributions (each completes a block at once, so every accepted
packet costs the switch a summation and a result sent back). B has no rate
limit; C has one (``--limit PPS,BURST``): its excess is answered with a
32-byte Trimmed nack (cause 3) and nothing else.

Job A's rank 0 picks the phase of each iteration in rotation (order
shuffled per round): *alone* (no flood), *flood* (flooding B),
*flood+limit* (flooding C) and *flood-sink* (the same flood into a socket
nobody reads, whose tiny buffer makes the kernel drop it on arrival), waits
for the flood to ramp, then times one allreduce. So the arms see the same
machine noise, and the flooder is paced (``--flood-pps``) so they see the
same offered load. On a 2-core machine the flooder's own CPU and the
kernel's path take a share no switch can give back; the sink arm measures
that share, so ``isolation_limited`` (job A's goodput with the limited
flood at the switch / into the sink) is what the switch itself lets the
flood take: 1.0 = nothing. Also reported: the ratios to *alone*, the flood
rate achieved, and the switch's counters (``rate_limited``,
``rate_limited_unanswered``, ``socket_drops``).
Every result of job A is checked against its reference.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queue_mod
import random
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

from fanin.proc import SwitchProcess, check_result, worker_inputs
from fanin.switch import job_config, switch_config

JOB_A, JOB_B, JOB_C = 1, 2, 3
SINK = -1
ARMS = ("alone", "flood", "flood+limit", "flood-sink")
TARGET = {"alone": 0, "flood": JOB_B, "flood+limit": JOB_C, "flood-sink": SINK}


def _contribution(job: int, block: int, elems: int) -> bytes:
    """A valid Contribution from source 0 (docs/protocol.md §2.2), int32."""
    header = bytes([0xFA, 0x17, 0x01, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00])
    header += job.to_bytes(4, "big") + block.to_bytes(4, "big") + elems.to_bytes(2, "big") + bytes([0x80, 0x80])
    return header + np.ones(elems, dtype=">i4").tobytes()


def _flooder(addr: str, elems: int, pps: int, target: Any, sent: Any, stop: Any) -> None:
    host, port = addr.rsplit(":", 1)
    dest = (host, int(port))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # results and nacks are not read
    s.setblocking(False)
    # The sink: a socket nobody reads, with the smallest receive buffer, so
    # the kernel drops the flood on arrival. Flooding it costs the machine
    # what the flood costs before any switch sees a packet: the flooder's
    # own CPU and the kernel's send and loopback path.
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    sink.bind((host, 0))
    sink_addr = sink.getsockname()
    packets = {job: bytearray(_contribution(job, 0, elems)) for job in (JOB_B, JOB_C)}
    packets[SINK] = bytearray(packets[JOB_B])  # the same bytes, to nobody
    block, count = 0, 0
    # Paced: bursts of 64 on a schedule of `pps`, so every arm offers the
    # same load whatever each send costs (sends into the sink are cheaper).
    burst, start, bursts = 64, time.perf_counter(), 0
    while not stop.is_set():
        job = target.value
        if job == 0:
            time.sleep(0.001)
            start, bursts = time.perf_counter(), 0
            continue
        bursts += 1
        ahead = start + bursts * burst / pps - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        p = packets[job]
        to = sink_addr if job == SINK else dest
        for _ in range(burst):
            # a new block each time: every accepted packet opens, sums and
            # completes a block and sends its result back
            block = (block + 1) & 0xFFFFFFFF
            p[16:20] = block.to_bytes(4, "big")
            try:
                s.sendto(p, to)
                count += 1
            except BlockingIOError:
                pass
        sent.value = count


def _worker(rank: int, addr: str, cfg: dict[str, Any], target: Any, sent: Any, results: Any) -> None:
    try:
        from fanin import Session

        s = Session(addr, JOB_A, rank, elems_per_packet=cfg["elems"], window=cfg["window"])
        x = worker_inputs(rank, cfg["elements"], "int32")
        sync = np.zeros(1, dtype=np.int32)
        rng = random.Random(7)
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        ok = True
        for _ in range(cfg["iters"]):
            order = list(ARMS)
            rng.shuffle(order)  # same order on every rank (same seed)
            for arm in order:
                if rank == 0:
                    target.value = TARGET[arm]
                s.allreduce(sync)  # barrier: the phase is set
                time.sleep(cfg["ramp_s"])
                before, t_before = sent.value, time.perf_counter()
                t0 = time.perf_counter()
                out = s.allreduce(x)
                times[arm].append(time.perf_counter() - t0)
                rates[arm].append((sent.value - before) / max(time.perf_counter() - t_before, 1e-9))
                ok = ok and check_result(out, cfg["workers"], "int32", cfg["elems"])["ok"]
        if rank == 0:
            target.value = 0
        results.put({"rank": rank, "ok": True, "verified": ok, "times": times, "flood_pps": rates})
    except BaseException as e:  # reported to the parent, which fails the run
        target.value = 0
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def run_flood(args: Any) -> int:
    # a value given is used or refused, never replaced by the default; --flood-pps 0 divided by zero in the
    # flooder, and a negative rate sent as fast as it could
    for flag, value, least in (("--flood-pps", args.flood_pps, 1), ("--workers", args.workers, 1),
                               ("--iters", args.iters, 1), ("--size", args.size, 4)):
        if value is not None and value < least:
            print(f"fanin bench flood: {flag} {value} is out of range: give at least {least}"
                  + (" bytes (one element)" if flag == "--size" else ""), file=sys.stderr)
            return 2
    iters = args.iters if args.iters is not None else (4 if args.quick else 10)
    size = args.size if args.size is not None else (2_000_000 if args.quick else 8_000_000)
    pps, burst = args.limit
    cfg = {"workers": args.workers, "elements": size // 4, "elems": 1024, "window": 64, "iters": iters,
           "ramp_s": 0.05}
    jobs = [
        job_config(JOB_A, args.workers, block_cnt_max=64, block_grad_max=1024),
        job_config(JOB_B, 1, block_cnt_max=256, block_grad_max=1024),
        job_config(JOB_C, 1, block_cnt_max=256, block_grad_max=1024, rate_limit=(pps, burst)),
    ]
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0",
                                     memory_mb=256, jobs=jobs))
    ctx = mp.get_context("spawn")
    target, sent, stop = ctx.Value("i", 0), ctx.Value("q", 0), ctx.Event()
    results = ctx.Queue()
    flooder = ctx.Process(target=_flooder, args=(sw.data_addr, 1024, args.flood_pps, target, sent, stop), daemon=True)
    procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, cfg, target, sent, results), daemon=True)
             for r in range(args.workers)]
    reports: list[dict[str, Any]] = []
    try:
        flooder.start()
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60 + iters * 60
        while len(reports) < args.workers:
            try:
                reports.append(results.get(timeout=1.0))
            except queue_mod.Empty:
                if time.monotonic() > deadline or all(not p.is_alive() for p in procs):
                    raise RuntimeError("flood bench: workers did not report") from None
            print(f"flood: {len(reports)}/{args.workers} workers done", file=sys.stderr)
        counters = sw.counters()
    finally:
        stop.set()
        for p in procs + [flooder]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        sw.stop()
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise RuntimeError("; ".join(f"worker {r['rank']}: {r['error']}" for r in failed))
    if not all(r["verified"] for r in reports):
        raise RuntimeError("flood bench: job A got a wrong result")
    nbytes = cfg["elements"] * 4
    arms: dict[str, Any] = {}
    for arm in ARMS:
        t = [max(r["times"][arm][i] for r in reports) for i in range(iters)]
        rank0 = next(r for r in reports if r["rank"] == 0)
        arms[arm] = {"median_s": statistics.median(t), "times_s": t,
                     "goodput_MBps": nbytes / statistics.median(t) / 1e6,
                     "flood_pps": statistics.median(rank0["flood_pps"][arm])}
    idle = [arm for arm in ARMS if TARGET[arm] and not arms[arm]["flood_pps"]]
    if idle:
        raise RuntimeError(f"flood bench: the flooder sent nothing in {', '.join(idle)} (did it crash?)")
    result = {
        "bench": "flood", "workers": args.workers, "elements": cfg["elements"], "iters": iters,
        "limit": {"pps": pps, "burst": burst}, "flood_pps_target": args.flood_pps, "verified": True, "arms": arms,
        "ratio_goodput_flood_vs_alone": arms["flood"]["goodput_MBps"] / arms["alone"]["goodput_MBps"],
        "ratio_goodput_limited_vs_alone": arms["flood+limit"]["goodput_MBps"] / arms["alone"]["goodput_MBps"],
        "ratio_goodput_sink_vs_alone": arms["flood-sink"]["goodput_MBps"] / arms["alone"]["goodput_MBps"],
        # What the switch adds to the harm the flood does anyway (the flooder's
        # CPU and the kernel path, measured by the sink arm): 1.0 = the
        # switch contains the flood completely.
        "isolation_unlimited": arms["flood"]["goodput_MBps"] / arms["flood-sink"]["goodput_MBps"],
        "isolation_limited": arms["flood+limit"]["goodput_MBps"] / arms["flood-sink"]["goodput_MBps"],
        "switch": {k: counters.get(k, 0) for k in ("rate_limited", "rate_limited_unanswered", "socket_drops", "blocks_completed", "nacks_sent")},
    }
    lines = [f"  {arm:12s} job A {a['goodput_MBps']:7.1f} MB/s (median {a['median_s'] * 1e3:6.1f} ms), "
             f"flood {a['flood_pps'] / 1e3:6.1f} kpps" for arm, a in arms.items()]
    lines.append(f"  job A goodput vs alone: flood {result['ratio_goodput_flood_vs_alone']:.2f}, "
                 f"flood with limit {pps},{burst} {result['ratio_goodput_limited_vs_alone']:.2f}, "
                 f"flood into a sink nobody reads {result['ratio_goodput_sink_vs_alone']:.2f}")
    lines.append(f"  isolation (job A goodput vs the sink arm): no limit {result['isolation_unlimited']:.2f}, "
                 f"with limit {result['isolation_limited']:.2f}; "
                 f"switch rate_limited {result['switch']['rate_limited']}")
    if args.json:
        print(json.dumps(result))
        print("\n".join(lines), file=sys.stderr)
    else:
        print("flood: one sender floods another job\n" + "\n".join(lines))
    return 0
