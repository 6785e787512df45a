"""The network-namespace testbed, for real: namespaces, veth links, tbf
limits, the management bridge, the switch daemon inside a namespace and
workers in host namespaces. Needs root; skipped (with the reason) only where
network namespaces cannot be created at all.

Every testbed here is named fbt<something> so that these tests never touch a
testbed someone else has up (the default name is fb)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from fanin import topology
from fanin_bench.testbed import Testbed, TestbedError, down, why_unavailable

_WHY_NOT = why_unavailable("fbt-probe")
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=f"no network namespaces: {_WHY_NOT}")

# Testbed names: fbt + a letter per test + this process's pid in base 36, so
# that two test runs on one machine (two worktrees) never take down each
# other's testbeds.
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_TAG_MOD = 36**4


def _tag(pid: int) -> str:
    n = pid % _TAG_MOD
    return "".join(_B36[n // 36**i % 36] for i in (3, 2, 1, 0))


S, D, F, R, A, X, E, C, P, G, T = (f"fbt{letter}{_tag(os.getpid())}" for letter in "sdfraxecpgt")


@pytest.fixture(scope="module", autouse=True)
def remove_testbeds_of_dead_test_runs():
    """Testbeds left by a test run that was killed: their owner pid is gone."""
    if _WHY_NOT:
        return
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    stale = {m.group(1) for ns in namespaces("fbt") if (m := re.match(r"^(fbt[a-z]([0-9a-z]{4}))-", ns))}
    for name in stale:
        n = int(name[4:], 36)
        if not any(os.path.exists(f"/proc/{pid}") for pid in range(n, pid_max + 1, _TAG_MOD)):
            down(name)


@pytest.fixture
def state_dir(tmp_path):
    return tmp_path


def up(spec, name, state_dir, **kw):
    down(name, state_dir)  # leftovers of an interrupted earlier run
    return Testbed.up(topology.load(spec), name=name, state_dir=state_dir, **kw)


def ping(tb, node, addr):
    r = tb.run(node, ["ping", "-c1", "-W2", addr], check=False)
    assert r.returncode == 0, f"{node} cannot ping {addr}: {r.stdout}{r.stderr}"


def ping_from_root(addr):
    r = subprocess.run(["ping", "-c1", "-W2", addr], capture_output=True, text=True)
    assert r.returncode == 0, f"root namespace cannot ping {addr}: {r.stdout}{r.stderr}"


def namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(prefix)}


def root_links(prefix):
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout)
    return {link["ifname"] for link in links if link["ifname"].startswith(prefix)}


UDP_SEND = """
import socket, sys, time
addr, port, size, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
payload = bytes(size)
sent, t0 = 0, time.perf_counter()
while (count and sent < count) or (not count and time.perf_counter() - t0 < seconds):
    s.sendto(payload, (addr, port))
    sent += 1
print(sent, time.perf_counter() - t0)
"""


def test_star_links_addresses_management_and_byte_counts(state_dir):
    with up("star:2", S, state_dir) as tb:
        assert namespaces(S + "-") == {S + "-s0", S + "-h0", S + "-h1"}
        assert tb.namespace("h0") == S + "-h0"
        for h in ("h0", "h1"):
            # each end of each link is a /30 of its own; the interface exists where the state says
            ifname = tb.interface(h, toward="s0")
            assert len(ifname) <= 15
            show = tb.run(h, ["ip", "-4", "-o", "addr", "show", "dev", ifname]).stdout
            assert f"{tb.addr(h, toward='s0')}/30" in show
            ping(tb, h, tb.addr("s0", toward=h))          # host reaches its switch
            ping(tb, "s0", tb.addr(h, toward="s0"))        # and back
            ping_from_root(tb.mgmt_addr(h))                # management from the root namespace
        ping_from_root(tb.mgmt_addr("s0"))
        ping(tb, "h0", tb.mgmt_addr())                     # workers reach a controller in the root namespace

        # byte counters: 100 datagrams of 1000 bytes = 100 frames of 1042 bytes (UDP 8 + IP 20 + Ethernet 14)
        before = tb.link_bytes("h0", "s0")
        tb.run("h0", [sys.executable, "-c", UDP_SEND, tb.addr("s0", toward="h0"), "9", "1000", "100", "0"])
        after = tb.link_bytes("h0", "s0")
        sent = after.a_to_b - before.a_to_b
        assert 100 * 1042 <= sent < 100 * 1042 + 2000, sent   # + an ARP exchange at most
        # back: only ARP and a few (rate-limited) ICMP port-unreachable replies, ~590 bytes each
        assert after.b_to_a - before.b_to_a < 10_000
        # Reversing the arguments reverses the directions.
        assert tb.link_bytes("s0", "h0").b_to_a >= after.a_to_b


# One UDP_SEGMENT send of `count` segments of 1000 bytes from the host, and a
# receiver with UDP_GRO in the switch namespace that reports the size of each
# read and its GRO segment size (0: the read is one datagram).
GSO_SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_UDP, 103, 1000)  # UDP_SEGMENT
s.sendto(bytes(1000 * int(sys.argv[3])), (sys.argv[1], int(sys.argv[2])))
"""
GRO_RECV = """
import json, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(5)
print("ready", flush=True)
reads, total = [], 0
while total < int(sys.argv[2]):
    data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(4))
    seg = next((struct.unpack("=i", d[:4])[0] for lvl, typ, d in anc if lvl == socket.SOL_UDP and typ == 104), 0)
    reads.append([len(data), seg])
    total += len(data)
print(json.dumps(reads))
"""


