"""Tensor <-> switch plumbing shared by the process group and the DDP hook:
dtype checks, one switch allreduce, averaging by each block's ``src_cnt``,
and the per-step record of how many workers each allreduce included."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from fanin.session import Session

__all__ = ["SUPPORTED_DTYPES", "StepStats", "StepLog", "check_tensor", "switch_allreduce"]

# dtype -> the dtype that travels through the switch. float16 and bfloat16
# travel as themselves: 2 bytes per element each way, block floating point
# in int16 lanes that the switch sums in int32 (docs/protocol.md 5.6), so the
# sum is never accumulated at half precision and INA's point, fewer bytes on
# the link, holds.
SUPPORTED_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.int32: torch.int32,
}
_HALF_FORMATS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_tensor(t: Any, what: str = "allreduce") -> None:
    """Raise a clear error for a tensor the switch cannot reduce."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fanin {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"fanin {what}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
                        f"(the switch sums {names}); cast the tensor or use a Gloo group for it")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fanin {what}: tensors must be on the CPU or a CUDA device, this one is on {t.device} "
                          "(copy it with .cpu())")
    # Refused here, when the collective is issued: a CSR/CSC/BSR tensor got
    # past an is_sparse check (COO only) and failed later on the group's
    # worker thread, and a tensor whose elements share memory ran the
    # network round and raised only when the sum was copied back into it.
    if t.layout != torch.strided or t.is_nested:
        raise ValueError(f"fanin {what}: layout {t.layout}{' (nested)' if t.is_nested else ''} is not supported: "
                         "the switch sums dense tensors; reduce t.to_dense() (or a sparse tensor's values) instead")
    if torch._debug_has_internal_overlap(t) == 1:  # 1: certainly overlaps (2 is "too hard to tell")
        raise ValueError(f"fanin {what}: the tensor's elements overlap in memory (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}, e.g. from expand()), so no element can hold its own sum: "
                         "reduce t.clone() (or .contiguous()) instead")


