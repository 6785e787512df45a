"""Device tensors (CUDA) through the switch, staged through pinned host
memory in chunks and pipelined with the network.

The switch speaks UDP from host memory, so a device tensor's bytes must
cross PCIe both ways. Done naively (copy all, reduce all, copy all back)
the copies add to the network time; here the tensor is cut into chunks and

* every device-to-host copy is queued at once on a side stream, after an
  event recorded on the caller's stream when the collective was issued (so
  the copies see the caller's pending kernels, e.g. the backward pass that
  wrote the gradients, and the caller's stream is never blocked);
* the worker thread waits for chunk k's copy alone (its event), reduces it
  through the switch (the GIL is released meanwhile), and queues its
  host-to-device copy on the side stream, while the copy engine carries on
  with chunk k+1's bytes;
* the collective completes when the last result copy has: the worker thread
  waits on that one event (``Event.synchronize``, never the whole device), so
  anyone who sees the work complete (``wait()``, the future DDP chains on)
  sees the result in device memory.

The chunking, the per-chunk allreduce and the copy ordering are
:func:`staged_allreduce`, which takes the copy and wait operations as
functions: the CUDA glue (:class:`CudaStaging`) supplies streams and events,
and the tests drive the same function on the CPU (they cannot run CUDA on a
machine without a GPU; the CUDA tests skip with the reason there).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fanin.session import Session

__all__ = ["CHUNK_ELEMS", "CudaStaging", "staged_allreduce"]

#: Elements per chunk: large enough that a chunk's allreduce keeps the link
#: busy for a while (1 M float32 = 4 MB, several thousand packets), small
#: enough that the first chunk's copy is short.
CHUNK_ELEMS = 1 << 20


def chunks(n: int, per: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``n`` elements."""
    per = max(1, per)
    return [(s, min(s + per, n)) for s in range(0, n, per)]


def staged_allreduce(reduce: Callable[[torch.Tensor, int], None], device_flat: torch.Tensor, host: torch.Tensor,
                     per: int, to_host: Callable[[torch.Tensor, torch.Tensor], Any],
                     wait: Callable[[Any], None], to_device: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
    """Reduce ``device_flat`` chunk by chunk through ``host`` (same length
    and dtype). ``to_host(dst, src)`` queues a copy and returns a marker
    that ``wait`` blocks on; ``reduce(chunk, start)`` reduces a host chunk
    (elements ``start:start + len(chunk)`` of the tensor) in place;
    ``to_device(dst, src)`` queues a copy back and returns its marker, the
    last of which is returned (the collective is complete once it is)."""
    spans = chunks(device_flat.numel(), per)
    # every copy out is queued before the first reduction: the copy engine
    # works ahead of the network
    copied = [to_host(host[s:e], device_flat[s:e]) for s, e in spans]
    last = None
    for (s, e), marker in zip(spans, copied):
        wait(marker)
        reduce(host[s:e], s)
        last = to_device(device_flat[s:e], host[s:e])
    return last


class CudaStaging:
    """One per process group: a side stream per device and pinned host
    buffers per dtype, reused (pinning is slow; a buffer grows to the
    largest tensor seen)."""

    def __init__(self, chunk_elems: int = CHUNK_ELEMS) -> None:
        self.chunk_elems = chunk_elems
        self._streams: dict[Any, Any] = {}
        self._buffers: dict[Any, torch.Tensor] = {}

    def issued(self, tensor: torch.Tensor) -> Any:
        """At issue, on the caller's thread: an event on the caller's current
        stream, after which the tensor's contents are final."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(tensor.device))
        return ev

    def _stream(self, device: Any) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _host(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, pin_memory=True)
            self._buffers[dtype] = buf
        return buf[:n]

    def allreduce(self, tensor: torch.Tensor, issued: Any, reduce: Callable[[torch.Tensor, int], None],
                  block: int = 1) -> None:
        """On the group's worker thread: reduce a CUDA tensor in place.
        Chunks are whole multiples of the session's ``block`` size, so the
        blocks (and their shared exponents) are those of one allreduce of
        the whole tensor: the result has the CPU path's bits."""
        per = max(block, self.chunk_elems // max(block, 1) * max(block, 1))
        side = self._stream(tensor.device)
        side.wait_event(issued)
        try:
            with torch.cuda.stream(side):
                # (a non-contiguous tensor's `flat` is a copy, allocated on
                # the side stream like everything else here, so the caching
                # allocator reuses it only after the side stream's work)
                flat = tensor.detach().reshape(-1)
                contiguous = tensor.is_contiguous()
                work = flat if contiguous else flat.contiguous()
                host = self._host(work.dtype, work.numel())

                def copy(dst: torch.Tensor, src: torch.Tensor) -> Any:
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    return ev

                last = staged_allreduce(reduce, work, host, per, copy, lambda ev: ev.synchronize(), copy)
                if not contiguous:
                    tensor.copy_(work.reshape(tensor.shape))
                    last = torch.cuda.Event()
                    last.record(side)
        except BaseException:
            _drain(side)
            raise
        if last is not None:
            last.synchronize()  # this collective's copies only, not the device

    def run_and_wait(self, device: Any, fn: Callable[[], None], after: Any = None) -> None:
        """On the group's worker thread: run ``fn`` (work on ``device``) with
        the side stream current, after everything queued there before (and
        after the event ``after``, if given), and wait for it alone."""
        side = self._stream(device)
        if after is not None:
            side.wait_event(after)
        try:
            with torch.cuda.stream(side):
                fn()
                done = torch.cuda.Event()
                done.record(side)
        except BaseException:
            _drain(side)
            raise
        done.synchronize()


def _drain(side: Any) -> None:
    """Wait for everything queued on ``side`` so far; for a collective that
    raised. A chunk's reduce that fails leaves copies queued behind it: the
    copies back of the chunks before it write the caller's tensor, the
    copies out still fill the pinned buffer, and temporaries used there
    would be freed under them. Without this wait they ran on after the
    error reached ``Work.wait()`` (whose caller may then reuse or free the
    tensor); with it, the error is raised once the side stream is idle (and
    every temporary it used is free to go, so none needs record_stream)."""
    done = torch.cuda.Event()
    done.record(side)
    done.synchronize()


def reduce_host_chunk(session: Session, average: bool, log: Optional[Any], epp: int,
                      keep: Optional[tuple[int, int]] = None) -> Callable[[torch.Tensor, int], None]:
    """``reduce`` for :func:`staged_allreduce`: one switch allreduce of a host
    chunk; with ``keep`` (a range of the whole tensor), a reduce-scatter of
    the chunk's part of that range (an empty one for chunks outside it)."""
    from fanin.torch._reduce import switch_allreduce

    def reduce(chunk: torch.Tensor, start: int) -> None:
        own = None
        if keep is not None:
            lo = min(max(keep[0] - start, 0), chunk.numel())
            own = (lo, max(lo, min(keep[1] - start, chunk.numel())))
        switch_allreduce(session, chunk, average, log, epp, own)

    return reduce