@pytest.mark.parametrize("gro", [False, True])
def test_receive_offload_coalesces_frames_and_bytes_stay_per_frame(state_dir, gro):
    """gro=True: frames a host sent together (here one GSO send of 20
    segments, as fanin's workers send) reach a UDP_GRO socket in fewer,
    coalesced reads, as behind a real NIC; every link counter still counts
    20 frames of 1042 bytes. gro=False (the default): one read per frame."""
    with up("star:1", G, state_dir, gro=gro) as tb:
        assert tb.state["gro"] is gro and tb.state["offloads"].endswith("on" if gro else "off")
        features = tb.run("s0", ["ethtool", "-k", tb.interface("s0", toward="h0")]).stdout
        assert f"generic-receive-offload: {'on' if gro else 'off'}" in features
        rx = tb.popen("s0", [sys.executable, "-c", GRO_RECV, "9999", "20000"], stdout=subprocess.PIPE, text=True)
        try:
            assert rx.stdout.readline().strip() == "ready"
            ping(tb, "h0", tb.addr("s0", toward="h0"))  # ARP resolved before counting
            before = tb.link_bytes("h0", "s0")
            tb.run("h0", [sys.executable, "-c", GSO_SEND, tb.addr("s0", toward="h0"), "9999", "20"])
            reads = json.loads(rx.stdout.readline())
            sent = tb.link_bytes("h0", "s0").a_to_b - before.a_to_b
        finally:
            rx.kill()
            rx.wait()
        assert sum(n for n, _ in reads) == 20_000
        if gro:
            assert len(reads) < 20 and any(seg == 1000 and n > 1000 for n, seg in reads), reads
        else:
            assert reads == [[1000, 0]] * 20, reads
        # 20 frames of 1042 bytes (UDP 8 + IP 20 + Ethernet 14), and at most
        # a stray frame or two of the namespace's own (IPv6 neighbour talk)
        assert 20 * 1042 <= sent < 20 * 1042 + 600, sent


def test_deep_tree_switch_to_switch(state_dir):
    with up("deep-tree:2,2", D, state_dir) as tb:
        topo = tb.topology
        assert len(namespaces(D + "-")) == len(topo.nodes) == 5
        for link in topo.links:
            ping(tb, link.a, tb.addr(link.b, toward=link.a))
        # data addresses are connected routes only: a host does not reach a switch two hops away
        r = tb.run("h0", ["ping", "-c1", "-W1", tb.addr("s0", toward="s1_0")], check=False)
        assert r.returncode != 0
        # a daemon on every switch; each control API answers from the root namespace
        from fanin.control.client import ControlClient

        daemons = tb.switches()
        assert sorted(daemons) == ["s0", "s1_0", "s1_1"]
        for node, sw in daemons.items():
            with ControlClient(sw.control_addr) as ctl:
                assert ctl.info()["api_version"] == "v1"


