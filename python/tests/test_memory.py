"""Pooled aggregation memory (Trio-ML's model, docs/memory.md) on the real
daemon: jobs whose caps add up to four times the switch's memory run at
once through one `fanin switch` process and all finish exactly (the
workers acknowledge the results they hold when the switch is short of
memory, and it frees what every member holds); the reserved model
(SwitchML's) refuses the same set of jobs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import fanin
from fanin.proc import SwitchProcess, check_result, worker_inputs
from fanin.switch import job_config, switch_config

JOBS, MEMBERS, SLOTS, ELEMS = 16, 2, 32, 1024
SIZE = 100_000  # int32 elements per worker: ~98 blocks per job


def _config(memory_model: str) -> dict:
    # 1 MiB for all jobs: each reserves its record (~26 KiB) and one 4 KiB
    # buffer, and may hold two per slot (256 KiB): the sixteen jobs' caps
    # are 4 MiB, four times the memory; reserved, only three fit
    jobs = [job_config(j, MEMBERS, block_cnt_max=SLOTS, block_grad_max=ELEMS) for j in range(1, JOBS + 1)]
    return switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", shards=1,
                         memory_mb=1, memory_model=memory_model, jobs=jobs)


def test_the_reserved_model_refuses_jobs_whose_buffers_exceed_the_memory(tmp_path):
    path = tmp_path / "switch.json"
    path.write_text(json.dumps(_config("reserved")))
    r = subprocess.run([sys.executable, "-m", "fanin", "switch", "--config", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert "job 4 needs" in r.stderr and "bytes of aggregation memory" in r.stderr, r.stderr


def test_jobs_whose_caps_exceed_the_memory_run_together_and_are_exact():
    results: dict = {}

    def worker(job: int, rank: int, addr: str) -> None:
        try:
            s = fanin.Session(addr, job, rank, elems_per_packet=ELEMS)
            y = s.allreduce(worker_inputs(rank, SIZE, "int32"))
            results[(job, rank)] = check_result(y, MEMBERS, "int32", ELEMS)["ok"]
        except BaseException as e:  # reported by the assertion below
            results[(job, rank)] = repr(e)

    with SwitchProcess(_config("pooled")) as sw:
        threads = [threading.Thread(target=worker, args=(j, r, sw.data_addr))
                   for j in range(1, JOBS + 1) for r in range(MEMBERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        counters = sw.counters()
    assert len(results) == JOBS * MEMBERS and all(v is True for v in results.values()), results
    assert counters["blocks_completed"] >= JOBS * (SIZE // ELEMS)
    print({k: counters.get(k) for k in ("memory_exhausted", "records_recycled", "result_acks", "records_acked",
                                        "records_evicted")})
    # the memory was short, and acknowledgements freed it
    assert counters["memory_exhausted"] > 0 and counters["result_acks"] > 0 and counters["records_acked"] > 0


def test_the_memory_bench_runs_both_models_and_prints_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "memory", "--quick", "--json", "--elems", "20000",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    by = {x["model"]: x for x in out["results"]}
    # sixteen jobs whose caps are four times the memory, against three
    assert by["reserved"]["jobs_admitted"] == 3 and by["pooled"]["jobs_admitted"] == 16
    assert by["pooled"]["caps_over_memory"] == 4.0 and out["jobs_ratio"] == 5.33
    assert all(x["exact"] for x in out["results"]) and "job 4 needs" in by["reserved"]["refused"]
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "memory.csv").exists()
