"""Key-value stream aggregation (ASK) through the host daemon.

``fanin kv daemon`` runs on every host; applications talk to the local one
through a Unix socket (JSON lines) and hand it their input through shared
memory: a file under ``/dev/shm`` that the daemon maps and streams to the
switch without copying it through the socket. Results come back the same
way. Waiting happens in socket calls, which release the GIL, so several
Python threads can send at once.

Example::

    from fanin.kv import Client
    with Client("/tmp/fanin-kv.sock") as kv:
        totals = kv.aggregate([[("a", 1), ("b", 2)], [("a", 5)]])   # two senders
    assert totals == {"a": 6, "b": 2}

The receiving application ``create``s a task (the daemon allocates the
switch region), gives the returned ticket to its senders (any host whose
daemon can reach this one), and ``wait``s for the merged sums.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from typing import Any, Iterable, Optional, Union

__all__ = ["Client", "KvError", "SenderFailed", "KeyDecodeError", "Ticket", "DaemonProcess", "encode_tuples",
           "decode_results", "DEFAULT_SOCKET"]

DEFAULT_SOCKET = "/tmp/fanin-kv.sock"
Key = Union[str, bytes]
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class KvError(RuntimeError):
    """The daemon refused a request or a task failed; the message says why."""


class SenderFailed(KvError):
    """A task ended without some of its senders (killed, hung, cut off, or
    bad input): ``wait`` delivers what was aggregated instead of results.

    ``failed``: one dict per failed channel: ``channel``, ``sender`` (its
    daemon's control address), ``reason``, ``progress`` (its last report:
    ``tuples_pushed``, ``tuples_acked``, ``acked_prefix``, ``packets_sent``,
    ``packets_acked``; None if it never reported) and timings in ms.
    ``partial``: {key: sum} with every tuple of the channels that finished
    exactly once and a subset of each failed channel's tuples, each at most
    once, including at least its first ``acked_prefix`` input tuples.
    ``reply``: the daemon's whole reply (``keys``, ``receiver`` stats, ...).
    """

    def __init__(self, message: str, failed: list, partial: dict, reply: dict) -> None:
        super().__init__(message)
        self.failed = failed
        self.partial = partial
        self.reply = reply
        self.task_id = reply.get("task_id")


class KeyDecodeError(KvError, UnicodeDecodeError):
    """The task's results are complete, but a key is not UTF-8 and str keys
    were asked for with ``errors="strict"``. Nothing is lost: ``results``
    holds them all with bytes keys. Ask for ``keys="bytes"`` or
    ``errors="surrogateescape"`` (lossless) instead."""

    def __init__(self, cause: UnicodeDecodeError, results: dict) -> None:
        UnicodeDecodeError.__init__(self, cause.encoding, cause.object, cause.start, cause.end, cause.reason)
        self.results = results
        key = bytes(cause.object)
        self.message = (f"fanin.kv: key {key[:40]!r}{'...' if len(key) > 40 else ''} is not UTF-8 ({cause.reason} at "
                        f"byte {cause.start}); the complete results, with bytes keys, are in .results; ask for "
                        "keys='bytes' or errors='surrogateescape' to get them directly")

    def __str__(self) -> str:
        return self.message


_LOSSLESS = ("strict", "surrogateescape")


def _check_keys(keys: Optional[str], errors: str) -> None:
    if keys not in (None, "str", "bytes"):
        raise ValueError(f"fanin.kv: keys={keys!r}; use 'str' or 'bytes' (or leave it unset)")
    if errors not in _LOSSLESS:
        raise ValueError(f"fanin.kv: errors={errors!r} could map two different keys to one str and lose a "
                         "count; use 'strict', 'surrogateescape' (lossless) or keys='bytes'")


Ticket = dict  # {"task_id": int, "control": "ip:port"}: what senders need


def encode_tuples(pairs: Iterable[tuple[Key, Any]], value_type: str = "int64") -> bytes:
    """Records ``key_len u16 | value i64 | key`` (little-endian), the daemon's input format.

    Keys are str (UTF-8) or bytes-like. Values: integers for an int64 task;
    with ``value_type="float64"`` anything ``float()`` takes, sent as its
    float64 bits (for a task created with that value type). The loop runs
    in the extension (``fanin_kv::records::push_tuple``)."""
    from fanin import _native

    try:
        return _native.encode_tuples(pairs, value_type)
    except _native.InvalidPair as e:  # not an error the iterable itself raised
        raise KvError(str(e)) from None


def decode_results(data: bytes, *, as_str: bool = True, errors: str = "strict",
                   value_type: str = "int64") -> dict[Key, Any]:
    """Result records (``key_len | sum | count | min | max | key``) -> {key: sum}.

    Sums are int, or float when ``value_type`` is "float64" (the task's:
    ``wait`` passes the daemon's word for it).

    Keys are str (UTF-8; with ``errors="strict"`` a key that is not raises
    ``UnicodeDecodeError``, with ``"surrogateescape"`` it decodes
    losslessly) or, with ``as_str=False``, bytes. A file cut inside a record
    raises ``ValueError``. Decoded in the extension: the Python loop took
    ~25 ms of the 64 MB word count's 130 207 keys."""
    from fanin import _native

    _check_keys(None, errors)
    return _native.decode_results(data, as_str, errors, value_type)


def refuse_incomplete(receiver: dict[str, Any]) -> None:
    """Raise unless the receiver's statistics of a finished task say every
    tuple it was sent is in the result: no key refused, no sum saturated,
    no key whose parts could not be decoded (a datagram that is not what
    the task's layout says, or a sender and receiver that disagree on it)."""
    refused = receiver.get("keys_refused", 0)
    if refused:
        raise KvError(f"fanin.kv: {refused} key fragments were of keys longer than the receiver's daemon "
                      "accepts (max_key_len); those keys are missing, so there is no result")
    overflowed = receiver.get("overflowed", 0)
    if overflowed:
        # saturated sums are no answer
        raise KvError(f"fanin.kv: int64 sums overflowed {overflowed} times; the task's values are too large "
                      "to sum in 64 bits")
    undecodable = receiver.get("undecodable", 0)
    if undecodable:
        raise KvError(f"fanin.kv: the receiver could not decode the key of {undecodable} tuples (their "
                      "datagrams do not follow the task's key layout); those tuples are missing, so there is no result")


def _shm_path(tag: str) -> str:
    return os.path.join(_SHM_DIR, f"fanin-kv-{os.getpid()}-{tag}-{uuid.uuid4().hex[:12]}")


class Client:
    """A connection to the local daemon. One request at a time per client;
    use one client per thread (``aggregate`` does that for its senders)."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout: Optional[float] = None) -> None:
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as e:
            self._sock.close()
            raise KvError(f"no fanin kv daemon at {socket_path} ({e}); start one with `fanin kv daemon`") from None
        self._file = self._sock.makefile("rb")

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the reply; raises KvError on a refusal."""
        reply = self._exchange(message)
        if not reply.get("ok"):
            raise KvError(reply.get("error", "request refused"))
        return reply

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        self._sock.sendall(json.dumps(message).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise KvError("the daemon closed the connection")
        return json.loads(line)

    # -- receiver side ---------------------------------------------------
    def create(self, senders: int, **options: Any) -> Ticket:
        """Create a task that ``senders`` channels will feed; returns the ticket.

        Options: aa_size, short_slots, medium_groups, medium_parts, window,
        shadow_copies, swap_threshold, silence_ms, auth (default True: a
        keyed task, every datagram sealed and verified, docs/security.md;
        False for an unkeyed one), key (32 hex digits: a keyed task with
        this task key), value_type ("int64", the default, or "float64":
        how the switch and the receiver add the values; a float64 task's
        senders send float bits, ``send`` does that from the ticket) (see
        docs/kv.md §10).
        """
        reply = self.request({"op": "create", "senders": senders, **options})
        return {"task_id": reply["task_id"], "control": reply["control"],
                "value_type": reply.get("value_type", "int64")}

    def wait(self, ticket: Ticket, *, as_str: bool = True, errors: str = "strict", with_stats: bool = False) -> Any:
        """Block until the task's results are complete; {key: sum}.

        Keys are str with ``as_str`` (``errors``: "strict" or the lossless
        "surrogateescape"), else bytes. Raises ``SenderFailed`` (with
        ``.failed`` and ``.partial``) when senders failed and the others
        finished, ``KeyDecodeError`` (with the complete ``.results``, bytes
        keys) when a key is not UTF-8 and ``errors`` is "strict", and
        ``KvError`` for other failures (e.g. the switch went silent: no
        aggregate to give)."""
        _check_keys(None, errors)
        data, reply = self.wait_records(ticket, partial_ok=True)
        value_type = reply.get("value_type", "int64")
        if not reply.get("ok"):
            # the senders' failure is the error to report: a partial result
            # is decoded so that no key can mask it
            partial = decode_results(data, as_str=as_str, errors="surrogateescape" if as_str else errors,
                                     value_type=value_type)
            raise SenderFailed(reply["error"], reply.get("failed", []), partial, reply)
        try:
            results = decode_results(data, as_str=as_str, errors=errors, value_type=value_type)
        except UnicodeDecodeError as e:
            raise KeyDecodeError(e, decode_results(data, as_str=False, value_type=value_type)) from None
        return (results, reply) if with_stats else results

    def wait_records(self, ticket: Ticket, *, partial_ok: bool = False) -> tuple[bytes, dict[str, Any]]:
        """``wait``, but the result file's records as they are (``key_len |
        sum | count | min | max | key``, ``fanin_kv::records``) and the
        daemon's reply: for callers that decode them their own way (the
        DataFrame path). Raises like ``wait``; with ``partial_ok`` a task
        whose senders failed returns the partial records and a reply with
        ``ok`` false instead."""
        path = _shm_path("res")
        try:
            reply = self._exchange({"op": "wait", "task_id": ticket["task_id"], "path": path})
            incomplete = not reply.get("ok") and reply.get("complete") is False
            if not reply.get("ok") and not incomplete:
                raise KvError(reply.get("error", "request refused"))
            with open(path, "rb") as f:
                data = f.read()
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if incomplete:
            if partial_ok:
                return data, reply
            raise SenderFailed(reply["error"], reply.get("failed", []), {}, reply)
        refuse_incomplete(reply.get("receiver", {}))
        return data, reply

    def status(self, ticket: Ticket) -> dict[str, Any]:
        """The task's joined channels as the receiver's daemon sees them:
        ``channels`` = [{channel, sender, state, reason, progress, ...}]."""
        return self.request({"op": "status", "task_id": ticket["task_id"]})

    def abort(self, ticket: Ticket) -> None:
        self.request({"op": "abort", "task_id": ticket["task_id"]})

    # -- sender side -----------------------------------------------------
    def send_bytes(self, ticket: Ticket, channel: int, data: bytes, *, format: str = "tuples") -> dict[str, Any]:
        """Stream an encoded input (``tuples`` records or ``text``) as one channel of the task."""
        path = _shm_path("in")
        with open(path, "wb") as f:
            f.write(data)
        try:
            return self.send_file(ticket, channel, path, format=format)
        finally:
            os.unlink(path)

    def send_file(self, ticket: Ticket, channel: int, path: str, *, format: str = "tuples") -> dict[str, Any]:
        """Stream a file the daemon can map (``tuples`` records or ``text``)."""
        _check_format(format)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"fanin.kv: input {path!r} does not exist (or is not a file)")
        # The request always names the input's value type, the ticket's or
        # int64 (encode_tuples' default, what `send` encoded): a ticket
        # without one (the documented {task_id, control}) sent int64 bits
        # to a float64 task unchecked, which summed them as floats; now the
        # receiver's daemon refuses the join instead.
        return self.request({"op": "send", "ticket": {**ticket, "value_type": _value_type(ticket)},
                             "channel": channel, "path": os.path.abspath(path), "format": format})

    def send(self, ticket: Ticket, channel: int, pairs: Iterable[tuple[Key, Any]]) -> dict[str, Any]:
        """Stream (key, value) pairs as one channel of the task (values of the ticket's value type, int64 if it
        names none)."""
        return self.send_bytes(ticket, channel, encode_tuples(pairs, _value_type(ticket)))

    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})

    # -- both --------------------------------------------------------------
    def aggregate(self, inputs: Any, *, format: str = "tuples", keys: Optional[str] = None, errors: str = "strict",
                  **options: Any) -> dict[Key, int]:
        """Sum values per key over one or several inputs, one sender channel each.

        ``inputs`` is an iterable of (key, int) pairs, or a list of such
        iterables (one channel each), or with ``format="text"`` a list of
        bytes or file paths (WordCount: each word, split as ``bytes.split()``
        splits, counts 1). Keys of any length are summed exactly. Returns
        {key: sum}. ``keys``: "bytes" or "str"; by default text gives bytes
        (text is bytes: a word need not be UTF-8) and tuples give back the
        type they were sent with. ``errors`` for str keys: "strict" (a key
        that is not UTF-8 raises ``KeyDecodeError``, which carries the
        complete result with bytes keys) or "surrogateescape" (lossless).
        A sender's error is raised as that error.
        """
        _check_format(format)
        _check_keys(keys, errors)
        channels = _split_inputs(inputs, format)
        # Bad input is refused before a task exists, not found by a sender
        # seconds later.
        missing = [c for c in channels if format == "text" and isinstance(c, str) and not os.path.isfile(c)]
        if missing:
            raise FileNotFoundError(f"fanin.kv: input {missing[0]!r} does not exist (or is not a file)")
        as_str = keys == "str"  # text: bytes unless str keys are asked for
        if format == "tuples":
            channels, key_types = _encode_channels(channels, options.get("value_type", "int64"))
            if keys is None:
                as_str = key_types != 2  # bytes keys only: bytes back (str, or no keys: str)
        ticket = self.create(len(channels), **options)
        failures: list[BaseException] = []

        def feed(i: int, item: Any) -> None:
            try:
                with Client(self.socket_path) as c:
                    if format == "text" and isinstance(item, str):
                        c.send_file(ticket, i, item, format="text")
                    elif format == "text":
                        c.send_bytes(ticket, i, bytes(item), format="text")
                    else:
                        c.send_bytes(ticket, i, item)  # encoded above
            except BaseException as e:  # reported below, after the wait
                failures.append(e)

        threads = [threading.Thread(target=feed, args=(i, item), daemon=True) for i, item in enumerate(channels)]
        for t in threads:
            t.start()
        try:
            results = self.wait(ticket, as_str=as_str, errors=errors)
        except (SenderFailed, KeyDecodeError):
            for t in threads:
                t.join(timeout=5)
            raise
        except KvError as e:
            for t in threads:
                t.join(timeout=5)
            raise KvError(f"{e}" + (f" (sender: {failures[0]})" if failures else "")) from None
        for t in threads:
            t.join()
        if failures:
            raise KvError(f"a sender failed: {failures[0]}")
        return results


