"""``fanin bench memory``: the switch's two memory models side by side.

Two ``fanin switch`` processes (one shard each) with ``--memory-mb`` of
aggregation memory, one with ``memory_model = "reserved"`` (SwitchML:
two buffers per slot reserved per job), one ``"pooled"`` (Trio-ML: one
buffer reserved per job, every other block record from the memory all
jobs share, freed once every member acknowledged its result;
docs/memory.md). Both switches run side by side: under each, jobs of the
same shape are admitted through the control API until the switch refuses
one; then, ``--repeats`` times and alternating between the two switches,
every job admitted on one runs at once (``--members`` workers each,
threads of this process, an int32 allreduce of ``--elems`` elements).
Only the allreduces are timed; every result is checked exactly after the
clock stops (a wrong one fails the run). Reported
per model: jobs admitted and their caps over the memory, wall time
(median), aggregate and per-job goodput, the switch's back-pressure nacks
for memory, recycled, acknowledged and evicted records.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from typing import Any

__all__ = ["run_memory"]

MODELS = ("reserved", "pooled")


class _Model:
    """One switch process under one memory model, its jobs admitted until
    it refuses one, and a thread per member of every admitted job, each
    holding its Session between runs. `run_once` runs every job at once and
    times only the allreduces: the results are checked after the clock
    stops, before the next run starts."""

    def __init__(self, model: str, args: Any, elems: int, inputs: dict[int, Any], stack: Any):
        from fanin.control import ControlClient, ControlError
        from fanin.proc import SwitchProcess
        from fanin.switch import switch_config

        self.model, self.args = model, args
        cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0",
                            shards=1, memory_mb=args.memory_mb, memory_model=model, jobs=[])
        self.sw = stack.enter_context(SwitchProcess(cfg))
        self.admitted: list[int] = []
        self.refusal = ""
        with ControlClient(self.sw.control_addr) as c:
            for job in range(1, args.jobs + 1):
                try:
                    c.admit_job(job, range(args.members), block_cnt_max=args.slots, block_grad_max=args.packet)
                except ControlError as e:
                    if e.code != "RESOURCE_EXHAUSTED":
                        raise
                    self.refusal = e.message
                    break
                self.admitted.append(job)
        if not self.admitted:
            raise SystemExit(f"bench memory: the {model} switch admits no job of this shape: {self.refusal}")
        self.inputs, self.times, self.failures = inputs, [], []
        parties = len(self.admitted) * args.members + 1
        # start -> (allreduce) -> done -> (check) -> checked
        self.start, self.done, self.checked = (threading.Barrier(parties) for _ in range(3))
        self.stopping = False
        self.threads = [threading.Thread(target=self._worker, args=(j, r), daemon=True)
                        for j in self.admitted for r in range(args.members)]
        for t in self.threads:
            t.start()

    def _worker(self, job: int, rank: int) -> None:
        import fanin

        args, checker = self.args, self.args.checker
        out = self.inputs[rank].copy()
        try:
            s = fanin.Session(self.sw.data_addr, job, rank, elems_per_packet=args.packet)
        except BaseException as e:  # reported after the run
            self.failures.append(f"job {job} rank {rank}: {e!r}")
            s = None
        while True:
            self.start.wait()
            if self.stopping:
                return
            failed = s is None
            try:
                if s is not None:
                    s.allreduce(self.inputs[rank], out=out)
            except BaseException as e:
                self.failures.append(f"job {job} rank {rank}: {e!r}")
                failed = True
            self.done.wait()
            if not failed and not checker.check(out)["ok"]:
                self.failures.append(f"job {job} rank {rank}: wrong result")
            self.checked.wait()

    def run_once(self, timed: bool = True) -> float:
        self.start.wait()
        t0 = time.perf_counter()
        self.done.wait()
        wall = time.perf_counter() - t0
        if timed:
            self.times.append(wall)
        self.checked.wait()
        return wall

    def finish(self) -> dict[str, Any]:
        self.stopping = True
        self.start.wait()
        for t in self.threads:
            t.join(timeout=60)
        counters = self.sw.counters()
        if self.failures:
            raise SystemExit(f"bench memory: {self.model}: {self.failures[0]} ({len(self.failures)} failures)")
        args = self.args
        wall = statistics.median(self.times)
        bits = args.elems * 4 * 8
        cap_bytes = 2 * args.slots * args.packet * 4  # a block and its shadow in every slot
        return {"model": self.model, "jobs_admitted": len(self.admitted), "refused": self.refusal,
                "caps_over_memory": round(len(self.admitted) * cap_bytes / (args.memory_mb << 20), 2),
                "wall_s": round(wall, 3),
                "runs_s": [round(t, 3) for t in self.times],
                "aggregate_gbit_s": round(len(self.admitted) * bits / wall / 1e9, 3),
                "per_job_gbit_s": round(bits / wall / 1e9, 3),
                "memory_exhausted": counters.get("memory_exhausted", 0),
                "records_recycled": counters.get("records_recycled", 0),
                "result_acks": counters.get("result_acks", 0), "records_acked": counters.get("records_acked", 0),
                "records_evicted": counters.get("records_evicted", 0), "exact": True}


class _SharedChecker:
    """One ResultChecker (every job sums the same inputs) for all threads."""

    def __init__(self, members: int, elems: int, packet: int):
        from fanin.proc import ResultChecker

        self._checker = ResultChecker(members, elems, "int32", packet)
        self._lock = threading.Lock()

    def check(self, result: Any) -> dict[str, Any]:
        with self._lock:
            return self._checker.check(result)


def _run_models(args: Any, elems: int, repeats: int) -> list[dict[str, Any]]:
    """Both models' switches up at once, their runs alternated (reserved
    first on odd runs, pooled first on even), so load that drifts during
    the benchmark falls on both."""
    from contextlib import ExitStack

    from fanin.proc import worker_inputs

    args.elems = elems
    args.checker = _SharedChecker(args.members, elems, args.packet)
    inputs = {r: worker_inputs(r, elems, "int32") for r in range(args.members)}
    with ExitStack() as stack:
        models = {m: _Model(m, args, elems, inputs, stack) for m in MODELS}
        for m in MODELS:
            # untimed, as for every arm of every benchmark: the sessions'
            # first allreduce stages their buffers (page faults, sockets)
            models[m].run_once(timed=False)
        for i in range(repeats):
            for m in (MODELS if i % 2 == 0 else MODELS[::-1]):
                wall = models[m].run_once()
                print(f"bench memory: {m}, {len(models[m].admitted)} jobs, run {i + 1}/{repeats}: {wall:.2f} s",
                      file=sys.stderr)
        return [models[m].finish() for m in MODELS]


def run_memory(args: Any) -> int:
    from fanin_bench.bench.kv_wordcount import _write_csv

    elems = args.elems or (100_000 if args.quick else 4_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    rows = _run_models(args, elems, repeats)
    by = {r["model"]: r for r in rows}
    out = {"benchmark": "memory", "memory_mb": args.memory_mb, "members": args.members, "slots": args.slots,
           "packet_elems": args.packet, "elems_per_worker": elems, "repeats": repeats, "results": rows,
           "jobs_ratio": round(by["pooled"]["jobs_admitted"] / by["reserved"]["jobs_admitted"], 2),
           "aggregate_goodput_ratio": round(by["pooled"]["aggregate_gbit_s"] / by["reserved"]["aggregate_gbit_s"], 2)}
    csv_path = os.path.join(args.out, "memory.csv")
    _write_csv(csv_path, [{k: v for k, v in r.items() if k != "refused"} for r in rows])
    png_path = os.path.join(args.out, "memory.png")
    _plot(rows, png_path, args)
    out.update(csv=csv_path, png=png_path)
    if args.json:
        print(json.dumps(out))
    print(f"{args.memory_mb} MiB, jobs of {args.members} workers x {args.slots} slots x {args.packet} elements, "
          f"{elems} int32 each, median of {repeats}; every result exact:", file=sys.stderr)
    for r in rows:
        print(f"  {r['model']:8}  {r['jobs_admitted']} jobs at once (caps {r['caps_over_memory']}x the memory)  "
              f"{r['wall_s']:6.2f} s  {r['aggregate_gbit_s']:6.3f} Gbit/s in all ({r['per_job_gbit_s']:.3f} per job)  "
              f"memory nacks {r['memory_exhausted']}, recycled {r['records_recycled']}, "
              f"acknowledged {r['records_acked']}, evicted {r['records_evicted']}", file=sys.stderr)
    return 0


def _plot(rows: list[dict[str, Any]], path: str, args: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fanin_bench.plotting import save_figure

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = [r["model"] for r in rows]
    a.bar(names, [r["jobs_admitted"] for r in rows], color=["tab:gray", "tab:blue"])
    a.set_ylabel("jobs running at once")
    b.bar(names, [r["aggregate_gbit_s"] for r in rows], color=["tab:gray", "tab:blue"])
    b.set_ylabel("aggregate goodput (Gbit/s)")
    fig.suptitle(f"{args.memory_mb} MiB switch memory, jobs of {args.slots} slots x {args.packet} elements")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
