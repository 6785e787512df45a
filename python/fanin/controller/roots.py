"""A root spread over several switches, weighted by what the network leaves
them (docs/simulator.md, "Weighted roots").

An aggregation tree sends each child's whole stream to the root. A root
spread over several switches (a leaf-spine's spines, `root_shards`) splits
the blocks between them the way a switch daemon splits them between its
shards: block b belongs to shard `shard_of(job, b, slots, R)`. Listing a
switch k times gives it k of the R shards, so k/R of the blocks; that is
how the controller weighs the roots without any change to the protocol.

Weighing by spare capacity: the controller reads every switch's port
counters over a short window before it places the job (other tenants'
traffic), and gives each candidate root a share in proportion to the
smallest spare fraction on its links to and from the root's children, since
a root runs at the pace of its most loaded link and a synchronised allreduce
at the pace of its slowest root. A switch with no spare capacity gets no
share.
"""

from __future__ import annotations

from math import gcd, isfinite
from typing import Iterable, Mapping

__all__ = ["spare_capacity", "weigh_root_shards"]


def spare_capacity(candidates: Iterable[str], children: Iterable[str],
                   load: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """Per candidate root: the smallest spare fraction (1 - load, at least 0)
    of the links between it and each of the root's children, both ways.
    `load[(a, b)]` is the fraction of the a -> b link's rate that other
    traffic used; a link missing from `load` is idle."""
    children = list(children)
    spare = {}
    for c in candidates:
        used = [load.get(pair, 0.0) for child in children for pair in ((c, child), (child, c))]
        bad = [u for u in used if not (isfinite(u) and u >= 0.0)]
        if bad:
            raise ValueError(f"spare_capacity: a load of {c}'s links is {bad[0]!r}, not a fraction of the link rate")
        spare[c] = max(0.0, 1.0 - max(used, default=0.0))
    return spare


def weigh_root_shards(candidates: list[str], spare: Mapping[str, float], units_per_switch: int = 4) -> list[str]:
    """The root's shards, each switch listed as often as its share.

    `candidates` in the controller's order (the tree's root first); `spare`
    from `spare_capacity`. With `units_per_switch` u, the R = u x
    len(candidates) shards are split as nearly in proportion to the spare
    capacity as whole shards allow (the split whose largest share / spare is
    smallest), reduced by their common divisor, and interleaved (smooth
    weighted round robin) so that consecutive blocks go to different
    switches; the first entry has the largest share. When every candidate
    has the same spare capacity, or none has any, the candidates are
    returned unchanged (one shard each)."""
    if not candidates:
        raise ValueError("weigh_root_shards: no candidate switches")
    if units_per_switch < 1:
        raise ValueError(f"weigh_root_shards: units_per_switch must be at least 1, not {units_per_switch}")
    missing = [c for c in candidates if c not in spare]
    if missing:
        raise ValueError(f"weigh_root_shards: no spare capacity given for {', '.join(missing)}")
    bad = [c for c in candidates if not isfinite(float(spare[c]))]
    if bad:
        raise ValueError(f"weigh_root_shards: the spare capacity of {bad[0]} is {spare[bad[0]]!r}, not a number")
    values = [max(0.0, float(spare[c])) for c in candidates]
    if max(values) <= 0.0 or max(values) - min(values) <= 1e-9 * max(values):
        return list(candidates)
    # Each shard goes to the switch whose share would then load it least
    # (smallest (share + 1) / spare, ties to the earlier): this minimises the
    # largest share / spare, the slowest root's pace, over whole shards. A
    # proportional split rounded by largest remainders does not: it may hand
    # a nearly full switch a shard its 2 % of spare capacity cannot carry.
    share = [0] * len(candidates)
    for _ in range(units_per_switch * len(candidates)):
        pick = min((i for i in range(len(candidates)) if values[i] > 0.0),
                   key=lambda i: ((share[i] + 1) / values[i], i))
        share[pick] += 1
    divisor = 0
    for s in share:
        divisor = gcd(divisor, s)
    share = [s // divisor for s in share]
    # smooth weighted round robin: the largest share first, then spread
    current = [0] * len(candidates)
    order = []
    for _ in range(sum(share)):
        for i, s in enumerate(share):
            current[i] += s
        pick = max(range(len(candidates)), key=lambda i: (current[i], -i))
        current[pick] -= sum(share)
        order.append(candidates[pick])
    return order
