"""Step 1 of KRGS (Algorithm 1): the LP relaxation of GINA, Eq. (1), solved
with HiGHS through scipy.optimize.linprog.

    min  Σ_g ( Σ_w Σ_{s∈S∪{α}} y_{w,g}^s D_w(s) + Σ_{s∈S} x_g^s D_s(α) ) b(g)
    s.t. Σ_s y_{w,g}^s = 1                 ∀ w, g
         y_{w,g}^s ≤ x_g^s                  ∀ w, g, s ∈ S
         Σ_g x_g^s b(g) ≤ B(s)              ∀ s ∈ S
         0 ≤ x, y ≤ 1

x_g^α has no cost and no capacity, so it is 1 in some optimum and is left
out: the PS can always aggregate (that is what makes Σ_s x_g^s ≥ 1 hold).

Two reductions keep the LP small without changing its optimum:
* Workers with equal distance rows (same edge switch) are interchangeable:
  averaging an optimal solution over them is feasible and optimal (the LP
  is convex and symmetric), so one y per class with the class size as
  weight has the same optimum, and ỹ_{w,g} = ỹ_{class(w),g}.
* y_{c,g}^s with D_c(s) ≥ D_c(α) is never needed: moving that mass to α
  costs no more and relaxes no constraint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fanin.goat.model import GoatError, Instance

__all__ = ["Fractional", "solve_lp"]


@dataclass
class Fractional:
    """The LP optimum {x̃_g^s, ỹ_{w,g}^s}."""

    x: np.ndarray          # x̃_g^s, shape |G| x |S|
    y_class: np.ndarray    # ỹ per worker class, shape |C| x |G| x (|S|+1)
    worker_class: np.ndarray
    objective: float       # the LP value of Eq. (1), MB·distance
    seconds: float
    variables: int
    constraints: int

    def y(self, w: int) -> np.ndarray:
        """ỹ_{w,g}^s for worker index w, shape |G| x (|S|+1)."""
        return self.y_class[self.worker_class[w]]


def solve_lp(inst: Instance) -> Fractional:
    # scipy is imported here, not at the top: `fanin --help` imports fanin.goat (for `fanin plan goat`'s
    # parser) and must not load scipy; model.py defers its scipy import for the same reason.
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    wclass, mult = inst.worker_classes()
    ncls = len(mult)
    # one representative distance row per class
    rep = np.zeros((ncls, inst.alpha + 1))
    rep[wclass] = inst.dist_ws
    nS, nG = inst.alpha, len(inst.submodels)
    b = inst.sizes

    useful = rep[:, :nS] < rep[:, [nS]]                                 # C x S
    # variable layout: x[g, s] first, then the kept y[c, g, s] (s ∈ S), then y[c, g, α]
    nx = nG * nS
    cs = np.argwhere(useful)                                            # K x 2 (c, s)
    K = len(cs)
    g_of = np.repeat(np.arange(nG), K)                                  # y[c,g,s] ordered g-major
    c_of = np.tile(cs[:, 0], nG)
    s_of = np.tile(cs[:, 1], nG)
    ny_sw = nG * K
    y_sw = nx + np.arange(ny_sw)
    y_alpha = nx + ny_sw + np.arange(nG * ncls).reshape(nG, ncls)      # y[c,g,α] at [g, c]
    nvar = nx + ny_sw + nG * ncls

    cost = np.empty(nvar)
    cost[:nx] = (b[:, None] * inst.dist_sa[None, :]).reshape(-1)
    cost[y_sw] = mult[c_of] * b[g_of] * rep[c_of, s_of]
    cost[y_alpha] = (b[:, None] * (mult * rep[:, nS])[None, :])

    # Σ_s y = 1 per (c, g)
    eq_row_sw = g_of * ncls + c_of
    eq_rows = np.concatenate([eq_row_sw, np.arange(nG * ncls)])
    eq_cols = np.concatenate([y_sw, y_alpha.reshape(-1)])
    A_eq = coo_matrix((np.ones(len(eq_rows)), (eq_rows, eq_cols)), shape=(nG * ncls, nvar)).tocsr()
    b_eq = np.ones(nG * ncls)

    # y[c,g,s] - x[g,s] ≤ 0, then memory rows
    r = np.arange(ny_sw)
    mem_rows = ny_sw + np.repeat(np.arange(nS)[None, :], nG, axis=0).reshape(-1)
    ub_rows = np.concatenate([r, r, mem_rows])
    ub_cols = np.concatenate([y_sw, g_of * nS + s_of, np.arange(nx)])
    ub_vals = np.concatenate([np.ones(ny_sw), -np.ones(ny_sw), np.repeat(b, nS)])
    A_ub = coo_matrix((ub_vals, (ub_rows, ub_cols)), shape=(ny_sw + nS, nvar)).tocsr()
    b_ub = np.concatenate([np.zeros(ny_sw), inst.memory_mb])

    res = linprog(cost, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0.0, 1.0), method="highs")
    if res.status != 0:
        raise GoatError(f"the GINA LP relaxation did not solve: {res.message}")
    v = np.clip(res.x, 0.0, 1.0)
    x = v[:nx].reshape(nG, nS)
    y = np.zeros((ncls, nG, nS + 1))
    y[c_of, g_of, s_of] = v[y_sw]
    y[:, :, nS] = v[y_alpha].T
    return Fractional(x=x, y_class=y, worker_class=wclass, objective=float(res.fun),
                      seconds=time.perf_counter() - t0, variables=nvar, constraints=A_ub.shape[0] + A_eq.shape[0])
