"""`fanin controller ...`: serve the controller, and talk to one."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from ..switch import JOB_DEFAULTS

EPILOG = """\
examples:
  # a switch daemon per switch of a 3-level tree on 127.0.0.1, and the controller
  fanin controller serve --topology deep-tree:3,2 --loopback --listen 127.0.0.1:9200
  # the same on the namespace testbed (switch daemons already running inside it)
  fanin controller serve --topology fat-tree:4 --testbed fb --listen 10.200.0.1:9200
  # ... or switches described by a fabric file (docs/trees.md)
  fanin controller serve --topology topo.toml --fabric fabric.json

  fanin controller create-job 1 --max-workers 8 --block-cnt-max 64   # keyed (--no-auth: unauthenticated)
  fanin controller subscribe 1 --rank 0 --host h0     # prints the data address and member key the worker uses
  fanin controller tree 1                            # root, levels, every switch's parent
  fanin controller unsubscribe 1 --rank 0

  # a GOAT plan (fanin plan goat) installed on the testbed's switches and PS (docs/goat.md, Deployment)
  fanin controller install-goat plan.json --testbed gt      # prints where every worker sends each sub-model
  fanin controller install-goat plan.json --testbed gt --remove

Jobs are keyed by default (docs/security.md): the controller draws a job key,
admits the job with it on every switch of the tree, and `subscribe` returns
the worker's member key (32 hex digits here; fanin.Session(auth_key=...)).
A worker without it gets no answer (its datagrams are counted auth_unsealed)
and fails with FaninTimeout after join_timeout_s. So whoever reaches the
controller can obtain member keys: keep it on loopback or behind --token.

The tree of a job is a Steiner tree over the switches spanning its workers,
rooted at their lowest common ancestor (docs/trees.md gives the exact rule).
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("controller", help="the controller: aggregation trees over a topology, workers join and leave",
                       description="Keep one aggregation tree per job over a topology and program the switches "
                                   "on it (SwitchML++); workers subscribe and unsubscribe while jobs run.",
                       epilog=EPILOG)
    csub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = csub.add_parser("serve", help="run the controller (gRPC) in the foreground")
    serve.add_argument("--topology", required=True, help="topology file or generator spec (docs/topology.md)")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--testbed", metavar="NAME", help="switches run in this namespace testbed (fanin testbed up)")
    where.add_argument("--fabric", metavar="FILE", help="JSON: each switch's control and data addresses")
    where.add_argument("--loopback", action="store_true",
                       help="start a switch daemon per topology switch on 127.0.0.1 (demo, tests)")
    serve.add_argument("--listen", default="127.0.0.1:9200", help="controller address (default 127.0.0.1:9200)")
    serve.add_argument("--shards", type=int, default=1, help="with --loopback: shards per switch (default %(default)s)")
    serve.add_argument("--token", help="bearer token the switches' control APIs require (and this one)")
    serve.set_defaults(func=_serve)

    def client(q: argparse.ArgumentParser) -> None:
        q.add_argument("--addr", default="127.0.0.1:9200", help="controller address (default 127.0.0.1:9200)")
        q.add_argument("--token", help="bearer token")

    cj = csub.add_parser("create-job", help="create a job (before workers subscribe)")
    cj.add_argument("job_id", type=int)
    cj.add_argument("--block-cnt-max", type=int, default=JOB_DEFAULTS["block_cnt_max"],
                    help="slots (blocks in flight) per switch (default %(default)s)")
    cj.add_argument("--block-grad-max", type=int, default=None,
                    help="elements per block and packet (default: %d, capped to what one unfragmented datagram "
                         "carries on the tree's smallest-MTU switch)" % JOB_DEFAULTS["block_grad_max"])
    cj.add_argument("--block-exp-ms", type=int, default=0, help="straggler timeout (0: wait for every member)")
    cj.add_argument("--max-workers", type=int, default=64,
                    help="most workers at once; block floating point keeps headroom for this many, so a smaller "
                         "count keeps more precision (default %(default)s)")
    cj.add_argument("--on-failure", choices=["degrade", "fail"], default=None,
                    help="when a worker dies: fail every member with an error naming it, or go on without it "
                         "(partial sums flagged degraded); default: degrade with --block-exp-ms, else fail "
                         "(docs/failures.md)")
    cj.add_argument("--no-auth", action="store_true",
                    help="an unauthenticated job: no keys, anyone who reaches the switches can contribute "
                         "(default: keyed, docs/security.md)")
    client(cj)
    cj.set_defaults(func=_create_job)
    dj = csub.add_parser("delete-job", help="remove a job from every switch of its tree")
    dj.add_argument("job_id", type=int)
    client(dj)
    dj.set_defaults(func=_delete_job)
    su = csub.add_parser("subscribe", help="add a worker (prints the data address it sends to and its member key)")
    su.add_argument("job_id", type=int)
    su.add_argument("--rank", type=int, required=True)
    su.add_argument("--host", required=True, help="the topology host the worker runs on")
    su.add_argument("--sync", action="store_true", help="the job is running: the worker syncs on the current block "
                    "(required for a rank that left while other ranks stayed subscribed; once every rank has "
                    "left, a new run subscribes without it)")
    client(su)
    su.set_defaults(func=lambda a: _call(a, lambda c: _printable(c.subscribe(a.job_id, a.rank, a.host, sync=a.sync))))
    un = csub.add_parser("unsubscribe", help="remove a worker")
    un.add_argument("job_id", type=int)
    un.add_argument("--rank", type=int, required=True)
    client(un)
    un.set_defaults(func=lambda a: _call(a, lambda c: c.unsubscribe(a.job_id, a.rank)))
    tr = csub.add_parser("tree", help="a job's current tree as JSON")
    tr.add_argument("job_id", type=int)
    client(tr)
    tr.set_defaults(func=lambda a: _call(a, lambda c: c.tree(a.job_id)))
    ig = csub.add_parser("install-goat", help="install a GOAT plan: switch jobs (responsibility filters) + PS jobs",
                         description="Admit a GOAT plan (fanin plan goat) on the switches and the parameter server's "
                                     "daemon (started with Testbed.host_aggregator, or any fanin switch on the PS "
                                     "host) through their control APIs: one job per sub-model, the PS the root "
                                     "(docs/goat.md, Deployment). Prints, per worker, the job, rank and data "
                                     "address of each sub-model. Workers two hops away need routing "
                                     "(fanin testbed up --routing).")
    ig.add_argument("plan", help="plan JSON (schema fanin.goat.plan/1)")
    where = ig.add_mutually_exclusive_group(required=True)
    where.add_argument("--testbed", metavar="NAME", help="the namespace testbed the plan's nodes run in")
    where.add_argument("--fabric", metavar="FILE", help="JSON: control and data addresses of the switches and the PS")
    ig.add_argument("--topology", help="with --fabric: the topology the plan was made for")
    ig.add_argument("--job-base", type=int, default=100, help="job id of sub-model 0 (default %(default)s)")
    ig.add_argument("--block-cnt-max", type=int, default=64)
    ig.add_argument("--block-grad-max", type=int, default=256)
    ig.add_argument("--no-auth", action="store_true",
                    help="install unkeyed jobs (default: every sub-model's job gets a fresh job key and each "
                         "worker's member key is printed with its target; docs/security.md)")
    ig.add_argument("--on-path", action="store_true",
                    help="GOAT's on-path filtering: every worker sends every sub-model to its first-hop switch, "
                         "and the plan's switches on the way relay what they do not aggregate toward its node "
                         "(docs/goat.md). Needs --no-auth (a relay holds no key) and the same shard count on "
                         "every daemon; with --remove, removes the relays too")
    ig.add_argument("--remove", action="store_true", help="remove the plan's jobs instead")
    ig.set_defaults(func=_install_goat)


