"""Switch restart with real processes (docs/restart.md): `fanin switch` is
killed with SIGKILL in the middle of a run of allreduces and started again on
the same ports; worker processes must recover, every result must equal the
reference, and recovery must be fast compared with the block timeout."""

import multiprocessing as mp
import os
import signal
import threading
import socket
import time

import numpy as np
import pytest

import fanin
from fanin.proc import SwitchProcess, check_result, worker_inputs
from fanin.switch import job_config, switch_config
from relay import one_member_left_behind

# The block timeout recovery is measured against: a worker's longest
# retransmission timeout (rto_max, 1 s by default), which is how long a block
# may go unanswered before the worker acts on it.
BLOCK_TIMEOUT_S = 1.0


def _free_port_pair(shards: int) -> int:
    """A base port with `shards` consecutive free UDP ports (best effort)."""
    for _ in range(50):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        if base + shards >= 65535:
            continue
        ok = True
        for k in range(shards):
            t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                t.bind(("127.0.0.1", base + k))
            except OSError:
                ok = False
            finally:
                t.close()
        if ok:
            return base
    raise RuntimeError("no free port range")


def _worker(rank, addr, n, size, dtype, iters, progress, q, auth_key=None):
    try:
        s = fanin.Session(addr, 1, rank, elems_per_packet=256, window=64, auth_key=auth_key)
        done = []
        for it in range(iters):
            y = s.allreduce(worker_inputs(rank, size, dtype, it))
            stats = s.last_stats
            ok = check_result(y, n, dtype, 256, it)["ok"]
            done.append((it, ok, time.time(), stats["recoveries"], y.tobytes()))
            with progress.get_lock():
                progress.value += 1
        q.put((rank, None, done, s.socket_stats()["port_unreachable"]))
    except BaseException as e:  # report, never hang the test
        q.put((rank, repr(e), [], 0))


def _run_with_kill(n, dtype, shards=2, size=64 * 1024, iters=12, kill_after=4, down_s=0.3):
    base = _free_port_pair(shards)
    cfg = switch_config(data_addr=f"127.0.0.1:{base}", control_addr=None, metrics_addr="127.0.0.1:0",
                        jobs=[job_config(1, n, block_cnt_max=64)], shards=shards)
    sw = SwitchProcess(cfg)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    progress = ctx.Value("i", 0)
    procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, n, size, dtype, iters, progress, q)) for r in range(n)]
    for p in procs:
        p.start()
    new = None
    try:
        deadline = time.time() + 120
        while progress.value < kill_after * n and time.time() < deadline:
            time.sleep(0.001)
        # SIGKILL mid-run: the daemon's memory (blocks, results) is gone
        sw.proc.send_signal(signal.SIGKILL)
        sw.proc.wait(10)
        killed_at = time.time()
        time.sleep(down_s)
        new = SwitchProcess(cfg)  # same ports; --config re-admits the job
        ready_at = time.time()
        res = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        counters = new.counters()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if new is not None:
            new.stop()
        sw.stop()
    errors = [(r, e, *_) for r, e, *_ in res if e]
    assert not errors, errors
    # the switch's host said nothing listened while it was down; that is
    # not fatal for a switch that comes back within switch_gone_after_s
    assert sum(unreachable for *_, unreachable in res) > 0
    res = [(r, e, done) for r, e, done, _ in res]
    for _, _, done in res:
        assert len(done) == iters
        assert all(ok for _, ok, _, _, _ in done), [(it, ok) for it, ok, *_ in done]
    for it in range(iters):
        assert len({done[it][4] for _, _, done in res}) == 1, f"allreduce {it}: results differ across workers"
    # the allreduce the kill interrupted: the first one completed after it
    # that recovered; recovery ends when the last worker finished it
    recovered = [min((t for _, _, t, rec, _ in done if rec > 0), default=None) for _, _, done in res]
    assert all(t is not None for t in recovered), "every worker went through a recovery"
    recovery_s = max(recovered) - ready_at
    assert counters.get("recoveries", 0) >= 1
    return recovery_s, ready_at - killed_at, counters


@pytest.mark.parametrize("n,dtype", [(2, "int32"), (4, "float32"), (3, "int32")])
def test_switch_killed_mid_allreduce_and_restarted_gives_exact_results(n, dtype):
    recovery_s, down_s, counters = _run_with_kill(n, dtype)
    print(f"workers {n} {dtype}: down {down_s * 1000:.0f} ms, recovery {recovery_s * 1000:.0f} ms "
          f"after the restarted daemon was ready; stale_incarnation {counters.get('stale_incarnation')}")
    assert recovery_s < 2 * BLOCK_TIMEOUT_S, f"recovery took {recovery_s:.3f} s"


