"""The controller: Steiner trees with an LCA root, incremental programming,
errors; per-job keys issued to members; and real multi-level aggregation
through real switch daemons on loopback (keyed, with forgeries), with loss
on every hop and workers joining and leaving."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import fanin
from fanin import _native, topology
from fanin.controller import (
    SWITCH_RANK_BASE, Controller, ControllerClient, ControllerError, ControllerServer, JobParams, StaticFabric,
    TreeError, build_tree, diff_roles, roles, switch_rank,
)
from fanin.controller.loopback import LoopbackSwitches
from fanin.topology import Host, Link, Switch, Topology

from relay import one_member_left_behind
from threads import in_threads


# -- trees --------------------------------------------------------------------------


def test_root_is_the_lowest_common_ancestor_in_a_fat_tree():
    ft = topology.fat_tree(4)
    same_edge = build_tree(ft, {0: "h0_0_0", 1: "h0_0_1"})
    assert (same_edge.root, same_edge.depth(), sorted(same_edge.parent)) == ("edge0_0", 1, ["edge0_0"])
    same_pod = build_tree(ft, {0: "h0_0_0", 1: "h0_1_0"})
    assert same_pod.root.startswith("agg0_") and same_pod.depth() == 2
    assert set(same_pod.parent) == {same_pod.root, "edge0_0", "edge0_1"}
    two_pods = build_tree(ft, {0: "h0_0_0", 1: "h3_1_1"})
    assert two_pods.root.startswith("core") and two_pods.depth() == 3
    # every path is a shortest path: 5 switches for two workers in two pods
    assert len(two_pods.parent) == 5
    everyone = build_tree(ft, {i: h.name for i, h in enumerate(ft.hosts)})
    assert everyone.root.startswith("core") and everyone.depth() == 3
    # a Steiner tree: every switch has a worker below it
    assert all(any(_below(everyone, a, s) for a in everyone.attach.values()) for s in everyone.parent)


def _below(tree, node, switch):
    while node is not None:
        if node == switch:
            return True
        node = tree.parent[node]
    return False


def test_deep_tree_has_the_levels_it_names_and_switch_ranks_are_stable():
    for levels in (1, 2, 3):
        topo = topology.deep_tree(levels, 2)
        tree = build_tree(topo, {0: "h0", 1: "h1"})
        assert tree.depth() == levels
        r = roles(topo, tree)
        assert r[tree.root].parent is None and r[tree.root].rank is None
        for s, role in r.items():
            if role.parent is not None:
                assert role.rank == switch_rank(topo, s) >= SWITCH_RANK_BASE
                assert role.rank in r[role.parent].members


def test_a_new_worker_reprograms_only_the_switches_whose_role_changes():
    ft = topology.fat_tree(4)
    before = roles(ft, build_tree(ft, {0: "h0_0_0", 1: "h0_1_0"}))
    # same edge switch as worker 0: only that edge switch changes
    d = diff_roles(before, roles(ft, build_tree(ft, {0: "h0_0_0", 1: "h0_1_0", 2: "h0_0_1"})))
    assert (set(d.added), set(d.changed), d.removed) == (set(), {"edge0_0"}, [])
    # another pod: a core root and that pod's path are added, the old root gets a parent
    d = diff_roles(before, roles(ft, build_tree(ft, {0: "h0_0_0", 1: "h0_1_0", 2: "h2_0_0"})))
    assert any(s.startswith("core") for s in d.added) and "edge2_0" in d.added
    assert set(d.changed) == {"agg0_0"} and d.removed == []
    # the worker leaves again: exactly the reverse
    after = roles(ft, build_tree(ft, {0: "h0_0_0", 1: "h0_1_0", 2: "h2_0_0"}))
    back = diff_roles(after, before)
    assert set(back.removed) == set(d.added) and set(back.changed) == {"agg0_0"}


def test_no_path_unknown_host_and_bad_ranks_are_clear_errors():
    islands = Topology("islands", [Switch("a"), Switch("b")], [Host("h0"), Host("h1")],
                       [Link("h0", "a"), Link("h1", "b")]).validate()
    with pytest.raises(TreeError, match="no path"):
        build_tree(islands, {0: "h0", 1: "h1"})
    with pytest.raises(TreeError, match="no host named 'h9'"):
        build_tree(islands, {0: "h9"})
    with pytest.raises(TreeError, match="rank 2048 is out of range"):
        build_tree(islands, {2048: "h0"})


def test_controller_refuses_unknown_jobs_duplicate_ranks_and_foreign_hosts():
    topo = topology.star(2)
    ctl = Controller(topo, StaticFabric({"s0": {"control": "127.0.0.1:1", "data": "127.0.0.1:2"}}))
    with pytest.raises(ControllerError, match="job 3 does not exist") as e:
        ctl.subscribe(3, 0, "h0")
    assert e.value.code == "NOT_FOUND"
    ctl.create_job(JobParams(3, max_workers=2))
    with pytest.raises(ControllerError, match="already exists"):
        ctl.create_job(JobParams(3))
    with pytest.raises(ControllerError, match="not a host") as e:
        ctl.subscribe(3, 0, "s0")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ControllerError, match="rank 1 is not subscribed"):
        ctl.unsubscribe(3, 1)
    with pytest.raises(ControllerError, match="max_workers 0 is out of range"):
        ctl.create_job(JobParams(4, max_workers=0))


# -- keys -----------------------------------------------------------------------------


def _switch_jobs(sws):
    """Every switch's admitted jobs, as its control API lists them."""
    from fanin.control import ControlClient

    out = {}
    for s in sws.procs:
        with ControlClient(sws.fabric.control_addr(s)) as cc:
            out[s] = {j["job_id"]: j for j in cc.list_jobs()}
    return out


def test_keyed_by_default_member_keys_per_rank_and_every_switch_holds_the_job_key():
    topo = topology.leaf_spine(1, 2, 2)  # spine0; leaf0: h0_0 h0_1; leaf1: h1_0 h1_1
    hosts = ["h0_0", "h0_1", "h1_0", "h1_1"]
    with LoopbackSwitches(topo) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, max_workers=4))
        ctl.create_job(JobParams(2, max_workers=4, auth=False))
        subs = {r: ctl.subscribe(1, r, hosts[r]) for r in range(4)}
        plain = ctl.subscribe(2, 0, hosts[0])
        jobs = _switch_jobs(sws)
        # the same 16-byte job key on every switch of the tree, root and children
        keys = {j[1]["key"] for j in jobs.values() if 1 in j}
        assert len(jobs) == 3 and len(keys) == 1
        (job_key,) = keys
        assert isinstance(job_key, bytes) and len(job_key) == 16
        # each rank gets its own member key, derived from the job key
        member_keys = [subs[r]["member_key"] for r in range(4)]
        assert len(set(member_keys)) == 4
        for r, k in enumerate(member_keys):
            assert k == fanin.derive_member_key(job_key, 1, r)
            assert k != job_key
        # the unauthenticated job: no key anywhere
        assert plain["member_key"] is None
        assert all(j[2]["key"] is None for j in jobs.values() if 2 in j)
        # a second keyed job draws its own key
        ctl.create_job(JobParams(3, max_workers=4))
        other = ctl.subscribe(3, 0, hosts[0])["member_key"]
        assert other != fanin.derive_member_key(job_key, 3, 0)
        # leaving and rejoining (update_job on a keyed job keeps its key) gives the same member key;
        # a rank that left while others stayed rejoins the running stream (sync)
        ctl.unsubscribe(1, 3)
        assert ctl.subscribe(1, 3, hosts[3], sync=True)["member_key"] == member_keys[3]
        assert {j[1]["key"] for j in _switch_jobs(sws).values() if 1 in j} == {job_key}
        # the key appears in no repr and no error the controller makes
        for text in (repr(ctl._jobs[1]), repr(JobParams(1))):
            assert job_key.hex() not in text and repr(job_key) not in text
        with pytest.raises(ControllerError) as e:
            ctl.subscribe(1, 0, hosts[0])
        assert job_key.hex() not in str(e.value)
        ctl.close()


