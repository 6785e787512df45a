"""Straggler mitigation end to end: the daemon's scanners, real UDP sockets,
the Python API (docs/stragglers.md)."""

import threading
import time

import numpy as np
import pytest

import fanin
from fanin.proc import worker_inputs
from fanin.switch import LocalSwitch, job_config, switch_config
from threads import in_threads


def straggler_switch(members, block_exp_ms, slow_after_windows=2, block_cnt_max=16, checks=4, scanner_threads=False):
    job = job_config(1, members=members, block_cnt_max=block_cnt_max, block_grad_max=256,
                     block_exp_ms=block_exp_ms, slow_after_windows=slow_after_windows)
    return LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, checks=checks,
                                     scanner_threads=scanner_threads, jobs=[job]))


# scanners on the shard threads (between batches), or as timer threads of
# their own visiting the shards' scan words (Trio's design, [aging] threads)
@pytest.mark.parametrize("scanner_threads", [False, True], ids=["shard-scanners", "scanner-threads"])
def test_a_silent_member_yields_partial_results_within_the_timeout(scanner_threads):
    with straggler_switch([0, 1, 2], block_exp_ms=20, slow_after_windows=0, scanner_threads=scanner_threads) as sw:
        blocks = 10
        finished = threading.Semaphore(0)

        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=256)
            if rank == 2:
                # joined (the round starts when all three have), then silent
                for _ in range(2):
                    assert finished.acquire(timeout=30)
                return None
            x = worker_inputs(rank, blocks * 256, "float32")
            t0 = time.perf_counter()
            total = s.allreduce(x)
            elapsed = time.perf_counter() - t0
            mean = s.allreduce(x, average=True)
            finished.release()
            return total, mean, elapsed, s.last_stats

        (t0, m0, e0, st0), (t1, m1, e1, st1), _ = in_threads(3, work)
        counters = sw.counters()
    assert t0.tobytes() == t1.tobytes() and m0.tobytes() == m1.tobytes()
    x0, x1 = worker_inputs(0, 2560, "float32"), worker_inputs(1, 2560, "float32")
    exact = x0.astype(np.float64) + x1
    assert np.allclose(t0, exact, rtol=1e-5, atol=1e-6), "the partial sum is the sum of the two active workers"
    # averaging divides by src_cnt (2), not by the job size (3)
    assert np.allclose(m0, exact / 2, rtol=1e-5, atol=1e-6)
    assert st0["min_src_cnt"] == 2 and len(st0["degraded_blocks"]) == blocks
    assert all(cnt == 2 for _, cnt in st0["degraded_blocks"])
    # the exponent round and the data round each age once: about 2 timeouts,
    # well under a second
    assert e0 < 0.5, e0
    assert counters["blocks_aged"] >= blocks and counters["blocks_degraded"] >= blocks


def test_a_late_worker_gets_what_the_switch_still_has_then_rejoins_the_job():
    n_elems = 4 * 256
    with straggler_switch([0, 1, 2], block_exp_ms=50, slow_after_windows=1, block_cnt_max=4) as sw:
        barrier = threading.Barrier(3)

        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=256, window=4)
            x = np.full(n_elems, rank + 1, dtype=np.int32)
            if rank == 2:
                time.sleep(0.5)  # straggles through the first allreduce
            first = s.allreduce(x)
            st_first = s.last_stats
            barrier.wait()  # from here on everyone is on time
            if rank != 2:
                # the former straggler opens the blocks (it has caught up); the
                # others follow well within the 50 ms timeout
                time.sleep(0.005)
            second = s.allreduce(x)
            return first, st_first, second, s.last_stats

        results = in_threads(3, work)
        counters = sw.counters()
    (f0, st0, s0, _), (f1, _, s1, _), (f2, st2, s2, st2b) = results
    # the punctual workers got the partial sum 1 + 2 without worker 2
    assert np.array_equal(f0, np.full(n_elems, 3, dtype=np.int32)) and np.array_equal(f0, f1)
    assert st0["min_src_cnt"] == 2
    # the straggler got, per block, the same partial result or a missed block (zeros)
    for b in range(4):
        block = f2[b * 256:(b + 1) * 256]
        assert np.array_equal(block, f0[b * 256:(b + 1) * 256]) or not block.any()
    assert st2["missed_blocks"] == sum(1 for _, c in st2["degraded_blocks"] if c == 0)
    # it caught up: the next allreduce includes everyone again
    assert counters["declared_slow"] >= 1
    full = np.full(n_elems, 6, dtype=np.int32)
    assert np.array_equal(s0, full) and np.array_equal(s1, full) and np.array_equal(s2, full)
    assert st2b["min_src_cnt"] == 3