@dataclass
class StepStats:
    """What the switch reported for the allreduces since the last reset.

    ``min_sources`` is the fewest workers any block of any of those
    allreduces included (``n_sources`` when nothing was degraded); with
    straggler mitigation it is below ``n_sources`` when the switch aged out
    a slow worker's contribution, and 0 on a straggler that missed a block
    altogether (see ``missed_blocks``). ``degraded_blocks`` counts blocks
    that summed fewer than ``n_sources`` workers.
    """

    n_sources: int
    min_sources: int
    allreduces: int = 0
    blocks: int = 0
    degraded_blocks: int = 0
    # blocks this worker arrived too late for: zero in its result (src_cnt 0);
    # the other workers applied a partial result there, so this replica
    # diverged and should be resynchronised (docs/stragglers.md)
    missed_blocks: int = 0
    retransmissions: int = 0
    elements: int = 0
    # src_cnt -> number of degraded blocks that summed that many workers
    sources_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every block summed every worker."""
        return self.min_sources >= self.n_sources


class StepLog:
    """Accumulates switch statistics between two ``take()`` calls (thread safe:
    allreduces finish on the process group's worker thread)."""

    def __init__(self, n_sources: int) -> None:
        self._n = n_sources
        self._lock = threading.Lock()
        self._cur = StepStats(n_sources=n_sources, min_sources=n_sources)
        self.total = StepStats(n_sources=n_sources, min_sources=n_sources)

    def record(self, stats: Optional[dict[str, Any]], elements: int) -> None:
        if not stats:
            return
        with self._lock:
            for s in (self._cur, self.total):
                s.allreduces += 1
                s.blocks += int(stats.get("blocks", 0))
                s.degraded_blocks += len(stats.get("degraded_blocks", ()))
                s.missed_blocks += int(stats.get("missed_blocks", 0))
                s.retransmissions += int(stats.get("retransmissions", 0))
                s.elements += elements
                s.min_sources = min(s.min_sources, int(stats.get("min_src_cnt", self._n)))
                for _, cnt in stats.get("degraded_blocks", ()):
                    s.sources_histogram[int(cnt)] = s.sources_histogram.get(int(cnt), 0) + 1

    def totals(self) -> StepStats:
        with self._lock:
            return StepStats(**{**self.total.__dict__, "sources_histogram": dict(self.total.sources_histogram)})

    def take(self, reset: bool = True) -> StepStats:
        with self._lock:
            cur = self._cur
            if reset:
                self._cur = StepStats(n_sources=self._n, min_sources=self._n)
            else:
                cur = StepStats(**{**cur.__dict__, "sources_histogram": dict(cur.sources_histogram)})
            return cur


def block_divisors(length: int, n_sources: int, degraded: list[tuple[int, int]], elems_per_packet: int) -> np.ndarray:
    """Per-element divisor for an int32 average: ``n_sources`` except in degraded
    blocks, where it is that block's ``src_cnt``. Block ``b`` of an allreduce
    covers elements ``[b*epp, (b+1)*epp)`` of the flattened tensor (block
    indices are relative to the allreduce; see fanin-proto host/allreduce.rs)."""
    div = np.full(length, n_sources, dtype=np.int32)
    for block, cnt in degraded:
        start = int(block) * elems_per_packet
        div[start:start + elems_per_packet] = max(int(cnt), 1)
    return div


def switch_allreduce(session: Session, tensor: torch.Tensor, average: bool, log: Optional[StepLog],
                     elems_per_packet: int, keep: Optional[tuple[int, int]] = None) -> None:
    """Sum (or average) ``tensor`` in place over the job's members through the switch.

    ``keep=(start, stop)``: a reduce-scatter; only those elements of the
    flattened tensor become the sum (the switch sends this rank the other
    blocks' headers, not their sums), the rest keep this rank's values.

    Averages divide each element by the number of workers its block actually
    summed (``src_cnt``), so a block the switch emitted without a straggler is
    the mean of the workers it included, not a sum scaled by the wrong count.
    Float means are rounded once, by the session; int32 averages truncate
    toward zero (like NCCL's AVG on integers).
    """
    wire = SUPPORTED_DTYPES[tensor.dtype]
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return
    if wire in _HALF_FORMATS:
        _half_allreduce(session, tensor, flat, _HALF_FORMATS[wire], average, log, keep)
        return
    # A contiguous tensor of the wire dtype is reduced in place (no result
    # array, no copy back); anything else goes through a converted copy.
    in_place = flat.dtype == wire and tensor.is_contiguous()
    src = flat if flat.dtype == wire else flat.to(wire)
    arr = src.contiguous().numpy()
    # float32 means are the session's: each block divided by its own src_cnt
    # while the switch's sum is decoded, rounded once (a division after the
    # decode would round twice, and walk the tensor once more). The session
    # refuses int32 means, so those are divided here, truncating.
    session_mean = average and wire != torch.int32
    # A reduce-scatter always reduces into `arr` (a new array would be
    # unspecified outside `keep`, and the copy back below writes it all).
    out = session.allreduce(arr, out=arr if in_place or keep is not None else None,
                            **({"average": True} if session_mean else {}),
                            **({"keep": keep} if keep is not None else {}))
    stats = session.last_stats
    if log is not None:
        log.record(stats, flat.numel())
    # in place: `flat` is a view of `tensor` and now holds the sum
    result = flat if in_place else torch.from_numpy(out)
    with torch.no_grad():
        if average and not session_mean:
            degraded = list(stats.get("degraded_blocks", ())) if stats else []
            if degraded:
                div = block_divisors(len(out), session.n_sources, degraded, elems_per_packet)
                result.div_(torch.from_numpy(div), rounding_mode="trunc")
            else:
                result.div_(session.n_sources, rounding_mode="trunc")
        if not in_place:
            tensor.copy_(result.reshape(tensor.shape))


def _half_allreduce(session: Session, tensor: torch.Tensor, flat: torch.Tensor, fmt: str, average: bool,
                    log: Optional[StepLog], keep: Optional[tuple[int, int]] = None) -> None:
    """A float16/bfloat16 tensor through the switch as its bits (numpy has no
    bfloat16): in place when contiguous, else through a contiguous copy. The
    session averages each block by its own ``src_cnt`` and rounds once."""
    in_place = tensor.is_contiguous()
    src = flat if in_place else flat.contiguous()
    bits = src.view(torch.int16).numpy().view(np.uint16)
    session.allreduce(bits, dtype=fmt, average=average, out=bits, **({"keep": keep} if keep is not None else {}))
    if log is not None:
        log.record(session.last_stats, flat.numel())
    if not in_place:
        with torch.no_grad():
            tensor.copy_(src.reshape(tensor.shape))