def test_a_restarted_controller_rebuilds_jobs_trees_and_keys_from_the_switches():
    """Nothing on disk: a second controller over the same switches adopts
    every job from ListJobs: the same roles, tree and key; workers get their
    member keys again by subscribing to the same switch, a duplicate is still
    refused, and a new worker reprograms only what its arrival changes."""
    topo = topology.leaf_spine(1, 2, 2)  # spine0; leaf0: h0_0 h0_1; leaf1: h1_0 h1_1
    with LoopbackSwitches(topo) as sws:
        first = Controller(topo, sws.fabric)
        first.create_job(JobParams(1, max_workers=4, block_cnt_max=32, on_failure="fail"))
        first.create_job(JobParams(2, max_workers=4, auth=False))
        subs = {r: first.subscribe(1, r, h) for r, h in enumerate(["h0_0", "h0_1", "h1_0"])}
        first.subscribe(2, 0, "h1_1")
        before = (first._jobs[1].roles, first.tree(1).parent, first.tree(1).attach, first._jobs[1].params)
        first.close()

        second = Controller(topo, sws.fabric)
        report = second.rebuild()
        assert report == {"adopted": [1, 2], "unreachable": [], "not_adopted": {}}
        job = second._jobs[1]
        assert (job.roles, second.tree(1).parent, second.tree(1).attach, job.params) == before
        assert second._jobs[2].key is None and second._jobs[2].params.auth is False
        assert second.rebuild()["adopted"] == [], "adopting twice changes nothing"
        # a worker of the job subscribing again: same key, nothing programmed;
        # from a host under another switch it is a different worker: refused
        with pytest.raises(ControllerError, match="rank 2 is already subscribed \\(from a host under leaf1\\)"):
            second.subscribe(1, 2, "h0_0")
        again = second.subscribe(1, 0, "h0_1")
        assert again == {**subs[0], "programmed": []}
        with pytest.raises(ControllerError, match="already subscribed"):
            second.subscribe(1, 0, "h0_1")
        # a new worker under leaf1 changes only leaf1's members
        assert second.subscribe(1, 3, "h1_1")["programmed"] == ["leaf1"]
        assert {j[1]["key"] for j in _switch_jobs(sws).values() if 1 in j} == {job.key}
        with pytest.raises(ControllerError, match="ALREADY_EXISTS|already exists"):
            second.create_job(JobParams(1))
        second.close()
        # a job its switches hold differently is named with the reason, not guessed
        from fanin.control import ControlClient

        for sw, cnt in (("leaf0", 8), ("leaf1", 16)):
            with ControlClient(sws.fabric.control_addr(sw)) as cc:
                cc.admit_job(job_id=9, members=[0], block_cnt_max=cnt, block_grad_max=64)
        third = Controller(topo, sws.fabric)
        report = third.rebuild()
        assert report["adopted"] == [1, 2] and list(report["not_adopted"]) == [9]
        assert "leaf0 and leaf1 hold it with different block_cnt_max" in report["not_adopted"][9]
        third.close()


def test_grpc_create_job_auth_switch_and_absent_field_means_keyed():
    from fanin.control._gen import control_pb2 as pb
    from fanin.control.client import call_rpc
    from fanin.control._gen import control_pb2_grpc as pb_grpc
    import grpc

    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        with ControllerServer(Controller(topo, sws.fabric), "127.0.0.1:0") as srv, ControllerClient(srv.addr) as c:
            c.create_job(1, max_workers=2)
            c.create_job(2, max_workers=2, auth=False)
            # a request without the field (an older client) creates a keyed job
            with grpc.insecure_channel(srv.addr) as ch:
                call_rpc(pb_grpc.ControllerStub(ch), "CreateJob", pb.CreateJobRequest(job_id=3, max_workers=2),
                         addr=srv.addr, timeout=5, metadata=None)
            k1, k3 = (c.subscribe(j, 0, "h0")["member_key"] for j in (1, 3))
            assert len(k1) == 16 and len(k3) == 16 and k1 != k3
            assert c.subscribe(2, 0, "h0")["member_key"] is None
            job_key = _switch_jobs(sws)["s0"][1]["key"]
            assert k1 == fanin.derive_member_key(job_key, 1, 0)


def test_a_controller_job_that_names_no_failure_policy_fails_loudly_unless_it_asked_for_aging():
    """The tree controller admits its jobs with the switch's default policy:
    `fail` unless the job asked for straggler aging (`degrade` then), so a
    job that did not opt into partial sums never gets one (docs/failures.md);
    a named policy is kept, through the gRPC API too."""
    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        with ControllerServer(Controller(topo, sws.fabric), "127.0.0.1:0") as srv, ControllerClient(srv.addr) as c:
            c.create_job(1, max_workers=2)
            c.create_job(2, max_workers=2, block_exp_ms=10)
            c.create_job(3, max_workers=2, on_failure="degrade")
            c.create_job(4, max_workers=2, block_exp_ms=10, on_failure="fail")
            for job in range(1, 5):
                c.subscribe(job, 0, "h0")
            policies = {j: spec["on_failure"] for j, spec in _switch_jobs(sws)["s0"].items()}
            assert policies == {1: "fail", 2: "degrade", 3: "degrade", 4: "fail"}
            with pytest.raises(ValueError, match="degrade, fail or None"):
                c.create_job(5, on_failure="ignore")


def test_cli_create_job_no_auth_and_subscribe_prints_the_member_key_in_hex(capsys):
    from fanin.cli import main

    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        with ControllerServer(Controller(topo, sws.fabric), "127.0.0.1:0") as srv:
            assert main(["controller", "create-job", "1", "--max-workers", "2", "--addr", srv.addr]) == 0
            assert main(["controller", "create-job", "2", "--max-workers", "2", "--no-auth", "--addr", srv.addr]) == 0
            capsys.readouterr()
            assert main(["controller", "subscribe", "1", "--rank", "1", "--host", "h1", "--addr", srv.addr]) == 0
            keyed = json.loads(capsys.readouterr().out)
            assert main(["controller", "subscribe", "2", "--rank", "1", "--host", "h1", "--addr", srv.addr]) == 0
            plain = json.loads(capsys.readouterr().out)
            job_key = _switch_jobs(sws)["s0"][1]["key"]
            assert bytes.fromhex(keyed["member_key"]) == fanin.derive_member_key(job_key, 1, 1)
            assert plain["member_key"] is None


# -- real daemons on loopback -------------------------------------------------------


