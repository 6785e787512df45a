"""Packet injectors of the chaos soak, run inside a testbed namespace.

    python -m fanin_bench.bench.chaos_inject garbage --to 10.1.0.2:9000 --count 50 --seed 1
    python -m fanin_bench.bench.chaos_inject replay --iface veth0 --ports 9000-9001 --capture 40 --delay 1
    python -m fanin_bench.bench.chaos_inject replay --iface veth0 --ports 9000-9001 --kv-task 77 --ready
    python -m fanin_bench.bench.chaos_inject kv-forge --to 10.1.0.2:9000 --task 77 --channels 2 --count 30

Each prints one JSON line saying exactly what it sent, by the switch
counter that must account for it, so the driver can check the counters
afterwards.

* ``garbage``: datagrams the switch must count as malformed (by reason)
  or as addressed to an unknown job, and drop.
* ``replay``: captures real datagrams this host sends to the switch (an
  ``AF_PACKET`` socket sees outgoing frames) and, after a delay, sends
  the same bytes again: the recorded packet-replay attack. Value-stream
  datagrams only, or with ``--kv-task`` only the key-value datagrams of
  that (keyed) task.
* ``forge``: contributions to an authenticated job from someone without
  the member's key: sealed with a random key, sealed with a member key of
  *another* job (cross-job injection by a member of that job), or not
  sealed at all.
* ``kv-forge``: the same against a keyed key-value task: Data (a poisoned
  count) and Release (freeing the region) datagrams of the task, sealed
  with a random key, with a member key of another task, or not sealed.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import time
from collections import Counter

MAGIC = 0xFA17
VERSION = 1
CONTRIBUTION = 0x01
UNKNOWN_JOB = 0xFFFF_FFF0  # never admitted by the soak


def _header(msg_type: int, job_id: int, *, version: int = VERSION, src: int = 0, block: int = 0,
            grad_cnt: int = 0) -> bytes:
    """A value-stream header (docs/protocol.md §2.2): int32 dtype, no exponent."""
    return struct.pack(">HBBBBHHHIIHbb", MAGIC, version, msg_type, 0, 0, src, 0, 1, job_id, block,
                       grad_cnt, -128, -128)


def garbage(rng: random.Random) -> tuple[str, bytes]:
    """One malformed or misaddressed datagram and the counter it must land in."""
    kind = rng.choice(["truncated", "bad_magic", "bad_version", "unknown_msg_type", "unknown_job"])
    if kind == "truncated":
        return "malformed.truncated", bytes([0xFA])
    if kind == "bad_magic":
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(4, 200)))
        return "malformed.bad_magic", bytes([0x00]) + body  # magic starts 0xFA, never 0x00
    if kind == "bad_version":
        return "malformed.bad_version", _header(CONTRIBUTION, UNKNOWN_JOB, version=0x7E)
    if kind == "unknown_msg_type":
        # (a job that exists and is keyed would count it as unsealed first)
        return "malformed.unknown_msg_type", _header(0x5F, UNKNOWN_JOB)
    payload = struct.pack(">4i", *(rng.randrange(-1000, 1000) for _ in range(4)))
    return "unknown_job", _header(CONTRIBUTION, UNKNOWN_JOB, grad_cnt=4) + payload


def forged(rng: random.Random, job_id: int, members: int, other_keys: list[bytes]) -> tuple[str, bytes]:
    """One forged contribution to keyed job `job_id` and the counter it must land in."""
    src = rng.randrange(members)
    payload = struct.pack(">4i", *(rng.randrange(-1000, 1000) for _ in range(4)))
    plain = _header(CONTRIBUTION, job_id, src=src, block=rng.randrange(1 << 20), grad_cnt=4) + payload
    return _forge_seal(rng, plain, other_keys, "")


def _forge_seal(rng: random.Random, plain: bytes, other_keys: list[bytes], counters: str) -> tuple[str, bytes]:
    """`plain` left unsealed, or sealed with a random key or another job's
    or task's key; and the counter (under prefix `counters`) it must land in."""
    from fanin import _native

    kind = rng.choice(["random_key", "other_key", "unsealed"] if other_keys else ["random_key", "unsealed"])
    if kind == "unsealed":
        return counters + "auth_unsealed", plain
    key = rng.choice(other_keys) if kind == "other_key" else bytes(rng.getrandbits(8) for _ in range(16))
    return counters + "auth_bad_tag", bytes(_native.seal_datagram(key, rng.getrandbits(63), plain))


KV_DATA, KV_RELEASE = 0x20, 0x2B
KV_SLOTS = 32  # the daemon's default layout: 16 short slots + 8 groups of 2