def _free_tcp_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("controller_restarted", [False, True], ids=["same-controller", "restarted-controller"])
def test_controller_reinstalls_the_job_on_a_restarted_switch(controller_restarted):
    """No --job on the daemon: the job exists only because the controller
    admitted it, keyed (the default). After SIGKILL and a restart on the
    same ports, the controller notices the new incarnation and admits it
    again with the same job key; the workers, waiting in recovery with their
    member keys, then finish every allreduce exactly and nothing is refused.

    restarted-controller: the controller that created the job is gone before
    the switch dies; a new one (nothing on disk) rebuilds the job, its tree
    and its key from the switch at start, answers a worker's subscribe
    again with the same member key, and re-installs the job all the same."""
    from fanin import topology
    from fanin.controller import Controller
    from fanin.controller.fabric import StaticFabric
    from fanin.controller.server import ControllerClient, ControllerServer

    n, dtype, iters = 3, "int32", 10
    base = _free_port_pair(2)
    control = f"127.0.0.1:{_free_tcp_port()}"
    cfg = switch_config(data_addr=f"127.0.0.1:{base}", control_addr=control, metrics_addr="127.0.0.1:0", shards=2)
    sw = SwitchProcess(cfg)
    new = None
    topo = topology.star(n)
    ctl = Controller(topo, StaticFabric({"s0": {"control": control, "data": sw.data_addr}}))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    progress = ctx.Value("i", 0)
    procs = []
    try:
        with ControllerServer(ctl, "127.0.0.1:0", reconcile_s=0.1) as srv, ControllerClient(srv.addr) as c:
            c.create_job(1, block_cnt_max=64, block_grad_max=256, max_workers=n)
            subs = [c.subscribe(1, r, f"h{r}") for r in range(n)]
            assert all(sub["member_key"] is not None for sub in subs)
            procs = [ctx.Process(target=_worker, args=(r, subs[r]["data_addr"], n, 64 * 1024, dtype, iters, progress,
                                                       q, subs[r]["member_key"]))
                     for r in range(n)]
            for p in procs:
                p.start()
            deadline = time.time() + 120
            while progress.value < 3 * n and time.time() < deadline:
                time.sleep(0.001)
            if controller_restarted:
                srv.stop()
                ctl = Controller(topo, StaticFabric({"s0": {"control": control, "data": sw.data_addr}}))
                srv = ControllerServer(ctl, "127.0.0.1:0", reconcile_s=0.1)
                c = ControllerClient(srv.addr)
                assert 1 in ctl._jobs and ctl.tree(1).attach == {r: "s0" for r in range(n)}
                again = c.subscribe(1, 0, "h0")
                assert again["member_key"] == subs[0]["member_key"] and again["programmed"] == []
                with pytest.raises(Exception, match="ALREADY_EXISTS"):
                    c.subscribe(1, 0, "h0")
            sw.proc.send_signal(signal.SIGKILL)
            sw.proc.wait(10)
            new = SwitchProcess(cfg)  # no jobs of its own
            ready_at = time.time()
            res = [q.get(timeout=120)[:3] for _ in procs]
            errors = [(r, e) for r, e, _ in res if e]
            assert not errors, errors  # before the control checks: the likelier cause
            counters = new.counters()
            from fanin.control import ControlClient

            with ControlClient(control) as cc:
                (job,) = cc.list_jobs()
            # re-installed with the key the members' keys derive from
            assert job["key"] is not None
            assert subs[0]["member_key"] == fanin.derive_member_key(job["key"], 1, 0)
            if controller_restarted:
                c.close()
                srv.stop()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if new is not None:
            new.stop()
        sw.stop()
    for _, _, done in res:
        assert len(done) == iters and all(ok for _, ok, *_ in done)
    recovered = [min((t for _, _, t, rec, _ in done if rec > 0), default=None) for _, _, done in res]
    assert all(t is not None for t in recovered)
    recovery_s = max(recovered) - ready_at
    print(f"controller re-admission: recovery {recovery_s * 1000:.0f} ms after the restarted daemon was ready")
    assert counters.get("recoveries", 0) >= 1
    assert (counters.get("auth_bad_tag", 0), counters.get("auth_replayed", 0), counters.get("auth_unsealed", 0)) == (
        0, 0, 0)
    assert recovery_s < 2 * BLOCK_TIMEOUT_S + 1.0, f"recovery took {recovery_s:.3f} s"