def _allreduce_all(addrs, job_id, tensors, keys=None, **kw):
    def work(r):
        s = fanin.Session(addrs[r], job_id, r, auth_key=keys[r] if keys else None, **kw)
        return [s.allreduce(t[r]) for t in tensors] + [s.last_stats]

    return in_threads(len(addrs), work)


def _eventually(check, timeout=5.0):
    """Poll `check` (counters are scraped, so they lag a little); its last value."""
    deadline = time.time() + timeout
    while not (ok := check()) and time.time() < deadline:
        time.sleep(0.05)
    return ok


def _forge(addr: str, job_id: int, src: int) -> None:
    """One Contribution of `job_id` from `src`, sealed under a guessed key,
    from a raw socket (docs/protocol.md §2.2, §2.4)."""
    values = np.full(256, 10_000, dtype=np.int32)
    header = struct.pack(">HBBBBHHHIIHbb", 0xFA17, 1, 0x01, 0, 0, src, 0, 1, job_id, 0, len(values), -128, -128)
    host, port = addr.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(_native.seal_datagram(os.urandom(16), 1 << 40, header + values.astype(">i4").tobytes()),
                    (host, int(port)))


def test_an_elastic_job_with_fewer_workers_than_its_maximum_returns_complete_sums_under_fail():
    """max_workers is what block floating point scales for, not who must
    contribute: two subscribed workers of a job of up to four get exact sums
    (src_cnt 2) under the default `fail` policy, not StaleResult (the worker
    took a src_cnt below the worker count for a partial result)."""
    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, block_cnt_max=8, block_grad_max=256, max_workers=4))
        subs = [ctl.subscribe(1, r, f"h{r}") for r in range(2)]
        assert _switch_jobs(sws)["s0"][1]["on_failure"] == "fail"
        ints = [np.arange(5000, dtype=np.int32) * (r + 1) for r in range(2)]
        out = _allreduce_all([s["data_addr"] for s in subs], 1, [ints], [s["member_key"] for s in subs],
                             elems_per_packet=256)
        for r in range(2):
            assert np.array_equal(out[r][0], ints[0] + ints[1])
            # the stats still say what each block summed (averaging divides by it)
            assert out[r][1]["min_src_cnt"] == 2


@pytest.mark.parametrize("levels", [2, 3])
def test_multi_level_tree_is_exact_with_loss_on_every_hop(levels):
    """A keyed job (the controller's default) over a tree of 2 and 3 levels:
    exact results, no datagram refused, and a forgery counted."""
    topo = topology.deep_tree(levels, 2)
    # ingress and egress loss on every switch: worker-switch and switch-switch hops
    with LoopbackSwitches(topo, shards=2, ingress_drop=0.03, egress_drop=0.03, seed=levels) as sws:
        ctl = Controller(topo, sws.fabric)
        with ControllerServer(ctl, "127.0.0.1:0") as srv, ControllerClient(srv.addr) as c:
            c.create_job(1, block_cnt_max=16, block_grad_max=256, max_workers=2)
            subs = [c.subscribe(1, r, f"h{r}") for r in range(2)]
            addrs = [sub["data_addr"] for sub in subs]
            keys = [sub["member_key"] for sub in subs]
            assert all(k is not None for k in keys)
            assert c.tree(1)["levels"] == levels
            rng = np.random.default_rng(levels)
            ints = [rng.integers(-2**31, 2**31, 20_000, dtype=np.int64).astype(np.int32) for _ in range(2)]
            floats = [rng.standard_normal(7_000).astype(np.float32) for _ in range(2)]
            out = _allreduce_all(addrs, 1, [ints, floats], keys, elems_per_packet=256, rto_ms=5, rto_min_ms=2)
            assert np.array_equal(out[0][0], ints[0] + ints[1])
            assert np.array_equal(out[1][0], out[0][0])
            assert np.array_equal(out[0][1], out[1][1])  # bit-identical floats
            np.testing.assert_allclose(out[0][1], floats[0] + floats[1], rtol=0, atol=1e-5)
            assert out[0][2]["degraded_blocks"] == [] and out[0][2]["min_src_cnt"] == 2
            root = c.tree(1)["root"]
            counters = {s: sws.counters(s) for s in sws.procs}
            # one partial per block goes up from every non-root; the root sends none
            assert counters[root]["sent_up"] == 0
            for s, cn in counters.items():
                if s != root:
                    assert cn["sent_up"] > 0 and cn["relayed_down"] > 0
            # loss between switches was recovered from caches on the way up
            assert sum(cn["resent_up"] for cn in counters.values()) > 0
            # every datagram, worker-switch and switch-switch, verified
            for s, cn in counters.items():
                assert (cn.get("auth_bad_tag", 0), cn.get("auth_replayed", 0), cn.get("auth_unsealed", 0)) == (0, 0, 0), s
            # a forgery from a raw socket at worker 0's switch is counted and dropped
            leaf0, leaf1 = (c.tree(1)["workers"][str(r)]["switch"] for r in range(2))
            # (the switch's injected ingress loss may eat one: forge again until one is counted)
            for forged in range(1, 11):
                _forge(addrs[0], 1, 0)
                if _eventually(lambda: sws.counters(leaf0).get("auth_bad_tag", 0) >= 1, 1.0):
                    break
            assert 1 <= sws.counters(leaf0).get("auth_bad_tag", 0) <= forged
            # a worker that ignores its key gets no answer: a clear timeout naming auth_key, not a hang
            with pytest.raises(fanin.FaninTimeout, match="auth_key"):
                fanin.Session(addrs[1], 1, 1, join_timeout_s=0.5)
            assert _eventually(lambda: sws.counters(leaf1).get("auth_unsealed", 0) >= 1)


def test_a_second_run_on_a_live_tree_is_refused_until_the_ranks_subscribe_again():
    """A tree's switches have no rounds (docs/trees.md): a second run of
    worker processes against a tree that already ran was answered from the
    stream's start, where the switches above still held the first run's
    results, and every rank took the first run's sums for its own, with
    clean statistics. Now each new process is refused at once with the way
    out, and after it (every rank unsubscribes, then they subscribe again)
    the next run gets exact sums of its own; re-subscribing one rank while
    another stays is refused by the controller."""
    topo = topology.deep_tree(2, 2)
    with LoopbackSwitches(topo, shards=2) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, block_cnt_max=16, block_grad_max=256, max_workers=2))
        subs = [ctl.subscribe(1, r, f"h{r}") for r in range(2)]
        assert ctl.tree(1).depth() == 2

        def run(number):
            def work(r):
                s = fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256)
                outs = [s.allreduce(np.full(1024, 1000 * number + 10 * r + call, dtype=np.int32)) for call in range(2)]
                stats = s.last_stats
                del s  # (a session is dropped on the thread that made it)
                return outs, stats

            for outs, stats in in_threads(2, work):
                for call, out in enumerate(outs):
                    assert (out == sum(1000 * number + 10 * r + call for r in range(2))).all(), (number, call, out[:2])
                assert stats["min_src_cnt"] == 2 and stats["missed_blocks"] == 0 and not stats["degraded_blocks"]

        run(1)
        for r in range(2):
            with pytest.raises(fanin.FaninRefused, match="already ran in this job's aggregation tree"):
                fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256)
        leaves = {ctl.tree(1).attach[r] for r in range(2)}
        assert _eventually(lambda: sum(sws.counters(s).get("rerun_in_tree", 0) for s in leaves) >= 2)
        # one rank at a time is refused: its leaf would be admitted afresh
        # under a root that still holds the results it took part in (its
        # new process got them for its own sums, with clean statistics)
        ctl.unsubscribe(1, 0)
        with pytest.raises(ControllerError, match="left while other ranks stayed subscribed"):
            ctl.subscribe(1, 0, "h0")
        ctl.unsubscribe(1, 1)  # the last rank: the job leaves every switch
        subs = [ctl.subscribe(1, r, f"h{r}") for r in range(2)]
        run(2)


