"""Trimming on overload through the real daemon, and `fanin bench overload`
on a tiny load (docs/trimming-daemon.md)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import fanin
from fanin.proc import SwitchProcess, reference_sum, worker_inputs
from fanin.switch import LocalSwitch, job_config, switch_config
from fanin_bench.bench.overload import run_point
from threads import in_threads


def test_an_invalid_watermark_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match=r"trim.watermark = 1.5 is out of range"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, trim=True,
                                  trim_watermark=1.5))


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_python_workers_see_trims_and_still_get_the_exact_sum(keyed):
    """keyed (the default for controller jobs): the shard verifies each
    trimmed contribution and seals its nack, so keyed workers (which drop
    anything unsealed) back off and resend instead of waiting out their
    timers; nothing is refused as forged or replayed."""
    from fanin.auth import derive_member_key, new_job_key

    key = new_job_key() if keyed else None
    outs, counters = _through_an_overloaded_shard(
        dict(trim=True, trim_watermark=0.05, socket_buffer=64 << 10), key=key,
        member_key=(lambda rank: derive_member_key(key, 1, rank)) if keyed else (lambda rank: None))
    assert counters["trimmed"] > 0, counters
    assert 0 < sum(st["trimmed"] for _, st in outs) <= counters["trimmed"], "the nacks were acted on"
    assert counters["auth_bad_tag"] == counters["auth_replayed"] == counters["auth_unsealed"] == 0, counters


N_OVERLOAD = 128 * 1024 * 2


def _udp_queue_bytes(addr: str) -> int:
    """Bytes waiting in the receive queue of the IPv4 UDP socket bound to
    `addr` (host:port), from /proc/net/udp; 0 if it is not found."""
    port = int(addr.rsplit(":", 1)[1])
    with open("/proc/net/udp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port:
                return int(fields[4].split(":")[1], 16)
    return 0


def _wait_for_queue(addr: str, timeout: float) -> None:
    """Until the socket's receive queue has stopped growing (the senders'
    windows are out, or the queue is full) for 0.1 s, or `timeout`."""
    deadline = time.monotonic() + timeout
    last, still = -1, 0
    while time.monotonic() < deadline and still < 5:
        queued = _udp_queue_bytes(addr)
        still = still + 1 if queued == last and queued > 0 else 0
        last = queued
        time.sleep(0.02)


def _through_an_overloaded_shard(trim_settings, key=None, member_key=lambda rank: None):
    """3 workers, one allreduce of N_OVERLOAD int32 each, through a switch
    process (`trim_settings` its switch_config trimming or marking) whose
    shard is overloaded on purpose. Checks every sum; returns each worker's
    (output, last_stats) and the switch's counters."""
    # Straggler and failure handling off: on a starved CI machine a worker
    # can be silent past the default 5 s member timeout, and its blocks would
    # then (correctly) complete degraded without it; these tests are about
    # losing nothing, so every block waits for every worker.
    job = job_config(1, 3, block_cnt_max=128, block_grad_max=1024, key=key, slow_after_windows=0,
                     member_timeout_ms=120_000)
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", jobs=[job],
                        **trim_settings)
    n = N_OVERLOAD
    # An overloaded shard, made so: the daemon (a real process) is stopped
    # (SIGSTOP) once the workers joined, while they send their first
    # windows, and resumed 0.3 s later with its socket queue full, far past
    # the watermark. (Left to the kernel's scheduling of 3 workers and a
    # shard on the machine's cores, the shard sometimes kept up, and the
    # test needed up to three runs.)
    joined, sending = threading.Barrier(4), threading.Barrier(4)
    with SwitchProcess(cfg) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, window=128, auth_key=member_key(rank))
            joined.wait(30)
            sending.wait(30)
            return s.allreduce(worker_inputs(rank, n, "int32")), s.last_stats

        def overload():
            joined.wait(30)
            os.kill(sw.proc.pid, signal.SIGSTOP)
            try:
                sending.wait(30)
                time.sleep(0.3)
                # (on a loaded machine the workers may not have sent much
                # yet: wait for the queue itself to fill, up to 4 s, well
                # inside the workers' 10 s silence timeout)
                _wait_for_queue(sw.data_addr, 4.0)
            finally:
                os.kill(sw.proc.pid, signal.SIGCONT)

        outs = in_threads(4, lambda i: overload() if i == 3 else work(i), timeout=120)[:3]
        counters = sw.counters()
    for out, st in outs:
        assert st["degraded_blocks"] == [], st
        assert np.array_equal(out, reference_sum(3, n, "int32"))
    return outs, counters


def test_an_invalid_mark_watermark_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match=r"trim.mark_watermark = 1.5 is out of range"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, mark_watermark=1.5))
    # above the trim watermark it would never mark: what it meets is trimmed
    with pytest.raises(ValueError, match=r"trim.mark_watermark = 0.6 is not below trim.watermark = 0.5"):
        LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None, trim=True,
                                  trim_watermark=0.5, mark_watermark=0.6))


