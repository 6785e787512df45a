"""`fanin demo`: a switch process and 4 worker processes on 127.0.0.1,
allreduce of float32 and int32 tensors with injected loss, every result
checked against the reference."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import numpy as np

from fanin.proc import SwitchProcess, check_result, format_size, worker_inputs
from fanin.switch import check_int, check_probability, job_config, switch_config

#: The demo's limits: one process per worker on this machine; a tensor up to 1 GiB of float32 per worker.
MAX_WORKERS = 256
MAX_ELEMENTS = 2**28
MAX_ROUNDS = 10_000


def _worker(rank: int, switch: str, workers: int, elements: int, loss: float, rounds: int, results: Any) -> None:
    try:
        from fanin import Session

        s = Session(switch, 1, rank, send_drop=loss, seed=rank + 1)
        report: dict[str, Any] = {"rank": rank, "ok": True, "runs": []}
        for it in range(rounds):
            for dtype in ("float32", "int32"):
                x = worker_inputs(rank, elements, dtype, it)
                t0 = time.perf_counter()
                out = s.allreduce(x)
                dt = time.perf_counter() - t0
                check = check_result(out, workers, dtype, s.elems_per_packet, it)
                report["runs"].append({
                    "iteration": it, "dtype": dtype, "seconds": dt,
                    "digest": hashlib.sha256(out.tobytes()).hexdigest(),
                    "retransmissions": s.last_stats["retransmissions"], **check,
                })
        results.put(report)
    except BaseException as e:
        results.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


#: What the demo prints after a pass: where a new user goes from here.
NEXT_STEPS = """
Try next:
  fanin switch --job id=1,sources=2 &      then two fanin.Session ranks: the README's "Using it"
  torchrun --nproc-per-node 4 examples/train_digits.py        PyTorch DDP on fanin (docs/torch.md)
  fanin bench allreduce --quick                               fanin vs the NoAggr baseline (docs/results.md)
  fanin kv daemon --help                                      key-value aggregation (docs/kv.md)
  fanin --help                                                every command"""


def network_run(say: Callable[..., None], workers: int = 4, rate_mbit: float = 200) -> Optional[dict[str, Any]]:
    """The same library where in-network aggregation can win: `fanin bench
    network --quick` on the namespace testbed (every link limited to
    `rate_mbit`), with Gloo's ring beside fanin when PyTorch is installed.
    Run as a command, since the benchmarks are not part of the library. None
    (and the reason said) where it cannot run: it needs root."""
    with tempfile.TemporaryDirectory(prefix="fanin-demo-") as out:
        argv = [sys.executable, "-m", "fanin", "bench", "network", "--quick", "--json", "--workers", str(workers),
                "--rates", f"{rate_mbit:g}", "--out", out]
        if importlib.util.find_spec("torch") is None:
            argv.append("--no-gloo")
        say(f"fanin demo: the same on a network: {workers} hosts and a switch in network namespaces, every link "
            f"limited to {rate_mbit:g} Mbit/s (fanin bench network --quick)")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    why = (r.stderr.strip().splitlines() or ["no output"])[-1]
    if r.returncode == 2:  # the bench's "cannot run here" (not root, no namespaces)
        say(f"  skipped: {why}")
        return None
    if r.returncode != 0:  # a wrong sum raises in the bench: the demo fails
        raise RuntimeError(f"the network run failed: {why}")
    report = json.loads(r.stdout)
    (row,) = report["rates"]
    line = (f"  links measured at {row['capacity_mbit']:.0f} Mbit/s: fanin {row['fanin_median_s']:.3f} s = "
            f"{row['fanin_fraction_of_capacity']:.2f} of capacity")
    if "gloo_median_s" in row:
        line += (f"; Gloo's ring {row['gloo_median_s']:.3f} s: fanin is {row['speedup_vs_gloo']:.2f}x Gloo "
                 f"(ideal {row['ideal_speedup']:.2f}x)")
    say(line + f"; {row['elems_per_packet']} elements per packet, {row['ip_fragments']} IP fragments, "
               f"{row['timeouts']} stall timeouts, results verified")
    return row


def run_demo(workers: int = 4, elements: int = 1_000_000, loss: float = 0.05, rounds: int = 2,
             shards: int = 2, as_json: bool = False, network: bool = True) -> int:
    # up front: 0 elements or rounds passed having checked nothing, and a bad worker or shard count or loss
    # failed only as "fanin switch exited with code 2"
    check_int("workers", workers, 1, MAX_WORKERS)
    check_int("elements", elements, 1, MAX_ELEMENTS)
    check_int("rounds", rounds, 1, MAX_ROUNDS)
    check_int("shards", shards, 1, 64)
    if check_probability("loss", loss) >= 1.0:
        raise ValueError(f"loss = {loss} drops every datagram: give a probability below 1 (e.g. 0.05)")
    cfg = switch_config(data_addr="127.0.0.1:0", shards=shards, control_addr=None, metrics_addr="127.0.0.1:0",
                        egress_drop=loss, seed=7, jobs=[job_config(1, workers)])
    say = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    with SwitchProcess(cfg) as sw:
        say(f"fanin demo: switch {sw.data_addr} ({shards} shards), {workers} worker processes, "
            f"{loss:.0%} loss injected on every worker send and every switch send")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, workers, elements, loss, rounds, results))
                 for r in range(workers)]
        for p in procs:
            p.start()
        reports = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        counters = sw.counters()
    failed = [r for r in reports if not r["ok"]]
    if failed:
        for r in failed:
            say(f"  worker {r['rank']} FAILED: {r['error']}")
        return 1
    ok = True
    rows = []
    for it in range(rounds):
        for dtype in ("float32", "int32"):
            runs = [next(x for x in r["runs"] if x["iteration"] == it and x["dtype"] == dtype) for r in reports]
            identical = len({x["digest"] for x in runs}) == 1
            correct = all(x["ok"] for x in runs)
            ok &= identical and correct
            rows.append({"iteration": it, "dtype": dtype, "identical": identical, "correct": correct,
                         "seconds": max(x["seconds"] for x in runs),
                         "retransmissions": sum(x["retransmissions"] for x in runs),
                         "max_abs_error": max(x["max_abs_error"] for x in runs),
                         "max_bound": max(x.get("max_bound", 0.0) for x in runs),
                         "worst_fraction_of_bound": max(x.get("worst_fraction_of_bound", 0.0) for x in runs)})
            verdict = "ok" if identical and correct else "MISMATCH"
            if dtype == "int32":
                detail = "exact" if correct else "NOT exact"
            else:
                detail = (f"max error {rows[-1]['max_abs_error']:.2e}, every element within its bound "
                          f"(worst at {rows[-1]['worst_fraction_of_bound']:.0%} of it)")
            say(f"  round {it + 1} {dtype:7s} {workers} x {format_size(elements * 4)}: {verdict}, "
                f"bit-identical on all workers, {detail}; {rows[-1]['seconds']:.3f} s, "
                f"{rows[-1]['retransmissions']} retransmissions")
    say(f"  switch: {counters.get('blocks_completed', 0)} blocks aggregated, "
        f"{counters.get('duplicate', 0)} duplicate contributions ignored, "
        f"{counters.get('results_resent', 0)} results resent from the shadow copies, "
        f"{counters.get('malformed', 0)} malformed")
    net = None
    if ok and network:
        try:
            net = network_run(say, workers)
        except RuntimeError as e:
            say(f"  FAILED: {e}")
            ok = False
    say("PASS" if ok else "FAIL")
    if ok:
        say(NEXT_STEPS)
    if as_json:
        print(json.dumps({"ok": ok, "workers": workers, "elements": elements, "loss": loss, "rows": rows,
                          "switch_counters": counters, "network": net}))
    return 0 if ok else 1
