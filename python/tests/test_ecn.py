"""ECN end to end (docs/congestion.md, "ECN"): the real switch daemon, two
real sessions, one of them behind a relay that marks what it forwards
Congestion Experienced in the IP header, as a queue on a path that marks
instead of dropping would. A mark on the way up is read by the switch, one
on the way down by the worker, which echoes it; either way both members
read the mark in the same results, cut their windows alike, resend
nothing, and every sum is exact."""

import threading

import numpy as np
import pytest

import fanin
from fanin.switch import switch_config
from relay import ResultEater

ELEMS = 256 * 400  # 400 blocks of 256 int32


def _run(*, ce_up=False, ce_down=False, worker_ecn=True, switch_ecn=True):
    """Two ranks of job 1, rank 1 through the relay; three allreduces.
    Returns each rank's last_stats of every allreduce, the switch's
    counters, and the codepoints of what the relay carried (up: rank 1's
    datagrams, down: the switch's results to it), as a dict of each
    codepoint's count for each direction."""
    cfg = switch_config(data_addr="127.0.0.1:0", shards=1, control_addr=None, metrics_addr=None, ecn=switch_ecn,
                        jobs=[{"job_id": 1, "sources": 2, "block_cnt_max": 256}])
    with fanin.LocalSwitch(cfg) as sw:
        relay = ResultEater(sw.data_addr, ce_up=ce_up, ce_down=ce_down)
        try:
            r0, r1 = _two_ranks(sw.data_addr, relay.addr, iters=3, ecn=worker_ecn)
        finally:
            relay.close()
        return r0, r1, sw.counters(), (relay.codepoints_up, relay.codepoints_down)


def _two_ranks(addr0: str, addr1: str, *, iters: int, **session_kw) -> tuple[list, list]:
    """Rank 0 of job 1 through `addr0`, rank 1 through `addr1`, `iters`
    allreduces each, every sum checked; each rank's last_stats of every
    allreduce."""
    inputs = [np.arange(ELEMS, dtype=np.int32) * (r + 1) for r in range(2)]
    out: dict = {}

    def rank(r: int, addr: str) -> None:
        try:
            s = fanin.Session(addr, 1, r, elems_per_packet=256, window=256, **session_kw)
            out[r] = []
            for _ in range(iters):
                got = s.allreduce(inputs[r])
                np.testing.assert_array_equal(got, inputs[0] + inputs[1])
                out[r].append(s.last_stats)
            del s  # on the thread that made it
        except Exception as e:  # noqa: BLE001 (reported below, without the traceback)
            out[r, "error"] = repr(e)

    threads = [threading.Thread(target=rank, args=(0, addr0)), threading.Thread(target=rank, args=(1, addr1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not [k for k in out if isinstance(k, tuple)], out
    return out[0], out[1]


def _sum(stats, key):
    return sum(s[key] for s in stats)


def test_without_marks_nothing_is_marked():
    r0, r1, c, _ = _run()
    assert _sum(r0, "marked_results") == _sum(r1, "marked_results") == 0
    assert _sum(r1, "ecn_ce") == 0 and c["ecn_ce"] == c["ecn_echoed"] == 0


def test_a_marked_uplink_marks_every_members_results_and_loses_nothing():
    r0, r1, c, _ = _run(ce_up=True)
    # every contribution of rank 1 arrived CE-marked: the switch read it
    assert c["ecn_ce"] >= 3 * 400, c
    assert c["congestion_marked"] >= 3 * 400 and c["ecn_echoed"] == 0, c
    for stats in (r0, r1):
        assert _sum(stats, "marked_results") >= 3 * 400, stats
        assert _sum(stats, "retransmissions") == 0 and _sum(stats, "timeouts") == 0, stats
    assert [s["window"] for s in r0] == [s["window"] for s in r1], (r0, r1)
    assert r0[-1]["window"] == 64, "held at the floor: 64 blocks per shard"


def test_a_marked_downlink_is_echoed_and_both_members_cut_at_the_same_results():
    r0, r1, c, _ = _run(ce_down=True)
    # rank 1 read the marks on its results and echoed them
    assert _sum(r1, "ecn_ce") >= 3 * 400 and _sum(r0, "ecn_ce") == 0, (r0, r1)
    assert c["ecn_echoed"] > 0 and c["ecn_ce"] == 0, c
    assert _sum(r0, "marked_results") == _sum(r1, "marked_results") > 0, (r0, r1)
    assert [s["window"] for s in r0] == [s["window"] for s in r1], (r0, r1)
    assert _sum(r1, "retransmissions") == 0


@pytest.mark.parametrize("side", ["worker", "switch"])
def test_ecn_off_reads_no_marks(side):
    r0, r1, c, _ = _run(ce_up=True, ce_down=True, worker_ecn=side != "worker", switch_ecn=side != "switch")
    if side == "worker":
        assert _sum(r1, "ecn_ce") == 0 and c["ecn_echoed"] == 0
        assert c["ecn_ce"] > 0  # the switch still reads its uplink
    else:
        assert c["ecn_ce"] == 0
        assert _sum(r1, "ecn_ce") > 0  # the worker still reads its downlink


def test_results_go_ecn_capable_only_to_a_session_that_answers_marks():
    # the switch sends ECT(0) from its sockets, but Not-ECT to a peer whose
    # own datagrams arrive Not-ECT (RFC 3168 section 5: a queue must not mark
    # instead of dropping for a receiver that ignores the marks)
    *_, (up, down) = _run(worker_ecn=True)
    assert set(up) == {2} and set(down) == {2}, (up, down)  # ECT(0) both ways
    *_, (up, down) = _run(worker_ecn=False)
    assert set(up) == {0} and set(down) == {0}, (up, down)  # Not-ECT both ways
    # a switch with ECN off sends its socket's default, Not-ECT, to everyone
    *_, (up, down) = _run(worker_ecn=True, switch_ecn=False)
    assert set(up) == {2} and set(down) == {0}, (up, down)


def _group_codepoints(*, ecn_of_rank):
    """Two ranks of job 1 listening on one result group, rank r with
    ``ecn=ecn_of_rank[r]``; a third socket on the group reads the IP
    header's ECN field of every result sent there. Returns
    {codepoint: count} and the switch's counters."""
    import socket

    from fanin.switch import free_result_group

    group = free_result_group()
    host, port = group.rsplit(":", 1)
    cfg = switch_config(data_addr="127.0.0.1:0", shards=1, control_addr=None, metrics_addr=None,
                        jobs=[{"job_id": 1, "sources": 2, "block_cnt_max": 64, "result_group": group}])
    seen: dict = {}
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    rx.bind((host, int(port)))
    rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(host) + socket.inet_aton("127.0.0.1"))
    rx.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    rx.settimeout(0.05)
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            try:
                _, anc, _, _ = rx.recvmsg(65536, socket.CMSG_SPACE(4))
            except socket.timeout:
                continue
            tos = next((c[0] for lvl, typ, c in anc if lvl == socket.IPPROTO_IP and typ == socket.IP_TOS and c), 0)
            seen[tos & 3] = seen.get(tos & 3, 0) + 1

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        with fanin.LocalSwitch(cfg) as sw:
            x = np.arange(256 * 100, dtype=np.int32)

            def rank(r: int):
                s = fanin.Session(sw.data_addr, 1, r, elems_per_packet=256, window=64, result_group=group,
                                  ecn=ecn_of_rank[r])
                assert s.params["results_on_group"]
                for _ in range(2):
                    np.testing.assert_array_equal(s.allreduce(x * (r + 1)), x * 3)
                return s.socket_stats()

            results: dict = {}
            threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, rank(r))) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(results) == 2, "a rank failed"
            assert all(st["datagrams_from_group"] > 0 for st in results.values()), results
            counters = sw.counters()
    finally:
        stop.set()
        listener.join(2)
        rx.close()
    return seen, counters


