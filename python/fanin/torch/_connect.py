"""Rendezvous: which switch and which job a group of torch ranks uses.

Rank 0 of the group decides and publishes the answer through the c10d store
that ``init_process_group`` already created; the other ranks wait for it
there. Either

* ``FANIN_SWITCH=HOST:PORT`` names a running switch on which the job
  ``FANIN_JOB_ID`` (default 1) is admitted with the group's size (a keyed
  job: each rank reads its member key from ``FANIN_AUTH_KEY_FILE``, where
  ``{rank}`` stands for the rank, e.g. ``/run/secrets/fanin-{rank}.key``,
  so one environment serves every rank of a node and each rank finds only
  its own key), or
* ``FANIN_CONTROLLER=HOST:PORT`` names a ``fanin controller`` on which the
  job ``FANIN_JOB_ID`` was created (``fanin controller create-job``, keyed
  by default): every rank subscribes as its rank on its topology host
  ``FANIN_HOST`` and gets its switch and, for a keyed job, its member key
  (docs/security.md); the ranks unsubscribe when the group is destroyed, or
* by default rank 0 starts a switch inside its own process (the embedded
  default: the real daemon on background threads) with one job for the group.

When every rank runs on this machine, the embedded switch's job gets a result
group on loopback (docs/protocol.md 4.5): each result is sent once to the
group rather than once per rank. ``FANIN_RESULT_GROUP=off`` turns that off;
``FANIN_RESULT_GROUP=IPV4:PORT`` names the group of the job on an external
switch (``FANIN_SWITCH``), which every rank then listens on.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

from fanin._native import FaninRefused, session_defaults
from fanin.auth import read_key_file
from fanin.session import Session
from fanin.switch import JOB_DEFAULTS, LocalSwitch, free_result_group, job_config, switch_config

__all__ = ["Connection", "ConnectOptions", "connect"]

_KEY = "fanin/switch"
_SESSION_DEFAULTS = session_defaults()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


@dataclass
class ConnectOptions:
    """How a group reaches its switch; every field has an environment variable."""

    switch: Optional[str] = None      # FANIN_SWITCH: HOST:PORT of a running switch; None = embedded
    job_id: int = 1                   # FANIN_JOB_ID: the job on an external switch
    # FANIN_ELEMS_PER_PACKET; 0 = the job's packet size (fits the switch's MTU)
    elems_per_packet: int = _SESSION_DEFAULTS["elems_per_packet"]
    window: int = _SESSION_DEFAULTS["window"]  # FANIN_WINDOW: blocks in flight (= the embedded job's block_cnt_max)
    block_exp_ms: int = 0             # FANIN_BLOCK_EXP_MS: straggler aging of the embedded job; 0 = off
    bind: Optional[str] = None        # FANIN_SWITCH_BIND: where the embedded switch listens
    shards: int = 1                   # FANIN_SWITCH_SHARDS: processing threads of the embedded switch
    result_group: Optional[str] = None  # FANIN_RESULT_GROUP: "off", or IPV4:PORT; None = automatic
    controller: Optional[str] = None  # FANIN_CONTROLLER: HOST:PORT of a `fanin controller` that made the job
    host: Optional[str] = None        # FANIN_HOST: this rank's host in the controller's topology
    # FANIN_AUTH_KEY_FILE: this rank's member key for a keyed job on FANIN_SWITCH ("{rank}" = the rank)
    auth_key_file: Optional[str] = None
    lanes: int = 1                    # FANIN_LANES: sockets (and threads) each rank sends from
    # FANIN_MEMBER_TIMEOUT_MS: the embedded job's member timeout; 0 = the
    # group's timeout (at most the switch's 600 000 ms)
    member_timeout_ms: int = 0

    @classmethod
    def from_env(cls, **overrides: Any) -> "ConnectOptions":
        opts = cls(
            switch=os.environ.get("FANIN_SWITCH") or None,
            job_id=_env_int("FANIN_JOB_ID", 1),
            elems_per_packet=_env_int("FANIN_ELEMS_PER_PACKET", _SESSION_DEFAULTS["elems_per_packet"]),
            window=_env_int("FANIN_WINDOW", _SESSION_DEFAULTS["window"]),
            block_exp_ms=_env_int("FANIN_BLOCK_EXP_MS", 0),
            bind=os.environ.get("FANIN_SWITCH_BIND") or None,
            shards=_env_int("FANIN_SWITCH_SHARDS", 1),
            result_group=os.environ.get("FANIN_RESULT_GROUP") or None,
            controller=os.environ.get("FANIN_CONTROLLER") or None,
            host=os.environ.get("FANIN_HOST") or None,
            auth_key_file=os.environ.get("FANIN_AUTH_KEY_FILE") or None,
            lanes=_env_int("FANIN_LANES", 1),
            member_timeout_ms=_env_int("FANIN_MEMBER_TIMEOUT_MS", 0),
        )
        for k, v in overrides.items():
            if v is not None:
                setattr(opts, k, v)
        return opts


@dataclass
class Connection:
    session: Optional[Session]  # None once the group is shut down
    switch_addr: str
    job_id: int
    elems_per_packet: int
    n_sources: int
    embedded: Optional[LocalSwitch]  # set on the rank that runs the embedded switch
    results_on_group: bool = False   # the switch sends this rank's results to the job's result group
    controller: Optional[str] = None  # the controller this rank subscribed at (unsubscribed at shutdown)

    def leave(self, rank: int) -> None:
        """Unsubscribe from the controller this rank subscribed at, if any."""
        if self.controller is not None:
            _unsubscribe(self.controller, self.job_id, rank)
            self.controller = None


def _unsubscribe(controller: str, job_id: int, rank: int) -> None:
    from fanin.controller import ControllerClient

    with ControllerClient(controller) as client:
        client.unsubscribe(job_id, rank)


def _embedded_bind(world: int) -> tuple[str, Optional[str]]:
    """(bind address, address to advertise) for the embedded switch."""
    local = _env_int("LOCAL_WORLD_SIZE", world)
    if local >= world:
        return "127.0.0.1:0", None  # every rank is on this machine
    master = os.environ.get("MASTER_ADDR")
    if not master:
        raise RuntimeError("fanin: ranks span several machines but MASTER_ADDR is unset; set FANIN_SWITCH "
                           "to a running switch or FANIN_SWITCH_BIND to an address the other machines reach")
    return "0.0.0.0:0", master


# the longest member timeout a job may ask for (fanin-proto job.rs MAX_MEMBER_TIMEOUT_MS)
_MAX_MEMBER_TIMEOUT_MS = 600_000


def _member_timeout_ms(timeout: datetime.timedelta, opts: ConnectOptions) -> int:
    """The embedded job's member timeout: ``FANIN_MEMBER_TIMEOUT_MS``, else
    the group's timeout. The switch's default (5 s) declared a rank dead,
    and with it failed the job for good (MemberFailed on every rank, every
    later collective too), as soon as the others had waited 5 s for it in a
    collective: a rank saving a checkpoint, evaluating or loading data for
    longer than that between two collectives killed the group, where Gloo
    waits the group's timeout (and docs/torch.md says a long straggler does
    not fail the others). The price: a rank that dies (other than rank 0)
    is found after this timeout too; FANIN_MEMBER_TIMEOUT_MS lowers it."""
    ms = opts.member_timeout_ms or int(timeout.total_seconds() * 1000)
    return max(1, min(_MAX_MEMBER_TIMEOUT_MS, ms))


def _decide(world: int, opts: ConnectOptions,
            timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> tuple[Optional[LocalSwitch], str]:
    """Rank 0's choice: (embedded switch or None, "addr|job|elems_per_packet|result group")."""
    embedded = None
    off = opts.result_group == "off"
    if opts.switch:
        addr, job_id = opts.switch, opts.job_id
        group = None if off else opts.result_group
    else:
        bind, advertise = (opts.bind, None) if opts.bind else _embedded_bind(world)
        job_id = 1
        # a group on loopback reaches every rank only when all are local
        on_loopback = bind.startswith("127.") and not advertise
        group = None if off else (opts.result_group or (free_result_group() if on_loopback else None))
        job = job_config(job_id, world, block_cnt_max=opts.window,
                         block_grad_max=opts.elems_per_packet or JOB_DEFAULTS["block_grad_max"],
                         block_exp_ms=opts.block_exp_ms, result_group=group,
                         member_timeout_ms=_member_timeout_ms(timeout, opts))
        embedded = LocalSwitch(switch_config(data_addr=bind, shards=opts.shards, control_addr=None,
                                             metrics_addr=None, memory_mb=4096, jobs=[job]))
        addr = embedded.data_addr
        if advertise:
            addr = f"{advertise}:{addr.rsplit(':', 1)[1]}"
    return embedded, f"{addr}|{job_id}|{opts.elems_per_packet}|{group or ''}"


