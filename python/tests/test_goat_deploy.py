"""GOAT deployment (issue 8 item 6): the plan -> jobs translation on a
hand-checked plan, installation through (fake) control APIs, and the end to
end run on the namespace testbed (root only; skipped with the reason
otherwise)."""

import os
from pathlib import Path

import pytest

from fanin import topology
from fanin.goat.deploy import (AggregatorJob, TransitEntry, WorkerTarget, atp_like_plan, install_goat_plan, plan_jobs,
                               ps_only_plan)
from fanin.goat.model import GoatError

TOPO = Path(__file__).resolve().parents[2] / "examples" / "goat-testbed.toml"
WORKERS = [f"w{i}" for i in range(8)]
AGG, TOR0, TOR1 = 2048, 2049, 2050  # switch ranks: 2048 + index in the file (agg, tor0, tor1)


def hand_plan():
    """g0: agg for everyone; g1: tor0 for w0-w3, w4-w7 straight to the PS;
    g2: nobody aggregates (tor1 reserved it, no worker chose it)."""
    return {
        "schema": "fanin.goat.plan/1",
        "submodels": [{"id": g, "name": f"g{g}", "size_mb": 1.0} for g in range(3)],
        "switches": [
            {"name": "agg", "memory_mb": 4, "memory_used_mb": 1,
             "filters": [{"submodel": 0, "expected_sources": 8, "workers": WORKERS}]},
            {"name": "tor0", "memory_mb": 4, "memory_used_mb": 1,
             "filters": [{"submodel": 1, "expected_sources": 4, "workers": WORKERS[:4]}]},
            {"name": "tor1", "memory_mb": 4, "memory_used_mb": 1,
             "filters": [{"submodel": 2, "expected_sources": 0, "workers": []}]},
        ],
        "workers": [{"name": w, "aggregation_node": ["agg", "tor0" if i < 4 else "ps", "ps"]}
                    for i, w in enumerate(WORKERS)],
        "parameter_server": {"name": "ps", "expect": [
            {"submodel": 0, "from_switches": ["agg"], "direct_workers": [], "expected_sources": 1},
            {"submodel": 1, "from_switches": ["tor0"], "direct_workers": WORKERS[4:], "expected_sources": 5},
            {"submodel": 2, "from_switches": [], "direct_workers": WORKERS, "expected_sources": 8},
        ]},
    }


def test_plan_to_jobs_on_a_hand_checked_plan():
    jp = plan_jobs(hand_plan(), topology.load(str(TOPO)), job_base=10)
    assert jp.ps == "ps"
    assert jp.ranks == {w: i for i, w in enumerate(WORKERS)}
    assert jp.jobs == [
        AggregatorJob("ps", 0, 10, (AGG,)),
        AggregatorJob("ps", 1, 11, (4, 5, 6, 7, TOR0)),
        AggregatorJob("ps", 2, 12, tuple(range(8))),
        AggregatorJob("agg", 0, 10, tuple(range(8)), parent="ps", rank=AGG),
        AggregatorJob("tor0", 1, 11, (0, 1, 2, 3), parent="ps", rank=TOR0),
        # tor1's empty filter is not installed
    ]
    assert jp.targets["w1"] == [WorkerTarget(0, 10, 1, "agg"), WorkerTarget(1, 11, 1, "tor0"),
                                WorkerTarget(2, 12, 1, "ps")]
    assert [t.node for t in jp.targets["w5"]] == ["agg", "ps", "ps"]
    # every (worker, sub-model) is counted once: the PS's sources sum the workers behind each switch
    for g in range(3):
        behind = sum(len(j.members) for j in jp.jobs if j.node != "ps" and j.submodel == g)
        direct = sum(1 for m in jp.on("ps")[g].members if m < 2048)
        assert behind + direct == 8


