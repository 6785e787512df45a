"""`fanin plan goat` end to end, and the topology additions it relies on."""

import json

import pytest

from fanin import topology as T
from fanin.cli import main


def test_fat_tree_with_hosts_per_edge_is_the_goat_instance():
    topo = T.load("fat-tree:8,6")
    assert (len(topo.switches), len(topo.hosts)) == (80, 192)
    assert len(T.load("fat-tree:4").hosts) == 16                      # the default is unchanged
    with pytest.raises(T.TopologyError, match="wrong number of arguments"):
        T.load("fat-tree:8,6,1")
    marked = T.with_programmable(topo, 0.2, seed=3, memory_mb=64)
    prog = [s for s in marked.switches if s.programmable]
    assert len(prog) == 16 and all(s.memory_mb == 64 for s in prog)
    with pytest.raises(T.TopologyError, match="fraction"):
        T.with_programmable(topo, 0.0)


def test_plan_goat_writes_an_installable_plan(tmp_path, capsys):
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps([{"name": "conv", "size_mb": 3.0}, 2.0, 1.0]))
    out = tmp_path / "plan.json"
    rc = main(["plan", "goat", "--topology", "leaf-spine:2,3,3", "--programmable", "0.4", "--memory-mb", "4",
               "--ps", "h0_0", "--submodels", str(sizes), "--out", str(out), "--seed", "2"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fanin.goat.plan/1"
    assert len(doc["workers"]) == 8 and all(len(w["aggregation_node"]) == 3 for w in doc["workers"])
    for sw in doc["switches"]:
        assert sw["memory_used_mb"] <= sw["memory_mb"] + 1e-9
    assert "PS receives" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--even", "10,2"], "role 'ps'"),
    (["--even", "10,x", "--ps", "h0_0"], "--even"),
    (["--model", "nosuchnet", "--ps", "h0_0"], "unknown model"),
    (["--even", "10,2", "--ps", "nobody"], "no host named"),
    (["--even", "10,2", "--ps", "h0_0", "--memory-mb", "8"], "--memory-mb needs --programmable"),
])
def test_plan_goat_rejects_bad_input_with_a_reason(argv, message, capsys):
    assert main(["plan", "goat", "--topology", "leaf-spine:2,3,3"] + argv) == 2
    assert message in capsys.readouterr().err


def test_plan_goat_out_that_cannot_be_written_is_one_error_naming_the_flag(tmp_path, capsys):
    """An --out the plan cannot be written to is refused with a line naming --out and why (exit 2, no
    traceback), before the planner runs; nothing is left behind."""
    base = ["plan", "goat", "--topology", "leaf-spine:2,3,3", "--programmable", "0.4", "--memory-mb", "4",
            "--ps", "h0_0", "--even", "10,2"]
    for out, why in ((tmp_path / "no" / "such" / "plan.json", "No such file or directory"),
                     (tmp_path, "Is a directory")):
        capsys.readouterr()
        assert main(base + ["--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fanin plan goat: --out {out}: cannot write the plan: {why}"], err
    assert not (tmp_path / "no").exists()
