"""`fanin bench lm-steps`: DDP training speed of the byte-level language
model (`examples/train_lm.py`) on a rate-limited network, fanin vs Gloo.

A star testbed (``star:N``, every veth limited by tbf both ways, routing
on), the real switch daemon in the switch namespace with one job of N
members, one training process per host namespace (``RANK``/``WORLD_SIZE``
as torchrun would set them; Gloo's traffic, and the fanin group's Gloo
fallback, on the testbed links). For every link rate, every system trains
the same model from the same seed for the same steps: ``fanin``
(``allreduce_hook``, float32 gradients), ``fanin-fp16``
(``fp16_compress_hook``: 2 bytes per gradient element each way) and
``gloo`` (DDP's own allreduce); with FSDP2 (``fully_shard``, gradients
reduce-scattered) ``fanin-fsdp``, ``fanin-fsdp-fp16`` (reduce dtype
float16) and ``gloo-fsdp``. ``--device cuda`` trains on the GPU (the ranks
share it; the namespaces do not hide it). Reported: steps per second (rank
0's clock over all steps, evaluation excluded), the held-out loss at the
end (the systems must agree), and each fanin system's speed over Gloo's
with the same parallelism.

`fanin bench time-to-accuracy --model lm` (:func:`run_lm_time_to_accuracy`)
trains the same model on the same testbed with the Slow Worker Pattern.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from fanin import topology
from fanin.switch import job_config
from fanin_bench.plotting import save_figure
from fanin_bench.report import emit

JOB = 1
# name -> (backend, gradient dtype on the wire, FSDP2)
SYSTEMS = {"fanin": ("fanin", "none", False), "fanin-fp16": ("fanin", "float16", False),
           "gloo": ("gloo", "none", False), "fanin-fsdp": ("fanin", "none", True),
           "fanin-fsdp-fp16": ("fanin", "float16", True), "gloo-fsdp": ("gloo", "none", True)}


def baseline(system: str) -> str:
    """The Gloo system a fanin system is compared with: the same parallelism."""
    return "gloo-fsdp" if SYSTEMS[system][2] else "gloo"


def run_system(tb: Any, hosts: list[str], system: str, steps: int, port: int, extra: list[str],
               job: int = JOB, worker_extra: tuple[str, ...] = (), log_every: int = 0,
               example: str = "train_lm", overlap_steps: int = 0) -> dict[str, Any]:
    """One training run of `examples/<example>.py` on every host: rank 0's
    figures, with the switch's counters summed over the ranks."""
    backend, compress, fsdp = SYSTEMS[system]
    master = tb.addr(hosts[0], toward="s0")
    procs = []
    for rank, h in enumerate(hosts):
        argv = [sys.executable, "-m", "fanin_bench.bench.lm_worker", "--rank", str(rank), "--world", str(len(hosts)),
                "--master", f"{master}:{port}", "--ifname", tb.interface(h, "s0"),
                "--switch", f"{tb.addr('s0', toward=h)}:{tb.SWITCH_DATA_PORT}", "--job", str(job),
                "--example", example, *worker_extra,
                "--", "--backend", backend, "--compress", compress, "--steps", str(steps),
                "--log-every", str(log_every or steps), *(["--fsdp"] if fsdp else []),
                *(["--overlap-steps", str(overlap_steps)] if overlap_steps and not fsdp else []), *extra]
        procs.append(tb.popen(h, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"lm-steps {system} rank {rank} failed: {err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    check_replicas_agree(system, reports)
    r0 = reports[0]
    return {**r0, "system": system, "held_out_bits_per_byte": r0.get("held_out_bits_per_byte_last"),
            "straggle_events": r0.get("straggle_events", 0),
            "degraded_blocks": sum(r.get("degraded_blocks", 0) for r in reports),
            "missed_blocks": sum(r.get("missed_blocks", 0) for r in reports),
            "replicas_agree": True}


def check_replicas_agree(system: str, reports: list[dict[str, Any]]) -> None:
    """Every rank ended with the same parameters (`param_digest`), or raise:
    replicas that went apart had different sums, a wrong result."""
    digests = {r.get("param_digest") for r in reports}
    if None in digests or len(digests) != 1:
        missing = sum(r.get("param_digest") is None for r in reports)
        raise RuntimeError(f"{system}: the ranks' parameters differ after training ({len(digests - {None})} distinct "
                           f"digests, {missing} ranks without one): the replicas went apart")


def rates_by_systems(name: str, n: int, rates: list[float], systems: list[str], port: int,
                     run: Any, record: Any) -> list[dict[str, Any]]:
    """The training benches' procedure: a `star:n` testbed with one switch
    job of n members; at every link rate, every system in turn
    (``run(tb, system, port)`` -> rank 0's figures, ``record(rate, system,
    figures, row)`` adds the bench's own columns and prints). Each row has
    the steps per second, the parameters, the device, and each fanin
    system's speed over its Gloo baseline."""
    from fanin_bench.testbed import Testbed

    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topology.load(f"star:{n}"), name=name, rate_mbit=rates[0], routing=True))
        tb.switch("s0", jobs=[job_config(JOB, n)])
        for rate in rates:
            tb.set_rate(rate)
            row: dict[str, Any] = {"rate_mbit": rate}
            for system in systems:
                port += 1
                r = run(tb, system, port)
                row[f"{system}_steps_per_s"] = r["steps_per_s"]
                row["params"], row["device"] = r["params"], r["device"]
                record(rate, system, r, row)
            for system in systems:
                if not system.startswith("gloo") and baseline(system) in systems:
                    row[f"{system}_vs_gloo"] = row[f"{system}_steps_per_s"] / row[f"{baseline(system)}_steps_per_s"]
            rows.append(row)
    return rows