FORMATS = ("tuples", "text")


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"fanin.kv: unknown format {format!r}; use one of {', '.join(FORMATS)}")


def _split_inputs(inputs: Any, format: str) -> list[Any]:
    if format == "text":
        return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and not _is_pair(inputs[0]):
        return [list(x) for x in inputs]
    return [list(inputs)]


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], (str, bytes))


def _value_type(ticket: Ticket) -> str:
    """The value type a send to ``ticket`` carries: the ticket's, int64 if
    it names none (as encode_tuples' default)."""
    return ticket.get("value_type") or "int64"


def _encode_channels(channels: list[Any], value_type: str) -> tuple[list[bytes], int]:
    """Each channel's pairs as a ``tuples`` input, and the mask of key types
    seen (1: str, 2: bytes). A mix of both is refused: the daemons compare
    bytes, so 'a' and b'a' would be one key, and the result could give it
    back as only one of them (it used to go by the first key's type:
    [("a", 1), (b"a", 2)] gave {'a': 3})."""
    from fanin import _native

    encoded, seen = [], 0
    for ch in channels:
        try:
            (data,), types = _native.encode_tuples_partitioned(ch, 1, value_type)
        except _native.InvalidPair as e:  # not an error the iterable itself raised
            raise KvError(str(e)) from None
        encoded.append(data)
        seen |= types
    if seen == 3:
        raise KvError("fanin.kv: keys mix str and bytes; a dict would count 'a' and b'a' apart, the daemons "
                      "compare bytes: make every key one type (e.g. k.encode() for str keys)")
    return encoded, seen