def test_averaging_an_int32_tensor_is_refused():
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        with pytest.raises(TypeError, match="average=True needs a float array"):
            s.allreduce(np.ones(4, dtype=np.int32), average=True)


def test_aging_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match="aging.checks 0 is out of range"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, checks=0))
    with pytest.raises(ValueError, match="slow_after_windows 20000 is out of range"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None,
                                  jobs=[job_config(1, 2, block_exp_ms=5, slow_after_windows=20000)]))
    # 1 ms over 100 scanners x 4 checks is a 2.5 us tick: refused at admission
    with pytest.raises(Exception, match="block_exp_ms 1 with 100 scanners x 4 checks"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, scanners=100,
                                  jobs=[job_config(1, 2, block_exp_ms=1)]))


def test_a_quorum_completes_blocks_with_the_first_k_workers_and_a_controller_changes_k():
    # GOAT's K_t (docs/goat.md): 4 members, K = 3, on the real daemon
    from fanin.control import ControlClient
    from fanin.proc import SwitchProcess

    job = job_config(1, members=[0, 1, 2, 3], block_cnt_max=16, block_grad_max=256, quorum=3)
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0", jobs=[job])
    n = 8 * 256
    x = [np.full(n, 1 << r, dtype=np.int32) for r in range(4)]
    with SwitchProcess(cfg) as sw:
        first_three, epoch = threading.Barrier(4), threading.Barrier(4)

        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=256)
            if rank == 3:
                first_three.wait(timeout=30)  # joined; contributes after the others have their sums
            out = s.allreduce(x[rank])
            stats = s.last_stats
            if rank != 3:
                first_three.wait(timeout=30)
            epoch.wait(timeout=30)
            if rank == 0:
                # the controller installs K = 0 (every member) for the next epoch
                with ControlClient(sw.control_addr) as c:
                    (spec,) = c.list_jobs()
                    assert spec["quorum"] == 3
                    c.update_job({**spec, "quorum": 0})
                    assert c.list_jobs()[0]["quorum"] == 0
            epoch.wait(timeout=30)
            return out, stats, s.allreduce(x[rank]), s.last_stats

        results = in_threads(4, work)
        counters = sw.counters()
    for out, stats, everyone, stats2 in results:
        # the first three complete every block: 1 + 2 + 4, never the late 8
        assert np.all(out == 7), out[:4]
        assert stats["min_src_cnt"] == 3 and len(stats["degraded_blocks"]) == 8
        # then every member's: 15, nothing degraded
        assert np.all(everyone == 15), everyone[:4]
        assert not stats2["degraded_blocks"]
    # The late worker's 8 blocks reached the switch after completion and were
    # counted late, not added; or its session read their results while it
    # was still joining (they go to every member) and it sent nothing for
    # them: 4 joins, the first three's 3 x 8 blocks, then everyone's 4 x 8.
    assert counters["late"] == 8 or (counters["late"] == 0 and counters["rx_datagrams"] == 4 + 3 * 8 + 4 * 8), counters


def test_a_quorum_is_not_added_to_a_running_job_whose_workers_refuse_partial_results():
    # its workers joined told that every result sums every member: a K below
    # that would hand them sums they raise on (docs/protocol.md §4.15)
    from fanin.control import ControlClient, ControlError
    from fanin.proc import SwitchProcess

    cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr=None,
                        jobs=[job_config(1, members=[0, 1, 2]), job_config(2, members=[0, 1, 2], quorum=3)])
    with SwitchProcess(cfg) as sw, ControlClient(sw.control_addr) as c:
        specs = {s["job_id"]: s for s in c.list_jobs()}
        with pytest.raises(ControlError, match="quorum = its member count"):
            c.update_job({**specs[1], "quorum": 2})
        assert {s["job_id"]: s["quorum"] for s in c.list_jobs()} == {1: 0, 2: 3}
        c.update_job({**specs[2], "quorum": 2})  # admitted with one: K may change
        assert {s["job_id"]: s["quorum"] for s in c.list_jobs()} == {1: 0, 2: 2}


