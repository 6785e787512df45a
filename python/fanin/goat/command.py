"""`fanin plan goat`: the command-line planner. (`fanin bench goat` and `goat-deploy` are fanin_bench's.)"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["add_plan_parser", "run_plan_goat"]

DESCRIPTION = """\
Plan GOAT's gradient scheduling (Fang et al., ToN 2024, §IV): which
programmable switch aggregates which sub-model gradient for which worker, and
what the parameter server (PS) aggregates itself.

The planner solves the LP relaxation of GINA (Eq. 1: minimise MB x distance
sent by workers to their aggregation nodes plus one aggregate per used switch
to the PS, under the switch memories B(s)) with HiGHS, then runs KRGS
(Algorithm 1): k(g) = floor(sum_s x_g^s) switches per sub-model, min-max
knapsacks, randomized rounding to switches S(g), and each worker's random
choice among S(g) and the PS. A rounded plan may overrun a switch memory by
Theorem 5's factor; by default the overrun is repaired (sub-models dropped
from the full switch go to the PS) so the plan can be installed.

Input: a topology (file or generator) in which programmable switches carry
memory_mb = B(s) and one host has role "ps" (or --ps), and the sub-model
sizes b(g). Output: one JSON plan (schema fanin.goat.plan/1, docs/goat.md):
per switch its responsibility filters (sub-model, expected sources), per
worker the aggregation node of each sub-model, and what the PS expects."""

EPILOG = """\
examples:
  # the §VII-D fat tree: 80 switches (20% programmable, 64 MB), 192 servers, 221 MB in 111 sub-models
  fanin plan goat --topology fat-tree:8,6 --programmable 0.2 --memory-mb 64 --ps h0_0_0 --even 221,111
  # a real model's parameters (one sub-model per tensor, big tensors cut to <= 2 MB)
  fanin plan goat --topology leaf-spine:2,3,3 --ps h0_0 --model resnet18 --max-submodel-mb 2 --summary
  # sizes from a file: [2.0, 1.5, ...] or [{"name": "fc", "size_mb": 16.8}, ...]
  fanin plan goat --topology my-dc.toml --submodels sizes.json --out plan.json