def test_static_routing_along_shortest_paths(state_dir):
    """routing=True: hosts reach every node over shortest paths; the switches
    on the way forward in the kernel (transit bytes appear on their links),
    and a host daemon receives what is sent to its address from afar."""
    with up("leaf-spine:1,2,2", P, state_dir, routing=True) as tb:
        assert tb.state["routing"]
        # h0_0 (leaf0) -> h1_1 (leaf1): via leaf0, spine0, leaf1
        far = tb.reach_addr("h1_1", "h0_0")
        assert far == tb.addr("h1_1", toward="leaf1")
        ping(tb, "h0_0", far)
        # a switch two hops away: its address on the link toward the next hop to the source
        assert tb.reach_addr("spine0", "h0_0") == tb.addr("spine0", toward="leaf0")
        ping(tb, "h0_0", tb.reach_addr("spine0", "h0_0"))
        ping(tb, "h0_0", tb.reach_addr("leaf1", "h0_0"))
        for host in tb.topology.workers():      # every host reaches every node
            for other in tb.topology.nodes:
                if other != host:
                    ping(tb, host, tb.reach_addr(other, host))
        # 100 datagrams h0_0 -> h1_1 cross spine0 -> leaf1 (transit) and arrive
        before = tb.link_bytes("spine0", "leaf1").a_to_b
        tb.run("h0_0", [sys.executable, "-c", UDP_SEND, far, "9", "1000", "100", "0"])
        assert tb.link_bytes("spine0", "leaf1").a_to_b - before >= 100 * 1042
        # the daemon on a host (a host aggregator) answers a worker two switches away
        from fanin.switch import job_config

        tb.host_aggregator("h1_1", jobs=[job_config(1, members=[0])])
        code = ("import numpy as np, fanin, sys; s = fanin.Session(sys.argv[1], 1, 0, elems_per_packet=64, "
                "rto_ms=5, rto_min_ms=2); x = np.arange(1000, dtype=np.int32); "
                "assert (s.allreduce(x) == x).all(); print('ok')")
        r = tb.run("h0_0", [sys.executable, "-c", code, f"{far}:{tb.SWITCH_DATA_PORT}"], check=False)
        assert r.stdout.strip() == "ok", r.stderr
    with up("leaf-spine:1,2,2", P, state_dir) as tb:
        # without routing: connected subnets only, as before
        r = tb.run("h0_0", ["ping", "-c1", "-W1", tb.addr("h1_1", toward="leaf1")], check=False)
        assert r.returncode != 0


def test_fat_tree_4_thesis_topology(state_dir):
    t0 = time.monotonic()
    with up("fat-tree:4", F, state_dir, rate_mbit=1000) as tb:
        built = time.monotonic() - t0
        topo = tb.topology
        assert (len(topo.switches), len(topo.hosts), len(topo.links)) == (20, 16, 48)
        assert len(namespaces(F + "-")) == 36
        assert len(root_links(F + "-m")) == 36
        for h in topo.workers():
            ping(tb, h, tb.addr(topo.attachment(h), toward=h))
        for link in topo.links[:4]:  # a few switch-switch links (core-agg)
            ping(tb, link.a, tb.addr(link.b, toward=link.a))
        ping_from_root(tb.mgmt_addr("core0"))
        ping_from_root(tb.mgmt_addr("h3_1_1"))
        qdisc = tb.run("edge0_0", ["tc", "qdisc", "show", "dev", tb.interface("edge0_0", toward="h0_0_0")]).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc, qdisc
        # the state file lets another process attach; leaving its `with` does not take the testbed down
        with Testbed.attach(F, state_dir) as again:
            assert again.addr("core0", toward="agg0_0") == tb.addr("core0", toward="agg0_0")
        assert len(namespaces(F + "-")) == 36
    assert built < 20, f"fat-tree:4 took {built:.1f} s to build"
    assert not namespaces(F + "-") and not root_links(F + "-")


