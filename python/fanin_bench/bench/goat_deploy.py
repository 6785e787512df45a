"""`fanin bench goat-deploy`: a GOAT plan installed on the namespace testbed
(issue 8 item 6; docs/goat.md, "Deployment").

3 switches, 8 workers and a parameter server (examples/goat-testbed.toml,
GOAT's hardware testbed in miniature), static routing on. The plan comes
from the planner (`fanin.goat.plan`, as `fanin plan goat`); its sub-model
sizes are scaled to the testbed (``--bytes-per-mb``). Two arms run side by
side in one testbed, allreduce by allreduce, with the same workers' data:

* **goat**: the plan installed by `install_goat_plan` (switch jobs as
  responsibility filters, the PS daemon completing the rest);
* **ps-only**: every sub-model straight to the PS, the switches only
  forwarding (Geryon without aggregation).

With ``--on-path`` a third arm, **goat-on-path**, runs the same plan with
GOAT's on-path filtering (docs/goat.md): every worker sends every sub-model
to its rack switch, and the plan's switches relay what they do not
aggregate toward its node. Every arm then runs unkeyed (a relay holds no
key), so the PS's ingress compares like for like.

Every worker checks every sub-model's sum exactly (int32). Measured: the
PS's ingress bytes on its veth link (per allreduce of the whole model),
next to what the plan predicts (``ps_mb`` scaled) and the time of a step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fanin import topology
from fanin_bench.bench.trees import _write_csv, step_workers, stop_workers, wait_ready
from fanin_bench.plotting import save_figure

DEFAULT_TOPOLOGY = Path(__file__).resolve().parents[3] / "examples" / "goat-testbed.toml"


def make_plan(topo: topology.Topology, args) -> dict[str, Any]:
    from fanin.goat import instance_from_topology, plan, plan_to_json
    from fanin.goat.command import _submodels

    return plan_to_json(plan(instance_from_topology(topo, _submodels(args)), seed=args.seed))


class Arm:
    """One installed plan and its worker processes."""

    def __init__(self, stack: ExitStack, tb, label: str, plan: dict[str, Any], *, job_base: int,
                 bytes_per_mb: float, epp: int, window: int, seed: int, parallel: int = 0,
                 elements: list[int] | None = None, worker_extra: tuple[str, ...] = (),
                 quorum_ready: bool = False, on_path: bool = False, auth: bool = True):
        """`elements`: each sub-model's length (default: its planned size
        at `bytes_per_mb`); `worker_extra`: more goat_worker arguments."""
        from fanin.controller import TestbedFabric
        from fanin.goat.deploy import install_goat_plan

        self.label, self.plan, self.tb = label, plan, tb
        self.dep = install_goat_plan(plan, tb.topology, TestbedFabric(tb), job_base=job_base,
                                     block_cnt_max=window, block_grad_max=epp, quorum_ready=quorum_ready,
                                     on_path=on_path, auth=auth and not on_path)
        stack.callback(self.dep.close)
        stack.callback(self.dep.remove)
        self.elements = elements or [max(1, round(s["size_mb"] * bytes_per_mb / 4)) for s in plan["submodels"]]
        n = len(self.dep.jobs.ranks)
        self.procs, self.ranks = [], []
        for w, targets in self.dep.addrs.items():
            spec = [[t.job_id, addr, self.elements[t.submodel]] for t, addr in targets]
            argv = [sys.executable, "-m", "fanin_bench.bench.goat_worker", "--rank", str(self.dep.jobs.ranks[w]),
                    "--workers", str(n), "--targets", json.dumps(spec), "--elems-per-packet", str(epp),
                    "--window", str(window), "--seed", str(seed), "--parallel", str(parallel), *worker_extra]
            # Member keys (one per sub-model job) through the environment,
            # not argv, which other local users can read.
            keys = {t.job_id: self.dep.member_key(t.job_id, self.dep.jobs.ranks[w]) for t, _ in targets}
            env = {**os.environ, "FANIN_MEMBER_KEYS": json.dumps({j: k.hex() for j, k in keys.items() if k})}
            self.procs.append(tb.popen(w, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
            self.ranks.append(self.dep.jobs.ranks[w])
        stack.callback(self.stop)
        wait_ready(self.procs, label)
        # what the PS must receive per allreduce: one contribution per source of each sub-model
        self.ps_sources = [len(j.members) for j in self.dep.jobs.on(self.dep.jobs.ps)]
        self.payload = sum(src * e * 4 for src, e in zip(self.ps_sources, self.elements))

    def step(self, delays_ms: dict[int, float] | None = None,
             epoch_ends_with: set[int] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One step on every worker: their answers, and the step as a whole
        (slowest worker's time, exactness, retransmissions, bytes on the
        PS's link). `delays_ms`: rank -> how long it straggles before it
        sends (training workers); `epoch_ends_with`: the ranks whose
        answers end the epoch (GOAT-Async's participants): the others are
        then told "cut", and send at once (late, not added)."""
        ps = self.dep.jobs.ps
        (peer,) = self.tb.topology.neighbours(ps)
        before = self.tb.link_bytes(peer, ps)
        if delays_ms is None and epoch_ends_with is None:
            answers = step_workers(self.procs, self.label)
        else:
            answers = self._step_epoch(delays_ms or {}, epoch_ends_with)
        after = self.tb.link_bytes(peer, ps)
        return answers, {"s": max(a["s"] for a in answers), "exact": all(a["exact"] for a in answers),
                         "retransmissions": sum(a["retransmissions"] for a in answers),
                         "ps_ingress_bytes": after.a_to_b - before.a_to_b,
                         "ps_egress_bytes": after.b_to_a - before.b_to_a}

    def _step_epoch(self, delays_ms: dict[int, float], ends_with: set[int] | None) -> list[dict[str, Any]]:
        for proc, rank in zip(self.procs, self.ranks):
            proc.stdin.write(f"go {delays_ms.get(rank, 0.0):.3f}\n")
            proc.stdin.flush()
        first = [i for i, r in enumerate(self.ranks) if ends_with is None or r in ends_with]
        rest = [i for i in range(len(self.procs)) if i not in first]
        answers: list[Any] = [None] * len(self.procs)
        for group in (first, rest):
            if group is rest:
                for i in rest:
                    self.procs[i].stdin.write("cut\n")
                    self.procs[i].stdin.flush()
            for i in group:
                line = self.procs[i].stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.label}: a worker died (exit {self.procs[i].poll()})")
                answers[i] = json.loads(line)
        return answers

    def run_once(self) -> dict[str, Any]:
        return self.step()[1]

    def stop(self) -> None:
        stop_workers(self.procs)
        self.procs = []


