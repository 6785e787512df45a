"""GOAT (Fang et al., ToN 2024): gradient scheduling with collaborative
in-network aggregation. The planner (LP relaxation of GINA + KRGS), the
asynchronous extension (Algorithm 2, K_t and K_t^s), the baselines
(Geryon, ATP, ESA, K-SGD) and one flow-level evaluator for all of them.
See docs/goat.md.

    from fanin import topology
    from fanin.goat import instance_from_topology, submodels_even, plan, plan_to_json
    topo = topology.with_ps(topology.with_programmable(topology.load("fat-tree:4"), 0.2, seed=1), "h0_0_0")
    doc = plan_to_json(plan(instance_from_topology(topo, submodels_even(221, 111)), seed=1))
"""

from fanin.goat.krgs import Plan, krgs, plan, theorem5_factor
from fanin.goat.lp import Fractional, solve_lp
from fanin.goat.model import GoatError, Instance, SubModel, instance_from_topology, submodels_even, \
    submodels_from_json, submodels_from_torch
from fanin.goat.schema import plan_to_json

__all__ = [
    "Fractional",
    "GoatError",
    "Instance",
    "Plan",
    "SubModel",
    "instance_from_topology",
    "krgs",
    "plan",
    "plan_to_json",
    "solve_lp",
    "submodels_even",
    "submodels_from_json",
    "submodels_from_torch",
    "theorem5_factor",
]
