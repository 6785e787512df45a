"""fanin for PyTorch: a ``torch.distributed`` backend and a DDP hook.

Backend (``import fanin.torch`` registers it)::

    import torch.distributed as dist, fanin.torch
    dist.init_process_group("fanin")          # under torchrun
    model = DDP(net)
    model.register_comm_hook(None, fanin.torch.allreduce_hook)   # src_cnt-aware averaging
    ...
    n = fanin.torch.last_step_sources()       # workers the last step's gradients included

DDP hook with another backend::

    dist.init_process_group("gloo")
    model.register_comm_hook(fanin.torch.FaninHookState(), fanin.torch.allreduce_hook)

The switch is ``FANIN_SWITCH=HOST:PORT`` (job ``FANIN_JOB_ID``; a keyed job's
member keys from ``FANIN_AUTH_KEY_FILE``, ``{rank}`` = the rank), the one a
``fanin controller`` names (``FANIN_CONTROLLER=HOST:PORT``, each rank on its
``FANIN_HOST``; keyed jobs get their member keys there) or, by default,
started inside rank 0's process. See docs/torch.md.
"""


from typing import Any, Optional

import torch
import torch.distributed as dist

from fanin.torch._connect import ConnectOptions
from fanin.torch._reduce import SUPPORTED_DTYPES, StepStats
from fanin.torch.backend import FaninProcessGroup, create_backend
from fanin.torch.hook import FaninHookState, noop_hook
from fanin.torch.hook import allreduce_hook as _allreduce_hook
from fanin.torch.hook import last_state as _last_hook_state

__all__ = [
    "BACKEND_NAME",
    "ConnectOptions",
    "FaninHookState",
    "FaninProcessGroup",
    "StepStats",
    "SUPPORTED_DTYPES",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "fanin_group",
    "last_step_sources",
    "noop_hook",
    "parameter_digest",
    "register",
    "step_stats",
]

BACKEND_NAME = "fanin"


def register() -> None:
    """Register the ``fanin`` backend with torch.distributed (idempotent; done
    on import, and by torch itself through the ``torch.distributed.backends``
    entry point when fanin is installed)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        # CUDA tensors are staged through pinned host memory (fanin.torch._staged)
        dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=["cpu", "cuda"])


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of the bytes of every parameter of ``model``, in order: equal on
    every rank exactly when the replicas are bit for bit the same (DDP's
    promise, whatever the backend). FSDP2's sharded parameters (DTensors)
    are gathered whole first, which is a collective: call it on every rank."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fanin_group(group: Optional[Any] = None) -> FaninProcessGroup:
    """The fanin group behind ``group`` (default: the default group)."""
    pg = group if group is not None else dist.group.WORLD
    if isinstance(pg, FaninHookState):
        return pg.group
    if isinstance(pg, FaninProcessGroup):
        return pg
    raise ValueError(f"fanin: {pg!r} is not a fanin process group; initialise with init_process_group('fanin') "
                     "or pass the FaninHookState")


def allreduce_hook(state: Optional[FaninHookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through the switch, dividing each
    block by the workers it included (``src_cnt``). ``state`` is a
    :class:`FaninHookState`, or ``None`` when the default group is fanin."""
    if state is None:
        from fanin.torch.hook import _average_bucket

        return _average_bucket(fanin_group(None), bucket.buffer())
    return _allreduce_hook(state, bucket)


def fp16_compress_hook(state: Optional[FaninHookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook, as torch's own ``fp16_compress_hook`` but through the
    switch: the float32 bucket is cast to float16, travels as 2 bytes per
    element each way (half of :func:`allreduce_hook`'s bytes), is averaged
    per block by the workers it included, and is cast back. ``state`` as for
    :func:`allreduce_hook`."""
    from fanin.torch.hook import _compressed_average

    return _compressed_average(fanin_group(state), bucket.buffer(), torch.float16)


def bf16_compress_hook(state: Optional[FaninHookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`fp16_compress_hook` with bfloat16: float32's range, 8 bits of
    precision."""
    from fanin.torch.hook import _compressed_average

    return _compressed_average(fanin_group(state), bucket.buffer(), torch.bfloat16)




def _stats_source(group: Optional[Any]) -> FaninProcessGroup:
    if group is None and not isinstance(dist.group.WORLD, FaninProcessGroup) and _last_hook_state() is not None:
        return _last_hook_state().group
    return fanin_group(group)


def step_stats(group: Optional[Any] = None, reset: bool = True) -> StepStats:
    """Switch statistics of the allreduces since the last reset: how many
    workers they included (``min_sources`` of ``n_sources``), degraded blocks,
    retransmissions. ``group`` is a fanin group or a :class:`FaninHookState`
    (default: the default group if it is fanin, else the last hook state)."""
    return _stats_source(group).step_stats(reset)


def last_step_sources(group: Optional[Any] = None) -> int:
    """Fewest workers any gradient block included since the last call (the
    world size when no straggler was left out); resets the count, so call it
    once per training step."""
    return step_stats(group, reset=True).min_sources


register()
