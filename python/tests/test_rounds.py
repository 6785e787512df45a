"""Never a wrong result, with real processes: a `fanin switch` process and
worker processes that run, exit, crash and restart against it
(docs/protocol.md 4.12: rounds and member incarnations).

Each test reproduces a way fanin used to hand workers another run's sums
or zeros with clean statistics."""

import multiprocessing as mp
import os
import queue
import signal
import time

import numpy as np
import pytest

import fanin
from fanin.proc import SwitchProcess
from fanin.switch import job_config, switch_config

ELEMS = 64
BLOCKS = 6


def _values(run, rank, call):
    return np.full(BLOCKS * ELEMS, 1000 * run + 10 * rank + call, dtype=np.int32)


def _expected(run, ranks, call):
    return sum(_values(run, r, call) for r in range(ranks))


def _runner(run, rank, ranks, addr, calls, results):
    """One worker process: `calls` allreduces, each checked exactly."""
    try:
        s = fanin.Session(addr, 1, rank, elems_per_packet=ELEMS, window=8, barrier_timeout_s=60)
        for call in range(calls):
            out = s.allreduce(_values(run, rank, call))
            st = s.last_stats
            results.put(("result", run, rank, call, bool((out == _expected(run, ranks, call)).all()),
                         st["min_src_cnt"], st["missed_blocks"]))
        results.put(("done", run, rank))
    except Exception as e:
        results.put(("error", run, rank, type(e).__name__, str(e)))


def _collect(results, want_done, timeout=60):
    events, done = [], set()
    deadline = time.monotonic() + timeout
    while done != want_done:
        try:
            ev = results.get(timeout=1)
        except queue.Empty:
            assert time.monotonic() < deadline, f"hang; events so far {events[-6:]}"
            continue
        events.append(ev)
        if ev[0] in ("done", "error"):
            done.add((ev[1], ev[2]))
    return events


@pytest.fixture
def switch2():
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", shards=2, control_addr=None,
                                     metrics_addr="127.0.0.1:0",
                                     jobs=[job_config(1, 2, block_cnt_max=8, block_grad_max=ELEMS)]))
    yield sw
    sw.stop()


def test_a_second_run_of_worker_processes_against_a_live_switch_gets_its_own_sums(switch2):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    for run in (1, 2, 3):
        procs = [ctx.Process(target=_runner, args=(run, r, 2, switch2.data_addr, 10, results)) for r in range(2)]
        for p in procs:
            p.start()
        events = _collect(results, {(run, 0), (run, 1)})
        for p in procs:
            p.join(timeout=30)
        errors = [e for e in events if e[0] == "error"]
        assert not errors, errors
        got = [e for e in events if e[0] == "result"]
        assert len(got) == 20
        # exact sums of this run, from the first call on, with clean stats
        assert all(ok and min_src == 2 and missed == 0 for (_, _, _, _, ok, min_src, missed) in got), got
    c = switch2.counters()
    assert c["rounds_started"] == 3 and c["rounds_ended"] == 2, c


def _survivor(rank, addr, results, ready):
    """Runs allreduces until its round ends, then does what a user does:
    a new Session; reports every result and the error in between. Rank 2
    (the victim) stops after 5 calls and says so on `ready`."""
    try:
        s = fanin.Session(addr, 1, rank, elems_per_packet=ELEMS, window=8, barrier_timeout_s=60)
        call = 0
        while True:
            try:
                out = s.allreduce(_values(1, rank, call))
            except fanin.MemberRestarted as e:
                results.put(("restarted", rank, str(e)))
                break
            results.put(("result", rank, call, bool((out == _expected(1, 3, call)).all())))
            call += 1
            if rank == 2 and call == 5:
                # Flush `results` first, then say so on a queue of its own:
                # a process SIGKILLed while its feeder thread holds a queue's
                # write lock blocks every other writer of that queue forever,
                # and the parent can read a message before the writer has
                # released that lock. Saying "idle" on `results` itself hung
                # 2 of 7 CI runs and 1 of 3 runs on 2 loaded cores.
                results.close()
                results.join_thread()
                ready.put("victim idle")
                time.sleep(3600)  # SIGKILLed here
            time.sleep(0.01)
    except Exception as e:
        results.put(("error", rank, type(e).__name__, str(e)))
        return
    _replacement(rank, addr, results)


def _replacement(rank, addr, results):
    """A new session of `rank` (a survivor's, or the restarted process's):
    five allreduces of the next round, each checked exactly."""
    try:
        s = fanin.Session(addr, 1, rank, elems_per_packet=ELEMS, window=8, barrier_timeout_s=60)
        for call in range(5):
            out = s.allreduce(_values(2, rank, call))
            results.put(("result2", rank, call, bool((out == _expected(2, 3, call)).all())))
        results.put(("done", rank))
    except Exception as e:
        results.put(("error", rank, type(e).__name__, str(e)))


