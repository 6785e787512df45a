"""Failed senders of key-value tasks, with real processes: a ``fanin switch``
process and ``fanin kv daemon`` processes on loopback. A sender's daemon is
killed (SIGKILL) or hung (SIGSTOP) mid-task; the receiving application must
get ``SenderFailed`` naming that channel and its daemon, within a bounded
time, with a partial aggregate that holds the surviving senders' tuples
exactly once and a subset of the failed sender's tuples that includes at
least the prefix it reported acknowledged (docs/kv.md §10, failed senders)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest

from fanin.control.client import ControlClient
from fanin.kv import DaemonProcess, KvError, SenderFailed

SILENCE_MS = 1000


@pytest.fixture(scope="module")
def receiver(switch):
    """The receiving host's daemon (also sends the surviving channels); its
    longest key is 1 KiB, so that a 2 000-byte key is bad input here."""
    d = DaemonProcess(switch.control_addr, silence_ms=SILENCE_MS, max_key_len=1024)
    yield d
    d.stop()


@pytest.fixture
def doomed(switch):
    """The daemon of the sender that will fail."""
    d = DaemonProcess(switch.control_addr, silence_ms=SILENCE_MS)
    yield d
    if d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()


def _wait_no_regions(switch, timeout: float = 8.0) -> list:
    deadline = time.time() + timeout
    while True:
        with ControlClient(switch.control_addr) as c:
            regions = c.kv_regions()
        if not regions or time.time() > deadline:
            return regions
        time.sleep(0.1)


def _big_text(tmp_path, words: int) -> tuple[str, list[bytes]]:
    data = b" ".join(b"w%d" % (i % 5000) for i in range(words))
    path = tmp_path / "big.txt"
    path.write_bytes(data)
    return str(path), data.split()


def _start_doomed_send(doomed, ticket, channel: int, path: str) -> tuple[threading.Thread, list]:
    errors: list = []

    def feed() -> None:
        try:
            with doomed.client() as s:
                s.send_file(ticket, channel, path, format="text")
        except (KvError, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return t, errors


def _until_acked(c, ticket, channel: int, at_least: int, timeout: float = 20.0) -> dict:
    """Poll the receiver's view of the channel until its acknowledged prefix
    reaches ``at_least`` tuples."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for ch in c.status(ticket)["channels"]:
            p = ch.get("progress") or {}
            if ch["channel"] == channel and p.get("acked_prefix", 0) >= at_least:
                return ch
        time.sleep(0.02)
    raise AssertionError(f"channel {channel} never reported {at_least} acknowledged tuples")


def _check_partial(partial: dict, survivors: Counter, failed_words: list[bytes], acked_prefix: int) -> None:
    """partial - survivors, per key, lies between the failed sender's first
    ``acked_prefix`` words and all of its words (each counts 1)."""
    low = Counter(w.decode() for w in failed_words[:acked_prefix])
    high = Counter(w.decode() for w in failed_words)
    assert acked_prefix > 0
    for key in set(partial) | set(survivors) | set(high):
        extra = partial.get(key, 0) - survivors.get(key, 0)
        assert low[key] <= extra <= high[key], (key, partial.get(key), survivors.get(key), low[key], high[key])
    assert sum(partial.values()) - sum(survivors.values()) >= acked_prefix


def test_killed_sender_daemon_is_named_and_the_partial_holds_survivors_exactly(switch, receiver, doomed, tmp_path):
    path, words = _big_text(tmp_path, 6_000_000)
    # Channel 0 finishes before the failure, channel 2 only starts after it
    # (survivors are let finish); both share keys with the doomed channel 1.
    before = [(f"w{i % 7000}", 1) for i in range(30_000)] + [("early", 5)]
    after = [(f"w{i % 300}", 2) for i in range(10_000)] + [("late", 7)]
    with receiver.client() as c:
        ticket = c.create(3)
        with receiver.client() as s0:
            s0.send(ticket, 0, before)
        feeder, doomed_errors = _start_doomed_send(doomed, ticket, 1, path)
        seen = _until_acked(c, ticket, 1, 20_000)
        assert seen["state"] == "active" and seen["sender"] == doomed.control_addr
        doomed.kill()
        killed = time.monotonic()
        with receiver.client() as s2:
            s2.send(ticket, 2, after)
        with pytest.raises(SenderFailed) as info:
            c.wait(ticket)
        waited = time.monotonic() - killed
        stats = c.stats()
    feeder.join(timeout=10)
    e = info.value
    # Detected through the closed control connection, not a timeout.
    assert waited < SILENCE_MS / 1000, f"took {waited:.2f}s"
    assert [f["channel"] for f in e.failed] == [1]
    failed = e.failed[0]
    assert failed["sender"] == doomed.control_addr
    assert "control connection closed" in failed["reason"]
    assert "channel 1" in str(e) and doomed.control_addr in str(e)
    assert failed["progress"]["acked_prefix"] >= seen["progress"]["acked_prefix"]
    assert failed["progress"]["tuples_acked"] >= failed["progress"]["acked_prefix"]
    assert e.reply["complete"] is False and e.reply["keys"] == len(e.partial)
    survivors = Counter()
    for k, v in before + after:
        survivors[k] += v
    _check_partial(e.partial, survivors, words, failed["progress"]["acked_prefix"])
    assert failed["progress"]["tuples_acked"] < len(words), "it was killed before it finished"
    assert stats["tasks_incomplete"] >= 1 and stats["senders_failed"] >= 1
    assert doomed_errors, "the killed daemon's client lost its connection"
    assert _wait_no_regions(switch) == []