#: How far (bits per byte) a fanin system's held-out loss may end from its
#: Gloo baseline's after the same steps from the same seeds: the sums differ
#: only in rounding (block floating point, or 16 bits on the wire), which
#: moves the loss in the third decimal; a wrong sum moves it much more.
LOSS_TOLERANCE = 0.05


def check_losses_agree(rows: list[dict[str, Any]], systems: list[str]) -> None:
    """Record each fanin system's held-out loss minus its Gloo baseline's
    (`<system>_loss_vs_gloo`); raise when one is beyond LOSS_TOLERANCE."""
    for row in rows:
        for system in systems:
            base = baseline(system)
            if system.startswith("gloo") or base not in systems:
                continue
            diff = row[f"{system}_held_out_bits_per_byte"] - row[f"{base}_held_out_bits_per_byte"]
            row[f"{system}_loss_vs_gloo"] = diff
            if abs(diff) > LOSS_TOLERANCE:
                raise RuntimeError(f"lm-steps: at {row['rate_mbit']:g} Mbit/s {system} ended at a held-out loss "
                                   f"{diff:+.3f} bits per byte from {base}'s (allowed ±{LOSS_TOLERANCE}): "
                                   "the same training from the same seeds must end at the same loss")


def model_args(args: Any) -> list[str]:
    """The example's arguments for the model and the device."""
    return ["--layers", str(args.layers), "--d-model", str(args.d_model), "--corpus-mb", str(args.corpus_mb),
            "--corpus", args.corpus, "--batch", str(args.batch), "--context", str(args.context), "--device", args.device,
            "--bucket-mb", str(args.bucket_mb)]


def cannot_run(bench: str) -> bool:
    """Say why a training bench cannot run here (no namespace testbed, no
    PyTorch) on stderr; True if so (the command exits 2)."""
    from fanin_bench.testbed import why_unavailable

    why = why_unavailable()
    if why:
        print(f"fanin bench {bench}: needs the namespace testbed: {why}", file=sys.stderr)
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"fanin bench {bench}: PyTorch is not installed (pip install -r requirements-bench.txt)", file=sys.stderr)
        return True
    return False


def bench_plan(args: Any, bench: str, known: Any, rates: tuple[str, str], steps: tuple[int, int]
               ) -> tuple[list[float], int, list[str], list[str]]:
    """A training bench's link rates, steps, systems (checked against
    `known`) and hosts, from its arguments and its (quick, full) defaults."""
    rate_list = [float(r) for r in (args.rates or (rates[0] if args.quick else rates[1])).split(",")]
    systems = args.systems.split(",")
    for s in systems:
        if s not in known:
            raise SystemExit(f"fanin bench {bench}: unknown system {s!r} (choose from {', '.join(known)})")
    return rate_list, args.steps or (steps[0] if args.quick else steps[1]), systems, [f"h{i}" for i in range(args.workers)]


