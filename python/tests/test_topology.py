"""The topology format, its checks and the generators (fanin.topology)."""

import json

import pytest

from fanin import topology
from fanin.topology import Host, Link, Switch, Topology, TopologyError


def test_fat_tree_counts():
    for k in (2, 4, 6):
        t = topology.fat_tree(k)
        half = k // 2
        assert len(t.switches) == half * half + k * k  # core + k pods of k/2 agg + k/2 edge
        assert len(t.hosts) == k**3 // 4
        # core-agg: k pods x k/2 aggs x k/2 uplinks; agg-edge: k x (k/2)^2; host-edge: k^3/4
        assert len(t.links) == k * half * half * 2 + k**3 // 4
    t = topology.load("fat-tree:4")
    assert (len(t.switches), len(t.hosts), len(t.links)) == (20, 16, 48)
    assert t.attachment("h0_0_0") == "edge0_0"
    assert sorted(t.neighbours("core0")) == ["agg0_0", "agg1_0", "agg2_0", "agg3_0"]


def test_other_generator_counts():
    t = topology.load("leaf-spine:2,4,3")
    assert (len(t.switches), len(t.hosts), len(t.links)) == (6, 12, 2 * 4 + 12)
    t = topology.load("star:8")
    assert (len(t.switches), len(t.hosts), len(t.links)) == (1, 8, 8)
    assert {t.attachment(h.name) for h in t.hosts} == {"s0"}
    t = topology.load("deep-tree:3,2")
    assert (len(t.switches), len(t.hosts), len(t.links)) == (1 + 2 * 2, 2, 2 * 2 + 2)
    assert t.attachment("h1") == "s2_1"
    # the number of switch levels from host to root is exactly `levels`
    parents = t.bfs("h0", through_hosts=False)
    path, node = [], "s0"
    while node is not None:
        path.append(node)
        node = parents[node]
    assert path == ["s0", "s1_0", "s2_0", "h0"]
    assert len(topology.load("deep-tree:1").switches) == 1


def test_generator_spec_errors():
    with pytest.raises(TopologyError, match="must be an even integer >= 2"):
        topology.load("fat-tree:3")
    with pytest.raises(TopologyError, match="unknown topology generator 'torus'"):
        topology.load("torus:4")
    with pytest.raises(TopologyError, match="arguments must be integers"):
        topology.load("star:x")
    with pytest.raises(TopologyError, match="wrong number of arguments"):
        topology.load("leaf-spine:2")
    with pytest.raises(TopologyError, match="no such file, and not a generator spec"):
        topology.load("/nonexistent/topo.toml")


def test_generator_rate_applies_to_every_link():
    t = topology.generate("leaf-spine:1,2,2", rate_mbit=100)
    assert {link.rate_mbit for link in t.links} == {100.0}


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_round_trip(tmp_path, suffix):
    ft = topology.fat_tree(4, rate_mbit=1000)
    # one of each non-default value: unlimited and longer link, small non-programmable switch, a PS host
    t = Topology("fat-tree-4", [Switch("core0", 16.0, False), *ft.switches[1:]], [Host("h0_0_0", "ps"), *ft.hosts[1:]],
                 [Link(ft.links[0].a, ft.links[0].b, None, 2.5), *ft.links[1:]]).validate()
    path = tmp_path / f"t{suffix}"
    t.save(path)
    back = topology.load(path)
    assert back.to_dict() == t.to_dict()
    assert back.name == "fat-tree-4"
    if suffix == ".json":
        assert json.loads(path.read_text())["link"][0] == {"a": t.links[0].a, "b": t.links[0].b, "distance": 2.5}