def test_hung_sender_daemon_is_declared_failed_after_the_silence_timeout(switch, receiver, doomed, tmp_path):
    path, words = _big_text(tmp_path, 6_000_000)
    with receiver.client() as c:
        ticket = c.create(2)
        with receiver.client() as s0:
            s0.send(ticket, 0, [("a", 3)])
        feeder, doomed_errors = _start_doomed_send(doomed, ticket, 1, path)
        _until_acked(c, ticket, 1, 20_000)
        os.kill(doomed.proc.pid, signal.SIGSTOP)  # alive, connection open, silent
        stopped = time.monotonic()
        with pytest.raises(SenderFailed) as info:
            c.wait(ticket)
        waited = time.monotonic() - stopped
        os.kill(doomed.proc.pid, signal.SIGCONT)
    e = info.value
    assert [f["channel"] for f in e.failed] == [1]
    assert "no progress for" in e.failed[0]["reason"], e.failed[0]
    # The clock starts at its last progress, up to a report interval before
    # the stop; the check runs every silence/5.
    assert 0.5 * SILENCE_MS / 1000 <= waited <= 2.5 * SILENCE_MS / 1000, f"took {waited:.2f}s"
    _check_partial(e.partial, Counter({"a": 3}), words, e.failed[0]["progress"]["acked_prefix"])
    # Woken up, the daemon learns it was declared failed and gives up.
    feeder.join(timeout=15)
    assert not feeder.is_alive()
    # Usually its next progress report is refused ("declared failed"); on a
    # loaded machine its own ack timeout may fire first. Either way it stops.
    assert doomed_errors and any(m in str(doomed_errors[0]) for m in ("declared", "nothing was acknowledged")), \
        doomed_errors
    assert _wait_no_regions(switch) == []


def test_bad_input_on_one_channel_delivers_the_other_channel_exactly(switch, receiver):
    with receiver.client() as c:
        ticket = c.create(2)
        with receiver.client() as s0:
            s0.send(ticket, 0, [("k%d" % (i % 50), i) for i in range(5000)])
        with receiver.client() as s1:
            with pytest.raises(KvError, match=r"key of 2000 bytes"):
                s1.send(ticket, 1, [("x" * 2000, 1), ("k1", 100)])
        with pytest.raises(SenderFailed, match=r"sender channel 1 .* failed: the sender failed: key of 2000") as info:
            c.wait(ticket)
    expected = Counter()
    for i in range(5000):
        expected["k%d" % (i % 50)] += i
    # The bad record is the first: nothing of channel 1 was sent.
    assert info.value.partial == dict(expected)
    assert info.value.failed[0]["sender"] == receiver.control_addr
    assert _wait_no_regions(switch) == []


def test_silence_names_the_channels_that_sent_no_fin(switch, receiver):
    """Channels that never join cannot be watched: the receiver's own
    silence timer (2 x silence_ms) fails the task and names them."""
    with receiver.client() as c:
        ticket = c.create(3, silence_ms=200)
        with receiver.client() as s0:
            s0.send(ticket, 1, [("a", 1)])
        t0 = time.monotonic()
        with pytest.raises(KvError, match=r"FINs from 1 of 3 senders, none from channels 0, 2") as info:
            c.wait(ticket)
        assert not isinstance(info.value, SenderFailed)
        assert time.monotonic() - t0 < 3.0
    assert _wait_no_regions(switch) == []