def run_lm_steps(args: Any) -> int:
    if cannot_run("lm-steps"):
        return 2
    rates, steps, systems, hosts = bench_plan(args, "lm-steps", SYSTEMS, ("100", "50,100,200"), (30, 80))
    n = args.workers
    extra = model_args(args)
    out = Path(args.out)
    print(f"lm-steps: star:{n}, {steps} steps per system, links {args.rates or rates} Mbit/s", file=sys.stderr)
    def record(rate: float, system: str, r: dict[str, Any], row: dict[str, Any]) -> None:
        row[f"{system}_held_out_bits_per_byte"] = r["held_out_bits_per_byte"]
        timing = ""
        if "overlap" in r:  # rank 0's: DDP's communication hidden by the backward pass
            for k in ("step_s", "compute_s", "comm_s", "overlap"):
                row[f"{system}_{k}"] = r[k]
            timing = (f"; forward+backward {r['step_s'] * 1e3:.1f} ms = compute {r['compute_s'] * 1e3:.1f} ms + "
                      f"gradients alone {r['comm_s'] * 1e3:.1f} ms, {r['overlap']:.0%} of it hidden")
        print(f"  {rate:g} Mbit/s {system}: {r['steps_per_s']:.2f} steps/s, held-out "
              f"{r['held_out_bits_per_byte']:.3f} bits/byte{timing}", file=sys.stderr, flush=True)

    rows = rates_by_systems(args.name, n, rates, systems, 29700,
                            lambda tb, system, port: run_system(tb, hosts, system, steps, port, extra,
                                                                overlap_steps=args.overlap_steps), record)
    check_losses_agree(rows, systems)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "lm_steps.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, systems, out / "lm_steps.png",
          f"byte-level GPT, star:{n}, {rows[0]['params'] / 1e6:.2f} M parameters, {rows[0]['device']}")
    result = {"workers": n, "steps": steps, "systems": systems, "device": rows[0]["device"],
              "model": {"layers": args.layers, "d_model": args.d_model, "batch": args.batch,
                        "context": args.context, "params": rows[0]["params"]}, "rates": rows,
              "csv": str(out / "lm_steps.csv"), "png": str(out / "lm_steps.png")}
    human = "; ".join(f"{r['rate_mbit']:g} Mbit/s: " + ", ".join(f"{s} {r[f'{s}_steps_per_s']:.2f}" for s in systems)
                      + " steps/s" + "".join(f" ({s} {r[f'{s}_vs_gloo']:.2f}x)" for s in systems
                                             if f"{s}_vs_gloo" in r)
                      for r in rows)
    emit(result, f"lm-steps, {n} workers: {human}", args.json)
    return 0


def _plot(rows: list[dict[str, Any]], systems: list[str], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fanin bench: matplotlib is not installed, no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [r["rate_mbit"] for r in rows]
    for s in systems:
        ax.plot(x, [r[f"{s}_steps_per_s"] for r in rows], "o-", label=s)
    ax.set_xscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:g}" for v in x])
    ax.set_xlabel("link rate (Mbit/s, tbf on every link)")
    ax.set_ylabel("training steps per second")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- time to a target loss
TTA_JOB_PLAIN, TTA_JOB_MITIGATION = 1, 2


def time_to_target(curve: list[dict[str, Any]], target: float) -> Optional[float]:
    """Training seconds at the first evaluation at or below ``target``
    (bits per byte), interpolated linearly from the evaluation before."""
    prev = None
    for point in curve:
        if point["held_out_bits_per_byte"] <= target:
            if prev is None:
                return point["seconds"]
            frac = (prev["held_out_bits_per_byte"] - target) / (prev["held_out_bits_per_byte"] -
                                                                  point["held_out_bits_per_byte"])
            return prev["seconds"] + frac * (point["seconds"] - prev["seconds"])
        prev = point
    return None


