"""Installing a GOAT plan on fanin switches (issue 8 item 6; docs/goat.md,
"Deployment").

A plan (schema ``fanin.goat.plan/1``) becomes one fanin job per sub-model g
(job id ``job_base + g``):

* the parameter server runs the fanin daemon as a *host aggregator* and is
  the **root** of every job; its members are the ranks of the switches
  that aggregate g (``2048 + index in the topology``, as the controller
  ranks switches) and the ranks of the workers that send g to it directly;
* a switch responsible for (g, workers W) gets job g with members W and a
  tree role whose parent is the PS: it aggregates W's fragments of g and
  sends one partial, counting ``|W|`` sources, to the PS. That job table
  *is* the responsibility filter: a switch only aggregates packets of its
  jobs addressed to it; everything else (other sub-models, fragments for
  another node) is addressed elsewhere and the switch forwards it at the IP
  level like any switch (the testbed's ``routing``);
* worker ranks are their index in the plan's ``workers`` list; each worker
  runs one session per sub-model, to its aggregation node for that g.

With ``on_path`` (GOAT's on-path filtering, docs/goat.md) workers send every
sub-model to their first-hop switch instead: each plan switch on a worker's
path to its node for g holds a *transit* for job g that relays g's
datagrams (unchanged) to the next plan switch toward the PS and fans the
results back down; a switch aggregates only what its job's members send.
One path for every fragment, no per-sub-model addresses at the workers.

`plan_jobs` is the pure translation (tested on a hand-checked plan), and
refuses a plan whose filters, workers' nodes and PS `expect` disagree;
`install_goat_plan` admits the jobs through the control APIs and returns a
`Deployment` that tells every worker where to send and removes the jobs.
`ps_only_plan` turns a plan into the no-aggregation baseline (every
sub-model straight to the PS, Geryon without in-network aggregation).
"""

from __future__ import annotations

import copy
import json
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional

from ..controller.fabric import Fabric
from ..controller.tree import SWITCH_RANK_BASE, switch_rank
from ..topology import Topology
from .model import GoatError

__all__ = ["AggregatorJob", "JobPlan", "TransitEntry", "WorkerTarget", "Deployment", "plan_jobs", "install_goat_plan",
           "remove_goat_plan", "ps_only_plan", "atp_like_plan"]

PLAN_SCHEMA = "fanin.goat.plan/1"


@dataclass(frozen=True)
class AggregatorJob:
    """One job on one aggregation node (a switch, or the PS as root)."""

    node: str
    submodel: int
    job_id: int
    members: tuple[int, ...]
    #: None on the PS (the root); the PS's name on a switch.
    parent: Optional[str] = None
    #: this node's rank at its parent (switches only)
    rank: Optional[int] = None


@dataclass(frozen=True)
class WorkerTarget:
    """Where one worker sends one sub-model."""

    submodel: int
    job_id: int
    rank: int
    node: str
    #: on-path filtering: the switch the worker sends to (its first plan
    #: switch toward the PS), which relays to `node`; None: `node` itself
    first_hop: Optional[str] = None

    @property
    def sends_to(self) -> str:
        return self.first_hop or self.node


@dataclass(frozen=True)
class TransitEntry:
    """On-path filtering: `node` relays job `job_id` (sub-model g) for the
    workers whose path to their aggregation node passes it, toward `next`
    (the next plan switch toward the PS, or the PS)."""

    node: str
    submodel: int
    job_id: int
    next: str
    #: the worker ranks whose path to their node passes `node` (only they are relayed)
    sources: tuple[int, ...] = ()


@dataclass
class JobPlan:
    ps: str
    jobs: list[AggregatorJob]
    #: worker -> its targets, in sub-model order
    targets: dict[str, list[WorkerTarget]]
    ranks: dict[str, int]
    #: on-path filtering's relays (empty without it), sorted by node and job
    transits: list[TransitEntry] = field(default_factory=list)

    def on(self, node: str) -> list[AggregatorJob]:
        return [j for j in self.jobs if j.node == node]


def _field(obj: Any, key: str, where: str) -> Any:
    """``obj[key]``, or GoatError naming the plan field that is missing."""
    if not isinstance(obj, dict) or key not in obj:
        raise GoatError(f"{where}: the plan lacks field {key!r} (schema {PLAN_SCHEMA}, docs/goat.md)")
    return obj[key]


