"""Network topologies: the file format, generators and checks.

One format serves the controller (aggregation trees), the namespace testbed
(which namespaces and veth links to create), the GOAT planner (switch memory,
link distances) and the benchmarks. The format is documented in
docs/topology.md; in short, a TOML (or JSON) file with three arrays of tables:

    name = "fat-tree-4"
    [[switch]]
    name = "core0"
    memory_mb = 64          # aggregation memory, GOAT's B(s)   (default 64)
    programmable = true     # can aggregate (GOAT: 20% are)     (default true)
    [[host]]
    name = "h0"
    role = "worker"         # "worker" or "ps" (parameter server) (default worker)
    [[link]]
    a = "h0"
    b = "edge0_0"
    rate_mbit = 1000        # tc tbf limit on the testbed; absent = unlimited
    distance = 1            # GOAT's link distance                (default 1)

Links are undirected. Hosts are single-homed (exactly one link, to a
switch), as in the topologies of the papers; switches may be connected in any
shape, loops included (the controller builds a tree over them).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

__all__ = [
    "Switch",
    "Host",
    "Link",
    "Topology",
    "TopologyError",
    "load",
    "fat_tree",
    "leaf_spine",
    "star",
    "deep_tree",
    "generate",
    "GENERATORS",
    "with_programmable",
    "with_memory",
    "with_ps",
]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,30}$")


class TopologyError(ValueError):
    """A topology file or generator argument that cannot describe a network."""


@dataclass(frozen=True)
class Switch:
    name: str
    memory_mb: float = 64.0
    programmable: bool = True


@dataclass(frozen=True)
class Host:
    name: str
    role: str = "worker"


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rate_mbit: Optional[float] = None
    distance: float = 1.0

    def other(self, node: str) -> str:
        return self.b if node == self.a else self.a


@dataclass
class Topology:
    name: str
    switches: list[Switch] = field(default_factory=list)
    hosts: list[Host] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index()

    # -- construction and checks -------------------------------------------------

    def _index(self) -> None:
        self._switch = {s.name: s for s in self.switches}
        self._host = {h.name: h for h in self.hosts}
        self._adj: dict[str, list[Link]] = {n: [] for n in [*self._switch, *self._host]}
        for link in self.links:
            if link.a in self._adj and link.b in self._adj:
                self._adj[link.a].append(link)
                self._adj[link.b].append(link)

    def validate(self) -> "Topology":
        """Raise TopologyError naming the first problem; return self if sound."""
        seen: set[str] = set()
        for node in [*(s.name for s in self.switches), *(h.name for h in self.hosts)]:
            if not isinstance(node, str) or not _NAME.match(node):
                raise TopologyError(
                    f"node name {node!r} is invalid: use 1-31 characters, a letter first, then letters, digits, _ . -")
            if node in seen:
                raise TopologyError(f"node name {node!r} is used twice")
            seen.add(node)
        for s in self.switches:
            if not (s.memory_mb >= 0):
                raise TopologyError(f"switch {s.name}: memory_mb {s.memory_mb} must be >= 0")
        for h in self.hosts:
            if h.role not in ("worker", "ps"):
                raise TopologyError(f"host {h.name}: role {h.role!r} must be 'worker' or 'ps'")
        pairs: set[frozenset[str]] = set()
        for link in self.links:
            for end in (link.a, link.b):
                if end not in seen:
                    raise TopologyError(f"link {link.a}-{link.b}: unknown node {end!r}")
            if link.a == link.b:
                raise TopologyError(f"link {link.a}-{link.b} connects a node to itself")
            key = frozenset((link.a, link.b))
            if key in pairs:
                raise TopologyError(f"link {link.a}-{link.b} is listed twice")
            pairs.add(key)
            if link.rate_mbit is not None and not (link.rate_mbit > 0):
                raise TopologyError(f"link {link.a}-{link.b}: rate_mbit {link.rate_mbit} must be > 0")
            if not (link.distance > 0):
                raise TopologyError(f"link {link.a}-{link.b}: distance {link.distance} must be > 0")
            if link.a in self._host and link.b in self._host:
                raise TopologyError(f"link {link.a}-{link.b} joins two hosts; hosts attach to switches")
        for h in self.hosts:
            n = len(self._adj[h.name])
            if n != 1:
                raise TopologyError(f"host {h.name} has {n} links; hosts are single-homed (exactly one link)")
        return self

    # -- queries -------------------------------------------------------------------

    def is_switch(self, node: str) -> bool:
        return node in self._switch

    def is_host(self, node: str) -> bool:
        return node in self._host

    def switch(self, name: str) -> Switch:
        try:
            return self._switch[name]
        except KeyError:
            raise TopologyError(f"no switch named {name!r} in topology {self.name}") from None

    def host(self, name: str) -> Host:
        try:
            return self._host[name]
        except KeyError:
            raise TopologyError(f"no host named {name!r} in topology {self.name}") from None

    @property
    def nodes(self) -> list[str]:
        return [*self._switch, *self._host]

    def workers(self) -> list[str]:
        return [h.name for h in self.hosts if h.role == "worker"]

    def links_of(self, node: str) -> list[Link]:
        return list(self._adj.get(node, ()))

    def neighbours(self, node: str) -> list[str]:
        return [link.other(node) for link in self._adj.get(node, ())]

    def link(self, a: str, b: str) -> Link:
        for link in self._adj.get(a, ()):
            if link.other(a) == b:
                return link
        raise TopologyError(f"no link between {a!r} and {b!r}")

    def attachment(self, host: str) -> str:
        """The switch a (single-homed) host hangs off."""
        self.host(host)
        links = self._adj[host]
        if len(links) != 1:
            raise TopologyError(f"host {host} has {len(links)} links; expected exactly one")
        return links[0].other(host)

    def bfs(self, source: str, through_hosts: bool = False) -> dict[str, Optional[str]]:
        """Breadth-first parents from `source` (hop count metric). Hosts are
        leaves: paths never pass through a host unless `through_hosts`."""
        parent: dict[str, Optional[str]] = {source: None}
        queue = deque([source])
        while queue:
            node = queue.popleft()
            if node != source and self.is_host(node) and not through_hosts:
                continue
            for nxt in sorted(self.neighbours(node)):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        return parent

    def to_networkx(self):
        """An undirected networkx Graph with node attribute `kind` and the link attributes."""
        import networkx as nx

        g = nx.Graph(name=self.name)
        for s in self.switches:
            g.add_node(s.name, kind="switch", memory_mb=s.memory_mb, programmable=s.programmable)
        for h in self.hosts:
            g.add_node(h.name, kind="host", role=h.role)
        for link in self.links:
            g.add_edge(link.a, link.b, rate_mbit=link.rate_mbit, distance=link.distance)
        return g

    # -- (de)serialisation -----------------------------------------------------------

    def to_dict(self) -> dict:
        def link_dict(link: Link) -> dict:
            d = {"a": link.a, "b": link.b, "distance": link.distance}
            if link.rate_mbit is not None:
                d["rate_mbit"] = link.rate_mbit
            return d

        return {
            "name": self.name,
            "switch": [{"name": s.name, "memory_mb": s.memory_mb, "programmable": s.programmable} for s in self.switches],
            "host": [{"name": h.name, "role": h.role} for h in self.hosts],
            "link": [link_dict(link) for link in self.links],
        }

    def to_toml(self) -> str:
        d = self.to_dict()
        lines = [f"name = {json.dumps(d['name'])}", ""]
        for table in ("switch", "host", "link"):
            for row in d[table]:
                lines.append(f"[[{table}]]")
                for key, value in row.items():
                    lines.append(f"{key} = {_toml_scalar(value)}")
                lines.append("")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2) + "\n" if path.suffix == ".json" else self.to_toml()
        path.write_text(text)

    @classmethod
    def from_dict(cls, d: dict, source: str = "topology") -> "Topology":
        if not isinstance(d, dict):
            raise TopologyError(f"{source}: expected a table at the top level")
        unknown = set(d) - {"name", "switch", "host", "link"}
        if unknown:
            raise TopologyError(f"{source}: unknown top-level keys {sorted(unknown)} (expected name, switch, host, link)")

        def rows(key: str, allowed: set[str], required: set[str]) -> Iterable[dict]:
            value = d.get(key, [])
            if not isinstance(value, list):
                raise TopologyError(f"{source}: '{key}' must be an array of tables ([[{key}]])")
            for i, row in enumerate(value):
                if not isinstance(row, dict):
                    raise TopologyError(f"{source}: {key} #{i} is not a table")
                extra = set(row) - allowed
                if extra:
                    raise TopologyError(f"{source}: {key} #{i}: unknown keys {sorted(extra)} (allowed: {sorted(allowed)})")
                missing = required - set(row)
                if missing:
                    raise TopologyError(f"{source}: {key} #{i}: missing {sorted(missing)}")
                yield row

        try:
            switches = [Switch(r["name"], float(r.get("memory_mb", 64.0)), bool(r.get("programmable", True)))
                        for r in rows("switch", {"name", "memory_mb", "programmable"}, {"name"})]
            hosts = [Host(r["name"], str(r.get("role", "worker"))) for r in rows("host", {"name", "role"}, {"name"})]
            links = [Link(str(r["a"]), str(r["b"]),
                          None if r.get("rate_mbit") is None else float(r["rate_mbit"]),
                          float(r.get("distance", 1.0)))
                     for r in rows("link", {"a", "b", "rate_mbit", "distance"}, {"a", "b"})]
        except (TypeError, ValueError) as e:
            if isinstance(e, TopologyError):
                raise
            raise TopologyError(f"{source}: {e}") from None
        return cls(str(d.get("name", source)), switches, hosts, links).validate()


def _toml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def load(spec: str | Path) -> Topology:
    """A topology from a file (.toml or .json) or a generator spec such as
    `fat-tree:4`, `leaf-spine:2,4,2`, `star:8` or `deep-tree:3,2` (see
    `generate`)."""
    text = str(spec)
    path = Path(text)
    if path.exists():
        raw = path.read_text()
        try:
            data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise TopologyError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
        return Topology.from_dict(data, source=str(path))
    if ":" in text or text in GENERATORS:
        return generate(text)
    raise TopologyError(f"topology {text!r}: no such file, and not a generator spec "
                        f"({', '.join(sorted(GENERATORS))}, e.g. fat-tree:4)")


# -- generators ----------------------------------------------------------------------


def fat_tree(k: int, rate_mbit: Optional[float] = None, memory_mb: float = 64.0, *,
             hosts_per_edge: Optional[int] = None) -> Topology:
    """The k-ary fat tree (Al-Fares et al.): (k/2)^2 core switches, k pods of
    k/2 aggregation and k/2 edge switches, k/2 hosts per edge switch, k^3/4
    hosts. k=4 is the SwitchML++ thesis topology (20 switches, 16 hosts).

    `hosts_per_edge` overrides the k/2 hosts under each edge switch (an
    oversubscribed tree): `fat-tree:8,6` is GOAT's §VII-D instance, 80
    switches and 192 servers."""
    if not isinstance(k, int) or k < 2 or k % 2:
        raise TopologyError(f"fat-tree k={k!r} must be an even integer >= 2")
    half = k // 2
    if hosts_per_edge is None:
        hosts_per_edge = half
    if not isinstance(hosts_per_edge, int) or hosts_per_edge < 1:
        raise TopologyError(f"fat-tree hosts_per_edge={hosts_per_edge!r} must be an integer >= 1")
    switches, hosts, links = [], [], []
    core = [f"core{i}" for i in range(half * half)]
    switches += [Switch(c, memory_mb) for c in core]
    for pod in range(k):
        aggs = [f"agg{pod}_{i}" for i in range(half)]
        edges = [f"edge{pod}_{i}" for i in range(half)]
        switches += [Switch(n, memory_mb) for n in aggs + edges]
        for i, agg in enumerate(aggs):
            # aggregation switch i of every pod connects to core group i
            for j in range(half):
                links.append(Link(agg, core[i * half + j], rate_mbit))
            for edge in edges:
                links.append(Link(agg, edge, rate_mbit))
        for e, edge in enumerate(edges):
            for h in range(hosts_per_edge):
                name = f"h{pod}_{e}_{h}"
                hosts.append(Host(name))
                links.append(Link(name, edge, rate_mbit))
    name = f"fat-tree-{k}" if hosts_per_edge == half else f"fat-tree-{k}-{hosts_per_edge}"
    return Topology(name, switches, hosts, links).validate()


def leaf_spine(spines: int, leaves: int, hosts_per_leaf: int, rate_mbit: Optional[float] = None,
               memory_mb: float = 64.0) -> Topology:
    """Every leaf connected to every spine; hosts on the leaves."""
    for label, value in (("spines", spines), ("leaves", leaves), ("hosts_per_leaf", hosts_per_leaf)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"leaf-spine {label}={value!r} must be an integer >= 1")
    switches = [Switch(f"spine{i}", memory_mb) for i in range(spines)]
    switches += [Switch(f"leaf{i}", memory_mb) for i in range(leaves)]
    hosts, links = [], []
    for leaf in range(leaves):
        for spine in range(spines):
            links.append(Link(f"leaf{leaf}", f"spine{spine}", rate_mbit))
        for h in range(hosts_per_leaf):
            name = f"h{leaf}_{h}"
            hosts.append(Host(name))
            links.append(Link(name, f"leaf{leaf}", rate_mbit))
    return Topology(f"leaf-spine-{spines}-{leaves}-{hosts_per_leaf}", switches, hosts, links).validate()


def star(hosts: int, rate_mbit: Optional[float] = None, memory_mb: float = 64.0) -> Topology:
    """One switch, `hosts` hosts: SwitchML's single rack."""
    if not isinstance(hosts, int) or hosts < 1:
        raise TopologyError(f"star hosts={hosts!r} must be an integer >= 1")
    hs = [Host(f"h{i}") for i in range(hosts)]
    return Topology(f"star-{hosts}", [Switch("s0", memory_mb)], hs,
                    [Link(h.name, "s0", rate_mbit) for h in hs]).validate()


