"""`fanin bench image-steps`: DDP training throughput of ResNet-18 (random
initialisation, synthetic images; `examples/train_resnet.py`) on a
rate-limited network, fanin vs Gloo.

The same testbed and procedure as `fanin bench lm-steps` (star:N, tbf on
every veth, the switch daemon in the switch namespace, one training process
per host namespace, the same seed for every system): ``fanin``
(``allreduce_hook``, 46.8 MB of float32 gradients per step), ``fanin-fp16``
(``fp16_compress_hook``: 2 bytes per element each way) and ``gloo``.
Reported per link rate: images per second (rank 0's clock over the timed
steps, after a warm-up), fanin's speed over Gloo's, and whether every
rank ended with the same parameters.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from fanin_bench.bench.lm_steps import _plot, bench_plan, cannot_run, rates_by_systems, run_system
from fanin_bench.report import emit

SYSTEMS = ("fanin", "fanin-fp16", "gloo")


def run_image_steps(args: Any) -> int:
    if cannot_run("image-steps"):
        return 2
    rates, steps, systems, hosts = bench_plan(args, "image-steps", SYSTEMS, ("200", "200,400"), (4, 20))
    n = args.workers
    extra = ["--batch", str(args.batch), "--image-size", str(args.image_size), "--device", args.device,
             "--warmup", str(args.warmup)]
    print(f"image-steps: star:{n}, ResNet-18, {steps} timed steps per system, {args.batch} images of "
          f"{args.image_size}x{args.image_size} per worker, links {','.join(f'{r:g}' for r in rates)} Mbit/s",
          file=sys.stderr)
    def record(rate: float, system: str, r: dict[str, Any], row: dict[str, Any]) -> None:
        row[f"{system}_images_per_s"] = r["images_per_s"]
        row[f"{system}_replicas_agree"] = r["replicas_agree"]
        print(f"  {rate:g} Mbit/s {system}: {r['images_per_s']:.1f} images/s ({r['steps_per_s']:.2f} steps/s)",
              file=sys.stderr, flush=True)

    rows = rates_by_systems(args.name, n, rates, systems, 29900,
                            lambda tb, system, port: run_system(tb, hosts, system, steps, port, extra,
                                                                example="train_resnet"), record)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "image_steps.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, systems, out / "image_steps.png",
          f"ResNet-18, star:{n}, {args.batch}x{args.image_size}px per worker, {rows[0]['device']}")
    result = {"bench": "image-steps", "model": "resnet18", "workers": n, "steps": steps, "systems": systems,
              "device": rows[0]["device"], "params": rows[0]["params"], "batch": args.batch,
              "image_size": args.image_size, "rates": rows, "csv": str(out / "image_steps.csv"),
              "png": str(out / "image_steps.png")}
    human = "; ".join(f"{r['rate_mbit']:g} Mbit/s: " + ", ".join(f"{s} {r[f'{s}_images_per_s']:.1f}" for s in systems)
                      + " images/s" + "".join(f" ({s} {r[f'{s}_vs_gloo']:.2f}x)" for s in systems
                                              if f"{s}_vs_gloo" in r) for r in rows)
    emit(result, f"image-steps, {n} workers: {human}", args.json)
    return 0
