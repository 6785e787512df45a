"""`fanin sim allreduce`: fanin's aggregation tree against ring allreduce at
scale, in the packet-level simulator.

The controller's own code decides the tree: `fanin.topology` builds the
network, `fanin.controller.tree.build_tree` / `roles` the aggregation tree
over it. Both go to the simulator (`fanin-sim allreduce --spec FILE`) as one
JSON file, so the simulated network and tree are the ones the controller
would program; the simulator generates neither.

Outputs in `--out` (default out/sim): `allreduce_spec.json` (what the
simulator ran), `allreduce.json` (everything, per-channel counters
included), `allreduce_summary.csv` (one row per scenario and algorithm),
`allreduce_links.csv` (bytes on every link, both directions),
`allreduce_completion.png` and `allreduce_layers.png`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import replace
from typing import Mapping, Optional

from fanin._cli_util import Parser
from fanin.controller.roots import spare_capacity, weigh_root_shards
from fanin.controller.tree import build_tree, roles
from fanin.topology import Topology, load
from fanin_bench.sim import out_of_range

__all__ = ["build_spec", "root_spare", "link_layers", "top_layer", "main", "run_report"]


def build_spec(topo: Topology, workers: int, spread: bool = False, multi_root: bool = False,
               root_spare: Optional[Mapping[str, float]] = None) -> dict:
    """The simulator's input: nodes, links and the tree of a job whose rank
    r runs on the r-th host of the topology, or, with `spread`, on the
    hosts taken evenly from every edge switch (the first hosts of each, in
    turn), so that the hosts left over, free for background traffic, are
    spread over the edge switches too.

    `multi_root` spreads the root's role over every switch that is a
    neighbour of all the root's children (a leaf-spine's spines): each is
    the root of the blocks `shard_of` assigns it (`root_shards`), so each
    child's partials leave over all its uplinks instead of one. With
    `root_spare` (each candidate's spare capacity, `root_spare()`), the
    shares follow it (`fanin.controller.roots.weigh_root_shards`): a switch
    may hold several shards or none, and the one with the largest share
    takes the tree root's place."""
    all_hosts = [h.name for h in topo.hosts]
    if not 1 <= workers <= len(all_hosts):
        raise ValueError(f"--workers must be between 1 and {len(all_hosts)} on {topo.name}")
    hosts = all_hosts
    if spread:
        groups: dict[str, list[str]] = {}
        for h in all_hosts:
            edge = next(link.b if link.a == h else link.a for link in topo.links if h in (link.a, link.b))
            groups.setdefault(edge, []).append(h)
        per = -(-workers // len(groups))
        chosen = [h for g in groups.values() for h in g[:per]][:workers]
        hosts = chosen + [h for h in all_hosts if h not in chosen]
    tree = build_tree(topo, {r: hosts[r] for r in range(workers)})
    names = all_hosts + [s.name for s in topo.switches]
    index = {n: i for i, n in enumerate(names)}
    switch_roles = roles(topo, tree)
    root_shards: list[str] = []
    if multi_root:
        children = [s for s, role in switch_roles.items() if role.parent == tree.root]
        peers = [s.name for s in topo.switches if s.name != tree.root and s.name not in switch_roles
                 and children and all(c in topo.neighbours(s.name) for c in children)]
        if not peers:
            raise ValueError(f"--multi-root: no switch of {topo.name} besides {tree.root} reaches every child of the "
                             f"root ({', '.join(children) or 'none'}); a leaf-spine has one per spine")
        own = sorted(h for r, h in enumerate(hosts[:workers]) if tree.attach[r] == tree.root)
        if own:
            raise ValueError(f"--multi-root: {tree.root} is the root and has workers of its own ({', '.join(own)}); "
                             f"a root spread over several switches needs every child of the root to be a switch")
        root_shards = [tree.root, *sorted(peers)]
        if root_spare is not None:
            root_shards = weigh_root_shards(root_shards, root_spare)
            if root_shards[0] != tree.root:
                # the switch with the largest share becomes shard 0, where
                # the job's joins go: it takes the root's role in the tree
                new_root = root_shards[0]
                switch_roles[new_root] = switch_roles.pop(tree.root)
                for s, role in list(switch_roles.items()):
                    if role.parent == tree.root:
                        switch_roles[s] = replace(role, parent=new_root)
    elif root_spare is not None:
        raise ValueError("root weights need --multi-root: one root has nothing to weigh")
    tree_root = root_shards[0] if root_shards else tree.root
    return {
        "name": topo.name,
        "nodes": [{"name": n, "switch": topo.is_switch(n)} for n in names],
        "links": [[index[link.a], index[link.b]] for link in topo.links],
        "workers": [{"rank": r, "host": index[hosts[r]], "switch": index[tree.attach[r]]} for r in range(workers)],
        "tree": [
            {"node": index[s], "parent": None if role.parent is None else index[role.parent], "rank": role.rank,
             "members": list(role.members)}
            for s, role in sorted(switch_roles.items())
        ],
        "root_shards": [index[s] for s in root_shards],
        "root": tree_root,
        "levels": tree.depth(),
    }


def root_spare(spec: dict, load: list[float]) -> dict[str, float]:
    """Each candidate root's spare capacity (`spare_capacity`) from the
    per-channel loads `fanin-sim port-counters` read on `spec`'s network:
    channel 2i is link i's a -> b direction, 2i + 1 its b -> a."""
    names = [n["name"] for n in spec["nodes"]]
    by_pair = {}
    for i, (a, b) in enumerate(spec["links"]):
        by_pair[(names[a], names[b])] = load[2 * i]
        by_pair[(names[b], names[a])] = load[2 * i + 1]
    root = spec["root"]
    children = [names[s["node"]] for s in spec["tree"] if s["parent"] is not None and names[s["parent"]] == root]
    candidates = list(dict.fromkeys(names[i] for i in spec["root_shards"]))
    return spare_capacity(candidates, children, by_pair)


def link_layers(topo: Topology) -> list[str]:
    """Each link's layer, from the switches' distance to the nearest host:
    `host` (host to edge), `edge-agg`, `agg-core` (deeper: `level<N>`)."""
    level = {h.name: 0 for h in topo.hosts}
    queue = deque(level)
    while queue:
        node = queue.popleft()
        for nxt in topo.neighbours(node):
            if nxt not in level:
                level[nxt] = level[node] + 1
                queue.append(nxt)
    names = {1: "host", 2: "edge-agg", 3: "agg-core"}
    return [names.get(max(level[link.a], level[link.b]), f"level{max(level[link.a], level[link.b])}") for link in topo.links]


def top_layer(layers: list[str]) -> str:
    """The layer farthest from the hosts (the core of a fat tree)."""
    order = {"host": 1, "edge-agg": 2, "agg-core": 3}
    return max(layers, key=lambda n: order.get(n) or int(n.removeprefix("level")))


def _summary(result: dict, layers: list[str], config: Optional[dict] = None) -> dict:
    """One algorithm's figures. Link bytes count every datagram on the
    link, background traffic's included (`background_bytes` says how much
    it sent). `goodput_fraction_of_line_rate`: the tensor's bytes over the
    link rate times the completion time (headers make 1 unreachable)."""
    sent = [c["sent_bytes"] for c in result["channels"]]
    per_link = [sent[2 * i] + sent[2 * i + 1] for i in range(len(layers))]
    top = top_layer(layers)
    by_layer: dict[str, int] = {}
    for name, b in zip(layers, per_link):
        by_layer[name] = by_layer.get(name, 0) + b
    return {
        "algorithm": result["algorithm"],
        "join_us": result["join_us"],
        "completion_us": result["completion_us"],
        "mean_completion_us": result["mean_completion_us"],
        "exact": result["exact"],
        "degraded_blocks": result["degraded_blocks"],
        "retransmissions": result["retransmissions"],
        "link_drops": result["link_drops"],
        "queue_drops": result["queue_drops"],
        "trims": result.get("trims", 0),
        "ce_marks": result.get("ce_marks", 0),
        **({"tofino": result["tofino"]} if "tofino" in result else {}),
        "stragglers": len(result["stragglers"]),
        "events": result["events"],
        "total_bytes": sum(per_link),
        "core_bytes": by_layer.get(top, 0),
        "max_link_bytes": max(max(sent), 0),
        "bytes_by_layer": by_layer,
        "background_bytes": result.get("background", {}).get("sent_bytes", 0),
        **({"goodput_fraction_of_line_rate": config["elements"] * 4 * 8 / (config["rate_gbps"] * 1e3
                                                                          * result["completion_us"])}
           if config and result["completion_us"] > 0 else {}),
    }


def _scenarios(args) -> list[tuple[str, float, float]]:
    if not args.sweep:
        return [("run", args.loss, args.stragglers)]
    return [("clean", 0.0, 0.0), ("loss", args.loss or 0.01, 0.0), ("stragglers", 0.0, args.stragglers or 0.1)]


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="fanin sim allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", help="generator spec or file (default fat-tree:8: 128 hosts; fat-tree:4 with --quick)")
    p.add_argument("--workers", type=int, help="workers on the first N hosts (default: every host)")
    p.add_argument("--size", type=int, help=f"int32 elements per worker (default {1 << 18}; {1 << 14} with --quick)")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=128, help="packets (fanin: blocks) in flight per worker")
    p.add_argument("--rate-gbps", type=int, default=100)
    p.add_argument("--delay-ns", type=int, default=500)
    p.add_argument("--queue-pkts", type=int, default=1000,
                   help="every switch port's buffer, in datagrams of the largest size (default %(default)s); a "
                        "host's own queue is its sender's socket and does not drop")
    p.add_argument("--loss", type=float, default=0.0, help="independent loss on every link")
    p.add_argument("--stragglers", type=float, default=0.0, help="fraction of workers that start late")
    p.add_argument("--straggler-delay-us", type=int, default=200)
    p.add_argument("--block-exp-ms", type=int, default=0, help="fanin block aging (0: off; with it results may degrade)")
    p.add_argument("--algorithms", default="fanin,ring")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-limit-ms", type=int, default=60_000,
                   help="simulated time after which a run stops with an error naming the workers without a result "
                        "(default %(default)s; with background traffic a starved hop can take hours of wall time "
                        "to reach it)")
    p.add_argument("--background-load", type=float, default=0.0,
                   help="other tenants' traffic: every host that runs no worker sends at this fraction of its link "
                        "rate to another such host for the whole run (0: none; needs --workers below the host count)")
    p.add_argument("--multi-root", action="store_true",
                   help="spread the tree's root over every switch that reaches all the root's children (a "
                        "leaf-spine's spines): each is the root of a share of the blocks, so a leaf's partials use "
                        "all its uplinks, not one")
    p.add_argument("--root-weights", choices=["equal", "spare"], default="equal",
                   help="with --multi-root: give every root switch the same share of the blocks (equal), or "
                        "shares in proportion to the spare capacity of its links to the root's children, read from "
                        "the port counters over --counters-us of the background alone before the job (spare; "
                        "fanin.controller.roots)")
    p.add_argument("--counters-us", type=int, default=50,
                   help="with --root-weights spare: the port-counter window in simulated µs (default %(default)s)")
    p.add_argument("--trimming", nargs="?", const="ndp", choices=["ndp", "tofino"],
                   help="trimming instead of drop-tail (same buffer): a datagram that finds the queue full is cut to "
                        "its fanin header, which tells the switch or worker of the loss at once (docs/protocol.md "
                        "4.14); the ring's transport sees a cut packet as a loss. ndp (the default): ideal NDP "
                        "queues; tofino: the switches trim as the trimming study's Tofino design (ingress meters, "
                        "deflect on drop, notifications). A host's own queue never drops or trims (it is its "
                        "sender's socket)")
    p.add_argument("--ecn-pkts", type=int, default=0,
                   help="ECN: a switch port whose queue holds at least this many datagrams marks the fanin datagrams "
                        "that join it Congestion Experienced (DCTCP's K; 0, the default: no marking); the switch "
                        "and the workers cut every member's window at the marked block, before the queue drops "
                        "(docs/congestion.md, \"ECN\"). Background traffic is never marked")
    p.add_argument("--responsive-background", action="store_true",
                   help="the background flows are congestion-controlled (AIMD on their rate: halved on a loss, "
                        "regrown by 1%% of their pace per datagram) instead of constant-rate")
    p.add_argument("--spread", action="store_true",
                   help="take the workers evenly from every edge switch instead of the first hosts, so the hosts "
                        "left for background traffic are on every edge switch too")
    p.add_argument("--sweep", action="store_true",
                   help="three scenarios: clean, --loss (default 0.01), --stragglers (default 0.1)")
    p.add_argument("--quick", action="store_true",
                   help="fat-tree:4 (16 workers) and 16384 elements, unless --topology or --size says otherwise")
    p.add_argument("--json", action="store_true", help="summary JSON on stdout")
    p.add_argument("--out", default="out/sim")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(binary: str, argv: list[str]) -> int:
    as_json = _parser().parse_args(argv).json
    code, report = run_report(binary, argv)
    if code == 0 and as_json:
        print(json.dumps(report))
    return code