@pytest.mark.parametrize("controller_restarted", [False, True], ids=["controller-up", "controller-restarted-too"])
def test_a_second_run_after_the_leaves_restarted_is_refused_not_handed_the_first_runs_sums(controller_restarted):
    """Every switch with workers restarts between two runs and the root
    does not: the restarted leaves have forgotten the processes they saw,
    and the controller installs the job on them again. A new run's Joins
    used to be answered from the stream's start, and the root, still
    holding the first run's results, handed them up as the new run's sums
    (every allreduce got them, with clean statistics; the root counted the
    partials `duplicate`). Now the re-installed leaves know they resumed a
    running tree (the controller says so) and refuse a new process with
    the way out; after it, the ranks subscribe afresh and the next run's
    sums are its own.

    controller-restarted-too: the controller is gone while the leaves
    restart, and they come back without the job; a new controller rebuilds
    the job from the root (which still lists them as its children) and
    installs it on them when the ranks subscribe again: resumed too."""
    topo = topology.deep_tree(2, 2)
    with LoopbackSwitches(topo, shards=2) as sws:
        ctl, subs, leaves = _two_leaf_job(topo, sws)

        def run(number):
            def work(r):
                s = fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256)
                outs = [s.allreduce(np.full(1024, 1000 * number + 10 * r + call, dtype=np.int32)) for call in range(2)]
                del s  # (a session is dropped on the thread that made it)
                return outs

            for outs in in_threads(2, work):
                for call, out in enumerate(outs):
                    assert (out == sum(1000 * number + 10 * r + call for r in range(2))).all(), (number, call, out[:2])

        run(1)
        if controller_restarted:
            ctl.close()
            for leaf in leaves:
                sws.restart(leaf)
            ctl = Controller(topo, sws.fabric)
            assert ctl.rebuild()["adopted"] == [1]
            for r in range(2):
                assert ctl.subscribe(1, r, f"h{r}")["member_key"] == subs[r]["member_key"]
        else:
            for leaf in leaves:
                sws.restart(leaf)
            assert sorted(s for s, _ in ctl.reconcile()) == leaves
        for r in range(2):
            with pytest.raises(fanin.FaninRefused, match="restarted after the job was installed on it"):
                fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256,
                              join_timeout_s=5)
        assert _eventually(lambda: sum(sws.counters(s).get("resumed_refused", 0) for s in leaves) >= 2)
        for r in range(2):
            ctl.unsubscribe(1, r)
        subs = [ctl.subscribe(1, r, f"h{r}") for r in range(2)]
        run(2)


def _mixed_root_job(sws, topo):
    """Job 1 on `_MIXED`: rank 0 hangs off the root `a` itself, ranks 1
    and 2 off its child switch `b`. Returns the controller, the
    subscriptions and the switches that hold a worker."""
    ctl = Controller(topo, sws.fabric)
    ctl.create_job(JobParams(1, block_cnt_max=16, block_grad_max=256, max_workers=3))
    subs = [ctl.subscribe(1, r, f"h{r}") for r in range(3)]
    assert ctl.tree(1).root == "a"
    return ctl, subs, ["a", "b"]


#: A root with a worker of its own and a child switch with two.
_MIXED = topology.Topology("mixed", [topology.Switch("a"), topology.Switch("b")],
                           [topology.Host("h0"), topology.Host("h1"), topology.Host("h2")],
                           [topology.Link("h0", "a"), topology.Link("a", "b"), topology.Link("h1", "b"),
                            topology.Link("h2", "b")]).validate()