def run_lm_time_to_accuracy(args: Any) -> int:
    """Trio-ML Fig. 12 on the language model: Gloo without stragglers (the
    ideal), fanin without stragglers, and fanin with the Slow Worker Pattern
    without and with straggler mitigation (job 1: ``block_exp_ms`` 0, job 2:
    ``block_exp_ms`` as given), on the namespace testbed at one link rate."""
    from fanin_bench.testbed import Testbed

    if cannot_run("time-to-accuracy --model lm"):
        return 2
    n, rate = args.workers, args.rate_mbit
    steps = args.steps or (60 if args.quick else 200)
    repeats = args.repeats or 1
    every = max(1, steps // 20)
    hosts = [f"h{i}" for i in range(n)]
    extra = model_args(args)
    arms: dict[str, list[dict[str, Any]]] = {}
    port = 29800
    print(f"time-to-accuracy (lm): star:{n} at {rate:g} Mbit/s, {steps} steps, p={args.straggler_p:.0%}, "
          f"block_exp_ms={args.block_exp_ms}", file=sys.stderr)
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topology.load(f"star:{n}"), name=args.name, rate_mbit=rate, routing=True))
        tb.switch("s0", jobs=[job_config(TTA_JOB_PLAIN, n),
                              job_config(TTA_JOB_MITIGATION, n, block_exp_ms=args.block_exp_ms)])

        def run(arm: str, system: str, job: int, slow: tuple[str, ...]) -> None:
            nonlocal port
            port += 1
            r = run_system(tb, hosts, system, steps, port, extra, job=job,
                           worker_extra=("--seed", str(args.seed), *slow), log_every=every)
            arms.setdefault(arm, []).append(r)
            print(f"  {arm}: {r['steps_per_s']:.2f} steps/s, held-out {r['held_out_bits_per_byte']:.3f} bits/byte, "
                  f"{r['straggle_events']} straggle events, {r['degraded_blocks']} degraded blocks",
                  file=sys.stderr, flush=True)

        for _ in range(repeats):
            run("gloo_ideal", "gloo", TTA_JOB_PLAIN, ())
            typical = args.typical_iter_s or statistics.median(r["seconds"] / steps for r in arms["gloo_ideal"])
            slow = ("--straggler-p", str(args.straggler_p), "--typical-step-s", f"{typical:.6f}")
            run("fanin_no_stragglers", "fanin", TTA_JOB_PLAIN, ())
            run("fanin_no_mitigation", "fanin", TTA_JOB_PLAIN, slow)
            run("fanin_mitigation", "fanin", TTA_JOB_MITIGATION, slow)
    # the target: what the ideal reaches at 80 % of its steps, unless given
    ideal_curve = arms["gloo_ideal"][0]["curve"]
    target = args.target_bits or next(p["held_out_bits_per_byte"] for p in ideal_curve if p["step"] >= 0.8 * steps)
    summary: dict[str, Any] = {}
    for arm, runs in arms.items():
        times = [time_to_target(r["curve"], target) for r in runs]
        summary[arm] = {"runs": len(runs), "time_to_target_s": times,
                        "time_to_target_median_s": statistics.median(times) if None not in times else None,
                        "steps_per_s_median": statistics.median(r["steps_per_s"] for r in runs),
                        "final_bits_per_byte": [r["held_out_bits_per_byte"] for r in runs],
                        "straggle_events": sum(r["straggle_events"] for r in runs),
                        "degraded_blocks": sum(r["degraded_blocks"] for r in runs),
                        "missed_blocks": sum(r["missed_blocks"] for r in runs)}
    ideal = summary["gloo_ideal"]["time_to_target_median_s"]
    own = summary["fanin_no_stragglers"]["time_to_target_median_s"]
    for s in summary.values():
        t = s["time_to_target_median_s"]
        # `vs_ideal`: against Gloo without stragglers (Trio-ML Fig. 12's
        # baseline); `vs_own_no_stragglers`: against fanin without them, the
        # stricter figure when fanin alone is faster than Gloo
        # (docs/stragglers.md, "Skew-aware expiry")
        s["vs_ideal"] = t / ideal if (t and ideal) else None
        s["vs_own_no_stragglers"] = t / own if (t and own) else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / "lm-time-to-accuracy.csv", out / "lm-time-to-accuracy.png"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "repeat", "step", "seconds", "held_out_bits_per_byte"])
        for arm, runs in arms.items():
            for i, r in enumerate(runs):
                for p in r["curve"]:
                    w.writerow([arm, i, p["step"], f"{p['seconds']:.4f}", f"{p['held_out_bits_per_byte']:.4f}"])
    _plot_tta(arms, target, args, png_path)
    result = {"bench": "time-to-accuracy", "model": "lm", "workers": n, "rate_mbit": rate, "steps": steps,
              "straggler_p": args.straggler_p, "block_exp_ms": args.block_exp_ms, "target_bits_per_byte": target,
              "device": arms["gloo_ideal"][0]["device"], "params": arms["gloo_ideal"][0]["params"],
              "summary": summary, "csv": str(csv_path), "png": str(png_path)}
    lines = [f"time-to-accuracy (lm, {n} workers, {rate:g} Mbit/s, p={args.straggler_p:.0%}, "
             f"target {target:.3f} bits/byte):"]
    for arm, s in summary.items():
        t = s["time_to_target_median_s"]
        lines.append(f"  {arm:20s} {('%.2f s' % t) if t else 'not reached':>12s}"
                     + (f" ({s['vs_ideal']:.2f}x Gloo without stragglers, {s['vs_own_no_stragglers']:.2f}x fanin "
                        "without them)" if s["vs_ideal"] and s["vs_own_no_stragglers"] else "")
                     + f", {s['steps_per_s_median']:.2f} steps/s, {s['degraded_blocks']} degraded blocks")
    emit(result, "\n".join(lines), args.json)
    return 0


def _plot_tta(arms: dict[str, list[dict[str, Any]]], target: float, args: Any, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fanin bench time-to-accuracy: matplotlib is not installed, no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, runs in arms.items():
        c = runs[0]["curve"]
        ax.plot([p["seconds"] for p in c], [p["held_out_bits_per_byte"] for p in c], "o-", ms=3, label=arm)
    ax.axhline(target, color="grey", ls=":", label=f"target {target:.2f}")
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("held-out loss (bits per byte)")
    ax.set_title(f"byte-level GPT, {args.workers} workers, {args.rate_mbit:g} Mbit/s, stragglers p={args.straggler_p:.0%}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