def _list(obj: Any, key: str, where: str) -> list:
    value = _field(obj, key, where)
    if not isinstance(value, list):
        raise GoatError(f"{where}.{key}: expected a list, got {value!r}")
    return value


def _submodel_id(entry: Any, where: str, n_sub: int) -> int:
    g = _field(entry, "submodel", where)
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 0 <= g < n_sub:
        raise GoatError(f"{where}: submodel {g!r} is not a sub-model id of the plan (0..{n_sub - 1}); "
                        f"use the index of an entry of `submodels`")
    return int(g)


def plan_jobs(plan: dict[str, Any], topo: Topology, *, job_base: int = 100, on_path: bool = False) -> JobPlan:
    """The jobs that realise `plan` on `topo`: PS jobs first (roots), then
    switch jobs; filters with no worker (``expected_sources`` 0) are not
    installed.

    Raises GoatError, naming the plan field and what to change, when the
    plan does not fit the topology or its parts disagree (docs/goat.md,
    "Deployment"): names must be known and unique; every (worker, sub-model
    g) is aggregated at exactly one node, the one in the worker's
    ``aggregation_node[g]`` (one switch filter lists it, or none does and
    the node is the PS); for every g the PS's ``expect`` lists exactly the
    switches whose filter for g has workers (``from_switches``) and the
    workers whose node for g is the PS (``direct_workers``); and
    ``expected_sources``, where given, is what is actually aggregated (a
    filter's workers; at the PS, switch partials plus direct workers).
    Anything else would install and return wrong sums, or never complete.

    `on_path`: also the transits of on-path filtering, and every worker's
    first hop (:func:`on_path_transits`)."""
    if not isinstance(plan, dict) or plan.get("schema") != PLAN_SCHEMA:
        got = plan.get("schema") if isinstance(plan, dict) else plan
        raise GoatError(f"plan schema {got!r} is not {PLAN_SCHEMA}")
    ps_entry = _field(plan, "parameter_server", "plan")
    ps = _field(ps_entry, "name", "parameter_server")
    if not topo.is_host(ps):
        raise GoatError(f"the plan's parameter server {ps!r} is not a host of topology {topo.name}")
    n_sub = len(_list(plan, "submodels", "plan"))
    for i, sm in enumerate(plan["submodels"]):
        if isinstance(sm, dict) and sm.get("id", i) != i:
            raise GoatError(f"submodels[{i}]: id {sm['id']!r} must be {i}: a sub-model's id is its index "
                            f"(workers' aggregation_node[g], filters' and the PS's `submodel`)")

    # -- workers: unique known hosts; rank = index
    workers = _list(plan, "workers", "plan")
    if not workers:
        raise GoatError("workers: the plan has no worker")
    ranks: dict[str, int] = {}
    for r, w in enumerate(workers):
        name = _field(w, "name", f"workers[{r}]")
        if name in ranks:
            raise GoatError(f"workers[{r}]: the name {name!r} is already worker {ranks[name]}'s; give every worker "
                            f"its own name (its rank is its index in `workers`)")
        if name == ps:
            raise GoatError(f"workers[{r}]: {name!r} is the parameter server; a host cannot be both")
        if not topo.is_host(name):
            raise GoatError(f"workers[{r}]: {name!r} is not a host of topology {topo.name}")
        ranks[name] = r
    if len(ranks) > SWITCH_RANK_BASE:
        raise GoatError(f"{len(ranks)} workers: worker ranks must stay below {SWITCH_RANK_BASE}")

    def job_id(g: int) -> int:
        return job_base + g

    # -- switch filters: each (worker, g) in at most one filter
    switch_jobs: list[AggregatorJob] = []
    filtered: dict[tuple[str, int], str] = {}  # (worker, g) -> switch
    aggregating: dict[int, list[str]] = {g: [] for g in range(n_sub)}  # g -> switches with workers of g
    plan_switches: set[str] = set()
    for i, sw in enumerate(_list(plan, "switches", "plan")):
        name = _field(sw, "name", f"switches[{i}]")
        if not topo.is_switch(name):
            raise GoatError(f"the plan's switch {name!r} is not a switch of topology {topo.name}")
        if name in plan_switches:
            raise GoatError(f"switches: {name!r} is listed twice; give each switch one entry with all its filters")
        plan_switches.add(name)
        seen: set[int] = set()
        for k, f in enumerate(_list(sw, "filters", f"switches[{name!r}]")):
            g = _submodel_id(f, f"switches[{name!r}].filters", n_sub)
            if g in seen:
                raise GoatError(f"switches[{name!r}].filters: two filters for sub-model {g}; merge them into one")
            seen.add(g)
            where = f"switches[{name!r}].filters (sub-model {g})"
            ws = _list(f, "workers", f"switches[{name!r}].filters[{k}]")
            for w in ws:
                if w not in ranks:
                    raise GoatError(f"{where}: worker {w!r} is not in the plan's `workers`; add it there or remove "
                                    f"it from the filter")
                other = filtered.get((w, g))
                if other == name:
                    raise GoatError(f"{where}: worker {w!r} is listed twice; list it once")
                if other is not None:
                    raise GoatError(f"{where}: worker {w!r} is also in the filter of {other!r} for sub-model {g}: a "
                                    f"worker's sub-model is aggregated at one node; keep it only in the filter of "
                                    f"its aggregation_node[{g}]")
                filtered[(w, g)] = name
            if "expected_sources" in f and f["expected_sources"] != len(ws):
                raise GoatError(f"{where}: expected_sources is {f['expected_sources']!r}, but the filter lists "
                                f"{len(ws)} workers; set it to {len(ws)}")
            if not ws:
                continue
            aggregating[g].append(name)
            switch_jobs.append(AggregatorJob(name, g, job_id(g), tuple(sorted(ranks[w] for w in ws)),
                                             parent=ps, rank=switch_rank(topo, name)))

    # -- workers' nodes agree with the filters; who goes to the PS directly
    direct: dict[int, list[str]] = {g: [] for g in range(n_sub)}
    targets: dict[str, list[WorkerTarget]] = {}
    for r, w in enumerate(workers):
        nodes = _list(w, "aggregation_node", f"workers[{r}]")
        if len(nodes) != n_sub:
            raise GoatError(f"worker {w['name']}: {len(nodes)} aggregation nodes for {n_sub} sub-models; give "
                            f"workers[{r}].aggregation_node one node per sub-model")
        out = []
        for g, node in enumerate(nodes):
            expected = filtered.get((w["name"], g), ps)
            if node != expected:
                raise GoatError(f"worker {w['name']} sends sub-model {g} to {node!r}, but the filters say "
                                f"{expected!r}; change workers[{r}].aggregation_node[{g}] or the switch filters")
            if node == ps:
                direct[g].append(w["name"])
            out.append(WorkerTarget(g, job_id(g), r, node))
        targets[w["name"]] = out

    # -- the PS completes every sub-model from exactly those
    expect: dict[int, dict[str, Any]] = {}
    for i, e in enumerate(_list(ps_entry, "expect", "parameter_server")):
        g = _submodel_id(e, f"parameter_server.expect[{i}]", n_sub)
        if g in expect:
            raise GoatError(f"parameter_server.expect: two entries for sub-model {g}; keep one")
        expect[g] = e
    ps_jobs = []
    for g in range(n_sub):
        want = {"submodel": g, "from_switches": aggregating[g], "direct_workers": direct[g],
                "expected_sources": len(aggregating[g]) + len(direct[g])}
        if g not in expect:
            raise GoatError(f"parameter_server.expect has no entry for sub-model {g}: the PS would never complete "
                            f"it; add {json.dumps(want)}")
        e, where = expect[g], f"parameter_server.expect (sub-model {g})"
        from_switches = _list(e, "from_switches", where)
        direct_workers = _list(e, "direct_workers", where)
        for field_, listed in (("from_switches", from_switches), ("direct_workers", direct_workers)):
            once: set[Any] = set()
            for x in listed:
                if x in once:
                    raise GoatError(f"{where}: {field_} lists {x!r} twice; list it once")
                once.add(x)
        direct_set = set(direct[g])
        for s in from_switches:
            if s not in plan_switches:
                raise GoatError(f"{where}: from_switches lists {s!r}, which is not a switch of the plan; remove it")
            if s not in aggregating[g]:
                raise GoatError(f"{where}: from_switches lists {s!r}, whose filter aggregates no worker's sub-model "
                                f"{g}: the PS would wait for a partial that never comes; remove it")
        for s in aggregating[g]:
            if s not in from_switches:
                n = sum(1 for (_, h), t in filtered.items() if h == g and t == s)
                raise GoatError(f"{where}: from_switches lacks {s!r}, whose filter aggregates sub-model {g} of {n} "
                                f"workers: their gradients would be missing from the sum; add it")
        for w in direct_workers:
            if w not in ranks:
                raise GoatError(f"{where}: direct_workers lists {w!r}, which is not in the plan's `workers`; "
                                f"remove it")
            if w not in direct_set:
                node = filtered[(w, g)]
                raise GoatError(f"{where}: direct_workers lists {w!r}, but {node!r} aggregates its sub-model {g} "
                                f"(that switch's filter and aggregation_node[{g}] say so): it would be counted "
                                f"twice; remove it from direct_workers")
        listed_direct = set(direct_workers)
        for w in direct[g]:
            if w not in listed_direct:
                raise GoatError(f"{where}: direct_workers lacks {w!r}, which sends sub-model {g} to the PS "
                                f"(aggregation_node[{g}] = {ps!r}, in no switch's filter): its gradient would be "
                                f"missing from the sum; add it")
        n = want["expected_sources"]
        if "expected_sources" in e and e["expected_sources"] != n:
            raise GoatError(f"{where}: expected_sources is {e['expected_sources']!r}, but the PS receives {n} "
                            f"contributions ({len(aggregating[g])} switch partials + {len(direct[g])} direct "
                            f"workers); set it to {n}")
        members = [switch_rank(topo, s) for s in from_switches] + [ranks[w] for w in direct_workers]
        ps_jobs.append(AggregatorJob(ps, g, job_id(g), tuple(sorted(members))))
    jp = JobPlan(ps, ps_jobs + switch_jobs, targets, ranks)
    if on_path:
        jp.targets, jp.transits = on_path_transits(plan, topo, jp)
    return jp


