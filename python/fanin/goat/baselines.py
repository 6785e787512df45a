"""The memory-sharing baselines, ATP and ESA, in the flow-level evaluator.

Both send every worker's gradient on its shortest path to the PS (the tree
of `tree_to_ps`) and aggregate in switch memory shared by hashing (§III-A):
the gradient is cut into fragments of `chunk_mb`, a programmable switch has
N = ⌊B(s) / chunk_mb⌋ memory units, and fragment i uses unit i mod N.

* ATP (§VII-A, as the paper runs it): a fragment is aggregated at the first
  switch on its path whose unit is free or already holds that fragment,
  first come first served; a fragment that finds its unit holding another
  one is forwarded unchanged toward the PS.
* ESA: the same, plus priority preemption: a fragment with higher priority
  evicts the one in its unit, whose partial aggregate is sent on toward the
  PS. ESA's priorities are per job; within one job we give the lower
  fragment index the higher priority (it is needed first by the next
  iteration), which is our reading, not ESA's text.

A unit is released when the last packet of its fragment that will ever
reach this switch has arrived (in ATP the PS's result, which follows that
packet, frees it); the aggregate then goes up. The fragment granularity is
a modelling choice: collisions depend on gradient size / memory and on the
arrival skew, not on the absolute fragment size, so `chunk_mb` = 1 keeps
the event count small (|W| · Σb / chunk per switch level).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from fanin.goat.evaluate import Metrics, Scenario

__all__ = ["evaluate_memory_sharing", "evaluate_atp", "evaluate_esa"]


def evaluate_atp(scn: Scenario, chunk_mb: float = 1.0) -> Metrics:
    return evaluate_memory_sharing(scn, "atp", chunk_mb)


def evaluate_esa(scn: Scenario, chunk_mb: float = 1.0) -> Metrics:
    return evaluate_memory_sharing(scn, "esa", chunk_mb)


def evaluate_memory_sharing(scn: Scenario, policy: str, chunk_mb: float = 1.0) -> Metrics:
    if policy not in ("atp", "esa"):
        raise ValueError(f"unknown memory-sharing policy {policy!r} (atp or esa)")
    if not (chunk_mb > 0):
        raise ValueError(f"chunk_mb {chunk_mb} must be > 0")
    total = scn.total_mb
    m = max(1, math.ceil(total / chunk_mb - 1e-9))
    sizes = np.full(m, chunk_mb)
    sizes[-1] = total - chunk_mb * (m - 1)
    ends = np.cumsum(sizes)
    topo, parent, dist = scn.topo, scn.parent, scn.dist

    # packets waiting at each node: (time s, fragment, MB, contributors)
    inbox: dict[str, list[tuple[float, int, float, int]]] = defaultdict(list)
    comm = 0.0
    for w, rate in zip(scn.workers, scn.rates_gbps):
        first = parent[w]
        hop = topo.link(w, first).distance
        times = ends * 8.0 / (rate * 1000.0)          # MB -> Mbit over Mbit/s: fragment fully sent
        inbox[first].extend(zip(times.tolist(), range(m), sizes.tolist(), [1] * m))
        comm += hop * total

    # Switches in decreasing distance from the PS: every packet a switch
    # receives comes from farther away, so its inbox is complete when its turn comes.
    order = sorted((n for n in inbox.keys() | {s.name for s in topo.switches} if n in dist and n != scn.ps),
                   key=lambda n: (-dist[n], n))
    aggregated_at = Counter()
    for node in order:
        packets = inbox.pop(node, [])
        if not packets:
            continue
        sw = topo.switch(node)
        units = int(sw.memory_mb // chunk_mb) if sw.programmable else 0
        out = _switch(packets, units, policy) if units > 0 else packets
        if units > 0:
            aggregated_at[node] = len(packets) - len(out)
        up = parent[node]
        hop = topo.link(node, up).distance
        comm += hop * sum(p[2] for p in out)
        inbox[up].extend(out)
    at_ps = inbox.pop(scn.ps, [])
    if inbox:
        raise RuntimeError(f"packets stranded at {sorted(inbox)}: the route tree is broken")
    contributors = Counter()
    for _, i, _, cnt in at_ps:
        contributors[i] += cnt
    if any(contributors[i] != len(scn.workers) for i in range(m)):
        raise RuntimeError("a fragment reached the PS with the wrong number of contributions")
    ps_mb = float(sum(p[2] for p in at_ps))
    return Metrics(policy, ps_mb, total * len(scn.workers) - ps_mb, comm,
                   {"fragments": m, "packets_at_ps": len(at_ps)})


def _switch(packets: list[tuple[float, int, float, int]], units: int, policy: str) -> list[tuple[float, int, float, int]]:
    """One programmable switch's memory units over its arrivals in time
    order; returns what it sends toward the PS."""
    packets.sort()
    remaining = Counter(i for _, i, _, _ in packets)
    occ = [-1] * units           # fragment held by each unit
    cnt = [0] * units            # contributors aggregated in it
    size = [0.0] * units
    out = []
    for t, i, mb, c in packets:
        remaining[i] -= 1
        u = i % units
        held = occ[u]
        if held == i:
            cnt[u] += c
        elif held == -1:
            occ[u], cnt[u], size[u] = i, c, mb
        elif policy == "esa" and i < held:
            out.append((t, held, size[u], cnt[u]))          # evicted partial aggregate goes on
            occ[u], cnt[u], size[u] = i, c, mb
        else:
            out.append((t, i, mb, c))                       # collision: forwarded unchanged
            continue
        if remaining[i] == 0:                               # last contribution here: release
            out.append((t, i, size[u], cnt[u]))
            occ[u] = -1
    return out
