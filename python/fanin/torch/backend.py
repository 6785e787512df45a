"""The ``fanin`` torch.distributed backend: a Python ``ProcessGroup`` whose
allreduce goes through a fanin switch.

What goes where (see docs/torch.md):

* ``allreduce`` (SUM, AVG; float32, float16, bfloat16, int32; CPU tensors,
  and CUDA tensors staged through pinned host memory in chunks pipelined
  with the network, ``fanin.torch._staged``),
  ``allreduce_coalesced`` and ``reduce_scatter_tensor`` (and its list and
  coalesced forms, which FSDP uses): through the switch.
* ``broadcast``, ``allgather``, ``all_gather_single`` (all_gather_into_tensor,
  all_gather_object),
  ``barrier``, and ``allreduce`` MIN/MAX/PRODUCT/bitwise: through a Gloo
  group built on the same c10d store under the prefix ``fanin-gloo/`` (the
  documented fallback: these carry no gradient volume, and Gloo does them
  correctly and efficiently).
* anything else raises ``NotImplementedError`` naming the call.

Every collective runs on one worker thread per group, in the order the
caller issued them, so ranks that issue the same sequence of collectives
agree on it on both channels (switch and Gloo) and ``barrier`` follows
every allreduce issued before it.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from fanin.torch._connect import Connection, ConnectOptions, connect
from fanin.torch._reduce import StepLog, StepStats, check_tensor, switch_allreduce
from fanin.torch._staged import CudaStaging, reduce_host_chunk

__all__ = ["FaninProcessGroup", "create_backend"]

_SWITCH_OPS = {dist.ReduceOp.SUM: False, dist.ReduceOp.AVG: True}
# all_reduce ops the switch cannot compute and Gloo can: the Gloo fallback
_GLOO_ONLY_OPS = {dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND,
                  dist.ReduceOp.BOR, dist.ReduceOp.BXOR}

# The groups of this process on an external switch's job, by (switch, job).
# A second group joining the same job (a `new_group(backend="fanin")` of the
# world's size, a second FaninHookState: FANIN_JOB_ID is one variable) joined
# as a new incarnation of every rank and silently took the job over: the
# first group's next collectives failed with MemberRestarted ("rank 0 joined
# again as a new process") or StaleResult, which named neither cause nor
# cure. Now the second group is refused at once, before it joins.
_ON_EXTERNAL_JOB: "dict[tuple[str, int], weakref.ref]" = {}


def _scoped_store(store: Any) -> Any:
    """`store` under a prefix of this torchrun attempt. torchrun keeps one
    store across the restarts of a group, so unscoped keys written by the
    previous attempt's ranks (rank 0's switch address, its Gloo listening
    address) were still there, and a rank of the new attempt that read one
    before rank 0 wrote it afresh connected to a dead process (seen as
    "Gloo connectFullMesh failed ... Connection refused" in about 1 of 6
    restarts). Groups within an attempt are told apart by torch's own
    prefix of the store it hands each group."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fanin/attempt-{attempt}/", store)


def _gloo_all_gather_single(gloo: Any) -> Callable[..., Any]:
    """Gloo's all_gather_into_tensor under either name: ``all_gather_single``
    (recent torch) or ``_allgather_base`` (torch 2.11 has only this one)."""
    fn = getattr(gloo, "all_gather_single", None)
    return fn if fn is not None else gloo._allgather_base


