"""Aggregation trees over a topology (SwitchML++ §3): which switches
aggregate a job, in what shape, and what each one must be told.

The tree of a job is a Steiner tree over the switches that spans the
switches its workers hang off. It is built in two steps:

1. **Root: the lowest common ancestor.** SwitchML++ roots the tree at the
   LCA of the workers, the switch with the fewest hops between the root and
   every worker. In a general graph "ancestor" has no meaning, so the rule
   is made exact here: the root is the switch that minimises, in order,
   (a) the largest hop count to any worker's switch, (b) the sum of those
   hop counts, (c) its position in the topology file. In a fat tree this
   is the LCA one expects: the edge switch when every worker hangs off it,
   an aggregation switch of the pod when they share a pod, a core switch
   otherwise.
2. **Edges: shortest paths from the root.** A breadth-first search from the
   root over switches only (neighbours in name order, so the choice is
   deterministic and stable as workers come and go) gives every switch a
   parent; the tree is the union of the paths from the root to the workers'
   switches. Switches with nothing below them are not in it. A switch on a
   path aggregates even if it has a single child (it then relays one partial;
   that is what the thesis's multi-level experiment measures).

Ranks: a worker keeps its job rank (below SWITCH_RANK_BASE); a switch's rank
at its parent is SWITCH_RANK_BASE + its index in the topology, so it never
changes while the switch stays in the tree, and a parent tells its children
apart whatever mix of workers and switches it has.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..topology import Topology, TopologyError

__all__ = ["SWITCH_RANK_BASE", "Tree", "Role", "TreeError", "build_tree", "roles", "diff_roles", "switch_rank"]

#: Ranks from here up name switches (crates/fanin-proto/src/job.rs).
SWITCH_RANK_BASE = 2048


class TreeError(ValueError):
    """The job's workers cannot be spanned by a tree (no path, unknown host)."""


@dataclass(frozen=True)
class Role:
    """What one switch of a job's tree is told through the control API."""

    #: Children: worker ranks and child switches' ranks, sorted.
    members: tuple[int, ...]
    #: Parent switch, None at the root.
    parent: Optional[str]
    #: This switch's rank at its parent (None at the root).
    rank: Optional[int]


@dataclass
class Tree:
    root: str
    #: Every switch of the tree -> its parent (None for the root).
    parent: dict[str, Optional[str]]
    #: Worker rank -> the switch it hangs off.
    attach: dict[int, str]
    #: Worker rank -> its host.
    hosts: dict[int, str] = field(default_factory=dict)

    def children(self, switch: str) -> list[str]:
        return sorted(s for s, p in self.parent.items() if p == switch)

    def depth(self) -> int:
        """Switch levels on the longest root-to-leaf path (1 = one switch)."""
        def level(s: str) -> int:
            n = 1
            while self.parent[s] is not None:
                s = self.parent[s]
                n += 1
            return n
        return max(level(s) for s in self.parent)

    def to_dict(self) -> dict:
        return {
            "root": self.root,
            "levels": self.depth(),
            "parent": dict(sorted(self.parent.items())),
            "workers": {str(r): {"host": self.hosts.get(r), "switch": s} for r, s in sorted(self.attach.items())},
        }


def switch_rank(topo: Topology, switch: str) -> int:
    index = [s.name for s in topo.switches].index(switch)
    return SWITCH_RANK_BASE + index


def _switch_bfs(topo: Topology, source: str) -> dict[str, tuple[int, Optional[str]]]:
    """Hop count and BFS parent of every switch reachable from `source`
    through switches only (hosts are never transit)."""
    seen: dict[str, tuple[int, Optional[str]]] = {source: (0, None)}
    queue = deque([source])
    while queue:
        node = queue.popleft()
        dist = seen[node][0]
        for nxt in sorted(topo.neighbours(node)):
            if topo.is_switch(nxt) and nxt not in seen:
                seen[nxt] = (dist + 1, node)
                queue.append(nxt)
    return seen


def build_tree(topo: Topology, workers: dict[int, str]) -> Tree:
    """The aggregation tree of a job whose worker `rank` runs on host
    `workers[rank]` (see the module docstring for the rules)."""
    if not workers:
        raise TreeError("a tree needs at least one worker")
    attach: dict[int, str] = {}
    for rank, host in workers.items():
        if not 0 <= rank < SWITCH_RANK_BASE:
            raise TreeError(f"worker rank {rank} is out of range (0..{SWITCH_RANK_BASE - 1})")
        try:
            attach[rank] = topo.attachment(host)
        except TopologyError as e:
            raise TreeError(str(e)) from None
    terminals = sorted(set(attach.values()), key=lambda s: _index(topo, s))
    best: Optional[tuple[tuple[int, int, int], str, dict]] = None
    for candidate in (s.name for s in topo.switches):
        reach = _switch_bfs(topo, candidate)
        if not all(t in reach for t in terminals):
            continue
        dists = [reach[t][0] for t in terminals]
        key = (max(dists), sum(dists), _index(topo, candidate))
        if best is None or key < best[0]:
            best = (key, candidate, reach)
    if best is None:
        names = ", ".join(terminals)
        raise TreeError(f"no switch of {topo.name} reaches all of the job's switches ({names}): the topology has no path between them")
    _, root, reach = best
    parent: dict[str, Optional[str]] = {root: None}
    for t in terminals:
        node = t
        while node not in parent:
            up = reach[node][1]
            parent[node] = up
            node = up
    return Tree(root=root, parent=parent, attach=attach, hosts=dict(workers))


def _index(topo: Topology, switch: str) -> int:
    return [s.name for s in topo.switches].index(switch)


def roles(topo: Topology, tree: Tree) -> dict[str, Role]:
    """Every tree switch's role: its children and its place under its parent."""
    out = {}
    for s, p in tree.parent.items():
        members = [r for r, a in tree.attach.items() if a == s]
        members += [switch_rank(topo, c) for c in tree.children(s)]
        out[s] = Role(members=tuple(sorted(members)), parent=p, rank=None if p is None else switch_rank(topo, s))
    return out


@dataclass(frozen=True)
class RoleDiff:
    #: Switches new to the tree (admit the job there).
    added: dict[str, Role]
    #: Switches whose role changed (update the job in place).
    changed: dict[str, Role]
    #: Switches no longer in the tree (remove the job there).
    removed: list[str]


def diff_roles(old: dict[str, Role], new: dict[str, Role]) -> RoleDiff:
    """What a recomputed tree changes: only these switches are programmed."""
    return RoleDiff(
        added={s: r for s, r in new.items() if s not in old},
        changed={s: r for s, r in new.items() if s in old and old[s] != r},
        removed=sorted(s for s in old if s not in new),
    )