@pytest.mark.parametrize("restarted", ["leaves", "root", "every-switch", "mixed-root", "mixed-child", "mixed-both"])
def test_switches_restarted_mid_run_recover_exactly_and_leaves_are_resumed(restarted):
    """The other side of the rule above: when switches of the tree restart
    *while* the run goes on, the controller installs the job on them again
    marked resumed, and the running workers — whose probes and stale
    contributions the new switches refuse — recover through them
    (docs/restart.md): every allreduce is exact and each worker went
    through a recovery. A restarted root (or inner switch) refuses its
    child switches' partials until each child restarted its subtree's
    stream and reported its workers' lowest block: the workers below a
    child recover too (docs/restart.md, "Trees"). mixed-*: the root has a
    worker of its own beside its child switch (its recovery floor used to
    wait for a child that never reported: every worker failed)."""
    mixed = restarted.startswith("mixed")
    topo = _MIXED if mixed else topology.deep_tree(2, 2)
    calls, n = 30, 4096
    with LoopbackSwitches(topo, shards=2) as sws:
        ctl, subs, leaves = _mixed_root_job(sws, topo) if mixed else _two_leaf_job(topo, sws)
        root = ctl.tree(1).root
        targets = {"leaves": leaves, "root": [root], "every-switch": [*leaves, root],
                   "mixed-root": ["a"], "mixed-child": ["b"], "mixed-both": ["a", "b"]}[restarted]
        ranks = len(subs)
        progress = [0] * ranks
        results: dict[int, object] = {}

        def work(r):
            try:
                s = fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256,
                                  rto_ms=20, rto_min_ms=5)
                recoveries = 0
                for call in range(calls):
                    out = s.allreduce(np.full(n, 10 * r + call, dtype=np.int32))
                    assert (out == sum(10 * q + call for q in range(ranks))).all(), (call, out[:2])
                    recoveries += s.last_stats["recoveries"]
                    progress[r] = call + 1
                    time.sleep(0.01)
                del s
                results[r] = recoveries
            except BaseException as e:  # reported below, on the test's thread
                results[r] = e

        threads = [threading.Thread(target=work, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        assert _eventually(lambda: min(progress) >= 3, timeout=30)
        for switch in targets:
            sws.restart(switch)
        reinstalled = []
        assert _eventually(lambda: reinstalled.extend(ctl.reconcile()) or len(reinstalled) == len(targets), timeout=10)
        for t in threads:
            t.join(120)
        assert not any(isinstance(v, BaseException) for v in results.values()), results
        # a worker on or below a restarted switch recovered, and only such a one
        tree = ctl.tree(1)

        def path_up(sw):
            while sw is not None:
                yield sw
                sw = tree.parent[sw]

        below = [any(sw in targets for sw in path_up(tree.attach[r])) for r in range(ranks)]
        assert progress == [calls] * ranks, progress
        assert [results[r] >= 1 for r in range(ranks)] == below, (results, below)
        for switch in targets:
            (job,) = _list_jobs(sws, switch)
            assert job["resumed"] is True
        # a restarted switch with child switches asked each to report
        parent_of = ctl.tree(1).parent
        parents = [s for s in targets if s in parent_of.values()]
        assert all(sws.counters(s).get("child_rejoin_asked", 0) >= 1 for s in parents), parents
        # a restarted controller learns the marks from the switches, and
        # keeps them when it programs them again
        again = Controller(topo, sws.fabric)
        assert again.rebuild()["adopted"] == [1]
        assert again._jobs[1].resumed_on == set(targets)


def test_a_root_restarted_while_one_subtrees_workers_finished_recovers_with_them_lingering():
    """docs/restart.md, "Idle members", in a tree (real daemons, the
    controller re-installing): rank 0 (under one leaf) finished its last
    allreduce; rank 1 (under the other, its results dropped by a relay)
    has none of it; then the root and rank 1's leaf restart. Rank 1
    recovers at its leaf, whose partials the restarted root takes only
    once every member reported, rank 0's leaf too: that leaf did not
    restart and its only worker no longer calls allreduce, but it lingers,
    the leaf passes its probes up, and the root's refusal makes the leaf
    restart its subtree's stream and report."""
    topo = topology.deep_tree(2, 2)
    with LoopbackSwitches(topo, shards=1) as sws:
        ctl, subs, leaves = _two_leaf_job(topo, sws)
        tree = ctl.tree(1)
        root, leaf0, leaf1 = tree.root, tree.attach[0], tree.attach[1]

        def restart() -> None:
            for switch in (root, leaf1):
                sws.restart(switch)
            reinstalled = []
            assert _eventually(lambda: reinstalled.extend(ctl.reconcile()) or len(reinstalled) == 2, timeout=10)

        keys = [{"auth_key": subs[r]["member_key"]} for r in range(2)]
        got, want, lingered, took_s = one_member_left_behind(
            [subs[0]["data_addr"], subs[1]["data_addr"]], restart, linger=True, session_kw=keys)
        assert not isinstance(got, Exception), got
        np.testing.assert_array_equal(got, want)
        assert lingered["idle_recoveries"] == 1, lingered
        assert _eventually(lambda: sws.counters(leaf0).get("probes_up", 0) >= 1), sws.counters(leaf0)
        assert sws.counters(leaf0).get("parent_restarts", 0) == 1
        assert sws.counters(root).get("child_probes", 0) >= 1
        print(f"root and one leaf restarted, the other leaf's worker lingering: rank 1 done {took_s * 1000:.0f} ms "
              f"after the switches were re-installed; rank 0 {lingered}")


def _two_leaf_job(topo, sws):
    """Job 1 on `deep_tree(2, 2)`: ranks 0 and 1 subscribed, one under
    each leaf. Returns the controller, the subscriptions and the leaves."""
    ctl = Controller(topo, sws.fabric)
    ctl.create_job(JobParams(1, block_cnt_max=16, block_grad_max=256, max_workers=2))
    subs = [ctl.subscribe(1, r, f"h{r}") for r in range(2)]
    tree = ctl.tree(1)
    leaves = sorted({tree.attach[r] for r in range(2)})
    assert tree.depth() == 2 and tree.root not in leaves and len(leaves) == 2
    return ctl, subs, leaves


def _list_jobs(sws, switch):
    from fanin.control import ControlClient

    with ControlClient(sws.procs[switch].control_addr) as c:
        return c.list_jobs()


def _stream_block_sums(sub, r, *, n_elems, epp, sync, until, into, deadline_s, start_together, on_start=None,
                       after_each=None, **session_kw):
    """Worker r of job 1 allreduces 2**r in every element until `until(k)`
    after k allreduces, keeping one sum per block in `into` (allreduce
    index -> block sums; every element of a block holds the same sum).
    `on_start(first)` gets the allreduce it starts at, `after_each(k)`
    runs after each. A worker that is not joining waits at
    `start_together` for the others."""
    align = n_elems // epp
    s = fanin.Session(sub["data_addr"], 1, r, auth_key=sub["member_key"], elems_per_packet=epp, window=8, sync_join=sync,
                      align_blocks=align if sync else 0, rto_ms=20, rto_min_ms=5, **session_kw)
    if not sync:
        start_together.wait()
    first = s.params["next_block"] // align
    if on_start is not None:
        on_start(first)
    k = 0
    deadline = time.monotonic() + deadline_s
    while not until(k):
        assert time.monotonic() < deadline, f"worker {r} still streaming after {deadline_s} s ({k} allreduces)"
        out = s.allreduce(np.full(n_elems, 1 << r, dtype=np.int32))
        assert all((out[i:i + epp] == out[i]).all() for i in range(0, n_elems, epp))
        into[first + k] = out[::epp].copy()
        k += 1
        if after_each is not None:
            after_each(k)


def test_workers_join_and_leave_while_allreduces_stream():
    """Worker r adds 2**r to every element, so each block's sum names the
    workers it summed. Worker 2 joins a running job (sync) and leaves again,
    worker 1 leaves; every block is a sum over workers subscribed while it
    ran, the same for every worker that got it, and nothing hangs."""
    topo = topology.leaf_spine(1, 2, 2)  # spine0; leaf0: h0_0 h0_1; leaf1: h1_0 h1_1
    n_elems, epp = 4096, 256
    with LoopbackSwitches(topo, shards=2) as sws:
        ctl = Controller(topo, sws.fabric)
        # An allreduce in flight while a worker leaves sums it in some blocks
        # and not in others: a partial result, which this elastic stream asks
        # for (under the default `fail` the call raises StaleResult instead).
        ctl.create_job(JobParams(1, block_cnt_max=8, block_grad_max=epp, max_workers=4, on_failure="degrade"))
        hosts = {0: "h0_0", 1: "h1_0", 2: "h0_1"}
        subs = {r: ctl.subscribe(1, r, hosts[r]) for r in (0, 1)}  # keyed: each gets its member key
        results: dict[int, dict[int, np.ndarray]] = {r: {} for r in hosts}  # allreduce index -> block sums
        join_now, one_left, joiner_left = threading.Event(), threading.Event(), threading.Event()
        start_together = threading.Barrier(2)

        def stream(r, sync, until):
            # Bounded in time, not in allreduces: how many run while the
            # controller reprograms the tree depends on the machine's speed
            # (78 to 157 here; more than 300 on a fast one).
            def first_is_0_unless_joining(first):
                assert first == 0 or sync

            _stream_block_sums(subs[r], r, n_elems=n_elems, epp=epp, sync=sync, until=until, into=results[r],
                               deadline_s=60, start_together=start_together, on_start=first_is_0_unless_joining,
                               after_each=lambda k: r == 0 and k == 5 and join_now.set())

        def worker0():
            stream(0, False, lambda k: joiner_left.is_set() and k >= max(results[2], default=0) + 3)

        def worker1():
            stream(1, False, lambda k: k >= 12 and 2 in results and len(results[2]) >= 2)
            ctl.unsubscribe(1, 1)  # leaves: the others stop waiting for it
            one_left.set()

        def joiner():
            assert join_now.wait(30)
            subs[2] = ctl.subscribe(1, 2, hosts[2], sync=True)
            after = []
            stream(2, True, lambda k: one_left.is_set() and (after.append(k) or len(after) > 3))
            ctl.unsubscribe(1, 2)
            joiner_left.set()

        tasks = [worker0, worker1, joiner]
        in_threads(3, lambda i: tasks[i](), timeout=120)
        for r, runs in results.items():
            for blocks in runs.values():
                for v in blocks:
                    assert 0 < v and v & ~0b111 == 0, (r, v)  # sums of 1, 2, 4 only
        sets0 = [frozenset(b for b in range(3) if v >> b & 1) for k in sorted(results[0]) for v in results[0][k]]
        assert sets0[0] == frozenset({0, 1}) and sets0[-1] == frozenset({0}), \
            (sets0[-3:], len(results[0]), max(results[1]), min(results[2]), max(results[2]))
        assert frozenset({0, 1, 2}) in sets0 and frozenset({0, 2}) in sets0
        # the joiner lined up with the others (same allreduce, same sums) and
        # was in every block from its start block on
        assert results[2] and min(results[2]) > 0
        for k, blocks in results[2].items():
            assert np.array_equal(blocks, results[0][k]), k
            assert all(v >> 2 & 1 for v in blocks), (k, blocks)
        for k, blocks in results[1].items():
            assert np.array_equal(blocks, results[0][k]), k


def _two_stream_then_a_joiner_syncs(ctl, hosts, epp, subscribe_joiner, n_elems=1024):
    """Ranks 0 and 1 stream allreduces of job 1 (worker r adds 2**r); at
    rank 0's fifth, `subscribe_joiner()` subscribes rank 2 (sync) and
    returns its subscription; rank 2 streams five allreduces and the others
    go on to its last. Returns (per rank: allreduce index -> block sums,
    the allreduce each rank started at)."""
    subs = {r: ctl.subscribe(1, r, hosts[r]) for r in (0, 1)}
    results: dict[int, dict[int, np.ndarray]] = {r: {} for r in hosts}
    join_now = threading.Event()
    start: dict[int, int] = {}
    start_together = threading.Barrier(2)

    def stream(r, sync, until):
        # short timeouts: a job that stops fails in seconds instead of hanging
        _stream_block_sums(subs[r], r, n_elems=n_elems, epp=epp, sync=sync, until=until, into=results[r],
                           deadline_s=30, start_together=start_together,
                           on_start=lambda first: start.__setitem__(r, first),
                           after_each=lambda k: r == 0 and k == 5 and join_now.set(),
                           join_timeout_s=5, dead_after_s=5)

    def joiner():
        assert join_now.wait(30)
        subs[2] = subscribe_joiner()
        stream(2, True, lambda k: k >= 5)

    def worker(r):
        stream(r, False, lambda k: k >= start.get(2, k + 1) + 5)

    tasks = [lambda: worker(0), lambda: worker(1), joiner]
    in_threads(3, lambda i: tasks[i](), timeout=60)
    return results, start


def test_a_joiner_that_grows_a_new_root_gets_exact_sums_with_the_running_workers():
    """Workers 0 and 1 share leaf0, the tree's only switch; worker 2 joins
    the running job (sync) under leaf1, so the controller grows a new root
    (spine0) above leaf0. The new root must wait for the joiner's branch
    only from the joiner's start block (awaiting), as a parent that gains a
    child does: admitted with that branch active, it waited for leaf1 from
    its first block, which leaf1 never sends, and the job stopped. Worker r
    adds 2**r: every block sums workers 0 and 1 before the joiner's start,
    all three from it on."""
    topo = topology.leaf_spine(1, 2, 2)  # spine0; leaf0: h0_0 h0_1; leaf1: h1_0 h1_1
    n_elems, epp = 1024, 256
    with LoopbackSwitches(topo) as sws:
        ctl = Controller(topo, sws.fabric)
        # the default failure policy (`fail`): workers take only complete
        # results, and the blocks before the joiner's start are complete
        # without it (a switch counted the awaiting joiner as missing, and
        # the running workers raised StaleResult on exact sums)
        ctl.create_job(JobParams(1, block_cnt_max=8, block_grad_max=epp, max_workers=3))
        hosts = {0: "h0_0", 1: "h0_1", 2: "h1_0"}

        def subscribe_joiner():
            assert ctl.tree(1).root == "leaf0"
            sub = ctl.subscribe(1, 2, hosts[2], sync=True)
            assert ctl.tree(1).root == "spine0" and ctl.tree(1).parent["leaf0"] == "spine0"
            return sub

        results, start = _two_stream_then_a_joiner_syncs(ctl, hosts, epp, subscribe_joiner, n_elems)
        assert sorted(results[2]) == list(range(start[2], start[2] + 5))
        for r in (0, 1):
            assert sorted(results[r]) == list(range(start[2] + 5)), r
        for r, runs in results.items():
            for k, blocks in runs.items():
                assert (blocks == (0b111 if k >= start[2] else 0b011)).all(), (r, k, blocks)


def test_a_tree_job_is_sized_to_the_smallest_mtu_of_its_switches_and_never_fragments():
    # every switch of a tree uses the job's block_grad_max as its packet
    # size: the controller caps it to the smallest data-port MTU it finds
    # (1500 here: 358 float32 per datagram), once, for the job's life
    topo = topology.leaf_spine(1, 2, 2)
    hosts = ["h0_0", "h0_1", "h1_0", "h1_1"]
    with LoopbackSwitches(topo, data_mtu=1500) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, max_workers=4, auth=False))
        ctl.create_job(JobParams(2, max_workers=4, block_grad_max=256, auth=False))
        subs = {r: ctl.subscribe(1, r, hosts[r]) for r in range(4)}
        ctl.subscribe(2, 0, hosts[0])
        ctl.subscribe(2, 2, hosts[2])
        jobs = _switch_jobs(sws)
        assert {j[1]["block_grad_max"] for j in jobs.values() if 1 in j} == {358}
        assert {j[2]["block_grad_max"] for j in jobs.values() if 2 in j} == {256}, "already fits"
        # the workers learn it, and their sums are exact through the tree
        x = np.arange(5000, dtype=np.int32)

        def worker(r):
            s = fanin.Session(subs[r]["data_addr"], 1, r)
            assert s.elems_per_packet == 358
            return s.allreduce(x + r)

        for y in in_threads(4, worker):
            np.testing.assert_array_equal(y, 4 * x + 6)
        ctl.close()


