"""``fanin bench memory``: the switch's two memory models side by side.

One ``fanin switch`` process (one shard) with ``--memory-mb`` of
aggregation memory, first with ``memory_model = "reserved"`` (SwitchML:
two buffers per slot reserved per job), then ``"pooled"`` (Trio-ML: one
buffer reserved per job, every other block record from the memory all
jobs share, freed once every member acknowledged its result;
docs/memory.md). Under each, jobs of the same shape are admitted through
the control API until the switch refuses one, and then every admitted job
runs at once (``--members`` workers each, threads of this process, an
int32 allreduce of ``--elems`` elements, ``--repeats`` times). Reported
per model: jobs admitted and their caps over the memory, wall time
(median), aggregate and per-job goodput, the switch's back-pressure nacks
for memory, recycled, acknowledged and evicted records; every result is
checked exactly or the run fails.
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


def _run_model(model: str, args: Any, elems: int, repeats: int) -> dict[str, Any]:
    import fanin
    from fanin.control import ControlClient, ControlError
    from fanin.proc import SwitchProcess, check_result, worker_inputs
    from fanin.switch import switch_config

    cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0", shards=1,
                        memory_mb=args.memory_mb, memory_model=model, jobs=[])
    with SwitchProcess(cfg) as sw:
        admitted, refusal = [], ""
        with ControlClient(sw.control_addr) as c:
            for job in range(1, args.jobs + 1):
                try:
                    c.admit_job(job, range(args.members), block_cnt_max=args.slots, block_grad_max=args.packet)
                except ControlError as e:
                    if e.code != "RESOURCE_EXHAUSTED":
                        raise
                    refusal = e.message
                    break
                admitted.append(job)
        if not admitted:
            raise SystemExit(f"bench memory: the {model} switch admits no job of this shape: {refusal}")
        inputs = {r: worker_inputs(r, elems, "int32") for r in range(args.members)}
        times: list[float] = []
        failures: list[str] = []
        start = threading.Barrier(len(admitted) * args.members + 1)
        done = threading.Barrier(len(admitted) * args.members + 1)

        def worker(job: int, rank: int) -> None:
            try:
                s = fanin.Session(sw.data_addr, job, rank, elems_per_packet=args.packet)
            except BaseException as e:  # reported after the run
                failures.append(f"job {job} rank {rank}: {e!r}")
                s = None
            for _ in range(repeats):
                start.wait()
                try:
                    if s is not None:
                        y = s.allreduce(inputs[rank])
                        if not check_result(y, args.members, "int32", args.packet)["ok"]:
                            failures.append(f"job {job} rank {rank}: wrong result")
                except BaseException as e:
                    failures.append(f"job {job} rank {rank}: {e!r}")
                done.wait()

        threads = [threading.Thread(target=worker, args=(j, r), daemon=True) for j in admitted
                   for r in range(args.members)]
        for t in threads:
            t.start()
        for i in range(repeats):
            start.wait()
            t0 = time.perf_counter()
            done.wait()
            times.append(time.perf_counter() - t0)
            print(f"bench memory: {model}, {len(admitted)} jobs, run {i + 1}/{repeats}: {times[-1]:.2f} s",
                  file=sys.stderr)
        for t in threads:
            t.join(timeout=60)
        counters = sw.counters()
    if failures:
        raise SystemExit(f"bench memory: {model}: {failures[0]} ({len(failures)} failures)")
    wall = statistics.median(times)
    bits = elems * 4 * 8
    cap_bytes = 2 * args.slots * args.packet * 4  # a block and its shadow in every slot
    return {"model": model, "jobs_admitted": len(admitted), "refused": refusal,
            "caps_over_memory": round(len(admitted) * cap_bytes / (args.memory_mb << 20), 2),
            "wall_s": round(wall, 3),
            "runs_s": [round(t, 3) for t in times],
            "aggregate_gbit_s": round(len(admitted) * bits / wall / 1e9, 3),
            "per_job_gbit_s": round(bits / wall / 1e9, 3),
            "memory_exhausted": counters.get("memory_exhausted", 0),
            "records_recycled": counters.get("records_recycled", 0),
            "result_acks": counters.get("result_acks", 0), "records_acked": counters.get("records_acked", 0),
            "records_evicted": counters.get("records_evicted", 0), "exact": True}


def run_memory(args: Any) -> int:
    from fanin_bench.bench.kv_wordcount import _write_csv

    elems = args.elems or (100_000 if args.quick else 4_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    rows = [_run_model(m, args, elems, repeats) for m in MODELS]
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
