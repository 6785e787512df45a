"""Keyed key-value tasks with real processes (docs/security.md): a ``fanin
switch`` process and a ``fanin kv daemon`` on 127.0.0.1. While a word
count runs, forged and replayed kv datagrams are sent from a raw UDP
socket; the result must stay exact and the switch must count every one.

The replay needs an ``AF_PACKET`` capture on ``lo`` (root); without it
that part is skipped with the reason."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
from collections import Counter

import pytest

from fanin import _native
from fanin.control.client import ControlClient
from fanin.kv import DaemonProcess
from fanin_bench.bench.chaos_inject import capture, is_kv_of, kv_forged, open_capture


@pytest.fixture(scope="module")
def daemon(switch):
    d = DaemonProcess(switch.control_addr, silence_ms=5000)
    yield d
    d.stop()


def _kv_counters(switch) -> Counter:
    with ControlClient(switch.control_addr) as c:
        return Counter(c.kv_counters())


def _words(n: int, seed: int) -> list:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(500)] + [f"medium-word-{i}" for i in range(40)]
    return [(rng.choice(vocab), 1) for _ in range(n)]


def _can_capture() -> str:
    try:
        open_capture("lo").close()
        return ""
    except (PermissionError, OSError) as e:
        return f"no AF_PACKET capture on lo: {e}"


def test_tasks_are_keyed_by_default_and_unkeyed_on_request(daemon):
    with daemon.client() as c:
        default = c.request({"op": "create", "senders": 1})
        keyed = c.request({"op": "create", "senders": 1, "auth": True})
        plain = c.request({"op": "create", "senders": 1, "auth": False})
        for t in (default, keyed, plain):
            c.request({"op": "abort", "task_id": t["task_id"]})
        with pytest.raises(Exception, match="key: a key is 32 hex digits"):
            c.request({"op": "create", "senders": 1, "key": "abc"})
        with pytest.raises(Exception, match="auth must be true or false"):
            c.request({"op": "create", "senders": 1, "auth": "yes"})
    assert default["keyed"] is True and keyed["keyed"] is True and plain["keyed"] is False


def test_forged_and_replayed_kv_datagrams_are_counted_and_the_count_stays_exact(switch, daemon):
    task_key = os.urandom(16)
    inputs = [_words(40_000, 1), _words(30_000, 2)]
    expected = Counter()
    for chan in inputs:
        for w, v in chan:
            expected[w] += v
    before = _kv_counters(switch)
    why_not = _can_capture()
    with daemon.client() as rx:
        reply = rx.request({"op": "create", "senders": 2, "aa_size": 256, "key": task_key.hex()})
        ticket = {"task_id": reply["task_id"], "control": reply["control"]}
        task = ticket["task_id"]
        host, port = reply["switch_addr"].rsplit(":", 1)
        switch_port = int(port)
        # Channel 0 runs while its datagrams to the switch are captured.
        captured: list = []
        cap = None if why_not else open_capture("lo")
        sniff = threading.Thread(target=lambda: captured.extend(
            capture(cap, range(switch_port, switch_port + 1), 30, 10.0, is_kv_of(task)))) if cap else None
        if sniff:
            sniff.start()
        with daemon.client() as tx:
            tx.send(ticket, 0, inputs[0])
        if sniff:
            sniff.join()
            cap.close()
        # The task is still running (channel 1 has not sent): attack it.
        rng = random.Random(5)
        other_task_key = _native.derive_member_key(os.urandom(16), task + 1, 0)
        sent = Counter()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(40):
                counter, data = kv_forged(rng, task, 2, [other_task_key])
                s.sendto(data, (host, int(port)))
                sent[counter] += 1
            for _, _, payload in captured:
                s.sendto(payload, (host, int(port)))
        sealed = [p for _, _, p in captured if p[3] & 0x80]
        assert len(sealed) == len(captured), "a keyed task's datagram went out unsealed"
        # Channel 1, then the result.
        with daemon.client() as tx:
            tx.send(ticket, 1, inputs[1])
        got = rx.wait(ticket)
    assert got == dict(expected), "a forged or replayed datagram changed the count"
    after = _kv_counters(switch)
    delta = {k: after[k] - before[k] for k in ("auth_bad_tag", "auth_unsealed", "auth_replayed")}
    assert delta["auth_bad_tag"] == sent["kv.auth_bad_tag"] > 0, (delta, sent)
    assert delta["auth_unsealed"] == sent["kv.auth_unsealed"] > 0, (delta, sent)
    assert after["rx_datagrams"] - before["rx_datagrams"] == sum(
        after[k] - before[k] for k in after if not k.startswith(("rx_", "duplicates", "tuples", "swaps", "nacks",
                                                                   "tasks_"))), "an outcome was not counted"
    if why_not:
        pytest.skip(f"forgeries checked; replay not: {why_not}")
    assert len(captured) == 30
    assert delta["auth_replayed"] == len(captured), (delta, len(captured))
