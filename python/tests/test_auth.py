"""Authenticated jobs end to end (docs/security.md): a real switch daemon
process, worker processes with member keys, a forging process, and a
man-in-the-middle relay that replays captured sealed datagrams in both
directions while the allreduce runs. Results stay exact and the counters
equal exactly what was injected."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import fanin
from fanin import _native
from fanin.proc import SwitchProcess
from fanin.switch import job_config, switch_config
from threads import in_threads

JOB, OTHER_JOB = 1, 2
WORKERS = 2
ELEMS = 64 * 256  # 64 blocks of 256 elements
EPP = 256


def _worker(rank: int, addr: str, member_key: bytes, out: "mp.Queue") -> None:
    try:
        s = fanin.Session(addr, JOB, rank, elems_per_packet=EPP, window=8, auth_key=member_key)
        x = (np.arange(ELEMS, dtype=np.int32) * (rank + 1)) % 1000
        y = s.allreduce(x)
        out.put({"rank": rank, "ok": True, "sum": int(y.astype(np.int64).sum()), "first": y[:4].tolist(),
                 "stats": s.socket_stats()})
    except BaseException as e:  # reported to the test
        out.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"})


def _contribution(job: int, src: int, block: int, values: np.ndarray) -> bytes:
    """An unsealed value-stream Contribution (docs/protocol.md §2.2)."""
    header = struct.pack(">HBBBBHHHIIHbb", 0xFA17, 1, 0x01, 0, 0, src, 0, 1, job, block, len(values), -128, -128)
    return header + values.astype(">i4").tobytes()


def _forger(addr: str, other_job_key: bytes, counts: dict, done: "mp.Event") -> None:
    """Poison the job without its key: wrong keys, another job's key, no tag."""
    host, port = addr.rsplit(":", 1)
    dest = (host, int(port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    poison = np.full(EPP, 10_000, dtype=np.int32)
    for i in range(counts["rounds"]):
        block = i % 64
        for src in range(WORKERS):
            raw = _contribution(JOB, src, block, poison)
            sock.sendto(_native.seal_datagram(os.urandom(16), 1 << 40 | i, raw), dest)  # a guessed key
            cross = fanin.derive_member_key(other_job_key, OTHER_JOB, src)
            sock.sendto(_native.seal_datagram(cross, 1 << 40 | i, raw), dest)  # another job's member key
            sock.sendto(raw, dest)  # unsealed
    sock.close()
    done.set()


class _Relay:
    """Worker 1's path to the switch: forwards both ways, and replays the
    first captured sealed datagrams of each direction `replays` times."""

    def __init__(self, switch_addr: str, replays: int, captures: int):
        host, port = switch_addr.rsplit(":", 1)
        self.switch = (host, int(port))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.replays, self.captures = replays, captures
        self.worker = None
        self.replayed_up = self.replayed_down = 0
        self.captured_up = self.captured_down = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                data, peer = self.sock.recvfrom(65535)
            except socket.timeout:
                continue
            if peer == self.switch:
                if self.worker is None:
                    continue
                self.sock.sendto(data, self.worker)
                # replay results (not the JoinAck, whose loss would only slow the join)
                if data[3] == 0x83 and self.captured_down < self.captures:
                    self.captured_down += 1
                    for _ in range(self.replays):
                        self.sock.sendto(data, self.worker)
                        self.replayed_down += 1
            else:
                self.worker = peer
                self.sock.sendto(data, self.switch)
                if data[3] in (0x81, 0x82) and self.captured_up < self.captures:
                    self.captured_up += 1
                    for _ in range(self.replays):
                        self.sock.sendto(data, self.switch)
                        self.replayed_up += 1

    def close(self) -> None:
        self.stop = True
        self.thread.join(timeout=2)
        self.sock.close()


# An independent, deliberately plain reimplementation of the tag
# (docs/protocol.md §2.4: SipHash-2-4 over seq, length and the NH digests
# of every 1 KiB chunk), to check the native sealing against byte for byte.
_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def _ref_siphash24(key: bytes, data: bytes) -> int:
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rnd() -> None:
        v[0] = (v[0] + v[1]) & _M64; v[1] = _rotl(v[1], 13) ^ v[0]; v[0] = _rotl(v[0], 32)  # noqa: E702
        v[2] = (v[2] + v[3]) & _M64; v[3] = _rotl(v[3], 16) ^ v[2]  # noqa: E702
        v[0] = (v[0] + v[3]) & _M64; v[3] = _rotl(v[3], 21) ^ v[0]  # noqa: E702
        v[2] = (v[2] + v[1]) & _M64; v[1] = _rotl(v[1], 17) ^ v[2]; v[2] = _rotl(v[2], 32)  # noqa: E702

    n = len(data) - len(data) % 8
    words = [struct.unpack_from("<Q", data, i)[0] for i in range(0, n, 8)]
    words.append(int.from_bytes(data[n:], "little") | ((len(data) & 0xFF) << 56))
    for m in words:
        v[3] ^= m
        rnd()
        rnd()
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        rnd()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def _ref_nh(k: list, m: list) -> int:
    s = 0
    for g in range(0, len(m), 8):
        for j in range(4):
            s += ((m[g + j] + k[g + j]) & 0xFFFFFFFF) * ((m[g + j + 4] + k[g + j + 4]) & 0xFFFFFFFF)
    return s & _M64


def _ref_tag(key: bytes, seq: int, inner: bytes) -> int:
    k = []
    for i in range(130):  # 260 NH key words, SipHash in counter mode
        w = _ref_siphash24(key, b"fanin-nh" + struct.pack(">Q", i))
        k += [w & 0xFFFFFFFF, w >> 32]
    msg = struct.pack(">QQ", seq, len(inner))
    for c in range(0, len(inner), 1024):
        chunk = inner[c:c + 1024]
        chunk += bytes(-len(chunk) % 32)
        m = list(struct.unpack("<%dI" % (len(chunk) // 4), chunk))
        msg += struct.pack("<QQ", _ref_nh(k, m), _ref_nh(k[4:], m))
    return _ref_siphash24(key, msg)


def test_the_native_tag_matches_an_independent_reference_and_the_golden_vectors():
    assert _ref_siphash24(bytes(range(16)), bytes(range(15))) == 0xA129CA6149BE45E5  # reference vector
    member = fanin.derive_member_key(bytes(range(16)), 7, 3)
    join = bytes([0xFA, 0x17, 0x01, 0x04, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0x80, 0x80])
    sealed = _native.seal_datagram(member, 0x0000_0102_0304_0506, join)
    assert sealed[-8:].hex() == "1cf0eb518f255db5"  # GOLDEN_JOIN in crates/fanin-wire/src/auth/tests.rs
    assert int.from_bytes(sealed[-8:], "big") == _ref_tag(member, 0x0000_0102_0304_0506, sealed[:-16])
    long = bytes([0xFA, 0x17, 0x01, 0x81]) + join[4:] + bytes((i * 7 + 1) & 0xFF for i in range(2400))
    assert _ref_tag(member, 42, long) == 0x97C7_8363_8B3E_9830  # GOLDEN_LONG_TAG
    for size in (0, 1, 31, 33, 1023, 1024, 1025, 3000):
        inner = join[:4] + join[4:] + os.urandom(size)
        sealed = _native.seal_datagram(member, 7 + size, inner)
        assert int.from_bytes(sealed[-8:], "big") == _ref_tag(member, 7 + size, sealed[:-16]), size


def test_sealed_kv_ack_golden_vector_matches_the_reference():
    # SEALED_ACK in crates/fanin-wire/src/kv/tests.rs (docs/kv.md §2.1): a
    # kv switch ACK sealed under the member key of channel 5 of task 0x01020304.
    member = fanin.derive_member_key(bytes(range(16)), 0x0102_0304, 5)
    ack = bytes.fromhex("fa17012201000005010203040000" "0007")
    sealed = _native.seal_datagram(member, 0x0000_0102_0304_0506, ack)
    assert sealed.hex() == "fa1701a201000005010203040000000700000102030405069466ca772529c126"
    assert int.from_bytes(sealed[-8:], "big") == _ref_tag(member, 0x0000_0102_0304_0506, sealed[:-16])


def _ref_prf128(key: bytes, label: bytes, job_id: int, tail: bytes) -> bytes:
    """128 bits as docs/protocol.md §2.4 defines them: SipHash of label ‖ i
    (the half, one byte) ‖ zero padding to 16 bytes ‖ job_id ‖ tail, for
    i = 0, 1, each big endian."""
    def half(i):
        head = (label + bytes([i])).ljust(16, b"\0")
        return _ref_siphash24(key, head + struct.pack(">I", job_id) + tail).to_bytes(8, "big")
    return half(0) + half(1)


def test_the_result_key_and_its_wrap_match_the_documented_derivation():
    # GOLDEN_RESULT_KEY and GOLDEN_WRAPPED_FOR_3 in crates/fanin-wire/src/auth/tests.rs
    job_key, inc, epoch = bytes(range(16)), 0x1234_5679, 2
    member = _ref_prf128(job_key, b"fanin-member-k", 7, struct.pack(">H", 3))
    assert member == fanin.derive_member_key(job_key, 7, 3)
    result = _ref_prf128(job_key, b"fanin-result-k", 7, struct.pack(">II", inc, epoch))
    pad = _ref_prf128(member, b"fanin-rkey-wrap", 7, struct.pack(">II", inc, epoch))
    assert result.hex() == "8a2ff77d4d29e5890fdf1c1358d725c9"
    assert bytes(a ^ b for a, b in zip(result, pad)).hex() == "1122fa37bea696d5338190604a094b83"


def test_derive_member_key_matches_the_switch_derivation_and_is_pinned():
    key = fanin.derive_member_key(bytes(range(16)), 7, 3)
    assert key.hex() == "8b5638aa5b5876fd2805b96de9d9ab72"  # docs/protocol.md §2.4
    with pytest.raises(ValueError, match="16 bytes"):
        fanin.derive_member_key(b"short", 1, 0)


def test_forged_and_replayed_packets_are_all_rejected_and_the_sum_stays_exact():
    job_key, other_key = fanin.new_job_key(), fanin.new_job_key()
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0",
                        jobs=[job_config(JOB, WORKERS, block_cnt_max=8, block_grad_max=EPP, key=job_key),
                              job_config(OTHER_JOB, WORKERS, block_cnt_max=8, block_grad_max=EPP, key=other_key)])
    ctx = mp.get_context("spawn")
    counts = {"rounds": 50}
    with SwitchProcess(cfg) as sw:
        relay = _Relay(sw.data_addr, replays=2, captures=5)
        done = ctx.Event()
        forger = ctx.Process(target=_forger, args=(sw.data_addr, other_key, counts, done), daemon=True)
        forger.start()
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, relay.addr if r == 1 else sw.data_addr,
                                                     fanin.derive_member_key(job_key, JOB, r), results), daemon=True)
                 for r in range(WORKERS)]
        for p in procs:
            p.start()
        reports = sorted((results.get(timeout=60) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(timeout=10)
        assert done.wait(timeout=30)
        forger.join(timeout=10)
        relay.close()
        counters = sw.counters()
    assert all(r["ok"] for r in reports), reports
    x = [(np.arange(ELEMS, dtype=np.int64) * (r + 1)) % 1000 for r in range(WORKERS)]
    want = sum(x)
    for r in reports:
        assert r["sum"] == int(want.sum()) and r["first"] == want[:4].tolist(), "poison reached a result"
    injected_forged = counts["rounds"] * WORKERS * 2
    injected_unsealed = counts["rounds"] * WORKERS
    assert relay.replayed_up == 10 and relay.replayed_down == 10
    assert counters["auth_bad_tag"] == injected_forged
    assert counters["auth_unsealed"] == injected_unsealed
    assert counters["auth_replayed"] == relay.replayed_up
    # the worker behind the relay refused every replayed result
    assert reports[1]["stats"]["auth_replayed"] == relay.replayed_down
    assert reports[1]["stats"]["auth_bad_tag"] == 0 and reports[0]["stats"]["auth_replayed"] == 0


def test_a_keyed_job_refuses_an_unkeyed_worker_and_a_wrong_key():
    job_key = fanin.new_job_key()
    with fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None,
                                         jobs=[job_config(JOB, 1, key=job_key)])) as sw:
        with pytest.raises(fanin.FaninTimeout):
            fanin.Session(sw.data_addr, JOB, 0, join_timeout_s=0.5)
        with pytest.raises(fanin.FaninTimeout):
            fanin.Session(sw.data_addr, JOB, 0, join_timeout_s=0.5, auth_key=fanin.derive_member_key(job_key, JOB, 1))
        s = fanin.Session(sw.data_addr, JOB, 0, auth_key=fanin.derive_member_key(job_key, JOB, 0))
        assert s.allreduce(np.arange(10, dtype=np.int32)).tolist() == list(range(10))
        c = sw.counters()
        assert c["auth_unsealed"] >= 1 and c["auth_bad_tag"] >= 1


def test_a_control_api_off_loopback_without_a_token_does_not_start(monkeypatch):
    monkeypatch.delenv("FANIN_CONTROL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="not a loopback address but no control_token"):
        fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr="0.0.0.0:0", metrics_addr=None))
    monkeypatch.setenv("FANIN_CONTROL_TOKEN", "s3cret")
    with fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr="0.0.0.0:0", metrics_addr=None)):
        pass


