"""Aggregation-tree benchmarks on the namespace testbed (SwitchML++ §5).

* ``tree-levels`` — the thesis experiment: 2 workers, 42 chunks, 0.3 loss in
  each worker-switch direction, 1 Gbit/s links; trees of 1, 2 and 3 levels
  (through the controller) and the single-switch baseline (a job admitted
  directly, SwitchML style), interleaved allreduce by allreduce in one run.
  Means, quartiles, Mann-Whitney U of each against 1 level.
* ``tree-scaling`` — 8 workers over a 2-level tree (leaf-spine 1 spine,
  2 leaves) vs one switch (star:8): completion time and the bytes measured
  on the veth links, i.e. what reaches the top of the tree.

Every allreduce's result is checked exactly by the workers (int32).
Every arm is keyed (docs/security.md): the controller issues the member keys
of the tree arms, the single-switch baseline is admitted with a job key of
its own, so the comparison is like for like.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fanin import derive_member_key, new_job_key, topology
from fanin.controller import Controller, JobParams, TestbedFabric
from fanin.switch import job_config
from fanin_bench.plotting import save_figure
from fanin_bench.bench.net_worker import MEMBER_KEY_ENV

JOB = 1
DATA_PORT = 9000


class TestbedJob:
    """One configuration: a testbed, its switches, the job, worker processes."""

    def __init__(self, stack: ExitStack, label: str, name: str, topo: topology.Topology, *, controller: bool,
                 rate_mbit: float, workers: dict[int, str], elements: int, epp: int, window: int,
                 send_drop: float, recv_drop: float, seed: int):
        from fanin_bench.testbed import Testbed

        self.label = label
        self.topo = topo
        self.tb = stack.enter_context(Testbed.up(topo, name=name, rate_mbit=rate_mbit))
        n = len(workers)
        if controller:
            self.tb.switches()
            ctl = Controller(topo, TestbedFabric(self.tb))
            stack.callback(ctl.close)
            ctl.create_job(JobParams(JOB, block_cnt_max=window, block_grad_max=epp, max_workers=n))
            subs = {r: ctl.subscribe(JOB, r, h) for r, h in workers.items()}
            addrs = {r: sub["data_addr"] for r, sub in subs.items()}
            keys = {r: sub["member_key"] for r, sub in subs.items()}
            self.tree = ctl.tree(JOB).to_dict()
        else:
            (sw,) = topo.switches
            job_key = new_job_key()
            self.tb.switches(jobs=[job_config(JOB, members=list(workers), block_cnt_max=window, block_grad_max=epp,
                                              key=job_key)])
            addrs = {r: f"{self.tb.addr(sw.name, toward=h)}:{DATA_PORT}" for r, h in workers.items()}
            keys = {r: derive_member_key(job_key, JOB, r) for r in workers}
            self.tree = None
        self.procs = []
        for r, h in workers.items():
            argv = [sys.executable, "-m", "fanin_bench.bench.tree_worker", "--addr", addrs[r], "--job", str(JOB),
                    "--rank", str(r), "--workers", str(n), "--elements", str(elements),
                    "--elems-per-packet", str(epp), "--window", str(window), "--send-drop", str(send_drop),
                    "--recv-drop", str(recv_drop), "--seed", str(seed * 1000 + r)]
            # the key in the environment, not argv (which other local users can read)
            env = {**os.environ, MEMBER_KEY_ENV: keys[r].hex()}
            proc = self.tb.popen(h, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            self.procs.append(proc)
        wait_ready(self.procs, label)

    def run_once(self) -> dict[str, Any]:
        """One allreduce on every worker at once: the slowest worker's time."""
        answers = step_workers(self.procs, self.label, verify=True)
        if not all(a["exact"] for a in answers):
            raise RuntimeError(f"{self.label}: a worker got a wrong sum")
        return {"s": max(a["s"] for a in answers), "retransmissions": sum(a["retransmissions"] or 0 for a in answers)}

    def stop(self) -> None:
        stop_workers(self.procs)


# Long-lived worker processes (tree_worker, goat_worker, net_worker): a JSON
# line {"ready": true} once joined, then one JSON line per "go" line on
# stdin; tree_worker and net_worker answer "check" with their result's check.

def wait_ready(procs: list[subprocess.Popen], label: str) -> None:
    for proc in procs:
        line = proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"{label}: a worker did not start (exit {proc.poll()})")


def step_workers(procs: list[subprocess.Popen], label: str, verify: bool = False) -> list[dict[str, Any]]:
    """Start one step on every worker at once; their answers.

    `verify`: the workers check their result only when told "check", after
    every worker has answered "go" with its time, and the check's answer
    is merged into the step's. A worker that checked as soon as its own
    allreduce ended would run a second of numpy on a 16 MB tensor while
    another worker's timed allreduce may still be finishing, on the cores
    that allreduce needs. (On the 2-core VM at 3.2 Gbit/s the two orders
    measured the same within the noise; this one cannot bias a run.)"""
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    answers = [_answer(proc, label) for proc in procs]
    if verify:
        for proc in procs:
            proc.stdin.write("check\n")
            proc.stdin.flush()
        for answer, proc in zip(answers, procs):
            answer.update(_answer(proc, label))
    return answers


