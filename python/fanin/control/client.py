"""Python client of the switch control API (gRPC, ``fanin.control.v1``).

The schema is ``proto/fanin/control/v1/control.proto``; the stubs in
``_gen/`` are generated from it by ``scripts/gen_proto_py.sh``.

Every method returns plain Python values (dicts, lists, ints, strings), and
every gRPC failure is raised as :class:`ControlError` carrying the status
code name (``"INVALID_ARGUMENT"``, ``"ALREADY_EXISTS"``,
``"RESOURCE_EXHAUSTED"``, ``"NOT_FOUND"``, ``"UNAUTHENTICATED"``,
``"UNAVAILABLE"``, ``"DEADLINE_EXCEEDED"``, ...) and the server's message.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional

import grpc

from ..switch import JOB_DEFAULTS
from ._gen import control_pb2 as pb
from ._gen import control_pb2_grpc as pb_grpc

__all__ = ["API_VERSION", "ControlClient", "ControlError", "MODES"]

#: The API version this client speaks (``info()["api_version"]``).
API_VERSION = "v1"

#: Job modes by name, as in the switch config file.
MODES = {"aggregate": pb.JOB_MODE_AGGREGATE, "forward": pb.JOB_MODE_FORWARD}
_MODE_NAMES = {v: k for k, v in MODES.items()}


class ControlError(Exception):
    """A control call failed.

    ``code`` is the gRPC status code name (e.g. ``"ALREADY_EXISTS"``),
    ``message`` the server's human-readable explanation.
    """

    def __init__(self, code: str, message: str):
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code

    def __repr__(self) -> str:
        return f"ControlError({self.code!r}, {self.message!r})"


CONTROL_TOKEN_ENV = "FANIN_CONTROL_TOKEN"


def control_token_from_env() -> Optional[str]:
    """The control API token from ``FANIN_CONTROL_TOKEN`` (None if unset or empty)."""
    return os.environ.get(CONTROL_TOKEN_ENV) or None


#: Reconnect quickly to a daemon that comes back (at most every 0.5 s).
#: Each client keeps its own connection (local subchannel pool): gRPC would
#: otherwise share one per address across the process, and a new client
#: would inherit another's reconnect backoff, failing at once with a stale
#: "connection refused" for up to 0.5 s after the daemon is back.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.use_local_subchannel_pool", 1),
]


class ControlClient:
    """Talks to one switch daemon's control API.

    ``addr`` is ``"host:port"``; ``token`` (default: the environment's
    ``FANIN_CONTROL_TOKEN``, if set) is sent on every call as
    ``authorization: Bearer <token>``; ``timeout`` (seconds) bounds each
    call. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, addr: str = "127.0.0.1:9100", token: Optional[str] = None, timeout: float = 5.0):
        self.addr = addr
        self.timeout = timeout
        token = token if token is not None else control_token_from_env()
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        # A restarted switch must be found quickly (docs/restart.md): gRPC's
        # default reconnect backoff starts at 1 s and grows to 120 s, so a
        # controller polling a switch that was down would keep it waiting.
        self._channel = grpc.insecure_channel(addr, options=RECONNECT_OPTIONS)
        self._stub = pb_grpc.ControlStub(self._channel)

    # -- lifecycle ---------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ControlClient({self.addr!r})"

    # -- calls -------------------------------------------------------------

    def info(self) -> Dict[str, Any]:
        """Identity, data-plane address and memory of the switch."""
        r = self._call("GetInfo", pb.GetInfoRequest())
        return {
            "api_version": r.api_version,
            "version": r.version,
            "data_addr": r.data_addr,
            "shard_count": r.shard_count,
            "incarnation": r.incarnation,
            "memory_limit": r.memory_limit,
            "memory_used": r.memory_used,
            # 0: no limit known (an older daemon, or loopback without one)
            "packet_elems_max": r.packet_elems_max,
        }

    def admit_job(
        self,
        job_id: int,
        members: Iterable[int],
        block_cnt_max: int = JOB_DEFAULTS["block_cnt_max"],
        block_grad_max: int = JOB_DEFAULTS["block_grad_max"],
        block_exp_ms: int = JOB_DEFAULTS["block_exp_ms"],
        mode: str = "aggregate",
        slow_after_windows: int = JOB_DEFAULTS["slow_after_windows"],
        workers: int = 0,
        tree: Optional[Dict[str, Any]] = None,
        on_failure: Optional[str] = None,
        member_timeout_ms: int = 0,
        rate_limit: Optional[Any] = None,
        key: Optional[Any] = None,
        result_group: Optional[str] = None,
        quorum: int = 0,
        resumed: bool = False,
    ) -> None:
        """Admit a job; ``members`` are the source ids (ranks) of its workers.

        ``block_cnt_max`` is the number of concurrent blocks (SwitchML's pool
        size), ``block_grad_max`` the most elements per block (defaults as in
        the switch config file), ``block_exp_ms``
        the straggler timeout (0 disables aging), ``mode`` ``"aggregate"`` or
        ``"forward"`` (the NoAggr baseline), ``slow_after_windows`` (K) the
        windows a source may miss before it is declared permanently slow.

        In an aggregation tree (SwitchML++), ``members`` are the switch's
        children (worker ranks, and child switches' ranks from 2048 up),
        ``workers`` the job's worker count (0 = len(members)) and ``tree``
        the non-root role ``{"parent_addr": "ip:port", "parent_shards": n,
        "rank": r}`` (None: the root, or the only switch). ``resumed``:
        True when a switch of a tree restarted with the job installed and
        the job is installed again: it then takes only recovery and sync
        joins from ranks new to it (docs/trees.md), and counts a child
        switch's partials only once the child reported its subtree's lowest
        block in a recovery (docs/restart.md, "Trees").

        ``on_failure`` (``"degrade"`` or ``"fail"``; None: ``"degrade"`` with
        ``block_exp_ms`` > 0, else ``"fail"``) and ``member_timeout_ms``
        (0 = 5000) say what happens when a worker dies (docs/failures.md);
        ``rate_limit`` ``(pps, burst)`` limits each source (docs/overload.md).
        ``key`` (16 bytes or 32 hex digits; None = unauthenticated) is the
        job key: members must seal their datagrams (docs/security.md).
        ``result_group`` (``"239.1.0.7:47001"``) makes the switch send each
        result once to that multicast group for the workers listening there
        (docs/protocol.md 4.5; keyed: sealed once under the job's result
        key, docs/security.md). ``quorum`` (GOAT's K; 0 =
        every member): a block completes with the first ``quorum`` members'
        contributions; it may change later through :meth:`update_job`.
        """
        self._call("AdmitJob", pb.AdmitJobRequest(spec=_job_spec(
            job_id, members, block_cnt_max, block_grad_max, block_exp_ms, mode, slow_after_windows, workers, tree,
            on_failure=on_failure, member_timeout_ms=member_timeout_ms, rate_limit=rate_limit, key=key,
            result_group=result_group, quorum=quorum, resumed=resumed)))

    def update_job(self, job: Dict[str, Any], awaiting: Iterable[int] = ()) -> None:
        """Change a running job in place: ``job`` as :meth:`list_jobs` gives
        it, with new ``members``, ``workers``, ``tree`` or ``quorum`` (the
        other fields must stay as admitted: ``FAILED_PRECONDITION``
        otherwise). New
        members listed in ``awaiting`` join a running job: blocks wait for
        them only from the start block their sync names."""
        spec = _job_spec(job["job_id"], job["members"], job["block_cnt_max"], job["block_grad_max"],
                         job["block_exp_ms"], job["mode"], job["slow_after_windows"], job.get("workers", 0),
                         job.get("tree"), on_failure=job.get("on_failure"),
                         member_timeout_ms=job.get("member_timeout_ms", 0), rate_limit=job.get("rate_limit"),
                         key=job.get("key"), result_group=job.get("result_group"), quorum=job.get("quorum", 0),
                         resumed=job.get("resumed", False))
        awaiting = [int(m) for m in awaiting]
        for m in awaiting:
            _check_u32(m, "awaiting member")
        self._call("UpdateJob", pb.UpdateJobRequest(spec=spec, awaiting=awaiting))

    def remove_job(self, job_id: int) -> None:
        """Remove a job and free its memory (``NOT_FOUND`` if unknown)."""
        _check_u32(job_id, "job_id")
        self._call("RemoveJob", pb.RemoveJobRequest(job_id=job_id))

    def install_transit(self, job_id: int, next_addr: str, next_shards: int, sources: Iterable[int] = ()) -> None:
        """Relay job ``job_id`` for sources this switch does not aggregate
        (GOAT's on-path filtering, docs/goat.md): their datagrams go unchanged
        to the next switch on their path (``next_addr`` "ip:port" of its
        shard 0, ``next_shards`` its shards, which must equal this switch's),
        results come back down once per distinct address. ``sources``: the
        ranks whose path passes this switch; only they are relayed (empty:
        any). Installing again moves the next hop and replaces the sources.
        ``INVALID_ARGUMENT`` on a bad address or a shard count that differs."""
        _check_u32(job_id, "job_id")
        self._call("InstallTransit", pb.InstallTransitRequest(
            job_id=job_id, next=pb.NextHop(addr=next_addr, shards=next_shards), sources=list(sources)))

    def remove_transit(self, job_id: int) -> None:
        """Stop relaying a job (``NOT_FOUND`` if not relayed here)."""
        _check_u32(job_id, "job_id")
        self._call("RemoveTransit", pb.RemoveTransitRequest(job_id=job_id))

    def list_jobs(self, page_size: int = 0) -> List[Dict[str, Any]]:
        """The admitted jobs, ordered by job_id, as dicts with the
        :meth:`admit_job` argument names. Fetched a page at a time
        (`page_size` jobs, 0 = the switch's default of 100; a page also stays
        under 1 MiB), so a switch with thousands of large jobs lists them all
        within gRPC's message limit."""
        _check_u32(page_size, "page_size")
        jobs: List[Dict[str, Any]] = []
        token = ""
        while True:
            r = self._call("ListJobs", pb.ListJobsRequest(page_size=page_size, page_token=token))
            jobs.extend(_job_to_dict(j) for j in r.jobs)
            if not r.next_page_token:
                return jobs
            token = r.next_page_token

    def counters(self) -> List[Dict[str, Any]]:
        """Packet counters merged over shards: a list of
        ``{"name": str, "reason": str | None, "value": int}``."""
        r = self._call("GetCounters", pb.GetCountersRequest())
        return [
            {"name": c.name, "reason": c.reason if c.HasField("reason") else None, "value": c.value}
            for c in r.counters
        ]

    # -- plumbing ----------------------------------------------------------

    def kv_regions(self) -> List[Dict[str, Any]]:
        """Key-value task regions the switch holds (docs/kv.md), by task_id,
        with their figures (tuples_in, tuples_aggregated, packets_acked, ...)."""
        r = self._call("ListKvRegions", pb.ListKvRegionsRequest())
        out = []
        for region in r.regions:
            spec = region.spec
            out.append({
                "task_id": spec.task_id, "tenant": spec.tenant, "receiver_addr": spec.receiver_addr,
                "slots": spec.short_slots + spec.medium_groups * spec.medium_parts, "aa_size": spec.aa_size,
                "shadow_copies": spec.shadow_copies, "data_addr": region.data_addr,
                "value_type": pb.KvValueType.Name(spec.value_type).removeprefix("KV_VALUE_TYPE_").lower(),
                "tuples_in": region.tuples_in, "tuples_aggregated": region.tuples_aggregated,
                "packets_acked": region.packets_acked, "packets_forwarded": region.packets_forwarded,
                "swaps": region.swaps,
            })
        return out

    def release_kv_region(self, task_id: int) -> None:
        """Free a key-value task's switch region (NOT_FOUND if there is none)."""
        _check_u32(task_id, "task_id")
        self._call("ReleaseKvRegion", pb.ReleaseKvRegionRequest(task_id=task_id))

    def kv_counters(self) -> Dict[str, int]:
        """Key-value packet counters over all shards, {name or name.reason: value}."""
        r = self._call("GetKvCounters", pb.GetCountersRequest())
        return {(c.name + "." + c.reason) if c.HasField("reason") else c.name: c.value for c in r.counters}

    def _call(self, method: str, request: Any) -> Any:
        return call_rpc(self._stub, method, request, addr=self.addr, timeout=self.timeout, metadata=self._metadata)