def _op_kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp (options carry a ReduceOp wrapper, users pass RedOpType)."""
    return getattr(op, "op", op)


def _op_name(op: Any) -> str:
    return str(getattr(_op_kind(op), "name", op))


class _Work(dist.Work):
    """The handle of a collective running on the group's worker thread.

    Not ``_create_work_from_future``: the Work that makes (torch 2.15)
    reports success for a Python future completed with ``set_exception``
    (its ``wait()`` returns True and its future's value is the exception
    object), so a failed allreduce (a lost switch, a refused tensor) would
    leave the tensor unchanged without a word. ``wait()`` here raises the
    collective's error, as it must."""

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        """Block until the collective ends; raise what it raised. With a
        ``timeout`` (a timedelta or seconds; 0 or None: none) raise
        RuntimeError if it has not ended by then, as Gloo's Work does. The
        collective itself goes on (a switch aggregates what every rank
        sent), so its tensor is still written when it completes; waiting
        again returns then."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0)
        if seconds > 0 and not self._fut.done():
            ended = threading.Event()
            self._fut.add_done_callback(lambda _: ended.set())
            if not ended.wait(seconds):
                raise RuntimeError(f"fanin: the collective did not complete within {seconds:g} s (wait's timeout); "
                                   "it goes on, and writes its tensor when it completes")
        self._fut.wait()  # raises what the collective raised
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.wait()
        except Exception:
            return False
        return True

    def exception(self) -> Optional[BaseException]:
        if not self._fut.done():
            return None
        try:
            self._fut.wait()
        except Exception as e:
            return e
        return None

    def result(self) -> Any:
        return self._fut.wait()

    def get_future(self) -> Future:
        return self._fut


class _Done:
    """A finished work, for a call made of several Gloo works already waited for."""

    def wait(self) -> bool:
        return True


class _Worker:
    """One thread that runs a group's collectives in issue order."""

    def __init__(self, name: str) -> None:
        self._q: "queue.Queue[Optional[tuple[Callable[[], Any], Future]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                value = fn()
            except Exception as e:  # delivered to whoever waits on the work
                fut.set_exception(e)
            except BaseException as e:  # a Rust panic: keep the thread alive, fail the work
                fut.set_exception(RuntimeError(f"fanin: {type(e).__name__}: {e}"))
            else:
                fut.set_result(value)

    def stop(self) -> None:
        self._q.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