def test_a_deep_receive_queue_marks_every_members_results_and_discards_nothing():
    """Marking instead of trimming (ATP's switch-side ECN): the same
    overloaded shard as above, with `[trim] mark_watermark` and trimming
    off. Contributions that reach the deep queue are aggregated as usual,
    and their blocks' results tell every member to cut its window."""
    outs, counters = _through_an_overloaded_shard(dict(mark_watermark=0.02, socket_buffer=4 << 20))
    assert counters["queue_marked"] > 0 and counters["congestion_marked"] > 0, counters
    assert counters["trimmed"] == 0 and counters["socket_drops"] == 0, counters
    marked = [st["marked_results"] for _, st in outs]
    assert min(marked) > 0 and len(set(marked)) == 1, f"every member read the same marks: {marked}"
    assert len({st["window"] for _, st in outs}) == 1, outs


def test_overload_bench_point_reports_every_arm_side_by_side():
    point = {"workers": 2, "window": 128, "elements": 262_144, "elems_per_packet": 1024,
             "socket_buffer": 128 << 10, "watermark": 0.3}
    r = run_point(point, iters=1)
    assert r["verified"]
    assert r["drop"]["trimmed"] == 0 and r["mark"]["trimmed"] == 0, "only the trim arm trims"
    assert r["drop"]["queue_marked"] == 0 and r["trim"]["queue_marked"] == 0, "only the mark arm marks"
    for arm in ("drop", "trim", "mark"):
        assert len(r[arm]["times_s"]) == 1 and r[arm]["median_s"] > 0
    assert r["ratio_time_trim_vs_drop"] == pytest.approx(r["trim"]["median_s"] / r["drop"]["median_s"])
    assert r["ratio_time_mark_vs_drop"] == pytest.approx(r["mark"]["median_s"] / r["drop"]["median_s"])


def test_cli_lists_the_overload_bench():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fanin.__file__)))
    out = subprocess.run([sys.executable, "-m", "fanin", "bench", "overload", "--help"], capture_output=True,
                         text=True, env=env, check=True).stdout
    assert "--watermark" in out and "--socket-buffers" in out


def test_an_overloaded_root_slows_every_worker_through_its_childrens_partials():
    """A two-level tree (the controller's, keyed) whose root is overloaded:
    stopped while the leaves' first partials arrive and resumed with its
    queue past the trim watermark, as above. The root trims the leaves'
    partials; each leaf marks its next partial up (`parent_trimmed`), so
    the root marks that block's result and every worker reads the same
    marks (docs/trimming-daemon.md, "In aggregation trees"). Every sum
    exact."""
    from fanin import topology
    from fanin.controller import Controller, ControllerClient, ControllerServer
    from fanin.controller.loopback import LoopbackSwitches

    n = N_OVERLOAD
    topo = topology.deep_tree(2, 2)
    with LoopbackSwitches(topo, trim=True, trim_watermark=0.05, socket_buffer=64 << 10) as sws:
        ctl = Controller(topo, sws.fabric)
        with ControllerServer(ctl, "127.0.0.1:0") as srv, ControllerClient(srv.addr) as c:
            # every block waits for every worker (see _through_an_overloaded_shard)
            c.create_job(1, block_cnt_max=128, block_grad_max=1024, max_workers=2, slow_after_windows=0,
                         member_timeout_ms=120_000)
            subs = [c.subscribe(1, r, f"h{r}") for r in range(2)]
            root = c.tree(1)["root"]
            joined, sending = threading.Barrier(3), threading.Barrier(3)

            def work(rank):
                s = fanin.Session(subs[rank]["data_addr"], 1, rank, window=128, auth_key=subs[rank]["member_key"])
                joined.wait(30)
                sending.wait(30)
                return s.allreduce(worker_inputs(rank, n, "int32")), s.last_stats

            def overload():
                joined.wait(30)
                os.kill(sws.procs[root].proc.pid, signal.SIGSTOP)
                try:
                    sending.wait(30)
                    time.sleep(0.3)
                finally:
                    os.kill(sws.procs[root].proc.pid, signal.SIGCONT)

            outs = in_threads(3, lambda i: overload() if i == 2 else work(i), timeout=120)[:2]
            counters = {s: sws.counters(s) for s in sws.procs}
    for out, st in outs:
        assert st["degraded_blocks"] == [], st
        assert np.array_equal(out, reference_sum(2, n, "int32"))
    leaves = [s for s in counters if s != root]
    trimmed_up = sum(counters[s]["parent_trimmed"] for s in leaves)
    assert counters[root]["trimmed"] > 0, counters[root]
    assert 0 < trimmed_up <= counters[root]["trimmed"], counters
    assert counters[root]["congestion_marked"] > 0, counters[root]
    marked = [st["marked_results"] for _, st in outs]
    assert min(marked) > 0 and len(set(marked)) == 1, f"every worker read the same marks: {marked}"
