"""Run fanin allreduce in real worker processes against a switch process,
aggregation and the NoAggr baseline side by side in the same run."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue as queue_mod
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from fanin.proc import ResultChecker, SwitchProcess, format_size, parse_size, worker_inputs
from fanin.switch import free_result_group, job_config, switch_config
from fanin_bench.bench.cpu import process_cpu_seconds
from fanin_bench.report import emit

AGGR_JOB = 1
NOAGGR_JOB = 2
AUTH_JOB = 3


@dataclass
class AllreduceParams:
    workers: int = 4
    elements: int = 25_000_000
    dtype: str = "float32"
    elems_per_packet: int = 1024
    window: int = 256
    loss: float = 0.0
    iters: int = 5
    shards: int = 1
    seed: int = 1
    verify: bool = True
    noaggr: bool = True
    # The same allreduce on a keyed job (docs/security.md), interleaved.
    auth: bool = False
    progress: bool = True
    job_key: Optional[bytes] = None
    # How the switch delivers the fanin arm's results: "multicast" (once to
    # the job's result group, which every worker listens on) or "unicast"
    # (a copy to each worker). The keyed arm goes the same way (sealed once
    # under the job's result key on the group); NoAggr is unicast either way.
    results: str = "multicast"
    # set by run_allreduce: rank 0 reads the switch's CPU time per arm
    switch_pid: Optional[int] = None
    result_group: Optional[str] = None

    def validate(self) -> None:
        if self.workers < 1 or self.workers > 256:
            raise ValueError(f"--workers {self.workers} is out of range (1..256)")
        if self.dtype not in ("float32", "int32"):
            raise ValueError(f"--dtype must be float32 or int32, not {self.dtype!r}")
        if not 1 <= self.elems_per_packet <= 16370:
            raise ValueError(f"--elems-per-packet {self.elems_per_packet} is out of range (1..16370)")
        if self.window < 1:
            raise ValueError("--window must be at least 1")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"--loss {self.loss} is not a probability below 1")
        if self.iters < 1:
            raise ValueError("--iters must be at least 1")
        if self.elements < 1:
            raise ValueError("--size must be at least one element")
        if self.results not in ("multicast", "unicast"):
            raise ValueError(f"--results must be multicast or unicast, not {self.results!r}")


@dataclass
class AllreduceRun:
    params: AllreduceParams
    fanin_times: list[float] = field(default_factory=list)
    noaggr_times: list[float] = field(default_factory=list)
    auth_times: list[float] = field(default_factory=list)
    # CPU seconds per allreduce, all workers plus the switch, per arm
    cpu_s: dict[str, list[float]] = field(default_factory=dict)
    switch_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    retransmissions: int = 0
    verified: bool = False
    # timed results compared with the verified one (every worker, every arm)
    timed_results_checked: int = 0
    checks: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        p = self.params
        nbytes = p.elements * 4
        med = statistics.median(self.fanin_times)
        out: dict[str, Any] = {
            "workers": p.workers,
            "size_bytes": nbytes,
            "elements": p.elements,
            "dtype": p.dtype,
            "elems_per_packet": p.elems_per_packet,
            "window": p.window,
            "loss": p.loss,
            "shards": p.shards,
            "results": p.results,
            "iters": p.iters,
            "median_s": med,
            "times_s": self.fanin_times,
            "goodput_gbps": nbytes * 8 / med / 1e9,
            "elements_per_s": p.elements / med,
            "retransmissions": self.retransmissions,
            "verified": self.verified,
            "timed_results_checked": self.timed_results_checked,
            "max_abs_error": max((c.get("max_abs_error", 0) for c in self.checks), default=None),
            "switch_counters": {k: v for k, v in self.counters.items() if v and not k.startswith("malformed.")},
        }
        if self.noaggr_times:
            nmed = statistics.median(self.noaggr_times)
            out["noaggr_median_s"] = nmed
            out["noaggr_times_s"] = self.noaggr_times
            out["ratio_vs_noaggr"] = nmed / med
        if self.auth_times:
            amed = statistics.median(self.auth_times)
            out["auth_median_s"] = amed
            out["auth_times_s"] = self.auth_times
            out["auth_goodput_gbps"] = nbytes * 8 / amed / 1e9
            # goodput with authentication / without (1.0 = free)
            out["auth_goodput_ratio"] = med / amed
            # The same from each iteration's pair (both arms ran back to
            # back), so load that drifts during the run cancels out.
            pairs = [t / a for t, a in zip(self.fanin_times, self.auth_times)]
            out["auth_goodput_ratio_paired"] = statistics.median(pairs)
            # CPU seconds (workers + switch) per allreduce, unkeyed / keyed:
            # what the goodput ratio is when the cores are the limit (as on
            # this 2-core machine), with much less noise than wall time.
            if self.cpu_s.get("fanin") and self.cpu_s.get("auth"):
                out["auth_cpu_ratio"] = sum(self.cpu_s["fanin"]) / sum(self.cpu_s["auth"])
        # Where the cores went, per arm: all workers plus the switch, and the
        # switch alone (median CPU seconds per allreduce).
        out["cpu_s_times"] = self.cpu_s.get("fanin", [])
        out["cpu_s_per_allreduce"] = {
            k: {"total": statistics.median(v), "switch": statistics.median(self.switch_cpu_s[k])}
            for k, v in self.cpu_s.items() if v}
        # The switch's cost per datagram it handled (received plus sent, a
        # group datagram counted once), per arm: its CPU time per allreduce
        # over N contributions and the results of every block (float32's
        # exponent rounds, a few blocks per allreduce, are left out). Next
        # to `udp_forward_bench` (raw recvmmsg/sendmmsg forwarding on the
        # same cores: 2 datagrams per forwarded one) it says what the
        # protocol costs over moving the bytes (issue 28, docs/network.md).
        blocks = -(-p.elements // p.elems_per_packet)
        # (the keyed arm's results go the same way as the unkeyed arm's:
        # to the group sealed once under the job's result key, or unicast)
        results_out = 1 if p.results == "multicast" else p.workers
        handled = {"fanin": blocks * (p.workers + results_out), "noaggr": 2 * blocks * p.workers,
                   "auth": blocks * (p.workers + results_out)}
        out["switch_ns_per_datagram"] = {k: statistics.median(v) * 1e9 / handled[k]
                                         for k, v in self.switch_cpu_s.items() if v}
        return out


def _worker(rank: int, switch: str, p: AllreduceParams, results: Any) -> None:
    try:
        from fanin import Session

        kw = dict(elems_per_packet=p.elems_per_packet, window=p.window, send_drop=p.loss, seed=p.seed * 1000 + rank)
        aggr = Session(switch, AGGR_JOB, rank, result_group=p.result_group, **kw)
        if p.result_group and not aggr.params["results_on_group"]:
            raise RuntimeError(f"the switch does not send job {AGGR_JOB}'s results to {p.result_group}")
        noaggr = Session(switch, NOAGGR_JOB, rank, **kw) if p.noaggr else None
        authed = None
        if p.auth:
            from fanin.auth import derive_member_key

            authed = Session(switch, AUTH_JOB, rank, auth_key=derive_member_key(p.job_key, AUTH_JOB, rank),
                             result_group=p.result_group, **kw)
            if p.result_group and not authed.params["results_on_group"]:
                raise RuntimeError(f"the switch does not send job {AUTH_JOB}'s results to {p.result_group}")
        x = worker_inputs(rank, p.elements, p.dtype)
        sync = np.zeros(1, dtype=np.int32)
        report: dict[str, Any] = {"rank": rank, "ok": True}
        # Correctness first, outside the timed loop. Every arm writes into
        # one preallocated array (`out=`), as torch.distributed's in-place
        # all_reduce into a preallocated tensor does in the Gloo arm; these
        # untimed calls also stage each session's buffer once.
        out = np.empty_like(x)
        aggr.allreduce(x, out=out)
        report["digest"] = hashlib.sha256(out.tobytes()).hexdigest()
        checker = ResultChecker(p.workers, x.size, p.dtype, p.elems_per_packet) if p.verify else None
        if checker is not None:
            report["check"] = checker.check(out)
        # What every timed call must give again, bit for bit: fanin's sum of
        # the same inputs is the same bits every time (with loss too: a
        # retransmission changes no sum); the keyed job's is the same sum.
        expected = {"fanin": out.copy()}
        if authed is not None:
            authed.allreduce(x, out=out)
            report["auth_digest"] = hashlib.sha256(out.tobytes()).hexdigest()
            expected["auth"] = expected["fanin"]
        if noaggr is not None:
            # NoAggr hands each worker its own contribution back, quantised
            # as the sum's is: within the sum's bound of its input.
            noaggr.allreduce(x, out=out)
            if checker is not None:
                report["noaggr_check"] = _check_own(out, x, checker, p.dtype)
            expected["noaggr"] = out.copy()
        times: dict[str, list[float]] = {"fanin": [], "noaggr": [], "auth": []}
        cpu: dict[str, list[float]] = {"fanin": [], "noaggr": [], "auth": []}
        switch_cpu: dict[str, list[float]] = {"fanin": [], "noaggr": [], "auth": []}
        timed_checked, timed_failed = 0, []
        retrans = 0
        for i in range(p.iters):
            order = [("fanin", aggr), ("noaggr", noaggr), ("auth", authed)]
            if i % 2:
                order.reverse()
            for name, sess in order:
                if sess is None:
                    continue
                aggr.allreduce(sync)  # barrier: everyone starts together
                s0 = process_cpu_seconds(p.switch_pid) if rank == 0 else 0.0
                c0 = time.process_time()
                t0 = time.perf_counter()
                sess.allreduce(x, out=out)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                if rank == 0:
                    switch_cpu[name].append(process_cpu_seconds(p.switch_pid) - s0)
                if name in ("fanin", "auth"):
                    retrans += sess.last_stats["retransmissions"]
                # every timed result checked, after its clock stopped
                if checker is not None:
                    timed_checked += 1
                    if not np.array_equal(out.view(np.uint8), expected[name].view(np.uint8)):
                        check = _check_own(out, x, checker, p.dtype) if name == "noaggr" else checker.check(out)
                        timed_failed.append({"arm": name, "iteration": i, **check, "ok": False})
            if rank == 0:
                results.put({"progress": i + 1})
        report["timed_results_checked"] = timed_checked
        report["timed_failures"] = timed_failed
        report["times"] = times
        report["cpu"] = cpu
        report["switch_cpu"] = switch_cpu
        report["retransmissions"] = retrans
        if authed is not None:
            report["auth_refused"] = {k: v for k, v in authed.socket_stats().items() if k.startswith("auth_")}
        results.put(report)
    except BaseException as e:  # reported to the parent, which fails the run
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def _check_own(out: np.ndarray, x: np.ndarray, checker: ResultChecker, dtype: str) -> dict[str, Any]:
    """NoAggr's result against the worker's own input: exact for int32,
    within the allreduce's per-element bound (plus an ulp) for floats."""
    if dtype == "int32":
        ok = bool(np.array_equal(out, x))
        return {"ok": ok, "max_abs_error": 0 if ok else int(np.max(np.abs(out.astype(np.int64) - x)))}
    err = np.abs(out.astype(np.float64) - x)
    ok = bool(np.all(err <= checker.bound + np.abs(out) * np.finfo(np.float32).eps))
    return {"ok": ok, "max_abs_error": float(err.max()) if err.size else 0.0}


