"""A UDP relay between one worker and a switch that can drop what the
switch sends it, for tests that need a member left without results, or
mark what it forwards ECN Congestion Experienced, as a queue on the path
would instead of dropping it."""

import socket
import struct
import threading


class ResultEater:
    """A UDP relay between one worker and the switch's shard 0 that can
    drop the switch's Result datagrams to that worker: its results are
    lost on the way while its contributions still arrive (the only way a
    real run leaves one member without results the others already have)."""

    RESULT = 0x03  # fanin_wire::MessageType::Result, byte 3 of the preamble...
    SEALED = 0x80  # ...with this bit set in a keyed job (fanin_wire::auth::SEALED)

    CE = 0b11  # the IP header's ECN field: Congestion Experienced (RFC 3168)

    def __init__(self, switch_addr: str, *, ce_up: bool = False, ce_down: bool = False) -> None:
        host, port = switch_addr.rsplit(":", 1)
        self._switch = (host, int(port))
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the worker's "switch"
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the switch's "worker"
        self.back.bind(("127.0.0.1", 0))
        for s in (self.front, self.back):
            s.settimeout(0.05)
            # room for a window of datagrams while this thread catches up
            # (a relay that dropped them would make losses of its own)
            try:
                s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
            except OSError:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        # what the relay forwards leaves CE-marked: to the switch (the
        # worker's uplink marked it) or to the worker (its downlink did)
        self._ce_up, self._ce_down = ce_up, ce_down
        # ECN codepoints of what it relayed: up, and of the switch's results
        self.codepoints_up: dict = {}
        self.codepoints_down: dict = {}
        self.eat_results = False
        self.eaten = 0
        self._worker = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(self.front, True), daemon=True),
                         threading.Thread(target=self._run, args=(self.back, False), daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def addr(self) -> str:
        return "127.0.0.1:%d" % self.front.getsockname()[1]

    def _run(self, sock: socket.socket, from_worker: bool) -> None:
        # ECN-transparent, as a router is: each datagram goes on with the
        # codepoint it came with, unless this relay marks it CE
        mark = self._ce_up if from_worker else self._ce_down
        seen = self.codepoints_up if from_worker else self.codepoints_down
        while not self._stop.is_set():
            try:
                data, anc, _, src = sock.recvmsg(65536, socket.CMSG_SPACE(4))
            except (socket.timeout, OSError):
                continue
            codepoint = next((c[0] & 3 for lvl, typ, c in anc
                              if lvl == socket.IPPROTO_IP and typ == socket.IP_TOS and c), 0)
            tos = [(socket.IPPROTO_IP, socket.IP_TOS, struct.pack("i", self.CE if mark else codepoint))]
            try:
                if from_worker:
                    self._worker = src
                    seen[codepoint] = seen.get(codepoint, 0) + 1
                    self.back.sendmsg([data], tos, 0, self._switch)
                elif self._worker is not None:
                    if len(data) > 3 and data[3] & ~self.SEALED == self.RESULT:
                        seen[codepoint] = seen.get(codepoint, 0) + 1
                        if self.eat_results:
                            self.eaten += 1
                            continue
                    self.front.sendmsg([data], tos, 0, self._worker)
            except OSError:
                pass  # the switch is down: its port is closed

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        self.front.close()
        self.back.close()


def one_member_left_behind(addrs, restart, *, linger, session_kw=None):
    """Two ranks of job 1 (a Session each, on a thread of its own: a
    Session belongs to the thread that made it) run two allreduces of 8
    blocks of 256 int32; rank 1 reaches its switch (`addrs[1]`) through a
    ResultEater that drops its results of the second one, so rank 0
    finishes it while rank 1 lacks them all. Then `restart()` restarts
    switches (returning once they are ready) and the results flow again;
    rank 0 lingers meanwhile if `linger`. Returns rank 1's outcome of the
    second allreduce (the array, or the exception it raised), the expected
    sum, rank 0's linger report (None without) and the seconds from
    `restart()` returning to rank 1's outcome."""
    import time

    import numpy as np

    import fanin

    kw = dict(elems_per_packet=256, window=64, dead_after_s=4.0, switch_gone_after_s=30.0)
    per_rank = session_kw or [{}, {}]  # e.g. each rank's auth_key
    relay = ResultEater(addrs[1])
    # 8 blocks: rank 1 sends all of its last allreduce without a result
    inputs = [[np.arange(2048, dtype=np.int32) * (r + 1) + it for r in range(2)] for it in range(2)]
    want = [x[0] + x[1] for x in inputs]
    first_done = [threading.Event(), threading.Event()]
    go_last, a_done, b_done, everyone_done = (threading.Event() for _ in range(4))
    out: dict = {}

    def rank(r: int, addr: str) -> None:
        try:
            s = fanin.Session(addr, 1, r, **{**kw, **per_rank[r]})
            out[r, 0] = s.allreduce(inputs[0][r])
            first_done[r].set()
            go_last.wait(30)
            try:
                out[r, 1] = s.allreduce(inputs[1][r])
            except Exception as e:  # the outcome under test (its traceback
                out[r, 1] = e.with_traceback(None)  # would keep `s` alive off its thread)
            (a_done if r == 0 else b_done).set()
            if r == 0 and linger:
                out["lingered"] = s.linger(60.0, until=everyone_done.is_set)
            everyone_done.wait(90)
            del s  # on the thread that made it
        except Exception as e:
            out[r, "error"] = repr(e)
        finally:
            first_done[r].set()
            (a_done if r == 0 else b_done).set()

    threads = [threading.Thread(target=rank, args=(0, addrs[0])), threading.Thread(target=rank, args=(1, relay.addr))]
    try:
        for t in threads:
            t.start()
        for e in first_done:
            assert e.wait(30)
        relay.eat_results = True
        go_last.set()
        assert a_done.wait(30)
        deadline = time.time() + 10  # the relay's thread may not have read them yet
        while relay.eaten == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert not b_done.is_set() and relay.eaten > 0, (
            f"rank 1 must lack results of its last allreduce: eaten {relay.eaten}, "
            f"rank 1 {out.get((1, 1), out.get((1, 'error')))!r}")
        restart()
        ready_at = time.time()
        relay.eat_results = False
        assert b_done.wait(60)
        took_s = time.time() - ready_at
    finally:
        everyone_done.set()
        for t in threads:
            t.join(30)
        relay.close()
    errors = {k: v for k, v in out.items() if k[1] == "error"}
    assert not errors, errors
    for r in range(2):
        np.testing.assert_array_equal(out[r, 0], want[0])
    np.testing.assert_array_equal(out[0, 1], want[1])
    return out[1, 1], want[1], out.get("lingered"), took_s
