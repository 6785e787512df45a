"""`fanin sim goat`: one point of GOAT's flow-level study (`fanin bench
goat`) validated at packet level in the simulator.

The instance is a point of the study, drawn by the study's own code
(`fanin_bench.bench.goat._scenario`: leaf-spine 10 + 10 switches, 20% of them
programmable with 64 MB, the PS and the workers drawn by seed, rates
ratio x 10 Gbit/s); the plan is `fanin.goat.krgs.plan` on it, and the
baseline Geryon (no aggregation) is the deployment's `ps_only_plan` of it.
Both plans go through the deployment's translation (`fanin.goat.deploy.
plan_jobs`: the PS a host aggregator, root of one job per sub-model; each
responsibility filter a switch job whose parent is the PS) into a spec that
`fanin-sim goat` runs with fanin-proto's machines, sub-model sizes scaled
by --bytes-per-mb. Every worker's result of every sub-model is checked.

The flow-level evaluator (`fanin.goat.evaluate`) is run on the identical
instance with the simulated sizes (4 bytes x the elements of each
sub-model); the packet-level run measures the same three metrics from
the links: contribution bytes into the PS, contribution bytes x link
distance over every link, and the workers' contribution bytes minus the
PS's (the in-network aggregation amount, as the paper defines it). The
flow model counts payload; packets add a fanin header and Ethernet/IP/UDP
to each of ceil(elements / elems-per-packet) packets per copy of a
sub-model. That factor is computed per sub-model and applied to the
flow-level prediction; the validation passes when the measurement matches
it within --tolerance (the only other source of contribution bytes is
retransmission, which a loss-free run should not have) and GOAT's ordering
against Geryon is the same at both levels. ATP and ESA are reported from
the flow-level evaluator only: fanin-proto has no memory-sharing (hashing,
first come first served) switch program to run them with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

from fanin._cli_util import Parser
from fanin_bench.sim import out_of_range

__all__ = ["build_spec", "flow_metrics", "packet_metrics", "main"]

METRICS = ("ps", "comm", "ina")
# metric -> True when lower is better
LOWER_IS_BETTER = {"ps": True, "comm": True, "ina": False}


def sizes_elements(plan: dict[str, Any], bytes_per_mb: float) -> list[int]:
    """int32 elements of each sub-model at --bytes-per-mb (as goat-deploy scales them)."""
    return [max(1, round(s["size_mb"] * bytes_per_mb / 4)) for s in plan["submodels"]]


def build_spec(topo, plan: dict[str, Any], elements: list[int], *, job_base: int = 100) -> dict[str, Any]:
    """The simulator's input: nodes, links, worker hosts in rank order, the
    PS, and per sub-model the deployment's jobs (`plan_jobs`) and each
    worker's aggregation node."""
    from fanin.goat.deploy import plan_jobs

    jp = plan_jobs(plan, topo, job_base=job_base)
    names = [h.name for h in topo.hosts] + [s.name for s in topo.switches]
    index = {n: i for i, n in enumerate(names)}
    workers = sorted(jp.ranks, key=jp.ranks.get)
    jobs = []
    for g, e in enumerate(elements):
        aggs = [{"node": index[j.node], "parent": None if j.parent is None else index[j.parent], "rank": j.rank,
                 "members": list(j.members)} for j in jp.jobs if j.submodel == g]
        jobs.append({"job_id": job_base + g, "elements": e, "aggregators": aggs,
                     "targets": [index[jp.targets[w][g].node] for w in workers]})
    return {
        "name": topo.name,
        "nodes": [{"name": n, "switch": topo.is_switch(n)} for n in names],
        "links": [[index[link.a], index[link.b]] for link in topo.links],
        "workers": [index[w] for w in workers],
        "ps": index[jp.ps],
        "jobs": jobs,
    }