def run_allreduce(p: AllreduceParams, label: str = "allreduce") -> AllreduceRun:
    """Start a switch process and `p.workers` worker processes; time fanin and
    NoAggr allreduce alternately; verify every worker's first result against
    the reference and every timed result against that one (outside the
    timing); NoAggr's against the worker's own input."""
    p.validate()
    p.result_group = free_result_group() if p.results == "multicast" else None
    jobs = [
        job_config(AGGR_JOB, p.workers, block_cnt_max=p.window, block_grad_max=p.elems_per_packet,
                   result_group=p.result_group),
        job_config(NOAGGR_JOB, p.workers, block_cnt_max=p.window, block_grad_max=p.elems_per_packet, mode="forward"),
    ]
    if p.auth:
        from fanin.auth import new_job_key

        p.job_key = p.job_key or new_job_key()
        jobs.append(job_config(AUTH_JOB, p.workers, block_cnt_max=p.window, block_grad_max=p.elems_per_packet,
                               key=p.job_key, result_group=p.result_group))
    cfg = switch_config(data_addr="127.0.0.1:0", shards=p.shards, control_addr=None, metrics_addr="127.0.0.1:0",
                        memory_mb=4096, ingress_drop=p.loss, egress_drop=p.loss, seed=p.seed, jobs=jobs)
    run = AllreduceRun(params=p)
    ctx = mp.get_context("spawn")
    with SwitchProcess(cfg) as sw:
        p.switch_pid = sw.proc.pid
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, p, results), daemon=True) for r in range(p.workers)]
        for pr in procs:
            pr.start()
        reports = []
        bar = _progress(p.iters, label) if p.progress else None
        deadline = time.monotonic() + 600 + p.iters * 120
        while len(reports) < p.workers:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline or all(not pr.is_alive() for pr in procs):
                    dead = [r for r, pr in enumerate(procs) if not pr.is_alive() and pr.exitcode]
                    raise RuntimeError(f"workers did not report (exited with errors: {dead})") from None
                continue
            if "progress" in msg:
                if bar is not None:
                    bar.update(1)
                continue
            reports.append(msg)
        if bar is not None:
            bar.close()
        for pr in procs:
            pr.join(timeout=30)
        run.counters = sw.counters()
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise RuntimeError("; ".join(f"worker {r['rank']}: {r['error']}" for r in failed))
    reports.sort(key=lambda r: r["rank"])
    # an iteration ends when the slowest worker has its result
    run.fanin_times = [max(r["times"]["fanin"][i] for r in reports) for i in range(p.iters)]
    if p.noaggr:
        run.noaggr_times = [max(r["times"]["noaggr"][i] for r in reports) for i in range(p.iters)]
    digests = {r["digest"] for r in reports}
    for arm in ("fanin", "noaggr", "auth"):
        if reports[0]["switch_cpu"][arm]:
            run.switch_cpu_s[arm] = reports[0]["switch_cpu"][arm]
            run.cpu_s[arm] = [sum(r["cpu"][arm][i] for r in reports) + run.switch_cpu_s[arm][i] for i in range(p.iters)]
    if p.auth:
        run.auth_times = [max(r["times"]["auth"][i] for r in reports) for i in range(p.iters)]
        digests |= {r["auth_digest"] for r in reports}
    run.retransmissions = sum(r["retransmissions"] for r in reports)
    run.checks = [r.get("check", {}) for r in reports]
    noaggr_checks = [r["noaggr_check"] for r in reports if "noaggr_check" in r]
    timed_failures = [{"rank": r["rank"], **f} for r in reports for f in r["timed_failures"]]
    run.timed_results_checked = sum(r["timed_results_checked"] for r in reports)
    run.verified = (p.verify and len(digests) == 1 and all(c.get("ok") for c in run.checks + noaggr_checks)
                    and not timed_failures)
    if p.verify and not run.verified:
        why = ("workers' results differ" if len(digests) != 1
               else f"a timed result differs from the verified one: {timed_failures[:4]}" if timed_failures
               else f"a result differs from the reference: {run.checks} (NoAggr: {noaggr_checks})")
        raise RuntimeError(f"verification failed: {why}")
    return run