@pytest.mark.parametrize("lanes", [1, 2], ids=["one-lane", "two-lanes-polled"])
def test_a_switch_that_does_not_come_back_is_reported_gone_soon(lanes):
    """The daemon is killed and not restarted. A worker waiting for a
    result, and one that starts an allreduce afterwards, raise SwitchGone
    about switch_gone_after_s after the switch's host first answered "port
    unreachable", not after dead_after_s (10 s) of silence. Two lanes: the
    session polls its sockets, where a poll woken by the error queue alone
    once led into a receive that never returned."""
    import threading

    cfg = switch_config(data_addr=f"127.0.0.1:{_free_port_pair(2)}", control_addr=None, metrics_addr="127.0.0.1:0",
                        jobs=[job_config(1, 2)], shards=2)
    sw = SwitchProcess(cfg)
    first_done = threading.Barrier(3)  # the two workers and this thread
    killed = threading.Event()
    out = {}

    def work(rank):
        s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=64, switch_gone_after_s=0.5, lanes=lanes)
        s.allreduce(np.ones(256, dtype=np.int32))
        first_done.wait(30)
        if rank == 1:
            killed.wait(30)  # rank 0 is waiting for this rank when the switch dies
        start = time.monotonic()
        try:
            s.allreduce(np.ones(256, dtype=np.int32))
            out[rank] = ("returned", 0.0, None)
        except Exception as e:
            out[rank] = (type(e).__name__, time.monotonic() - start, str(e))
        out[f"stats{rank}"] = s.socket_stats()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        first_done.wait(30)
        time.sleep(0.3)  # rank 0 is in its allreduce
        sw.proc.send_signal(signal.SIGKILL)
        sw.proc.wait(10)
        killed_at = time.monotonic()
        killed.set()
        for t in threads:
            t.join(30)
    finally:
        sw.stop()
    assert out[0][0] == "SwitchGone" and out[1][0] == "SwitchGone", out
    assert "nothing listens on the switch's port" in out[0][2]
    # rank 0 waited 0.3 s before the kill, then a retransmission timeout or
    # two for its first refusal, then 0.5 s of them
    assert out[0][1] < 0.3 + 2.0, out[0]
    assert out[1][1] < 2.0, out[1]
    assert out["stats0"]["port_unreachable"] > 0 and out["stats1"]["port_unreachable"] > 0
    assert time.monotonic() - killed_at < 5


def _finished_member_and_a_restart(linger: bool):
    """Rank 0 finishes its last allreduce; rank 1's results of it are lost
    on the way; then the switch is killed and restarted (relay.py).
    Returns rank 1's outcome, the expected sum, rank 0's linger report,
    the restarted switch's counters and the recovery time."""
    base = _free_port_pair(1)
    cfg = switch_config(data_addr=f"127.0.0.1:{base}", control_addr=None, metrics_addr="127.0.0.1:0",
                        jobs=[job_config(1, 2, block_cnt_max=32)], shards=1)
    sw = SwitchProcess(cfg)
    new = []

    def restart() -> None:
        sw.proc.send_signal(signal.SIGKILL)
        sw.proc.wait(10)
        time.sleep(0.3)
        new.append(SwitchProcess(cfg))  # same ports, the job re-admitted, no blocks

    try:
        got, want, lingered, took_s = one_member_left_behind([sw.data_addr, sw.data_addr], restart, linger=linger)
        counters = new[0].counters()
    finally:
        for s in new:
            s.stop()
        sw.stop()
    return got, want, lingered, counters, took_s


def test_a_finished_member_that_lingers_lets_the_others_recover_a_restart():
    got, want, lingered, counters, took_s = _finished_member_and_a_restart(linger=True)
    assert not isinstance(got, Exception), got
    np.testing.assert_array_equal(got, want)
    assert lingered["idle_recoveries"] == 1 and lingered["probes"] >= 1, lingered
    assert counters.get("recoveries", 0) == 1, counters
    print(f"finished member lingering: restarted daemon ready -> rank 1 done {took_s * 1000:.0f} ms, "
          f"rank 0 {lingered}")
    assert took_s < 2 * BLOCK_TIMEOUT_S, f"recovery took {took_s:.3f} s"


def test_without_lingering_the_others_fail_cleanly_not_wrongly():
    got, *_ = _finished_member_and_a_restart(linger=False)
    assert isinstance(got, fanin.FaninError), got
    assert "recovery did not finish" in str(got)
