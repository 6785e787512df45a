"""The key-value service with real processes and sockets: a ``fanin switch``
process, ``fanin kv daemon`` processes, UDP on 127.0.0.1, the local API on
Unix sockets. Results are checked against ``Counter``; failures must give a
clear error, count, and free the switch region."""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections import Counter

import pytest

from fanin.control.client import ControlClient
from fanin.kv import Client, DaemonProcess, KeyDecodeError, KvError, SenderFailed


@pytest.fixture(scope="module")
def daemon(switch):
    d = DaemonProcess(switch.control_addr, silence_ms=1500)
    yield d
    d.stop()


def _regions(switch) -> list:
    with ControlClient(switch.control_addr) as c:
        return c.kv_regions()


def _wait_no_regions(switch, timeout: float = 8.0) -> list:
    deadline = time.time() + timeout
    regions = _regions(switch)
    while regions and time.time() < deadline:
        time.sleep(0.1)
        regions = _regions(switch)
    return regions


def _pairs(n: int, seed: int) -> list:
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(300)] + [f"medium-key-{i}" for i in range(50)] + \
           [f"a-long-key-that-bypasses-the-switch-{i}" for i in range(20)]
    return [(rng.choice(keys), rng.randrange(-5, 100)) for _ in range(n)]


def test_two_senders_match_the_reference_and_release_the_region(switch, daemon):
    inputs = [_pairs(20_000, 1), _pairs(15_000, 2)]
    expected: Counter = Counter()
    for chan in inputs:
        for k, v in chan:
            expected[k] += v
    with daemon.client() as c:
        got = c.aggregate(inputs, aa_size=64)
    assert got == dict(expected)
    assert _wait_no_regions(switch) == []
    with ControlClient(switch.control_addr) as cc:
        counters = cc.kv_counters()
    assert counters["tuples_aggregated"] > 0, "the switch absorbed nothing"


def test_text_mode_counts_words(daemon, tmp_path):
    text = b"the cat sat on the mat\n\tthe end \x0b"
    path = tmp_path / "words.txt"
    path.write_bytes(text)
    expected = Counter(text.split() + [b"cat", b"cat"])
    with daemon.client() as c:
        got = c.aggregate([str(path), b"cat cat"], format="text")  # text is bytes: so are its words
        assert got == dict(expected)
        got = c.aggregate([str(path), b"cat cat"], format="text", keys="str")
    assert got == {k.decode(): v for k, v in expected.items()}


