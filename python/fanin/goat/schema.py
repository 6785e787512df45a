"""The plan as JSON (schema `fanin.goat.plan/1`, documented in docs/goat.md):
what each switch's responsibility filter must match, what each worker
labels its fragments with, and what the PS completes."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from fanin.goat.krgs import Plan, theorem5_factor

__all__ = ["SCHEMA", "plan_to_json"]

SCHEMA = "fanin.goat.plan/1"


def plan_to_json(p: Plan) -> dict:
    inst = p.inst
    b = inst.sizes
    nS = inst.alpha
    senders: dict[tuple[int, int], list[str]] = defaultdict(list)      # (node, g) -> workers
    for w, name in enumerate(inst.workers):
        for g, j in enumerate(p.node[w].tolist()):
            senders[(j, g)].append(name)
    used = p.memory_used()
    switches = []
    for s, name in enumerate(inst.switches):
        filters = [{"submodel": g, "expected_sources": len(senders[(s, g)]), "workers": senders[(s, g)]}
                   for g in range(len(b)) if s in p.responsible[g]]
        switches.append({"name": name, "memory_mb": float(inst.memory_mb[s]), "memory_used_mb": float(used[s]),
                         "filters": filters})
    ps_expect = []
    for g in range(len(b)):
        from_switches = [inst.switches[s] for s in p.responsible[g] if senders[(s, g)]]
        ps_expect.append({"submodel": g, "from_switches": from_switches, "direct_workers": senders[(nS, g)],
                          "expected_sources": len(from_switches) + len(senders[(nS, g)])})
    lp = p.lp
    return {
        "schema": SCHEMA,
        "topology": inst.topology,
        "parameter_server": {"name": inst.ps, "expect": ps_expect},
        "submodels": [{"id": g, "name": sm.name, "size_mb": sm.size_mb} for g, sm in enumerate(inst.submodels)],
        "switches": switches,
        "workers": [{"name": name, "aggregation_node": [inst.node_name(j) for j in p.node[w].tolist()]}
                    for w, name in enumerate(inst.workers)],
        "krgs": {
            "k": p.k,
            "responsible": [[inst.switches[s] for s in ss] for ss in p.responsible],
            "repaired": [{"submodel": g, "switch": inst.switches[s]} for g, s in p.repaired],
            "memory_overrun_before_repair": p.overrun_before_repair,
            "theorem5_factor": theorem5_factor(inst),
        },
        "lp": None if lp is None else {"objective": lp.objective, "variables": lp.variables,
                                       "constraints": lp.constraints},
        "objective": {"rounded": p.objective(), "lp_bound": None if lp is None else lp.objective},
        "seconds": {k: round(v, 4) for k, v in p.seconds.items()},
        "ps_mb": float(sum(b[g] * e["expected_sources"] for g, e in enumerate(ps_expect))),
    }
