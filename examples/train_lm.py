"""A small GPT-style byte-level language model trained from scratch on real
text this machine has offline (the Debian documentation in /usr/share/doc:
READMEs, changelogs, copyright files; nothing is downloaded), data-parallel,
with gradients averaged by a fanin switch.

    torchrun --nproc-per-node 4 examples/train_lm.py
    torchrun --nproc-per-node 4 examples/train_lm.py --compress float16   # gradients as 2 bytes each way
    torchrun --nproc-per-node 4 examples/train_lm.py --backend gloo       # the same steps on Gloo

By default rank 0 starts the switch inside its own process; point the
workers at a running one with FANIN_SWITCH=HOST:PORT (and FANIN_JOB_ID).
Runs on a CUDA device when there is one (`--device cuda`; ranks may share
one GPU), else on the CPU. DDP by default; `--fsdp` shards the model with
FSDP2 (`fully_shard`: gradients reduce-scattered through the switch). Every
rank reads the same corpus and draws its own windows of it; rank 0 reports
the training loss, the loss on held-out text (the last 5 % of the corpus)
in bits per byte, and steps per second (evaluation time excluded).
"""

import argparse
import gc
import gzip
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fanin.torch  # registers the "fanin" backend


def corpus(megabytes: float, root: str = "/usr/share/doc") -> torch.Tensor:
    """The first `megabytes` of the text files under `root` (a directory,
    or one file), in sorted path order (gzip files unpacked, binary files
    skipped), as bytes."""
    want, parts, have = int(megabytes * 1e6), [], 0
    walk = [(os.path.dirname(root), [], [os.path.basename(root)])] if os.path.isfile(root) else os.walk(root)
    for dirpath, dirnames, filenames in walk:
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            try:
                data = gzip.open(path).read() if name.endswith(".gz") else open(path, "rb").read()
            except (OSError, EOFError):
                continue
            if b"\0" in data[:4096]:
                continue
            parts.append(data)
            have += len(data)
            if have >= want:
                return torch.frombuffer(bytearray(b"".join(parts)[:want]), dtype=torch.uint8).long()
    if have == 0:
        raise SystemExit(f"train_lm: no text found under {root}")
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """A decoder-only transformer over bytes (256 symbols)."""

    def __init__(self, context: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def batch(data: torch.Tensor, size: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=gen)
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + context] for s in starts])
    return x, y


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="windows per worker per step")
    ap.add_argument("--context", type=int, default=64, help="bytes per window")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-mb", type=float, default=4.0, help="megabytes of text to train on")
    ap.add_argument("--corpus", default="/usr/share/doc", help="a directory of text files or one file "
                    "(default %(default)s)")
    ap.add_argument("--backend", default="fanin", help="fanin, or gloo to compare")
    ap.add_argument("--compress", choices=("none", "float16", "bfloat16"), default="none",
                    help="fanin: gradients travel as 16-bit floats, 2 bytes per element each way")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard with FSDP2 instead of DDP (gradients reduce-scattered; --compress sets the "
                         "reduce dtype)")
    ap.add_argument("--log-every", type=int, default=50, help="evaluate the held-out loss every N steps")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="DDP's gradient bucket size (torch's bucket_cap_mb; default %(default)s): smaller buckets "
                         "start communicating earlier in the backward pass")
    ap.add_argument("--overlap-steps", type=int, default=0,
                    help="DDP: after training, time this many forward+backward passes with and without gradient "
                         "communication, and as many allreduces of the gradients alone, to report how much of the "
                         "communication the backward pass hides (no optimizer step: the model is unchanged)")
    return ap


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_lm: --device cuda but PyTorch sees no CUDA device; use --device cpu")
    return device


def wrap(model: nn.Module, args: argparse.Namespace, device: torch.device) -> nn.Module:
    """DDP with fanin's averaging hook, or FSDP2 (``fully_shard`` per block)."""
    half = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.compress]
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(reduce_dtype=half) if half is not None else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
    if args.backend == "fanin":
        hook = {"none": fanin.torch.allreduce_hook, "float16": fanin.torch.fp16_compress_hook,
                "bfloat16": fanin.torch.bf16_compress_hook}[args.compress]
        ddp.register_comm_hook(None, hook)
    elif half is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if half == torch.float16
                               else default_hooks.bf16_compress_hook)
    return ddp


