"""A GOAT deployment worker: one fanin session per sub-model, each to the
sub-model's aggregation node (a switch, or the PS's host aggregator). Joins
once, then per line "go" on stdin allreduces every sub-model in sub-model
order (the same order on every worker, so no job waits on another), or
with --parallel N up to N at once, and
answers one JSON line: seconds, whether every sum was exact (int32, the
sum over all workers), retransmissions.

    python -m fanin_bench.bench.goat_worker --rank 0 --workers 8 --targets '[[100, "10.1.0.9:9000", 16384], ...]'

With ``--train digits`` a "go" is one step of synchronous data-parallel SGD
instead (`fanin bench goat-train`): the digits MLP of
`examples/train_digits.py`, the same initial weights on every rank, this
rank's shard of the data; its gradient, flattened, is cut into the
sub-models (the targets' element counts add up to the parameter count),
each averaged through its aggregation node (float32), and the step is
taken. The answer adds the training loss, the held-out loss and accuracy
(every rank holds the same replica, so rank 0's are the job's), and a
digest of the parameters (replicas that drifted apart would differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import queue
import threading
import time

import numpy as np

import fanin
from fanin_bench.bench.tree_worker import contribution


class Lane:
    """A thread that owns the sessions of some sub-models (a fanin Session
    must stay on the thread that made it) and allreduces them in order when
    asked; lanes run side by side, their allreduces release the GIL."""

    def __init__(self, make_sessions):
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(make_sessions,), daemon=True)
        self.thread.start()
        self.joined = self.replies.get()  # 0 once joined, or the exception

    def _run(self, make_sessions) -> None:
        try:
            sessions = make_sessions()
        except Exception as e:
            self.replies.put(e)
            return
        self.replies.put(0)
        while (request := self.requests.get()) is not None:
            inputs, average = request
            try:
                outs = [s.allreduce(x, average=average) for s, x in zip(sessions, inputs)]
                self.replies.put((outs, sum((s.last_stats or {}).get("retransmissions") or 0 for s in sessions)))
            except Exception as e:
                self.replies.put(e)

    @staticmethod
    def _check(reply):
        if isinstance(reply, Exception):
            raise reply
        return reply


def allreduce_parts(lanes: list[Lane], owned: list[list[int]], parts: list,
                    average: bool = False) -> tuple[list, int]:
    """Allreduce parts[g] through sub-model g's session (on its lane; the
    mean with `average`); the results in sub-model order and the
    retransmissions."""
    for lane, gs in zip(lanes, owned):
        lane.requests.put(([parts[g] for g in gs], average))
    outs: list = [None] * len(parts)
    retx = 0
    for lane, gs in zip(lanes, owned):
        lane_outs, lane_retx = Lane._check(lane.replies.get())
        retx += lane_retx
        for g, out in zip(gs, lane_outs):
            outs[g] = out
    return outs, retx


#: examples/train_digits.py's MLP: 64 inputs, two hidden layers, 10 classes
DIGITS_LAYERS = (64, 256, 128, 10)


def digits_param_count() -> int:
    """The MLP's parameters (weights and biases), without importing torch."""
    return sum(i * o + o for i, o in zip(DIGITS_LAYERS[:-1], DIGITS_LAYERS[1:]))


class DigitsTrainer:
    """One replica of `examples/train_digits.py`'s MLP, trained by steps whose
    gradient is averaged sub-model by sub-model through the GOAT deployment."""

    def __init__(self, rank: int, world: int, batch: int, lr: float, seed: int, elements: list[int]):
        import torch
        from torch import nn

        torch.set_num_threads(1)
        self.torch, self.nn = torch, nn
        from fanin_bench.bench.lm_worker import load_example

        example = load_example("train_digits")
        xtr, ytr, self.xte, self.yte = example.data(seed=0)
        self.xs, self.ys = xtr[rank::world], ytr[rank::world]
        torch.manual_seed(seed)  # the same initial weights on every rank (no broadcast needed)
        layers: list = []
        for i, o in zip(DIGITS_LAYERS[:-1], DIGITS_LAYERS[1:]):
            layers += [nn.Linear(i, o), nn.ReLU()]
        self.model = nn.Sequential(*layers[:-1])
        self.params = list(self.model.parameters())
        self.n_params = sum(p.numel() for p in self.params)
        if sum(elements) != self.n_params:
            raise SystemExit(f"goat_worker: the targets cover {sum(elements)} elements, "
                             f"the model has {self.n_params} parameters")
        self.bounds = np.cumsum([0, *elements])
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)
        self.batch, self.rank = batch, rank
        self.gen = torch.Generator().manual_seed(seed * 7919 + rank)
        self.perm, self.pos = None, 0

    def _next_batch(self):
        if self.perm is None or self.pos + self.batch > len(self.xs):
            self.perm, self.pos = self.torch.randperm(len(self.xs), generator=self.gen), 0
        idx = self.perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.xs[idx], self.ys[idx]

    def step(self, lanes: list[Lane], owned: list[list[int]], delay: float = 0.0,
             commands: "Commands | None" = None) -> dict:
        """One step. `delay`: seconds this worker straggles before it sends
        (a slow worker, GOAT's heterogeneous p_w), cut short by a "cut"
        command: the controller saying the epoch ended without it (K-SGD;
        its late gradient is then not added, and it takes the epoch's
        result like every worker)."""
        torch, nn = self.torch, self.nn
        t0 = time.perf_counter()
        x, y = self._next_batch()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.params]).numpy()
        compute = time.perf_counter() - t0
        cut = False
        if delay > 0:
            cut = commands is not None and commands.wait_for("cut", delay)
            if commands is None:
                time.sleep(delay)
        t1 = time.perf_counter()
        parts = [flat[lo:hi] for lo, hi in zip(self.bounds[:-1], self.bounds[1:])]
        outs, retx = allreduce_parts(lanes, owned, parts, average=True)
        comm = time.perf_counter() - t1
        mean = torch.from_numpy(np.concatenate(outs))
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(mean[offset:offset + n].view_as(p))
            offset += n
        self.opt.step()
        with torch.no_grad():
            logits = self.model(self.xte)
            held_out = nn.functional.cross_entropy(logits, self.yte).item()
            accuracy = (logits.argmax(1) == self.yte).float().mean().item()
            digest = float(sum(p.double().sum().item() for p in self.params))
        return {"rank": self.rank, "s": time.perf_counter() - t0, "compute_s": compute, "cut": cut, "comm_s": comm,
                "exact": True, "retransmissions": retx,
                "loss": loss.item(), "held_out_loss": held_out, "accuracy": accuracy, "param_digest": digest}


