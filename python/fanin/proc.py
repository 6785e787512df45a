"""Process plumbing shared by the demo, the controller's loopback switches and
the benchmarks (fanin_bench): a switch in its own process, worker inputs,
sizes, reference checks."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any, Optional

import numpy as np

__all__ = [
    "SwitchProcess",
    "terminate",
    "parse_size",
    "format_size",
    "worker_inputs",
    "reference_sum",
    "float_error_bound",
    "HALF_DTYPES",
    "bf16_bits",
    "half_values",
    "scrape_counters",
]

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)([iI]?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """Bytes from '100MB', '64KiB', '1e6' style strings (decimal units: 1 MB = 10**6)."""
    m = _SIZE.match(str(text))
    if not m:
        try:
            return int(float(text))
        except ValueError:
            raise ValueError(f"size {text!r} is not a number of bytes such as 100MB, 64KiB or 4096") from None
    value, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    base = 1024 if binary else 1000
    return int(value * {"": 1, "K": base, "M": base**2, "G": base**3}[unit])


def format_size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


def terminate(proc: subprocess.Popen) -> int:
    """SIGTERM a child daemon, SIGKILL it if it has not exited after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _last_error(log: Any) -> str:
    """The last line a child wrote to its stderr file `log` (its error: `fanin switch: ...: invalid config:
    shards = 0 is out of range`, or a traceback's last line), '' if none."""
    if log is None:
        return ""
    log.seek(0)
    lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class SwitchProcess:
    """`fanin switch` in a child process, stopped with SIGTERM on exit.

    ``netns`` runs it inside that network namespace (`ip netns exec NS`,
    which execs, so ``proc`` is still the daemon itself); the testbed uses it
    (``fanin_bench.testbed.Testbed.switch``).
    """

    def __init__(self, config: dict[str, Any], *, quiet: bool = True, netns: Optional[str] = None) -> None:
        from fanin.switch import config_json

        text = config_json(config)  # a NaN or an infinity refused by its field's name, before any file exists
        fd, self.config_path = tempfile.mkstemp(prefix="fanin-switch-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        self.netns = netns
        # quiet: the switch's stderr goes to a file nobody reads (a pipe left unread could fill and stall it),
        # unless it exits before it is ready: then its own error line is the exception's
        log = tempfile.TemporaryFile() if quiet else None
        try:
            self.proc = subprocess.Popen(
                (["ip", "netns", "exec", netns] if netns else [])
                + [sys.executable, "-m", "fanin", "switch", "--config", self.config_path, "--print-ready"],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if not line:
                try:
                    code = self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = terminate(self.proc)
                raise RuntimeError(f"fanin switch exited with code {code} before it was ready: "
                                   f"{_last_error(log) or 'its error is on stderr above'}")
            self.info = json.loads(line)
        except BaseException:
            if getattr(self, "proc", None) is not None and self.proc.poll() is None:
                terminate(self.proc)  # (interrupted, or a ready line that is not JSON)
            self._forget_config()
            raise
        finally:
            if log is not None:
                log.close()  # the child keeps its own descriptor
        # the switch has read its config: nothing is left behind if this process dies without stop()
        self._forget_config()
        self.data_addr: str = self.info["data_addr"]
        self.metrics_addr: Optional[str] = self.info.get("metrics_addr")
        self.control_addr: Optional[str] = self.info.get("control_addr")

    def _forget_config(self) -> None:
        try:
            os.unlink(self.config_path)
        except OSError:
            pass

    def counters(self) -> dict[str, int]:
        if not self.metrics_addr:
            return {}
        return scrape_counters(self.metrics_addr)

    def stop(self) -> int:
        terminate(self.proc)
        self._forget_config()
        return self.proc.returncode

    def __enter__(self) -> "SwitchProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape_counters(metrics_addr: str) -> dict[str, int]:
    """Sum the switch's Prometheus counters over shards: {counter[.reason]: value};
    the key-value program's as {kv.counter[.reason]: value}."""
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    pat = re.compile(r'^fanin_switch_packets_total\{shard="\d+",counter="(\w+)"(?:,reason="(\w+)")?\} (\d+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            key = m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
            out[key] = out.get(key, 0) + int(m.group(3))
    # Fault injection: fault_dropped.ingress|egress, fault_injected.duplicate|reorder.
    fault = re.compile(r'^fanin_switch_fault_(dropped|injected)_total\{shard="\d+",(?:direction|fault)="(\w+)"\} (\d+)$')
    for line in text.splitlines():
        m = fault.match(line)
        if m:
            key = f"fault_{m.group(1)}.{m.group(2)}"
            out[key] = out.get(key, 0) + int(m.group(3))
    # Datagrams the daemon dropped on its own: send_errors, send_dropped,
    # handover_dropped (summed over shards).
    own = re.compile(r'^fanin_switch_(send_errors|send_dropped|handover_dropped)_total\{shard="\d+"\} (\d+)$')
    for line in text.splitlines():
        m = own.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(2))
    out["malformed"] = sum(v for k, v in out.items() if k.startswith("malformed."))
    # The key-value program's counters (merged over shards): kv.counter[.reason].
    kv = re.compile(r'^fanin_switch_kv_packets_total\{counter="(\w+)"(?:,reason="(\w+)")?\} (\d+)$')
    for line in text.splitlines():
        m = kv.match(line)
        if m:
            key = "kv." + m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
            out[key] = out.get(key, 0) + int(m.group(3))
    return out


#: The 16-bit float formats, as `dtype` names: float16 is a numpy dtype;
#: bfloat16 (which numpy lacks) is held as its bits in uint16 arrays.
HALF_DTYPES = ("float16", "bfloat16")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16), rounded to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def half_values(a: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of a 16-bit array (float16, or bfloat16 bits)."""
    if dtype == "bfloat16":
        return (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def worker_inputs(rank: int, n: int, dtype: str, iteration: int = 0) -> np.ndarray:
    """Deterministic per-rank input, so any process can rebuild the reference:
    int32, float32, float16 (the float32 input rounded), or bfloat16 (its
    bits, uint16)."""
    rng = np.random.default_rng([rank, iteration, 0xFA17])
    if dtype == "int32":
        return rng.integers(-(2**31), 2**31, size=n, dtype=np.int64).astype(np.int32)
    # magnitudes spanning many binades, as gradients do
    scale = np.exp2(rng.integers(-20, 4, size=n)).astype(np.float32)
    x = (rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return bf16_bits(x)
    return x


def reference_sum(workers: int, n: int, dtype: str, iteration: int = 0) -> np.ndarray:
    """Exact reference: int32 wrapping sum, or the float64 sum of the float inputs."""
    if dtype == "int32":
        acc = np.zeros(n, dtype=np.int64)
        for r in range(workers):
            acc += worker_inputs(r, n, dtype, iteration)
        return acc.astype(np.int32)  # wraps modulo 2**32 like the switch
    acc = np.zeros(n, dtype=np.float64)
    for r in range(workers):
        x = worker_inputs(r, n, dtype, iteration)
        acc += half_values(x, dtype) if dtype in HALF_DTYPES else x
    return acc


def float_error_bound(workers: int, n: int, elems_per_packet: int, iteration: int = 0,
                      dtype: str = "float32") -> np.ndarray:
    """The documented per-element block-floating-point bound (docs/protocol.md):
    N * 2**(e - B - 1) with e the block's shared exponent, B = 30 - ceil(log2 N)
    for float32 (int32 lanes), 14 - ceil(log2 N) for float16 and bfloat16
    (int16 lanes, §5.6); `elems_per_packet` is the allreduce's block size."""
    maxabs = np.zeros(n, dtype=np.float64)
    for r in range(workers):
        x = worker_inputs(r, n, dtype, iteration)
        np.maximum(maxabs, np.abs(half_values(x, dtype) if dtype in HALF_DTYPES else x), out=maxabs)
    blocks = math.ceil(n / elems_per_packet)
    padded = np.zeros(blocks * elems_per_packet, dtype=np.float64)
    padded[:n] = maxabs
    block_max = padded.reshape(blocks, elems_per_packet).max(axis=1)
    _, e = np.frexp(block_max)  # block_max < 2**e
    e = np.maximum(e, -127)
    lane_bits = 14 if dtype in HALF_DTYPES else 30
    b = lane_bits - (math.ceil(math.log2(workers)) if workers > 1 else 0)
    bound = np.where(block_max > 0, workers * np.exp2(e.astype(np.float64) - b - 1), 0.0)
    return np.repeat(bound, elems_per_packet)[:n]


def _ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """One unit in the last place of each result value in its dtype."""
    if dtype == "float32":
        return np.abs(values) * np.finfo(np.float32).eps
    fraction_bits, min_exp = (10, -14) if dtype == "float16" else (7, -126)
    mag = np.maximum(np.abs(values), 2.0 ** min_exp)
    return np.exp2(np.floor(np.log2(mag)) - fraction_bits)


def check_result(result: np.ndarray, workers: int, dtype: str, elems_per_packet: int, iteration: int = 0,
                 keep: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Compare one worker's result with the reference; returns a report.
    A bfloat16 result is given as its bits (uint16). ``keep=(start, stop)``:
    a reduce-scatter's result, only those elements are compared."""
    return ResultChecker(workers, result.size, dtype, elems_per_packet, iteration).check(result, keep)


class ResultChecker:
    """`check_result` for many results of the same inputs: the reference
    and the error bound (every worker's input regenerated: about a second
    of CPU for a 16 MB tensor of 4 workers) are computed once, here, not
    per result, so a benchmark that repeats one allreduce spends its time
    on the allreduce.

    A result bit-identical to one that already passed (same `keep`) passes
    with that one's report, after a comparison of bytes (milliseconds,
    against a third of a second for the float64 check of a 16 MB tensor):
    fanin's sum of the same inputs is the same bits every time (integer
    adds in any order, one quantisation and one rounding), so a benchmark
    that repeats an allreduce checks it in full once. Anything else, a
    degraded block or a single differing bit, gets the full check."""

    def __init__(self, workers: int, n: int, dtype: str, elems_per_packet: int, iteration: int = 0):
        self.n, self.dtype = n, dtype
        self.ref = reference_sum(workers, n, dtype, iteration)
        self.bound = None if dtype == "int32" else float_error_bound(workers, n, elems_per_packet, iteration, dtype)
        # (keep, a copy of the checked part, its report) of the last result that passed
        self._passed: Optional[tuple[Optional[tuple[int, int]], np.ndarray, dict[str, Any]]] = None
        # how many results got the full float64 check (the others matched one that passed)
        self.full_checks = 0

    def check(self, result: np.ndarray, keep: Optional[tuple[int, int]] = None) -> dict[str, Any]:
        if result.size != self.n:
            raise ValueError(f"a result of {result.size} elements checked against a reference of {self.n}")
        cut = slice(*keep) if keep is not None else slice(None)
        part = result.reshape(-1)[cut]
        if self._passed is not None:
            passed_keep, passed, report = self._passed
            if passed_keep == keep and passed.dtype == part.dtype and np.array_equal(
                    np.ascontiguousarray(part).view(np.uint8), passed.view(np.uint8)):
                return dict(report)
        report = self._check(part, cut)
        self.full_checks += 1
        if report["ok"]:
            self._passed = (keep, np.array(part, copy=True), dict(report))
        return report

    def _check(self, result: np.ndarray, cut: slice) -> dict[str, Any]:
        ref = self.ref[cut]
        n = result.size
        if self.bound is None:
            ok = bool(np.array_equal(result, ref))
            return {"ok": ok, "max_abs_error": 0 if ok else int(np.max(np.abs(result.astype(np.int64) - ref)))}
        bound, dtype = self.bound[cut], self.dtype
        got = half_values(result, dtype) if dtype in HALF_DTYPES else result.astype(np.float64)
        err = np.abs(got - ref)
        allowed = bound + _ulp(got, dtype)
        ok = bool(np.all(err <= allowed))
        # the worst element's error as a fraction of its own allowance (<= 1 when ok)
        worst = float(np.max(np.where(allowed > 0, err / np.where(allowed > 0, allowed, 1), np.where(err > 0, np.inf, 0.0)))) if n else 0.0
        return {"ok": ok, "max_abs_error": float(err.max()) if n else 0.0, "max_bound": float(bound.max()) if n else 0.0,
                "worst_fraction_of_bound": worst}