def test_file_defaults(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text('[[switch]]\nname = "s"\n[[host]]\nname = "h"\n[[link]]\na = "h"\nb = "s"\n')
    t = topology.load(path)
    assert t.name == str(path)
    assert t.switch("s") == Switch("s", 64.0, True)
    assert t.host("h") == Host("h", "worker")
    assert t.link("s", "h") == Link("h", "s", None, 1.0)


@pytest.mark.parametrize("text,message", [
    ('[[switch]]\nname = "s"\n[[host]]\nname = "h"\n', "host h has 0 links; hosts are single-homed"),
    ('[[switch]]\nname = "s"\n[[switch]]\nname = "s"\n', "node name 's' is used twice"),
    ('[[switch]]\nname = "1s"\n', "node name '1s' is invalid"),
    ('[[switch]]\nname = "s"\n[[link]]\na = "s"\nb = "x"\n', "link s-x: unknown node 'x'"),
    ('[[switch]]\nname = "s"\n[[link]]\na = "s"\nb = "s"\n', "connects a node to itself"),
    ('[[switch]]\nname = "s"\n[[switch]]\nname = "t"\n[[link]]\na = "s"\nb = "t"\n[[link]]\na = "t"\nb = "s"\n',
     "link t-s is listed twice"),
    ('[[switch]]\nname = "s"\n[[host]]\nname = "h"\n[[link]]\na = "h"\nb = "s"\nrate_mbit = 0\n',
     "rate_mbit 0.0 must be > 0"),
    ('[[switch]]\nname = "s"\n[[host]]\nname = "h"\n[[link]]\na = "h"\nb = "s"\ndistance = -1\n',
     "distance -1.0 must be > 0"),
    ('[[host]]\nname = "a"\n[[host]]\nname = "b"\n[[link]]\na = "a"\nb = "b"\n', "joins two hosts"),
    ('[[host]]\nname = "h"\nrole = "boss"\n', "role 'boss' must be 'worker' or 'ps'"),
    ('[[switch]]\nname = "s"\nmemory_mb = -1\n', "memory_mb -1.0 must be >= 0"),
    ('[[switch]]\nname = "s"\ncolour = "red"\n', "switch #0: unknown keys \\['colour'\\]"),
    ('[[link]]\na = "s"\n', "link #0: missing \\['b'\\]"),
    ('nodes = 3\n', "unknown top-level keys \\['nodes'\\]"),
    ('switch = 3\n', "'switch' must be an array of tables"),
    ('[[switch]]\nname = "s"\nmemory_mb = "lots"\n', "could not convert string to float"),
    ('[[switch]\n', "not valid TOML"),
])
def test_validation_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=message):
        topology.load(path)


def test_json_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(TopologyError, match="not valid JSON"):
        topology.load(path)
    path.write_text("[]")
    with pytest.raises(TopologyError, match="expected a table at the top level"):
        topology.load(path)


def test_queries():
    t = topology.load("star:2")
    assert t.is_switch("s0") and t.is_host("h0") and not t.is_host("s0")
    assert t.workers() == ["h0", "h1"]
    with pytest.raises(TopologyError, match="no link between 'h0' and 'h1'"):
        t.link("h0", "h1")
    with pytest.raises(TopologyError, match="no switch named 'x'"):
        t.switch("x")
    with pytest.raises(TopologyError, match="no host named 's0'"):
        t.attachment("s0")


def test_with_memory_sets_b_of_the_named_switches_and_refuses_unknown_ones():
    from pathlib import Path

    from fanin.topology import with_memory

    topo = topology.load(str(Path(__file__).resolve().parents[2] / "examples" / "goat-testbed.toml"))
    big = with_memory(topo, {"agg": 12, "tor1": 0})
    assert {s.name: (s.memory_mb, s.programmable) for s in big.switches} == {
        "agg": (12.0, True), "tor0": (4.0, True), "tor1": (0.0, False)}
    with pytest.raises(TopologyError, match="no switch 'core' in topology goat-testbed"):
        with_memory(topo, {"core": 4})
    with pytest.raises(TopologyError, match="must be >= 0"):
        with_memory(topo, {"agg": -1})
