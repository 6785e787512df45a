"""The `fanin` command line.

Each command area registers its own sub-parser: the switch and key-value daemons and the demo here, `controller`
in fanin.controller.command, `plan` in fanin.goat.command. `bench`, `sim` and `testbed` belong to the fanin_bench
package (the harnesses, the namespace testbed, the simulator drivers), which imports fanin; fanin imports it only
when one of those commands runs (see `_forward`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from fanin._cli_util import (Parser, data_ip, dispatch, drop_probability, int_in, ip_port, job_arg, listen_addr,
                             rate_limit_dict)

EPILOG_MAIN = """\
examples:
  fanin demo                                   # switch + 4 workers on 127.0.0.1, 5% loss, checked results
  fanin switch --job id=1,sources=4            # run a switch with one 4-worker job
  fanin switch --config examples/switch.toml   # ... or from a config file (every field: docs/operations.md)
  fanin keys --job-id 1 --ranks 4 --out keys/  # a keyed job without a controller: job key + one file per rank
  fanin bench allreduce --workers 4 --size 100MB --json
  fanin bench gloo-compare --workers 4 --size 100MB
  fanin bench torch-allreduce --quick --json   # torch.distributed: fanin backend vs Gloo
  fanin bench time-to-accuracy --quick --json  # digits MLP with stragglers (cf. Trio-ML Fig. 12)
  fanin sim trimming --figure 6 --quick        # trimming study in the simulator (CSV + PNG in out/sim)
  fanin sim allreduce --sweep --json           # fanin's tree vs ring allreduce, fat-tree:8, 128 workers (CSV + PNG)
  fanin sim goat --json                        # one GOAT study point at packet level vs the flow-level evaluator
  fanin bench kv-prioritisation --quick        # ASK Fig. 9 on the key-value machines
  fanin bench overload --quick --json          # overloaded switch: trimming vs silent drops
  fanin bench flood --quick --json             # job isolation under a flood, with/without rate limits
  fanin testbed up fat-tree:4                  # namespaces + veth links (root; see fanin testbed --help)
  fanin controller serve --topology deep-tree:3,2 --loopback   # aggregation trees (see fanin controller --help)
  fanin plan goat --topology fat-tree:8,6 --programmable 0.2 --memory-mb 64 --ps h0_0_0 --even 221,111
  fanin bench goat --quick --json              # GOAT §VII-D: GOAT vs Geryon, ATP, ESA (CSV + PNG in out/goat)
  fanin bench kv-traffic --quick               # word counts: share absorbed by the switch
  fanin bench kv-wordcount --quick             # fanin vs PreAggr vs PySpark vs DataFrame
  fanin bench kv-window --quick                # fanin WordCount at sender windows 1024, 2048, 4096
  fanin bench kv-groupby --quick --json        # DataFrame group-by: fanin.spark.aggregate vs groupBy().agg()
  fanin bench kv-network --quick --json        # kv word count on rate-limited links: adaptive vs ASK's window (root)
  fanin kv daemon --socket /tmp/fanin-kv.sock  # key-value host daemon (docs/kv.md)
