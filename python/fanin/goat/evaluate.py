"""One flow-level evaluator for GOAT and every baseline (§VII-D metrics).

A scenario is a topology with a PS, a set of workers, each worker's sending
rate (ratio × 10 Gbit/s) and the model's sub-models. Every scheme's traffic
is counted the same way, as MB × link distance on shortest paths:
* PS aggregation overhead: MB arriving at the PS;
* in-network aggregation amount: |W| · Σ b(g) minus that (the paper's
  definition, §VII-A);
* communication overhead: Σ over links of the MB crossing them.

Schemes: `goat` (a KRGS plan; each responsible switch holds its sub-models
exclusively, so arrival order does not matter), `geryon` (shortest paths,
no aggregation) and the memory-sharing schemes `atp` and `esa` in
`baselines.py`, which do depend on when each fragment arrives.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from fanin.goat.model import GoatError, Instance, SubModel, instance_from_topology
from fanin.topology import Topology

__all__ = ["Scenario", "Metrics", "tree_to_ps", "evaluate_plan", "evaluate_geryon", "draw_rates"]

LINK_GBPS = 10.0


@dataclass
class Metrics:
    scheme: str
    ps_mb: float                 # PS aggregation overhead
    ina_mb: float                # in-network aggregation amount
    comm_mb: float               # communication overhead (MB x distance)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "ps_mb": self.ps_mb, "ina_mb": self.ina_mb, "comm_mb": self.comm_mb,
                **self.extra}


@dataclass
class Scenario:
    topo: Topology
    ps: str
    workers: list[str]
    rates_gbps: np.ndarray
    submodels: list[SubModel]

    def __post_init__(self) -> None:
        if len(self.rates_gbps) != len(self.workers):
            raise GoatError("one sending rate per worker")
        if np.any(~(self.rates_gbps > 0)):
            raise GoatError("sending rates must be > 0")
        self.parent, self.dist = tree_to_ps(self.topo, self.ps)

    @property
    def total_mb(self) -> float:
        return float(sum(sm.size_mb for sm in self.submodels))

    def instance(self) -> Instance:
        return instance_from_topology(self.topo, self.submodels, workers=self.workers, ps=self.ps)


def draw_rates(n: int, sigma: float, rng: np.random.Generator, link_gbps: float = LINK_GBPS) -> np.ndarray:
    """ratio × 10 Gbit/s with ratio ~ Normal(1, σ), kept in [0.1, 1.9] so
    the mean stays 10 Gbit/s and no worker stops (§VII-D)."""
    if sigma < 0:
        raise GoatError(f"sigma {sigma} must be >= 0")
    return np.clip(rng.normal(1.0, sigma, size=n), 0.1, 1.9) * link_gbps


def tree_to_ps(topo: Topology, ps: str) -> tuple[dict[str, Optional[str]], dict[str, float]]:
    """Next hop toward the PS and the distance to it, for every node: the
    shortest-path tree rooted at the PS (link `distance` as length; ties
    broken by node name so the routes are deterministic). Hosts are leaves."""
    dist: dict[str, float] = {ps: 0.0}
    parent: dict[str, Optional[str]] = {ps: None}
    heap = [(0.0, ps)]
    done: set[str] = set()
    while heap:
        d, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node != ps and topo.is_host(node):
            continue
        for link in sorted(topo.links_of(node), key=lambda l: l.other(node)):
            nxt = link.other(node)
            nd = d + link.distance
            if nd < dist.get(nxt, float("inf")) - 1e-12:
                dist[nxt], parent[nxt] = nd, node
                heapq.heappush(heap, (nd, nxt))
    return parent, dist


def evaluate_geryon(scn: Scenario) -> Metrics:
    """Geryon-style: every worker's gradient on its shortest path to the PS,
    no aggregation anywhere."""
    total = scn.total_mb
    ps_mb = total * len(scn.workers)
    comm = sum(scn.dist[w] for w in scn.workers) * total
    return Metrics("geryon", ps_mb, 0.0, comm)


def evaluate_plan(scn: Scenario, plan, name: str = "goat") -> Metrics:
    """A GOAT plan: worker w sends sub-model g to its node (shortest path);
    a responsible switch aggregates everything addressed to it into one
    b(g) toward the PS. Its memory for g is exclusive (the plan fits B(s)),
    so asynchronous arrivals change nothing."""
    inst = plan.inst
    if list(inst.workers) != list(scn.workers) or inst.ps != scn.ps:
        raise GoatError("the plan was made for other workers or another PS")
    b = inst.sizes
    w_idx = np.arange(len(inst.workers))[:, None]
    comm = float((inst.dist_ws[w_idx, plan.node] * b[None, :]).sum())
    direct = (plan.node == inst.alpha)
    ps_mb = float((direct * b[None, :]).sum())
    for g in range(len(b)):
        for s in set(plan.node[:, g].tolist()) - {inst.alpha}:
            comm += inst.dist_sa[s] * b[g]
            ps_mb += b[g]
    overfull = int(np.sum(plan.memory_used() > inst.memory_mb + 1e-7))
    return Metrics(name, float(ps_mb), float(scn.total_mb * len(scn.workers) - ps_mb), float(comm),
                   {"switches_used": int(len({s for ss in plan.responsible for s in ss})),
                    "overfull_switches": overfull})