def on_path_transits(plan: dict[str, Any], topo: Topology,
                     jp: JobPlan) -> tuple[dict[str, list[WorkerTarget]], list[TransitEntry]]:
    """GOAT's on-path filtering on fanin (docs/goat.md): the routes toward
    the PS are the shortest-path tree rooted at it (as the evaluator's and
    the testbed's). A worker's *path* is the plan switches (those with
    memory, which run a daemon) it passes toward the PS, then the PS. Each
    sub-model's node must lie on that path; every plan switch before it
    relays the sub-model to the next one. Returns the targets with their
    first hop and the transits. Raises GoatError where a node is off a
    worker's path (the plan then needs the direct addressing)."""
    from .evaluate import tree_to_ps

    parent, _ = tree_to_ps(topo, jp.ps)
    programmable = {sw["name"] for sw in plan["switches"]}
    transits: dict[tuple[str, int], TransitEntry] = {}
    behind: dict[tuple[str, int], set[int]] = {}
    targets: dict[str, list[WorkerTarget]] = {}
    for w, ts in jp.targets.items():
        path, hop = [], parent.get(w)
        while hop is not None and hop != jp.ps:
            if hop in programmable:
                path.append(hop)
            hop = parent.get(hop)
        path.append(jp.ps)
        out = []
        for t in ts:
            if t.node not in path:
                raise GoatError(f"on-path filtering: worker {w} sends sub-model {t.submodel} to {t.node!r}, which "
                                f"is not on its path to the PS ({' -> '.join(path)}); install the plan without on_path")
            for here, nxt in zip(path[:path.index(t.node)], path[1:]):
                transits[(here, t.job_id)] = TransitEntry(here, t.submodel, t.job_id, nxt)
                behind.setdefault((here, t.job_id), set()).add(t.rank)
            out.append(replace(t, first_hop=path[0]))
        targets[w] = out
    return targets, [replace(transits[k], sources=tuple(sorted(behind[k]))) for k in sorted(transits)]


