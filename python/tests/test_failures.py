"""Worker failure and per-source rate limits with real processes: a switch
process (`fanin switch`), worker processes, one killed with SIGKILL
mid-job (docs/failures.md, docs/overload.md)."""

import multiprocessing as mp
import os
import queue
import signal
import socket
import time

import numpy as np
import pytest

from fanin.proc import SwitchProcess
from fanin.switch import job_config, switch_config
from fanin_bench.bench.flood import _contribution

TIMEOUT_MS = 500
ELEMS = 256
BLOCKS = 8


def _worker(rank, addr, victim_after, ready, results):
    import fanin

    try:
        s = fanin.Session(addr, 1, rank, elems_per_packet=ELEMS, window=8)
        x = np.full(BLOCKS * ELEMS, rank + 1, dtype=np.int32)
        for i in range(40):
            if rank == 2 and i == victim_after:
                # flush both queues before the kill: a process SIGKILLed while
                # a feeder thread holds a queue's write lock blocks every
                # other writer of that queue forever
                results.close()
                results.join_thread()
                ready.put("victim idle")
                ready.close()
                ready.join_thread()
                time.sleep(3600)  # killed here
            out = s.allreduce(x)
            st = s.last_stats
            src_cnt = [3] * BLOCKS
            for idx, cnt in st["degraded_blocks"]:
                src_cnt[idx] = cnt
            # each block is the sum of the ranks it says it summed
            expected = np.repeat([6 if c == 3 else 3 if c == 2 else -1 for c in src_cnt], ELEMS)
            results.put(("result", rank, i, time.monotonic(), bool((out == expected).all()), min(src_cnt)))
            time.sleep(0.02)
        results.put(("done", rank, time.monotonic()))
    except Exception as e:  # the parent checks what was raised
        results.put(("error", rank, time.monotonic(), type(e).__name__, str(e)))


def _run(policy):
    job = job_config(1, 3, block_cnt_max=16, block_grad_max=ELEMS, on_failure=policy, member_timeout_ms=TIMEOUT_MS)
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0",
                                     jobs=[job]))
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, 5, ready, results), daemon=True) for r in range(3)]
    try:
        for p in procs:
            p.start()
        assert ready.get(timeout=60) == "victim idle"
        os.kill(procs[2].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        events, finished = [], set()
        deadline = time.monotonic() + 60
        while finished != {0, 1}:
            try:
                ev = results.get(timeout=1)
            except queue.Empty:
                assert time.monotonic() < deadline, f"survivors hang; events so far {events[-5:]}"
                continue
            events.append(ev)
            if ev[0] in ("done", "error") and ev[1] in (0, 1):
                finished.add(ev[1])
        counters = sw.counters()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        sw.stop()
    return events, killed_at, counters


def test_kill_9_under_degrade_the_survivors_continue_with_correct_partial_sums():
    events, killed_at, counters = _run("degrade")
    results = [e for e in events if e[0] == "result" and e[1] in (0, 1)]
    errors = [e for e in events if e[0] == "error"]
    assert not errors, errors
    assert all(ok for *_, ok, _ in results), "every block equals the sum of the sources it reports"
    after = [e for e in results if e[3] > killed_at + 2 * TIMEOUT_MS / 1000]
    assert after and all(e[5] == 2 for e in after), "after the timeout every result sums the 2 survivors"
    # nothing stalls longer than the member timeout (+ a check period, + slack)
    times = sorted(e[3] for e in results if e[1] == 0)
    gaps = np.diff(times)
    assert gaps.max() < TIMEOUT_MS / 1000 * 1.25 + 0.75, gaps.max()
    assert counters.get("members_timed_out", 0) >= 1 and counters.get("jobs_failed", 0) == 0


def test_kill_9_under_fail_every_survivor_raises_member_failed_naming_the_rank_in_bounded_time():
    events, killed_at, counters = _run("fail")
    errors = [e for e in events if e[0] == "error"]
    assert {e[1] for e in errors} == {0, 1}, events[-6:]
    for _, rank, at, kind, message in errors:
        assert kind == "MemberFailed", message
        assert "rank 2" in message and "fail" in message, message
        # the victim was idle from before the kill: the survivors' next
        # block waited at most since then
        assert at - killed_at < TIMEOUT_MS / 1000 * 1.25 + 1.0, at - killed_at
    results = [e for e in events if e[0] == "result"]
    assert all(ok and cnt == 3 for *_, ok, cnt in results), "no partial result under fail"
    assert counters.get("jobs_failed", 0) >= 1


def test_a_flooding_source_is_rate_limited_with_trimmed_nacks_and_another_job_is_unharmed():
    import fanin

    jobs = [job_config(1, 2, block_cnt_max=16, block_grad_max=ELEMS),
            job_config(2, 1, block_cnt_max=64, block_grad_max=ELEMS, rate_limit=(1000, 16))]
    with SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0",
                                     jobs=jobs)) as sw:
        host, port = sw.data_addr.rsplit(":", 1)
        flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flood.settimeout(0.5)
        packet = bytearray(_contribution(2, 0, ELEMS))
        for b in range(2000):
            packet[16:20] = b.to_bytes(4, "big")
            flood.sendto(packet, (host, int(port)))
        replies = []
        try:
            while len(replies) < 200:
                replies.append(flood.recv(70000))
        except socket.timeout:
            pass
        nacks = [r for r in replies if r[3] == 0x06]
        assert nacks, "the flooder is told to slow down"
        # reason 10 Trimmed, detail 3 (rate limited)
        assert all(r[24:26] == b"\x00\x0a" and r[28:32] == b"\x00\x00\x00\x03" for r in nacks)

        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=ELEMS)
            return s.allreduce(np.full(BLOCKS * ELEMS, rank + 1, dtype=np.int32))

        from threads import in_threads

        for out in in_threads(2, work):
            assert (out == 3).all()
        counters = sw.counters()
    assert counters["rate_limited"] > 1000, counters["rate_limited"]
    # The flood ignores the nacks, so past its nack budget (1000/s, burst 16)
    # the switch stops answering: most refusals cost no reply.
    answered = counters["rate_limited"] - counters["rate_limited_unanswered"]
    assert 0 < answered < counters["rate_limited"] / 2, counters
