"""`fanin bench goat-train`: a real training run scheduled by a GOAT plan on
the namespace testbed (issue 31 part 2; docs/goat.md, "A training run").

3 switches, 8 workers and a parameter server (examples/goat-testbed.toml),
static routing, every link rate-limited. Each worker trains one replica of
the digits MLP (`examples/train_digits.py`, 50 826 parameters) on its shard
of the data by synchronous SGD; a step's gradient is cut into the plan's
sub-models (lengths in proportion to their planned sizes) and each is
averaged through its aggregation node, so the placement decides how many
bytes cross which link, and so the step time. Arms, installed side by side
on the same daemons (different job ids) and stepped in turn, step by step,
with the same initial weights and data order:

* **goat**: GOAT's plan (`fanin.goat.plan`, LP + KRGS), as `fanin
  controller install-goat` installs it;
* **atp-like**: ATP's memory sharing settled into a static placement
  (`deploy.atp_like_plan`: the first switch on each worker's path with room
  for the sub-model, in sub-model order);
* **ps-only**: every sub-model straight to the PS (Geryon without in-network
  aggregation; a parameter server alone);
* **goat-async**: GOAT's plan trained as §V's asynchronous data plane: after
  each step the controller runs Algorithm 2 on the workers' last intervals
  (`async_.algorithm2`), and when K or the fastest K change it installs
  K_t^s on every aggregation node (`Deployment.install_quorums`, through the
  control API; its time counts in the arm's clock). A node completes a block
  with the first K_t^s contributions; once the participants have their
  result the controller ends the epoch ("cut"), and the others send at once,
  are not added, and take the same result (K-SGD: every replica stays the
  same).

Slow workers (``--slow-ranks``, ``--slow-ms``) model GOAT's heterogeneous
workers: each step they straggle that long (±25 %, the same draw in every
arm) before sending.

Every arm computes the same mathematics (the mean gradient), so their loss
curves agree step by step up to block floating point rounding; what differs
is the time a step takes. Measured per arm: the step time (slowest worker),
the held-out loss and accuracy after each step (every replica is the same:
rank 0's; that they are the same is checked by a parameter digest), the
time to reach ``--target-loss``, and the PS's ingress bytes per step on its
link. The JSON gives each arm's speed-up over ps-only in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fanin import topology
from fanin_bench.bench.goat_deploy import DEFAULT_TOPOLOGY, Arm, make_plan
from fanin_bench.bench.goat_worker import digits_param_count
from fanin_bench.bench.trees import _write_csv
from fanin_bench.plotting import save_figure

ARMS = ("goat", "atp-like", "ps-only", "goat-async")


def split_elements(plan: dict[str, Any], total: int) -> list[int]:
    """`total` parameters cut into the plan's sub-models in proportion to
    their planned sizes (each at least 1; the rounding left to the last)."""
    sizes = [float(s["size_mb"]) for s in plan["submodels"]]
    if total < len(sizes):
        raise ValueError(f"{total} parameters cannot fill {len(sizes)} sub-models")
    whole = sum(sizes)
    out = [max(1, round(total * s / whole)) for s in sizes[:-1]]
    out.append(total - sum(out))
    if out[-1] < 1:
        raise ValueError(f"sub-model sizes {sizes} leave nothing for the last one of {total} parameters")
    return out


def parse_memory(text: str) -> dict[str, float]:
    """`agg=12,tor0=4` -> {"agg": 12.0, "tor0": 4.0}."""
    out: dict[str, float] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, mb = item.partition("=")
        try:
            value = float(mb)
        except ValueError:
            value = None
        if not eq or not name.strip() or value is None:
            raise SystemExit(f"fanin bench goat-train: --switch-memory {text!r}: expected NAME=MB,..., e.g. agg=12")
        out[name.strip()] = value
    return out


def plans_of(plan: dict[str, Any], topo: topology.Topology, arms: list[str]) -> dict[str, dict[str, Any]]:
    from fanin.goat.deploy import atp_like_plan, ps_only_plan

    every = {"goat": plan, "atp-like": atp_like_plan(plan, topo), "ps-only": ps_only_plan(plan), "goat-async": plan}
    return {a: every[a] for a in arms}


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds of training (step times summed) until the held-out loss first
    reaches `target`; None if it never does."""
    for point in curve:
        if point["held_out_loss"] <= target:
            return point["time_s"]
    return None


