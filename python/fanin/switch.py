"""Running a switch: in this process (embedded default, tests) or configured
for ``fanin switch``."""

from __future__ import annotations

import ipaddress
import json
import math
import numbers
from typing import Any, Iterable, Optional, Union

from fanin import _native

__all__ = ["LocalSwitch", "local_switch", "job_config", "switch_config", "free_result_group", "JOB_DEFAULTS",
           "JOB_SCHEMA", "check_job", "config_json"]

#: Every field of a job with its default (None: unset), read from the Rust
#: job description (`fanin_switch::JobConfig`), the one place they are
#: written; `job_id` is required (its value here is a placeholder).
JOB_SCHEMA: dict[str, Any] = _native.job_schema()
#: The sizing defaults (block_cnt_max, block_grad_max, block_exp_ms,
#: slow_after_windows) every Python layer that describes a job uses.
JOB_DEFAULTS: dict[str, int] = _native.job_defaults()


U16, U32, U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1
#: Most shards a switch runs (`DaemonConfig::validate`).
MAX_SHARDS = 64
#: Most aggregation memory a config may give, in MiB (`config::MAX_MEMORY_MB`).
MAX_MEMORY_MB = 2**30
#: The range of each integer field of a job (the Rust type's; the switch
#: checks what it means, e.g. block_grad_max against a datagram). A field
#: not listed is a u32.
#: (sources and workers: source ids lie below the switch's MAX_SOURCES, 4096)
JOB_INT_RANGES: dict[str, tuple[int, int]] = {"job_id": (0, U32), "sources": (1, 4096), "workers": (0, 4096),
                                              "quorum": (0, 4096)}
#: The words a job's text fields take.
JOB_CHOICES: dict[str, tuple[str, ...]] = {"mode": ("aggregate", "forward"), "on_failure": ("degrade", "fail")}


def _bound(n: int) -> str:
    return {U32: "2**32-1", U64: "2**64-1"}.get(n, str(n))


def range_text(lo: int, hi: int, unit: str = "") -> str:
    """'(1 to 64)', '(0 to 2**32-1 ms)': how every range check says what it takes."""
    return f"({lo} to {_bound(hi)}{' ' + unit if unit else ''})"