def _call(args: argparse.Namespace, fn) -> int:
    from ..control import ControlError
    from .server import ControllerClient

    with ControllerClient(args.addr, token=args.token) as c:
        try:
            result = fn(c)
        except ControlError as e:
            print(f"fanin controller: {e}", file=sys.stderr)
            return 1
    if result is not None:
        print(json.dumps(result, indent=2))
    return 0


def _printable(sub: dict) -> dict:
    """A subscribe answer as JSON: the member key as 32 hex digits (the
    form `fanin.Session(auth_key=bytes.fromhex(...))` and config files take)."""
    key = sub.get("member_key")
    return {**sub, "member_key": key.hex() if key is not None else None}


# create-job's flags and the job fields they set (JobParams.LIMITS holds the switch's range of each)
_JOB_FLAGS = {"block_cnt_max": "--block-cnt-max", "block_grad_max": "--block-grad-max",
              "block_exp_ms": "--block-exp-ms", "max_workers": "--max-workers"}


def _create_job(args: argparse.Namespace) -> int:
    from .service import JobParams

    # Checked here, before the request: the gRPC message cannot carry a negative value (protobuf's "Value out
    # of range" names no field), and the controller reads 0 as "the default" (the field unset).
    if not 0 <= args.job_id < 2**32:
        print(f"fanin controller create-job: job id {args.job_id} is out of range: give 0..{2**32 - 1}",
              file=sys.stderr)
        return 2
    for field, flag in _JOB_FLAGS.items():
        value = getattr(args, field)
        lo, hi, means = JobParams.LIMITS[field]
        if value is not None and not lo <= value <= hi:
            print(f"fanin controller create-job: {flag} {value} is out of range: give {lo}..{hi}{means}",
                  file=sys.stderr)
            return 2
    params = JobParams(args.job_id, block_cnt_max=args.block_cnt_max, block_grad_max=args.block_grad_max,
                       block_exp_ms=args.block_exp_ms, max_workers=args.max_workers, on_failure=args.on_failure,
                       auth=not args.no_auth)
    code = _call(args, lambda c: c.create_job(args.job_id, block_cnt_max=args.block_cnt_max,
                                              block_grad_max=args.block_grad_max, block_exp_ms=args.block_exp_ms,
                                              max_workers=args.max_workers, on_failure=args.on_failure,
                                              auth=not args.no_auth))
    if code == 0:
        grad = (params.block_grad_max if params.block_grad_max is not None
                else f"<= {JOB_DEFAULTS['block_grad_max']} (sized to the tree's MTU)")
        print(f"job {params.job_id} created: {'keyed' if params.auth else 'unauthenticated'}, "
              f"max_workers {params.max_workers}, block_cnt_max {params.block_cnt_max}, block_grad_max {grad}, "
              f"block_exp_ms {params.block_exp_ms}, on_failure {params.on_failure}")
    return code