def kv_forged(rng: random.Random, task: int, channels: int, other_keys: list[bytes]) -> tuple[str, bytes]:
    """One forged datagram for keyed kv task `task` and the kv counter it must land in."""
    channel = rng.randrange(channels)
    if rng.random() < 0.8:
        body = struct.pack(">Q", 1) + b"forged\0\6" + struct.pack(">q", rng.randrange(1, 1 << 40))
        body += bytes(16 * (KV_SLOTS - 1))
        plain = struct.pack(">HBBBBHII", MAGIC, VERSION, KV_DATA, 0, KV_SLOTS, channel, task, rng.randrange(256)) + body
    else:  # a Release "from the receiver": would free the region
        plain = struct.pack(">HBBBBHII", MAGIC, VERSION, KV_RELEASE, 0, 0, 0, task, 0)
    return _forge_seal(rng, plain, other_keys, "kv.")


def _send_forged(args: argparse.Namespace, make) -> dict:
    """Send `args.count` datagrams `make(rng, other_keys)` builds to `args.to`;
    how many should land in each counter."""
    host, port = args.to.rsplit(":", 1)
    rng = random.Random(args.seed)
    others = [bytes.fromhex(k) for k in args.other_key]
    sent: Counter = Counter()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(args.count):
            counter, data = make(rng, others)
            s.sendto(data, (host, int(port)))
            sent[counter] += 1
            time.sleep(0.0005)
    return {"sent": dict(sent)}


def run_kv_forge(args: argparse.Namespace) -> dict:
    return _send_forged(args, lambda rng, others: kv_forged(rng, args.task, args.channels, others))


def run_forge(args: argparse.Namespace) -> dict:
    return _send_forged(args, lambda rng, others: forged(rng, args.job, args.members, others))


def run_garbage(args: argparse.Namespace) -> dict:
    host, port = args.to.rsplit(":", 1)
    rng = random.Random(args.seed)
    sent: Counter = Counter()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(args.count):
            counter, data = garbage(rng)
            s.sendto(data, (host, int(port)))
            sent[counter] += 1
            time.sleep(0.0005)  # not a flood: this is about parsing, not rate limits
    return {"sent": dict(sent)}


def _outgoing_udp(frame: bytes, ports: range):
    """(dst ip, dst port, payload) of an IPv4/UDP datagram to one of `ports`, else None."""
    if len(frame) < 28 or frame[0] >> 4 != 4 or frame[9] != 17:
        return None
    ihl = (frame[0] & 0x0F) * 4
    if struct.unpack_from(">H", frame, 6)[0] & 0x3FFF:  # fragments: not ours
        return None
    dport = struct.unpack_from(">H", frame, ihl + 2)[0]
    if dport not in ports:
        return None
    ulen = struct.unpack_from(">H", frame, ihl + 4)[0]
    return socket.inet_ntoa(frame[16:20]), dport, bytes(frame[ihl + 8:ihl + ulen])


def is_value(payload: bytes) -> bool:
    """A value-stream datagram (service 0x01-0x1f, sealed or not)."""
    return len(payload) > 3 and 0 < (payload[3] & 0x7F) < 0x20


def is_kv_of(task: int):
    """A predicate: a key-value datagram (0x20-0x3f) of `task`."""
    def pred(payload: bytes) -> bool:
        return (len(payload) >= 16 and 0x20 <= (payload[3] & 0x7F) < 0x40
                and struct.unpack_from(">I", payload, 8)[0] == task)
    return pred


def open_capture(iface: str) -> socket.socket:
    """A packet socket that sees the frames `iface` sends."""
    # Outgoing frames reach a packet socket only when it listens to every
    # protocol (ETH_P_ALL); IPv4 is picked out by the frame's ethertype.
    cap = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))
    cap.bind((iface, 0x0003))
    cap.settimeout(0.2)
    return cap


def _kv_len(payload: bytes) -> int:
    """Length of the key-value datagram at the start of `payload` (docs/kv.md
    §2), trailer included when sealed; 0 if it cannot tell."""
    if len(payload) < 16:
        return 0
    t, slots, n = payload[3] & 0x7F, payload[5], 16
    if t == 0x20:
        n += 8 + 16 * slots
    elif t == 0x21:
        for _ in range(slots):
            if len(payload) < n + 2:
                return 0
            n += 10 + struct.unpack_from(">H", payload, n)[0]
    elif t == 0x28 and len(payload) >= 20:
        n += 12 + 40 * struct.unpack_from(">H", payload, 18)[0]
    elif t in (0x27, 0x2C):
        n += 8
    elif t in (0x29, 0x2A):
        n += 4
    return n + (16 if payload[3] & 0x80 else 0)


