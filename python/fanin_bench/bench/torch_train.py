"""Data-parallel training of a small MLP on scikit-learn's bundled digits
(offline), one torchrun worker per rank. Used by ``fanin bench
time-to-accuracy``; ``examples/train_digits.py`` is the readable version.

Run under torchrun::

    torchrun --nproc-per-node 4 -m fanin_bench.bench.torch_train --backend fanin --out run.json

Straggler injection follows Trio-ML §6.1 ("Slow Worker Pattern", after
[38]): each iteration has three delay points; at each, with probability
``p``, one worker (chosen at random) sleeps for U(0.5, 2) x the typical
iteration time. Every rank draws from the same seeded generator, so all
agree on the schedule and the run is reproducible.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8x8 digits bundled with scikit-learn (1,797 images; nothing is downloaded):
    75 % train, 25 % test, stratified, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    g = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return f(xtr), g(ytr), f(xte), g(yte)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


class SlowWorkerPattern:
    def __init__(self, p: float, typical_s: float, world: int, seed: int) -> None:
        self.p, self.typical_s, self.world = p, typical_s, world
        self.rng = random.Random(seed)
        self.events = 0
        self.slept_s = 0.0

    def point(self, rank: int) -> None:
        if self.p <= 0:
            return
        if self.rng.random() < self.p:
            victim = self.rng.randrange(self.world)
            dur = self.rng.uniform(0.5, 2.0) * self.typical_s
            self.events += 1
            if rank == victim:
                self.slept_s += dur
                time.sleep(dur)


def train(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "fanin":
        import fanin.torch as ft  # registers the backend
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_digits_split(args.seed)
    # each rank trains on its own shard of the training set
    shard = torch.arange(rank, len(xtr), world)
    xs, ys = xtr[shard], ytr[shard]
    model = DDP(make_model(args.seed))
    if args.backend == "fanin":
        model.register_comm_hook(None, ft.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    slow = SlowWorkerPattern(args.straggler_p, args.typical_iter_s, world, args.seed + 7)
    gen = torch.Generator().manual_seed(args.seed + rank)
    iters_per_epoch = len(xs) // args.batch
    curve: list[dict[str, Any]] = []
    iter_times: list[float] = []
    sources: list[int] = []
    it = 0
    reached_s = None
    dist.barrier()
    clock = 0.0  # training time; evaluation is not counted
    for epoch in range(args.epochs):
        perm = torch.randperm(len(xs), generator=gen)
        for b in range(iters_per_epoch):
            t0 = time.perf_counter()
            idx = perm[b * args.batch:(b + 1) * args.batch]
            slow.point(rank)
            out = model(xs[idx])
            slow.point(rank)
            loss = loss_fn(out, ys[idx])
            opt.zero_grad()
            loss.backward()
            slow.point(rank)
            opt.step()
            dt = time.perf_counter() - t0
            clock += dt
            iter_times.append(dt)
            if args.backend == "fanin":
                sources.append(ft.last_step_sources())
            it += 1
            if it % args.eval_every == 0:
                acc = accuracy(model.module, xte, yte)
                curve.append({"iter": it, "epoch": epoch, "time_s": clock, "test_acc": acc, "loss": float(loss.detach())})
                if reached_s is None and acc >= args.target_acc:
                    reached_s = clock
                if args.stop_at_target and reached_s is not None:
                    break
        if args.stop_at_target and reached_s is not None:
            break
    final_acc = accuracy(model.module, xte, yte)
    # every rank must hold the same parameters (the switch returns one result to all)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    max_param_diff = max(float((g - flat).abs().max()) for g in gathered)
    missed_all = None
    if args.backend == "fanin":
        mine = torch.tensor([float(ft.fanin_group().total_stats().missed_blocks)])
        every = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(every, mine)
        missed_all = [int(x.item()) for x in every]
    result = {
        "backend": args.backend, "workers": world, "straggler_p": args.straggler_p,
        "typical_iter_s": args.typical_iter_s, "block_exp_ms": int(os.environ.get("FANIN_BLOCK_EXP_MS", "0") or 0),
        "iters": it, "train_time_s": clock, "median_iter_s": float(np.median(iter_times)),
        "target_acc": args.target_acc, "time_to_target_s": reached_s, "final_acc": final_acc,
        "straggle_events": slow.events, "curve": curve, "max_param_diff_across_ranks": max_param_diff,
    }
    if sources:
        result["steps_with_fewer_sources"] = sum(1 for s in sources if s < world)
        result["min_sources_seen"] = min(sources)
        st = ft.fanin_group().total_stats()
        result["degraded_blocks"] = st.degraded_blocks
        result["missed_blocks_per_rank"] = missed_all
        result["retransmissions"] = st.retransmissions
    # DDP keeps its process group and its last works until the model is collected, which a reference
    # cycle puts off to Python's shutdown, where Gloo freeing a work aborts the process now and then
    # (torch 2.15, docs/torch.md "Ending a run"). Collect the model first, while Python still runs.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return result if rank == 0 else {}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="fanin", choices=["fanin", "gloo"])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=5, help="iterations between test-set evaluations")
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--straggler-p", type=float, default=0.0, help="Slow Worker Pattern probability per delay point")
    p.add_argument("--typical-iter-s", type=float, default=0.0, help="typical iteration time without stragglers")
    p.add_argument("--out", help="rank 0 writes its JSON result here")
    return p


def main() -> None:
    args = parser().parse_args()
    result = train(args)
    if result:
        text = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text)


if __name__ == "__main__":
    main()