def _delete_job(args: argparse.Namespace) -> int:
    code = _call(args, lambda c: c.delete_job(args.job_id))
    if code == 0:
        print(f"job {args.job_id} deleted")
    return code


def _install_goat(args: argparse.Namespace) -> int:
    from .. import topology
    from ..control import ControlError
    from ..goat.deploy import install_goat_plan, remove_goat_plan
    from ..goat.model import GoatError
    from .fabric import FabricError, StaticFabric, TestbedFabric

    try:
        plan = json.loads(open(args.plan).read())
        if args.testbed:
            tb = _attach_testbed(args.testbed)
            topo, fabric = tb.topology, TestbedFabric(tb)
        else:
            if not args.topology:
                raise GoatError("--fabric needs --topology")
            topo, fabric = topology.load(args.topology), StaticFabric.load(args.fabric)
        if args.remove:
            done = remove_goat_plan(plan, topo, fabric, job_base=args.job_base, on_path=args.on_path)
            print(json.dumps({"removed": [{"node": j.node, "job_id": j.job_id} for j in done]}, indent=1))
            return 0
        dep = install_goat_plan(plan, topo, fabric, job_base=args.job_base, block_cnt_max=args.block_cnt_max,
                                block_grad_max=args.block_grad_max, auth=not args.no_auth, on_path=args.on_path)
        dep.close()
    except (OSError, ValueError, GoatError, FabricError, ControlError, topology.TopologyError) as e:
        print(f"fanin controller install-goat: {e}", file=sys.stderr)
        return 1
    def key_hex(t):
        key = dep.member_key(t.job_id, t.rank)
        return key.hex() if key else None

    print(json.dumps({w: [{"submodel": t.submodel, "job_id": t.job_id, "rank": t.rank, "node": t.node,
                           "sends_to": t.sends_to, "data_addr": addr, "member_key": key_hex(t)}
                          for t, addr in targets]
                      for w, targets in dep.addrs.items()}, indent=1))
    return 0


def _attach_testbed(name: str) -> Any:
    """The namespace testbed `name` that `fanin testbed up` built. The testbed lives in fanin_bench, imported
    here only for --testbed (fanin never imports it at module level); its errors become FabricError, a
    ValueError, so they are reported like a bad fabric file."""
    from fanin_bench.testbed import Testbed, TestbedError

    from .fabric import FabricError

    try:
        return Testbed.attach(name)
    except TestbedError as e:
        raise FabricError(str(e)) from None


def _serve(args: argparse.Namespace) -> int:
    from .. import topology
    from .fabric import FabricError, StaticFabric, TestbedFabric
    from .server import ControllerServer
    from .service import Controller

    try:
        topo = topology.load(args.topology)
    except topology.TopologyError as e:
        print(f"fanin controller: {e}", file=sys.stderr)
        return 2
    loopback = None
    if args.testbed:
        fabric = TestbedFabric(_attach_testbed(args.testbed))
    elif args.fabric:
        try:
            fabric = StaticFabric.load(args.fabric)
        except (FabricError, OSError) as e:
            print(f"fanin controller: --fabric {args.fabric}: {e}", file=sys.stderr)
            return 2
    else:
        from .loopback import LoopbackSwitches

        loopback = LoopbackSwitches(topo, shards=args.shards)
        fabric = loopback.fabric
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        try:
            server = ControllerServer(Controller(topo, fabric, token=args.token), args.listen, token=args.token)
        except (OSError, ValueError) as e:  # the port, or a token it needs
            print(f"fanin controller: {e}", file=sys.stderr)
            return 2
        with server as srv:
            print(json.dumps({"controller": srv.addr, "topology": topo.name,
                              "switches": len(topo.switches), "hosts": len(topo.hosts)}), flush=True)
            stop.wait()
    finally:
        if loopback is not None:
            loopback.stop()
    return 0
