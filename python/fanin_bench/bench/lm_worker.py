"""One rank of `fanin bench lm-steps` (and `image-steps`, `time-to-accuracy
--model lm`), started in a testbed host namespace: sets the environment
torchrun would (rank, world, master) plus the fanin switch and the interface
Gloo uses, runs ``train`` of `examples/train_lm.py` (or `--example
train_resnet`) with the arguments after ``--``, and prints its figures as
one JSON line.

    python -m fanin_bench.bench.lm_worker --rank 0 --world 4 --master 10.1.0.2:29701 \\
        --ifname veth-h0 --switch 10.1.0.1:9000 --job 1 -- --backend fanin --steps 80
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path


def load_example(name: str = "train_lm") -> object:
    """`examples/<name>.py` of this checkout (the one this package was
    installed from in editable mode, or the working directory's), as a module."""
    candidates = [Path(__file__).resolve().parents[3] / "examples" / f"{name}.py",
                  Path.cwd() / "examples" / f"{name}.py"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise SystemExit(f"lm_worker: examples/{name}.py not found at {' or '.join(map(str, candidates))} "
                         "(the benchmark runs from a checkout: cd into it)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m fanin_bench.bench.lm_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's c10d store")
    p.add_argument("--ifname", required=True, help="the interface Gloo uses")
    p.add_argument("--switch", required=True, help="HOST:PORT of the switch's data port")
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--example", default="train_lm", choices=("train_lm", "train_resnet"),
                   help="the training script of examples/ to run (default %(default)s)")
    p.add_argument("--straggler-p", type=float, default=0.0,
                   help="Slow Worker Pattern (Trio-ML §6.1): probability per delay point")
    p.add_argument("--typical-step-s", type=float, default=0.0, help="the straggler sleeps' scale")
    p.add_argument("--seed", type=int, default=1, help="of the straggler schedule (the same on every rank)")
    a = p.parse_args(argv[:split])
    host, port = a.master.rsplit(":", 1)
    os.environ.update({"RANK": str(a.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(a.world), "MASTER_ADDR": host,
                       "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": a.ifname, "FANIN_SWITCH": a.switch,
                       "FANIN_JOB_ID": str(a.job), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    from fanin_bench.bench.torch_train import SlowWorkerPattern

    slow = SlowWorkerPattern(a.straggler_p, a.typical_step_s, a.world, a.seed + 7)
    example = load_example(a.example)
    figures = example.train(example.parser().parse_args(argv[split + 1:]), log=lambda line: None, delay=slow.point)
    figures.update({"straggle_events": slow.events, "slept_s": slow.slept_s})
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # The report is out and the group destroyed. Leave without the
    # interpreter's teardown: a Gloo rank's C++ threads can still be joinable
    # when their static destructors run, and the process then aborts
    # ("terminate called without an active exception", exit 134) after a
    # complete, correct run; CI saw it despite the barrier before teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