def test_tbf_limits_throughput(state_dir):
    with up("star:1", R, state_dir, rate_mbit=20) as tb:
        before = tb.link_bytes("h0", "s0")
        out = tb.run("h0", [sys.executable, "-c", UDP_SEND, tb.addr("s0", toward="h0"), "9", "1400", "0", "1.5"]).stdout
        sent, seconds = out.split()
        passed = tb.link_bytes("h0", "s0").a_to_b - before.a_to_b
        mbit = passed * 8 / float(seconds) / 1e6
        # tbf counts whole frames; the bucket (16 KiB) adds < 0.1 Mbit/s over 1.5 s
        assert 16 <= mbit <= 22, f"{mbit:.1f} Mbit/s through a 20 Mbit/s link ({sent} datagrams offered)"


WORKER = """
import hashlib, json, sys
import fanin
from fanin.proc import check_result, worker_inputs
addr, rank, workers, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = fanin.Session(addr, 1, rank, join_timeout_s=10)
y = s.allreduce(worker_inputs(rank, n, "float32"))
print(json.dumps({"ok": check_result(y, workers, "float32", s.elems_per_packet)["ok"], "digest": hashlib.sha256(y.tobytes()).hexdigest()}))
"""


def test_allreduce_switch_daemon_and_workers_in_namespaces(state_dir):
    from fanin.control.client import ControlClient

    n = 100_000
    with up("star:2", A, state_dir) as tb:
        sw = tb.switch("s0")
        assert sw.control_addr == f"{tb.mgmt_addr('s0')}:{tb.SWITCH_CONTROL_PORT}"
        # a controller in the root namespace programs the switch over the management network
        with ControlClient(sw.control_addr) as ctl:
            ctl.admit_job(1, members=[0, 1])
            assert [j["job_id"] for j in ctl.list_jobs()] == [1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        workers = [tb.popen(h, [sys.executable, "-c", WORKER, f"{tb.addr('s0', toward=h)}:{tb.SWITCH_DATA_PORT}",
                                str(rank), "2", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
                   for rank, h in enumerate(("h0", "h1"))]
        reports = []
        for p in workers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            reports.append(json.loads(out))
        assert all(r["ok"] for r in reports), reports
        assert reports[0]["digest"] == reports[1]["digest"]
        # the data really crossed the veth links: 4 bytes per element up, and the result back down
        for h in ("h0", "h1"):
            up_bytes, down_bytes = tb.link_bytes(h, "s0")
            assert up_bytes >= 4 * n and down_bytes >= 4 * n, (h, up_bytes, down_bytes)
        assert sw.counters()["blocks_completed"] >= n // 1024  # metrics from the root namespace too


def test_down_removes_everything_even_without_state_file(state_dir):
    tb = up("star:2", X, state_dir)
    started = tb.popen("h0", ["sleep", "300"])
    # a process started behind the testbed's back, in one of its namespaces
    stray = subprocess.Popen(["ip", "netns", "exec", tb.namespace("s0"), "sleep", "300"])
    (state_dir / f"testbed-{X}.json").unlink()
    removed = down(X, state_dir)
    assert removed["namespaces"] == 3 and removed["processes"] >= 2
    assert started.wait(timeout=5) is not None and stray.wait(timeout=5) is not None
    assert not namespaces(X + "-") and not root_links(X + "-")
    assert down(X, state_dir) == {"processes": 0, "namespaces": 0, "root_links": 0}  # idempotent
    tb.down()  # and through the object as well


_HOLD_A_TESTBED = """
import sys, time
from contextlib import ExitStack
from fanin import topology
from fanin_bench.testbed import Testbed
with ExitStack() as stack:
    tb = stack.enter_context(Testbed.up(topology.load("star:2"), name=sys.argv[1], state_dir=sys.argv[2]))
    worker = tb.popen("h0", ["sleep", "300"])
    print("up", worker.pid, flush=True)
    time.sleep(300)
"""


def test_a_bench_stopped_by_sigterm_takes_its_testbed_down(state_dir):
    # `timeout 900 fanin bench goat-train` left its namespaces and 28 worker
    # processes behind: SIGTERM ended the process without unwinding the
    # ExitStack that takes the testbed down (only `bench network` had a handler)
    down(T, state_dir)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_TESTBED, T, str(state_dir)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        word, pid = holder.stdout.readline().split()
        assert word == "up" and namespaces(T + "-")
        holder.terminate()
        assert holder.wait(timeout=30) == 143
        assert not namespaces(T + "-") and not root_links(T + "-")
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # reaped by init once orphaned
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), "the testbed's worker process outlived it"
    finally:
        holder.kill()
        down(T, state_dir)


def test_clear_errors(state_dir, monkeypatch):
    with up("star:1", E, state_dir) as tb:
        with pytest.raises(TestbedError, match="already up"):
            Testbed.up(topology.load("star:1"), name=E, state_dir=state_dir)
        with pytest.raises(TestbedError, match="no link between 'h0' and 'nowhere'"):
            tb.addr("h0", toward="nowhere")
        with pytest.raises(TestbedError, match="no node 'x'"):
            tb.namespace("x")
    with pytest.raises(TestbedError, match="testbed name 'fb-1' is invalid"):
        Testbed.up(topology.load("star:1"), name="fb-1", state_dir=state_dir)
    with pytest.raises(TestbedError, match="no testbed named 'fbtnone' is up"):
        Testbed.attach("fbtnone", state_dir)
    bad = topology.Topology("bad", [topology.Switch("s0")], [topology.Host("h0")], [])
    with pytest.raises(topology.TopologyError, match="host h0 has 0 links"):
        Testbed.up(bad, name=E, state_dir=state_dir)
    import fanin_bench.testbed as testbed_mod
    monkeypatch.setattr(testbed_mod, "_effective_caps", lambda: 0)
    with pytest.raises(TestbedError, match="needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN missing"):
        Testbed.up(topology.load("star:1"), name=E, state_dir=state_dir)
    assert not namespaces(E + "-")


def test_cli_up_status_exec_down(tmp_path):
    env = {**os.environ, "FANIN_TESTBED_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fanin", "testbed", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    cli("down", "--name", C)
    r = cli("up", "star:1", "--name", C, "--rate-mbit", "100", "--json")
    assert r.returncode == 0, r.stderr
    state = json.loads(r.stdout)
    assert state["links"][0]["rate_mbit"] == 100 and state["missing_namespaces"] == []
    r = cli("up", "star:1", "--name", C)
    assert r.returncode == 1 and "already up" in r.stderr
    r = cli("status", "--name", C)
    assert r.returncode == 0 and C + "-h0" in r.stdout, r.stderr
    r = cli("exec", "--name", C, "h0", "--", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
    assert r.returncode == 0 and state["links"][0]["a_addr"] in r.stdout, r.stdout + r.stderr
    r = cli("down", "--name", C)
    assert r.returncode == 0 and "2 namespaces" in r.stdout, r.stdout + r.stderr
    assert not namespaces(C + "-")
    r = cli("up", "no-such-file.toml", "--name", C)
    assert r.returncode == 1 and "no such file" in r.stderr


T = f"fbtt{_tag(os.getpid())}"


def test_controller_builds_a_three_level_tree_on_a_fat_tree_and_traffic_shrinks_upward():
    """The thesis topology: 4 workers in two pods of a fat-tree k=4; the
    controller roots the tree at a core switch (3 levels), the real daemons
    aggregate on the way up, every worker checks its exact sum, and the
    core root receives two partial streams instead of four."""
    from contextlib import ExitStack

    from fanin_bench.bench.trees import TestbedJob

    topo = topology.fat_tree(4)
    hosts = {0: "h0_0_0", 1: "h0_1_0", 2: "h1_0_0", 3: "h1_1_1"}
    with ExitStack() as stack:
        job = TestbedJob(stack, "fat-tree", T, topo, controller=True, rate_mbit=None, workers=hosts,
                         elements=64 * 1024, epp=1024, window=32, send_drop=0.0, recv_drop=0.0, seed=1)
        stack.callback(job.stop)
        assert job.tree["levels"] == 3 and job.tree["root"].startswith("core")
        root = job.tree["root"]
        into_root = lambda: sum(job.tb.link_bytes(c, root).a_to_b
                                for c, p in job.tree["parent"].items() if p == root)
        from_workers = lambda: sum(job.tb.link_bytes(h, topo.attachment(h)).a_to_b for h in hosts.values())
        root0, workers0 = into_root(), from_workers()
        for _ in range(3):
            job.run_once()  # raises unless every worker's sum is exact
        into, sent = into_root() - root0, from_workers() - workers0
        # two pods send one partial stream each: half of what the workers sent
        assert 0.4 * sent < into < 0.6 * sent, (into, sent)