def test_root_shards_follow_spare_capacity_and_a_switch_with_none_gets_no_share():
    from fanin.controller.roots import spare_capacity, weigh_root_shards

    # spine0's link to leaf1 is full both ways; spine2's uplink from leaf0 half
    load = {("spine0", "leaf1"): 0.99, ("leaf1", "spine0"): 1.01, ("leaf0", "spine2"): 0.5}
    spare = spare_capacity(["spine0", "spine1", "spine2"], ["leaf0", "leaf1"], load)
    assert spare == {"spine0": 0.0, "spine1": 1.0, "spine2": 0.5}
    shards = weigh_root_shards(["spine0", "spine1", "spine2"], spare)
    # 12 units in proportion 0 : 1 : 0.5 = 0 : 8 : 4, reduced to 2 : 1,
    # interleaved, the largest share first
    assert shards == ["spine1", "spine2", "spine1"]
    # the same spare everywhere, or none anywhere: one shard each, unchanged
    assert weigh_root_shards(["b", "a"], {"a": 0.3, "b": 0.3}) == ["b", "a"]
    assert weigh_root_shards(["b", "a"], {"a": 0.0, "b": 0.0}) == ["b", "a"]
    # 9 shards for 0.5 : 0.3 : 0.2: 5 : 3 : 1 loads no switch more than 10
    # shards per unit of spare capacity, which no split of 9 beats
    shares = weigh_root_shards(["x", "y", "z"], {"x": 0.5, "y": 0.3, "z": 0.2}, units_per_switch=3)
    assert [shares.count(c) for c in "xyz"] == [5, 3, 1] and shares[0] == "x"
    # a nearly full switch gets no shard its spare capacity cannot carry
    # (largest remainders would give 0.02 and 0.03 one of 20 each)
    spare = {"s0": 0.02, "s1": 0.01, "s2": 0.5, "s3": 0.03, "s4": 0.5}
    assert weigh_root_shards(list(spare), spare) == ["s2", "s4"]
    with pytest.raises(ValueError, match="no spare capacity given for z"):
        weigh_root_shards(["x", "z"], {"x": 1.0})
    with pytest.raises(ValueError, match="at least 1"):
        weigh_root_shards(["x"], {"x": 1.0}, units_per_switch=0)
    with pytest.raises(ValueError, match="spare capacity of y is nan"):
        weigh_root_shards(["x", "y"], {"x": 1.0, "y": float("nan")})
    with pytest.raises(ValueError, match="not a fraction of the link rate"):
        spare_capacity(["spine0"], ["leaf0"], {("leaf0", "spine0"): float("nan")})