def test_group_results_are_ecn_capable_when_every_listener_answers_marks():
    # one copy to the group: ECT(0) when every member listening there sent
    # ECT(0) (a queue on the way may mark it, and they all echo a mark),
    # Not-ECT as soon as one of them does not answer marks
    # (the listening thread may miss some on a loaded machine: what it
    # reads is checked, and that it read a good share)
    seen, counters = _group_codepoints(ecn_of_rank=[True, True])
    assert counters["results_to_group"] > 0
    assert set(seen) == {2} and seen[2] >= 0.25 * counters["results_to_group"], (seen, counters)
    seen, counters = _group_codepoints(ecn_of_rank=[True, False])
    assert set(seen) == {0} and seen[0] >= 0.25 * counters["results_to_group"], (seen, counters)


def test_a_goat_relay_daemon_passes_a_mark_on_to_the_switch_past_it():
    """Rank 1 reaches the node through an on-path relay (a second switch
    daemon with a transit for job 1, docs/goat.md), and the link into the
    relay marks everything CE: the relay passes the mark on, so the node
    reads it and marks the results, as it would with no relay between."""
    from fanin.control import ControlClient
    from fanin.proc import SwitchProcess

    node_cfg = switch_config(data_addr="127.0.0.1:0", shards=1, control_addr=None, metrics_addr=None,
                             jobs=[{"job_id": 1, "sources": 2, "block_cnt_max": 256}])
    relay_cfg = switch_config(data_addr="127.0.0.1:0", shards=1, control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0",
                              jobs=[])
    with fanin.LocalSwitch(node_cfg) as node, SwitchProcess(relay_cfg) as relay:
        ControlClient(relay.control_addr).install_transit(1, node.data_addr, 1)
        marker = ResultEater(relay.data_addr, ce_up=True)
        try:
            (r0,), (r1,) = _two_ranks(node.data_addr, marker.addr, iters=1)
        finally:
            marker.close()
        node_counters, relay_counters = node.counters(), relay.counters()
    assert relay_counters["transit_up"] >= 400 and relay_counters["ecn_ce"] >= 400, relay_counters
    # every contribution of rank 1 reached the node still marked
    assert node_counters["ecn_ce"] >= 400 and node_counters["congestion_marked"] >= 400, node_counters
    assert r0["marked_results"] >= 400 and r1["marked_results"] >= 400, (r0, r1)
    assert r0["retransmissions"] == r1["retransmissions"] == 0, (r0, r1)