# ------------------------------------------------ straggler-iterations bench

def _fake_run(rows_by_rank, blocks=4):
    """A run of `_run_arm` as `_arm_point` reads it: rows per rank."""
    reports = []
    for rank, rows in rows_by_rank.items():
        full = [{"iter": i, "wall_s": w, "own_delay_s": d, "min_src_cnt": 3 if not deg else min(c for _, c in deg),
                 "missed_blocks": sum(c == 0 for _, c in deg), "degraded_blocks": len(deg), "blocks": blocks,
                 "degraded": deg, "check_s": 0.0, "check_overrun_s": 0.0} for i, (w, d, deg) in enumerate(rows)]
        reports.append({"rank": rank, "ok": True, "rows": full, "result_errors": [], "results_checked": len(rows),
                        "blocks_verified": 0, "blocks": blocks})
    return {"arm": "mitigation", "p": 0.5, "reports": reports, "counters": {}}


def test_the_iteration_headline_keeps_the_slow_iterations_of_the_mitigation_arm():
    # audit: iteration_s averaged only rows with own_delay 0 and no missed
    # blocks, and only the mitigation arm misses blocks: its slow iterations
    # were dropped, the ideal's kept. The headline now takes, per iteration,
    # the slowest worker the schedule did not delay, whatever happened to it.
    from fanin_bench.bench import stragglers

    schedule = [[(2, 0.3), None, None], [None, None, None]]
    run = _fake_run({
        # iteration 0: rank 2 straggles; iteration 1: rank 1 arrives late
        # (catching up) and misses two blocks, a slow iteration for it
        0: [(0.20, 0.0, [(0, 2), (1, 2), (2, 2), (3, 2)]), (0.15, 0.0, [])],
        1: [(0.22, 0.0, [(0, 2), (1, 2), (2, 2), (3, 2)]), (0.60, 0.0, [(0, 0), (1, 0)])],
        2: [(0.55, 0.3, [(0, 0), (1, 0), (2, 0), (3, 0)]), (0.15, 0.0, [])],
    })
    pt = stragglers._arm_point("mitigation", 0.5, [run], schedule, workers=3)
    assert pt["iteration_s"] == pytest.approx((0.22 + 0.60) / 2)
    # the old figure, kept as a secondary field, drops the slow row
    assert pt["iteration_in_sync_mean_s"] == pytest.approx((0.20 + 0.22 + 0.15 + 0.15) / 4)
    # iteration 0: every block summed 2 of 3 (rank 2 missed them all);
    # iteration 1: rank 1 missed blocks 0 and 1, but the others' results of
    # them summed all 3 (a block sums what the most any member saw): 4 of
    # the 24 contributions were left out
    assert pt["contributions_dropped_fraction"] == pytest.approx(4 / 24)
    assert pt["iterations_all_straggled"] == 0


def test_the_straggler_benches_never_print_nan_as_json(capsys):
    from types import SimpleNamespace

    from fanin_bench.bench import stragglers

    with pytest.raises(ValueError, match="points.*iteration_s.*nan"):
        stragglers._emit(SimpleNamespace(json=True), {"points": [{"iteration_s": float("nan")}]}, [], "human")
    assert "NaN" not in capsys.readouterr().out


def _mean_result(workers, n, members, epp=256):
    """What fanin returns for an average over `members`: the float32 of the exact mean."""
    total = np.zeros(n)
    for r in members:
        total += worker_inputs(r, n, "float32")
    return (total / len(members)).astype(np.float32)