def check_int(name: str, value: Any, lo: int, hi: int, unit: str = "") -> int:
    """``value`` as an int within lo..hi, or a ValueError naming ``name``,
    the value and the range (a TypeError for what is no integer): the
    switch's own parser would say only "invalid value: integer `-1`,
    expected u16" about a JSON the caller never saw."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer {range_text(lo, hi, unit)}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is out of range {range_text(lo, hi, unit)}")
    return int(value)


def check_probability(name: str, value: Any) -> float:
    """``value`` as a probability, 0 to 1 (NaN refused: it went into the
    config's JSON as a bare NaN, "expected value at line 1 column 344")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a probability (0 to 1), got {value!r}")
    if not 0.0 <= value <= 1.0:  # NaN compares false
        raise ValueError(f"{name} = {value} is not a probability (0 to 1)")
    return float(value)


def ip_port_error(text: Any, example: str = "127.0.0.1:9000", ipv4: bool = False) -> Optional[str]:
    """Why ``text`` is not an address the daemons parse (IPV4:PORT or
    [IPV6]:PORT, as Rust's SocketAddr; no names), or None if it is."""
    form = "IPV4:PORT" if ipv4 else "IP:PORT"
    if not isinstance(text, str):
        return f"{text!r} is not {form} (e.g. {example})"
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
        if not sep or not port.isdigit() or (ip.version == 6) != bracketed or (ipv4 and ip.version != 4):
            raise ValueError
    except ValueError:
        return f"{text!r} is not {form} (e.g. {example})"
    if int(port) > U16:
        return f"port {int(port)} is out of range (0 to {U16})"
    return None


def check_job(job: dict[str, Any], label: str = "{}") -> dict[str, Any]:
    """Check a job description's fields before the switch parses it: each
    integer within its type's range (:data:`JOB_INT_RANGES`), the words of
    ``mode`` and ``on_failure``, ``result_group`` as IPV4:PORT, ``key``
    as 32 hex digits. ``label`` formats each field's name in messages
    (``"job field {}"`` for ``--job``). Returns ``job``."""
    for name, value in job.items():
        what = label.replace("{}", name)
        if name == "members" and value is not None:
            for m in value:
                if isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 0 <= m < 4096:
                    raise ValueError(f"{what}: member {m!r} is out of range {range_text(0, 4095)}")
        elif name in JOB_CHOICES and value is not None:
            if value not in JOB_CHOICES[name]:
                raise ValueError(f"{what}={value!r}: give {' or '.join(JOB_CHOICES[name])}")
        elif name == "result_group" and value is not None:
            why = ip_port_error(value, "239.1.0.7:47001", ipv4=True)
            if why:
                raise ValueError(f"{what}={value!r} is not IPV4:PORT of a multicast group (e.g. 239.1.0.7:47001)"
                                 if "is not" in why else f"{what}: {why}")
        elif name == "key" and value is not None:
            if not (isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdefABCDEF" for c in value)):
                # (never echo the value: a mistyped key is still mostly a secret)
                raise ValueError(f"{what}: give 32 hex digits (a 16-byte key, as `fanin keys` writes), not "
                                 f"{len(value) if isinstance(value, str) else type(value).__name__} characters")
        elif isinstance(JOB_SCHEMA.get(name), int) or name in JOB_INT_RANGES:
            if value is None and name != "job_id" and JOB_SCHEMA.get(name) is None:
                continue
            lo, hi = JOB_INT_RANGES.get(name, (0, U32))
            check_int(what, value, lo, hi)
    return job


def config_json(config: dict[str, Any]) -> str:
    """A switch config as the JSON the daemon reads, refusing a NaN or an
    infinity by its field's path (``faults.egress_drop``): JSON has none,
    and the daemon's parser said only "expected value at line 1 column N"."""

    def walk(value: Any, path: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path} = {value} is not a number the switch takes")
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(config, "")
    return json.dumps(config)


def job_config(
    job_id: int,
    sources: Optional[int] = None,
    members: Optional[Iterable[int]] = None,
    *,
    block_cnt_max: int = JOB_DEFAULTS["block_cnt_max"],
    block_grad_max: int = JOB_DEFAULTS["block_grad_max"],
    block_exp_ms: int = JOB_DEFAULTS["block_exp_ms"],
    slow_after_windows: int = JOB_DEFAULTS["slow_after_windows"],
    mode: str = JOB_SCHEMA["mode"],
    key: Optional[Union[bytes, str]] = None,
    on_failure: Optional[str] = None,
    member_timeout_ms: int = JOB_SCHEMA["member_timeout_ms"],
    rate_limit: Optional[tuple[int, int]] = None,
    result_group: Optional[str] = None,
    workers: int = JOB_SCHEMA["workers"],
    quorum: int = 0,
) -> dict[str, Any]:
    """A job as the switch config (and ``LocalSwitch.admit_job``) expects it.

    Give either ``sources`` (members 0..n-1) or ``members`` (explicit ids).
    ``mode="forward"`` is the NoAggr baseline: contributions are returned to
    their sender without aggregation.

    Straggler mitigation (docs/stragglers.md): ``block_exp_ms`` > 0 makes the
    switch emit partial results for blocks that waited that long for a
    missing source; ``slow_after_windows`` (K) declares a source missing for
    K windows permanently slow, so blocks stop waiting for it (0 = never).

    ``key`` (16 bytes or 32 hex digits) makes the job authenticated: members
    must seal every datagram with their member key (docs/security.md).

    Worker failure (docs/failures.md): a worker silent for
    ``member_timeout_ms`` (0 = 5000) while a block has waited that long for
    it is dead; ``on_failure="degrade"`` continues without it (degraded
    results), ``"fail"`` fails the job (every worker's allreduce raises
    ``fanin.MemberFailed`` naming the dead rank). Unset: ``"degrade"`` if
    ``block_exp_ms`` > 0 (the job asked for partial results), else
    ``"fail"``. ``rate_limit=(pps, burst)``
    limits each source (docs/overload.md).

    ``result_group`` (``"239.1.0.7:47001"``): the switch sends each result
    once to this IPv4 multicast group for the workers listening there
    (``fanin.Session(..., result_group=...)``) instead of a copy to each
    (docs/protocol.md 4.5). A keyed job's group results are sealed once
    under the job's result key, which every listening member learns from
    its JoinAck: any member could then forge results to the others
    (docs/security.md says what that changes).

    ``workers``: the workers of the whole job when this switch is one of an
    aggregation tree's (docs/trees.md); 0 = its member count.

    ``quorum`` (GOAT's K, docs/goat.md): a block completes with the first
    ``quorum`` members' contributions, the others' arrive late and get the
    result; 0 = every member. Workers get partial (degraded) results.
    """
    job: dict[str, Any] = {
        "job_id": job_id,
        "block_cnt_max": block_cnt_max,
        "block_grad_max": block_grad_max,
        "block_exp_ms": block_exp_ms,
        "slow_after_windows": slow_after_windows,
        "mode": mode,
        "member_timeout_ms": member_timeout_ms,
    }
    if workers:
        job["workers"] = workers
    if quorum:
        job["quorum"] = quorum
    if on_failure is not None:
        job["on_failure"] = on_failure
    if result_group is not None:
        job["result_group"] = result_group
    if rate_limit is not None:
        job["rate_limit"] = {"pps": int(rate_limit[0]), "burst": int(rate_limit[1])}
    if members is not None:
        job["members"] = list(members)
    if sources is not None:
        job["sources"] = sources
    if key is not None:
        from fanin.auth import key_hex

        job["key"] = key_hex(key)
    return check_job(job)


def free_result_group() -> str:
    """A result group (``job_config(result_group=...)``) for a switch and
    workers on this host: an administratively scoped multicast address
    (239.77/16) picked from the pid, so concurrent runs do not share one,
    and a UDP port no socket holds right now."""
    import os
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid = os.getpid()
    return f"239.77.{(pid >> 8) & 255}.{pid & 255}:{port}"


def switch_config(
    *,
    data_addr: str = "127.0.0.1:9000",
    shards: Optional[int] = None,
    control_addr: Optional[str] = "auto",
    metrics_addr: Optional[str] = "auto",
    memory_mb: int = 1024,
    memory_model: Optional[str] = None,
    ingress_drop: float = 0.0,
    egress_drop: float = 0.0,
    seed: int = 0,
    ingress_duplicate: float = 0.0,
    ingress_reorder: float = 0.0,
    batch: int = 64,
    scanners: int = 8,
    checks: int = 4,
    max_factor: int = 16,
    scanner_threads: bool = False,
    trim: bool = False,
    trim_watermark: float = 0.5,
    mark_watermark: Optional[float] = None,
    socket_buffer: Optional[int] = None,
    rate_limit: Optional[tuple[int, int]] = None,
    jobs: Iterable[dict[str, Any]] = (),
    control_token: Optional[str] = None,
    data_mtu: Optional[int] = None,
    ecn: bool = True,
) -> dict[str, Any]:
    """The daemon configuration (the same fields as the TOML config file).
    ``shards``: processing threads, one data port each (None: the daemon's
    default, one per two cores, 1 to 8). ``control_addr`` and
    ``metrics_addr``: ``"auto"`` (127.0.0.1 at the data port + 100 and
    + 101, or a free port if taken), ``"ip:port"``, or None (off).
    ``scanners``, ``checks`` and ``max_factor`` (skew-aware expiry's
    ceiling, in multiples of a job's ``block_exp_ms``; 1 = a fixed timeout)
    configure the straggler detector (docs/stragglers.md), and
    ``scanner_threads`` runs its scanners as timer threads of their own
    (Trio's design) instead of on the shard threads; ``trim``
    and ``trim_watermark`` trimming on overload (docs/trimming-daemon.md),
    ``mark_watermark`` marking instead (a contribution reaching a receive
    queue deeper than this fraction marks its block's result congested,
    ATP's switch-side ECN; docs/trimming-daemon.md, "Marking");
    ``socket_buffer`` the receive buffer per data socket in bytes (default
    the daemon's). ``memory_model``: "pooled" (the daemon's default:
    Trio-ML's shared memory, block buffers taken on demand) or "reserved"
    (SwitchML: every job's buffers reserved at admission); docs/memory.md. ``ingress_drop``/``ingress_duplicate``/``ingress_reorder``
    and ``egress_drop`` are seeded fault-injection probabilities (reordering
    swaps a datagram with the next one of its receive batch).
    ``control_token`` is the bearer token the control API
    requires; unset, the daemon takes ``FANIN_CONTROL_TOKEN`` from the
    environment, and refuses to start with a non-loopback ``control_addr``
    and no token (docs/security.md). ``rate_limit=(pps, burst)`` is the per-source rate
    limit of jobs that set none (docs/overload.md). ``ecn``: send results
    ECN-capable and mark a block whose contribution arrived CE-marked
    (docs/congestion.md, "ECN")."""
    if shards is not None:
        check_int("shards", shards, 1, MAX_SHARDS)
    check_int("memory_mb", memory_mb, 1, MAX_MEMORY_MB, "MiB")
    check_int("seed", seed, 0, U64)
    for name, p in (("ingress_drop", ingress_drop), ("egress_drop", egress_drop),
                    ("ingress_duplicate", ingress_duplicate), ("ingress_reorder", ingress_reorder)):
        check_probability(name, p)
    why = ip_port_error(data_addr)
    if why:
        raise ValueError(f"data_addr: {why}")
    for name, addr, example in (("control_addr", control_addr, "127.0.0.1:9100"),
                                ("metrics_addr", metrics_addr, "127.0.0.1:9101")):
        if addr not in (None, "auto", "off") and ip_port_error(addr):
            raise ValueError(f'{name}={addr!r} is not an address: give "auto", "off" (or None) or ip:port '
                             f"(e.g. {example})")
    jobs = [check_job(dict(j), f"jobs[{i}].{{}}") for i, j in enumerate(jobs)]
    cfg: dict[str, Any] = {
        "aging": {"scanners": scanners, "checks": checks, "max_factor": max_factor, "threads": scanner_threads},
        "trim": {"enabled": trim, "watermark": trim_watermark,
                 **({"mark_watermark": mark_watermark} if mark_watermark is not None else {})},
        "data_addr": data_addr,
        "control_addr": control_addr,
        "metrics_addr": metrics_addr,
        "memory_mb": memory_mb,
        "batch": batch,
        "ecn": ecn,
        "faults": {"ingress_drop": ingress_drop, "ingress_duplicate": ingress_duplicate,
                   "ingress_reorder": ingress_reorder, "egress_drop": egress_drop, "seed": seed},
        "jobs": list(jobs),
    }
    if shards is not None:  # else the daemon's: one per two cores, 1..8
        cfg["shards"] = shards
    if socket_buffer is not None:
        cfg["socket_buffer"] = socket_buffer
    if data_mtu is not None:
        # the data port's MTU instead of the interface's (0 = detect)
        cfg["data_mtu"] = data_mtu
    if memory_model is not None:
        cfg["memory_model"] = memory_model
    if control_token is not None:
        cfg["control_token"] = control_token
    if rate_limit is not None:
        cfg["rate_limit"] = {"pps": int(rate_limit[0]), "burst": int(rate_limit[1])}
    return cfg


class LocalSwitch:
    """A fanin switch running on background threads of this process.

    It is the real daemon (same shard threads, sockets and counters as
    ``fanin switch``), so tests and the embedded default exercise shipped code.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self._switch = _native.Switch(config_json(config))

    @property
    def data_addr(self) -> str:
        return self._switch.data_addr

    @property
    def metrics_addr(self) -> Optional[str]:
        return self._switch.metrics_addr

    def admit_job(self, job: dict[str, Any]) -> None:
        self._switch.admit_job(json.dumps(job))

    def remove_job(self, job_id: int) -> None:
        self._switch.remove_job(job_id)

    def counters(self) -> dict[str, int]:
        return self._switch.counters()

    def metrics_text(self) -> str:
        return self._switch.metrics_text()

    def stop(self) -> None:
        self._switch.stop()

    def __enter__(self) -> "LocalSwitch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_switch(
    workers: int = 1,
    *,
    job_id: int = 1,
    shards: int = 1,
    block_cnt_max: int = JOB_DEFAULTS["block_cnt_max"],
    block_grad_max: int = JOB_DEFAULTS["block_grad_max"],
    block_exp_ms: int = JOB_DEFAULTS["block_exp_ms"],
    slow_after_windows: int = JOB_DEFAULTS["slow_after_windows"],
    ingress_drop: float = 0.0,
    egress_drop: float = 0.0,
    seed: int = 0,
    extra_jobs: Iterable[dict[str, Any]] = (),
) -> LocalSwitch:
    """Start a switch on an ephemeral loopback port with one job of
    ``workers`` sources; no control API or metrics ports are opened."""
    check_int("workers", workers, 1, 4096)
    jobs = [
        job_config(
            job_id,
            workers,
            block_cnt_max=block_cnt_max,
            block_grad_max=block_grad_max,
            block_exp_ms=block_exp_ms,
            slow_after_windows=slow_after_windows,
        )
    ]
    jobs += list(extra_jobs)
    return LocalSwitch(
        switch_config(
            data_addr="127.0.0.1:0",
            shards=shards,
            control_addr=None,
            metrics_addr=None,
            ingress_drop=ingress_drop,
            egress_drop=egress_drop,
            seed=seed,
            jobs=jobs,
        )
    )