def test_on_path_every_worker_sends_to_its_first_hop_and_the_switches_on_the_way_relay():
    # GOAT's on-path filtering (docs/goat.md): w0-w3 sit under tor0, w4-w7
    # under tor1, both under agg, which connects the PS
    jp = plan_jobs(hand_plan(), topology.load(str(TOPO)), job_base=10, on_path=True)
    assert [t.sends_to for t in jp.targets["w1"]] == ["tor0"] * 3
    assert [t.sends_to for t in jp.targets["w6"]] == ["tor1"] * 3
    assert [t.node for t in jp.targets["w6"]] == ["agg", "ps", "ps"]  # the nodes do not change
    left, right, every = (0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8))
    assert jp.transits == [
        TransitEntry("agg", 1, 11, "ps", right),  # w4-w7's g1 (to the PS); w0-w3's is aggregated at tor0
        TransitEntry("agg", 2, 12, "ps", every),
        TransitEntry("tor0", 0, 10, "agg", left),  # tor0 aggregates g1 itself and relays g0, g2
        TransitEntry("tor0", 2, 12, "agg", left),
        TransitEntry("tor1", 0, 10, "agg", right),
        TransitEntry("tor1", 1, 11, "agg", right),
        TransitEntry("tor1", 2, 12, "agg", right),
    ]
    assert plan_jobs(hand_plan(), topology.load(str(TOPO)), job_base=10).transits == []
    # a node off a worker's path cannot be reached by relaying
    off = hand_plan()
    off["switches"][1]["filters"][0]["workers"] = ["w0", "w1", "w2", "w3", "w4"]
    off["parameter_server"]["expect"][1]["direct_workers"] = WORKERS[5:]
    off["workers"][4]["aggregation_node"][1] = "tor0"
    plan_jobs(off, topology.load(str(TOPO)))  # fine when workers address the node directly
    with pytest.raises(GoatError, match="w4 sends sub-model 1 to 'tor0', which is not on its path"):
        plan_jobs(off, topology.load(str(TOPO)), on_path=True)


def test_inconsistent_plans_are_refused():
    topo = topology.load(str(TOPO))
    bad = hand_plan()
    bad["workers"][5]["aggregation_node"][1] = "tor0"   # tor0's filter does not list w5
    with pytest.raises(GoatError, match="w5 sends sub-model 1 to 'tor0'"):
        plan_jobs(bad, topo)
    bad = hand_plan()
    bad["switches"][0]["name"] = "nowhere"
    with pytest.raises(GoatError, match="not a switch"):
        plan_jobs(bad, topo)
    with pytest.raises(GoatError, match="schema"):
        plan_jobs({**hand_plan(), "schema": "x"}, topo)


def test_atp_like_placement_fills_the_first_switch_on_each_path_in_submodel_order():
    # six 2 MB sub-models, B(s) = 4 MB: each rack switch takes g0 and g1 for
    # its four workers, then the aggregation switch (next on every path) g2
    # and g3 for all eight; g4 and g5 find no room anywhere: straight to the PS
    topo = topology.load(str(TOPO))
    base = hand_plan()
    base["submodels"] = [{"id": g, "name": f"g{g}", "size_mb": 2.0} for g in range(6)]
    base["workers"] = [{"name": w, "aggregation_node": ["ps"] * 6} for w in WORKERS]
    atp = atp_like_plan(base, topo)
    nodes = {w["name"]: w["aggregation_node"] for w in atp["workers"]}
    assert nodes["w0"] == ["tor0", "tor0", "agg", "agg", "ps", "ps"]
    assert nodes["w6"] == ["tor1", "tor1", "agg", "agg", "ps", "ps"]
    used = {sw["name"]: sw["memory_used_mb"] for sw in atp["switches"]}
    assert used == {"agg": 4.0, "tor0": 4.0, "tor1": 4.0}
    # the PS gets 2 partials of g0 and g1, 1 of g2 and g3, 8 raw g4 and g5
    assert [e["expected_sources"] for e in atp["parameter_server"]["expect"]] == [2, 2, 1, 1, 8, 8]
    assert atp["ps_mb"] == 2.0 * 22
    jp = plan_jobs(atp, topo)  # a plan the deployment installs as it is
    assert sorted((j.node, j.submodel, len(j.members)) for j in jp.jobs if j.node != "ps") == [
        ("agg", 2, 8), ("agg", 3, 8), ("tor0", 0, 4), ("tor0", 1, 4), ("tor1", 0, 4), ("tor1", 1, 4)]
    # a switch with no memory for anything aggregates nothing
    for sw in base["switches"]:
        sw["memory_mb"] = 0
    assert all(n == "ps" for w in atp_like_plan(base, topo)["workers"] for n in w["aggregation_node"])


