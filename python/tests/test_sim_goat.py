"""`fanin sim goat` (issue 8 item 5): a GOAT plan and the PS-only baseline
run at packet level in fanin-sim with the deployment's jobs, and the three
metrics of the flow-level evaluator measured on the simulated links."""

import json
import math
import subprocess
import sys

from fanin import topology
from fanin.goat.deploy import ps_only_plan
from fanin_bench.sim.command import _find_sim_binary
from fanin_bench.sim.goat import build_spec
from test_goat_deploy import AGG, TOPO, TOR0, hand_plan

# fanin's value header (docs/protocol.md) + Ethernet, IPv4, UDP; written out here, not taken from the code
HEADER, WIRE = 24, 14 + 4 + 20 + 8


def copy_bytes(elements, epp=256):
    return math.ceil(elements / epp) * (HEADER + WIRE) + 4 * elements


def test_spec_carries_the_deployment_jobs_of_a_hand_checked_plan():
    topo = topology.load(str(TOPO))
    spec = build_spec(topo, hand_plan(), [10, 20, 30])
    name = [n["name"] for n in spec["nodes"]]
    assert name[spec["ps"]] == "ps" and [name[w] for w in spec["workers"]] == [f"w{i}" for i in range(8)]
    g0, g1, g2 = spec["jobs"]
    assert [j["job_id"] for j in spec["jobs"]] == [100, 101, 102] and g1["elements"] == 20
    agg = {name[a["node"]]: a for a in g0["aggregators"]}
    assert agg["ps"]["parent"] is None and agg["ps"]["members"] == [AGG]
    assert name[agg["agg"]["parent"]] == "ps" and agg["agg"]["rank"] == AGG and agg["agg"]["members"] == list(range(8))
    assert [name[t] for t in g0["targets"]] == ["agg"] * 8
    assert [name[t] for t in g1["targets"]] == ["tor0"] * 4 + ["ps"] * 4
    assert {name[a["node"]]: a["members"] for a in g1["aggregators"]} == {"ps": [4, 5, 6, 7, TOR0], "tor0": [0, 1, 2, 3]}
    # tor1's filter has no worker: not installed, everything to the PS
    assert [name[a["node"]] for a in g2["aggregators"]] == ["ps"] and [name[t] for t in g2["targets"]] == ["ps"] * 8


def test_hand_plan_at_packet_level_puts_the_planned_copies_into_the_ps(tmp_path):
    """Responsibility filters in the simulator: the PS receives one partial
    per responsible switch and one copy per direct worker, nothing else."""
    topo = topology.load(str(TOPO))
    elements = [1000, 600, 300]
    for plan, copies in ((hand_plan(), [1, 5, 8]), (ps_only_plan(hand_plan()), [8, 8, 8])):
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(build_spec(topo, plan, elements)))
        r = subprocess.run([_find_sim_binary(), "goat", "--spec", str(path), "--json"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)["result"]
        assert res["exact"] and res["retransmissions"] == 0
        assert res["ps_packets_per_job"] == [c * math.ceil(e / 256) for c, e in zip(copies, elements)]
        assert res["ps_contribution_bytes"] == sum(c * copy_bytes(e) for c, e in zip(copies, elements))
        assert res["worker_contribution_bytes"] == 8 * sum(copy_bytes(e) for e in elements)


def test_quick_study_point_agrees_with_the_flow_level_evaluator(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fanin", "sim", "goat", "--quick", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["valid"] and out["exact"] and out["same_ordering"]
    assert out["retransmissions"] == {"goat": 0, "geryon": 0}
    inst = out["instance"]
    assert inst["workers"] == 5 and inst["aggregation_nodes"] >= 1
    # the packetisation factor, computed here from the sub-model size: 221 MB / 111 at 4096 B/MB
    e = round(221 / 111 * 4096 / 4)
    factor = copy_bytes(e) / (4 * e)
    rows = {(row["scheme"], row["metric"]): row for row in out["comparison"]}
    for key in (("goat", "ps"), ("goat", "comm"), ("goat", "ina"), ("geryon", "ps"), ("geryon", "comm")):
        row = rows[key]
        assert row["flow_bytes"] > 0
        assert abs(row["packet_over_flow"] / factor - 1) < 1e-3, (key, row)
    assert rows[("geryon", "ina")]["packet_bytes"] == 0
    for level in ("flow", "packet"):
        vals = out[level]
        assert vals["goat"]["ps"] < vals["geryon"]["ps"] and vals["goat"]["comm"] < vals["geryon"]["comm"]


def test_retransmissions_break_the_agreement(tmp_path):
    """The check has teeth: with loss, retransmitted contributions are bytes
    the flow model does not have; the results stay exact but validation fails."""
    r = subprocess.run([sys.executable, "-m", "fanin", "sim", "goat", "--quick", "--loss", "0.01", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["exact"] and not out["valid"] and out["retransmissions"]["goat"] > 0