def measure_overlap(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                    k: int, wire_dtype: torch.dtype = torch.float32) -> dict:
    """How much of a DDP step's gradient communication its backward pass
    hides. Times, per pass, over `k` passes each (after one untimed pass of
    each kind): forward+backward with DDP's communication (`step_s`),
    the same under `no_sync` (`compute_s`: no communication), and one
    `all_reduce` of a flat tensor of all the gradients, in the dtype the
    hook sends (`wire_dtype`: float16 or bfloat16 with `--compress`), on the
    same group (`comm_s`: communication alone). `overlap` = the part of `comm_s`
    that `step_s` does not add to `compute_s`, as a fraction of `comm_s`
    (0: serial, 1: fully hidden). No optimizer step: the replicas stay equal."""
    x, y = (t.to(device) for t in xy)
    grads = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad), device=device, dtype=wire_dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

    def compute_only() -> None:
        with model.no_sync():
            fwd_bwd()

    def timed(fn) -> float:
        fn()  # untimed: buckets built, buffers allocated
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        return (time.perf_counter() - t) / k

    step_s = timed(fwd_bwd)
    compute_s = timed(compute_only)
    comm_s = timed(lambda: dist.all_reduce(grads))
    model.zero_grad(set_to_none=True)
    hidden = compute_s + comm_s - step_s
    return {"step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
            "overlap": min(max(hidden / comm_s, 0.0), 1.0) if comm_s > 0 else 0.0}


def train(args: argparse.Namespace, log=print, delay=None) -> dict:
    """Train as the arguments say; rank 0 reports through `log`. Returns
    this rank's figures (the held-out losses are rank 0's). `delay(rank)`,
    if given, is called at three points of every step (before the forward
    pass, before the backward pass, before the optimizer step): the hook a
    benchmark uses to inject stragglers."""
    dist.init_process_group(args.backend)  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    data = corpus(args.corpus_mb, args.corpus)
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]

    # different on purpose under DDP: it broadcasts rank 0's parameters;
    # FSDP2 shards what each rank holds, so there every rank starts alike
    torch.manual_seed(0 if args.fsdp else rank)
    model = wrap(ByteGPT(args.context, args.d_model, args.layers, args.heads).to(device), args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    eval_gen = torch.Generator().manual_seed(7)
    eval_batches = [tuple(t.to(device) for t in batch(held_out, 32, args.context, eval_gen)) for _ in range(4)]
    params = sum(p.numel() for p in ByteGPT(args.context, args.d_model, args.layers, args.heads).parameters())
    delay = delay or (lambda rank: None)
    if rank == 0:
        log(f"{world} workers on {args.backend} ({'FSDP2' if args.fsdp else 'DDP'}, {device}), "
            f"{params / 1e6:.2f} M parameters, corpus {len(data) / 1e6:.1f} MB (held out {len(held_out) / 1e6:.2f} MB)")

    def held_out_loss() -> float:
        # every rank evaluates (FSDP2's forward is a collective)
        with torch.no_grad():
            return sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                       for x, y in eval_batches) / len(eval_batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    first = held_out_loss()
    curve = [{"step": 0, "seconds": 0.0, "held_out_bits_per_byte": first / math.log(2)}]
    trained_s, last_step = 0.0, 0
    sync()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device, non_blocking=True) for t in batch(train, args.batch, args.context, gen))
        delay(rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        delay(rank)
        loss.backward()
        delay(rank)
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            sync()
            now = time.perf_counter()
            trained_s += now - t0
            val = held_out_loss()  # not on the training clock
            curve.append({"step": step, "seconds": trained_s, "held_out_bits_per_byte": val / math.log(2)})
            if rank == 0:
                rate = (step - last_step) / (now - t0)
                log(f"step {step:5d}  train loss {loss.item():.3f}  held-out {val / math.log(2):.3f} bits/byte  "
                    f"{rate:.1f} steps/s")
            last_step = step
            sync()
            t0 = time.perf_counter()
    last = curve[-1]["held_out_bits_per_byte"]
    if rank == 0:
        log(f"held-out loss {first / math.log(2):.3f} -> {last:.3f} bits per byte in {args.steps} "
            f"steps ({args.steps / trained_s:.1f} steps/s)")
    wire = {"none": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.compress]
    overlap = measure_overlap(model, batch(train, args.batch, args.context, gen), device, args.overlap_steps, wire) \
        if args.overlap_steps > 0 and not args.fsdp else {}
    # the replicas must agree (every rank, every backend): one hash of all the parameters
    digest = fanin.torch.parameter_digest(model)
    switch = {}
    if args.backend == "fanin":  # what the switch did: blocks aged out, blocks resent
        st = fanin.torch.fanin_group().total_stats()
        switch = {"degraded_blocks": st.degraded_blocks, "missed_blocks": st.missed_blocks,
                  "retransmissions": st.retransmissions}
    # every rank is done with the group before any tears it down (rank 0
    # holds the store)
    dist.barrier()
    # DDP keeps its process group and its last works until the model is collected, which a reference
    # cycle puts off to Python's shutdown, where Gloo freeing a work aborts the process now and then
    # (torch 2.15, docs/torch.md "Ending a run"). Collect the model first, while Python still runs.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return {**switch, **overlap, "rank": rank, "world": world, "backend": args.backend, "compress": args.compress,
            "parallel": "fsdp" if args.fsdp else "ddp", "device": str(device), "params": params,
            "steps": args.steps, "seconds": trained_s, "steps_per_s": args.steps / trained_s,
            "held_out_bits_per_byte_first": first / math.log(2), "held_out_bits_per_byte_last": last,
            "curve": curve, "param_digest": digest}


def main() -> None:
    train(parser().parse_args(), log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
