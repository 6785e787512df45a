"""The worker-side API: join a job on a switch and allreduce numpy arrays."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Union

import numpy as np

from fanin import _native

__all__ = ["Session"]


#: The defaults of the tunables below, from the Rust session configuration
#: (`SessionConfig::new`), the one place they are written.
_DEFAULTS = _native.session_defaults()
#: The most send lanes a session takes (``lanes=``).
MAX_LANES: int = _native.MAX_LANES


def _member_key(key: Optional[Union[bytes, str]]) -> Optional[bytes]:
    """A member key as bytes: bytes-like as given, or the 32 hex digits the
    CLI prints."""
    if key is None or isinstance(key, (bytes, bytearray, memoryview)):
        return None if key is None else bytes(key)
    if isinstance(key, str):
        try:
            return bytes.fromhex(key)
        except ValueError:
            # (never echo the value: a mistyped key is still mostly a secret)
            raise ValueError(f"auth_key is a string of {len(key)} characters that is not hex; give 32 hex "
                             "digits, as `fanin controller subscribe` prints them, or 16 bytes") from None
    raise TypeError(f"auth_key must be bytes or a hex string, not {type(key).__name__}")


def _float16_format(dt: np.dtype) -> Optional[str]:
    """The 16-bit float format whose values an array of ``dt`` holds
    (whatever its byte order), or None."""
    if dt.kind == "f" and dt.itemsize == 2:
        return "float16"
    if dt.name == "bfloat16":  # ml_dtypes
        return "bfloat16"
    return None


def _native_order(dt: np.dtype, what: str) -> None:
    # the values go to the switch as native uint16 views: bits of the other
    # byte order would be summed as garbage
    if not dt.isnative:
        raise TypeError(f"{what} is {dt}, not in this machine's byte order (16-bit values go to the switch as "
                        f"native uint16): convert it first, {what}.astype({what}.dtype.newbyteorder('='))")


_AS_FLOAT = {"float16": "a float16 array", "bfloat16": "an ml_dtypes.bfloat16 array"}


def _half_format(array: np.ndarray, dtype: Optional[str], out: Optional[np.ndarray]) -> Optional[str]:
    """"float16" / "bfloat16" for a 16-bit float allreduce, None otherwise.

    Only the item size used to be checked, so a float16 array with
    dtype="bfloat16" was summed as bfloat16 bits, big-endian bits as native
    ones, and a float16 input into an int16 ``out`` left raw bits there:
    each is refused here, before anything is sent."""
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: give 'float16' or 'bfloat16' (other dtypes come from the array)")
    fmt = dtype if dtype is not None else _float16_format(array.dtype)
    if fmt is None:
        return None  # int32 / float32 (or refused) in the native session
    _native_order(array.dtype, "array")
    if dtype is not None and array.dtype not in (np.int16, np.uint16) and _float16_format(array.dtype) != fmt:
        other = _float16_format(array.dtype)
        raise TypeError(f"dtype={fmt!r} got a {array.dtype} array, which does not hold {fmt} values: give them as "
                        f"their bits in a uint16 or int16 array (from torch: t.view(torch.int16).numpy()) or as "
                        f"{_AS_FLOAT[fmt]}" + (f" (or drop dtype= to sum this array as {other})" if other else ""))
    if out is None:
        return fmt
    if dtype is None and out.dtype != array.dtype:
        raise TypeError(f"out is {out.dtype} but the input is {array.dtype}: give out the input's dtype, or pass "
                        f"dtype={fmt!r} to have the result's bits written into a uint16 or int16 out")
    _native_order(out.dtype, "out")
    if out.dtype not in (np.int16, np.uint16) and _float16_format(out.dtype) != fmt:
        raise TypeError(f"out is a {out.dtype} array but dtype={fmt!r}: give a uint16 or int16 out for the "
                        f"result's bits, or {_AS_FLOAT[fmt]}")
    if out.shape != array.shape:
        raise TypeError(f"out must have the input's shape {array.shape} (got {out.shape})")
    return fmt


class Session:
    """A worker's session with a fanin switch for one job.

    Joining is synchronous: the constructor asks the switch for the job's
    parameters and fails with :class:`fanin.FaninRefused` (unknown job, not a
    member, packets larger than the job allows) or :class:`fanin.FaninTimeout`
    (no switch answering within ``join_timeout_s``).

    Guarantee: every member of the job receives the same result for each
    block, bit for bit. int32 sums are exact (wrapping on overflow, like
    two's complement hardware). float32 travels as block floating point: the
    error of each element is at most ``N * 2**(e - B - 1)`` plus the final
    float32 rounding, where ``e`` is the block's shared exponent and
    ``B = 30 - ceil(log2 N)`` (see docs/protocol.md). float16 and bfloat16
    travel in 16-bit lanes with ``B = 14 - ceil(log2 N)`` and the same bound
    plus the final 16-bit rounding (docs/protocol.md 5.6). A NaN or an
    infinity in any member's block makes that block NaN in every element on
    every member (as in Gloo the result is non-finite on every rank, so
    AMP's loss scaler skips the step everywhere); a finite value of 2**126
    or more raises :class:`fanin.InputOutOfRange` before anything is sent,
    and the session then takes no more allreduces (docs/protocol.md 5.1).

    Args:
        switch: ``"HOST:PORT"`` of the switch's data port (shard 0).
        job_id: the job, as admitted on the switch.
        rank: this worker's source id in the job.
        elems_per_packet: elements per packet. 0 (the default): the job's
            packet size, which the switch announces at join: the job's
            block_grad_max capped so one datagram fits one frame of the
            switch's data link (no IP fragments). Another value overrides
            it (at most block_grad_max) and must be the same on every rank.
        window: blocks in flight (clamped to the job's block_cnt_max).
        send_drop: probability of dropping each datagram this worker sends
            (fault injection for tests and benchmarks), with ``seed``.
        recv_drop: the same for datagrams this worker receives.
        recv_duplicate, recv_reorder: probabilities of handing a received
            datagram to the protocol twice, or after the next one of its
            receive batch (seeded, like the drops; counted in
            :meth:`socket_stats`).
        sync_join: join a job that is already running (SwitchML++ runtime
            scaling): the tree's root tells the current block offset and the
            first allreduce starts at the next allreduce boundary from there.
        align_blocks: blocks per allreduce of the job's stream (every step
            reduces the same tensor: ``ceil(size / elems_per_packet)``);
            needed with ``sync_join`` to line up with the others.
        rto_ms, rto_min_ms, rto_max_ms: retransmission timeout (initial, bounds).
        join_timeout_s: give up joining after this long.
        dead_after_s: fail an allreduce when the switch is silent this long.
        switch_gone_after_s: raise :class:`fanin.SwitchGone` when the
            switch's host has answered for this long that nothing listens
            on the switch's port (ICMP port unreachable: its process
            stopped) and the switch sent nothing since. A switch restarted
            on its port within this time answers, and the allreduce goes on
            (docs/restart.md); 0 for a switch that cannot come back, which
            then fails at the first such answer instead of after
            ``dead_after_s`` of silence.
        auth_key: this worker's 16-byte member key in a keyed job (the
            controller issues it; ``fanin.derive_member_key(job_key, job_id,
            rank)`` computes it from the job key). Every datagram is sealed
            with it and only results sealed for it are accepted
            (docs/security.md). Bytes, or the hex string the CLI prints
            (``fanin controller subscribe``). None for an unauthenticated job.
        result_group: ``"IPV4:PORT"`` of the job's result group, a multicast
            group the job was admitted with (its ``result_group``): this
            worker listens there too, and the switch sends each result once
            to the group for every listening member instead of a copy to
            each (docs/protocol.md 4.5). ``params["results_on_group"]``
            says whether the switch does; if the job has no group, results
            come by unicast as without it. In a keyed job the group's
            results are sealed once under the job's result key, which the
            JoinAck gives this worker (docs/security.md).
        barrier_timeout_s: how long to wait for the job's other members:
            the switch starts a job's round only when every member has
            joined (each Session is a new incarnation of its rank, so a new
            run against a job that ran before starts afresh, and a rank that
            restarts mid-run ends the others' round with
            :class:`fanin.MemberRestarted`; docs/protocol.md 4.12).
        members: the member count the caller expects (a world size); a job
            of another size raises :class:`fanin.FaninRefused` at once. 0 = any.
        lanes: sockets, each sent from a thread of its own, that this
            worker's datagrams leave from (1 to ``MAX_LANES``, 16; at most the switch's
            shard count are used): lane k carries the blocks of the shards
            s with s % lanes == k. On a fast link with 1500-byte frames most
            of a worker's time is the kernel's per-frame work for what it
            sends, which lands on the sending thread's core; more lanes
            spread it over more cores (docs/network.md, "A worker on several
            threads"). The protocol and the results are the same. 1 (the
            default) sends from the calling thread only.
        ecn: Explicit Congestion Notification (docs/congestion.md, "ECN"):
            datagrams go out ECN-capable, and a result that a queue on its
            way marked Congestion Experienced (instead of dropping it) is
            echoed to the switch, which marks the next block's result for
            every member; every member's window is cut there, as after a
            repaired loss. On by default, as on the switch (its ``ecn`` key);
            turn it off on a path that mishandles ECN-capable packets (the
            switch then sends this session's results Not-ECT too: it goes by
            what the session sends).

    Errors: an allreduce returns a complete result or raises.
    :class:`fanin.MemberRestarted` (another rank's process was replaced:
    start a new Session), :class:`fanin.MemberFailed` (a rank died under
    ``on_failure=fail``), :class:`fanin.StaleResult` (a block the switch no
    longer holds, or completed without every member, in a job that did not
    opt into partial results), :class:`fanin.SwitchGone` (the switch
    process stopped), :class:`fanin.FaninTimeout`.

    Example::

        s = fanin.Session("127.0.0.1:9000", job_id=1, rank=0)
        total = s.allreduce(np.ones(1000, dtype=np.float32))
    """

    def __init__(
        self,
        switch: str,
        job_id: int,
        rank: int,
        *,
        elems_per_packet: int = _DEFAULTS["elems_per_packet"],
        window: int = _DEFAULTS["window"],
        send_drop: float = 0.0,
        seed: int = 0,
        rto_ms: float = _DEFAULTS["rto_ms"],
        rto_min_ms: float = _DEFAULTS["rto_min_ms"],
        rto_max_ms: float = _DEFAULTS["rto_max_ms"],
        join_timeout_s: float = _DEFAULTS["join_timeout_s"],
        dead_after_s: float = _DEFAULTS["dead_after_s"],
        offload: bool = True,
        recv_drop: float = 0.0,
        sync_join: bool = False,
        align_blocks: int = 0,
        recv_duplicate: float = 0.0,
        recv_reorder: float = 0.0,
        auth_key: Optional[Union[bytes, str]] = None,
        result_group: Optional[str] = None,
        barrier_timeout_s: float = _DEFAULTS["barrier_timeout_s"],
        members: int = 0,
        lanes: int = 1,
        switch_gone_after_s: float = _DEFAULTS["switch_gone_after_s"],
        ecn: bool = True,
    ) -> None:
        # The native session is bound to the thread that made it (pyo3
        # `unsendable`): used from another, it panics with a PanicException,
        # a BaseException that escapes `except Exception`, after printing a
        # Rust backtrace. Every call checks the thread first (_checked). The
        # check is a thread-local mark, not the ident alone: CPython reuses
        # the ident of a thread that ended (a pool's next thread gets it),
        # and pyo3 would still panic there. The ident and name are for the
        # message.
        self._owner = threading.local()
        self._owner.here = True
        self._thread = (threading.get_ident(), threading.current_thread().name)
        self._native = _native.Session(
            switch,
            job_id,
            rank,
            elems_per_packet=elems_per_packet,
            window=window,
            send_drop=send_drop,
            seed=seed,
            rto_ms=rto_ms,
            rto_min_ms=rto_min_ms,
            rto_max_ms=rto_max_ms,
            join_timeout_s=join_timeout_s,
            dead_after_s=dead_after_s,
            offload=offload,
            recv_drop=recv_drop,
            sync_join=sync_join,
            align_blocks=align_blocks,
            recv_duplicate=recv_duplicate,
            recv_reorder=recv_reorder,
            auth_key=_member_key(auth_key),
            result_group=result_group,
            barrier_timeout_s=barrier_timeout_s,
            members=members,
            lanes=lanes,
            switch_gone_after_s=switch_gone_after_s,
            ecn=ecn,
        )
        self.switch = switch
        self.job_id = job_id
        self.rank = rank

    def _checked(self) -> Any:
        """The native session, on the thread that created it; a RuntimeError
        saying so on any other (before anything is sent)."""
        if not getattr(self._owner, "here", False):
            ident, name = self._thread
            raise RuntimeError(f"fanin.Session was created on thread {name!r} ({ident}) and is used on thread "
                               f"{threading.current_thread().name!r} ({threading.get_ident()}): create one Session "
                               "per thread")
        return self._native

    def allreduce(self, array: np.ndarray, *, average: bool = False,
                  out: Optional[np.ndarray] = None, dtype: Optional[str] = None,
                  keep: Optional[tuple[int, int]] = None) -> np.ndarray:
        """Return the element-wise sum of ``array`` over every member.

        ``array`` must be int32, float32 or float16 (any shape and memory
        layout; it is not modified unless it is also ``out``). float16
        travels as 2 bytes per element each way (docs/protocol.md 5.6).
        numpy has no bfloat16: pass a bfloat16 tensor's bits as a uint16 or
        int16 array with ``dtype="bfloat16"`` (from torch:
        ``t.view(torch.int16).numpy()``); the result is bits too. An
        ``ml_dtypes.bfloat16`` array is taken as it is. With ``average=True``
        (float arrays; int32 is refused) the result is the mean: each block
        is divided by the number of sources its result summed, which is
        fewer than the job size when the switch gave up on a straggler (a
        partial result, see :attr:`last_stats`). The division happens while
        the switch's sum is decoded, before the one rounding to the array's
        dtype, so a float16 mean that fits is never inf though its sum
        would be. The GIL is released while the switch
        aggregates, so other Python threads keep running.

        ``out``: write the result into this array (same shape and dtype,
        C-contiguous, writable; ``out=array`` reduces in place, as
        ``torch.distributed.all_reduce`` does) and return it. For repeated
        allreduces of large tensors this is the fast path: the sum is
        written into ``out`` directly as each block's result arrives, and a
        C-contiguous ``array`` that shares no memory with ``out`` is read in
        place, never copied. Otherwise (in place, or a strided input) the
        session stages the input into one buffer of the tensor's size that
        it keeps, so no call touches fresh memory (whose page faults cost
        more than the copies). Like numpy's own ``out=``, all that happens
        without the GIL: no other thread may use ``out``, nor write
        ``array``, until the call returns, and if the call raises, ``out``
        holds a partial result.

        ``keep=(start, stop)`` makes the call a **reduce-scatter**: every
        member contributes the whole array, but only the elements
        ``start:stop`` of the flattened result are the sum; the others are
        left as they were (``array``'s own values when reducing in place,
        unspecified in a new array). The switch sends this member the sums
        of the blocks that hold those elements and a 24-byte header for
        every other block, so its link carries about ``stop - start``
        elements down instead of the whole array (docs/protocol.md 4.13).
        Each member passes its own range; the ranges need not be disjoint.
        """
        native = self._checked()
        if not isinstance(array, np.ndarray):
            raise TypeError(f"allreduce takes a numpy array, got {type(array).__name__}")
        if out is not None and not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        fmt = _half_format(array, dtype, out)
        if keep is not None:
            start, stop = (int(k) for k in keep)
            if not 0 <= start <= stop <= array.size:
                raise ValueError(f"keep={keep!r} is not a range (start, stop) within the array's {array.size} "
                                 "elements")
            keep = (start, stop)
        if fmt is None:
            return native.allreduce(array, average=average, out=out, keep=keep)
        # 16-bit floats go to the switch as their bits (uint16 views: no
        # copy), `out` checked by _half_format
        bits = array.view(np.uint16) if array.flags.c_contiguous else np.ascontiguousarray(array).view(np.uint16)
        result = native.allreduce_half(bits, fmt, average=average,
                                       out=None if out is None else out.view(np.uint16), keep=keep)
        return out if out is not None else result.view(array.dtype)

    @property
    def last_stats(self) -> Optional[dict[str, Any]]:
        """Statistics of the last allreduce: ``retransmissions``, ``trimmed``
        (Trimmed nacks from an overloaded switch that made this worker resend
        a block and shrink its window), ``fast_retransmits`` (blocks found
        lost because results of later blocks came first: congestion
        signals, each within about a round trip), ``timeouts`` (stall
        timeouts: nothing answered for an RTO), ``marked_results`` (results
        the switch marked congested: a repaired loss, or a queue's ECN mark
        on some member's path), ``ecn_ce`` (results that reached this worker
        CE-marked; the next contribution echoes them to the switch),
        ``window`` (the congestion
        window in blocks when the call ended; docs/congestion.md), ``blocks``,
        ``gen_id``, ``degraded_blocks`` (list of ``(block, src_cnt)``: blocks
        whose result summed fewer than all members), ``min_src_cnt``,
        ``missed_blocks`` (blocks this worker arrived too late for: zero,
        ``src_cnt`` 0), ``latency_mean_ms``/``latency_max_ms`` (first send of
        a block to its result) and ``slow_sources`` (members the switch
        declared permanently slow)."""
        return self._checked().last_stats()

    @property
    def elems_per_packet(self) -> int:
        """Elements per packet this session sends (the job's packet size
        unless overridden): a tensor of n elements is ceil(n / this) blocks."""
        return self._checked().elems_per_packet

    @property
    def half_elems_per_packet(self) -> int:
        """Elements per block of a float16/bfloat16 allreduce: twice
        :attr:`elems_per_packet` within the job's block_grad_max when the
        packet size is the job's (int16 lanes fill the same datagram)."""
        return self._checked().half_elems_per_packet

    @property
    def n_sources(self) -> int:
        """Number of members in the job."""
        return self._checked().n_sources

    @property
    def params(self) -> dict[str, int]:
        """Job parameters announced by the switch at join time."""
        return self._checked().params

    @property
    def error(self) -> Optional[str]:
        """Why this session ended (the message of the error its calls now
        raise), or None while it can still be used."""
        return self._checked().error

    def linger(self, seconds: float = 60.0, until: Optional[Callable[[], bool]] = None) -> dict[str, Any]:
        """Keep taking part in the job after this member's last allreduce,
        until every member is done (the switch says so), for at most
        ``seconds``, or until ``until()`` returns true (asked every 20 ms).
        If the switch restarts while another member still waits for results
        of its last allreduce, the restarted switch needs this member's
        retained contributions to recompute them; a member that neither
        runs an allreduce nor lingers makes the others fail with a stalled
        recovery instead (docs/restart.md, "Idle members").

        Lingering costs one 24-byte probe to the switch every 200 ms; each
        says this member is done, and once every member said so the switch
        answers that all are, which ends it on every member within about
        one probe interval: the switch is the barrier. ``until`` is for a
        caller that knows sooner; ``seconds`` bounds the wait for members
        that never finish. Returns ``{"probes", "idle_recoveries",
        "all_done"}`` (``all_done``: ended because every member is done).
        Raises if the session failed meanwhile; the results this member
        already has are never touched.

        Example::

            for step in range(steps):
                s.allreduce(grads[step])
            s.linger()  # returns once every rank is done, 60 s at most
        """
        return self._checked().linger(float(seconds), until)

    def socket_stats(self) -> dict[str, Any]:
        """Datagrams sent, received, and dropped, duplicated or reordered by
        fault injection; ``lanes`` and, per lane, ``sent_by_lane`` and
        ``received_by_lane`` (lists, lane 0 first); what keyed jobs refused
        (``auth_*``)."""
        return self._checked().socket_stats()