def _subscribe(store: Any, rank: int, world: int, timeout: datetime.timedelta,
               opts: ConnectOptions) -> tuple[str, Optional[bytes]]:
    """Subscribe this rank at the controller: (switch data address, member
    key or None), once every rank of the group has subscribed (so that each
    one's Join finds the job at the group's size)."""
    from fanin.controller import ControllerClient

    if opts.switch:
        raise RuntimeError("fanin: set FANIN_CONTROLLER or FANIN_SWITCH, not both (the controller names the switch)")
    if not opts.host:
        raise RuntimeError("fanin: FANIN_CONTROLLER is set but FANIN_HOST is not: name this rank's host in the "
                           "controller's topology (e.g. h0_0)")
    try:
        with ControllerClient(opts.controller) as client:
            sub = client.subscribe(opts.job_id, rank, opts.host)
    except Exception as e:
        store.set(f"fanin/subscribed/{rank}", f"!{e}")
        raise RuntimeError(f"fanin: the controller at {opts.controller} did not subscribe rank {rank} of job "
                           f"{opts.job_id} on host {opts.host}: {e}") from e
    store.set(f"fanin/subscribed/{rank}", "ok")
    keys = [f"fanin/subscribed/{r}" for r in range(world)]
    store.wait(keys, timeout)
    failed = [r for r, k in enumerate(keys) if store.get(k).decode().startswith("!")]
    if failed:
        _unsubscribe(opts.controller, opts.job_id, rank)
        raise RuntimeError(f"fanin: ranks {failed} could not subscribe at the controller {opts.controller}")
    return sub["data_addr"], sub["member_key"]


