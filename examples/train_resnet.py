"""ResNet-18 (random initialisation) trained data-parallel on synthetic
image batches, with gradients averaged by a fanin switch: the image-model
throughput run (11.7 M parameters, 46.8 MB of float32 gradients per step;
the images are random, so what it measures is images per second, not
accuracy).

    torchrun --nproc-per-node 4 examples/train_resnet.py --steps 20
    torchrun --nproc-per-node 4 examples/train_resnet.py --compress float16   # gradients as 2 bytes each way
    torchrun --nproc-per-node 4 examples/train_resnet.py --backend gloo       # the same steps on Gloo

The network is torchvision's `resnet18` (BasicBlock, [2, 2, 2, 2], 1000
classes), written out here so the example needs nothing beyond PyTorch.
Runs on a CUDA device when there is one (`--device cuda`; ranks may share
one GPU), else on the CPU, where `--image-size 64` keeps a step short.
By default rank 0 starts the switch inside its own process; point the
workers at a running one with FANIN_SWITCH=HOST:PORT (and FANIN_JOB_ID).
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fanin.torch  # registers the "fanin" backend


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the clock starts (default %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="images per worker per step (default %(default)s)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--backend", default="fanin", help="fanin, or gloo to compare")
    ap.add_argument("--compress", choices=("none", "float16", "bfloat16"), default="none",
                    help="gradients as 16-bit floats, 2 bytes per element each way")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    ap.add_argument("--log-every", type=int, default=10)
    return ap


def train(args: argparse.Namespace, log=print, delay=None) -> dict:
    """Train as the arguments say; rank 0 reports through `log`. Returns
    this rank's figures. `delay(rank)`, if given, is called before the
    forward pass, the backward pass and the optimizer step."""
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.manual_seed(rank)  # DDP broadcasts rank 0's parameters
    model = DDP(ResNet18().to(device), device_ids=[device] if device.type == "cuda" else None)
    if args.backend == "fanin":
        hook = {"none": fanin.torch.allreduce_hook, "float16": fanin.torch.fp16_compress_hook,
                "bfloat16": fanin.torch.bf16_compress_hook}[args.compress]
        model.register_comm_hook(None, hook)
    elif args.compress != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook if args.compress == "float16"
                                 else default_hooks.bf16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    params = sum(p.numel() for p in model.parameters())
    delay = delay or (lambda rank: None)
    if rank == 0:
        log(f"{world} workers on {args.backend}, ResNet-18 ({params / 1e6:.2f} M parameters) on {device}, "
            f"{args.batch} synthetic {args.image_size}x{args.image_size} images per worker per step")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = None
    for step in range(1, args.warmup + args.steps + 1):
        if step == args.warmup + 1:
            sync()
            t0 = time.perf_counter()
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen).to(device)
        y = torch.randint(0, 1000, (args.batch,), generator=gen).to(device)
        delay(rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        delay(rank)
        loss.backward()
        delay(rank)
        opt.step()
        if rank == 0 and step > args.warmup and (step - args.warmup) % args.log_every == 0:
            sync()
            done = step - args.warmup
            log(f"step {done:4d}  loss {loss.item():.3f}  {done * args.batch * world / (time.perf_counter() - t0):.1f} "
                "images/s")
    sync()
    seconds = time.perf_counter() - t0
    # the replicas must agree: a digest of the parameters on every rank
    digest = fanin.torch.parameter_digest(model)
    if rank == 0:
        log(f"{args.steps} steps in {seconds:.2f} s: {args.steps / seconds:.2f} steps/s, "
            f"{args.steps * args.batch * world / seconds:.1f} images/s")
    # DDP keeps its process group and its last works until the model is collected, which a reference
    # cycle puts off to Python's shutdown, where Gloo freeing a work aborts the process now and then
    # (torch 2.15, docs/torch.md "Ending a run"). Collect the model first, while Python still runs.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "backend": args.backend, "compress": args.compress, "device": str(device),
            "params": params, "steps": args.steps, "seconds": seconds, "steps_per_s": args.steps / seconds,
            "images_per_s": args.steps * args.batch * world / seconds, "param_digest": digest}


def main() -> None:
    train(parser().parse_args(), log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