def _awkward_text(seed: int) -> bytes:
    """Words of every length a real corpus has, and some it rarely has:
    short, medium, just over 1 KiB, base64 blobs of 5 KB and 100 KB, and
    bytes that are not UTF-8 (Latin-1 text, a truncated sequence)."""
    import base64

    rng = random.Random(seed)
    blob = lambda n: base64.b64encode(rng.randbytes(n * 3 // 4))  # noqa: E731
    words = [b"the", b"a", b"configuration", b"caf\xe9", b"na\xefve", b"\xe2\x82", b"\xff\xfe\x00x"]
    words += [blob(1_100), blob(5_000), blob(5_000)]
    out = [rng.choice(words) for _ in range(3_000)] + [blob(100_000), blob(100_000)]
    rng.shuffle(out)
    return b" \n".join(out)


def test_text_with_long_words_and_invalid_utf8_counts_exactly(daemon, tmp_path):
    """Every word of a text is counted exactly, whatever its length (keys
    over 1 KiB travel in fragments) or encoding (bytes keys); str keys on
    request, strict (the complete result comes with the error) or lossless."""
    texts = [_awkward_text(1), _awkward_text(2), _awkward_text(1)]
    paths = []
    for i, t in enumerate(texts):
        paths.append(tmp_path / f"part{i}.txt")
        paths[-1].write_bytes(t)
    expected = Counter(w for t in texts for w in t.split())
    assert max(map(len, expected)) >= 100_000 and any(b"\xff" in k for k in expected)
    with daemon.client() as c:
        got = c.aggregate([str(p) for p in paths], format="text")
        assert got == dict(expected)
        with pytest.raises(KeyDecodeError, match=r"is not UTF-8.*keys='bytes' or errors='surrogateescape'") as e:
            c.aggregate([str(p) for p in paths], format="text", keys="str")
        assert e.value.results == dict(expected)
        assert isinstance(e.value, UnicodeDecodeError) and isinstance(e.value, KvError)
        lossless = c.aggregate([str(p) for p in paths], format="text", keys="str", errors="surrogateescape")
        assert {k.encode("utf-8", "surrogateescape"): v for k, v in lossless.items()} == dict(expected)
        with pytest.raises(ValueError, match=r"errors='replace' could map two different keys to one str"):
            c.aggregate([str(paths[0])], format="text", keys="str", errors="replace")


def test_tuples_with_keys_of_any_length_sum_exactly(daemon):
    """Keys beyond one datagram and beyond a u16 length (the records'
    length escape), from two senders: exact sums."""
    big = {n: "k" * n for n in (1_025, 65_534, 65_535, 70_000, 200_000)}
    inputs = [[(k, n) for n, k in big.items()] + [("short", 1)], [(big[200_000], 5), (big[1_025], -1), ("short", 2)]]
    expected: Counter = Counter()
    for chan in inputs:
        for k, v in chan:
            expected[k] += v
    with daemon.client() as c:
        got, reply = c.wait(_send_all(c, inputs), with_stats=True)
    assert got == dict(expected)
    assert reply["receiver"]["keys_reassembled"] == 7
    assert reply["receiver"]["undecodable"] == 0  # reported, and refused when not 0 (below)


def _send_all(c, inputs):
    ticket = c.create(len(inputs))
    for i, chan in enumerate(inputs):
        c.send(ticket, i, chan)
    return ticket


def test_oversized_key_fails_the_task_with_a_clear_error(switch):
    with DaemonProcess(switch.control_addr, silence_ms=1500, max_key_len=1024) as d, d.client() as c:
        with pytest.raises(KvError, match=r"key of 2000 bytes exceeds the limit of 1024 bytes"):
            c.aggregate([("x" * 2000, 1), ("ok", 1)])
        assert c.stats()["sends_failed"] >= 1
    assert _wait_no_regions(switch) == []


def test_a_senders_error_is_reported_never_masked_by_decoding(switch, tmp_path):
    """A sender fails on a word over its daemon's limit while the partial
    result holds keys that are not UTF-8 and str keys were asked for: the
    error raised is the sender's (once, a UnicodeDecodeError of the partial
    result hid it)."""
    text = b"caf\xe9 ok ok " + b"x" * 2_000 + b" tail"
    with DaemonProcess(switch.control_addr, silence_ms=1500, max_key_len=1024) as d, d.client() as c:
        with pytest.raises(SenderFailed, match=r"key of 2000 bytes exceeds the limit of 1024 bytes") as e:
            c.aggregate([b"caf\xe9 more words", text], format="text", keys="str")
        assert e.value.partial.get("caf\udce9", 0) >= 1  # the partial result, decoded losslessly
    assert _wait_no_regions(switch) == []


def test_unknown_task_is_refused(daemon):
    with daemon.client() as c:
        before = c.stats()["unknown_task"]
        with pytest.raises(KvError, match=r"unknown task 123456789"):
            c.send({"task_id": 123456789, "control": daemon.control_addr}, 0, [("a", 1)])
        with pytest.raises(KvError, match=r"unknown task 987"):
            c.wait({"task_id": 987, "control": daemon.control_addr})
        assert c.stats()["unknown_task"] >= before + 2


def test_bad_requests_get_errors(daemon):
    with daemon.client() as c:
        with pytest.raises(KvError, match=r"unknown op"):
            c.request({"op": "frobnicate"})
        with pytest.raises(KvError, match=r"senders must be"):
            c.create(0)
        with pytest.raises(KvError, match=r"missing field"):
            c.request({"op": "send"})
        # an option the daemon does not know is refused, naming it and what it
        # knows (it was ignored, and the task ran with the default)
        with pytest.raises(KvError, match=r'unknown field "aa_sise", expected one of .*"aa_size"'):
            c.create(2, aa_sise=256)
        with pytest.raises(KvError, match=r'request "wait": invalid type: string "seven", expected u32'):
            c.request({"op": "wait", "task_id": "seven", "path": "/tmp/x"})
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(daemon.socket_path)
        raw.sendall(b"not json\n")
        reply = b""
        while not reply.endswith(b"\n"):  # one reply line, maybe in pieces
            chunk = raw.recv(1000)
            assert chunk, "the daemon closed the connection without a reply"
            reply += chunk
        assert b"not a JSON object" in reply
        raw.close()


def test_malformed_packets_are_counted_and_harmless(switch, daemon):
    with daemon.client() as c:
        data_addr = c.stats()["data_addrs"][0]
    host, port = data_addr.rsplit(":", 1)
    sw_host, sw_port = switch.data_addr.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Garbage, a key-value header cut short, and a Data packet with reserved
    # flag bits set, to the daemon's data channel and to the switch.
    bad_flags = struct.pack(">HBBBBHII", 0xFA17, 1, 0x20, 0x80, 1, 0, 7, 0) + b"\0" * 24
    for payload in (b"\x00garbage", struct.pack(">HBB", 0xFA17, 1, 0x22) + b"\0" * 4, bad_flags):
        s.sendto(payload, (host, int(port)))
        s.sendto(payload, (sw_host, int(sw_port)))
    s.close()
    time.sleep(0.3)
    with daemon.client() as c:
        assert c.stats()["malformed_datagrams"] >= 3
        assert c.aggregate([("a", 1), ("a", 2)]) == {"a": 3}
    with ControlClient(switch.control_addr) as cc:
        counters = cc.kv_counters()
    assert counters["malformed.reserved_bits"] >= 1
    assert counters["malformed.truncated"] >= 1


def test_receiver_application_that_disconnects_aborts_its_task(switch, daemon):
    c = daemon.client()
    ticket = c.create(1)
    assert any(r["task_id"] == ticket["task_id"] for r in _regions(switch))
    c.close()
    assert _wait_no_regions(switch) == []
    with daemon.client() as s:
        with pytest.raises(KvError, match=r"unknown task"):
            s.send(ticket, 0, [("a", 1)])


def test_switch_memory_exhausted_is_refused(switch, daemon):
    with daemon.client() as c:
        with pytest.raises(KvError, match=r"aggregators"):
            c.create(1, aa_size=1 << 22)
    assert _regions(switch) == []


def _bench(tmp_path, *args):
    """``fanin bench ...`` in a scratch directory (its corpus goes to out/)."""
    import subprocess
    import sys

    import fanin

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fanin.__file__)))
    return subprocess.run([sys.executable, "-m", "fanin", "bench", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)


def test_kv_window_bench_times_each_window_on_checked_counts(tmp_path):
    import json

    r = _bench(tmp_path, "kv-window", "--corpus-mb", "1", "--repeats", "1", "--windows", "16,4096", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["all_equal"] and [row["window"] for row in out["rows"]] == [16, 4096]
    assert all(row["median_s"] > 0 and len(row["runs_s"]) == 1 for row in out["rows"])
    assert "every count checked" in r.stderr
    bad = _bench(tmp_path, "kv-window", "--windows", "16,many")
    assert bad.returncode != 0 and "--windows is a comma list of integers, got '16,many'" in bad.stderr


def test_an_int64_sum_that_overflows_raises_instead_of_wrapping(daemon):
    # found by a user: three values of 2^62 summed to -4611686018427387904
    with daemon.client() as c:
        with pytest.raises(KvError, match="int64 sums overflowed"):
            c.aggregate([("a", 2**62), ("b", 1), ("a", 2**62), ("a", 2**62)])
        # the daemon and the switch go on: a task that fits is exact
        assert c.aggregate([("a", 2**62), ("a", -(2**62)), ("b", 2)]) == {"a": 0, "b": 2}


def test_float64_tasks_sum_floats_and_refuse_what_would_be_misread(switch, daemon, tmp_path):
    """A float64 task: the switch's registers add floats (ints are taken as
    floats); values are quarter multiples, so every order gives the same
    sums. What would read integer bits as floats (text, a ticket of the
    other type, a value type the daemon does not know) is refused."""
    pairs = [(f"k{i % 97}", (i % 301 - 150) * 0.25) for i in range(50_000)] + [("int", 3), ("int", 4)]
    want: dict = {}
    for k, v in pairs:
        want[k] = want.get(k, 0.0) + v
    with daemon.client() as c:
        got = c.aggregate([pairs[0::2], pairs[1::2]], value_type="float64")
        assert got == want and all(isinstance(v, float) for v in got.values())
        ticket = c.create(1, value_type="float64")
        assert ticket["value_type"] == "float64"
        assert [r["value_type"] for r in _regions(switch) if r["task_id"] == ticket["task_id"]] == ["float64"]
        text = tmp_path / "words.txt"
        text.write_bytes(b"a b a\n")
        with daemon.client() as s:
            with pytest.raises(KvError, match="sums float64 values; text input counts integer ones"):
                s.send_file(ticket, 0, str(text), format="text")
            with pytest.raises(KvError, match="sums float64 values but this input's are int64 .text counts integer"):
                s.send_file(dict(ticket, value_type=None), 0, str(text), format="text")
            with pytest.raises(KvError, match="task .* sums float64 values but this input's are int64"):
                s.send(dict(ticket, value_type="int64"), 0, [("a", 1)])
        c.abort(ticket)
        with pytest.raises(KvError, match='value_type "float32": give "int64" or "float64"'):
            c.create(1, value_type="float32")
        with pytest.raises(KvError, match="value 'x' for key a is not a number"):
            c.aggregate([("a", "x")], value_type="float64")
    assert _wait_no_regions(switch) == []


def test_join_ms_lets_senders_join_after_the_silence_timeout(daemon):
    """A task created before its senders' inputs are ready (fanin.spark
    creates receivers, then encodes): with join_ms, senders joining after
    2 x silence_ms are waited for; without it, the receiver fails as silent."""
    with daemon.client() as c:
        ticket = c.create(1, silence_ms=300, join_ms=5000)
        time.sleep(1.5)
        with daemon.client() as s:
            s.send(ticket, 0, [("a", 1), ("b", 2)])
        assert c.wait(ticket) == {"a": 1, "b": 2}
        ticket = c.create(1, silence_ms=300)
        time.sleep(1.5)
        with pytest.raises(KvError, match="nothing arrived"):
            c.wait(ticket)
        # a channel that never joins within join_ms ends the task at once, saying so
        ticket = c.create(2, silence_ms=5000, join_ms=500)
        with daemon.client() as s:
            s.send(ticket, 0, [("a", 1)])
        t0 = time.monotonic()
        with pytest.raises(KvError, match="sender channels 1 never joined within the task's join_ms"):
            c.wait(ticket)
        assert time.monotonic() - t0 < 3, "not after 2 x silence_ms"


def _raw(daemon):
    import socket as socket_mod

    s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.socket_path)
    return s


def test_an_endless_request_line_is_refused_not_buffered(daemon):
    # found by a user: 300 MB without a newline raised the daemon's RSS by 300 MB
    s = _raw(daemon)
    try:
        chunk = b"x" * (1 << 16)
        sent = 0
        try:
            while sent < (3 << 20):
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed it: refused
        reply = s.recv(4096)
        assert b"request longer than 1048576 bytes" in reply, reply
    finally:
        s.close()
    with daemon.client() as c:
        st = c.stats()
        assert st["oversized_requests"] >= 1


def test_connections_beyond_the_limit_are_refused_with_a_reason(daemon):
    held = []
    try:
        refused = None
        for _ in range(300):
            s = _raw(daemon)
            held.append(s)
            s.settimeout(0.05)
            try:
                refused = s.recv(4096)
                if refused:
                    break
            except OSError:
                continue  # served: nothing to read
        assert refused and b"too many connections (at most 256 at once)" in refused, refused
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    with daemon.client() as c:  # the idle connections are gone: served again
        assert c.stats()["connections_refused"] >= 1


def test_a_result_with_keys_that_could_not_be_decoded_is_refused():
    """The receiver counts tuples whose key parts do not decode; any such
    tuple is missing from the result, which is then no answer."""
    from fanin.kv import KvError, refuse_incomplete

    refuse_incomplete({"keys_refused": 0, "overflowed": 0, "undecodable": 0})
    with pytest.raises(KvError, match="could not decode the key of 3 tuples"):
        refuse_incomplete({"keys_refused": 0, "overflowed": 0, "undecodable": 3})
    with pytest.raises(KvError, match="overflowed"):
        refuse_incomplete({"overflowed": 1})


def test_a_ticket_without_a_value_type_is_refused_by_a_float64_task_not_summed_as_floats(daemon):
    """found by a review: a ticket of the documented shape {task_id,
    control} carried no value type, so `send` encoded int64 (its default)
    and the daemon joined it to a float64 task unchecked, which summed the
    integers' bits as floats. The request now always names the type it
    encoded (int64 here), and the float64 task refuses the join."""
    with daemon.client() as c:
        full = c.create(1, value_type="float64")
        ticket = {"task_id": full["task_id"], "control": full["control"]}
        with daemon.client() as s:
            with pytest.raises(KvError, match="task .* sums float64 values but this input's are int64"):
                s.send(ticket, 0, [("x", 1), ("x", 2)])
            with pytest.raises(KvError, match="task .* sums float64 values but this input's are int64"):
                s.send_bytes(ticket, 0, struct.pack("<Hq", 1, 1) + b"x")
            # the same ticket with the task's type is taken
            assert s.send(dict(ticket, value_type="float64"), 0, [("x", 1), ("x", 2.5)])["ok"]
        assert c.wait(full) == {"x": 3.5}


def test_a_mix_of_str_and_bytes_keys_is_refused_before_a_task_exists(switch, daemon):
    """found by a review: aggregate chose str or bytes keys for the result by
    the first key alone, and the daemons compare bytes, so [("a", 1),
    (b"a", 2)] gave {'a': 3} (and {b'a': 3} the other way round), where a
    dict counts 'a' and b'a' apart. A mix is refused, in one channel or
    across channels, as the Spark path refuses it."""
    with daemon.client() as c:
        for inputs in ([("a", 1), (b"a", 2)], [(b"a", 2), ("a", 1)], [[("a", 1)], [(bytearray(b"b"), 2)]]):
            with pytest.raises(KvError, match="keys mix str and bytes"):
                c.aggregate(inputs)
            with pytest.raises(KvError, match="keys mix str and bytes"):
                c.aggregate(inputs, keys="bytes")
        assert _wait_no_regions(switch) == []  # refused before any task was created
        # one type of key gives that type back
        assert c.aggregate([[("a", 1)], [("a", 2), ("b", 1)]]) == {"a": 3, "b": 1}
        assert c.aggregate([[(b"a", 1)], [(b"a", 2)]]) == {b"a": 3}
        assert c.aggregate([(b"a", 1)], keys="str") == {"a": 1}


def test_the_local_api_socket_is_for_the_daemons_own_user_only(daemon):
    """A local client names files the daemon reads and writes with its own
    rights: the socket is mode 0600 whatever the umask (with umask 002 it
    was 0775, and the daemon's group could have it read or overwrite any
    file its user can)."""
    import stat

    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600


def test_the_socket_path_is_taken_only_when_free_or_stale(switch, tmp_path):
    """`fanin kv daemon --socket PATH` used to delete whatever was at PATH:
    a regular file, or a live daemon's socket, which it then took over and
    left the first daemon unreachable. Only a free path or a stale socket
    (nobody accepts on it) may be used."""
    import subprocess
    import sys

    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(KvError, match=r"notes\.txt.*is a regular file, not a socket"):
        DaemonProcess(switch.control_addr, socket_path=str(precious))
    assert precious.read_text() == "keep me"
    # the command line says the same (exit 1, one line naming the path)
    r = subprocess.run([sys.executable, "-m", "fanin", "kv", "daemon", "--socket", str(precious),
                        "--switch-control", switch.control_addr], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is a regular file, not a socket" in r.stderr and str(precious) in r.stderr, r.stderr
    assert precious.read_text() == "keep me"

    live = str(tmp_path / "live.sock")
    with DaemonProcess(switch.control_addr, socket_path=live) as first:
        with pytest.raises(KvError, match="another kv daemon is listening on .*live.sock"):
            DaemonProcess(switch.control_addr, socket_path=live)
        with first.client() as c:  # the first daemon is still the one there
            assert c.stats()["tasks_created"] >= 0

    # a stale socket (its daemon died without removing it) is replaced
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    with DaemonProcess(switch.control_addr, socket_path=stale) as d:
        with d.client() as c:
            assert c.aggregate([[("a", 1)], [("a", 2)]]) == {"a": 3}