def _answer(proc: subprocess.Popen, label: str) -> dict[str, Any]:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{label}: a worker died (exit {proc.poll()})")
    return json.loads(line)


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """Close every worker's stdin (its signal to end) and wait for it; raise if one ended with an error (a
    crash at exit is still a crash, though every answer it gave was checked), after all are stopped."""
    failed = []
    for proc in procs:
        try:
            proc.stdin.close()
            code = proc.wait(timeout=10)
        except Exception:
            proc.kill()
            proc.wait()
            continue
        if code != 0:
            failed.append(f"pid {proc.pid}: exit {code}")
    if failed:
        raise RuntimeError(f"{len(failed)} worker process(es) ended with an error after their last step "
                           f"({', '.join(failed)}); their output above says why")


def _quartiles(xs: list[float]) -> dict[str, float]:
    q = np.percentile(xs, [25, 50, 75])
    return {"mean": float(np.mean(xs)), "q1": float(q[0]), "median": float(q[1]), "q3": float(q[2]),
            "min": float(min(xs)), "max": float(max(xs))}


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def run_tree_levels(args) -> int:
    from scipy.stats import mannwhitneyu

    from fanin_bench.testbed import check_privileges

    check_privileges()
    reps = args.reps or (10 if args.quick else 50)
    epp, chunks = args.elems_per_packet, args.chunks
    elements = epp * chunks
    workers = {0: "h0", 1: "h1"}
    arms_spec = [("single switch", "star:2", False), ("1 level", "deep-tree:1,2", True),
                 ("2 levels", "deep-tree:2,2", True), ("3 levels", "deep-tree:3,2", True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {label: [] for label, _, _ in arms_spec}
    retx: dict[str, int] = {label: 0 for label, _, _ in arms_spec}
    with ExitStack() as stack:
        arms = []
        for i, (label, spec, ctl) in enumerate(arms_spec):
            arm = TestbedJob(stack, label, f"tl{i}", topology.load(spec), controller=ctl, rate_mbit=args.rate_mbit,
                       workers=workers, elements=elements, epp=epp, window=args.window,
                       send_drop=args.loss, recv_drop=args.loss, seed=args.seed + i)
            stack.callback(arm.stop)
            arms.append(arm)
        levels = {a.label: (a.tree["levels"] if a.tree else 1) for a in arms}
        for rep in range(reps):
            # interleaved, and the order rotates, so drift hits every arm alike
            for k in range(len(arms)):
                arm = arms[(rep + k) % len(arms)]
                r = arm.run_once()
                times[arm.label].append(r["s"])
                retx[arm.label] += r["retransmissions"]
            if not args.json:
                print(f"\rtree-levels: {rep + 1}/{reps}", end="", file=sys.stderr, flush=True)
    if not args.json:
        print(file=sys.stderr)
    base = times["1 level"]
    rows, summary = [], {}
    for label, xs in times.items():
        st = _quartiles([x * 1e3 for x in xs])
        test = mannwhitneyu(xs, base, alternative="two-sided") if label != "1 level" else None
        summary[label] = {"levels": levels[label], "ms": st, "retransmissions": retx[label],
                          "mean_vs_1_level": statistics.mean(xs) / statistics.mean(base),
                          "mann_whitney_u_vs_1_level": None if test is None else
                          {"U": float(test.statistic), "p": float(test.pvalue)}}
        for rep, x in enumerate(xs):
            rows.append({"config": label, "levels": levels[label], "rep": rep, "ms": x * 1e3})
    _write_csv(out / "tree_levels.csv", rows)
    _plot_levels(times, out / "tree_levels.png", args)
    result = {
        "bench": "tree-levels", "workers": 2, "chunks": chunks, "elems_per_packet": epp, "reps": reps,
        "loss_each_direction": args.loss, "rate_mbit": args.rate_mbit, "configs": summary,
        "target": "3 levels within 1.25x of 1 level (mean)",
        "target_met": summary["3 levels"]["mean_vs_1_level"] <= 1.25,
        "csv": str(out / "tree_levels.csv"), "png": str(out / "tree_levels.png"),
    }
    _emit(result, args, lambda: "\n".join(
        f"{label:>13}: mean {s['ms']['mean']:.2f} ms (q1 {s['ms']['q1']:.2f}, median {s['ms']['median']:.2f}, "
        f"q3 {s['ms']['q3']:.2f}), {s['mean_vs_1_level']:.2f}x 1 level"
        + (f", Mann-Whitney p={s['mann_whitney_u_vs_1_level']['p']:.3g}" if s["mann_whitney_u_vs_1_level"] else "")
        for label, s in summary.items()))
    return 0 if result["target_met"] else 1


def _plot_levels(times: dict[str, list[float]], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = list(times)
    ax.boxplot([[x * 1e3 for x in times[k]] for k in labels], tick_labels=labels, showmeans=True)
    ax.set_ylabel("allreduce time (ms)")
    ax.set_title(f"2 workers, {args.chunks} chunks, loss {args.loss} each way, {args.rate_mbit:g} Mbit/s links")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def run_tree_scaling(args) -> int:
    from fanin.proc import parse_size
    from fanin_bench.testbed import check_privileges

    check_privileges()
    reps = args.reps or (3 if args.quick else 10)
    size = parse_size(args.size or ("1MB" if args.quick else "8MB"))
    epp = args.elems_per_packet
    elements = size // 4
    tree_topo = topology.leaf_spine(1, 2, 4)
    star_topo = topology.star(8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        tree = TestbedJob(stack, "2-level tree", "ts0", tree_topo, controller=True, rate_mbit=args.rate_mbit,
                    workers={r: h.name for r, h in enumerate(tree_topo.hosts)}, elements=elements, epp=epp,
                    window=args.window, send_drop=0.0, recv_drop=0.0, seed=args.seed)
        stack.callback(tree.stop)
        star = TestbedJob(stack, "one switch", "ts1", star_topo, controller=False, rate_mbit=args.rate_mbit,
                    workers={r: h.name for r, h in enumerate(star_topo.hosts)}, elements=elements, epp=epp,
                    window=args.window, send_drop=0.0, recv_drop=0.0, seed=args.seed)
        stack.callback(star.stop)
        arms = [tree, star]
        before = {a.label: {(l.a, l.b): a.tb.link_bytes(l.a, l.b) for l in a.topo.links} for a in arms}
        times: dict[str, list[float]] = {a.label: [] for a in arms}
        for rep in range(reps):
            for k in range(2):
                arm = arms[(rep + k) % 2]
                times[arm.label].append(arm.run_once()["s"])
        after = {a.label: {(l.a, l.b): a.tb.link_bytes(l.a, l.b) for l in a.topo.links} for a in arms}
    rows, per_arm = [], {}
    for a in arms:
        links = {}
        for (x, y), b0 in before[a.label].items():
            b1 = after[a.label][(x, y)]
            links[f"{x}->{y}"] = b1.a_to_b - b0.a_to_b
            links[f"{y}->{x}"] = b1.b_to_a - b0.b_to_a
            rows.append({"config": a.label, "link": f"{x}-{y}", "a_to_b_bytes": links[f"{x}->{y}"],
                         "b_to_a_bytes": links[f"{y}->{x}"], "reps": reps})
        per_arm[a.label] = links
    # bytes that reach the top of the tree (the only switch, for the star)
    spine_in = sum(v for k, v in per_arm["2-level tree"].items() if k.endswith("->spine0"))
    star_in = sum(v for k, v in per_arm["one switch"].items() if k.endswith("->s0"))
    host_up_tree = sum(v for k, v in per_arm["2-level tree"].items() if k.startswith("h") and "->leaf" in k)
    _write_csv(out / "tree_scaling_links.csv", rows)
    _plot_scaling(per_arm, out / "tree_scaling.png")
    result = {
        "bench": "tree-scaling", "workers": 8, "size_bytes": size, "reps": reps, "rate_mbit": args.rate_mbit,
        "ms": {label: _quartiles([x * 1e3 for x in xs]) for label, xs in times.items()},
        "tree_vs_one_switch_time": statistics.mean(times["2-level tree"]) / statistics.mean(times["one switch"]),
        "bytes_into_top": {"2-level tree (spine0)": spine_in, "one switch (s0)": star_in},
        "top_ingress_reduction": star_in / spine_in if spine_in else None,
        "bytes_from_workers_tree": host_up_tree,
        "links": per_arm,
        "csv": str(out / "tree_scaling_links.csv"), "png": str(out / "tree_scaling.png"),
    }
    _emit(result, args, lambda: (
        f"8 workers x {size / 1e6:g} MB: tree {result['ms']['2-level tree']['mean']:.1f} ms vs one switch "
        f"{result['ms']['one switch']['mean']:.1f} ms ({result['tree_vs_one_switch_time']:.2f}x); bytes into the "
        f"top switch {spine_in / 1e6:.1f} MB vs {star_in / 1e6:.1f} MB ({result['top_ingress_reduction']:.2f}x less)"))
    return 0


def _plot_scaling(per_arm: dict[str, dict[str, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (label, links) in zip(axes, per_arm.items()):
        names = sorted(links)
        ax.bar(range(len(names)), [links[n] / 1e6 for n in names])
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_title(label)
        ax.set_ylabel("MB sent over the link")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _emit(result: dict[str, Any], args, human) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        print(human(), file=sys.stderr)
    else:
        print(human())