def test_a_keyed_sender_learns_of_a_lost_task_from_the_control_api_not_its_silence_timer(switch, tmp_path):
    """The switch forgets the task while a keyed sender streams (here its
    region is released under it; a restarted switch is the same) and
    answers the sender's datagrams with an UnknownTask it cannot seal, which
    the sender may not trust (docs/security.md). Its daemon asks the
    switch's control API, learns that the task is gone, and fails the send
    at once with that reason, long before its 20 s silence bound.

    The sender's silence bound is its daemon's ``silence_ms`` (20 s); the
    task's own ``silence_ms`` only sets how often progress is reported
    (a fifth of it). It is short here so the first report, which the test
    waits for before it releases the region, arrives long before a fast
    machine has streamed the whole input (6M words take under a second)."""
    path, _ = _big_text(tmp_path, 6_000_000)
    rx = DaemonProcess(switch.control_addr, silence_ms=20_000)
    tx = DaemonProcess(switch.control_addr, silence_ms=20_000)
    try:
        with rx.client() as c:
            ticket = c.create(1, silence_ms=250)
            feeder, errors = _start_doomed_send(tx, ticket, 0, path)
            _until_acked(c, ticket, 0, 20_000)
            with ControlClient(switch.control_addr) as cc:
                cc.release_kv_region(ticket["task_id"])
            released = time.monotonic()
            feeder.join(timeout=15)
            took = time.monotonic() - released
        assert errors and f"no longer holds task {ticket['task_id']}" in str(errors[0]), errors
        assert took < 3.0, f"the send failed {took:.2f} s after the task was lost"
    finally:
        rx.stop()
        tx.stop()



# ------------------------------------------------ bad input refused at once
def test_kv_values_that_are_not_int64_integers_are_refused_not_truncated_or_wrapped():
    from fanin.kv import KvError, encode_tuples

    with pytest.raises(KvError, match=r"value 1.5 for key a is not an integer"):
        encode_tuples([("a", 1), ("a", 1.5)])
    with pytest.raises(KvError, match="does not fit in int64"):
        encode_tuples([("a", 2**63)])
    import numpy as np

    assert encode_tuples([("a", np.int64(3)), ("b", True)]) == encode_tuples([("a", 3), ("b", 1)])


def test_kv_unknown_format_and_missing_input_fail_at_once(tmp_path):
    from fanin.kv import Client

    c = Client.__new__(Client)  # no daemon needed: refused before any request
    c.socket_path = str(tmp_path / "nowhere.sock")
    t = time.monotonic()
    with pytest.raises(ValueError, match="unknown format 'csv'; use one of tuples, text"):
        c.aggregate([("a", 1)], format="csv")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        c.aggregate([str(tmp_path / "missing.txt")], format="text")
    assert time.monotonic() - t < 1


def test_an_input_file_truncated_while_it_is_sent_fails_its_channel_not_the_daemon(switch, doomed, tmp_path):
    """The daemon reads a caller's input file as it sends. One that another
    process truncates meanwhile ends that send with an error; the daemon and
    its other tasks go on. (It was mapped, and the daemon died of SIGBUS.)"""
    from fanin.kv import encode_tuples

    path = tmp_path / "input.bin"
    chunk = encode_tuples((f"k{i % 1000}", 1) for i in range(100_000))
    with open(path, "wb") as f:
        for _ in range(120):  # 12 million tuples, 170 MB: longer to send than the wait below
            f.write(chunk)
    outcome: list = []
    with doomed.client() as c:
        ticket = c.create(1, auth=False)

        def feed() -> None:
            try:
                with doomed.client() as s:
                    outcome.append(s.send_file(ticket, 0, str(path)))
            except KvError as e:
                outcome.append(e)

        t = threading.Thread(target=feed)
        t.start()
        time.sleep(0.15)
        os.truncate(path, 100)
        t.join(30)
        assert outcome, "the send did not return"
        if isinstance(outcome[0], dict):
            pytest.skip(f"the whole input was sent before it was truncated (a fast machine): {outcome[0]}")
        assert "shrank" in str(outcome[0]), outcome[0]
        with pytest.raises(SenderFailed):
            c.wait(ticket)
    assert doomed.proc.poll() is None, "the daemon is alive"
    # and serves the next task
    with doomed.client() as c:
        ticket = c.create(1, auth=False)
        with doomed.client() as s:
            s.send(ticket, 0, [("a", 1), ("b", 2), ("a", 3)])
        assert c.wait(ticket) == {"a": 4, "b": 2}