"""

# The commands fanin_bench answers, with the line `fanin --help` shows for each. main() hands everything after the
# command word to fanin_bench's own parser (fanin_bench.cli). The alternative, fanin_bench registering its
# sub-parsers here at parse time, would import fanin_bench on every `fanin switch` and make the library depend on
# it; forwarding keeps the one fanin -> fanin_bench import inside `_forward`, and each forwarded command's options,
# help and examples next to its code. main() checks the command word itself because argparse cannot forward: a
# REMAINDER positional does not take an argument list that starts with an option, as `fanin bench --help` does.
FORWARDED = {
    "bench": "benchmarks (JSON with --json; --quick for a ~1 minute run)",
    "sim": "the packet-level simulator (fanin-sim): trimming study, incast, end-to-end latency, permutation, allreduce, background traffic, GOAT, event rate",
    "testbed": "network-namespace testbed: a topology of namespaces, veth links, tbf limits",
}


def _forward(argv: list[str]) -> int:
    """`fanin bench|sim|testbed ...`: parsed, helped and run by fanin_bench.cli."""
    try:
        from fanin_bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name not in ("fanin_bench", "fanin_bench.cli"):
            raise
        print(f"fanin {argv[0]}: the fanin_bench package is not installed (it ships in fanin's wheel and "
              "source tree, python/fanin_bench)", file=sys.stderr)
        return 2
    return bench_main(argv)


def _add_forwarded(sub: Any, name: str) -> None:
    # Never parsed (main forwards first); here so that `fanin --help` lists the command. add_help=False because
    # `fanin NAME --help` is fanin_bench's to answer.
    sub.add_parser(name, help=FORWARDED[name], add_help=False)


def _add_switch(sub: Any) -> None:
    sw = sub.add_parser("switch", help="run a software aggregation switch in the foreground",
                        description="Run the fanin switch daemon until SIGINT/SIGTERM. Shard i listens on the data "
                                    "port + i; jobs come from --job/--config or the control API.",
                        epilog="example: fanin switch --shards 2 --job id=1,sources=4,block_cnt_max=256\n"
                               "a second switch on this machine: fanin switch --data-addr 127.0.0.1:9010 "
                               "(control API 127.0.0.1:9110, metrics 127.0.0.1:9111)\n"
                               "the control API on the network needs a token: FANIN_CONTROL_TOKEN=SECRET fanin switch "
                               "--data-addr 0.0.0.0:9000 --control-addr 10.0.0.2:9100")
    sw.add_argument("--config", help="TOML or JSON config file; flags given as well override its fields (a --job "
                                     "replaces the file's job of the same id)")
    sw.add_argument("--data-addr", type=ip_port("127.0.0.1:9000"), metavar="IP:PORT",
                    help="data port of shard 0 (default 127.0.0.1:9000)")
    sw.add_argument("--shards", type=int_in(1, 64), help="processing threads, one data port each, 1 to 64 "
                                                         "(default: one per two cores, 1 to 8)")
    sw.add_argument("--control-addr", type=listen_addr("127.0.0.1:9100"),
                    help="gRPC control API address, 'auto' or 'off' (default auto: 127.0.0.1 at the "
                         "data port + 100, e.g. 127.0.0.1:9100; a free port if that one is taken)")
    sw.add_argument("--control-token", help="bearer token the control API requires (default: $FANIN_CONTROL_TOKEN; "
                                             "required when --control-addr is not a loopback address)")
    sw.add_argument("--metrics-addr", type=listen_addr("127.0.0.1:9101"),
                    help="Prometheus endpoint address, 'auto' or 'off' (default auto: 127.0.0.1 at the data port "
                         "+ 101, e.g. 127.0.0.1:9101; a free port if that one is taken)")
    sw.add_argument("--memory-mb", type=int_in(1, 2**30, "MiB"),
                    help="aggregation memory for all jobs, in MiB (default 1024)")
    sw.add_argument("--job", action="append", type=job_arg, metavar="id=N,sources=N[,...]",
                    help="admit a job at start (repeatable); fields: id, sources or members=0:1:2, "
                         "block_cnt_max, block_grad_max, block_exp_ms, slow_after_windows, mode=aggregate|forward, "
                         "key=32 hex digits (an authenticated job, docs/security.md; key_file=PATH keeps it "
                         "off the command line, e.g. from `fanin keys`), "
                         "on_failure=degrade|fail (when a worker dies, docs/failures.md; unset: fail, or degrade "
                         "with block_exp_ms), member_timeout_ms (0 = 5000), "
                         "rate_limit=PPS:BURST (per source), result_group=239.1.0.7:47001 (results once to this "
                         "multicast group for workers listening there, docs/protocol.md 4.5)")
    sw.add_argument("--rate-limit", type=rate_limit_dict, metavar="PPS,BURST",
                    help="per-source rate limit for jobs that set none: each worker may send PPS contributions "
                         "per second and BURST back to back; the excess is answered with a Trimmed nack so it "
                         "slows down (docs/overload.md). Default: unlimited")
    sw.add_argument("--ingress-drop", type=drop_probability,
                    help="fault injection: drop probability on receive, 0 to below 1 (default 0)")
    sw.add_argument("--egress-drop", type=drop_probability,
                    help="fault injection: drop probability on send, 0 to below 1 (default 0)")
    sw.add_argument("--seed", type=int_in(0, 2**64 - 1), help="seed of the fault injection (default 0)")
    sw.add_argument("--print-ready", action="store_true", help="print one JSON line on stdout once the ports are bound")
    sw.set_defaults(func=_cmd_switch)


def _cmd_switch(args: argparse.Namespace) -> int:
    from fanin import _native
    from fanin.switch import config_json, switch_config

    if args.config:
        try:
            config = json.loads(_native.load_config(args.config))
        except ValueError as e:
            print(f"fanin switch: {args.config}: {e}", file=sys.stderr)
            return 2
    else:
        config = switch_config()
    # Flags given override the file's fields (or the defaults): never ignored.
    off = lambda v: None if v == "off" else v  # noqa: E731
    for flag, key, value in (("data_addr", "data_addr", args.data_addr), ("shards", "shards", args.shards),
                             ("control_addr", "control_addr", off(args.control_addr)),
                             ("metrics_addr", "metrics_addr", off(args.metrics_addr)),
                             ("memory_mb", "memory_mb", args.memory_mb)):
        if getattr(args, flag) is not None:
            config[key] = value
    for flag in ("ingress_drop", "egress_drop", "seed"):
        if getattr(args, flag) is not None:
            config.setdefault("faults", {})[flag] = getattr(args, flag)
    if args.job:
        flagged = {j["job_id"] for j in args.job}
        config["jobs"] = [j for j in config.get("jobs", []) if j.get("job_id") not in flagged] + list(args.job)
    if args.control_token:
        config["control_token"] = args.control_token
    if args.rate_limit:
        config["rate_limit"] = args.rate_limit

    def ready(info: dict[str, Any]) -> None:
        if args.print_ready:
            print(json.dumps(info), flush=True)
        # a job's packets fit one frame of the data link (docs/network.md)
        mtu = (f", MTU {info['data_mtu']}: up to {info['packet_elems_max']} elements per packet"
               if info.get("data_mtu") else "")
        print(f"fanin switch: data {info['data_addr']} ({info['shards']} shards{mtu}), "
              f"control API {info.get('control_addr') or 'off'}, "
              f"metrics {('http://' + info['metrics_addr'] + '/metrics') if info.get('metrics_addr') else 'off'}; "
              "Ctrl-C to stop", file=sys.stderr, flush=True)

    try:
        text = config_json(config)
    except ValueError as e:
        print(f"fanin switch: {e}", file=sys.stderr)
        return 2
    return _run_foreground("fanin switch", _native.run_switch, text, ready)


def _run_foreground(name: str, run: Any, config: str, ready: Any) -> int:
    """Run a native daemon (its config as JSON) until SIGINT/SIGTERM; exit 2 on a bad config, 1 on a start
    failure."""
    from fanin import _native

    try:
        run(config, ready)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except _native.FaninError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    print(f"{name}: stopped", file=sys.stderr)
    return 0


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="switch + 4 workers on 127.0.0.1 with 5%% loss, then on rate-limited links",
                          description="Start a switch process and worker processes on 127.0.0.1, allreduce float32 "
                                      "and int32 tensors with injected loss, check every result against the "
                                      "reference; then (as root) the same on 200 Mbit/s links in network "
                                      "namespaces, where aggregation beats Gloo's ring.")
    from fanin.demo import MAX_ELEMENTS, MAX_ROUNDS, MAX_WORKERS

    demo.add_argument("--workers", type=int_in(1, MAX_WORKERS), default=4,
                      help=f"worker processes, 1 to {MAX_WORKERS} (default %(default)s)")
    demo.add_argument("--elements", type=int_in(1, MAX_ELEMENTS), default=1_000_000,
                      help="elements per tensor (default %(default)s)")
    demo.add_argument("--loss", type=drop_probability, default=0.05,
                      help="drop probability on every send, 0 to below 1 (default %(default)s)")
    demo.add_argument("--rounds", type=int_in(1, MAX_ROUNDS), default=2,
                      help="allreduces of each dtype (default %(default)s)")
    demo.add_argument("--shards", type=int_in(1, 64), default=2, help="switch shards, 1 to 64 (default %(default)s)")
    demo.add_argument("--no-network", action="store_true",
                      help="skip the second part: the same on rate-limited links in network namespaces (root), "
                           "next to Gloo's ring when PyTorch is installed")
    demo.add_argument("--json", action="store_true", help="one JSON object on stdout")
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from fanin.demo import run_demo

    return run_demo(workers=args.workers, elements=args.elements, loss=args.loss, rounds=args.rounds,
                    shards=args.shards, as_json=args.json, network=not args.no_network)


def _add_kv(sub: Any) -> None:
    kvd = sub.add_parser("kv", help="key-value aggregation service (ASK)")
    kvsub = kvd.add_subparsers(dest="kv_command", required=True)
    dm = kvsub.add_parser("daemon", help="run the key-value host daemon in the foreground",
                          description="The host daemon of docs/kv.md §10: local API on a Unix socket, "
                                      "control channel (TCP) to other daemons, UDP data channels to the switch.")
    dm.add_argument("--socket", default="/tmp/fanin-kv.sock", help="local API socket (default %(default)s)")
    dm.add_argument("--switch-control", default="127.0.0.1:9100", type=ip_port("127.0.0.1:9100"), metavar="IP:PORT",
                    help="switch control API (default %(default)s)")
    dm.add_argument("--switch-token", help="bearer token of the switch control API")
    dm.add_argument("--control-addr", default="127.0.0.1:0", type=ip_port("127.0.0.1:0"), metavar="IP:PORT",
                    help="daemon control channel, TCP; port 0 picks one (default %(default)s)")
    dm.add_argument("--bind-ip", default="127.0.0.1", type=data_ip,
                    help="this host's address of the UDP data channels, toward the switch (default %(default)s)")
    dm.add_argument("--receive-channels", type=int_in(1, 64), default=1,
                    help="data channels for receivers, 1 to 64 (default 1)")
    dm.add_argument("--send-channels", type=int_in(1, 64), default=1,
                    help="data channels for senders, 1 to 64 (default 1)")
    dm.add_argument("--tenant", type=int_in(0, 2**32 - 1), default=0,
                    help="tenant of the tasks created here (switch memory cap)")
    dm.add_argument("--rto-us", type=int_in(1, 2**32 - 1, "us"), default=20000,
                    help="sender retransmission timeout in us before the first round trip is measured "
                         "(default %(default)s)")
    dm.add_argument("--no-congestion", action="store_true",
                    help="senders keep ASK's fixed window and --rto-us instead of adapting both to the path "
                         "(docs/kv.md, 'Congestion'; for comparison)")
    dm.add_argument("--silence-ms", type=int_in(1, 2**32 - 1, "ms"), default=5000,
                    help="fail a task after this long without traffic, in ms (default %(default)s)")
    dm.add_argument("--config-json", help="the whole config as JSON (overrides the options above)")
    dm.add_argument("--print-ready", action="store_true", help="print one JSON line when ready (for scripts)")
    dm.set_defaults(func=_cmd_kv_daemon)


def _cmd_kv_daemon(args: argparse.Namespace) -> int:
    from fanin import _native

    if args.config_json:
        config = json.loads(args.config_json)
    else:
        config = {"socket_path": args.socket, "switch_control": args.switch_control,
                  "control_addr": args.control_addr, "bind_ip": args.bind_ip,
                  "receive_channels": args.receive_channels, "send_channels": args.send_channels,
                  "tenant": args.tenant, "rto_us": args.rto_us, "congestion": not args.no_congestion, "silence_ms": args.silence_ms}
        if args.switch_token:
            config["switch_token"] = args.switch_token

    def ready(info: dict[str, Any]) -> None:
        if args.print_ready:
            print(json.dumps(info), flush=True)
        print(f"fanin kv daemon: local API {info['socket_path']}, control channel {info['control_addr']}, "
              f"data channels {info['data_addrs']}; Ctrl-C to stop", file=sys.stderr, flush=True)

    return _run_foreground("fanin kv daemon", _native.run_kv_daemon, json.dumps(config), ready)


def _add_keys(sub: Any) -> None:
    keys = sub.add_parser(
        "keys", help="draw a job key and write each rank's member key to its own file (keyed jobs, no controller)",
        description="Write the keys of an authenticated job (docs/security.md) to files only their owner may read: "
                    "the job key, for the switch (--job ...,key_file=), and each rank's member key, derived from it, "
                    "for that rank alone (torch: FANIN_AUTH_KEY_FILE with {rank}; fanin.Session(auth_key=...)). "
                    "Hand each machine only its own ranks' files: a member key lets its holder contribute as "
                    "that rank. Existing files are never replaced. A `fanin controller` does all of this itself.",
        epilog="example:\n"
               "  fanin keys --job-id 1 --ranks 4 --out keys/\n"
               "  fanin switch --job id=1,sources=4,key_file=keys/job1.key\n"
               "  FANIN_SWITCH=HOST:9000 FANIN_JOB_ID=1 FANIN_AUTH_KEY_FILE=keys/job1-rank{rank}.key torchrun ...")
    keys.add_argument("--job-id", type=int, required=True, help="the job the keys are for (member keys depend on it)")
    keys.add_argument("--ranks", type=int, required=True, help="member keys for ranks 0 .. RANKS-1")
    keys.add_argument("--out", required=True, help="directory for the files (created, mode 0700, if missing)")
    keys.add_argument("--job-key-file", help="derive the member keys from this job key instead of drawing a new one "
                                             "(more ranks for a running job)")
    keys.add_argument("--json", action="store_true", help="one JSON object on stdout (paths, never keys)")
    keys.set_defaults(func=_cmd_keys)


def _cmd_keys(args: argparse.Namespace) -> int:
    import os

    from fanin.auth import derive_member_key, new_job_key, read_key_file, write_key_file

    if args.ranks < 1 or args.ranks > 2048:
        # worker ranks lie below the tree's switch ranks (SWITCH_RANK_BASE)
        raise ValueError(f"--ranks {args.ranks}: give 1 to 2048 ranks (a job's worker ranks are 0..2047)")
    if args.job_id < 0 or args.job_id > 0xFFFF_FFFF:
        raise ValueError(f"--job-id {args.job_id} is not a 32-bit job id")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file: give a directory (made if missing)")
    try:
        os.makedirs(args.out, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {args.out}: cannot make the directory ({e.strerror}): give one you can write") from None
    if os.stat(args.out).st_mode & 0o077:
        # the files are 0600 whatever the folder; say so rather than chmod a folder we did not make
        print(f"fanin keys: note: {args.out} is open to other users (the key files themselves are not)",
              file=sys.stderr)
    job_file = os.path.join(args.out, f"job{args.job_id}.key")
    if args.job_key_file:
        job_key, job_file = read_key_file(args.job_key_file), args.job_key_file
    else:
        job_key = new_job_key()
        try:
            write_key_file(job_file, job_key)
        except FileExistsError:
            raise ValueError(f"{job_file} exists; give it as --job-key-file to derive from it, or choose another "
                             "--out") from None
    pattern = os.path.join(args.out, f"job{args.job_id}-rank{{rank}}.key")
    written = []
    for rank in range(args.ranks):
        path = pattern.replace("{rank}", str(rank))
        try:
            write_key_file(path, derive_member_key(job_key, args.job_id, rank))
        except FileExistsError:
            raise ValueError(f"{path} exists (written {len(written)} of {args.ranks}); keys are never replaced: "
                             "remove the old ones or choose another --out") from None
        written.append(path)
    if args.json:
        print(json.dumps({"job_id": args.job_id, "job_key_file": job_file, "member_key_files": written,
                          "auth_key_file_pattern": pattern}))
        return 0
    print(f"job {args.job_id}: job key in {job_file} (the switch's), member keys in {pattern} for ranks "
          f"0..{args.ranks - 1}, each readable by its owner only")
    print(f"  switch: fanin switch --job id={args.job_id},sources={args.ranks},key_file={job_file}")
    print(f"  torch:  FANIN_SWITCH=HOST:PORT FANIN_JOB_ID={args.job_id} FANIN_AUTH_KEY_FILE={pattern} torchrun ...")
    print(f"  python: fanin.Session(addr, {args.job_id}, rank, auth_key=fanin.read_key_file(...))")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fanin.controller.command import add_parser as add_controller_parser
    from fanin.goat.command import add_plan_parser

    parser = Parser(
        prog="fanin",
        description="In-network aggregation you can run today: a software aggregation switch, "
                    "its worker library, demos and benchmarks.",
        epilog=EPILOG_MAIN)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_switch(sub)
    _add_demo(sub)
    _add_keys(sub)
    _add_forwarded(sub, "bench")
    _add_forwarded(sub, "sim")
    _add_kv(sub)
    _add_forwarded(sub, "testbed")
    add_controller_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        return _forward(argv)
    return dispatch(build_parser(), argv, listing="plan")