def test_ps_only_baseline_sends_everything_to_the_ps():
    jp = plan_jobs(ps_only_plan(hand_plan()), topology.load(str(TOPO)))
    assert [(j.node, j.members) for j in jp.jobs] == [("ps", tuple(range(8)))] * 3
    assert all(t.node == "ps" for ts in jp.targets.values() for t in ts)


class FakeSwitch:
    keys: dict = {}  # job id -> the keys it was admitted with, over every node

    def __init__(self, log, addr, fail_on=None):
        self.log, self.addr, self.fail_on = log, addr, fail_on
        self.jobs = {}

    def info(self):
        return {"shard_count": 2}

    def admit_job(self, job_id, members, **kw):
        from fanin.control import ControlError

        if self.fail_on == job_id:
            raise ControlError("RESOURCE_EXHAUSTED", "full")
        self.log.append(("admit", self.addr, job_id, tuple(members), kw["workers"], kw["tree"]))
        self.keys.setdefault(job_id, set()).add(kw.get("key"))
        self.jobs[job_id] = {"job_id": job_id, "members": list(members), **kw, "quorum": 0}

    def list_jobs(self):
        return list(self.jobs.values())

    def update_job(self, spec):
        self.log.append(("update", self.addr, spec["job_id"], spec["quorum"]))
        self.jobs[spec["job_id"]] = spec

    def remove_job(self, job_id):
        self.log.append(("remove", self.addr, job_id))

    def install_transit(self, job_id, next_addr, next_shards, sources=()):
        self.log.append(("transit", self.addr, job_id, next_addr, next_shards, tuple(sources)))

    def remove_transit(self, job_id):
        self.log.append(("untransit", self.addr, job_id))

    def close(self):
        pass


class NamesFabric:
    def control_addr(self, node):
        return node

    def data_addr(self, node, toward):
        return f"{node}@{toward}"


def _install(plan, log, fail=None, **kw):
    return install_goat_plan(
        plan, topology.load(str(TOPO)), NamesFabric(), job_base=10,
        client_factory=lambda addr: FakeSwitch(log, addr, fail_on=fail.get(addr) if fail else None), **kw)


def test_on_path_install_adds_the_relays_after_the_jobs_and_removes_them_first():
    log = []
    with pytest.raises(GoatError, match="auth=False"):
        _install(hand_plan(), log, on_path=True)
    assert log == []
    dep = _install(hand_plan(), log, on_path=True, auth=False)
    assert [e[0] for e in log] == ["admit"] * 5 + ["transit"] * 7
    assert log[5:7] == [("transit", "agg", 11, "ps@agg", 2, (4, 5, 6, 7)),
                        ("transit", "agg", 12, "ps@agg", 2, tuple(range(8)))]
    assert ("transit", "tor1", 10, "agg@tor1", 2, (4, 5, 6, 7)) in log
    assert [addr for _, addr in dep.addrs["w6"]] == ["tor1@w6"] * 3
    log.clear()
    dep.remove()
    assert [e[0] for e in log] == ["untransit"] * 7 + ["remove"] * 5


def test_install_programs_the_ps_first_and_removes_in_reverse():
    FakeSwitch.keys = {}
    log = []
    dep = _install(hand_plan(), log)
    assert log == [
        ("admit", "ps", 10, (AGG,), 8, None),
        ("admit", "ps", 11, (4, 5, 6, 7, TOR0), 8, None),
        ("admit", "ps", 12, tuple(range(8)), 8, None),
        ("admit", "agg", 10, tuple(range(8)), 8, {"parent_addr": "ps@agg", "parent_shards": 2, "rank": AGG}),
        ("admit", "tor0", 11, (0, 1, 2, 3), 8, {"parent_addr": "ps@tor0", "parent_shards": 2, "rank": TOR0}),
    ]
    assert [(t.job_id, addr) for t, addr in dep.addrs["w6"]] == [(10, "agg@w6"), (11, "ps@w6"), (12, "ps@w6")]
    # keyed by default: one fresh key per sub-model job, the same on every node holding it
    keys = {job: FakeSwitch.keys[job] for job in (10, 11, 12)}
    assert all(len(k) == 1 and None not in k for k in keys.values()), keys
    assert len({next(iter(k)) for k in keys.values()}) == 3
    from fanin.auth import derive_member_key
    assert dep.member_key(11, 6) == derive_member_key(next(iter(keys[11])), 11, 6)
    log.clear()
    dep.remove()
    assert log == [("remove", "tor0", 11), ("remove", "agg", 10), ("remove", "ps", 12), ("remove", "ps", 11),
                   ("remove", "ps", 10)]