def run_report(binary: str, argv: list[str]) -> tuple[int, Optional[dict]]:
    """`fanin sim allreduce ARGV` without printing its JSON: (exit code,
    the report, None on a failure). Files, plots and the summary on stderr
    as `main`."""
    args = _parser().parse_args(argv)
    # --quick fills in what the command line left out, and overrides nothing it gave
    if args.topology is None:
        args.topology = "fat-tree:4" if args.quick else "fat-tree:8"
    if args.size is None:
        args.size = 1 << 14 if args.quick else 1 << 18
    bad = out_of_range(args, workers="count", size="count", elems_per_packet=(1, 16370), window="count",
                       rate_gbps="count", delay_ns="nonnegative", queue_pkts="count", loss="probability",
                       stragglers="fraction", straggler_delay_us="nonnegative", block_exp_ms="nonnegative",
                       time_limit_ms="count", background_load="fraction", counters_us="count",
                       ecn_pkts="nonnegative")
    if bad:
        print(f"fanin sim allreduce: {bad}", file=sys.stderr)
        return 2, None
    try:
        topo = load(args.topology)
    except ValueError as e:
        print(f"fanin sim allreduce: --topology {args.topology}: {e}", file=sys.stderr)
        return 2, None
    try:
        spec = build_spec(topo, args.workers or len(topo.hosts), spread=args.spread, multi_root=args.multi_root)
    except ValueError as e:
        print(f"fanin sim allreduce: {e}", file=sys.stderr)
        return 2, None
    if args.root_weights == "spare" and not args.multi_root:
        print("fanin sim allreduce: --root-weights spare needs --multi-root (one root has nothing to weigh)",
              file=sys.stderr)
        return 2, None
    os.makedirs(args.out, exist_ok=True)
    spec_path = os.path.join(args.out, "allreduce_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    # the network and its traffic, as every run of this invocation has them
    network = ["--elems-per-packet", str(args.elems_per_packet), "--rate-gbps", str(args.rate_gbps),
               "--delay-ns", str(args.delay_ns), "--queue-pkts", str(args.queue_pkts), "--seed", str(args.seed),
               "--background-load", str(args.background_load), "--ecn-pkts", str(args.ecn_pkts)] \
        + (["--trimming"] if args.trimming else []) + (["--tofino"] if args.trimming == "tofino" else []) \
        + (["--responsive-background"] if args.responsive_background else [])
    shares = None
    if args.root_weights == "spare":
        proc = subprocess.run([binary, "port-counters", "--spec", spec_path, "--json",
                               "--window-us", str(args.counters_us)] + network, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            return proc.returncode, None
        spare = root_spare(spec, json.loads(proc.stdout)["load"])
        spec = build_spec(topo, args.workers or len(topo.hosts), spread=args.spread, multi_root=True, root_spare=spare)
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        names = [n["name"] for n in spec["nodes"]]
        shares = {"spare": spare, "shards": {c: 0 for c in spare}}
        for i in spec["root_shards"]:
            shares["shards"][names[i]] += 1
        print("fanin sim allreduce: root shards by spare capacity: " + ", ".join(
            f"{c} {shares['shards'][c]} (spare {v:.2f})" for c, v in spare.items()), file=sys.stderr)
    layers = link_layers(topo)
    runs = []
    for name, loss, stragglers in _scenarios(args):
        argv = [binary, "allreduce", "--spec", spec_path, "--json", "--algorithms", args.algorithms,
                "--elements", str(args.size), "--window", str(args.window),
                "--loss", str(loss), "--stragglers", str(stragglers), "--straggler-delay-us",
                str(args.straggler_delay_us), "--block-exp-ms", str(args.block_exp_ms),
                "--time-limit-ms", str(args.time_limit_ms)] + network
        print(f"fanin sim allreduce: scenario {name} (loss {loss}, stragglers {stragglers})", file=sys.stderr)
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            return proc.returncode, None
        out = json.loads(proc.stdout)
        runs.append({"scenario": name, "loss": loss, "stragglers": stragglers, "raw": out,
                     "summary": [_summary(r, layers, out.get("config")) for r in out["results"]]})
    report = _report(spec, topo, args, runs)
    if shares is not None:
        report["root_weights"] = shares
    _write(args.out, topo, layers, runs, report)
    if not args.no_plot:
        try:
            from fanin_bench.sim.plots import plot_allreduce

            for path in plot_allreduce(args.out):
                print(f"fanin sim: wrote {path}", file=sys.stderr)
        except ImportError as e:
            print(f"fanin sim: no PNG ({e})", file=sys.stderr)
    for run in report["scenarios"]:
        for s in run["algorithms"]:
            print(f"{run['scenario']:>10} {s['algorithm']:>5}: {s['completion_us']:9.1f} µs, {s['total_bytes'] / 1e6:8.2f} MB "
                  f"on links, {s['core_bytes'] / 1e6:8.2f} MB on {top_layer(layers)} links, "
                  f"max link {s['max_link_bytes'] / 1e6:6.2f} MB, exact={s['exact']}", file=sys.stderr)
        if run.get("fanin_over_ring"):
            r = run["fanin_over_ring"]
            print(f"{'':>10} fanin/ring: time {r['completion']:.2f}, bytes {r['total_bytes']:.2f}, core bytes "
                  f"{r['core_bytes']:.2f}, max link {r['max_link_bytes']:.2f}", file=sys.stderr)
    return 0, report


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _report(spec: dict, topo: Topology, args, runs: list) -> dict:
    scenarios = []
    for run in runs:
        by = {s["algorithm"]: s for s in run["summary"]}
        entry = {"scenario": run["scenario"], "loss": run["loss"], "stragglers": run["stragglers"], "algorithms": run["summary"]}
        if "fanin" in by and "ring" in by:
            f, r = by["fanin"], by["ring"]
            entry["fanin_over_ring"] = {
                "completion": _ratio(f["completion_us"], r["completion_us"]),
                "total_bytes": _ratio(f["total_bytes"], r["total_bytes"]),
                "core_bytes": _ratio(f["core_bytes"], r["core_bytes"]),
                "max_link_bytes": _ratio(f["max_link_bytes"], r["max_link_bytes"]),
            }
        scenarios.append(entry)
    return {
        "topology": topo.name,
        "workers": len(spec["workers"]),
        "tree_root": spec["root"],
        "tree_levels": spec["levels"],
        "tree_switches": len(spec["tree"]),
        "root_shards": len(spec.get("root_shards") or [spec["root"]]),
        "size_elements": args.size,
        "seed": args.seed,
        "queue_pkts": args.queue_pkts,
        "ecn_pkts": args.ecn_pkts,
        "scenarios": scenarios,
    }


def _write(out: str, topo: Topology, layers: list[str], runs: list, report: dict) -> None:
    with open(os.path.join(out, "allreduce.json"), "w") as f:
        json.dump({"report": report, "runs": [{"scenario": r["scenario"], **r["raw"]} for r in runs]}, f)
    fields = ["scenario", "algorithm", "join_us", "completion_us", "mean_completion_us", "exact", "degraded_blocks", "retransmissions",
              "link_drops", "queue_drops", "trims", "ce_marks", "stragglers", "events", "total_bytes", "core_bytes", "max_link_bytes"]
    layer_names = sorted(set(layers))
    with open(os.path.join(out, "allreduce_summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields + [f"bytes_{n}" for n in layer_names])
        for run in runs:
            for s in run["summary"]:
                w.writerow([run["scenario"]] + [s[k] for k in fields[1:]] + [s["bytes_by_layer"].get(n, 0) for n in layer_names])
    with open(os.path.join(out, "allreduce_links.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "algorithm", "a", "b", "layer", "bytes_a_to_b", "bytes_b_to_a", "bytes", "lost_bytes",
                    "queue_dropped_bytes"])
        for run in runs:
            for r in run["raw"]["results"]:
                ch = r["channels"]
                for i, (link, layer) in enumerate(zip(topo.links, layers)):
                    ab, ba = ch[2 * i], ch[2 * i + 1]
                    w.writerow([run["scenario"], r["algorithm"], link.a, link.b, layer, ab["sent_bytes"], ba["sent_bytes"],
                                ab["sent_bytes"] + ba["sent_bytes"], ab["lost_bytes"] + ba["lost_bytes"],
                                ab["queue_dropped_bytes"] + ba["queue_dropped_bytes"]])