def _member_key_file(rank: int, opts: ConnectOptions) -> Optional[bytes]:
    """This rank's member key from ``FANIN_AUTH_KEY_FILE`` (32 hex digits,
    as `fanin controller subscribe` prints them, or 16 raw bytes), for a
    keyed job on an external switch; None when the variable is unset."""
    if not opts.auth_key_file:
        return None
    if opts.controller:
        raise RuntimeError("fanin: FANIN_AUTH_KEY_FILE is for a keyed job on FANIN_SWITCH; with FANIN_CONTROLLER "
                           "the controller hands each rank its key, so unset FANIN_AUTH_KEY_FILE")
    if not opts.switch:
        raise RuntimeError("fanin: FANIN_AUTH_KEY_FILE is set but FANIN_SWITCH is not: the embedded switch's job "
                           "is not keyed; name the switch whose keyed job this key is for")
    path = opts.auth_key_file.replace("{rank}", str(rank))
    try:
        return read_key_file(path)
    except OSError as e:
        raise RuntimeError(f"fanin: rank {rank} cannot read its member key from {path} (FANIN_AUTH_KEY_FILE): "
                           f"{e.strerror}") from None
    except ValueError as e:
        raise RuntimeError(f"fanin: FANIN_AUTH_KEY_FILE: {e}") from None


def _join(addr: str, job_id: int, rank: int, world: int, timeout: datetime.timedelta, opts: ConnectOptions,
          elems_per_packet: int, **session_kw: Any) -> Session:
    """This rank's Session on the job, with the group's timeouts."""
    dead_after = max(10.0, timeout.total_seconds())
    # A new Session is a new incarnation of this rank: against a job that
    # ran before (a second torchrun, a restarted group) it waits at the job's
    # barrier for every rank and starts a fresh round (docs/protocol.md §4.12).
    # members=world refuses a job of another size at once.
    try:
        return Session(addr, job_id, rank, elems_per_packet=elems_per_packet, window=opts.window, lanes=opts.lanes,
                       join_timeout_s=min(60.0, dead_after), dead_after_s=dead_after,
                       barrier_timeout_s=max(120.0, timeout.total_seconds()), members=world, **session_kw)
    except FaninRefused as e:
        raise RuntimeError(f"fanin: {e}") from e


def connect(store: Any, rank: int, world: int, timeout: datetime.timedelta, opts: ConnectOptions) -> Connection:
    """Agree on a switch and job through ``store`` and join it (all ranks call this)."""
    embedded: Optional[LocalSwitch] = None
    controller: Optional[str] = None
    # before any rendezvous: a rank with a misconfigured key fails at once
    member_key = _member_key_file(rank, opts)
    if opts.controller:
        addr, member_key = _subscribe(store, rank, world, timeout, opts)
        job_id, controller = opts.job_id, opts.controller
        try:
            session = _join(addr, job_id, rank, world, timeout, opts, opts.elems_per_packet, auth_key=member_key)
        except BaseException:
            _unsubscribe(controller, job_id, rank)  # not a member of a group that never formed
            raise
    else:
        if rank == 0:
            try:
                embedded, published = _decide(world, opts, timeout)
            except Exception as e:
                # tell the other ranks instead of leaving them waiting for the store timeout
                store.set(_KEY, f"!{type(e).__name__}: {e}")
                raise
            store.set(_KEY, published)
        else:
            store.wait([_KEY], timeout)
        answer = store.get(_KEY).decode()
        if answer.startswith("!"):
            raise RuntimeError(f"fanin: rank 0 could not set up the switch: {answer[1:]}")
        addr, job_s, epp_s, group = answer.split("|")
        job_id = int(job_s)
        # The embedded switch dies with rank 0's process and never comes
        # back on its port: the first "port unreachable" from rank 0's host
        # ends the group (as Gloo's closed connection does), instead of the
        # group's timeout of silence.
        gone = {"switch_gone_after_s": 0.0} if opts.switch is None else {}
        session = _join(addr, job_id, rank, world, timeout, opts, int(epp_s), result_group=group or None,
                        auth_key=member_key, **gone)
    # (the packet size the session really uses: the job's when epp is 0)
    return Connection(session=session, switch_addr=addr, job_id=job_id, elems_per_packet=session.elems_per_packet,
                      n_sources=session.n_sources, embedded=embedded,
                      results_on_group=bool(session.params["results_on_group"]), controller=controller)