def test_an_epoch_installs_k_on_every_aggregation_node_for_the_workers_taking_part():
    # GOAT Algorithm 2 (docs/goat.md): w0, w1, w2 and w5 take part this epoch
    FakeSwitch.keys = {}
    log = []
    dep = _install(hand_plan(), log)
    log.clear()
    ks = dep.install_quorums([0, 1, 2, 5])
    assert ks == {
        ("agg", 10): 4,  # g0: everyone's aggregation node; four of its members take part
        ("tor0", 11): 3,  # g1 for w0-w3: three of them
        ("ps", 10): 1,  # g0 at the PS: the agg switch, which has participants
        ("ps", 11): 2,  # g1 at the PS: tor0 and w5 directly
        ("ps", 12): 4,  # g2: every worker directly
    }
    assert sorted(log) == sorted(("update", node, job, k) for (node, job), k in ks.items())
    # nobody of tor0's workers takes part next epoch: tor0 keeps waiting for
    # all (K = 0), and the PS stops counting it
    ks = dep.install_quorums([4, 5])
    assert ks[("tor0", 11)] == 0 and ks[("ps", 11)] == 2 and ks[("agg", 10)] == 2
    # the same participants again: nothing to update
    log.clear()
    assert dep.install_quorums([5, 4]) == ks
    assert not [e for e in log if e[0] == "update"]


def test_a_failed_install_removes_what_it_admitted():
    from fanin.control import ControlError

    log = []
    with pytest.raises(ControlError):
        _install(hand_plan(), log, fail={"tor0": 11})
    assert [e[0] for e in log] == ["admit"] * 4 + ["remove"] * 4
    assert log[-1] == ("remove", "ps", 10)


# -- end to end on loopback (no privileges) and on the namespace testbed --------------------------


def _testbed_plan(seed=1):
    from argparse import Namespace

    from fanin_bench.bench.goat_deploy import make_plan

    topo = topology.load(str(TOPO))
    return topo, make_plan(topo, Namespace(even="12,6", model=None, submodels=None, max_submodel_mb=None, seed=seed))