"""


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="control-plane planners (goat: gradient scheduling across switches)",
                          description="Control-plane planners. `fanin plan goat --help` explains GOAT's.")
    psub = plan.add_subparsers(dest="planner", metavar="PLANNER")
    g = psub.add_parser("goat", help="GOAT: which switch aggregates which sub-model for which worker",
                        description=DESCRIPTION, epilog=EPILOG)
    g.add_argument("--topology", required=True,
                   help="topology file (.toml/.json, docs/topology.md) or generator: fat-tree:K[,HOSTS_PER_EDGE], "
                        "leaf-spine:SPINES,LEAVES,HOSTS_PER_LEAF, star:N, deep-tree:L[,H]")
    g.add_argument("--programmable", type=float, metavar="FRACTION",
                   help="make a seeded random FRACTION of the switches programmable, the rest not "
                        "(GOAT §VII-D: 0.2); default: as the topology says")
    g.add_argument("--memory-mb", type=float, help="B(s) of the programmable switches chosen by --programmable")
    g.add_argument("--ps", help="host that is the parameter server (default: the host with role 'ps')")
    g.add_argument("--workers", type=int, help="use a seeded random subset of N workers (default: all other hosts)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--submodels", metavar="FILE.json", help="JSON list of sizes in MB or of {name, size_mb}")
    src.add_argument("--model", help="a PyTorch model's parameter tensors (alexnet, resnet18, resnet34, or any "
                                     "torchvision name when torchvision is installed)")
    src.add_argument("--even", metavar="TOTAL_MB,PARTS", help="TOTAL_MB split into PARTS equal sub-models")
    g.add_argument("--max-submodel-mb", type=float, help="with --model: cut tensors above this size into pieces")
    g.add_argument("--seed", type=int, default=0, help="seed of the topology choices and of the rounding")
    g.add_argument("--no-repair", action="store_true", help="keep the rounded plan even where it overruns B(s)")
    g.add_argument("--out", help="write the plan JSON to this file instead of stdout")
    g.add_argument("--summary", action="store_true", help="also print a short human summary on stderr")
    g.set_defaults(func=run_plan_goat)


def _submodels(args):
    from fanin.goat.model import GoatError, submodels_even, submodels_from_json, submodels_from_torch

    if args.max_submodel_mb is not None and not args.model:
        raise GoatError("--max-submodel-mb applies to --model only")
    if args.max_submodel_mb is not None and not (args.max_submodel_mb > 0):
        raise GoatError(f"--max-submodel-mb {args.max_submodel_mb} must be > 0")
    if args.submodels:
        return submodels_from_json(args.submodels)
    if args.model:
        return submodels_from_torch(args.model, args.max_submodel_mb)
    try:
        total, parts = args.even.split(",")
        return submodels_even(float(total), int(parts))
    except ValueError:
        raise GoatError(f"--even {args.even!r}: expected TOTAL_MB,PARTS, e.g. 221,111") from None


def _unwritable(path: str) -> str | None:
    """Why the plan could not be written to `path` (checked before planning, which may take a while), or None."""
    import errno
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return os.strerror(errno.EISDIR)
    if not os.path.isdir(folder):
        return os.strerror(errno.ENOENT if not os.path.exists(folder) else errno.ENOTDIR)
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return os.strerror(errno.EACCES)
    return None


def run_plan_goat(args: argparse.Namespace) -> int:
    import numpy as np

    from fanin import topology as topo_mod
    from fanin.goat.krgs import plan
    from fanin.goat.model import GoatError, instance_from_topology
    from fanin.goat.schema import plan_to_json

    t0 = time.perf_counter()
    unwritable = _unwritable(args.out) if args.out else None
    if unwritable:
        print(f"fanin plan goat: --out {args.out}: cannot write the plan: {unwritable}", file=sys.stderr)
        return 2
    try:
        topo = topo_mod.load(args.topology)
        if args.programmable is not None:
            topo = topo_mod.with_programmable(topo, args.programmable, args.seed, args.memory_mb)
        elif args.memory_mb is not None:
            raise GoatError("--memory-mb needs --programmable (it sets B(s) of the switches that choice marks)")
        if args.ps:
            topo = topo_mod.with_ps(topo, args.ps)
        workers = None
        if args.workers is not None:
            pool = [h.name for h in topo.hosts if h.role == "worker"]
            if not 1 <= args.workers <= len(pool):
                raise GoatError(f"--workers {args.workers}: the topology has {len(pool)} worker hosts")
            rng = np.random.default_rng(args.seed)
            workers = sorted(rng.choice(pool, args.workers, replace=False).tolist())
        inst = instance_from_topology(topo, _submodels(args), workers=workers)
        if inst.alpha == 0:
            raise GoatError("the topology has no programmable switch (use --programmable FRACTION)")
        p = plan(inst, seed=args.seed, repair=not args.no_repair)
    except (GoatError, topo_mod.TopologyError) as e:
        print(f"fanin plan goat: {e}", file=sys.stderr)
        return 2
    doc = plan_to_json(p)
    doc["seconds"]["total"] = round(time.perf_counter() - t0, 4)
    text = json.dumps(doc, indent=1)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            print(f"fanin plan goat: --out {args.out}: cannot write the plan: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        print(text)
    if args.summary or args.out:
        total = inst.sizes.sum() * len(inst.workers)
        print(f"fanin plan goat: {len(inst.workers)} workers, {len(inst.submodels)} sub-models "
              f"({inst.sizes.sum():.1f} MB), {inst.alpha} programmable switches; PS receives "
              f"{doc['ps_mb']:.1f} of {total:.1f} MB; objective {doc['objective']['rounded']:.0f} MB·hop "
              f"(LP bound {doc['objective']['lp_bound']:.0f}); {len(p.repaired)} (sub-model, switch) pairs "
              f"repaired; {doc['seconds']['total']:.2f} s" + (f"; wrote {args.out}" if args.out else ""),
              file=sys.stderr)
    return 0