def deep_tree(levels: int, hosts: int = 2, rate_mbit: Optional[float] = None, memory_mb: float = 64.0) -> Topology:
    """An aggregation tree of exactly `levels` switch levels over `hosts`
    hosts (the SwitchML++ tree-levels experiment): a root `s0`, and below it
    one chain of `levels - 1` switches per host (`s<level>_<host>`), the host
    at the bottom. levels=1 puts every host on the root."""
    if not isinstance(levels, int) or levels < 1:
        raise TopologyError(f"deep-tree levels={levels!r} must be an integer >= 1")
    if not isinstance(hosts, int) or hosts < 1:
        raise TopologyError(f"deep-tree hosts={hosts!r} must be an integer >= 1")
    switches, hs, links = [Switch("s0", memory_mb)], [], []
    for h in range(hosts):
        upper = "s0"
        for level in range(1, levels):
            name = f"s{level}_{h}"
            switches.append(Switch(name, memory_mb))
            links.append(Link(name, upper, rate_mbit))
            upper = name
        hs.append(Host(f"h{h}"))
        links.append(Link(f"h{h}", upper, rate_mbit))
    return Topology(f"deep-tree-{levels}-{hosts}", switches, hs, links).validate()


GENERATORS = {
    "fat-tree": (fat_tree, "K[,HOSTS_PER_EDGE]"),
    "leaf-spine": (leaf_spine, "SPINES,LEAVES,HOSTS_PER_LEAF"),
    "star": (star, "HOSTS"),
    "deep-tree": (deep_tree, "LEVELS[,HOSTS]"),
}

