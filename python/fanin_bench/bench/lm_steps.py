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
``gloo`` (DDP's own allreduce). Reported: steps per second (rank 0's clock
over all steps), the held-out loss at the end (the systems must agree),
and fanin's speed over Gloo's.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fanin import topology
from fanin.switch import job_config
from fanin_bench.plotting import save_figure
from fanin_bench.report import emit

JOB = 1
SYSTEMS = {"fanin": ("fanin", "none"), "fanin-fp16": ("fanin", "float16"), "gloo": ("gloo", "none")}


def _run_system(tb: Any, hosts: list[str], system: str, steps: int, port: int, extra: list[str]) -> dict[str, Any]:
    backend, compress = SYSTEMS[system]
    master = tb.addr(hosts[0], toward="s0")
    procs = []
    for rank, h in enumerate(hosts):
        argv = [sys.executable, "-m", "fanin_bench.bench.lm_worker", "--rank", str(rank), "--world", str(len(hosts)),
                "--master", f"{master}:{port}", "--ifname", tb.interface(h, "s0"),
                "--switch", f"{tb.addr('s0', toward=h)}:{tb.SWITCH_DATA_PORT}", "--job", str(JOB), "--",
                "--backend", backend, "--compress", compress, "--steps", str(steps), "--log-every", str(steps), *extra]
        procs.append(tb.popen(h, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"lm-steps {system} rank {rank} failed: {err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    r0 = reports[0]
    return {"system": system, "steps_per_s": r0["steps_per_s"], "seconds": r0["seconds"],
            "held_out_bits_per_byte": r0["held_out_bits_per_byte_last"], "params": r0["params"]}


def run_lm_steps(args: Any) -> int:
    from fanin_bench.testbed import Testbed, why_unavailable

    why = why_unavailable()
    if why:
        print(f"fanin bench lm-steps: needs the namespace testbed: {why}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
    except ImportError:
        print("fanin bench lm-steps: PyTorch is not installed (pip install -r requirements-bench.txt)", file=sys.stderr)
        return 2
    rates = [float(r) for r in (args.rates or ("100" if args.quick else "50,100,200")).split(",")]
    steps = args.steps or (30 if args.quick else 80)
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"fanin bench lm-steps: unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    n = args.workers
    hosts = [f"h{i}" for i in range(n)]
    extra = ["--layers", str(args.layers), "--d-model", str(args.d_model), "--corpus-mb", str(args.corpus_mb)]
    out = Path(args.out)
    print(f"lm-steps: star:{n}, {steps} steps per system, links {args.rates or rates} Mbit/s", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    port = 29700
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topology.load(f"star:{n}"), name=args.name, rate_mbit=rates[0],
                                            routing=True))
        tb.switch("s0", jobs=[job_config(JOB, n)])
        for rate in rates:
            tb.set_rate(rate)
            row: dict[str, Any] = {"rate_mbit": rate}
            for system in systems:
                port += 1
                r = _run_system(tb, hosts, system, steps, port, extra)
                row[f"{system}_steps_per_s"] = r["steps_per_s"]
                row[f"{system}_held_out_bits_per_byte"] = r["held_out_bits_per_byte"]
                row["params"] = r["params"]
                print(f"  {rate:g} Mbit/s {system}: {r['steps_per_s']:.2f} steps/s, held-out "
                      f"{r['held_out_bits_per_byte']:.3f} bits/byte", file=sys.stderr)
            if "gloo" in systems:
                for system in systems:
                    if system != "gloo":
                        row[f"{system}_vs_gloo"] = row[f"{system}_steps_per_s"] / row["gloo_steps_per_s"]
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "lm_steps.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, systems, out / "lm_steps.png", n)
    result = {"workers": n, "steps": steps, "systems": systems, "model": {"layers": args.layers,
              "d_model": args.d_model, "params": rows[0]["params"]}, "rates": rows,
              "csv": str(out / "lm_steps.csv"), "png": str(out / "lm_steps.png")}
    human = "; ".join(f"{r['rate_mbit']:g} Mbit/s: " + ", ".join(f"{s} {r[f'{s}_steps_per_s']:.2f}" for s in systems)
                      + " steps/s" + (f" (fanin {r['fanin_vs_gloo']:.2f}x Gloo)" if "fanin_vs_gloo" in r else "")
                      for r in rows)
    emit(result, f"lm-steps, {n} workers: {human}", args.json)
    return 0


def _plot(rows: list[dict[str, Any]], systems: list[str], path: Path, n: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fanin bench lm-steps: matplotlib is not installed, no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [r["rate_mbit"] for r in rows]
    for s in systems:
        ax.plot(x, [r[f"{s}_steps_per_s"] for r in rows], "o-", label=s)
    ax.set_xscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:g}" for v in x])
    ax.set_xlabel("link rate (Mbit/s, tbf on every link)")
    ax.set_ylabel("DDP steps per second")
    ax.set_title(f"byte-level GPT, star:{n}, {rows[0]['params'] / 1e6:.2f} M parameters")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