def wire_bytes(elements: int, epp: int, overhead: int) -> int:
    """Bytes on a link of one copy of a sub-model: its payload plus
    `overhead` (fanin header + Ethernet/IP/UDP) per packet."""
    return math.ceil(elements / epp) * overhead + 4 * elements


def flow_metrics(scn, plan, sizes_bytes: list[float]) -> dict[str, dict[str, float]]:
    """GOAT's plan and Geryon in the flow-level evaluator on `scn` with
    sub-model g of `sizes_bytes[g]` bytes; results in bytes."""
    from fanin.goat.evaluate import evaluate_geryon, evaluate_plan
    from fanin.goat.model import SubModel

    subs = [SubModel(s.name, b / 1e6) for s, b in zip(scn.submodels, sizes_bytes)]
    s2 = dataclasses.replace(scn, submodels=subs)
    p2 = dataclasses.replace(plan, inst=dataclasses.replace(plan.inst, submodels=subs, _classes=None))
    out = {}
    for m in (evaluate_plan(s2, p2), evaluate_geryon(s2)):
        out[m.scheme] = {"ps": m.ps_mb * 1e6, "comm": m.comm_mb * 1e6, "ina": m.ina_mb * 1e6}
    return out


def packet_metrics(topo, result: dict[str, Any]) -> dict[str, float]:
    """The three metrics from the simulator's per-link, per-class counts:
    contribution bytes (first sends and retransmissions; results and the
    join handshake excluded) into the PS, x link distance over every link,
    and the workers' contribution bytes minus the PS's."""
    per_chan = [c[0] + c[1] for c in result["class_bytes"]]
    comm = sum((per_chan[2 * i] + per_chan[2 * i + 1]) * link.distance for i, link in enumerate(topo.links))
    ps = result["ps_contribution_bytes"]
    return {"ps": float(ps), "comm": float(comm), "ina": float(result["worker_contribution_bytes"] - ps)}


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="fanin sim goat", description=__doc__,
                                epilog="The study point: `fanin bench goat` draws the same instance for "
                                       "(--topology, --workers, --sigma, --seed). See docs/goat.md.")
    p.add_argument("--topology", default="leaf-spine:10,10,5",
                   help="generator spec, as in the study (default %(default)s: GOAT's leaf-spine)")
    p.add_argument("--workers", type=int, help="workers (default 15, a point of the study's sweep; 5 with --quick)")
    p.add_argument("--sigma", type=float, default=0.2, help="sigma of the rate ratio (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gradient-mb", type=float, default=221.0, help="gradient per worker in the plan (default %(default)s)")
    p.add_argument("--submodels", type=int, default=111, help="equal sub-models (default %(default)s, as the study)")
    p.add_argument("--bytes-per-mb", type=float,
                   help="simulated bytes per planned MB (default 65536: 221 MB -> 14.5 MB per worker; 4096 with "
                        "--quick)")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=32, help="blocks in flight per session (default %(default)s)")
    p.add_argument("--loss", type=float, default=0.0,
                   help="independent loss on every link (default 0; retransmissions then add contribution bytes "
                        "that the flow model does not have, and the validation fails when they exceed --tolerance)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="ATP/ESA fragment in the flow-level model")
    p.add_argument("--tolerance", type=float, default=0.001,
                   help="largest |measured / (flow x packetisation) - 1| (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="5 workers, 4096 bytes per MB (a few seconds), unless --workers or --bytes-per-mb says "
                        "otherwise")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--out", default="out/sim", help="spec and raw output (default %(default)s)")
    return p


def _run_sim(binary: str, spec: dict, path: str, args) -> dict:
    with open(path, "w") as f:
        json.dump(spec, f)
    argv = [binary, "goat", "--spec", path, "--json", "--elems-per-packet", str(args.elems_per_packet),
            "--window", str(args.window), "--seed", str(args.seed), "--loss", str(args.loss)]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fanin-sim goat failed (exit {proc.returncode}) on {path}")
    return json.loads(proc.stdout)


def run(binary: str, args) -> dict[str, Any]:
    from fanin.goat.baselines import evaluate_atp, evaluate_esa
    from fanin.goat.deploy import ps_only_plan
    from fanin.goat.krgs import plan as make_plan
    from fanin.goat.model import submodels_even
    from fanin.goat.schema import plan_to_json
    from fanin_bench.bench.goat import _scenario

    scn = _scenario(args.topology, args.workers, args.sigma, args.seed, submodels_even(args.gradient_mb, args.submodels))
    p = make_plan(scn.instance(), seed=args.seed)
    goat_plan = plan_to_json(p)
    elements = sizes_elements(goat_plan, args.bytes_per_mb)
    os.makedirs(args.out, exist_ok=True)
    raw, measured = {}, {}
    for scheme, pl in (("goat", goat_plan), ("geryon", ps_only_plan(goat_plan))):
        print(f"fanin sim goat: {scheme} at packet level", file=sys.stderr)
        raw[scheme] = _run_sim(binary, build_spec(scn.topo, pl, elements), os.path.join(args.out, f"goat_{scheme}_spec.json"),
                               args)
        measured[scheme] = packet_metrics(scn.topo, raw[scheme]["result"])
    overhead = raw["goat"]["packet_overhead_bytes"]
    payload = [4.0 * e for e in elements]
    wire = [float(wire_bytes(e, args.elems_per_packet, overhead)) for e in elements]
    flow = flow_metrics(scn, p, payload)
    predicted = flow_metrics(scn, p, wire)
    # ATP and ESA at flow level on the study's instance, scaled like the rest (their collisions depend on
    # gradient size / memory, which scaling both keeps)
    scale = args.bytes_per_mb
    for m in (evaluate_atp(scn, args.chunk_mb), evaluate_esa(scn, args.chunk_mb)):
        flow[m.scheme] = {"ps": m.ps_mb * scale, "comm": m.comm_mb * scale, "ina": m.ina_mb * scale}

    rows, worst = [], 0.0
    for scheme in ("goat", "geryon"):
        for metric in METRICS:
            f, pr, me = flow[scheme][metric], predicted[scheme][metric], measured[scheme][metric]
            agree = (me / pr - 1.0) if pr else (0.0 if me == 0 else None)   # None: bytes where none were predicted
            worst = max(worst, math.inf if agree is None else abs(agree))
            rows.append({"scheme": scheme, "metric": metric, "flow_bytes": f, "packet_bytes": me,
                         "packet_over_flow": me / f if f else None, "expected_factor": pr / f if f else None,
                         "flow_x_factor_bytes": pr, "deviation": agree})
    ordering = {}
    for metric in METRICS:
        better = (lambda a, b: a < b) if LOWER_IS_BETTER[metric] else (lambda a, b: a > b)
        ordering[metric] = {"flow_goat_better": better(flow["goat"][metric], flow["geryon"][metric]),
                            "packet_goat_better": better(measured["goat"][metric], measured["geryon"][metric])}
    same_order = all(o["flow_goat_better"] == o["packet_goat_better"] for o in ordering.values())
    exact = all(raw[s]["result"]["exact"] for s in raw)
    rtx = {s: raw[s]["result"]["retransmissions"] for s in raw}
    sw_used = sorted({a["node"] for j in build_spec(scn.topo, goat_plan, elements)["jobs"] for a in j["aggregators"]})
    return {
        "bench": "sim-goat", "quick": bool(args.quick), "loss": args.loss,
        "instance": {"topology": args.topology, "workers": args.workers, "sigma": args.sigma, "seed": args.seed,
                     "ps": scn.ps, "gradient_mb": args.gradient_mb, "submodels": args.submodels,
                     "bytes_per_mb": args.bytes_per_mb, "elements_per_worker": sum(elements),
                     "programmable": [s.name for s in scn.topo.switches if s.programmable],
                     "aggregation_nodes": len(sw_used) - 1,
                     "filters": sum(len(s["filters"]) for s in goat_plan["switches"])},
        "packet_overhead_bytes": overhead, "elems_per_packet": args.elems_per_packet,
        "flow": flow, "packet": measured, "comparison": rows, "ordering_goat_vs_geryon": ordering, "same_ordering": same_order,
        "reduction_vs_geryon": {
            level: {m: 1 - vals["goat"][m] / vals["geryon"][m] for m in ("ps", "comm")}
            for level, vals in (("flow", flow), ("packet", measured))},
        "exact": exact, "retransmissions": rtx,
        "completion_us": {s: raw[s]["result"]["completion_us"] for s in raw},
        "max_deviation": None if math.isinf(worst) else worst, "tolerance": args.tolerance,
        "valid": bool(exact and same_order and worst <= args.tolerance),
    }


def _human(r: dict) -> str:
    i = r["instance"]
    lines = [f"fanin sim goat: {i['topology']}, {i['workers']} workers, PS {i['ps']}, {i['submodels']} sub-models "
             f"({i['gradient_mb']} MB planned, {i['elements_per_worker']} int32 simulated per worker), "
             f"{i['filters']} filters on {i['aggregation_nodes']} switches; exact={r['exact']}, "
             f"retransmissions {r['retransmissions']}",
             f"  {'scheme':7} {'metric':5} {'flow (B)':>13} {'packet (B)':>13} {'packet/flow':>11} {'expected':>9} {'dev':>9}"]
    for row in r["comparison"]:
        lines.append(f"  {row['scheme']:7} {row['metric']:5} {row['flow_bytes']:13.0f} {row['packet_bytes']:13.0f} "
                     f"{row['packet_over_flow'] or 0:11.4f} {row['expected_factor'] or 0:9.4f} "
                     + ("      n/a" if row["deviation"] is None else f"{row['deviation']:+9.2e}"))
    for level in ("flow", "packet"):
        red = r["reduction_vs_geryon"][level]
        lines.append(f"  GOAT vs Geryon at {level} level: PS bytes -{100 * red['ps']:.1f}%, bytes x hops -{100 * red['comm']:.1f}%")
    f = r["flow"]
    lines.append("  flow level only (no packet-level program): " + ", ".join(
        f"{s} PS {f[s]['ps']:.0f} B, comm {f[s]['comm']:.0f} B" for s in ("atp", "esa")))
    dev = "unbounded" if r["max_deviation"] is None else f"{r['max_deviation']:.2e}"
    lines.append(f"  validation: {'PASS' if r['valid'] else 'FAIL'} (max deviation {dev}, "
                 f"tolerance {r['tolerance']}; GOAT vs Geryon ordered alike at both levels: {r['same_ordering']})")
    return "\n".join(lines)


def main(binary: str, argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # --quick fills in what the command line left out, and overrides nothing it gave
    if args.workers is None:
        args.workers = 5 if args.quick else 15
    if args.bytes_per_mb is None:
        args.bytes_per_mb = 4096.0 if args.quick else 65536.0
    bad = out_of_range(args, workers="count", sigma="nonnegative", gradient_mb="positive", submodels="count",
                       bytes_per_mb="positive", elems_per_packet=(1, 16370), window="count", loss="probability",
                       chunk_mb="positive", tolerance="nonnegative")
    if bad:
        print(f"fanin sim goat: {bad}", file=sys.stderr)
        return 2
    from fanin.goat.model import GoatError

    try:
        r = run(binary, args)
    except (GoatError, ValueError, RuntimeError) as e:
        print(f"fanin sim goat: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "goat_packet.json"), "w") as f:
        json.dump(r, f)
    from fanin_bench.report import emit

    emit(r, _human(r), args.json)
    return 0 if r["valid"] else 1