# -- controller restarts, partial failures, foreign jobs (from a review) ------------


def test_a_rank_back_plainly_under_a_fresh_leaf_of_a_tree_that_ran_is_refused_even_by_a_restarted_controller():
    """The controller that saw a rank leave refuses its plain subscribe; a
    restarted one does not know, but the root does: its stream ran, and a
    child added active would be answered from the stream's start, where it
    holds results the rank's old process took part in (they look complete:
    every rank of the next run got the first run's sums). The root refuses
    the update (FAILED_PRECONDITION), the fresh leaf loses the job again,
    and the way the message names works: a sync join, or a new run."""
    from fanin.control import ControlClient

    topo = topology.deep_tree(2, 3)  # s0 root; leaves s1_0, s1_1, s1_2; h0, h1, h2
    hosts = ["h0", "h1", "h2"]
    with LoopbackSwitches(topo) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, block_cnt_max=16, block_grad_max=256, max_workers=3))
        subs = [ctl.subscribe(1, r, hosts[r]) for r in range(3)]

        def run(number):
            def work(r):
                s = fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256)
                try:
                    return [int(s.allreduce(np.full(1024, 1000 * number + 10 * r + k, dtype=np.int32))[0])
                            for k in range(2)]
                finally:
                    del s
            return in_threads(3, work, timeout=60)

        assert run(1) == [[sum(1000 + 10 * q + k for q in range(3)) for k in range(2)]] * 3
        ctl.unsubscribe(1, 0)
        ctl.close()
        ctl = Controller(topo, sws.fabric)  # the controller restarts
        assert ctl.rebuild()["adopted"] == [1]
        with pytest.raises(ControllerError) as e:
            ctl.subscribe(1, 0, "h0")
        assert e.value.code == "FAILED_PRECONDITION" and "sync_join=True" in str(e.value), e.value
        assert "undone on ['s1_0']" in str(e.value), e.value
        with ControlClient(sws.fabric.control_addr("s1_0")) as cc:
            assert cc.list_jobs() == []  # the fresh leaf lost the job again
        ctl.subscribe(1, 0, "h0", sync=True)  # as a sync joiner it is taken
        # a new run: every rank leaves, then all subscribe again
        for r in range(3):
            ctl.unsubscribe(1, r)
        subs = [ctl.subscribe(1, r, hosts[r]) for r in range(3)]
        assert run(2) == [[sum(2000 + 10 * q + k for q in range(3)) for k in range(2)]] * 3
        ctl.close()


def test_a_sync_subscribe_that_failed_part_way_is_undone_so_its_retry_programs_the_joiner_awaiting():
    """The new root's update fails once while worker 2 syncs into a running
    job: the switches already programmed get their old roles back, and the
    retry adds the joiner's branch as awaiting at every switch (it found
    its leaf in place, added the branch active, and the job stopped)."""
    from fanin.control import ControlClient, ControlError

    topo = topology.deep_tree(2, 3)
    n_elems, epp = 1024, 256
    with LoopbackSwitches(topo, shards=2) as sws:
        root = sws.fabric.control_addr("s0")
        fail_once = {"armed": False}

        class Flaky(ControlClient):
            def update_job(self, job, awaiting=()):
                if self.addr == root and fail_once["armed"]:
                    fail_once["armed"] = False
                    raise ControlError("UNAVAILABLE", "injected: s0 briefly unreachable")
                return super().update_job(job, awaiting)

        ctl = Controller(topo, sws.fabric, client_factory=lambda a: Flaky(a))
        ctl.create_job(JobParams(1, block_cnt_max=8, block_grad_max=epp, max_workers=3))
        hosts = {0: "h0", 1: "h1", 2: "h2"}
        first_try: list[str] = []

        def subscribe_joiner():
            fail_once["armed"] = True
            try:
                ctl.subscribe(1, 2, hosts[2], sync=True)
            except ControllerError as e:
                first_try.append(f"{e.code}: {e}")
            return ctl.subscribe(1, 2, hosts[2], sync=True)

        results, start = _two_stream_then_a_joiner_syncs(ctl, hosts, epp, subscribe_joiner, n_elems)
        assert first_try and first_try[0].startswith("UNAVAILABLE") and "undone on ['s1_2']" in first_try[0], first_try
        for r, runs in results.items():
            for k, blocks in runs.items():
                assert (blocks == (0b111 if k >= start[2] else 0b011)).all(), (r, k, blocks)
        ctl.close()


def test_a_rebuilt_job_keeps_its_zero_parameters_and_an_idle_restart_is_no_restart_of_the_next_run():
    """`slow_after_windows = 0` survives a controller restart (it became the
    default 2, and every later update was refused as a change of it); a
    switch that restarted while it held none of the job is not taken for a
    restart of the run installed on it later (it was marked resumed, and
    the run's workers refused)."""
    from fanin.control import ControlClient

    topo = topology.deep_tree(2, 3)
    with LoopbackSwitches(topo) as sws:
        ctl = Controller(topo, sws.fabric)
        ctl.create_job(JobParams(1, block_cnt_max=16, block_grad_max=256, max_workers=3, slow_after_windows=0,
                                 block_exp_ms=50))
        ctl.subscribe(1, 0, "h0")
        ctl.subscribe(1, 1, "h1")
        ctl.close()
        ctl = Controller(topo, sws.fabric)
        assert ctl.rebuild()["adopted"] == [1]
        ctl.unsubscribe(1, 0)  # an update of s0 with the adopted parameters: taken
        ctl.unsubscribe(1, 1)  # the run ends: the job is off every switch
        sws.restart("s1_0")    # restarted while it holds nothing
        assert ctl.reconcile() == []
        subs = {r: ctl.subscribe(1, r, h) for r, h in ((0, "h0"), (1, "h1"))}
        assert ctl.reconcile() == []  # nothing restarted since the run was installed
        subs[2] = ctl.subscribe(1, 2, "h0")
        with ControlClient(sws.fabric.control_addr("s1_0")) as cc:
            assert [j["resumed"] for j in cc.list_jobs()] == [False]

        def work(r):
            s = fanin.Session(subs[r]["data_addr"], 1, r, auth_key=subs[r]["member_key"], elems_per_packet=256)
            try:
                return int(s.allreduce(np.full(512, r + 1, dtype=np.int32))[0])
            finally:
                del s
        assert in_threads(3, work, timeout=60) == [6, 6, 6]
        ctl.close()


