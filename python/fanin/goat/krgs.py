"""Steps 2 and 3 of KRGS (Algorithm 1): knapsack-based randomized rounding
of the LP optimum to a gradient-scheduling plan, and the plan's checks
(Theorems 1, 2 and 5).

Two places where the paper's text does not pin the algorithm down, and what
this module does:
* "Put x̃_g^s into k(g) knapsacks with min-max sum" (line 7): min-max
  partition is NP-hard; we use LPT (largest value first into the lightest
  knapsack), the classic 4/3-approximation, exact for the ≤ 2 values per
  knapsack that most instances have.
* Line 19 sets p_n(s) = ỹ_{w,g}^s / x̃_g^s for s ∈ S(g) and p_n(α) = 1 - Σ.
  When k(g) ≥ 2 that sum can exceed 1 (each term is ≤ 1), which would make
  p_n(α) negative; we then scale the switch probabilities to sum to 1 and
  give α probability 0, so Theorem 2 (exactly one aggregation node) holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fanin.goat.lp import Fractional, solve_lp
from fanin.goat.model import Instance

__all__ = [
    "Plan",
    "k_of",
    "minmax_knapsacks",
    "round_switches",
    "choose_nodes",
    "krgs",
    "plan",
    "theorem5_factor",
    "repair_memory",
]

# LP solutions are exact only to the solver's tolerance: Σ x̃ = 0.9999999
# must count as 1 switch, x̃ = 1e-12 as none.
EPS = 1e-7


@dataclass
class Plan:
    """A rounded GOAT plan. `node[w, g]` is worker w's aggregation node for
    sub-model g: a switch index, or `inst.alpha` for the PS."""

    inst: Instance
    node: np.ndarray                       # |W| x |G| ints
    responsible: list[list[int]]           # S(g)
    k: list[int]                           # k(g)
    knapsacks: list[list[list[int]]]       # per g, the switches in each knapsack
    lp: Optional[Fractional] = None
    seconds: dict = field(default_factory=dict)
    repaired: list[tuple[int, int]] = field(default_factory=list)   # (g, s) dropped by repair_memory
    overrun_before_repair: float = 0.0                              # max_s used/B(s) as rounded

    def memory_used(self) -> np.ndarray:
        """Σ_g x̂_g^s b(g) per switch (MB)."""
        used = np.zeros(self.inst.alpha)
        b = self.inst.sizes
        for g, ss in enumerate(self.responsible):
            for s in ss:
                used[s] += b[g]
        return used

    def overrun(self) -> np.ndarray:
        """memory used / B(s) per switch (inf where B(s) = 0 and used > 0)."""
        used = self.memory_used()
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(self.inst.memory_mb > 0, used / np.where(self.inst.memory_mb > 0, self.inst.memory_mb, 1),
                         np.where(used > 0, np.inf, 0.0))
        return r

    def objective(self) -> float:
        """Eq. (1) of the rounded plan: worker-to-node traffic plus one
        aggregate per used switch to the PS (MB·distance)."""
        inst, b = self.inst, self.inst.sizes
        w_idx = np.arange(len(inst.workers))[:, None]
        total = float((inst.dist_ws[w_idx, self.node] * b[None, :]).sum())
        for g in range(len(b)):
            used = set(self.node[:, g].tolist()) - {inst.alpha}
            total += sum(inst.dist_sa[s] * b[g] for s in used)
        return total


def k_of(x_g: np.ndarray) -> int:
    """k(g) = ⌊Σ_{s∈S} x̃_g^s⌋ (line 6)."""
    return int(math.floor(float(np.sum(x_g)) + EPS))


def minmax_knapsacks(values: dict[int, float], k: int) -> list[list[int]]:
    """Partition the keys of `values` (switch -> x̃_g^s > 0) into k knapsacks
    with small maximum sum (LPT; line 7). Ties break on the switch index so
    the result is deterministic."""
    if k <= 0:
        return []
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0.0] * k
    for s in sorted(values, key=lambda s: (-values[s], s)):
        a = min(range(k), key=lambda i: (loads[i], i))
        bins[a].append(s)
        loads[a] += values[s]
    return bins


def round_switches(x: np.ndarray, rng: np.random.Generator) -> tuple[list[list[int]], list[int], list[list[list[int]]]]:
    """Step 2: S(g), k(g) and the knapsacks for every sub-model."""
    responsible, ks, sacks = [], [], []
    for g in range(x.shape[0]):
        values = {s: float(v) for s, v in enumerate(x[g]) if v > EPS}
        # each x̃ ≤ 1, so k(g) ≤ the number of non-zero x̃; min() only guards the solver's tolerance
        k = min(k_of(x[g]), len(values))
        bins = minmax_knapsacks(values, k)
        chosen = []
        for members in bins:
            p = np.array([values[s] for s in members])
            chosen.append(members[int(rng.choice(len(members), p=p / p.sum()))])    # prob x̃ / S_a (line 11)
        responsible.append(sorted(chosen))
        ks.append(k)
        sacks.append(bins)
    return responsible, ks, sacks


def choose_nodes(inst: Instance, frac: Fractional, responsible: list[list[int]],
                 rng: np.random.Generator) -> np.ndarray:
    """Step 3: each worker's aggregation node per sub-model (lines 17-22)."""
    nW, nG = len(inst.workers), len(inst.submodels)
    node = np.full((nW, nG), inst.alpha, dtype=np.int64)
    for g, ss in enumerate(responsible):
        if not ss:
            continue                       # no switch holds g: every worker sends it to the PS
        ss_arr = np.array(ss)
        xg = frac.x[g, ss_arr]
        for c in range(frac.y_class.shape[0]):
            members = np.flatnonzero(frac.worker_class == c)
            p = np.where(xg > EPS, frac.y_class[c, g, ss_arr] / np.maximum(xg, EPS), 0.0)
            p = np.clip(p, 0.0, 1.0)
            total = p.sum()
            if total > 1.0:
                p = p / total
                total = 1.0
            probs = np.append(p, max(0.0, 1.0 - total))
            probs = probs / probs.sum()
            picks = rng.choice(len(probs), size=len(members), p=probs)
            targets = np.append(ss_arr, inst.alpha)
            node[members, g] = targets[picks]
    return node


