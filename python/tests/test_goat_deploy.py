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
    off["switches"][1]["filters"][0].update(workers=["w0", "w1", "w2", "w3", "w4"], expected_sources=5)
    off["parameter_server"]["expect"][1].update(direct_workers=WORKERS[5:], expected_sources=4)
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


def _g1(plan):
    return plan["parameter_server"]["expect"][1]


def _two_filters_for_w0(plan):
    # w0's g1 in agg's filter as well as tor0's; the PS lists both, w0's node is agg
    plan["switches"][0]["filters"].append({"submodel": 1, "expected_sources": 1, "workers": ["w0"]})
    _g1(plan)["from_switches"].append("agg")
    plan["workers"][0]["aggregation_node"][1] = "agg"


def _two_filters_for_w0_node_tor0(plan):
    # the same, but w0's node is the later filter's (tor0): once a dict entry silently overwritten
    plan["switches"][0]["filters"].append({"submodel": 1, "expected_sources": 1, "workers": ["w0"]})
    _g1(plan)["from_switches"].append("agg")


@pytest.mark.parametrize("mutate, message", [
    # the PS leaves out a worker that sends to it: w7's gradient missing from the sum (127 instead of 255)
    (lambda p: _g1(p)["direct_workers"].remove("w7"),
     r"parameter_server\.expect \(sub-model 1\): direct_workers lacks 'w7'.*add it"),
    # a worker aggregated at tor0 and also direct at the PS: counted twice
    (lambda p: _g1(p)["direct_workers"].append("w0"),
     r"parameter_server\.expect \(sub-model 1\): direct_workers lists 'w0'.*'tor0'.*counted twice.*remove it"),
    # the PS ignores a switch that aggregates workers of g: their gradients missing
    (lambda p: _g1(p).update(from_switches=[], expected_sources=4),
     r"parameter_server\.expect \(sub-model 1\): from_switches lacks 'tor0'.*add it"),
    # the PS waits for a switch that aggregates nobody's g2 (tor1's filter is empty): it never completes
    (lambda p: p["parameter_server"]["expect"][2].update(from_switches=["tor1"], expected_sources=9),
     r"parameter_server\.expect \(sub-model 2\): from_switches lists 'tor1'.*remove it"),
    (lambda p: _g1(p)["from_switches"].append("nowhere"),
     r"parameter_server\.expect \(sub-model 1\): from_switches lists 'nowhere', which is not a switch of the plan"),
    (lambda p: p["parameter_server"]["expect"].pop(1),
     r"parameter_server\.expect has no entry for sub-model 1.*add .*\"from_switches\": \[\"tor0\"\]"),
    (lambda p: p["parameter_server"]["expect"].append(dict(_g1(p))),
     r"parameter_server\.expect: two entries for sub-model 1"),
    (lambda p: p["parameter_server"]["expect"].append({**_g1(p), "submodel": 3}),
     r"parameter_server\.expect\[3\]: submodel 3 is not a sub-model id of the plan \(0\.\.2\)"),
    (lambda p: _g1(p).update(expected_sources=99),
     r"parameter_server\.expect \(sub-model 1\): expected_sources is 99.*set it to 5"),
    (lambda p: p["switches"][1]["filters"][0].update(expected_sources=3),
     r"switches\['tor0'\]\.filters \(sub-model 1\): expected_sources is 3.*set it to 4"),
    (_two_filters_for_w0, r"switches\['tor0'\]\.filters \(sub-model 1\): worker 'w0' is also in the filter of 'agg'"),
    (_two_filters_for_w0_node_tor0,
     r"switches\['tor0'\]\.filters \(sub-model 1\): worker 'w0' is also in the filter of 'agg'"),
    (lambda p: p["switches"][1]["filters"][0]["workers"].append("w0"),
     r"switches\['tor0'\]\.filters \(sub-model 1\): worker 'w0' is listed twice"),
    (lambda p: p["switches"][1]["filters"].append({"submodel": 1, "expected_sources": 0, "workers": []}),
     r"switches\['tor0'\]\.filters: two filters for sub-model 1"),
    (lambda p: p["switches"][1]["filters"].append({"submodel": 5, "expected_sources": 0, "workers": []}),
     r"switches\['tor0'\]\.filters: submodel 5 is not a sub-model id of the plan \(0\.\.2\)"),
    (lambda p: p["switches"].append(dict(p["switches"][1])), r"switches: 'tor0' is listed twice"),
    # names: GoatError naming the field, never a bare KeyError
    (lambda p: p["workers"][1].update(name="w0"), r"workers\[1\]: the name 'w0' is already worker 0's"),
    (lambda p: p["switches"][1]["filters"][0]["workers"].append("nobody"),
     r"switches\['tor0'\]\.filters \(sub-model 1\): worker 'nobody' is not in the plan's `workers`"),
    (lambda p: _g1(p)["direct_workers"].append("nobody"),
     r"parameter_server\.expect \(sub-model 1\): direct_workers lists 'nobody', which is not in the plan's `workers`"),
    (lambda p: _g1(p)["direct_workers"].append("w7"),
     r"parameter_server\.expect \(sub-model 1\): direct_workers lists 'w7' twice"),
    (lambda p: p["workers"][3].update(name="ps"), r"workers\[3\]: 'ps' is the parameter server"),
    (lambda p: p["workers"][3].update(name="nowhere"), r"workers\[3\]: 'nowhere' is not a host of topology"),
    (lambda p: p["submodels"][2].update(id=7), r"submodels\[2\]: id 7"),
    (lambda p: p["parameter_server"].pop("expect"), r"parameter_server: the plan lacks field 'expect'"),
    (lambda p: p["switches"][1]["filters"][0].pop("workers"),
     r"switches\['tor0'\]\.filters\[0\]: the plan lacks field 'workers'"),
], ids=["ps-omits-worker", "worker-counted-twice", "ps-omits-switch", "ps-expects-idle-switch",
        "ps-expects-unknown-switch", "submodel-missing-at-ps", "submodel-twice-at-ps", "ps-unknown-submodel",
        "ps-expected-sources", "filter-expected-sources", "worker-in-two-filters",
        "worker-in-two-filters-node-later", "worker-twice-in-a-filter", "two-filters-one-submodel",
        "filter-unknown-submodel", "switch-twice", "duplicate-worker-name", "unknown-worker-in-filter",
        "unknown-direct-worker", "direct-worker-twice", "worker-is-ps", "worker-not-a-host", "submodel-id",
        "missing-expect", "missing-filter-workers"])