def test_a_rank_killed_and_restarted_ends_the_round_and_everyone_continues_exactly():
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", shards=2, control_addr=None, metrics_addr="127.0.0.1:0",
                                     # the silent victim is replaced before any member timeout
                                     jobs=[job_config(1, 3, block_cnt_max=8, block_grad_max=ELEMS,
                                                      member_timeout_ms=120_000)]))
    ctx = mp.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_survivor, args=(r, sw.data_addr, results, ready), daemon=True) for r in range(3)]
    try:
        for p in procs:
            p.start()
        events = []
        try:
            ready.get(timeout=60)
        except queue.Empty:
            while not results.empty():
                events.append(results.get())
            pytest.fail(f"the victim never went idle; events {events[-8:]}")
        os.kill(procs[2].pid, signal.SIGKILL)
        # torchrun --max-restarts style: a new process for rank 2
        new = ctx.Process(target=_replacement, args=(2, sw.data_addr, results), daemon=True)
        new.start()
        finished = set()
        deadline = time.monotonic() + 90
        while finished != {0, 1, 2}:
            try:
                ev = results.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    c = sw.counters()
                    keys = ("joins", "rounds_started", "rounds_ended", "barrier_waiting", "stale_round", "notices_sent")
                    pytest.fail(f"hang; events {events[-8:]}; replacement alive {new.is_alive()} exit {new.exitcode}; "
                                f"switch {({k: c.get(k) for k in keys})}")
                continue
            events.append(ev)
            assert ev[0] != "error", ev
            if ev[0] == "done":
                finished.add(ev[1])
        counters = sw.counters()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        sw.stop()
    restarted = [e for e in events if e[0] == "restarted"]
    assert sorted(e[1] for e in restarted) == [0, 1], events
    assert all("rank 2" in e[2] for e in restarted), restarted
    # every result returned, before and after the restart, is exact
    assert all(e[-1] for e in events if e[0] in ("result", "result2")), events
    assert len([e for e in events if e[0] == "result2"]) == 15
    assert counters["rounds_ended"] == 1 and counters["rounds_started"] == 2, counters


def test_a_job_of_another_size_is_refused_at_once(switch2):
    t = time.monotonic()
    with pytest.raises(fanin.FaninRefused, match="has 2 members but 3 ranks"):
        fanin.Session(switch2.data_addr, 1, 0, elems_per_packet=ELEMS, members=3)
    assert time.monotonic() - t < 3


def test_a_member_that_never_joins_gives_a_clear_timeout(switch2):
    with pytest.raises(fanin.FaninTimeout, match="only 1 of the job's 2 members joined"):
        fanin.Session(switch2.data_addr, 1, 0, elems_per_packet=ELEMS, barrier_timeout_s=1.0)


@pytest.mark.parametrize("inputs, says", [
    # found by a user: one rank got FaninRefused, the other its own values
    # back after 5 s, flagged only in last_stats
    ((np.ones(1000, dtype=np.float32), np.ones(1200, dtype=np.float32)), "disagree on this allreduce's length"),
    # found by a user: the float16 rank got FaninRefused at once, the float32
    # one MemberFailed after the member timeout, blaming the other as silent
    ((np.ones(1000, dtype=np.float32), np.ones(1000, dtype=np.float16)), "length or element type"),
], ids=["length", "dtype"])
def test_ranks_that_disagree_on_the_length_or_dtype_all_raise_at_once(switch2, inputs, says):
    import threading

    errors, start = {}, time.monotonic()

    def work(rank):
        s = fanin.Session(switch2.data_addr, 1, rank, elems_per_packet=ELEMS, barrier_timeout_s=30)
        try:
            s.allreduce(inputs[rank])
        except fanin.FaninError as e:
            errors[rank] = (type(e).__name__, str(e), time.monotonic() - start)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(errors) == [0, 1], errors
    for name, msg, at in errors.values():
        assert name == "FaninRefused" and says in msg, msg
        assert at < 3, f"raised after {at:.1f} s"

_BLOCKED = r'''
import sys, threading, time
import numpy as np
import fanin

addr, where = sys.argv[1], sys.argv[2]
try:
    if where == "barrier":
        print("ready", flush=True)
        fanin.Session(addr, 1, 0, elems_per_packet=64, barrier_timeout_s=60)  # rank 1 never joins
    else:
        joined = threading.Event()
        def quiet():  # rank 1 joins, then never sends
            fanin.Session(addr, 1, 1, elems_per_packet=64)
            joined.set()
            time.sleep(60)
        threading.Thread(target=quiet, daemon=True).start()
        s = fanin.Session(addr, 1, 0, elems_per_packet=64, dead_after_s=60)
        joined.wait(10)
        print("ready", flush=True)
        s.allreduce(np.ones(100_000, dtype=np.float32))
    print("returned", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {time.time()}", flush=True)
'''


@pytest.mark.parametrize("where", ["barrier", "allreduce"])
def test_ctrl_c_interrupts_a_blocked_call_within_100_ms(switch2, where, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "blocked.py"
    script.write_text(_BLOCKED)
    p = subprocess.Popen([sys.executable, str(script), switch2.data_addr, where], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # well inside the blocking call
        sent = time.time()
        p.send_signal(signal.SIGINT)
        line = p.stdout.readline().split()
        assert line and line[0] == "interrupted", line
        assert float(line[1]) - sent < 0.1, f"Ctrl-C took {float(line[1]) - sent:.3f} s"
    finally:
        p.kill()
        p.wait()