class FaninProcessGroup(dist.ProcessGroup):
    """A torch process group whose allreduce is aggregated by a fanin switch.

    Created by ``torch.distributed.init_process_group("fanin")`` (or
    ``new_group(backend="fanin")``) after ``import fanin.torch``; see
    :func:`create_backend` for how it finds its switch.

    Guarantee: every rank receives the same allreduce result, bit for bit.
    float32 travels as block floating point in int32 lanes, float16 and
    bfloat16 as themselves in int16 lanes, 2 bytes per element each way
    (error bounds in :class:`fanin.Session`); int32 sums are exact. AVG divides each
    element by the number of workers its block summed (``src_cnt``); SUM of a
    block that straggler mitigation emitted without a slow worker is the sum
    over the workers it included (read :meth:`step_stats` to see it).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                 options: Optional[ConnectOptions] = None, tied_to: Any = None) -> None:
        super().__init__(rank, size)
        store = _scoped_store(store)
        self._rank, self._size = rank, size
        self._options = options or ConnectOptions.from_env()
        self._closed = True  # until it has joined (shutdown() then does nothing)
        # a hook state's group lives as long as the default group it mirrors
        # (nothing shuts it down): it stops counting once that one is gone
        self._tied_to = weakref.ref(tied_to) if tied_to is not None else None
        job = self._external_job()
        if job is not None:
            other = _ON_EXTERNAL_JOB.get(job)
            other = other() if other is not None else None
            if other is not None and other._uses_its_job():
                raise RuntimeError(
                    f"fanin: job {job[1]} on the switch {job[0]} is already used by another fanin group of this "
                    f"process ({other!r}); a second group on the same job would take it over and the first "
                    "group's collectives would fail. Give this group a job of its own: set FANIN_JOB_ID to "
                    "another job of the switch (of this group's size) before creating it, or pass "
                    "options=fanin.torch.ConnectOptions.from_env(job_id=...) to FaninHookState; or destroy "
                    "the other group first")
        # A fanin Session belongs to the thread that made it, so the worker
        # thread that runs every collective also joins the switch.
        self._worker = _Worker(f"fanin-pg-{rank}")
        self._conn: Connection = self._worker.submit(
            lambda: connect(store, rank, size, timeout, self._options)).wait()
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("fanin-gloo/", store), rank, size, timeout)
        self._log = StepLog(self._conn.n_sources)
        self._closed = False
        self._cuda: Optional[CudaStaging] = None
        #: ``{"probes", "idle_recoveries", "all_done"}`` of the session's
        #: lingering at shutdown (None before, or if it could not linger)
        self.linger_stats: Optional[dict[str, Any]] = None
        if job is not None:
            _ON_EXTERNAL_JOB[job] = weakref.ref(self)

    def _external_job(self) -> Optional[tuple[str, int]]:
        """(switch, job) when this group joins a job on FANIN_SWITCH."""
        o = self._options
        return (o.switch, o.job_id) if o.switch and not o.controller else None

    def _uses_its_job(self) -> bool:
        if self._closed:
            return False
        return self._tied_to is None or self._tied_to() is dist.group.WORLD

    # -- identity ---------------------------------------------------------
    def getBackendName(self) -> str:
        return "fanin"

    # torch keeps a group's name in the backend registered under it, which a
    # Python process group has none of, so DeviceMesh (FSDP2) asking for the
    # name it was given got "ProcessGroup name not set"
    def _set_group_name(self, name: str) -> None:
        self._fanin_group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_fanin_group_name", None)
        if name is None:
            raise RuntimeError("fanin process group: no name set yet (torch names a group when it registers it)")
        return name

    @property
    def switch_addr(self) -> str:
        """``HOST:PORT`` of the switch this group aggregates on."""
        return self._conn.switch_addr

    @property
    def job_id(self) -> int:
        return self._conn.job_id

    @property
    def results_on_group(self) -> bool:
        """Whether the switch sends this rank's results once to the job's
        multicast group rather than to each rank (``FANIN_RESULT_GROUP``)."""
        return self._conn.results_on_group

    @property
    def elems_per_packet(self) -> int:
        return self._conn.elems_per_packet

    def step_stats(self, reset: bool = True) -> StepStats:
        """Workers included by the allreduces since the last reset (see :class:`StepStats`)."""
        return self._log.take(reset)

    def total_stats(self) -> StepStats:
        """Totals since the group was created (never reset)."""
        return self._log.totals()

    def socket_stats(self) -> dict[str, int]:
        """The switch socket's counters (``bytes_sent``, ``bytes_received``,
        datagrams, ...: :meth:`fanin.Session.socket_stats`), read on the
        worker thread after every collective issued before."""
        return self._submit(lambda: self._conn.session.socket_stats()).result()

    def __repr__(self) -> str:
        return f"FaninProcessGroup(rank={self._rank}, size={self._size}, switch={self.switch_addr}, job={self.job_id})"

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: wait (Gloo barrier, at most
        60 s) until every rank is done with the switch, then stop the
        embedded switch on rank 0 and the worker thread. Without the barrier
        rank 0 could take the switch away while another rank still waits
        for a retransmitted result. While it waits, the rank's session
        lingers: it takes part in a recovery should the switch restart
        before the others finished (:meth:`fanin.Session.linger`; what it
        did is left in ``linger_stats``). Last, the group's own Gloo group
        is released, which joins its threads (see below)."""
        if self._closed:
            return
        self._closed = True
        done = threading.Event()

        def run() -> None:
            try:
                barrier = self._gloo.barrier()
                # Until every rank entered the barrier, another rank may still
                # be in its last allreduce and need this rank's retained
                # contributions should the switch restart now: the session
                # lingers (probing the switch every 200 ms) exactly that long
                # (docs/restart.md, "Idle members").
                session = self._conn.session
                try:
                    # (a session a failed collective ended has nothing to offer;
                    # its caller saw the error)
                    if session.error is None:
                        self.linger_stats = session.linger(60.0, until=barrier.is_completed)
                except Exception as e:  # this rank's results are complete; say why it could not help
                    warnings.warn(f"fanin: rank {self._rank} stopped taking part in the job while the others "
                                  f"finished: {e}")
                barrier.wait()
            finally:
                # a Session must be dropped by the thread that made it
                self._conn.session = None
                done.set()

        self._worker.submit(run)
        done.wait(60.0)
        self._worker.stop()
        self._worker.join(10.0)
        # A Gloo thread releases a finished work (the barrier's, a
        # broadcast's) a moment after the caller saw it complete, and that
        # work holds a Python object. Under DDP this group outlives
        # destroy_process_group (the model keeps it), so its Gloo threads
        # lived on into interpreter shutdown, where a release needing the
        # GIL ends the thread inside C++ and aborts the process ("terminate
        # called without an active exception", SIGABRT: 1 run in 4-12 of
        # examples/train_digits.py-like training, torch 2.15; the same
        # happens to Gloo's own DDP, docs/torch.md). Dropping the only
        # reference destroys the Gloo group now, which joins its threads.
        # Only after the worker thread stopped: it is the other user.
        if not self._worker.is_alive():
            self._gloo = None
        if self._conn.embedded is not None:
            self._conn.embedded.stop()
        try:
            self._conn.leave(self._rank)
        except Exception as e:  # the group is gone either way; say why the job keeps the rank
            warnings.warn(f"fanin: rank {self._rank} could not unsubscribe from the controller: {e}")

    # -- the switch path --------------------------------------------------
    def _submit(self, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError("fanin: the process group was destroyed")
        return _Work(self._worker.submit(fn))

    def _check_allreduce(self, tensors: list, opts: Any, what: str) -> bool:
        op = _op_kind(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        if op not in _SWITCH_OPS:
            raise NotImplementedError(f"fanin {what}: reduce op {_op_name(op)} is not supported "
                                      "(the switch sums: use SUM or AVG; all_reduce takes MIN/MAX/PRODUCT through "
                                      "Gloo, or use a Gloo group)")
        if not tensors:
            raise ValueError(f"fanin {what}: no tensors given")
        for t in tensors:
            check_tensor(t, what)
        return _SWITCH_OPS[op]

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        if opts is None or not hasattr(opts, "reduceOp"):
            o = dist.AllreduceOptions()
            o.reduceOp = opts if opts is not None else dist.ReduceOp.SUM
            opts = o
        if _op_kind(opts.reduceOp) in _GLOO_ONLY_OPS:
            # MIN/MAX/PRODUCT/bitwise: the switch only sums, so these go
            # through the Gloo fallback, in issue order like broadcast.
            # torch issues them itself: DDP under Join (uneven inputs) ends
            # with an int64 MAX allreduce (_sync_final_model), which raised
            # "reduce op MAX is not supported" from inside Join's exit on
            # every rank, after training, though the caller never asked for
            # MAX. They carry no gradient volume (a flag, a rank, a metric).
            return self._via_gloo(lambda: self._gloo.allreduce(tensors, opts), tensors, tensors)
        average = self._check_allreduce(tensors, opts, "allreduce")
        if len(tensors) != 1:
            # torch's contract (Gloo's behaviour) for a list is one sum over
            # every tensor of it on every rank, not a sum per tensor
            raise ValueError(f"fanin allreduce: one tensor per call, got a list of {len(tensors)} (torch's "
                             "ProcessGroup.allreduce sums over the whole list; use all_reduce_coalesced for "
                             "several tensors, each summed on its own)")
        issued = [self._issued(t) for t in tensors]

        def run() -> list:
            for t, ev in zip(tensors, issued):
                self._reduce(t, ev, average)
            return tensors

        return self._submit(run)

    def _staging(self) -> CudaStaging:
        if self._cuda is None:
            self._cuda = CudaStaging()
        return self._cuda

    def _issued(self, t: torch.Tensor) -> Any:
        """At issue, on the caller's thread: for a CUDA tensor, an event on
        the caller's stream after which its contents are final (None on the
        CPU, where they are final already)."""
        return self._staging().issued(t) if t.is_cuda else None

    def _reduce(self, t: torch.Tensor, issued: Any, average: bool, keep: Optional[tuple[int, int]] = None) -> None:
        """On the worker thread: one switch allreduce of ``t`` in place; a
        CUDA tensor is staged through pinned host memory, pipelined in
        chunks that are whole blocks (so the result has the CPU path's bits).
        ``keep``: a reduce-scatter, only that range of ``t`` becomes the sum."""
        session, log, epp = self._conn.session, self._log, self._conn.elems_per_packet
        if issued is None:
            switch_allreduce(session, t, average, log, epp, keep)
            return
        half = t.dtype in (torch.float16, torch.bfloat16)
        block = session.half_elems_per_packet if half else epp
        self._staging().allreduce(t, issued, reduce_host_chunk(session, average, log, epp, keep), block)

    def _then_on_device(self, t: torch.Tensor, fn: Callable[[], None]) -> None:
        """On the worker thread, after ``_reduce(t)``: run ``fn`` (copies out
        of ``t``) where ``t`` lives; on a CUDA device on the side stream,
        waiting for those copies alone before the collective completes."""
        if t.is_cuda:
            self._staging().run_and_wait(t.device, fn)
        else:
            fn()

    @staticmethod
    def _one_device(tensors: list, what: str) -> None:
        if len({t.device for t in tensors}) != 1:
            raise ValueError(f"fanin {what}: all tensors must be on one device, got "
                             f"{sorted({str(t.device) for t in tensors})}")

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        average = self._check_allreduce(tensors, opts, "allreduce_coalesced")
        self._one_device(tensors, "allreduce_coalesced")
        if len({t.dtype for t in tensors}) != 1:
            raise TypeError("fanin allreduce_coalesced: all tensors must have one dtype")
        # flattened on the caller's thread (and stream, for CUDA tensors)
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        issued = self._issued(flat)

        def scatter_back() -> None:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].reshape(t.shape))
                    offset += t.numel()

        def run() -> list:
            self._reduce(flat, issued, average)
            self._then_on_device(flat, scatter_back)
            return tensors

        return self._submit(run)

    # -- the Gloo fallback ------------------------------------------------
    def _via_gloo(self, call: Callable[[], Any], result: Any, tensors: list = ()) -> Any:
        """Run a Gloo collective on the worker thread, in issue order.

        CUDA tensors: Gloo's CUDA path orders its copies after the *calling
        thread's* current stream and, in ``wait()``, makes that thread's
        current stream wait for them. Called from the worker thread, that
        was the default stream, not the caller's: under FSDP2, which issues
        its all-gathers on side streams, Gloo read inputs not yet written
        and the caller read outputs not yet copied back (seen on an H100 as
        a different loss than Gloo's own FSDP2 run). So the call runs on the
        staging side stream after an event recorded on the caller's stream
        at issue, and the work completes once that side stream has caught
        up (the CPU waits on its event, never on the whole device)."""
        cuda = next((t for t in tensors if t.is_cuda), None)
        issued = self._issued(cuda) if cuda is not None else None

        def run() -> Any:
            if issued is None:
                call().wait()
            else:
                self._staging().run_and_wait(cuda.device, lambda: call().wait(), after=issued)
            return result

        return self._submit(run)

    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._via_gloo(lambda: self._gloo.broadcast(tensors, opts), tensors, tensors)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._via_gloo(lambda: self._gloo.allgather(output_tensors, input_tensors, opts), output_tensors,
                              [*input_tensors, *[t for ts in output_tensors for t in ts]])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._via_gloo(lambda: _gloo_all_gather_single(self._gloo)(output, input, opts), [output],
                              [output, input])

    _allgather_base = all_gather_single

    # -- reduce-scatter: through the switch --------------------------------
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: every rank contributes its whole input
        once, and the switch sends each rank the sums of the blocks of its
        own shard only (a header for every other block): each link carries
        the input once up and about one shard down (docs/torch.md,
        "Reduce-scatter")."""
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        if opts is None or not hasattr(opts, "reduceOp"):
            o = dist.ReduceScatterOptions()
            o.reduceOp = opts if opts is not None else dist.ReduceOp.SUM
            opts = o
        average = self._check_allreduce(list(inputs) + list(outputs), opts, "reduce_scatter_tensor")
        self._one_device(list(inputs) + list(outputs), "reduce_scatter_tensor")
        if len(outputs) != len(inputs) or len({t.dtype for t in list(inputs) + list(outputs)}) != 1:
            raise TypeError("fanin reduce_scatter_tensor: one output per input, all of one dtype")
        world = self.size()
        for out, inp in zip(outputs, inputs):
            if inp.numel() != out.numel() * world:
                raise ValueError(f"fanin reduce_scatter_tensor: the input has {inp.numel()} elements, the output "
                                 f"{out.numel()}; the input must be the world size ({world}) times the output")
        rank = self.rank()
        # One switch reduce-scatter for all the pairs (the inputs stay as
        # they are), laid out rank by rank so that every rank's shards of
        # all the pairs are one contiguous range, its `keep`: rank r's part
        # is [shard r of pair 0, shard r of pair 1, ...]. Flattened on the
        # caller's thread and stream.
        sizes = [out.numel() for out in outputs]
        flats = [t.detach().reshape(-1) for t in inputs]
        flat = torch.cat([f[r * k:(r + 1) * k] for r in range(world) for f, k in zip(flats, sizes)])
        total = sum(sizes)
        issued = self._issued(flat)

        def keep_own_shards() -> None:
            offset = rank * total
            with torch.no_grad():
                for out, k in zip(outputs, sizes):
                    out.copy_(flat[offset:offset + k].reshape(out.shape))
                    offset += k

        def run() -> list:
            self._reduce(flat, issued, average, (rank * total, (rank + 1) * total))
            self._then_on_device(flat, keep_own_shards)
            return outputs

        return self._submit(run)

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        """``reduce_scatter`` (a list of per-rank inputs): as ``reduce_scatter_tensor``."""
        if len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != self.size():
            raise ValueError("fanin reduce_scatter: one output and one list of world-size inputs")
        if any(t.numel() != outputs[0].numel() for t in input_lists[0]):
            raise ValueError("fanin reduce_scatter: every input must have the output's size")
        flat = torch.cat([t.detach().reshape(-1) for t in input_lists[0]])
        return self.reduce_scatter_single(outputs[0], flat, opts)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._via_gloo(lambda: self._gloo.barrier(opts), [])

    # -- everything else --------------------------------------------------
    def _unsupported(self, name: str) -> Any:
        raise NotImplementedError(
            f"fanin process group: {name} is not supported (supported: all_reduce and reduce_scatter SUM/AVG "
            "through the switch; broadcast, all_gather, all_gather_into_tensor and barrier through Gloo). "
            "Create a Gloo group for it: torch.distributed.new_group(backend='gloo')")

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("reduce")

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("scatter")

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_to_all")

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_to_all_single")

    all_to_all_single = alltoall_base

    def gather_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("gather")

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_gather_coalesced")

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        gather = _gloo_all_gather_single(self._gloo)

        def call() -> Any:
            for out, inp in zip(outputs, inputs):
                gather(out, inp, opts).wait()
            return _Done()

        return self._via_gloo(call, outputs, [*outputs, *inputs])

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv from any source")


def create_backend(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> FaninProcessGroup:
    """The creator torch calls for ``init_process_group("fanin")``.

    The switch comes from ``FANIN_SWITCH`` (``HOST:PORT``, with job
    ``FANIN_JOB_ID``) or, by default, is started inside rank 0's process
    with one job for ``size`` workers; the address travels through ``store``.
    """
    return FaninProcessGroup(store, rank, size, timeout)