_SPEC_KEYWORDS = {"fat-tree": ("hosts_per_edge",)}


def generate(spec: str, rate_mbit: Optional[float] = None) -> Topology:
    """A generated topology from `name:arg,arg` (e.g. `fat-tree:4`)."""
    name, _, args = spec.partition(":")
    if name not in GENERATORS:
        raise TopologyError(f"unknown topology generator {name!r}; known: "
                            + ", ".join(f"{n}:{a}" for n, (_, a) in sorted(GENERATORS.items())))
    fn, usage = GENERATORS[name]
    try:
        values = [int(a) for a in args.split(",") if a.strip()]
    except ValueError:
        raise TopologyError(f"{spec!r}: arguments must be integers ({name}:{usage})") from None
    # Optional trailing spec arguments that are keyword-only in Python (so the
    # existing positional signatures stay as they were).
    extra = _SPEC_KEYWORDS.get(name, ())
    if extra and len(values) > 1 + len(extra):
        raise TopologyError(f"{spec!r}: wrong number of arguments ({name}:{usage})")
    keywords = dict(zip(extra, values[1:]))
    if keywords:
        values = values[:1]
    try:
        return fn(*values, rate_mbit=rate_mbit, **keywords)
    except TypeError:
        raise TopologyError(f"{spec!r}: wrong number of arguments ({name}:{usage})") from None