def test_a_subscribe_the_fabric_cannot_address_programs_nothing():
    topo = topology.leaf_spine(1, 2, 2)
    with LoopbackSwitches(topo) as sws:
        table = {s: {"control": sws.fabric.control_addr(s), "data": {"*": sws.fabric.data_addr(s, toward="x")}}
                 for s in ("spine0", "leaf0")}
        table["leaf1"] = {"control": sws.fabric.control_addr("leaf1"), "data": {"spine0": sws.fabric.data_addr("leaf1", toward="spine0")}}
        ctl = Controller(topo, StaticFabric(table))
        ctl.create_job(JobParams(1, max_workers=4, auth=False))
        ctl.subscribe(1, 0, "h0_0")
        with pytest.raises(ControllerError) as e:
            ctl.subscribe(1, 1, "h1_0")  # leaf1 has no data address toward h1_0
        assert e.value.code == "FAILED_PRECONDITION" and "h1_0" in str(e.value)
        assert sorted(ctl._jobs[1].roles) == ["leaf0"] and list(ctl._jobs[1].workers) == [0]
        ctl.close()


def test_a_controller_needs_a_real_token_off_loopback_and_its_port_to_itself():
    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        with pytest.raises(ValueError, match="needs a token"):
            ControllerServer(Controller(topo, sws.fabric), listen="0.0.0.0:0", token="", rebuild=False)
        first = ControllerServer(Controller(topo, sws.fabric), listen="127.0.0.1:0", rebuild=False)
        try:
            # (gRPC's SO_REUSEPORT let a second one bind it: calls went to either at random)
            with pytest.raises(OSError, match="cannot listen"):
                ControllerServer(Controller(topo, sws.fabric), listen=first.addr, rebuild=False)
        finally:
            first.stop()


# -- job parameters and the command line --------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("block_grad_max", 999_999, "block_grad_max 999999 is out of range (1..16370"),
    ("block_grad_max", 0, "block_grad_max 0 is out of range (1..16370"),
    ("block_cnt_max", 0, "block_cnt_max 0 is out of range (1..1048576)"),
    ("block_cnt_max", -1, "block_cnt_max -1 is out of range (1..1048576)"),
    ("block_cnt_max", 2**20 + 1, "block_cnt_max 1048577 is out of range (1..1048576)"),
    ("member_timeout_ms", 700_000, "member_timeout_ms 700000 is out of range (0..600000"),
    ("member_timeout_ms", -1, "member_timeout_ms -1 is out of range (0..600000"),
    ("block_exp_ms", 600_001, "block_exp_ms 600001 is out of range (0..600000"),
    ("block_exp_ms", -5, "block_exp_ms -5 is out of range (0..600000"),
    ("slow_after_windows", 10_001, "slow_after_windows 10001 is out of range (0..10000"),
    ("max_workers", -1, "max_workers -1 is out of range (1..2048)"),
    ("max_workers", 2049, "max_workers 2049 is out of range (1..2048)"),
    ("block_cnt_max", 8.5, "block_cnt_max 8.5 is not an integer"),
])
def test_create_job_refuses_what_the_switch_would_refuse_naming_the_field_and_its_range(field, value, message):
    """The controller checks a job against the switch's own limits
    (fanin-proto JobSpec::validate) when it is created, not when its first
    worker subscribes and the switch refuses it (UNAVAILABLE)."""
    import re

    ctl = Controller(topology.star(2), StaticFabric({"s0": {"control": "127.0.0.1:1", "data": "127.0.0.1:2"}}))
    with pytest.raises(ControllerError, match=re.escape(f"job 7: {message}")) as e:
        ctl.create_job(JobParams(7, **{field: value}))
    assert e.value.code == "INVALID_ARGUMENT"
    assert 7 not in ctl._jobs
    # the largest values the switch takes are taken
    ctl.create_job(JobParams(8, block_cnt_max=2**20, block_grad_max=16370, block_exp_ms=600_000,
                             slow_after_windows=10_000, max_workers=2048, member_timeout_ms=600_000))


@pytest.mark.parametrize("flags, message", [
    (["--block-grad-max", "999999"], "--block-grad-max 999999 is out of range: give 1..16370"),
    (["--block-grad-max", "0"], "--block-grad-max 0 is out of range: give 1..16370"),
    (["--max-workers", "0"], "--max-workers 0 is out of range: give 1..2048"),
    (["--block-cnt-max", "0"], "--block-cnt-max 0 is out of range: give 1..1048576"),
    (["--block-cnt-max", "-1"], "--block-cnt-max -1 is out of range: give 1..1048576"),
    (["--block-exp-ms", "-1"], "--block-exp-ms -1 is out of range: give 0..600000"),
    (["--block-exp-ms", "600001"], "--block-exp-ms 600001 is out of range: give 0..600000"),
])
def test_cli_create_job_refuses_out_of_range_flags_before_calling_the_controller(flags, message, capsys):
    """A flag the switch would refuse is refused up front, exit 2, one line
    naming the flag and the range (no controller is reached: the address is
    a closed port), instead of a default in its place (0) or protobuf's
    "Value out of range: -1"."""
    from fanin.cli import main

    assert main(["controller", "create-job", "1", *flags, "--addr", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fanin controller create-job: {message}"), err


def test_cli_create_job_and_delete_job_say_what_they_did(capsys):
    from fanin.cli import main

    topo = topology.star(2)
    with LoopbackSwitches(topo) as sws:
        with ControllerServer(Controller(topo, sws.fabric), "127.0.0.1:0") as srv:
            capsys.readouterr()
            assert main(["controller", "create-job", "1", "--max-workers", "2", "--addr", srv.addr]) == 0
            out = capsys.readouterr().out.strip().splitlines()
            assert len(out) == 1 and out[0].startswith("job 1 created: keyed"), out
            assert "max_workers 2" in out[0] and "on_failure fail" in out[0], out
            assert main(["controller", "create-job", "2", "--no-auth", "--block-exp-ms", "10", "--addr",
                         srv.addr]) == 0
            out = capsys.readouterr().out
            assert out.startswith("job 2 created: unauthenticated") and "on_failure degrade" in out, out
            assert main(["controller", "delete-job", "1", "--addr", srv.addr]) == 0
            assert capsys.readouterr().out.strip() == "job 1 deleted"
            assert main(["controller", "delete-job", "1", "--addr", srv.addr]) == 1
            assert "job 1 does not exist" in capsys.readouterr().err


def test_the_controller_client_names_a_bad_job_field_before_calling():
    c = ControllerClient("127.0.0.1:1")  # nothing listens: the check comes first
    for kw, name in (({"block_cnt_max": -1}, "block_cnt_max"), ({"max_workers": 0}, "max_workers"),
                     ({"block_grad_max": 10**6}, "block_grad_max")):
        with pytest.raises(ValueError, match=name):
            c.create_job(7, **kw)
    c.close()
