"""Asynchronous training (§V): the PS aggregates the fastest K_t workers of
epoch t; Algorithm 2 searches K_t online; each switch s is told K_t^s, the
number of participating (worker, sub-model) gradients it aggregates, so it
knows when an aggregate is complete. K-SGD (a fixed K) is the baseline.

The epoch model is Algorithm 2's own: worker w needs p_w seconds from
receiving the model to delivering its gradient; an epoch ends at the K-th
earliest delivery plus H(α); a worker left out keeps working and delivers
p'_w - h_t later. The number of epochs to reach the accuracy target is
T = ψ(K_m), Eq. (36), with K_m the smallest K_t used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from fanin.goat.model import GoatError

__all__ = ["Convergence", "algorithm2", "estimate_total", "per_switch_k", "run_epochs", "compare_async"]


@dataclass(frozen=True)
class Convergence:
    """ψ(K) = 4 K² (F(x0) - F(x*))² / (n (ε K - σ²)²), Eq. (36): epochs
    needed with K participants per epoch. Needs ε K > σ²."""

    f_gap: float = 1.0
    epsilon: float = 1.0
    sigma2: float = 1.0
    n: int = 1

    def psi(self, k: int) -> float:
        margin = self.epsilon * k - self.sigma2
        if margin <= 0:
            return math.inf
        return 4.0 * k * k * self.f_gap ** 2 / (self.n * margin * margin)


def algorithm2(history: Sequence[float], conv: Convergence, rounds: Optional[int] = None,
               h_alpha: float = 0.0) -> tuple[int, float]:
    """Algorithm 2: the K minimising T · H̄, from the workers' last observed
    intervals p_w. Returns (K_{t+1}, its estimated total time)."""
    p = _intervals(history)
    best_k, best_h = len(p), math.inf
    for k in range(1, len(p) + 1):
        total = estimate_total(p, k, conv, rounds, h_alpha)
        if math.isfinite(total) and total <= best_h:          # ties go to the larger K, as in line 16
            best_k, best_h = k, total
    return best_k, best_h


def estimate_total(history: Sequence[float], k: int, conv: Convergence, rounds: Optional[int] = None,
                   h_alpha: float = 0.0) -> float:
    """Algorithm 2's estimate for one K: ψ(K) times the mean epoch time of
    M simulated epochs from the intervals p_w (inf where ψ is)."""
    p = _intervals(history)
    if not 1 <= k <= len(p):
        raise GoatError(f"K {k} is outside 1..{len(p)} workers")
    est = p.copy()
    hs = []
    for _ in range(rounds or len(p)):                  # "we can set M as the number of workers"
        h_t = float(np.partition(est, k - 1)[k - 1])          # K-th fastest estimated interval
        late = est > h_t
        est = np.where(late, est - h_t, p)                      # stragglers keep working; the others restart
        hs.append(h_t + h_alpha)
    return conv.psi(k) * (sum(hs) / len(hs))


def _intervals(history: Sequence[float]) -> np.ndarray:
    p = np.asarray(history, dtype=float)
    if p.ndim != 1 or len(p) == 0 or np.any(~(p > 0)):
        raise GoatError("Algorithm 2 needs one positive history interval per worker")
    return p


def per_switch_k(node: np.ndarray, participating: Sequence[int], alpha: int) -> dict[int, int]:
    """K_t^s = Σ_w Σ_g y_{w,g}^s z_w^t for every aggregation node (α included)."""
    counts: dict[int, int] = {}
    for w in participating:
        for s in node[w].tolist():
            counts[s] = counts.get(s, 0) + 1
    return counts


def run_epochs(base: np.ndarray, choose_k: Callable[[np.ndarray], int], conv: Convergence,
               rng: np.random.Generator, h_alpha: float = 0.0, jitter: float = 0.1,
               max_epochs: int = 10_000, on_epoch: Optional[Callable[[np.ndarray], None]] = None,
               discard_stragglers: bool = False) -> dict:
    """Simulate epochs until T = ψ(K_m) epochs are done. `base[w]` is worker
    w's mean interval; each new interval is base · (1 + jitter · N(0,1)),
    at least 10% of base. `choose_k(history)` picks K_t. With
    `discard_stragglers` (K-SGD), workers left out drop their work and
    restart on the new model; otherwise (GOAT-Async, Algorithm 2's model)
    they keep working and deliver later."""
    n = len(base)

    def draw() -> np.ndarray:
        return base * np.maximum(0.1, 1.0 + jitter * rng.standard_normal(n))

    interval = draw()                  # the interval each worker is working through now
    remaining = interval.copy()
    history = interval.copy()          # p_w: the last interval observed at the PS
    elapsed, epochs, k_min, ks = 0.0, 0, n, []
    while True:
        k = int(choose_k(history))
        if not 1 <= k <= n:
            raise GoatError(f"K_t = {k} outside 1..{n}")
        k_min = min(k_min, k)
        h_t = float(np.partition(remaining, k - 1)[k - 1])
        joined = remaining <= h_t
        if on_epoch is not None:
            on_epoch(np.flatnonzero(joined))
        elapsed += h_t + h_alpha
        epochs += 1
        ks.append(k)
        fresh = draw()
        history = np.where(joined, interval, history)
        interval = np.where(joined, fresh, interval)
        if discard_stragglers:
            interval = fresh
            remaining = fresh.copy()
        else:
            remaining = np.where(joined, fresh, remaining - h_t)    # stragglers keep working
        target = conv.psi(k_min)
        if epochs >= target or epochs >= max_epochs:
            break
    return {"epochs": epochs, "time_s": elapsed, "k_min": k_min, "k_mean": float(np.mean(ks)),
            "converged": bool(epochs >= conv.psi(k_min))}


def compare_async(base: np.ndarray, conv: Convergence, seed: int = 0, h_alpha: float = 0.0,
                  ksgd: Sequence[int] = (), node: Optional[np.ndarray] = None, node_names: Sequence[str] = (),
                  record_epochs: int = 3) -> dict:
    """GOAT-Async (Algorithm 2 each epoch) vs K-SGD for each fixed K in
    `ksgd` (stragglers' work discarded each epoch, as K-SGD does) vs
    synchronous training (K = |W|), same seed for every arm. With a
    plan's `node` matrix (|W| x |G|, last node = α), GOAT-Async's result also
    lists K_t^s for the first `record_epochs` epochs: what the PS publishes
    to each switch."""
    n = len(base)
    arms = {"goat_async": lambda h: algorithm2(h, conv, h_alpha=h_alpha)[0], "sync": lambda h: n}
    for k in ksgd:
        arms[f"ksgd_{k}"] = (lambda kk: (lambda h: kk))(k)
    out = {}
    for name, fn in arms.items():
        published: list[dict] = []

        def record(joined: np.ndarray) -> None:
            if node is not None and name == "goat_async" and len(published) < record_epochs:
                counts = per_switch_k(node, joined, len(node_names) - 1)
                published.append({node_names[s]: c for s, c in sorted(counts.items())})

        out[name] = run_epochs(base, fn, conv, np.random.default_rng(seed), h_alpha=h_alpha, on_epoch=record,
                               discard_stragglers=name.startswith("ksgd_"))
        if published:
            out[name]["k_t_s_first_epochs"] = published
    return out