def _segments(payload: bytes) -> list:
    """The datagrams of one captured UDP payload. A sender using UDP GSO
    hands the kernel one buffer of equal-sized datagrams (the last may be
    shorter), and a capture on a GSO-capable link sees it whole: key-value
    datagrams carry their length, so they are cut apart again."""
    if len(payload) < 16 or not 0x20 <= (payload[3] & 0x7F) < 0x40:
        return [payload]
    size = _kv_len(payload)
    if size <= 0 or size >= len(payload):
        return [payload]
    return [payload[i:i + size] for i in range(0, len(payload), size)]


def capture(cap: socket.socket, ports: range, count: int, seconds: float, keep=lambda payload: True) -> list:
    """Up to `count` (dst ip, dst port, payload) of the UDP datagrams this host
    sends to `ports` for which `keep(payload)`, within `seconds`."""
    eth_p_ip = 0x0800
    captured = []
    deadline = time.monotonic() + seconds
    while len(captured) < count and time.monotonic() < deadline:
        try:
            frame, addr = cap.recvfrom(70000)
        except socket.timeout:
            continue
        if addr[1] != eth_p_ip or addr[2] != socket.PACKET_OUTGOING:
            continue
        got = _outgoing_udp(frame, ports)
        if not got:
            continue
        for payload in _segments(got[2]):
            if keep(payload) and len(captured) < count:
                captured.append((got[0], got[1], payload))
    return captured


def run_replay(args: argparse.Namespace) -> dict:
    lo, _, hi = args.ports.partition("-")
    ports = range(int(lo), int(hi or lo) + 1)
    cap = open_capture(args.iface)
    if args.ready:
        print(json.dumps({"ready": True}), flush=True)
    keep = is_kv_of(args.kv_task) if args.kv_task is not None else is_value
    captured = capture(cap, ports, args.capture, args.capture_s, keep)
    cap.close()
    time.sleep(args.delay)
    types: Counter = Counter()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for ip, port, payload in captured:
            s.sendto(payload, (ip, port))
            types[payload[3] if len(payload) > 3 else -1] += 1
            time.sleep(0.0005)
    # Sealed value-stream datagrams (bit 0x80 of msg_type, service 0x01-0x1f)
    # must each be recognised by the switch's replay window.
    sealed = sum(n for t, n in types.items() if t >= 0 and t & 0x80 and (t & 0x7F) < 0x20)
    # Sealed key-value datagrams of a keyed task that still runs must each be
    # recognised by the kv program's replay window.
    sealed_kv = sum(n for t, n in types.items() if t >= 0 and t & 0x80 and 0x20 <= (t & 0x7F) < 0x40)
    return {"captured": len(captured), "replayed": len(captured), "sealed_value": sealed, "sealed_kv": sealed_kv,
            "msg_types": {str(k): v for k, v in types.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("garbage")
    g.add_argument("--to", required=True)
    g.add_argument("--count", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("replay")
    r.add_argument("--iface", required=True)
    r.add_argument("--ports", default="9000")
    r.add_argument("--capture", type=int, default=40, help="datagrams to capture")
    r.add_argument("--capture-s", type=float, default=3.0, help="stop capturing after this long")
    r.add_argument("--delay", type=float, default=1.0, help="seconds between capture and replay")
    r.add_argument("--kv-task", type=int, help="replay the key-value datagrams of this task (default: value only)")
    r.add_argument("--ready", action="store_true", help="print a line once capturing")
    k = sub.add_parser("kv-forge")
    k.add_argument("--to", required=True)
    k.add_argument("--task", type=int, required=True, help="the keyed key-value task to attack")
    k.add_argument("--channels", type=int, required=True, help="channels 0..channels-1 are impersonated")
    k.add_argument("--other-key", action="append", default=[],
                   help="a member key of another task (hex), for cross-task injection; repeatable")
    k.add_argument("--count", type=int, default=50)
    k.add_argument("--seed", type=int, default=0)
    f = sub.add_parser("forge")
    f.add_argument("--to", required=True)
    f.add_argument("--job", type=int, required=True, help="the keyed job to attack")
    f.add_argument("--members", type=int, required=True, help="src ids 0..members-1 are impersonated")
    f.add_argument("--other-key", action="append", default=[],
                   help="a member key of another job (hex), for cross-job injection; repeatable")
    f.add_argument("--count", type=int, default=50)
    f.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = {"garbage": run_garbage, "replay": run_replay, "forge": run_forge, "kv-forge": run_kv_forge}[a.what](a)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
