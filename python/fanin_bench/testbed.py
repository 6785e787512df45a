"""The network-namespace testbed: a topology built from real Linux network
namespaces, veth links and (optionally) tc tbf rate limits.

Every node of a :mod:`fanin.topology` (switch or host) gets its own network
namespace ``<name>-<node>``; every topology link becomes one veth pair with
a point-to-point /30 subnet; a Linux bridge ``<name>-br`` in the root
namespace plus one veth into every namespace forms the management network,
over which a controller in the root namespace reaches every switch's control
API. What is recorded (addresses, interface names) is kept in a JSON state
file so that ``fanin testbed status|exec|down`` and :meth:`Testbed.attach`
find it again. docs/testbed.md has the addressing plan and what is and is not
emulated.

Example::

    from fanin import topology
    from fanin_bench.testbed import Testbed
    with Testbed.up(topology.load("star:2"), name="demo", rate_mbit=1000) as tb:
        sw = tb.switch("s0", jobs=[job_config(1, 2)])          # the real daemon in s0's namespace
        data = f"{tb.addr('s0', toward='h0')}:{tb.SWITCH_DATA_PORT}"
        p = tb.popen("h0", ["python3", "-c", "..."])           # a worker inside h0's namespace
        print(tb.link_bytes("h0", "s0"))
    # namespaces, veths, bridge and every process started inside are gone here

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; ethtool is used
when present to turn off segmentation offloads (see ``_SEND_OFFLOADS``) and
to set receive offload (GRO: off unless ``gro=True``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from fanin.topology import Topology

__all__ = [
    "Testbed",
    "TestbedError",
    "LinkBytes",
    "DEFAULT_NAME",
    "STATE_DIR",
    "down",
    "check_privileges",
    "why_unavailable",
    "list_testbeds",
]

DEFAULT_NAME = "fb"
STATE_DIR = Path(os.environ.get("FANIN_TESTBED_DIR", "/run/fanin"))

# A testbed name becomes the prefix of every namespace ("<name>-<node>") and of
# every root-namespace interface ("<name>-br", "<name>-m<i>"), so it must be
# short (IFNAMSIZ is 16 with the NUL) and free of '-' (then "<name>-" can only
# ever match this testbed's objects, never those of a testbed "<name>-x").
_TESTBED_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")

# Data links: one /30 per topology link, carved in link order out of this
# range. It exists only inside the namespaces, so every testbed reuses it.
_DATA_NET = ipaddress.ip_network("10.1.0.0/16")
# Management networks: one /16 per testbed out of 10.200.0.0-10.249.0.0, the
# first free one from a start derived from the name (the root namespace sees
# these, so two testbeds must not share one).
_MGMT_FIRST, _MGMT_COUNT = 200, 50

# Segmentation offloads make a veth hand the qdisc and the byte counters one
# 64 KB super-packet instead of MTU-sized frames: tbf then releases bursts far
# larger than its bucket (or has to re-segment), and /sys statistics count one
# header per super-packet. Turned off on every data interface so a link
# behaves, and is counted, like a wire carrying 1500-byte frames.
_SEND_OFFLOADS = ["tso", "off", "gso", "off", "tx-udp-segmentation", "off"]
# Receive offload (GRO) acts after a link's tbf and counters, where a real
# NIC's driver coalesces the frames of a flow that arrive together into one
# packet for the stack: off by default (as the figures so far were measured),
# on with `gro=True`. On, a veth delivers through NAPI, which also counts a
# frame's bytes without its Ethernet header (`Testbed._tx_bytes` adds it).
_ETH_HLEN = 14


def _offloads(gro: bool) -> list[str]:
    return _SEND_OFFLOADS + ["gro", "on" if gro else "off"]


class TestbedError(RuntimeError):
    """The testbed cannot be built, found or used; the message says why and what to do."""

    __test__ = False  # not a pytest test class despite the name


class LinkBytes(NamedTuple):
    """Bytes that left each end of one veth link (the sender's tx counter)."""

    a_to_b: int
    b_to_a: int


@dataclass(frozen=True)
class _End:
    node: str
    ifname: str
    addr: str


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> None:
    """Raise TestbedError unless this process may create namespaces and links."""
    caps = _effective_caps()
    missing = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if missing:
        raise TestbedError(f"the testbed needs root: {' and '.join(missing)} missing (creating network namespaces "
                           "and veth links is privileged); run as root, e.g. with sudo")
    if not shutil.which("ip"):
        raise TestbedError("iproute2 (`ip`) is not installed: apt-get install iproute2 (scripts/setup.sh does this)")


def why_unavailable(probe: str = "fbprobe") -> str:
    """Why network namespaces cannot be used here ('' when they can): the
    privilege check, then creating and deleting a namespace ``<probe><pid>``.
    Tests skip with this reason."""
    try:
        check_privileges()
    except TestbedError as e:
        return str(e)
    ns = f"{probe}{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return "" if r.returncode == 0 else f"`ip netns add` fails here: {r.stderr.strip()}"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _TESTBED_NAME.match(name):
        raise TestbedError(f"testbed name {name!r} is invalid: 1-8 characters, a lower-case letter first, then "
                           "lower-case letters or digits (it prefixes namespace and interface names)")
    return name


def _state_path(name: str, state_dir: Optional[Path] = None) -> Path:
    return Path(state_dir or STATE_DIR) / f"testbed-{name}.json"


def _sh(argv: Sequence[str], *, stdin: Optional[str] = None, check: bool = True,
        timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        what = " ".join(argv) + (f" (batch starting {stdin.splitlines()[0]!r})" if stdin else "")
        raise TestbedError(f"{what} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _ip_batch(lines: Iterable[str], netns: Optional[str] = None, force: bool = False) -> None:
    """Many ip commands in one process: a fat-tree needs hundreds."""
    text = "\n".join(lines)
    if not text:
        return
    argv = ["ip"] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    _sh(argv, stdin=text + "\n", check=not force)


def _our_namespaces(name: str) -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    prefix = f"{name}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _our_root_links(name: str) -> list[str]:
    r = _sh(["ip", "-j", "link", "show"], check=False)
    try:
        links = json.loads(r.stdout or "[]")
    except json.JSONDecodeError:
        return []
    pat = re.compile(rf"^{re.escape(name)}-(br|m\d+)$")
    return [link["ifname"] for link in links if pat.match(link.get("ifname", ""))]


def _pick_mgmt_net(name: str) -> ipaddress.IPv4Network:
    used = []
    r = _sh(["ip", "-j", "-4", "route", "show", "table", "all"], check=False)
    try:
        for route in json.loads(r.stdout or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default":
                used.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
    except (json.JSONDecodeError, ValueError):
        pass
    start = zlib.crc32(name.encode()) % _MGMT_COUNT
    for k in range(_MGMT_COUNT):
        net = ipaddress.ip_network(f"10.{_MGMT_FIRST + (start + k) % _MGMT_COUNT}.0.0/16")
        if not any(net.overlaps(u) for u in used):
            return net
    raise TestbedError(f"no free management /16 in 10.{_MGMT_FIRST}.0.0-10.{_MGMT_FIRST + _MGMT_COUNT - 1}.0.0 "
                       "(too many testbeds up? see `fanin testbed status`)")


def _tbf(ifname: str, rate_mbit: float, queue_ms: float = 20.0) -> str:
    """A tc batch line that limits egress of `ifname` to `rate_mbit`.

    burst: the bucket must hold at least one full frame, and enough for the
    timer that refills it not to become the limit; 1 ms worth of the rate, at
    least 16 KiB (~10 frames), keeps short bursts faithful without letting a
    long blast exceed the rate measurably (16 KiB is 0.1 s at 1.3 Mbit/s).
    latency: how long a packet may wait in the queue before tbf drops it,
    i.e. the switch port's buffer: 20 ms is a shallow-buffered datacenter
    port at these rates (2.5 MB at 1 Gbit/s), so an overloaded link drops
    instead of building seconds of delay.
    """
    burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
    return f"qdisc replace dev {ifname} root tbf rate {rate_mbit:g}mbit burst {burst} latency {queue_ms:g}ms"


class Testbed:
    """A testbed that is up: names, addresses and helpers to run things inside.

    Create one with :meth:`up` (builds it) or :meth:`attach` (finds one that
    `fanin testbed up` built). Used as a context manager it is taken down on
    exit, exceptions included; :meth:`attach` ed testbeds are left up unless
    ``down()`` is called.
    """

    __test__ = False  # not a pytest test class despite the name

    SWITCH_DATA_PORT = 9000
    SWITCH_CONTROL_PORT = 9100
    SWITCH_METRICS_PORT = 9101

    def __init__(self, state: dict[str, Any], state_dir: Optional[Path] = None, owned: bool = False) -> None:
        self.state = state
        self.name: str = state["name"]
        self.topology = Topology.from_dict(state["topology"], source=f"testbed {self.name}")
        self._state_dir = state_dir
        self._owned = owned
        self._procs: list[subprocess.Popen] = []
        self._switches: list[Any] = []  # SwitchProcess: stop() also removes its config file
        self._ends: dict[tuple[str, str], tuple[_End, _End]] = {}
        for link in state["links"]:
            a = _End(link["a"], link["a_if"], link["a_addr"])
            b = _End(link["b"], link["b_if"], link["b_addr"])
            self._ends[(a.node, b.node)] = (a, b)
            self._ends[(b.node, a.node)] = (b, a)

    # -- life cycle ------------------------------------------------------------------

    @classmethod
    def up(cls, topology: Topology, *, name: str = DEFAULT_NAME, rate_mbit: Optional[float] = None,
           state_dir: Optional[Path] = None, routing: bool = False, mtu: Optional[int] = None,
           gro: bool = False) -> "Testbed":
        """Build `topology` as namespaces and veth links and return it.

        ``rate_mbit`` overrides every link's own ``rate_mbit`` (None: use the
        links' values; a link without one is unlimited). ``routing`` also
        installs static routes along shortest paths (:meth:`enable_routing`).
        ``mtu`` sets every interface of the testbed (data links and the
        management network) to that MTU, e.g. 9000 for jumbo frames (None:
        the veth default, 1500); the daemons and workers learn it from their
        interfaces, nothing else needs telling. ``gro`` turns on receive
        offload on every data interface (needs ethtool): the frames of a
        flow that one receive pass finds are coalesced into one packet for
        the stack, as a real NIC's driver does; links, rates and counters
        stay per frame (docs/testbed.md).
        Raises TestbedError
        when not privileged or when a testbed called `name` is already up, and
        TopologyError for an unsound topology. On any failure everything
        created so far is removed again.
        """
        _check_name(name)
        check_privileges()
        topology.validate()
        unwind_on_sigterm()
        if rate_mbit is not None and not rate_mbit > 0:
            raise TestbedError(f"rate_mbit {rate_mbit} must be > 0 (or absent for the links' own rates)")
        if mtu is not None and not 1280 <= mtu <= 65535:
            raise TestbedError(f"mtu {mtu} must be between 1280 (IPv6's minimum) and 65535; 9000 gives jumbo frames")
        path = _state_path(name, state_dir)
        leftovers = _our_namespaces(name) + _our_root_links(name)
        if path.exists() or leftovers:
            raise TestbedError(f"a testbed named {name!r} is already up ({path if path.exists() else ''} "
                               f"{len(leftovers)} namespaces/links with prefix '{name}-'); take it down first with "
                               f"`fanin testbed down --name {name}`, or choose another --name")
        state = _plan(topology, name, rate_mbit)
        state["mtu"] = mtu
        state["gro"] = bool(gro)
        if gro and not shutil.which("ethtool"):
            raise TestbedError("gro=True needs ethtool to turn receive offload on (apt-get install ethtool)")
        try:
            _build(state)
            if routing:
                _build_routes(state)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1) + "\n")
            tmp.replace(path)
        except BaseException:
            down(name, state_dir)
            raise
        return cls(state, state_dir, owned=True)

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME, state_dir: Optional[Path] = None) -> "Testbed":
        """The testbed `name` that is already up (from its state file)."""
        _check_name(name)
        path = _state_path(name, state_dir)
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed named {name!r} is up (no {path}); start one with "
                               f"`fanin testbed up TOPOLOGY --name {name}`") from None
        except json.JSONDecodeError as e:
            raise TestbedError(f"{path} is corrupt ({e}); `fanin testbed down --name {name}` still cleans up") from None
        return cls(state, state_dir)

    def stop_processes(self) -> None:
        """Stop the switches and processes started through this object."""
        for sw in self._switches:
            sw.stop()
        for p in self._procs:
            _stop(p)
        self._switches.clear()
        self._procs.clear()

    def down(self) -> None:
        """Stop processes started inside, remove namespaces, links, bridge and state file."""
        self.stop_processes()
        down(self.name, self._state_dir)

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc: object) -> None:
        # What `up` built goes down; an attached testbed belongs to whoever
        # ran `fanin testbed up`, so only our own processes are stopped.
        if self._owned:
            self.down()
        else:
            self.stop_processes()

    # -- names and addresses ---------------------------------------------------------

    def _node(self, node: str) -> dict[str, Any]:
        try:
            return self.state["nodes"][node]
        except KeyError:
            raise TestbedError(f"no node {node!r} in testbed {self.name} "
                               f"(nodes: {', '.join(self.state['nodes'])})") from None

    def _link_ends(self, node: str, toward: str) -> tuple[_End, _End]:
        self._node(node)
        try:
            return self._ends[(node, toward)]
        except KeyError:
            raise TestbedError(f"no link between {node!r} and {toward!r} in testbed {self.name} "
                               f"({node}'s neighbours: {', '.join(self.topology.neighbours(node))})") from None

    def namespace(self, node: str) -> str:
        """The network namespace of `node` (for `ip netns exec`)."""
        return self._node(node)["netns"]

    def interface(self, node: str, toward: str) -> str:
        """The interface name inside `node`'s namespace on its link to `toward`."""
        return self._link_ends(node, toward)[0].ifname

    def addr(self, node: str, toward: str) -> str:
        """The IPv4 address of `node` on its link to `toward` (what `toward` sends to)."""
        return self._link_ends(node, toward)[0].addr

    def mgmt_addr(self, node: Optional[str] = None) -> str:
        """The management address of `node`, or of the root namespace (the bridge) when None."""
        return self.state["root_mgmt_addr"] if node is None else self._node(node)["mgmt_addr"]

    def reach_addr(self, node: str, source: str) -> str:
        """The address `source` sends to in order to reach `node`: `node`'s
        address on its link toward `source` when they are neighbours,
        otherwise on its link toward the next hop of the shortest path to
        `source` (the path the routes of :meth:`enable_routing` take back,
        so a reply leaves from the address that was addressed). Two hops or
        more away this needs routing."""
        if source in self.topology.neighbours(node):
            return self.addr(node, toward=source)
        hop = self.topology.bfs(source).get(node)
        if hop is None:
            raise TestbedError(f"no path from {source!r} to {node!r} in testbed {self.name}")
        return self.addr(node, toward=hop)

    def enable_routing(self) -> None:
        """Static IP routing along shortest paths (hop count, ties by name;
        hosts are never transit): IP forwarding on in every switch namespace
        and, in every namespace, a /32 route to every data address of every
        other node via the next hop toward it. The switch daemon still only
        receives what is addressed to its own addresses; packets for others
        are forwarded by the kernel, as a non-programmable switch would.
        Idempotent (``ip route replace``)."""
        if not self.state.get("routing"):
            _build_routes(self.state)
            path = _state_path(self.name, self._state_dir)
            if path.exists():
                path.write_text(json.dumps(self.state, indent=1) + "\n")

    def replicate_group(self, switch: str, group: str) -> list[str]:
        """Deliver what `switch` sends to the IPv4 multicast `group` on every
        one of its links toward a host, as a switch ASIC's multicast engine
        does (SwitchML returns each result this way): one send by the
        daemon, one copy per port made in the switch's data plane, not by
        its CPU. Inside `switch`'s namespace: a route for the group out of
        its first host link, and on that link's egress a tc filter that
        mirrors each packet to the other host links (`mirred egress
        mirror`, a clone of the packet, not a copy of its bytes). Every copy
        then leaves through its link's own tbf and counters, so rates and
        byte counts stay per link. Hosts receive the group on a socket that
        joined it (`fanin.Session(result_group=...)`). Returns the switch's
        interfaces that carry the group."""
        import ipaddress

        if not ipaddress.ip_address(group).is_multicast:
            raise TestbedError(f"{group} is not an IPv4 multicast group (224.0.0.0/4)")
        ports = [self.interface(switch, h) for h in self.topology.neighbours(switch) if self.topology.is_host(h)]
        if not ports:
            raise TestbedError(f"{switch!r} has no link to a host to deliver group {group} on")
        ns = self.namespace(switch)
        _sh(["ip", "-n", ns, "route", "replace", f"{group}/32", "dev", ports[0]])
        if len(ports) > 1:
            _sh(["tc", "-n", ns, "qdisc", "replace", "dev", ports[0], "clsact"])
            mirrors = [a for port in ports[1:] for a in ("action", "mirred", "egress", "mirror", "dev", port)]
            _sh(["tc", "-n", ns, "filter", "add", "dev", ports[0], "egress", "protocol", "ip", "prio", "1",
                 "u32", "match", "ip", "dst", f"{group}/32", *mirrors])
        return ports

    @property
    def root_mgmt_addr(self) -> str:
        return self.state["root_mgmt_addr"]

    # -- running things inside -------------------------------------------------------

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed so that it runs inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside `node`'s namespace (environment and cwd inherited).
        The process is stopped by ``down()`` if still running."""
        p = subprocess.Popen(self.exec_argv(node, argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, node: str, argv: Sequence[str], *, check: bool = True, timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run `argv` inside `node`'s namespace to completion (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.exec_argv(node, argv), check=check, timeout=timeout, **kwargs)

    def switch(self, node: str, jobs: Iterable[dict[str, Any]] = (), *, quiet: bool = True,
               **config: Any) -> Any:
        """The real switch daemon (`fanin switch`) inside switch `node`'s namespace.

        Data plane on 0.0.0.0:SWITCH_DATA_PORT (reached by neighbours at
        ``addr(node, toward=neighbour)``), control API and metrics on the
        node's management address. Extra keyword arguments go to
        :func:`fanin.switch.switch_config`. Returns a started
        :class:`fanin.proc.SwitchProcess`; ``down()`` stops it if you don't.
        """
        self.topology.switch(node)
        return self._daemon(node, jobs, quiet, config)

    def host_aggregator(self, node: str, jobs: Iterable[dict[str, Any]] = (), *, quiet: bool = True,
                        **config: Any) -> Any:
        """The same daemon as :meth:`switch` on *host* `node`: a host
        aggregator, e.g. a parameter server that completes what the switches
        did not aggregate (GOAT deployment, docs/goat.md). Data plane on
        0.0.0.0:SWITCH_DATA_PORT, reached at ``reach_addr(node, source)``."""
        self.topology.host(node)
        return self._daemon(node, jobs, quiet, config)

    def _daemon(self, node: str, jobs: Iterable[dict[str, Any]], quiet: bool, config: dict[str, Any]) -> Any:
        from fanin.proc import SwitchProcess
        from fanin.switch import switch_config

        mgmt = self.mgmt_addr(node)
        # The control API listens on the management network, so it needs a
        # token (docs/security.md): one per process, exported so every
        # ControlClient of this process (and its children) sends it.
        config.setdefault("control_token", _control_token())
        config.setdefault("data_addr", f"0.0.0.0:{self.SWITCH_DATA_PORT}")
        config.setdefault("control_addr", f"{mgmt}:{self.SWITCH_CONTROL_PORT}")
        config.setdefault("metrics_addr", f"{mgmt}:{self.SWITCH_METRICS_PORT}")
        sw = SwitchProcess(switch_config(jobs=jobs, **config), quiet=quiet, netns=self.namespace(node))
        self._switches.append(sw)
        return sw

    def switches(self, nodes: Optional[Iterable[str]] = None, jobs: Iterable[dict[str, Any]] = (),
                 **config: Any) -> dict[str, Any]:
        """:meth:`switch` on every switch of the topology (or on `nodes`),
        started concurrently (each waits for its daemon to bind its ports);
        returns {node: SwitchProcess}."""
        from concurrent.futures import ThreadPoolExecutor

        names = list(nodes) if nodes is not None else [s.name for s in self.topology.switches]
        jobs = list(jobs)
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
            started = {n: pool.submit(self.switch, n, jobs, **config) for n in names}
        return {n: f.result() for n, f in started.items()}

    def set_rate(self, rate_mbit: float, queue_ms: float = 20.0) -> None:
        """Limit every data link, both directions, to `rate_mbit` (the tbf of
        :meth:`up`, replaced in place: what runs keeps running), with a
        queue of `queue_ms` at that rate (tbf's latency; a shallow queue
        overflows sooner)."""
        if not rate_mbit > 0 or not queue_ms > 0:
            raise TestbedError(f"rate_mbit {rate_mbit} and queue_ms {queue_ms} must be > 0")
        shaping: dict[str, list[str]] = {}
        for link in self.state["links"]:
            for end in ("a", "b"):
                shaping.setdefault(link[end], []).append(_tbf(link[f"{end}_if"], rate_mbit, queue_ms))
            link["rate_mbit"] = rate_mbit
        for node, lines in shaping.items():
            _sh(["tc", "-n", self.namespace(node), "-batch", "-"], stdin="\n".join(lines) + "\n")

    # -- measurements ----------------------------------------------------------------

    def ip_stats(self, node: str) -> dict[str, int]:
        """The IP and UDP counters of `node`'s namespace (/proc/net/snmp as
        seen inside it), e.g. ``Ip.FragCreates``, ``Udp.RcvbufErrors``."""
        text = self.run(node, ["cat", "/proc/net/snmp"]).stdout
        out: dict[str, int] = {}
        lines = text.splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            proto, *keys = names.split()
            for k, v in zip(keys, values.split()[1:]):
                out[f"{proto.rstrip(':')}.{k}"] = int(v)
        return out

    def _tx_bytes(self, end: _End) -> int:
        # The same counters as /sys/class/net/<if>/statistics/tx_bytes inside
        # the namespace, read over netlink (sysfs shows only the reader's own
        # namespace).
        r = _sh(["ip", "-n", self.namespace(end.node), "-j", "-s", "link", "show", "dev", end.ifname])
        tx = json.loads(r.stdout)[0]["stats64"]["tx"]
        # With receive offload a veth delivers through NAPI, and its peer
        # counts each frame after the Ethernet header was taken off (these
        # tx counters are the peer's rx ones then): put it back, so a frame
        # counts the same either way.
        return int(tx["bytes"]) + (_ETH_HLEN * int(tx["packets"]) if self.state.get("gro") else 0)

    def link_bytes(self, a: str, b: str) -> LinkBytes:
        """Bytes sent so far over the link a-b in each direction (frames as the
        veth carried them, Ethernet header included, FCS not)."""
        end_a, end_b = self._link_ends(a, b)
        return LinkBytes(self._tx_bytes(end_a), self._tx_bytes(end_b))

    def status(self) -> dict[str, Any]:
        """The state (as in the state file) plus which namespaces really exist."""
        present = set(_our_namespaces(self.name))
        missing = [n for n, info in self.state["nodes"].items() if info["netns"] not in present]
        return {**{k: v for k, v in self.state.items() if k != "topology"}, "missing_namespaces": missing}


# -- planning and building ----------------------------------------------------------------


def _plan(topology: Topology, name: str, rate_override: Optional[float]) -> dict[str, Any]:
    """Every name and address, before anything is created."""
    if len(topology.links) > _DATA_NET.num_addresses // 4:
        raise TestbedError(f"{len(topology.links)} links do not fit the data range {_DATA_NET} (one /30 each)")
    nodes: dict[str, dict[str, Any]] = {}
    mgmt_net = _pick_mgmt_net(name)
    hosts_ok = mgmt_net.num_addresses - 3
    if len(topology.nodes) > hosts_ok:
        raise TestbedError(f"{len(topology.nodes)} nodes do not fit the management network {mgmt_net}")
    for i, node in enumerate(topology.nodes):
        nodes[node] = {
            "netns": f"{name}-{node}",
            "kind": "switch" if topology.is_switch(node) else "host",
            "mgmt_addr": str(mgmt_net.network_address + 2 + i),
            "mgmt_if": "mgmt0",
            "root_if": f"{name}-m{i}",
            "ifaces": 0,
        }
    links = []
    for i, link in enumerate(topology.links):
        subnet = ipaddress.ip_network(f"{_DATA_NET.network_address + 4 * i}/30")
        ends = {}
        for end in (link.a, link.b):
            # eth<k>: the k-th link of this node, in topology order; short
            # enough for IFNAMSIZ whatever the node is called.
            ends[end] = f"eth{nodes[end]['ifaces']}"
            nodes[end]["ifaces"] += 1
        rate = rate_override if rate_override is not None else link.rate_mbit
        links.append({
            "a": link.a, "b": link.b, "a_if": ends[link.a], "b_if": ends[link.b],
            "a_addr": str(subnet.network_address + 1), "b_addr": str(subnet.network_address + 2),
            "subnet": str(subnet), "rate_mbit": rate,
        })
    return {
        "name": name,
        "created": time.time(),
        "topology": topology.to_dict(),
        "rate_mbit_override": rate_override,
        "bridge": f"{name}-br",
        "mgmt_net": str(mgmt_net),
        "root_mgmt_addr": str(mgmt_net.network_address + 1),
        "nodes": nodes,
        "links": links,
        "offloads": "unchanged",
    }


def _build(state: dict[str, Any]) -> None:
    nodes, links = state["nodes"], state["links"]
    prefix = ipaddress.ip_network(state["mgmt_net"]).prefixlen
    root = [f"netns add {info['netns']}" for info in nodes.values()]
    root += [f"link add {state['bridge']} type bridge",
             f"addr add {state['root_mgmt_addr']}/{prefix} dev {state['bridge']}",
             f"link set {state['bridge']} up"]
    for link in links:
        a, b = nodes[link["a"]], nodes[link["b"]]
        root.append(f"link add {link['a_if']} netns {a['netns']} type veth peer name {link['b_if']} netns {b['netns']}")
    for info in nodes.values():
        root.append(f"link add {info['root_if']} type veth peer name {info['mgmt_if']} netns {info['netns']}")
        root.append(f"link set {info['root_if']} master {state['bridge']} up")
    _ip_batch(root)

    # the management network too: a daemon bound to 0.0.0.0 sizes its packets
    # to the smallest MTU among its interfaces
    mtu = f" mtu {state['mtu']}" if state.get("mtu") else ""
    if mtu:
        _ip_batch([f"link set {info['root_if']}{mtu}" for info in nodes.values()] + [f"link set {state['bridge']}{mtu}"])
    inside: dict[str, list[str]] = {n: ["link set lo up"] for n in nodes}
    shaping: dict[str, list[str]] = {n: [] for n in nodes}
    for link in links:
        plen = ipaddress.ip_network(link["subnet"]).prefixlen
        for end in ("a", "b"):
            node, ifname = link[end], link[f"{end}_if"]
            inside[node] += [f"addr add {link[f'{end}_addr']}/{plen} dev {ifname}", f"link set {ifname}{mtu} up"]
            if link["rate_mbit"] is not None:
                shaping[node].append(_tbf(ifname, link["rate_mbit"]))
    for node, info in nodes.items():
        inside[node] += [f"addr add {info['mgmt_addr']}/{prefix} dev {info['mgmt_if']}", f"link set {info['mgmt_if']}{mtu} up"]
        _ip_batch(inside[node], netns=info["netns"])
        if shaping[node]:
            _sh(["tc", "-n", info["netns"], "-batch", "-"], stdin="\n".join(shaping[node]) + "\n")

    if shutil.which("ethtool"):
        offloads = " ".join(_offloads(state.get("gro", False)))
        for node, info in nodes.items():
            script = "; ".join(f"ethtool -K eth{k} {offloads} 2>/dev/null" for k in range(info["ifaces"]))
            if script:
                _sh(["ip", "netns", "exec", info["netns"], "sh", "-c", script + "; true"])
        state["offloads"] = ("off (" + " ".join(_SEND_OFFLOADS[::2]) + "), receive offload (gro) "
                             + ("on" if state.get("gro") else "off"))
    else:
        state["offloads"] = "unchanged: ethtool is not installed (apt-get install ethtool)"


def _build_routes(state: dict[str, Any]) -> None:
    """Shortest-path static routes in every namespace, forwarding in switches.

    For every node t and every data address of t, each other node n that is
    not on that address's link routes it (/32) via its BFS parent toward t
    (one BFS per t, neighbours in name order, hosts never transit, as
    ``Topology.bfs``), so following next hops always ends at t. rp_filter is
    turned off: a reply may come back over another link than the request
    went (t owns all its addresses, Linux's weak host model accepts them).
    """
    topo = Topology.from_dict(state["topology"], source=f"testbed {state['name']}")
    nodes, links = state["nodes"], state["links"]
    addr_of: dict[tuple[str, str], str] = {}
    for link in links:
        addr_of[(link["a"], link["b"])] = link["a_addr"]
        addr_of[(link["b"], link["a"])] = link["b_addr"]
    routes: dict[str, list[str]] = {n: [] for n in nodes}
    for t in nodes:
        parent = topo.bfs(t)
        for (owner, peer), addr in addr_of.items():
            if owner != t:
                continue
            for n, hop in parent.items():
                if hop is None or n == peer:
                    continue  # t itself, or on the address's own (connected) link
                routes[n].append(f"route replace {addr}/32 via {addr_of[(hop, n)]}")
    for node, info in nodes.items():
        forward = "1" if info["kind"] == "switch" else "0"
        _sh(["ip", "netns", "exec", info["netns"], "sh", "-c",
             "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo 0 > $f; done; "
             f"echo {forward} > /proc/sys/net/ipv4/ip_forward"])
        _ip_batch(routes[node], netns=info["netns"])
    state["routing"] = "static shortest paths (hop count, ties by name)"


# -- taking down ---------------------------------------------------------------------------


def _stop(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _kill_namespace_processes(namespaces: list[str], grace_s: float = 3.0) -> int:
    """SIGTERM every process in the namespaces, SIGKILL what is left after the grace period."""
    def pids() -> set[int]:
        found: set[int] = set()
        for ns in namespaces:
            out = _sh(["ip", "netns", "pids", ns], check=False).stdout
            found |= {int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()}
        return found

    alive = pids()
    killed = len(alive)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 1.0)
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = {p for p in alive if _alive(p)}
        if not alive:
            break
    return killed


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap our own children so they do not linger as zombies
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def unwind_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`, a supervisor) end this process as an exception does, so that the
    `with`/ExitStack holding a testbed takes it down: by default SIGTERM ends Python at once, leaving the
    namespaces, veths and the processes inside running. Only from the main thread (signal handlers live
    there), and never over a handler someone else installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def down(name: str = DEFAULT_NAME, state_dir: Optional[Path] = None) -> dict[str, int]:
    """Take testbed `name` down: stop every process in its namespaces, delete
    the namespaces (which deletes their veths), the bridge, stray root-side
    veths and the state file. Found by prefix, so it works without the state
    file; idempotent. Returns counts of what was removed."""
    _check_name(name)
    path = _state_path(name, state_dir)
    namespaces = _our_namespaces(name)
    if namespaces or _our_root_links(name):
        check_privileges()
    killed = _kill_namespace_processes(namespaces) if namespaces else 0
    _ip_batch((f"netns del {ns}" for ns in namespaces), force=True)
    links = _our_root_links(name)
    _ip_batch((f"link del {link}" for link in links), force=True)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    left = _our_namespaces(name) + _our_root_links(name)
    if left:
        raise TestbedError(f"could not remove {', '.join(left)} (see `ip netns pids` / `ip link`)")
    return {"processes": killed, "namespaces": len(namespaces), "root_links": len(links)}


def list_testbeds(state_dir: Optional[Path] = None) -> list[str]:
    """Names of the testbeds with a state file."""
    d = Path(state_dir or STATE_DIR)
    return sorted(p.name[len("testbed-"):-len(".json")] for p in d.glob("testbed-*.json"))


_TOKEN_LOCK = threading.Lock()


def _control_token() -> str:
    """The testbed's control API token: ``FANIN_CONTROL_TOKEN`` if set,
    else a random one set there for this process and its children. Under a
    lock: `Testbed.switches` starts daemons on several threads, and two that
    both found no token would each draw one, starting a daemon whose token
    the process's clients no longer send (CI: "UNAUTHENTICATED: wrong
    token" from one switch of a GOAT deployment)."""
    import os
    import secrets

    from fanin.control.client import CONTROL_TOKEN_ENV

    with _TOKEN_LOCK:
        token = os.environ.get(CONTROL_TOKEN_ENV)
        if not token:
            token = secrets.token_hex(16)
            os.environ[CONTROL_TOKEN_ENV] = token
        return token