def krgs(inst: Instance, frac: Fractional, seed: int = 0) -> Plan:
    """Steps 2 and 3 of Algorithm 1 on an LP optimum."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    responsible, ks, sacks = round_switches(frac.x, rng)
    node = choose_nodes(inst, frac, responsible, rng)
    return Plan(inst, node, responsible, ks, sacks, lp=frac,
                seconds={"lp": frac.seconds, "rounding": time.perf_counter() - t0})


def plan(inst: Instance, seed: int = 0, repair: bool = True) -> Plan:
    """LP relaxation + KRGS, then (by default) `repair_memory`."""
    p = krgs(inst, solve_lp(inst), seed)
    p.overrun_before_repair = float(p.overrun().max()) if inst.alpha else 0.0
    if repair:
        t0 = time.perf_counter()
        repair_memory(p)
        p.seconds["repair"] = time.perf_counter() - t0
    return p


def theorem5_factor(inst: Instance) -> float:
    """The memory factor 2(1 + ϱ) of Theorem 5 with ϱ from Eq. (17),
    ν = min_g 2 B_min / b(g); a rounded plan exceeds it on a switch with
    probability at most 1/|S| (Eq. 16)."""
    nS = inst.alpha
    if nS == 0:
        return 1.0
    bmin = float(inst.memory_mb.min())
    nu = 2.0 * bmin / float(inst.sizes.max())
    if nu <= 0:
        return math.inf
    log_s = math.log(max(nS, 2))
    rho = (log_s + math.sqrt(log_s ** 2 + 8.0 * nu * log_s)) / (2.0 * nu)
    return 2.0 * (1.0 + rho)


def repair_memory(p: Plan) -> None:
    """Make the rounded plan fit B(s): Theorem 5 only bounds the overrun, and
    a switch cannot hold more than its memory. On an overfull switch, drop
    the sub-models that save least traffic per MB until it fits; their
    workers send to the PS instead. Recorded in `p.repaired`."""
    inst, b = p.inst, p.inst.sizes
    used = p.memory_used()
    for s in np.flatnonzero(used > inst.memory_mb + EPS):
        held = [g for g, ss in enumerate(p.responsible) if s in ss]

        def saving(g: int) -> float:
            ws = np.flatnonzero(p.node[:, g] == s)
            return float((inst.dist_ws[ws, inst.alpha] - inst.dist_ws[ws, s]).sum() - inst.dist_sa[s]) if len(ws) else 0.0

        for g in sorted(held, key=lambda g: (saving(g), -b[g], g)):
            if used[s] <= inst.memory_mb[s] + EPS:
                break
            p.responsible[g].remove(s)
            p.node[p.node[:, g] == s, g] = inst.alpha
            used[s] -= b[g]
            p.repaired.append((g, int(s)))