def step_delays(slow_ranks: list[int], slow_ms: float, seed: int, step: int) -> dict[int, float]:
    """How long each slow rank straggles in `step`: slow_ms ±25 %, the same
    draw for every arm."""
    import random

    rng = random.Random(seed * 1_000_003 + step)
    return {r: slow_ms * rng.uniform(0.75, 1.25) for r in slow_ranks}


class AsyncController:
    """GOAT-Async's controller (§V) for one deployment: Algorithm 2 on the
    workers' last intervals chooses K, the K fastest take part, and K_t^s
    goes to the switches when that changes.

    Two departures from the paper, both against churn: reinstalling K_t^s
    costs control round trips (tens of ms on the testbed), and workers
    whose intervals differ by noise (8 workers computing on 2 cores finish
    in a different order every step) would otherwise swap in and out
    every epoch. `smoothing`: p_w is an exponentially weighted mean of the
    worker's intervals (the weight of the newest; 1: the last interval
    only, as the paper). `margin`: keep the current participants unless
    Algorithm 2's choice is estimated that much faster (T · H̄) than
    keeping them, and none of them has become slower than a worker left
    out (0: follow Algorithm 2 every epoch)."""

    def __init__(self, dep, ranks: list[int], margin: float = 0.1, smoothing: float = 0.3):
        from fanin.goat.async_ import Convergence

        n = len(ranks)
        # ψ's constants are not in the paper: σ²/ε = |W|/4, as `fanin bench goat` assumes
        self.conv = Convergence(epsilon=1.0, sigma2=n / 4.0, n=1)
        self.dep, self.ranks = dep, sorted(ranks)
        self.participants: set[int] | None = None  # None: every member (as admitted)
        self.k_history: list[int] = []
        self.margin, self.smoothing = margin, smoothing
        self.p: dict[int, float] = {}

    def after(self, observed: dict[int, float]) -> float:
        """Choose the next epoch's participants from this epoch's intervals;
        seconds spent installing."""
        import time

        from fanin.goat.async_ import algorithm2, estimate_total

        a = self.smoothing
        self.p = {r: observed[r] if r not in self.p else a * observed[r] + (1 - a) * self.p[r] for r in self.ranks}
        intervals = self.p
        p = [intervals[r] for r in self.ranks]
        k, best = algorithm2(p, self.conv)
        current = self.participants or set(self.ranks)
        left_out = set(self.ranks) - current
        still_fastest = not left_out or max(intervals[r] for r in current) <= min(intervals[r] for r in left_out)
        if self.margin > 0 and still_fastest and \
                estimate_total(p, len(current), self.conv) <= (1 + self.margin) * best:
            chosen = current  # not worth a reinstall
        else:
            chosen = set(sorted(self.ranks, key=lambda r: (intervals[r], r))[:k])
        self.k_history.append(len(chosen))
        if chosen == current:
            return 0.0
        t0 = time.perf_counter()
        self.dep.install_quorums(chosen)
        self.participants = chosen
        return time.perf_counter() - t0