def call_rpc(stub: Any, method: str, request: Any, *, addr: str, timeout: float, metadata: Any) -> Any:
    """Call `method` on a generated stub; a gRPC failure becomes a
    :class:`ControlError` named after its status code (shared by the switch
    and controller clients)."""
    try:
        return getattr(stub, method)(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        name = code.name if code is not None else "UNKNOWN"
        details = e.details() if hasattr(e, "details") else str(e)
        raise ControlError(name, f"{method} on {addr}: {details or ''}".rstrip(": ")) from None


def _check_u32(value: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
        raise ValueError(f"{what} must be an integer in 0..2**32, not {value!r}")


FAILURE_POLICIES = {"degrade": pb.FailurePolicy.FAILURE_POLICY_DEGRADE, "fail": pb.FailurePolicy.FAILURE_POLICY_FAIL}
_POLICY_NAMES = {v: k for k, v in FAILURE_POLICIES.items()}


def _job_spec(job_id, members, block_cnt_max, block_grad_max, block_exp_ms, mode, slow_after_windows,
              workers, tree, *, on_failure=None, member_timeout_ms=0, rate_limit=None,
              key=None, result_group=None, quorum=0, resumed=False) -> "pb.JobSpec":
    try:
        mode_value = MODES[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}") from None
    if on_failure is not None and on_failure not in FAILURE_POLICIES:
        raise ValueError(f"on_failure must be one of {sorted(FAILURE_POLICIES)}, not {on_failure!r}")
    _check_u32(member_timeout_ms, "member_timeout_ms")
    members = [int(m) for m in members]
    for value, what in [(job_id, "job_id"), (block_cnt_max, "block_cnt_max"),
                        (block_grad_max, "block_grad_max"), (block_exp_ms, "block_exp_ms"),
                        (slow_after_windows, "slow_after_windows"), (workers, "workers"),
                        *((m, "member id") for m in members)]:
        _check_u32(value, what)
    spec = pb.JobSpec(
        job_id=job_id,
        members=members,
        block_cnt_max=block_cnt_max,
        block_grad_max=block_grad_max,
        block_exp_ms=block_exp_ms,
        slow_after_windows=slow_after_windows,
        mode=mode_value,
        member_timeout_ms=member_timeout_ms,
    )
    if on_failure is not None:  # unset: the switch's default (fail, or degrade with aging)
        spec.on_failure = FAILURE_POLICIES[on_failure]
    if result_group:
        spec.result_group = str(result_group)
    if key is not None:
        from ..auth import _key_bytes

        spec.key = _key_bytes(key)
    if rate_limit is not None:
        pps, burst = (rate_limit["pps"], rate_limit["burst"]) if isinstance(rate_limit, dict) else rate_limit
        _check_u32(pps, "rate_limit pps")
        _check_u32(burst, "rate_limit burst")
        spec.rate_limit.CopyFrom(pb.RateLimit(pps=pps, burst=burst))
    if workers:
        spec.workers = workers
    if quorum:
        _check_u32(quorum, "quorum")
        spec.quorum = quorum
    if resumed:
        spec.resumed = True
    if tree is not None:
        unknown = set(tree) - {"parent_addr", "parent_shards", "rank"}
        if unknown:
            hint = " (resumed is the job's, not its tree role's)" if "resumed" in unknown else ""
            raise ValueError(f"tree has unknown keys {sorted(unknown)} (parent_addr, parent_shards, rank){hint}")
        spec.tree.CopyFrom(pb.TreeRole(parent_addr=str(tree["parent_addr"]),
                                       parent_shards=int(tree.get("parent_shards", 1)), rank=int(tree["rank"])))
    return spec


def _job_to_dict(j: "pb.JobSpec") -> Dict[str, Any]:
    return {
        "job_id": j.job_id,
        "members": list(j.members),
        "block_cnt_max": j.block_cnt_max,
        "block_grad_max": j.block_grad_max,
        "block_exp_ms": j.block_exp_ms,
        "slow_after_windows": j.slow_after_windows if j.HasField("slow_after_windows") else 2,
        "mode": _MODE_NAMES.get(j.mode, f"unknown({j.mode})"),
        "workers": j.workers if j.HasField("workers") else 0,
        "tree": ({"parent_addr": j.tree.parent_addr, "parent_shards": j.tree.parent_shards, "rank": j.tree.rank}
                 if j.HasField("tree") else None),
        "resumed": j.resumed,
        "on_failure": _POLICY_NAMES.get(j.on_failure, f"unknown({j.on_failure})"),
        "member_timeout_ms": j.member_timeout_ms,
        "rate_limit": {"pps": j.rate_limit.pps, "burst": j.rate_limit.burst} if j.HasField("rate_limit") else None,
        # the job key (the switch lists it: its API needs a token off
        # loopback), so that update_job(list_jobs()[i]) keeps it
        "key": bytes(j.key) or None,
        "result_group": j.result_group or None,
        "quorum": j.quorum,
    }