def deploy_and_run(topo: topology.Topology, plan: dict[str, Any], *, name: str, reps: int, bytes_per_mb: float,
                   epp: int = 256, window: int = 64, rate_mbit=None, seed: int = 1,
                   parallel: int = 0, on_path: bool = False) -> dict[str, list[dict]]:
    """The arms on one testbed, interleaved; {arm: [run_once() ...]}.
    `on_path`: a third arm with on-path filtering, every arm unkeyed."""
    from fanin.goat.deploy import ps_only_plan
    from fanin_bench.testbed import Testbed, down

    down(name)  # leftovers of an interrupted earlier run of the same name
    runs: dict[str, list[dict]] = {"goat": [], "ps-only": []}
    if on_path:
        runs["goat-on-path"] = []
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topo, name=name, rate_mbit=rate_mbit, routing=True))
        tb.switches()
        tb.host_aggregator(plan["parameter_server"]["name"])
        kw = dict(bytes_per_mb=bytes_per_mb, epp=epp, window=window, seed=seed, parallel=parallel,
                  auth=not on_path)
        n_sub = len(plan["submodels"])
        arms = [Arm(stack, tb, "goat", plan, job_base=100, **kw),
                Arm(stack, tb, "ps-only", ps_only_plan(plan), job_base=100 + 2 * n_sub, **kw)]
        if on_path:
            arms.append(Arm(stack, tb, "goat-on-path", plan, job_base=100 + 4 * n_sub, on_path=True, **kw))
        for rep in range(reps):
            for k in range(len(arms)):
                arm = arms[(rep + k) % len(arms)]
                r = arm.run_once()
                r.update(payload_bytes=arm.payload, ps_sources=sum(arm.ps_sources))
                runs[arm.label].append(r)
    return runs