def test_plans_whose_parts_disagree_are_refused_with_what_to_change(mutate, message):
    """The PS's members for every sub-model g must be exactly the switches
    that aggregate workers of g and the workers whose node for g is the PS;
    each (worker, g) is aggregated once; expected_sources, where given, is
    the count actually aggregated; names are known and unique. Anything else
    would install and return wrong sums (or wait forever)."""
    plan = hand_plan()
    mutate(plan)
    with pytest.raises(GoatError, match=message):
        plan_jobs(plan, topology.load(str(TOPO)))


def test_a_plan_missing_a_worker_at_the_ps_installs_nothing():
    # the reviewer's case: installed, it summed 7 of the 8 workers' g1
    plan = hand_plan()
    _g1(plan)["direct_workers"].remove("w7")
    log = []
    with pytest.raises(GoatError, match="direct_workers lacks 'w7'"):
        _install(plan, log)
    assert log == []


def test_install_goat_cli_reports_an_inconsistent_plan_without_a_traceback(tmp_path, capsys):
    import json

    from fanin.cli import main

    for name, mutate, message in [("missing", lambda p: _g1(p)["direct_workers"].remove("w7"), "lacks 'w7'"),
                                  ("dup", lambda p: p["workers"][1].update(name="w0"), "the name 'w0'")]:
        plan = hand_plan()
        mutate(plan)
        (tmp_path / f"{name}.json").write_text(json.dumps(plan))
        (tmp_path / "fabric.json").write_text("{}")
        rc = main(["controller", "install-goat", str(tmp_path / f"{name}.json"), "--fabric",
                   str(tmp_path / "fabric.json"), "--topology", str(TOPO)])
        err = capsys.readouterr().err
        assert rc == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_planners_plans_and_their_baselines_pass_the_checks(tmp_path, seed):
    """What the project's planners write is consistent: KRGS on the testbed
    (as `fanin bench goat-deploy`), `fanin plan goat` on a leaf-spine with
    some programmable switches, and the ATP-like and PS-only baselines of
    both."""
    import json

    from fanin.cli import main

    topo, plan = _testbed_plan(seed)
    out = tmp_path / "plan.json"
    assert main(["plan", "goat", "--topology", "leaf-spine:2,3,3", "--programmable", "0.4", "--memory-mb", "4",
                 "--ps", "h0_0", "--even", "9,6", "--out", str(out), "--seed", str(seed)]) == 0
    ls = topology.load("leaf-spine:2,3,3")
    for t, p in ((topo, plan), (ls, json.loads(out.read_text()))):
        for variant in (p, atp_like_plan(p, t), ps_only_plan(p)):
            jp = plan_jobs(variant, t)
            for g in range(len(p["submodels"])):  # every worker counted once per sub-model
                behind = sum(len(j.members) for j in jp.jobs if j.node != jp.ps and j.submodel == g)
                direct = sum(1 for j in jp.on(jp.ps) if j.submodel == g for m in j.members if m < 2048)
                assert behind + direct == len(p["workers"])


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


def test_a_controller_over_the_same_topology_leaves_a_goat_plans_jobs_alone():
    """A GOAT plan's switch jobs have the parameter server's daemon as their
    parent, no switch of the topology: a controller (re)started over the
    topology adopted them as its own trees, and when a switch restarted it
    re-installed the job there as a root, whose results lacked the rest of
    the plan. It leaves them alone now, and says why."""
    import os

    from fanin.controller import Controller
    from fanin.controller.loopback import LoopbackSwitches
    from fanin.goat.deploy import install_goat_plan

    topo = topology.load(str(TOPO))
    with LoopbackSwitches(topo, hosts=("ps",), seed=os.getpid()) as sws:
        dep = install_goat_plan(hand_plan(), topo, sws.fabric, job_base=100)
        ctl = Controller(topo, sws.fabric)
        report = ctl.rebuild()
        assert report["adopted"] == [] and set(report["not_adopted"]) == {100, 101}, report
        assert all("no switch of topology" in why for why in report["not_adopted"].values()), report
        sws.restart("tor0")
        assert ctl.reconcile() == []
        ctl.close()
        dep.close()
