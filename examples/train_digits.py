"""Data-parallel training of a small MLP on the handwritten digits bundled
with scikit-learn (1,797 8x8 images; nothing is downloaded), with gradients
averaged by a fanin switch.

    torchrun --nproc-per-node 4 examples/train_digits.py

By default rank 0 starts the switch inside its own process; point the
workers at a running one with FANIN_SWITCH=HOST:PORT (and FANIN_JOB_ID).
Each step prints how many workers the switch included (fewer than the world
size only when straggler mitigation left a slow worker out).
"""

import argparse
import gc
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fanin.torch  # registers the "fanin" backend


def data(seed):
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(xtr), as_y(ytr), as_x(xte), as_y(yte)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="per-worker batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default="fanin", help="fanin, or gloo to compare")
    args = ap.parse_args()

    dist.init_process_group(args.backend)  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = data(seed=0)
    xs, ys = xtr[rank::world], ytr[rank::world]  # this worker's shard

    torch.manual_seed(rank)  # different on purpose: DDP broadcasts rank 0's parameters
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)))
    if args.backend == "fanin":
        # average by the number of workers each block included (src_cnt)
        model.register_comm_hook(None, fanin.torch.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0 and args.backend == "fanin":
        print(f"{world} workers, switch {fanin.torch.fanin_group().switch_addr}")

    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(xs))
        partial_steps = 0
        for i in range(len(xs) // args.batch):
            idx = perm[i * args.batch:(i + 1) * args.batch]
            loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.backend == "fanin" and fanin.torch.last_step_sources() < world:
                partial_steps += 1
        if rank == 0:
            with torch.no_grad():
                acc = (model.module(xte).argmax(1) == yte).float().mean().item()
            print(f"epoch {epoch:3d}  loss {loss.item():.4f}  test accuracy {acc:.4f}  "
                  f"steps with a worker left out {partial_steps}  ({time.perf_counter() - t0:.1f} s)")
    if rank == 0:
        with torch.no_grad():
            print(f"final test accuracy {(model.module(xte).argmax(1) == yte).float().mean().item():.4f}")
    # DDP keeps its process group and its last works until the model is collected, which a reference
    # cycle puts off to Python's shutdown, where Gloo freeing a work aborts the process now and then
    # (torch 2.15, docs/torch.md "Ending a run"). Collect the model first, while Python still runs.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