# -- derived topologies (GOAT's §VII-D setting) ------------------------------------------


def with_programmable(topo: Topology, fraction: float, seed: int = 0,
                      memory_mb: Optional[float] = None) -> Topology:
    """A copy of `topo` where a seeded random `fraction` of the switches
    (rounded, at least one) is programmable and the others are not; with
    `memory_mb`, the programmable ones get that memory B(s). GOAT §VII-D
    makes 20% of the switches programmable with 64 MB."""
    import random

    if not (0.0 < fraction <= 1.0):
        raise TopologyError(f"programmable fraction {fraction!r} must be in (0, 1]")
    if memory_mb is not None and not (memory_mb >= 0):
        raise TopologyError(f"memory_mb {memory_mb!r} must be >= 0")
    names = sorted(s.name for s in topo.switches)
    count = max(1, round(fraction * len(names)))
    chosen = set(random.Random(seed).sample(names, count))
    switches = [Switch(s.name, s.memory_mb if memory_mb is None or s.name not in chosen else float(memory_mb),
                       s.name in chosen) for s in topo.switches]
    return Topology(topo.name, switches, list(topo.hosts), list(topo.links)).validate()


def with_memory(topo: Topology, memory_mb: dict[str, float]) -> Topology:
    """A copy of `topo` where each switch named in `memory_mb` has that
    memory B(s) (programmable if it is > 0, not if it is 0)."""
    names = {s.name for s in topo.switches}
    unknown = sorted(set(memory_mb) - names)
    if unknown:
        raise TopologyError(f"no switch {', '.join(map(repr, unknown))} in topology {topo.name} "
                            f"(its switches: {', '.join(sorted(names))})")
    for name, mb in memory_mb.items():
        if not (mb >= 0):
            raise TopologyError(f"memory of switch {name!r}: {mb!r} must be >= 0 MB")
    switches = [Switch(s.name, float(memory_mb[s.name]), memory_mb[s.name] > 0) if s.name in memory_mb else s
                for s in topo.switches]
    return Topology(topo.name, switches, list(topo.hosts), list(topo.links)).validate()


def with_ps(topo: Topology, host: str) -> Topology:
    """A copy of `topo` where `host` is the parameter server and every other
    host a worker."""
    topo.host(host)
    hosts = [Host(h.name, "ps" if h.name == host else "worker") for h in topo.hosts]
    return Topology(topo.name, list(topo.switches), hosts, list(topo.links)).validate()