def train_arms(topo: topology.Topology, plans: dict[str, dict[str, Any]], *, name: str, steps: int,
               rate_mbit: float, epp: int, window: int, seed: int, batch: int, lr: float,
               slow_ranks: list[int] = (), slow_ms: float = 0.0, replan_margin: float = 0.1,
               smoothing: float = 0.3, progress=None, on_path: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Every arm on one testbed, step by step in turn; {arm: curve}, a point
    per step. `on_path`: every arm's plan with GOAT's on-path filtering
    (workers send to their rack switch, which relays), every arm unkeyed."""
    from fanin_bench.testbed import Testbed, down

    down(name)  # leftovers of an interrupted earlier run of the same name
    first = next(iter(plans.values()))
    elements = split_elements(first, digits_param_count())
    curves: dict[str, list[dict[str, Any]]] = {a: [] for a in plans}
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topo, name=name, rate_mbit=rate_mbit, routing=True))
        tb.switches()
        tb.host_aggregator(first["parameter_server"]["name"])
        extra = ("--train", "digits", "--batch", str(batch), "--lr", str(lr))
        arms = [Arm(stack, tb, label, plan, job_base=100 + 2 * k * len(plan["submodels"]), bytes_per_mb=0,
                    epp=epp, window=window, seed=seed, elements=elements, worker_extra=extra,
                    quorum_ready=label == "goat-async", on_path=on_path, auth=not on_path)
                for k, (label, plan) in enumerate(plans.items())]
        controllers = {a.label: AsyncController(a.dep, a.ranks, replan_margin, smoothing) for a in arms
                       if a.label == "goat-async"}
        clock = {a.label: 0.0 for a in arms}
        for step in range(steps):
            delays = step_delays(list(slow_ranks), slow_ms, seed, step)
            for k in range(len(arms)):
                arm = arms[(step + k) % len(arms)]  # each arm goes first in turn
                ctl = controllers.get(arm.label)
                k_used = len(ctl.participants) if ctl and ctl.participants else len(arm.ranks)
                answers, whole = arm.step(delays, ctl.participants if ctl else None)
                rank0 = min(answers, key=lambda a: a["rank"])
                control_s = 0.0
                if ctl:
                    control_s = ctl.after({a["rank"]: a["compute_s"] + delays.get(a["rank"], 0.0) for a in answers})
                clock[arm.label] += whole["s"] + control_s
                curves[arm.label].append({
                    "step": step + 1, "time_s": clock[arm.label], "step_s": whole["s"], "control_s": control_s,
                    "k": k_used, "cut": sum(1 for a in answers if a["cut"]),
                    "comm_s": max(a["comm_s"] for a in answers), "loss": statistics.mean(a["loss"] for a in answers),
                    "held_out_loss": rank0["held_out_loss"], "accuracy": rank0["accuracy"],
                    "replicas_agree": len({a["param_digest"] for a in answers}) == 1,
                    "retransmissions": whole["retransmissions"], "ps_ingress_bytes": whole["ps_ingress_bytes"]})
            if progress is not None:
                progress(step + 1)
    return curves


def run_goat_train(args) -> int:
    from fanin_bench.testbed import check_privileges

    check_privileges()
    topo = topology.load(args.topology or str(DEFAULT_TOPOLOGY))
    if args.switch_memory:
        topo = topology.with_memory(topo, parse_memory(args.switch_memory))
    if not (args.even or args.submodels):
        args.even = "12,6"
    args.model, args.max_submodel_mb = None, None  # (make_plan's other sources of sub-models)
    plan = make_plan(topo, args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"fanin bench goat-train: --arms {args.arms!r}: choose from {', '.join(ARMS)}")
    steps = args.steps or (60 if args.quick else 100)
    target = args.target_loss
    plans = plans_of(plan, topo, arms)
    print(f"goat-train: {len(plan['workers'])} workers, {len(plan['submodels'])} sub-models, {steps} steps per arm "
          f"({', '.join(arms)}), links {args.rate_mbit:g} Mbit/s", file=sys.stderr)
    bar = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=steps, unit="step", file=sys.stderr)
    slow_ranks = [int(r) for r in args.slow_ranks.split(",") if r.strip()] if args.slow_ranks else []
    n_workers = len(plan["workers"])
    if any(not 0 <= r < n_workers for r in slow_ranks):
        raise SystemExit(f"fanin bench goat-train: --slow-ranks {args.slow_ranks!r}: ranks are 0..{n_workers - 1}")
    if slow_ranks and not args.slow_ms > 0:
        raise SystemExit("fanin bench goat-train: --slow-ranks needs --slow-ms > 0 (how long they straggle)")
    if not 0 < args.smoothing <= 1:
        raise SystemExit(f"fanin bench goat-train: --smoothing {args.smoothing} must be in (0, 1] (1: the last interval)")
    if not args.replan_margin >= 0:
        raise SystemExit(f"fanin bench goat-train: --replan-margin {args.replan_margin} must be >= 0")
    curves = train_arms(topo, plans, name=f"gt{os.getpid() % 100000}", steps=steps, rate_mbit=args.rate_mbit,
                        epp=args.elems_per_packet, window=args.window, seed=args.seed, batch=args.batch, lr=args.lr,
                        slow_ranks=slow_ranks, slow_ms=args.slow_ms, replan_margin=args.replan_margin,
                        smoothing=args.smoothing, on_path=args.on_path,
                        progress=(lambda n: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "goat_train.csv", [{"arm": a, **p} for a, c in curves.items() for p in c])
    summary = {}
    for arm, curve in curves.items():
        summary[arm] = {
            "ps_mb_planned": plans[arm].get("ps_mb"),
            "step_ms_median": 1e3 * statistics.median(p["step_s"] for p in curve),
            "comm_ms_median": 1e3 * statistics.median(p["comm_s"] for p in curve),
            "steps_per_s": len(curve) / curve[-1]["time_s"],
            "ps_ingress_bytes_per_step": statistics.median(p["ps_ingress_bytes"] for p in curve),
            "time_to_target_s": time_to(curve, target),
            "held_out_loss_final": curve[-1]["held_out_loss"], "accuracy_final": curve[-1]["accuracy"],
            "replicas_agree": all(p["replicas_agree"] for p in curve),
            "k_median": statistics.median(p["k"] for p in curve), "control_s": sum(p["control_s"] for p in curve),
            "cut_gradients": sum(p["cut"] for p in curve),
            "retransmissions": sum(p["retransmissions"] for p in curve)}
    base = summary.get("ps-only")
    for arm, s in summary.items():
        if base and arm != "ps-only":
            s["speedup_vs_ps_only"] = base["step_ms_median"] / s["step_ms_median"]
            if s["time_to_target_s"] and base["time_to_target_s"]:
                s["time_to_target_vs_ps_only"] = base["time_to_target_s"] / s["time_to_target_s"]
    png = out / "goat_train.png"
    if not args.no_plot:
        _plot(curves, target, png, args.rate_mbit,
              f", rank{'s' * (len(slow_ranks) > 1)} {args.slow_ranks} {args.slow_ms:g} ms slow" if slow_ranks else "")
    result = {"bench": "goat-train", "topology": topo.name, "workers": len(plan["workers"]),
              "switch_memory_mb": {s.name: s.memory_mb for s in topo.switches},
              "submodels": len(plan["submodels"]), "params": digits_param_count(),
              "elements": split_elements(plan, digits_param_count()), "steps": steps, "rate_mbit": args.rate_mbit,
              "batch_per_worker": args.batch, "lr": args.lr, "target_loss": target,
              "slow_ranks": slow_ranks, "slow_ms": args.slow_ms, "replan_margin": args.replan_margin,
              "smoothing": args.smoothing, "on_path": args.on_path, "keyed": not args.on_path,
              "arms": summary,
              "all_replicas_agree": all(s["replicas_agree"] for s in summary.values()),
              "csv": str(out / "goat_train.csv"), "png": None if args.no_plot else str(png)}
    human = f"goat-train: {steps} steps per arm at {args.rate_mbit:g} Mbit/s, target held-out loss {target}\n" + "\n".join(
        f"{arm:>9}: step {s['step_ms_median']:.0f} ms, PS ingress {s['ps_ingress_bytes_per_step'] / 1e3:.0f} kB/step, "
        f"to target {_secs(s['time_to_target_s'])}, final held-out loss {s['held_out_loss_final']:.3f} "
        f"(accuracy {s['accuracy_final']:.3f})"
        + (f", {s['speedup_vs_ps_only']:.2f}x ps-only" if "speedup_vs_ps_only" in s else "")
        for arm, s in summary.items())
    if args.json:
        print(json.dumps(result, indent=2))
        print(human, file=sys.stderr)
    else:
        print(human)
    return 0 if result["all_replicas_agree"] else 1


def _secs(s: float | None) -> str:
    return "not reached" if s is None else f"{s:.1f} s"


def _plot(curves: dict[str, list[dict[str, Any]]], target: float, path: Path, rate: float, slow: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for arm, curve in curves.items():
        ax.plot([p["time_s"] for p in curve], [p["held_out_loss"] for p in curve], label=arm)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target}")
    ax.set_xlabel("training time (s, step times summed)")
    ax.set_ylabel("held-out loss")
    ax.set_yscale("log")
    ax.set_title(f"GOAT training run: digits MLP, 8 workers, 3 switches + PS, {rate:g} Mbit/s links{slow}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