@pytest.mark.parametrize("on_path", [False, True], ids=["direct", "on-path"])
def test_install_goat_cli_on_loopback_daemons_and_every_worker_gets_the_sum(tmp_path, on_path):
    """`fanin controller install-goat --fabric` on one daemon per switch and
    one for the PS (all on 127.0.0.1), then 8 worker processes: every
    sub-model's sum exact on every worker; --remove empties the daemons.
    `--on-path` (unkeyed): every worker sends to its rack switch, which
    relays what it does not aggregate; the PS gets what it gets directly."""
    import json
    import subprocess
    import sys

    from fanin.control import ControlClient
    from fanin.controller.loopback import LoopbackSwitches
    from fanin_bench.bench.trees import step_workers, stop_workers, wait_ready

    topo, plan = _testbed_plan()
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with LoopbackSwitches(topo, hosts=("ps",), seed=os.getpid()) as daemons:
        (tmp_path / "fabric.json").write_text(json.dumps(daemons.fabric.table))
        cli = [sys.executable, "-m", "fanin", "controller", "install-goat", str(tmp_path / "plan.json"),
               "--fabric", str(tmp_path / "fabric.json"), "--topology", str(TOPO)]
        if on_path:
            cli += ["--on-path", "--no-auth"]
        r = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        targets = json.loads(r.stdout)
        assert sorted(targets) == WORKERS
        with ControlClient(daemons.fabric.control_addr("agg")) as c:
            agg_jobs = c.list_jobs()
        assert agg_jobs and all(j["tree"]["parent_addr"] == daemons.fabric.data_addr("ps", "agg") for j in agg_jobs)
        if on_path:
            # one address per worker: its rack switch's
            racks = {w: {t["data_addr"] for t in ts} for w, ts in targets.items()}
            assert racks["w0"] == {daemons.fabric.data_addr("tor0", "w0")}, racks
            assert racks["w7"] == {daemons.fabric.data_addr("tor1", "w7")}, racks
            assert all(t["member_key"] is None for ts in targets.values() for t in ts)
        else:
            # keyed by default: every target comes with its member key
            assert all(len(bytes.fromhex(t["member_key"])) == 16 for ts in targets.values() for t in ts)
            assert all(j["key"] for j in agg_jobs)
        procs = []
        try:
            for w, ts in targets.items():
                spec = [[t["job_id"], t["data_addr"], 1000 + 37 * t["submodel"]] for t in ts]
                keys = json.dumps({t["job_id"]: t["member_key"] for t in ts if t["member_key"]})
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fanin_bench.bench.goat_worker", "--rank", str(ts[0]["rank"]),
                     "--workers", "8", "--targets", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**env, "FANIN_MEMBER_KEYS": keys}))
            wait_ready(procs, "loopback")
            for _ in range(2):
                assert all(a["exact"] for a in step_workers(procs, "loopback"))
        finally:
            stop_workers(procs)
        counters = {}
        for node in ("agg", "tor0", "tor1", "ps"):
            with ControlClient(daemons.fabric.control_addr(node)) as c:
                counters[node] = {x["name"]: x["value"] for x in c.counters() if x["value"]}
            refused = {k: v for k, v in counters[node].items() if k.startswith("auth_") or k == "transit_refused"}
            assert not refused, (node, refused)
        relayed = {node: counters[node].get("transit_up", 0) for node in counters}
        if on_path:
            # every rack switch relays; the PS only aggregates
            assert relayed["tor0"] > 0 and relayed["tor1"] > 0 and relayed["ps"] == 0, relayed
        else:
            assert not any(relayed.values()), relayed
        r = subprocess.run(cli + ["--remove"], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        for node in ("agg", "tor0", "tor1", "ps"):
            with ControlClient(daemons.fabric.control_addr(node)) as c:
                assert c.list_jobs() == []


def test_goat_plan_end_to_end_on_the_testbed():
    """3 switches, 8 workers, a PS: the planner's plan installed, every
    worker's every sub-model exact, and the PS's ingress shrinks as the plan
    says against PS-only (frames on the veth, headers included)."""
    from fanin_bench.testbed import why_unavailable

    why = why_unavailable("fbtg-probe")
    if why:
        pytest.skip(f"no network namespaces: {why}")
    from fanin_bench.bench.goat_deploy import deploy_and_run

    topo, plan = _testbed_plan()
    nodes = {n for w in plan["workers"] for n in w["aggregation_node"]}
    assert {"agg", "tor0", "tor1", "ps"} <= nodes  # switches one and two hops away, and direct to the PS
    from test_testbed import _tag  # fbt<letter><pid tag>: the stale-testbed cleanup there knows the owner

    runs = deploy_and_run(topo, plan, name=f"fbtg{_tag(os.getpid())}", reps=1, bytes_per_mb=8192)
    for arm in ("goat", "ps-only"):
        (r,) = runs[arm]
        assert r["exact"], arm
        assert r["payload_bytes"] <= r["ps_ingress_bytes"] < 1.15 * r["payload_bytes"], (arm, r)
    measured = runs["ps-only"][0]["ps_ingress_bytes"] / runs["goat"][0]["ps_ingress_bytes"]
    planned = 12 * 8 / plan["ps_mb"]
    assert measured == pytest.approx(planned, rel=0.05)


def test_on_path_filtering_on_the_testbed_gives_the_ps_what_direct_addressing_does():
    """GOAT's on-path filtering (docs/goat.md): every worker sends every
    sub-model to its rack switch; the switches relay what they do not
    aggregate. Every sum exact, and the PS receives the same bytes as when
    the workers address each sub-model's node (all arms unkeyed)."""
    from fanin_bench.testbed import why_unavailable

    why = why_unavailable("fbto-probe")
    if why:
        pytest.skip(f"no network namespaces: {why}")
    from fanin_bench.bench.goat_deploy import deploy_and_run
    from test_testbed import _tag

    topo, plan = _testbed_plan()
    runs = deploy_and_run(topo, plan, name=f"fbto{_tag(os.getpid())}", reps=1, bytes_per_mb=8192, on_path=True)
    assert all(r["exact"] for rs in runs.values() for r in rs), runs
    (direct,), (on_path,) = runs["goat"], runs["goat-on-path"]
    assert on_path["ps_ingress_bytes"] == pytest.approx(direct["ps_ingress_bytes"], rel=0.02), (direct, on_path)
    assert on_path["payload_bytes"] == direct["payload_bytes"]