def test_iteration_results_are_checked_full_partial_and_missed():
    from fanin_bench.bench.stragglers import _Results, float_error_bound

    workers, n, epp = 3, 1000, 256  # 4 blocks, the last one short
    inputs = [worker_inputs(r, n, "float32") for r in range(workers)]
    bound = float_error_bound(workers, n, epp)[::epp]
    full = _mean_result(workers, n, range(workers))
    partial = _mean_result(workers, n, [0, 2])

    good = _Results(n, epp, workers, aging=True)
    good.observe("warm-up", full.copy(), [])
    out = full.copy()
    out[256:512] = partial[256:512]
    out[512:768] = 0  # missed
    good.observe("iteration 0", out, [(1, 2), (2, 0)])
    good.observe("iteration 1", full.copy(), [])  # same bits as the warm-up: nothing kept
    assert not good.errors, good.errors
    assert good.verify(inputs, bound) == 4 + 1  # the four first full blocks and the one partial

    # a partial block that is no sum of two workers' inputs
    bad = _Results(n, epp, workers, aging=True)
    bad.observe("warm-up", full.copy(), [])
    out = full.copy()
    out[256:512] = partial[256:512]
    out[300] += 1e-3
    bad.observe("iteration 0", out, [(1, 2)])
    assert not bad.errors
    bad.verify(inputs, bound)
    assert any("summed 2 sources" in e for e in bad.errors), bad.errors

    # a full block that changed (not reported degraded) gets the full check
    drift = _Results(n, epp, workers, aging=False)
    drift.observe("warm-up", full.copy(), [])
    out = full.copy()
    out[10] *= 1.5
    drift.observe("iteration 0", out, [])
    drift.verify(inputs, bound)
    assert any("every worker's input" in e for e in drift.errors), drift.errors

    # a missed block that is not zero, a degraded block without aging
    other = _Results(n, epp, workers, aging=False)
    other.observe("iteration 0", full.copy(), [(3, 0)])
    assert any("not zero" in e for e in other.errors) and any("without straggler aging" in e for e in other.errors)


def test_straggler_iterations_arms_check_their_results_on_the_real_daemon():
    from fanin_bench.bench import stragglers

    workers, n, iters = 3, 20_000, 4
    # rank 2 straggles 0.4 s at the first delay point of iterations 1 and 2
    schedule = [[None] * 3, [(2, 0.4), None, None], [(2, 0.4), None, None], [None] * 3]
    ideal = stragglers._run_arm("ideal", 0.0, workers, n, [[None] * 3] * iters, 0.03, 50, 1)
    mitig = stragglers._run_arm("mitigation", 0.5, workers, n, schedule, 0.03, 50, 1)
    none = stragglers._run_arm("none", 0.5, workers, n, schedule, 0.03, 50, 1)
    pts = {arm: stragglers._arm_point(arm, p, [run], sch, workers)
           for arm, p, run, sch in (("ideal", 0.0, ideal, [[None] * 3] * iters), ("mitigation", 0.5, mitig, schedule),
                                    ("none", 0.5, none, schedule))}
    for pt in pts.values():
        # the warm-up and three timed results (first, middle, last) of every worker
        assert pt["results_checked"] == workers * (1 + len({0, iters // 2, iters - 1})), pt
        assert pt["blocks_verified"] >= workers * -(-n // 1024), pt
    assert pts["ideal"]["contributions_dropped_fraction"] == pts["none"]["contributions_dropped_fraction"] == 0
    assert pts["mitigation"]["contributions_dropped_fraction"] > 0, pts["mitigation"]
    # the on-time workers waited for the straggler without mitigation (0.4 s
    # in two of the four iterations)
    assert pts["none"]["iteration_s"] > pts["ideal"]["iteration_s"] + 0.1, pts
    assert pts["mitigation"]["iteration_s"] < pts["none"]["iteration_s"], pts


def test_straggler_iterations_cli_reports_checked_figures_beside_an_ideal_per_p(tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "straggler-iterations", "--quick", "--workers", "3",
                        "--iters", "3", "--compute-ms", "30", "--probs", "0.3", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    def no_nan(c):
        raise AssertionError(f"{c} in the JSON")

    report = json.loads(r.stdout, parse_constant=no_nan)
    points = report["points"]
    assert [(p["arm"], p["beside_p"]) for p in points] == [("ideal", 0.3), ("mitigation", 0.3), ("none", 0.3)]
    for p in points:
        assert p["iters"] == 3 and p["results_checked"] == 3 * (3 + 2), p  # two halves, a warm-up each
        assert 0 <= p["contributions_dropped_fraction"] < 1
    assert points[0]["vs_ideal"] == 1.0 and "slowest worker" in report["iteration_definition"]
    (s,) = report["summary"]
    assert s["mitigation_contributions_dropped_fraction"] == points[1]["contributions_dropped_fraction"]
