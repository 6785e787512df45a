"""`fanin testbed up|down|status|exec`: the command line of :mod:`fanin_bench.testbed`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from fanin_bench.report import emit

__all__ = ["register"]


EPILOG_TESTBED = """\
Every node of the topology (switch or host) gets a network namespace
<name>-<node>; every link a veth pair with its own /30 (hosts talk to their
switch, switches to their neighbours; --routing adds shortest-path routes); a bridge
<name>-br in the root namespace reaches every node's management address.
Needs root. See docs/testbed.md (addressing, rate limits) and
docs/topology.md (file format, generators).

examples:
  fanin testbed up fat-tree:4 --rate-mbit 1000  # the thesis topology: 20 switches, 16 hosts
  fanin testbed up my.toml --name tb2           # a second testbed beside the first
  fanin testbed status                          # nodes, addresses, interfaces
  fanin testbed exec h0_0_0 -- ping -c1 10.1.0.2
  fanin testbed exec s0 -- env FANIN_CONTROL_TOKEN=SECRET python3 -m fanin switch \\
        --data-addr 0.0.0.0:9000 --control-addr MGMT_IP:9100 --job id=1,sources=2
  fanin testbed down                            # idempotent; removes processes started inside too
"""


def _cmd_testbed(args: argparse.Namespace) -> int:
    import os

    from fanin import topology
    from fanin_bench import testbed

    try:
        if args.action == "up":
            topo = topology.load(args.topology)
            tb = testbed.Testbed.up(topo, name=args.name, rate_mbit=args.rate_mbit, routing=args.routing,
                                    mtu=args.mtu, gro=args.gro)
            st = tb.state
            emit(tb.status(), f"fanin testbed {tb.name}: {topo.name} up, {len(st['nodes'])} namespaces "
                              f"({tb.name}-*), {len(st['links'])} links, management {st['mgmt_net']} "
                              f"(root {st['root_mgmt_addr']} on {st['bridge']}), offloads {st['offloads']}",
                 args.json)
        elif args.action == "down":
            removed = testbed.down(args.name)
            emit(removed, f"fanin testbed {args.name}: down ({removed['namespaces']} namespaces, "
                          f"{removed['processes']} processes, {removed['root_links']} root links removed)", args.json)
        elif args.action == "status":
            names = [args.name] if args.name else testbed.list_testbeds()
            if not names:
                emit({}, "fanin testbed: none up", args.json)
            for name in names:
                tb = testbed.Testbed.attach(name)
                emit(tb.status(), _describe_testbed(tb), args.json)
        elif args.action == "exec":
            cmd = list(args.cmd)
            if cmd[:1] == ["--name"] and len(cmd) > 1:  # `exec NODE --name X -- CMD`: REMAINDER took it
                args.name, cmd = cmd[1], cmd[2:]
            cmd = cmd[1:] if cmd[:1] == ["--"] else cmd
            if not cmd:
                print("fanin testbed exec: give a command after --", file=sys.stderr)
                return 2
            tb = testbed.Testbed.attach(args.name)
            argv = tb.exec_argv(args.node, cmd)
            os.execvp(argv[0], argv)
    except (testbed.TestbedError, topology.TopologyError) as e:
        print(f"fanin testbed {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def _describe_testbed(tb: Any) -> str:
    st = tb.status()
    lines = [f"testbed {tb.name}: {tb.topology.name}, management {st['mgmt_net']} (root {st['root_mgmt_addr']} "
             f"on {st['bridge']}), offloads {st['offloads']}"]
    if st["missing_namespaces"]:
        lines.append(f"  MISSING namespaces of: {', '.join(st['missing_namespaces'])}")
    for node, info in st["nodes"].items():
        lines.append(f"  {info['kind']:6s} {node:12s} netns {info['netns']:16s} mgmt {info['mgmt_addr']}")
    for link in st["links"]:
        rate = f"{link['rate_mbit']:g} Mbit/s" if link["rate_mbit"] else "unlimited"
        lines.append(f"  link {link['a']}/{link['a_if']} {link['a_addr']} <-> {link['b']}/{link['b_if']} "
                     f"{link['b_addr']}  {rate}")
    return "\n".join(lines)


def register(sub: Any) -> None:
    tb = sub.add_parser("testbed", help="network-namespace testbed: a topology of namespaces, veth links, tbf limits",
                        description="Build a topology (file or generator spec) out of Linux network namespaces and "
                                    "veth links, run commands inside, take it down again.",
                        epilog=EPILOG_TESTBED)
    tsub = tb.add_subparsers(dest="action", metavar="ACTION", required=True)

    def named(p: argparse.ArgumentParser, default: Optional[str] = "fb") -> None:
        p.add_argument("--name", default=default,
                       help="testbed name, prefix of its namespaces and interfaces (1-8 of a-z0-9; default fb)")
        p.add_argument("--json", action="store_true", help="print JSON on stdout")

    up = tsub.add_parser("up", help="build a testbed from a topology",
                         description="Build TOPOLOGY: a .toml/.json file (docs/topology.md) or a generator spec "
                                     "fat-tree:K, leaf-spine:S,L,H, star:N, deep-tree:LEVELS[,HOSTS].")
    up.add_argument("topology", help="topology file or generator spec, e.g. fat-tree:4")
    up.add_argument("--rate-mbit", type=float, help="tc tbf limit on every link, both directions "
                                                    "(default: each link's rate_mbit; none = unlimited)")
    up.add_argument("--mtu", type=int, help="MTU of every interface, e.g. 9000 for jumbo frames (default: the veth "
                                            "default, 1500); fanin learns it at join")
    up.add_argument("--gro", action="store_true",
                    help="receive offload on every data interface: frames of a flow that arrive together reach the "
                         "stack as one packet, as behind a real NIC (links, rates and byte counters stay per frame; "
                         "default off, docs/testbed.md)")
    up.add_argument("--routing", action="store_true",
                    help="static routes along shortest paths, IP forwarding in switches (every node reaches every "
                         "data address; docs/testbed.md)")
    named(up)
    down = tsub.add_parser("down", help="remove a testbed (idempotent; works without its state file)")
    named(down)
    st = tsub.add_parser("status", help="nodes, namespaces, addresses and links of the testbeds that are up")
    named(st, default=None)
    ex = tsub.add_parser("exec", help="run a command inside a node's namespace",
                         description="Run CMD inside NODE's network namespace (like `ip netns exec`).",
                         epilog="example: fanin testbed exec h0 -- ping -c1 10.1.0.2")
    ex.add_argument("node", metavar="NODE", help="a switch or host of the topology")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    named(ex)
    tb.set_defaults(func=_cmd_testbed)