class Commands:
    """Lines from the driver on stdin, read from the descriptor itself (no
    read-ahead buffer hides a line from `select`), so a worker can wait for
    one with a timeout."""

    def __init__(self, fd: int = 0):
        self.fd, self.buf, self.eof = fd, b"", False

    def _fill(self, timeout: float | None) -> bool:
        import select

        if self.eof or not select.select([self.fd], [], [], timeout)[0]:
            return False
        chunk = os.read(self.fd, 4096)
        self.eof = not chunk
        self.buf += chunk
        return bool(chunk)

    def readline(self) -> str | None:
        while b"\n" not in self.buf:
            if not self._fill(None):
                return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def wait_for(self, word: str, timeout: float) -> bool:
        """Wait up to `timeout` s for a line `word` (consumed); True if it came."""
        deadline = time.monotonic() + timeout
        while True:
            if b"\n" in self.buf:
                line, _, rest = self.buf.partition(b"\n")
                if line.decode().strip() == word:
                    self.buf = rest
                    return True
                return False  # something else is next: leave it for the main loop
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                return False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True, help="ranks 0..workers-1 take part in every sub-model")
    p.add_argument("--targets", required=True, help="JSON [[job_id, addr, elements], ...] in sub-model order")
    p.add_argument("--elems-per-packet", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="allreduce up to N sub-models at once (threads; 0 or 1: one after the other)")
    p.add_argument("--train", choices=("digits",), help="each step trains this model (see the module's doc)")
    p.add_argument("--batch", type=int, default=16, help="--train: per-worker batch size")
    p.add_argument("--lr", type=float, default=0.05, help="--train: SGD learning rate (momentum 0.9)")
    a = p.parse_args()
    targets = json.loads(a.targets)
    trainer = DigitsTrainer(a.rank, a.workers, a.batch, a.lr, a.seed, [e for _, _, e in targets]) if a.train else None
    lanes_n = max(1, min(a.parallel, len(targets)))
    # sub-model g on lane g % lanes_n, in sub-model order: the same on every worker, so no job waits on another
    owned = [[g for g in range(len(targets)) if g % lanes_n == k] for k in range(lanes_n)]

    # {job_id: member key hex} of keyed jobs (the deployment's, docs/security.md)
    keys = {int(j): bytes.fromhex(k) for j, k in json.loads(os.environ.get("FANIN_MEMBER_KEYS", "{}")).items()}

    def sessions_of(gs):
        return lambda: [fanin.Session(targets[g][1], targets[g][0], a.rank, elems_per_packet=a.elems_per_packet,
                                      window=a.window, seed=a.seed * 1000 + targets[g][0], rto_ms=20, rto_min_ms=5,
                                      rto_max_ms=200, dead_after_s=60, auth_key=keys.get(targets[g][0]))
                        for g in gs]

    lanes = [Lane(sessions_of(gs)) for gs in owned]
    for lane in lanes:
        Lane._check(lane.joined)
    print(json.dumps({"ready": True}), flush=True)
    step = 0
    commands = Commands()
    while (line := commands.readline()) is not None:
        words = line.split()
        if words == ["cut"]:
            continue  # an epoch's end that came after this worker finished it
        if not words or words[0] != "go":
            break
        if trainer is not None:
            delay = float(words[1]) / 1e3 if len(words) > 1 else 0.0
            print(json.dumps(trainer.step(lanes, owned, delay, commands)), flush=True)
            step += 1
            continue
        inputs = [contribution(a.rank, elements, step * 4096 + g)  # different data per sub-model and step
                  for g, (_, _, elements) in enumerate(targets)]
        t0 = time.perf_counter()
        outs, retx = allreduce_parts(lanes, owned, inputs)
        dt = time.perf_counter() - t0
        exact = all(np.array_equal(out, sum(contribution(r, elements, step * 4096 + g).astype(np.int64)
                                            for r in range(a.workers)).astype(np.int32))
                    for g, (out, (_, _, elements)) in enumerate(zip(outs, targets)))
        print(json.dumps({"s": dt, "exact": bool(exact), "retransmissions": retx}), flush=True)
        step += 1
    for lane in lanes:
        lane.requests.put(None)
    # Let every lane end before Python shuts down: a lane that frees its last
    # tensors during shutdown (torch releases the GIL to free one, and a
    # thread asking for it back then is ended inside C++) aborts the process,
    # "terminate called without an active exception" (docs/torch.md, "Ending a run")
    for lane in lanes:
        lane.thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
