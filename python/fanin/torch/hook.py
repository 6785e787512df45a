"""DDP communication hooks that average gradient buckets through a fanin
switch, for users whose process group is Gloo or NCCL (or fanin itself)."""


import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from fanin.torch._connect import ConnectOptions
from fanin.torch._reduce import StepStats
from fanin.torch.backend import FaninProcessGroup

__all__ = ["FaninHookState", "allreduce_hook", "noop_hook"]

_last_state = None  # the FaninHookState built last (for fanin.torch.step_stats)
# States that joined a switch through the default group's store, in this
# process: each gets a store prefix of its own (a second state on the same
# prefix would read the first one's rendezvous). Every rank builds its
# states in the same order (the constructor is a collective), so the
# numbers agree, as torch's own new_group names do.
_states_on_default_store = 0


class FaninHookState:
    """State of :func:`allreduce_hook`: the fanin group the buckets go through.

    If ``process_group`` (default: the default group) is a fanin group, the
    hook uses it. Otherwise the constructor joins a switch itself through the
    default group's c10d store (prefix ``fanin-hook/<n>/``, ``n`` counting
    the states built in this process, so two models' states each get their
    own job), exactly as
    ``init_process_group("fanin")`` would: ``FANIN_SWITCH`` or the embedded
    default in rank 0's process. Construct it on every rank (it is a
    collective), after ``init_process_group``.

    Example::

        dist.init_process_group("gloo")
        model = DDP(net)
        state = fanin.torch.FaninHookState()
        model.register_comm_hook(state, fanin.torch.allreduce_hook)
        ...
        print(state.step_stats().min_sources)
    """

    def __init__(self, process_group: Optional[Any] = None, *, options: Optional[ConnectOptions] = None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
        global _last_state, _states_on_default_store
        pg = process_group if process_group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("fanin FaninHookState: call torch.distributed.init_process_group first")
        if isinstance(pg, FaninProcessGroup):
            self.group = pg
        else:
            if process_group is not None and process_group is not dist.group.WORLD:
                raise NotImplementedError("fanin FaninHookState: only the default group can be mirrored on a "
                                          "switch; pass a fanin group for subgroups")
            prefix = f"fanin-hook/{_states_on_default_store}/"
            _states_on_default_store += 1
            store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
            self.group = FaninProcessGroup(store, dist.get_rank(), dist.get_world_size(), timeout, options,
                                           tied_to=dist.group.WORLD)
        _last_state = self

    def step_stats(self, reset: bool = True) -> StepStats:
        """Workers included by the buckets averaged since the last reset."""
        return self.group.step_stats(reset)

    def __setstate__(self, state: Any) -> None:  # DDP pickles hook state only for checkpoints
        raise RuntimeError("fanin FaninHookState cannot be restored from a pickle; build a new one")


def allreduce_hook(state: FaninHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over the workers through the switch.

    Guarantee: every rank gets the same averaged bucket; each element is
    divided by the number of workers its block included (``src_cnt``), so a
    partial result from straggler mitigation is the mean of the workers that
    made it, not a diluted sum. Read ``state.step_stats()`` (or
    :func:`fanin.torch.last_step_sources`) to see how many were included.

    Precondition: CPU gradients of dtype float32, float16 or bfloat16.

    Example::

        model.register_comm_hook(fanin.torch.FaninHookState(), fanin.torch.allreduce_hook)
    """
    return _average_bucket(state.group, bucket.buffer())


def _average_bucket(group: FaninProcessGroup, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    work = group.allreduce([buffer], dist.ReduceOp.AVG)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compressed_average(group: FaninProcessGroup, buffer: torch.Tensor,
                        dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    """The bucket cast to a 16-bit dtype (2 bytes per element on the wire
    each way), averaged through the switch, cast back into the bucket."""
    compressed = buffer.to(dtype)
    work = group.allreduce([compressed], dist.ReduceOp.AVG)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket unchanged without communicating: the compute-only
    baseline that shows how much time communication costs (it does not train
    a data-parallel model correctly)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def last_state() -> Optional[FaninHookState]:
    return _last_state