def _group_sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """(a socket on the result group on loopback, one that sends to it and
    hears its own sends)."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    rx.bind((host, port))
    rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(host) + socket.inet_aton("127.0.0.1"))
    rx.settimeout(0.05)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    return rx, tx


def _group_attacker(group: str, stop: threading.Event, captured: list, counts: dict) -> None:
    """On the job's result group: capture the first sealed results and send
    each back to the group twice (replays), and send results sealed with a
    random key on the group lanes (forgeries), while the job runs."""
    host, port = group.rsplit(":", 1)
    dest = (host, int(port))
    rx, tx = _group_sockets(host, int(port))
    poison = np.full(EPP, 10_000, dtype=np.int32)
    i, forged = 0, []
    while not stop.is_set():
        try:
            data, _ = rx.recvfrom(65535)
        except socket.timeout:
            continue
        # (the group loops the attacker's own forgeries back to it: skip them)
        if data[3] == 0x83 and len(captured) < counts["captures"] and data not in captured + forged:
            captured.append(data)
            for _ in range(2):
                tx.sendto(data, dest)
                counts["replayed"] += 1
            # a result for the same block, sealed with a guessed key on the
            # group lanes (bit 63 of seq: lane 0x8000)
            raw = bytearray(_contribution(JOB, 0, struct.unpack(">I", data[16:20])[0], poison))
            raw[3] = 0x03
            forged.append(_native.seal_datagram(os.urandom(16), 1 << 63 | (1 << 40) + i, bytes(raw)))
            tx.sendto(forged[-1], dest)
            counts["forged"] += 1
            i += 1
            if len(captured) == counts["captures"]:
                counts["done"].set()
    rx.close()
    tx.close()


def test_a_keyed_job_sends_each_result_once_to_its_group_and_refuses_forged_and_replayed_ones():
    """A keyed job with a result group: the switch seals each result once
    under the job's result key and sends it to the group (not once per
    member); listening workers learn the key from their JoinAck, the last
    worker does not listen and gets its own seals by unicast. A process on
    the group replays captured results and forges others: every one is
    refused and counted, the sums stay exact and equal."""
    from fanin.switch import free_result_group

    n, group, job_key = 3, free_result_group(), fanin.new_job_key()
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", shards=2,
                        jobs=[job_config(JOB, n, block_cnt_max=8, block_grad_max=EPP, key=job_key,
                                         result_group=group)])
    stop, captured = threading.Event(), []
    counts = {"captures": 5, "replayed": 0, "forged": 0, "done": threading.Event()}
    with fanin.LocalSwitch(cfg) as sw:
        attacker = threading.Thread(target=_group_attacker, args=(group, stop, captured, counts), daemon=True)
        attacker.start()
        time.sleep(0.2)  # the attacker listens before the first result

        def work(rank):
            s = fanin.Session(sw.data_addr, JOB, rank, elems_per_packet=EPP, window=8,
                              auth_key=fanin.derive_member_key(job_key, JOB, rank),
                              result_group=group if rank < n - 1 else None)
            assert s.params["results_on_group"] == (rank < n - 1)
            x = (np.arange(ELEMS, dtype=np.int32) * (rank + 1)) % 1000
            ys = [s.allreduce(x)]
            # the attack lands between calls: the next call reads it first
            assert counts["done"].wait(timeout=10)
            ys += [s.allreduce(x) for _ in range(2)]
            return ys, s.socket_stats()

        results = in_threads(n, work)
        stop.set()
        attacker.join(timeout=5)
        counters = sw.counters()
    want = sum((np.arange(ELEMS, dtype=np.int64) * (r + 1)) % 1000 for r in range(n))
    for ys, _ in results:
        for y in ys:
            assert np.array_equal(y, want), "a forged or replayed result reached the sum"
    blocks = 3 * ELEMS // EPP
    # about one group datagram per block (int32: no exponent rounds), and
    # unicast to the worker that does not listen; a listener's first
    # results from the shard that did not answer its Join come unicast
    # until that shard learns it listens (docs/protocol.md §4.5)
    assert counters["results_to_group"] >= 0.9 * blocks
    assert counters["results_sent"] < 1.25 * blocks, counters
    assert counts["replayed"] == 10 and counts["forged"] == 5
    for ys, stats in results[:-1]:
        assert stats["datagrams_from_group"] >= 0.9 * blocks
        assert stats["auth_replayed"] == 10 and stats["auth_bad_tag"] == 5, stats
    assert results[-1][1]["datagrams_from_group"] == 0
    assert counters["auth_bad_tag"] == 0 and counters["malformed"] == 0


def _verifies_under(key: bytes, data: bytes) -> bool:
    """True when the sealed datagram `data` carries a valid tag under `key`
    (sealing is deterministic: seal its inner bytes again with its own
    sequence number and compare)."""
    inner = bytearray(data[:-16])
    inner[3] &= 0x7F
    seq = int.from_bytes(data[-16:-8], "big")
    return _native.seal_datagram(key, seq, bytes(inner)) == data


def _removed_member_on_the_group(group: str, old_key: bytes, stop: threading.Event, left: threading.Event,
                                 seen: dict) -> None:
    """What a member that left still has: the group's address and the
    result key it was given. Counts the group results it can open before
    and after it left, and after it left forges a poisoned result under
    that key for every one it hears."""
    host, port = group.rsplit(":", 1)
    rx, tx = _group_sockets(host, int(port))
    poison = np.full(EPP, 10_000, dtype=np.int32)
    forged, i = set(), 0
    while not stop.is_set():
        try:
            data, _ = rx.recvfrom(65535)
        except socket.timeout:
            continue
        if data in forged or data[3] != 0x83:
            continue
        phase = "after" if left.is_set() else "before"
        seen[f"{phase}_heard"] += 1
        seen[f"{phase}_opened"] += _verifies_under(old_key, data)
        if left.is_set():
            seen["after_new_key"] += _verifies_under(seen["new_key"], data)
            raw = bytearray(_contribution(JOB, 0, struct.unpack(">I", data[16:20])[0], poison))
            raw[3] = 0x03
            forgery = _native.seal_datagram(old_key, 1 << 63 | (1 << 44) + i, bytes(raw))
            forged.add(forgery)
            tx.sendto(forgery, (host, int(port)))
            seen["forged"] += 1
            i += 1
    rx.close()
    tx.close()


def test_a_member_that_leaves_a_keyed_group_job_can_neither_read_nor_forge_its_later_results():
    """Three keyed workers listen on the job's result group; rank 2 leaves
    (the control API's update_job, as the controller does on Unsubscribe).
    The switch starts a new result-key epoch and sends it to the two that
    stay: the key rank 2 was given opens every group result before it left
    and none after, its forgeries under that key are refused by the two
    that stay, and they keep exact sums (docs/security.md)."""
    from fanin.control import ControlClient
    from fanin.switch import free_result_group

    n, group, job_key = 3, free_result_group(), fanin.new_job_key()
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0", shards=2,
                        jobs=[job_config(JOB, n, block_cnt_max=8, block_grad_max=EPP, key=job_key,
                                         result_group=group)])
    x = [(np.arange(ELEMS, dtype=np.int32) * (r + 1)) % 1000 for r in range(n)]
    with SwitchProcess(cfg) as sw:
        seen = {k: 0 for k in ("before_heard", "before_opened", "after_heard", "after_opened", "after_new_key",
                               "forged")}
        stop, left, first_done = threading.Event(), threading.Event(), threading.Barrier(n + 1)
        spy_started = threading.Event()

        def work(r):
            # a session lives on the thread that made it
            s = fanin.Session(sw.data_addr, JOB, r, elems_per_packet=EPP, window=8, result_group=group,
                              auth_key=fanin.derive_member_key(job_key, JOB, r))
            if r == 0:
                inc = s.params["incarnation"]
                old_key = _ref_prf128(job_key, b"fanin-result-k", JOB, struct.pack(">II", inc, 0))
                seen["new_key"] = _ref_prf128(job_key, b"fanin-result-k", JOB, struct.pack(">II", inc, 1))
                threading.Thread(target=_removed_member_on_the_group, args=(group, old_key, stop, left, seen),
                                 daemon=True).start()
                time.sleep(0.2)  # listening before the first result
                spy_started.set()
            assert spy_started.wait(timeout=30)
            ys = [s.allreduce(x[r])]
            first_done.wait(timeout=60)
            if r == 2:
                return ys, None  # it left
            assert left.wait(timeout=60)
            ys += [s.allreduce(x[r]) for _ in range(3)]
            return ys, s.socket_stats()

        runner = threading.Thread(target=lambda: results.extend(in_threads(n, work)), daemon=True)
        results = []
        runner.start()
        first_done.wait(timeout=120)
        time.sleep(0.2)  # every datagram of the first allreduce reached the spy
        with ControlClient(sw.control_addr) as c:
            job = c.list_jobs()[0]
            c.update_job({**job, "members": [0, 1], "key": job_key})
        left.set()
        runner.join(timeout=120)
        time.sleep(0.2)
        stop.set()
        counters = sw.counters()
    want3 = sum(a.astype(np.int64) for a in x)
    want2 = x[0].astype(np.int64) + x[1]
    assert len(results) == n
    for ys, _ in results:
        assert np.array_equal(ys[0], want3)
        for y in ys[1:]:
            assert np.array_equal(y, want2), "a forged result or a stale round reached the sum"
    stats = [st for _, st in results[:2]]
    assert seen["before_heard"] > 0 and seen["before_opened"] == seen["before_heard"], seen
    assert seen["after_heard"] > 0 and seen["after_opened"] == 0, f"the removed member opened results: {seen}"
    assert seen["after_new_key"] == seen["after_heard"], seen
    assert counters["result_key_updates"] == 2, "the two that stay were sent the new key"
    for st in stats:
        assert st["auth_result_key_changes"] == 1, st
        # told by the switch's key update; the forgeries under the old key
        # that fail then make (rate-limited) probes that change nothing
        assert st["auth_result_key_probes"] <= 20, st
        assert st["auth_bad_tag"] >= 1, "the forgeries (and the results under the old key) were refused"
    assert counters["auth_bad_tag"] == 0 and counters["malformed"] == 0


def test_fanin_keys_writes_private_key_files_that_a_cli_switch_and_workers_use(tmp_path):
    """`fanin keys` draws a job key and writes each rank's member key to a
    file of its own (mode 0600, never replaced, never printed); `fanin
    switch --job ...,key_file=` admits the keyed job from the job key's file
    (so the key is not on any command line); workers sealing with their
    files' keys sum exactly, and a rank holding another rank's key is not
    let in as itself."""
    import json as _json
    import signal
    import subprocess
    import sys

    out = tmp_path / "keys"
    run = lambda *a: subprocess.run([sys.executable, "-m", "fanin", "keys", *a], capture_output=True, text=True)
    made = run("--job-id", "5", "--ranks", "2", "--out", str(out), "--json")
    assert made.returncode == 0, made.stderr
    paths = _json.loads(made.stdout)
    job_key = fanin.read_key_file(paths["job_key_file"])
    for path in [paths["job_key_file"], *paths["member_key_files"]]:
        assert os.stat(path).st_mode & 0o777 == 0o600, path
        assert job_key.hex() not in made.stdout and job_key.hex() not in made.stderr
    for rank, path in enumerate(paths["member_key_files"]):
        assert fanin.read_key_file(path) == fanin.derive_member_key(job_key, 5, rank)
        assert paths["auth_key_file_pattern"].replace("{rank}", str(rank)) == path
    again = run("--job-id", "5", "--ranks", "2", "--out", str(out))
    assert again.returncode == 1 and "exists" in again.stderr
    assert fanin.read_key_file(paths["job_key_file"]) == job_key, "an existing key is never replaced"

    proc = subprocess.Popen([sys.executable, "-m", "fanin", "switch", "--data-addr", "127.0.0.1:0", "--control-addr",
                             "off", "--metrics-addr", "off", "--shards", "1", "--print-ready", "--job",
                             f"id=5,sources=2,block_cnt_max=8,block_grad_max={EPP},key_file={paths['job_key_file']}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        addr = _json.loads(line)["data_addr"]
        x = [np.arange(ELEMS, dtype=np.int32) * (r + 1) for r in range(2)]

        def work(r):
            s = fanin.Session(addr, 5, r, elems_per_packet=EPP, window=8,
                              auth_key=fanin.read_key_file(paths["member_key_files"][r]))
            return s.allreduce(x[r])

        for y in in_threads(2, work):
            assert np.array_equal(y, x[0] + x[1])
        # rank 0's key does not make anyone rank 1: its join is dropped unanswered
        with pytest.raises(fanin.FaninTimeout, match="member key"):
            fanin.Session(addr, 5, 1, elems_per_packet=EPP, join_timeout_s=1.0,
                          auth_key=fanin.read_key_file(paths["member_key_files"][0]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    half = tmp_path / "half.key"
    half.write_text(fanin.new_job_key().hex()[:16])  # half a key, no newline: 16 bytes, not a raw key
    with pytest.raises(ValueError, match="16 hex digits"):
        fanin.read_key_file(str(half))
    bad = tmp_path / "bad.key"
    bad.write_text("s3cret but not hex")
    said = subprocess.run([sys.executable, "-m", "fanin", "switch", "--job", f"id=5,sources=2,key_file={bad}"],
                          capture_output=True, text=True, timeout=60)
    assert said.returncode != 0 and "not a key" in said.stderr and "s3cret" not in said.stderr, said.stderr


def test_an_unreadable_or_unwritable_key_file_is_one_error_naming_the_file(tmp_path):
    """A key file that cannot be opened is an OSError (errno, filename) that is
    also a ValueError, so `fanin keys --job-key-file`, `--job ...,key_file=`
    and every command line that reports ValueErrors print one line naming the
    file, never a traceback; writing one where no file can be made likewise.
    An existing file stays a FileExistsError (`fanin keys` refuses to replace it)."""
    import subprocess
    import sys

    missing = str(tmp_path / "nope" / "job1.key")
    with pytest.raises(ValueError, match="cannot read the key file .*nope/job1.key: No such file"):
        fanin.read_key_file(missing)
    with pytest.raises(OSError) as e:
        fanin.read_key_file(missing)
    assert e.value.filename == missing and e.value.errno is not None
    with pytest.raises(ValueError, match="cannot write the key file .*nope/job1.key: No such file"):
        fanin.auth.write_key_file(missing, fanin.new_job_key())
    kept = tmp_path / "kept.key"
    fanin.auth.write_key_file(str(kept), fanin.new_job_key())
    with pytest.raises(FileExistsError):
        fanin.auth.write_key_file(str(kept), fanin.new_job_key())

    said = subprocess.run([sys.executable, "-m", "fanin", "keys", "--job-id", "1", "--ranks", "2", "--out",
                           str(tmp_path / "k"), "--job-key-file", missing], capture_output=True, text=True, timeout=60)
    assert said.returncode != 0 and "Traceback" not in said.stderr, said.stderr
    assert said.stderr.strip().splitlines() == [f"fanin keys: cannot read the key file {missing}: "
                                                "No such file or directory"], said.stderr