def run_goat_deploy(args) -> int:
    from fanin_bench.testbed import check_privileges

    check_privileges()
    topo = topology.load(args.topology or str(DEFAULT_TOPOLOGY))
    if args.ps:
        topo = topology.with_ps(topo, args.ps)
    if args.memory_mb is not None:
        topo = topology.with_programmable(topo, 1.0, args.seed, args.memory_mb)
    if not (args.even or args.model or args.submodels):
        args.even = "12,6"
    plan = make_plan(topo, args)
    reps = args.reps or (3 if args.quick else 10)
    bytes_per_mb = args.bytes_per_mb or (16384 if args.quick else 131072)
    runs = deploy_and_run(topo, plan, name=f"gd{os.getpid() % 100000}", reps=reps, bytes_per_mb=bytes_per_mb,
                          epp=args.elems_per_packet, window=args.window, rate_mbit=args.rate_mbit, seed=args.seed,
                          parallel=args.parallel, on_path=args.on_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"arm": arm, "rep": i, **{k: v for k, v in r.items()}} for arm, rs in runs.items() for i, r in enumerate(rs)]
    _write_csv(out / "goat_deploy.csv", rows)
    total_mb = sum(s["size_mb"] for s in plan["submodels"])
    n_workers = len(plan["workers"])
    summary = {}
    for arm, rs in runs.items():
        ingress = statistics.median(r["ps_ingress_bytes"] for r in rs)
        summary[arm] = {"exact": all(r["exact"] for r in rs), "ps_ingress_bytes_median": ingress,
                        "ps_payload_bytes": rs[0]["payload_bytes"], "ps_sources": rs[0]["ps_sources"],
                        "ps_egress_bytes_median": statistics.median(r["ps_egress_bytes"] for r in rs),
                        "step_ms_median": 1e3 * statistics.median(r["s"] for r in rs),
                        "retransmissions": sum(r["retransmissions"] for r in rs)}
    measured = summary["ps-only"]["ps_ingress_bytes_median"] / summary["goat"]["ps_ingress_bytes_median"]
    planned = total_mb * n_workers / plan["ps_mb"]
    _plot(summary, planned, out / "goat_deploy.png", plan)
    result = {
        "bench": "goat-deploy", "topology": topo.name, "workers": n_workers, "submodels": len(plan["submodels"]),
        "model": args.model or args.submodels or f"even {args.even}", "model_mb": total_mb, "bytes_per_mb": bytes_per_mb, "reps": reps, "rate_mbit": args.rate_mbit,
        "parallel_submodels": args.parallel,
        "plan": {"ps_mb": plan["ps_mb"], "ps_only_mb": total_mb * n_workers,
                 "switch_filters": {s["name"]: [f["submodel"] for f in s["filters"] if f["workers"]]
                                    for s in plan["switches"]}},
        "arms": summary, "ps_ingress_reduction_measured": measured, "ps_ingress_reduction_planned": planned,
        "keyed": not args.on_path,
        "all_exact": all(s["exact"] for s in summary.values()),
        "csv": str(out / "goat_deploy.csv"), "png": str(out / "goat_deploy.png"),
    }
    human = (f"goat-deploy: {n_workers} workers, {len(plan['submodels'])} sub-models, {reps} allreduces per arm, "
             f"every sum exact: {result['all_exact']}\n" + "\n".join(
                 f"{arm:>12}: PS ingress {s['ps_ingress_bytes_median'] / 1e6:.2f} MB per step (payload "
                 f"{s['ps_payload_bytes'] / 1e6:.2f} MB from {s['ps_sources']} sources), step {s['step_ms_median']:.0f} ms"
                 for arm, s in summary.items())
             + f"\nPS ingress reduction: measured {measured:.2f}x, planned {planned:.2f}x")
    if args.on_path:
        on = summary["goat-on-path"]
        result["on_path_ps_ingress_vs_direct"] = on["ps_ingress_bytes_median"] / summary["goat"]["ps_ingress_bytes_median"]
        result["on_path_step_vs_direct"] = on["step_ms_median"] / summary["goat"]["step_ms_median"]
        human += (f"\non-path filtering: PS ingress {result['on_path_ps_ingress_vs_direct']:.3f}x the direct "
                  f"addressing's, step {result['on_path_step_vs_direct']:.2f}x")
    if args.json:
        print(json.dumps(result, indent=2))
        print(human, file=sys.stderr)
    else:
        print(human)
    return 0 if result["all_exact"] else 1


def _plot(summary: dict[str, Any], planned: float, path: Path, plan: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    x = range(len(arms))
    ax.bar([i - 0.2 for i in x], [summary[a]["ps_ingress_bytes_median"] / 1e6 for a in arms], 0.4,
           label="measured (veth, frames)")
    ax.bar([i + 0.2 for i in x], [summary[a]["ps_payload_bytes"] / 1e6 for a in arms], 0.4,
           label="gradient payload (plan)")
    ax.set_xticks(list(x), arms)
    ax.set_ylabel("PS ingress per step (MB)")
    ax.set_title(f"GOAT plan on the testbed: {len(plan['workers'])} workers, {len(plan['switches'])} switches, "
                 f"{len(plan['submodels'])} sub-models\nPS ingress planned {planned:.2f}x less than PS-only",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