def ps_only_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The same instance without in-network aggregation: no switch filters,
    every worker sends every sub-model to the PS."""
    out = copy.deepcopy(plan)
    ps = out["parameter_server"]["name"]
    names = [w["name"] for w in out["workers"]]
    for sw in out["switches"]:
        sw["filters"], sw["memory_used_mb"] = [], 0.0
    for w in out["workers"]:
        w["aggregation_node"] = [ps] * len(out["submodels"])
    out["parameter_server"]["expect"] = [
        {"submodel": s["id"], "from_switches": [], "direct_workers": list(names), "expected_sources": len(names)}
        for s in out["submodels"]]
    out["ps_mb"] = len(names) * sum(float(s["size_mb"]) for s in out["submodels"])
    return out


def atp_like_plan(plan: dict[str, Any], topo: Topology) -> dict[str, Any]:
    """The same instance placed as ATP's memory sharing settles without
    contention (§VII-A's baseline, as a static plan a controller can
    install): every worker's sub-models, in id order (ATP serves fragments
    first come, and a step sends them in order), are aggregated at the
    first programmable switch on the worker's shortest path to the PS that
    already aggregates that sub-model or still has B(s) for it; a sub-model
    no switch on the path can hold goes to the PS directly. Unlike GOAT's
    plan it is chosen per switch, greedily, with no view of the whole tree.
    ESA differs from ATP only by preempting another job's (or a lower
    priority fragment's) memory at runtime: with one job and sub-models in
    priority order its static placement is this one, and its dynamics are
    in the flow-level evaluator (`fanin.goat.baselines`)."""
    from .evaluate import tree_to_ps

    out = copy.deepcopy(plan)
    ps = out["parameter_server"]["name"]
    parent, _ = tree_to_ps(topo, ps)
    sizes = {int(s["id"]): float(s["size_mb"]) for s in out["submodels"]}
    by_name = {sw["name"]: sw for sw in out["switches"]}
    for sw in out["switches"]:
        sw["filters"], sw["memory_used_mb"] = [], 0.0
    filters: dict[tuple[str, int], list[str]] = {}
    direct: dict[int, list[str]] = {g: [] for g in sizes}
    for w in out["workers"]:
        nodes = []
        for g in sorted(sizes):
            node = ps
            hop = parent.get(w["name"])
            while hop is not None and hop != ps:
                sw = by_name.get(hop)
                if sw is not None and sw["memory_mb"] > 0:
                    if (hop, g) in filters:
                        node = hop
                        break
                    if sw["memory_used_mb"] + sizes[g] <= sw["memory_mb"] + 1e-9:
                        sw["memory_used_mb"] += sizes[g]
                        filters[(hop, g)] = []
                        node = hop
                        break
                hop = parent.get(hop)
            if node == ps:
                direct[g].append(w["name"])
            else:
                filters[(node, g)].append(w["name"])
            nodes.append(node)
        w["aggregation_node"] = nodes
    for (name, g), workers in sorted(filters.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        by_name[name]["filters"].append({"submodel": g, "expected_sources": len(workers), "workers": workers})
    out["parameter_server"]["expect"] = [
        {"submodel": g, "from_switches": sorted(n for (n, h) in filters if h == g), "direct_workers": direct[g],
         "expected_sources": sum(1 for (n, h) in filters if h == g) + len(direct[g])}
        for g in sorted(sizes)]
    out["ps_mb"] = sum(e["expected_sources"] * sizes[e["submodel"]] for e in out["parameter_server"]["expect"])
    out.pop("krgs", None)
    out.pop("lp", None)
    out.pop("objective", None)
    return out


@dataclass
class Deployment:
    """Installed jobs: where workers send (`targets`, with `data_addr`), and
    `remove()` (children first, then the PS)."""

    jobs: JobPlan
    #: worker -> [(target, "ip:port" of its node as the worker reaches it)]
    addrs: dict[str, list[tuple[WorkerTarget, str]]]
    installed: list[AggregatorJob] = field(default_factory=list)
    #: on-path filtering's relays, as installed
    transits: list[TransitEntry] = field(default_factory=list)
    #: job id -> its job key (docs/security.md); empty when installed with
    #: ``auth=False``. Every node of a sub-model's job holds the same key.
    _keys: dict[int, bytes] = field(default_factory=dict, repr=False)

    def member_key(self, job_id: int, rank: int) -> Optional[bytes]:
        """The member key worker `rank` seals job `job_id` with (None: unkeyed)."""
        from ..auth import derive_member_key

        key = self._keys.get(job_id)
        return None if key is None else derive_member_key(key, job_id, rank)
    _client: Callable[[str], Any] = field(default=None, repr=False)
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        """Close the control connections (the jobs stay installed)."""
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def remove(self) -> None:
        # relays first: nothing is relayed to a job that is gone; the jobs
        # go even if a relay could not be removed
        try:
            _remove_transits(self.transits, self._client)
            self.transits.clear()
        finally:
            _remove_jobs(self.installed, self._client)
            self.installed.clear()

    def install_quorums(self, participating: Iterable[int]) -> dict[tuple[str, int], int]:
        """One epoch of GOAT's asynchronous training (§V, Algorithm 2):
        install K_t^s on every aggregation node for the workers (ranks)
        `participating` this epoch. Each sub-model's job on a node then
        completes a block with the first K contributions (the switch's
        `quorum`, docs/protocol.md): on a switch, K is the number of its
        members taking part; at the PS, the switches of the job with any
        participant plus its direct participating workers. A node whose job
        has no participant gets K = 0 (every member), so a job nobody feeds
        is not completed by nobody. Returns ``{(node, job_id): K}``."""
        part = {int(r) for r in participating}
        quorums: dict[tuple[str, int], int] = {}
        active_ranks: dict[int, set[int]] = {}
        for j in self.installed:  # switches first: they decide who counts at the PS
            if j.parent is not None:
                k = sum(1 for m in j.members if m in part)
                quorums[(j.node, j.job_id)] = k
                if k:
                    active_ranks.setdefault(j.job_id, set()).add(j.rank)
        for j in self.installed:
            if j.parent is None:
                counted = part | active_ranks.get(j.job_id, set())
                quorums[(j.node, j.job_id)] = sum(1 for m in j.members if m in counted)
        # one listing per node, and an update only where K changes (the
        # controller runs this every epoch). "Every member" is written as
        # the member count on a job admitted with a quorum (`quorum_ready`):
        # K = 0 would take its partial results away for good.
        for node in sorted({node for node, _ in quorums}):
            client = self._client(node)
            specs = {s["job_id"]: s for s in client.list_jobs()}
            for (n, job_id), k in quorums.items():
                if n != node:
                    continue
                spec = specs[job_id]
                if k == 0 and spec["quorum"] != 0:
                    k = len(spec["members"])
                if spec["quorum"] != k:
                    client.update_job({**spec, "quorum": k})
        return quorums


def _remove_jobs(jobs: list[AggregatorJob], client: Callable[[str], Any]) -> list[AggregatorJob]:
    """Remove `jobs` in reverse order (switches before the PS); a job already
    gone is not an error. Returns the jobs that were removed."""
    from ..control import ControlError

    errors, removed = [], []
    for j in reversed(jobs):
        try:
            client(j.node).remove_job(j.job_id)
            removed.append(j)
        except ControlError as e:
            if e.code != "NOT_FOUND":
                errors.append(f"{j.node} job {j.job_id}: {e}")
    if errors:
        raise GoatError("removing the plan's jobs failed: " + "; ".join(errors))
    return removed


def _remove_transits(transits: list[TransitEntry], client: Callable[[str], Any]) -> None:
    """Remove on-path relays; one already gone is not an error."""
    from ..control import ControlError

    errors = []
    for t in transits:
        try:
            client(t.node).remove_transit(t.job_id)
        except ControlError as e:
            if e.code != "NOT_FOUND":
                errors.append(f"{t.node} transit {t.job_id}: {e}")
    if errors:
        raise GoatError("removing the plan's transits failed: " + "; ".join(errors))


def remove_goat_plan(plan: dict[str, Any], topo: Topology, fabric: Fabric, *, job_base: int = 100,
                     client_factory: Optional[Callable[[str], Any]] = None,
                     on_path: bool = False) -> list[AggregatorJob]:
    """Remove what :func:`install_goat_plan` admitted for `plan` (e.g. from
    another process), with its transits when installed `on_path`; jobs
    already gone are skipped. Returns the removed jobs."""
    clients, client = _clients(fabric, client_factory)
    try:
        jp = plan_jobs(plan, topo, job_base=job_base, on_path=on_path)
        try:
            _remove_transits(jp.transits, client)
        finally:
            removed = _remove_jobs(jp.jobs, client)
        return removed
    finally:
        for c in clients.values():
            c.close()


def _clients(fabric: Fabric, factory: Optional[Callable[[str], Any]]):
    """A cache of control clients by node and the function that fills it."""
    from ..control import ControlClient

    clients: dict[str, Any] = {}
    factory = factory or (lambda addr: ControlClient(addr))

    def client(node: str):
        if node not in clients:
            clients[node] = factory(fabric.control_addr(node))
        return clients[node]

    return clients, client


def install_goat_plan(plan: dict[str, Any], topo: Topology, fabric: Fabric, *, job_base: int = 100,
                      block_cnt_max: int = 64, block_grad_max: int = 256, auth: bool = True,
                      client_factory: Optional[Callable[[str], Any]] = None,
                      quorum_ready: bool = False, on_path: bool = False) -> Deployment:
    """Admit `plan`'s jobs on the PS's host aggregator and the switches.

    `fabric` says where nodes are, as for the controller
    (``fanin.controller.fabric``): ``control_addr(node)`` for switches and
    the PS alike, ``data_addr(node, toward=source)`` the ``ip:port`` at
    which `source` reaches `node`'s data plane (on the testbed,
    ``TestbedFabric``; workers or the PS two hops away need the testbed's
    routing). Every job gets
    ``workers`` = the plan's worker count (block floating point is scaled for
    all of them). With `auth` (the default) each sub-model's job gets a
    fresh job key on every node that holds it, and workers seal with
    ``Deployment.member_key(job_id, rank)`` (docs/security.md). On a failure
    the jobs admitted so far are removed again.

    `quorum_ready`: admit every job with a quorum of all its members, so
    its workers join accepting results of fewer (docs/protocol.md §4.15)
    and `Deployment.install_quorums` can set GOAT-Async's K_t^s later; a
    job admitted without one refuses a quorum while it runs.

    `on_path`: GOAT's on-path filtering (:func:`on_path_transits`): workers
    send every sub-model to their first-hop switch and the plan switches on
    the way relay it. Needs ``auth=False``: a keyed job's results are sealed
    for each member, so a relay, which holds no key, cannot fan them out.
    Every switch on a path must run as many shards as the PS daemon.
    """
    from ..auth import new_job_key

    if on_path and auth:
        raise GoatError("on-path filtering relays results unsealed: install unkeyed jobs (auth=False; "
                        "--no-auth on the command line): a keyed job's results are sealed per member, and a "
                        "relay holds no key")
    jp = plan_jobs(plan, topo, job_base=job_base, on_path=on_path)
    clients, client = _clients(fabric, client_factory)
    keys = {j.job_id: new_job_key() for j in jp.jobs} if auth else {}
    dep = Deployment(jp, {}, _client=client, _clients=clients, _keys=keys)
    shards: dict[str, int] = {}
    try:
        for j in jp.jobs:  # roots (the PS) first: no partial reaches a parent that does not know the job
            tree = None
            if j.parent is not None:
                if j.parent not in shards:
                    shards[j.parent] = int(client(j.parent).info()["shard_count"])
                tree = {"parent_addr": fabric.data_addr(j.parent, toward=j.node), "parent_shards": shards[j.parent],
                        "rank": j.rank}
            client(j.node).admit_job(j.job_id, list(j.members), block_cnt_max=block_cnt_max,
                                     block_grad_max=block_grad_max, workers=len(jp.ranks), tree=tree,
                                     key=keys.get(j.job_id), quorum=len(j.members) if quorum_ready else 0)
            dep.installed.append(j)
        for t in jp.transits:  # before any worker sends: the whole path relays
            if t.next not in shards:
                shards[t.next] = int(client(t.next).info()["shard_count"])
            client(t.node).install_transit(t.job_id, fabric.data_addr(t.next, toward=t.node), shards[t.next],
                                           sources=t.sources)
            dep.transits.append(t)
    except Exception as failure:
        try:
            dep.remove()
        except Exception as cleanup:  # the install's own failure is the one to report
            if hasattr(failure, "add_note"):  # Python 3.11+
                failure.add_note(f"removing what was installed also failed: {cleanup}")
        finally:
            dep.close()
        raise
    dep.addrs = {w: [(t, fabric.data_addr(t.sends_to, toward=w)) for t in ts] for w, ts in jp.targets.items()}
    return dep