def run_bench_allreduce(args: Any) -> int:
    """`fanin bench allreduce`."""
    def refuse(why: str) -> int:
        print(f"fanin bench allreduce: {why}", file=sys.stderr)
        return 2

    # a value given is used or refused, never replaced by the default (--iters 0 ran 3 iterations)
    if args.iters is not None and args.iters < 1:
        return refuse(f"--iters {args.iters} is out of range: give at least 1")
    if not 1 <= args.shards <= 64:  # the switch's own range (fanin-switch config)
        return refuse(f"--shards {args.shards} is out of range: give 1..64")
    try:
        size = parse_size(args.size) if args.size is not None else (16_000_000 if args.quick else 100_000_000)
    except ValueError as e:
        return refuse(f"--size: {e}")
    if size < 4:  # 4 bytes: one float32 / int32 (--size 0 ran one element and reported verified=True)
        return refuse(f"--size {args.size} is out of range: give at least 4 bytes (one element)")
    p = AllreduceParams(workers=args.workers, elements=size // 4, dtype=args.dtype,
                        elems_per_packet=args.elems_per_packet, window=args.window, loss=args.loss,
                        iters=args.iters if args.iters is not None else (3 if args.quick else 7), shards=args.shards,
                        seed=args.seed, auth=args.auth, noaggr=not args.auth, results=args.results)
    try:
        p.validate()
    except ValueError as e:
        return refuse(str(e))
    s = run_allreduce(p).summary()
    human = (f"fanin allreduce {args.workers} workers x {format_size(size)} {args.dtype}: median {s['median_s']:.3f} s "
             f"({s['goodput_gbps']:.2f} Gbit/s per worker), ")
    if args.auth:
        human += (f"authenticated {s['auth_median_s']:.3f} s ({s['auth_goodput_gbps']:.2f} Gbit/s), "
                  f"auth_goodput_ratio {s['auth_goodput_ratio']:.3f} (CPU: {s.get('auth_cpu_ratio', float('nan')):.3f}), ")
    else:
        human += f"NoAggr {s['noaggr_median_s']:.3f} s, ratio_vs_noaggr {s['ratio_vs_noaggr']:.2f}, "
    human += f"{s['retransmissions']} retransmissions, verified={s['verified']}"

    emit(s, human, args.json)
    return 0


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=label, unit="iter", file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return None