class DaemonProcess:
    """``fanin kv daemon`` in a child process (tests, benchmarks), stopped on exit.

    ``netns`` runs it inside that network namespace (the testbed); the Unix
    socket is a path, so the caller reaches it from any namespace."""

    def __init__(self, switch_control: str, *, socket_path: Optional[str] = None, quiet: bool = True,
                 netns: Optional[str] = None, **config: Any) -> None:
        # Without a socket_path the socket goes in a fresh directory of our own, removed when the daemon is
        # stopped or killed (or, failing that, when this object goes away) so that runs leave no fanin-kv-*
        # directories behind in /tmp.
        own_dir = None if socket_path else tempfile.mkdtemp(prefix="fanin-kv-")
        self._remove_dir = weakref.finalize(self, shutil.rmtree, own_dir, True) if own_dir else lambda: None
        self.socket_path = socket_path or os.path.join(own_dir, "kv.sock")
        cfg = {"socket_path": self.socket_path, "switch_control": switch_control, **config}
        # quiet: the daemon's stderr goes to a file nobody reads, unless it dies before it is ready: then the
        # error says why (a pipe left unread could fill and stall a chatty daemon)
        log = tempfile.TemporaryFile() if quiet else None
        self.proc = subprocess.Popen(
            (["ip", "netns", "exec", netns] if netns else [])
            + [sys.executable, "-m", "fanin", "kv", "daemon", "--config-json", json.dumps(cfg), "--print-ready"],
            stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            code = self.proc.wait(timeout=10)
            why = ""
            if log is not None:
                log.seek(0)
                why = log.read().decode(errors="replace").strip().splitlines()
                why = f": {why[-1]}" if why else ""
            raise KvError(f"fanin kv daemon exited with code {code} before it was ready{why}")
        if log is not None:
            log.close()  # the child keeps its own descriptor
        self.info = json.loads(line)
        self.control_addr: str = self.info["control_addr"]

    def client(self) -> Client:
        return Client(self.socket_path)

    def kill(self) -> None:
        """SIGKILL: the daemon disappears without any teardown (failure tests)."""
        self.proc.kill()
        self.proc.wait(timeout=10)
        self._remove_dir()

    def stop(self) -> int:
        from fanin.proc import terminate

        code = terminate(self.proc)
        self._remove_dir()
        return code

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
