"""The `fanin` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

EPILOG_MAIN = """\
examples:
  fanin demo                                   # switch + 4 workers on 127.0.0.1, 5% loss, checked results
  fanin switch --job id=1,sources=4            # run a switch with one 4-worker job
  fanin switch --config switch.toml            # ... or from a config file (see docs/operations.md)
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
  fanin kv daemon --socket /tmp/fanin-kv.sock  # key-value host daemon (docs/kv.md)
"""


def _job_arg(text: str) -> dict[str, Any]:
    """Parse 'id=1,sources=4,block_cnt_max=256,block_grad_max=1024,mode=forward'."""
    job: dict[str, Any] = {}
    for part in text.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"job field {part!r} is not key=value")
        k, v = (s.strip() for s in part.split("=", 1))
        k = {"id": "job_id"}.get(k, k)
        if k == "members":
            job[k] = [int(x) for x in v.split(":") if x]
        elif k in ("mode", "key", "on_failure", "result_group"):
            job[k] = v
        elif k == "rate_limit":
            job[k] = _rate_limit_dict(v.replace(":", ","))
        elif k in ("job_id", "sources", "block_cnt_max", "block_grad_max", "block_exp_ms", "slow_after_windows",
                   "member_timeout_ms"):
            try:
                job[k] = int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"job field {k} must be an integer, got {v!r}") from None
        else:
            raise argparse.ArgumentTypeError(
                f"unknown job field {k!r} (use id, sources, members=0:1:2, block_cnt_max, block_grad_max, block_exp_ms, "
                "slow_after_windows, mode, on_failure=degrade|fail, member_timeout_ms, rate_limit=PPS:BURST, key=HEX, "
                "result_group=IPV4:PORT)")
    if "job_id" not in job:
        raise argparse.ArgumentTypeError("a job needs id=N")
    return job


def _rate_limit_dict(text: str) -> dict[str, int]:
    """Parse 'PPS,BURST' (two positive integers)."""
    try:
        pps, burst = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate limit {text!r}: expected PPS,BURST (e.g. 100000,256)") from None
    if pps < 1 or burst < 1:
        raise argparse.ArgumentTypeError(f"rate limit {text!r}: rate and burst must be at least 1")
    return {"pps": pps, "burst": burst}


def _rate_limit_dict_tuple(text: str) -> tuple[int, int]:
    d = _rate_limit_dict(text)
    return d["pps"], d["burst"]


def _cmd_switch(args: argparse.Namespace) -> int:
    from fanin import _native
    from fanin.switch import switch_config

    if args.config:
        try:
            config = json.loads(_native.load_config(args.config))
        except ValueError as e:
            print(f"fanin switch: {args.config}: {e}", file=sys.stderr)
            return 2
    else:
        config = switch_config(
            data_addr=args.data_addr, shards=args.shards,
            control_addr=None if args.control_addr == "off" else args.control_addr,
            metrics_addr=None if args.metrics_addr == "off" else args.metrics_addr,
            memory_mb=args.memory_mb, ingress_drop=args.ingress_drop, egress_drop=args.egress_drop,
            seed=args.seed, jobs=args.job or [],
        )
    if args.control_token:
        config["control_token"] = args.control_token
    if args.rate_limit:
        config["rate_limit"] = args.rate_limit

    def ready(info: dict[str, Any]) -> None:
        if args.print_ready:
            print(json.dumps(info), flush=True)
        print(f"fanin switch: data {info['data_addr']} ({info['shards']} shards), "
              f"control API {info.get('control_addr') or 'off'}, "
              f"metrics {('http://' + info['metrics_addr'] + '/metrics') if info.get('metrics_addr') else 'off'}; "
              "Ctrl-C to stop", file=sys.stderr, flush=True)

    return _run_foreground("fanin switch", _native.run_switch, config, ready)


def _run_foreground(name: str, run: Any, config: dict[str, Any], ready: Any) -> int:
    """Run a native daemon until SIGINT/SIGTERM; exit 2 on a bad config, 1 on a start failure."""
    from fanin import _native

    try:
        run(json.dumps(config), ready)
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from fanin.demo import run_demo

    return run_demo(workers=args.workers, elements=args.elements, loss=args.loss, rounds=args.rounds,
                    shards=args.shards, as_json=args.json)


def _emit(result: dict[str, Any], human: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        print(human, file=sys.stderr)
    else:
        print(human)


def _cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from fanin.bench.runner import AllreduceParams, run_allreduce
    from fanin.proc import format_size, parse_size

    size = parse_size(args.size) if args.size else (16_000_000 if args.quick else 100_000_000)
    p = AllreduceParams(workers=args.workers, elements=max(1, size // 4), dtype=args.dtype,
                        elems_per_packet=args.elems_per_packet, window=args.window, loss=args.loss,
                        iters=args.iters or (3 if args.quick else 7), shards=args.shards, seed=args.seed,
                        auth=args.auth, noaggr=not args.auth, results=args.results)
    s = run_allreduce(p).summary()
    human = (f"fanin allreduce {args.workers} workers x {format_size(size)} {args.dtype}: median {s['median_s']:.3f} s "
             f"({s['goodput_gbps']:.2f} Gbit/s per worker), ")
    if args.auth:
        human += (f"authenticated {s['auth_median_s']:.3f} s ({s['auth_goodput_gbps']:.2f} Gbit/s), "
                  f"auth_goodput_ratio {s['auth_goodput_ratio']:.3f} (CPU: {s.get('auth_cpu_ratio', float('nan')):.3f}), ")
    else:
        human += f"NoAggr {s['noaggr_median_s']:.3f} s, ratio_vs_noaggr {s['ratio_vs_noaggr']:.2f}, "
    human += f"{s['retransmissions']} retransmissions, verified={s['verified']}"

    _emit(s, human, args.json)
    return 0


def _cmd_bench_gloo(args: argparse.Namespace) -> int:
    from fanin.bench.gloo import run_gloo_compare

    return run_gloo_compare(args)


def _cmd_bench_sweep(args: argparse.Namespace) -> int:
    from fanin.bench.sweeps import run_sweep

    return run_sweep(args)


def _cmd_bench_torch(args: argparse.Namespace) -> int:
    try:
        from fanin.bench import torch_bench
    except ImportError as e:
        print(f"fanin bench {args.bench}: {e} (pip install -r requirements-bench.txt)", file=sys.stderr)
        return 2
    return torch_bench.run_torch_allreduce(args) if args.bench == "torch-allreduce" else \
        torch_bench.run_time_to_accuracy(args)


def _cmd_bench_straggler_recovery(args: argparse.Namespace) -> int:
    from fanin.bench.stragglers import run_recovery

    return run_recovery(args)


def _cmd_bench_straggler_iterations(args: argparse.Namespace) -> int:
    from fanin.bench.stragglers import run_iterations

    return run_iterations(args)


def _cmd_bench_overload(args: argparse.Namespace) -> int:
    from fanin.bench.overload import run_overload

    return run_overload(args)


def _cmd_bench_chaos(args: argparse.Namespace) -> int:
    from fanin.bench.chaos import run_bench_chaos

    return run_bench_chaos(args)


def _cmd_bench_flood(args: argparse.Namespace) -> int:
    from fanin.bench.flood import run_flood

    return run_flood(args)


def _find_sim_binary() -> Optional[str]:
    """`target/release/fanin-sim` of the source tree this package lives in, else PATH."""
    import os
    import shutil

    env = os.environ.get("FANIN_SIM")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (os.path.join(here, "..", ".."), os.getcwd()):
        cand = os.path.normpath(os.path.join(up, "target", "release", "fanin-sim"))
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("fanin-sim")


def _minimal_allreduce(rest: list) -> bool:
    """`fanin sim allreduce --star ...` runs the one-switch experiment (fanin-sim's own flags)."""
    if "--star" in rest:
        rest.remove("--star")
        return True
    return False


def _cmd_sim(args: argparse.Namespace) -> int:
    import subprocess

    binary = _find_sim_binary()
    if not binary:
        print("fanin sim: the simulator binary is not built; run `cargo build --release -p fanin-sim` "
              "(or put fanin-sim on PATH, or set FANIN_SIM)", file=sys.stderr)
        return 2
    rest = list(args.sim_args or [])
    no_plot = args.no_plot or "--no-plot" in rest
    rest = [a for a in rest if a != "--no-plot"]
    if args.sim == "goat":
        from fanin.sim_goat import main as sim_goat

        return sim_goat(binary, rest)
    if args.sim == "allreduce" and not _minimal_allreduce(rest):
        from fanin.sim_allreduce import main as sim_allreduce

        return sim_allreduce(binary, rest + (["--no-plot"] if no_plot else []))
    argv = [binary, args.sim] + rest
    if args.sim != "trimming":
        return subprocess.call(argv)
    rc = subprocess.call(argv)
    if rc != 0 or no_plot:
        return rc
    out, figure = "out/sim", None
    for i, a in enumerate(rest[:-1]):
        if a == "--out":
            out = rest[i + 1]
        elif a == "--figure":
            figure = int(rest[i + 1])
    if figure is not None:
        try:
            from fanin.sim_plots import plot_figure

            for path in plot_figure(figure, out):
                print(f"fanin sim: wrote {path}", file=sys.stderr)
        except ImportError as e:
            print(f"fanin sim: no PNG ({e}); the CSV is in {out}", file=sys.stderr)
    return 0


def _cmd_kv_daemon(args: argparse.Namespace) -> int:
    from fanin import _native

    if args.config_json:
        config = json.loads(args.config_json)
    else:
        config = {"socket_path": args.socket, "switch_control": args.switch_control,
                  "control_addr": args.control_addr, "bind_ip": args.bind_ip,
                  "receive_channels": args.receive_channels, "send_channels": args.send_channels,
                  "tenant": args.tenant, "rto_us": args.rto_us, "silence_ms": args.silence_ms}
        if args.switch_token:
            config["switch_token"] = args.switch_token

    def ready(info: dict[str, Any]) -> None:
        if args.print_ready:
            print(json.dumps(info), flush=True)
        print(f"fanin kv daemon: local API {info['socket_path']}, control channel {info['control_addr']}, "
              f"data channels {info['data_addrs']}; Ctrl-C to stop", file=sys.stderr, flush=True)

    return _run_foreground("fanin kv daemon", _native.run_kv_daemon, config, ready)


def _cmd_bench_kv_traffic(args: argparse.Namespace) -> int:
    from fanin.bench.kv_wordcount import run_kv_traffic

    return run_kv_traffic(args)


def _cmd_bench_kv_wordcount(args: argparse.Namespace) -> int:
    from fanin.bench.kv_wordcount import run_kv_wordcount

    return run_kv_wordcount(args)


def _cmd_bench_kv_window(args: argparse.Namespace) -> int:
    from fanin.bench.kv_wordcount import run_kv_window

    return run_kv_window(args)


def _cmd_bench_kv(args: argparse.Namespace) -> int:
    from fanin.bench.kv import run_kv_prioritisation

    return run_kv_prioritisation(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fanin",
        description="In-network aggregation you can run today: a software aggregation switch, "
                    "its worker library, demos and benchmarks.",
        epilog=EPILOG_MAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sw = sub.add_parser("switch", help="run a software aggregation switch in the foreground",
                        description="Run the fanin switch daemon until SIGINT/SIGTERM. Shard i listens on the data "
                                    "port + i; jobs come from --job/--config or the control API.",
                        epilog="example: fanin switch --shards 2 --job id=1,sources=4,block_cnt_max=256",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sw.add_argument("--config", help="TOML or JSON config file (overrides the other flags)")
    sw.add_argument("--data-addr", default="127.0.0.1:9000", help="data port of shard 0 (default %(default)s)")
    sw.add_argument("--shards", type=int, default=1, help="processing threads, one data port each (default %(default)s)")
    sw.add_argument("--control-addr", default="127.0.0.1:9100", help="gRPC control API address or 'off'")
    sw.add_argument("--control-token", help="bearer token the control API requires (default: $FANIN_CONTROL_TOKEN; "
                                             "required when --control-addr is not a loopback address)")
    sw.add_argument("--metrics-addr", default="127.0.0.1:9101", help="Prometheus endpoint address or 'off'")
    sw.add_argument("--memory-mb", type=int, default=1024, help="aggregation memory for all jobs (default %(default)s)")
    sw.add_argument("--job", action="append", type=_job_arg, metavar="id=N,sources=N[,...]",
                    help="admit a job at start (repeatable); fields: id, sources or members=0:1:2, "
                         "block_cnt_max, block_grad_max, block_exp_ms, slow_after_windows, mode=aggregate|forward, "
                         "key=32 hex digits (an authenticated job, docs/security.md), "
                         "on_failure=degrade|fail (when a worker dies, docs/failures.md; unset: fail, or degrade "
                         "with block_exp_ms), member_timeout_ms (0 = 5000), "
                         "rate_limit=PPS:BURST (per source), result_group=239.1.0.7:47001 (results once to this "
                         "multicast group for workers listening there, docs/protocol.md 4.5)")
    sw.add_argument("--rate-limit", type=_rate_limit_dict, metavar="PPS,BURST",
                    help="per-source rate limit for jobs that set none: each worker may send PPS contributions "
                         "per second and BURST back to back; the excess is answered with a Trimmed nack so it "
                         "slows down (docs/overload.md). Default: unlimited")
    sw.add_argument("--ingress-drop", type=float, default=0.0, help="fault injection: drop probability on receive")
    sw.add_argument("--egress-drop", type=float, default=0.0, help="fault injection: drop probability on send")
    sw.add_argument("--seed", type=int, default=0, help="seed of the fault injection")
    sw.add_argument("--print-ready", action="store_true", help="print one JSON line on stdout once the ports are bound")
    sw.set_defaults(func=_cmd_switch)

    demo = sub.add_parser("demo", help="switch + 4 workers on 127.0.0.1 with 5%% loss, results checked",
                          description="Start a switch process and worker processes on 127.0.0.1, allreduce float32 "
                                      "and int32 tensors with injected loss, check every result against the reference.")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--elements", type=int, default=1_000_000, help="elements per tensor (default %(default)s)")
    demo.add_argument("--loss", type=float, default=0.05, help="drop probability on every send (default %(default)s)")
    demo.add_argument("--rounds", type=int, default=2)
    demo.add_argument("--shards", type=int, default=2)
    demo.add_argument("--json", action="store_true", help="one JSON object on stdout")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (JSON with --json; --quick for a ~1 minute run)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")

    def common(b: argparse.ArgumentParser) -> None:
        b.add_argument("--json", action="store_true", help="print one JSON object on stdout (summary to stderr)")
        b.add_argument("--quick", action="store_true", help="reduced run that finishes in about a minute")
        b.add_argument("--seed", type=int, default=1)

    def results_option(b: argparse.ArgumentParser) -> None:
        b.add_argument("--results", choices=["multicast", "unicast"], default="multicast",
                       help="how the switch delivers results: once to the job's multicast group on loopback, which "
                            "every worker listens on, or a copy to each worker (default %(default)s; NoAggr and "
                            "keyed jobs are unicast either way)")

    ar = bsub.add_parser("allreduce", help="fanin allreduce vs the NoAggr baseline through the same daemon",
                         description="Time allreduce through a switch process with N worker processes, and the same "
                                     "packets through the same daemon with aggregation replaced by forwarding "
                                     "(NoAggr, ASK §5.7), alternating in one run. Every worker's result is verified.")
    ar.add_argument("--workers", type=int, default=4)
    ar.add_argument("--size", help="tensor size per worker, e.g. 100MB (default 100MB, 16MB with --quick)")
    ar.add_argument("--dtype", default="float32", choices=["float32", "int32"])
    ar.add_argument("--elems-per-packet", type=int, default=1024)
    ar.add_argument("--window", type=int, default=256, help="blocks in flight (= the job's block_cnt_max)")
    ar.add_argument("--loss", type=float, default=0.0, help="drop probability on every send, both directions")
    ar.add_argument("--iters", type=int, help="timed iterations (default 7, 3 with --quick)")
    ar.add_argument("--shards", type=int, default=1)
    results_option(ar)
    ar.add_argument("--auth", action="store_true",
                    help="compare against the same allreduce on an authenticated job (every datagram sealed and "
                         "verified, docs/security.md) instead of NoAggr; reports auth_goodput_ratio and auth_cpu_ratio "
                         "(CPU seconds of workers and switch per allreduce, unkeyed / keyed)")
    common(ar)
    ar.set_defaults(func=_cmd_bench_allreduce)

    gl = bsub.add_parser("gloo-compare", help="fanin vs torch.distributed Gloo allreduce, side by side",
                         description="Run torch.distributed Gloo allreduce (what a PyTorch user has today) and fanin "
                                     "allreduce at the same N and size in the same run.")
    gl.add_argument("--workers", type=int, default=4)
    gl.add_argument("--size", help="tensor size per worker (default 100MB, 16MB with --quick)")
    gl.add_argument("--elems-per-packet", type=int, default=4096)
    gl.add_argument("--window", type=int, default=128)
    gl.add_argument("--shards", type=int, default=1)
    results_option(gl)
    gl.add_argument("--iters", type=int)
    common(gl)
    gl.set_defaults(func=_cmd_bench_gloo)

    for name, help_text in (("epp-sweep", "aggregation latency vs elements per packet (Trio Fig. 15)"),
                            ("window-sweep", "throughput and latency vs window (Trio Fig. 16)")):
        sp = bsub.add_parser(name, help=help_text, description=help_text + "; writes CSV and PNG to --out.")
        sp.add_argument("--workers", type=int, default=4)
        sp.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
        common(sp)
        sp.set_defaults(func=_cmd_bench_sweep, sweep=name)

    sr = bsub.add_parser("straggler-recovery", help="time to a partial result vs the timeout (Trio Fig. 14)",
                         description="One member of the job never sends; for timeouts 1-50 ms the two others stream "
                                     "20 back-to-back blocks and measure each block's time from first send to its "
                                     "partial result, with Trio's single REF flag (checks=1) and fanin's default "
                                     "(checks=4) side by side. Writes CSV and PNG to --out.")
    sr.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    common(sr)
    sr.set_defaults(func=_cmd_bench_straggler_recovery)

    si = bsub.add_parser("straggler-iterations", help="iteration time under the Slow Worker Pattern (Trio Fig. 13)",
                         description="Worker processes run iterations of compute + allreduce of a model-sized tensor "
                                     "(25M float32; 2M with --quick); at three delay points per iteration one worker "
                                     "straggles with probability p for U(0.5, 2) x the typical iteration time. fanin "
                                     "with mitigation vs without (SwitchML behaviour) vs an ideal run, one run.")
    si.add_argument("--workers", type=int, default=4)
    si.add_argument("--iters", type=int, help="iterations per arm (default 20, 10 with --quick)")
    si.add_argument("--compute-ms", type=float, default=100.0, help="simulated compute per iteration (default %(default)s)")
    si.add_argument("--block-exp-ms", type=int, default=50,
                    help="straggler timeout of the mitigation arm (default %(default)s; Trio uses 10 ms on dedicated "
                         "hosts, but 5 processes sharing 2 cores are descheduled for longer than that)")
    si.add_argument("--slow-after-windows", type=int, default=1,
                    help="K of the mitigation arm: windows a worker may miss before it is declared slow (default %(default)s)")
    si.add_argument("--probs", type=float, nargs="+", help="straggling probabilities (default 0 0.04 0.08 0.16 0.32)")
    si.add_argument("--arms", nargs="+", choices=["mitigation", "none"], help="arms besides ideal (default both)")
    si.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    common(si)
    si.set_defaults(func=_cmd_bench_straggler_iterations)

    ov = bsub.add_parser("overload", help="allreduce through an overloaded switch, trimming on vs off (NDP return-to-sender)",
                         description="Two switches, identical but for [trim] enabled, one overloaded shard each "
                                     "(small receive buffer, full windows from every worker); each worker "
                                     "alternates between them. Completion time, kernel drops, trims and "
                                     "retransmissions per arm, and trim/drop ratios. Writes CSV and PNG to --out. "
                                     "Under overload the drop arm's allreduces have a long tail (seconds, "
                                     "occasionally minutes): --quick usually takes well under a minute, not always.")
    ov.add_argument("--workers", type=int, default=4)
    ov.add_argument("--windows", type=int, nargs="+", help="worker windows (default 256)")
    ov.add_argument("--socket-buffers", type=int, nargs="+",
                    help="receive buffers requested per switch socket, bytes, one point each (the kernel doubles "
                         "them; default 4194304 1048576 524288, 1048576 with --quick)")
    ov.add_argument("--size", type=int, help="bytes per worker (default 4000000)")
    ov.add_argument("--iters", type=int, help="timed allreduces per arm and point (default 7; 3 with --quick)")
    ov.add_argument("--watermark", type=float, default=0.5,
                    help="trim arm: fraction of the receive buffer above which it trims (default %(default)s)")
    ov.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    common(ov)
    ov.set_defaults(func=_cmd_bench_overload)

    ch = bsub.add_parser("chaos", help="chaos soak on the namespace testbed: faults injected while jobs run (root)",
                         description="Value-stream jobs (int32 with straggler aging, float32) and key-value word "
                                     "counts over real text run through one switch daemon on the namespace testbed "
                                     "while a seeded driver injects one fault at a time (on top of seeded loss, duplication and "
                                     "reordering at every worker): garbage datagrams, forged packets, captured packets "
                                     "replayed (value jobs and keyed key-value tasks), workers killed "
                                     "and restarted, the switch daemon killed and restarted. Workers verify every "
                                     "result. Exit 0 only with zero wrong results, zero hangs and every injected "
                                     "packet accounted for by the switch counters. Report: JSON in --out.",
                         epilog="examples:\n  fanin bench chaos --quick --json\n"
                                "  fanin bench chaos --duration 600 --seed 7\n"
                                "  fanin bench chaos --quick --skip restart_switch replay",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    ch.add_argument("--duration", type=float, default=600.0, help="seconds of chaos (default %(default)s; --quick: 60)")
    ch.add_argument("--hang-s", type=float, default=30.0,
                    help="a worker or kv task without progress this long counts as hung (default %(default)s)")
    ch.add_argument("--skip", nargs="*", default=[], metavar="FAULT",
                    help="fault kinds to leave out (garbage forge replay kill_worker restart_switch "
                         "kv_forge kv_replay kill_kv_sender)")
    ch.add_argument("--no-kv", action="store_true", help="value-stream jobs only")
    ch.add_argument("--out", default="out/chaos", help="directory for the JSON report (default %(default)s)")
    common(ch)
    ch.set_defaults(func=_cmd_bench_chaos)

    fl = bsub.add_parser("flood", help="job isolation: one job's allreduce while another job's sender floods, "
                                       "with and without a per-source rate limit",
                         description="One switch (one shard), job A's worker processes allreduce while a flooder "
                                     "process sends a raw UDP flood of valid contributions to job B (no rate limit) "
                                     "or job C (rate limited), or into a socket nobody reads (what the flood "
                                     "costs the machine before any switch sees it), or stays quiet; the four "
                                     "arms alternate per iteration at one paced flood rate. Reports job A's "
                                     "goodput per arm, its ratio to the quiet arm, and the isolation: job A's "
                                     "goodput with the flood at the switch vs into the sink. docs/overload.md.")
    fl.add_argument("--workers", type=int, default=2, help="job A's workers (default %(default)s)")
    fl.add_argument("--size", type=int, help="bytes per worker (default 8000000, 2000000 with --quick)")
    fl.add_argument("--iters", type=int, help="timed allreduces per arm (default 10, 4 with --quick)")
    fl.add_argument("--limit", type=_rate_limit_dict_tuple, default=(2000, 64), metavar="PPS,BURST",
                    help="job C's per-source rate limit (default 2000,64)")
    fl.add_argument("--flood-pps", type=int, default=50_000,
                    help="the flooder's paced rate, the same in every arm (default %(default)s)")
    common(fl)
    fl.set_defaults(func=_cmd_bench_flood)

    sim = sub.add_parser("sim", help="the packet-level simulator (fanin-sim): trimming study, incast, permutation, allreduce, GOAT, event rate",
                         description="Run the Rust simulator binary fanin-sim (build it with "
                                     "`cargo build --release -p fanin-sim`). Arguments after the subcommand are passed "
                                     "through; for `trimming` the CSV it writes is also plotted to PNG.",
                         epilog="examples:\n  fanin sim trimming --figure 6 --quick --json\n"
                                "  fanin sim trimming --figure 5 --out out/sim\n  fanin sim bench-events --runs 5\n"
                                "  fanin sim allreduce --quick --loss 0.01 --json   (see fanin sim allreduce --help; "
                                "--star: the one-switch fanin-sim allreduce)\n"
                                "  fanin sim goat --quick --json   (a GOAT study point at packet level vs flow level; "
                                "see fanin sim goat --help)",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("sim", choices=["trimming", "incast", "permutation", "allreduce", "goat", "bench-events"],
                     help="simulator command (see `fanin-sim --help`)")
    sim.add_argument("--no-plot", action="store_true", help="CSV/JSON only, no PNG")
    sim.add_argument("sim_args", nargs=argparse.REMAINDER, help="passed to fanin-sim (e.g. --figure 6 --quick --json)")
    sim.set_defaults(func=_cmd_sim)

    kv = bsub.add_parser("kv-prioritisation", help="key-value on-switch aggregation vs memory (ASK Fig. 9)",
                         description="On-switch aggregation ratio vs aggregator-to-distinct-key ratio, with and "
                                     "without shadow copies, on Uniform/Zipf/Zipf-reversed streams; runs the real "
                                     "key-value machines (cargo example kv_prioritisation) and writes CSV and PNG.")
    kv.add_argument("--out", default="docs/figures/kv", help="directory for CSV and PNG (default %(default)s)")
    kv.add_argument("--tuples", type=int, help="tuples per stream (default 2^24, 2^20 with --quick)")
    kv.add_argument("--keys", type=int, help="distinct keys (default 2^16)")
    kv.add_argument("--zipf-s", type=float, help="Zipf exponent (default 1.0)")
    kv.add_argument("--swap-threshold", type=int, help="arrived packets per shadow-copy swap (default 64)")
    kv.add_argument("--window", type=int, help="sender window W (default 256)")
    kv.add_argument("--slots", type=int, help="tuple slots = aggregator arrays (default 32)")
    kv.add_argument("--datasets", help="comma list of uniform,zipf,zipf-reverse,zipf-shuffled")
    kv.add_argument("--ratios", help="aggregator/key ratio exponents LO..HI[:STEP] (default -12..0, "
                                     "-12..0:2 with --quick)")
    kv.add_argument("--verbose", action="store_true", help="show the example's progress on stderr")
    common(kv)
    kv.set_defaults(func=_cmd_bench_kv)

    def corpus_options(b: argparse.ArgumentParser, repeats_help: str) -> None:
        """The word-count benches' corpus, repeat and AA-size options."""
        b.add_argument("--corpus-mb", type=float, help="corpus size in MB (default 64, 8 with --quick)")
        b.add_argument("--repeats", type=int, help=repeats_help)
        b.add_argument("--aa-size", type=int, default=4096, help="aggregators per AA per copy (default %(default)s)")
        common(b)

    for name, func, help_text in (
        ("kv-traffic", _cmd_bench_kv_traffic,
         "word counts over real text through switch + kv daemon: tuples/packets absorbed (ASK Table 1, Fig. 8b)"),
        ("kv-wordcount", _cmd_bench_kv_wordcount,
         "WordCount: fanin vs PreAggr vs PySpark reduceByKey vs Spark DataFrame groupBy, results checked equal"),
    ):
        wc = bsub.add_parser(name, help=help_text, description=help_text + "; writes CSV and PNG to --out.")
        wc.add_argument("--out", default="docs/figures/kv", help="directory for CSV and PNG (default %(default)s)")
        corpus_options(wc, "runs per system, median reported (default 3, 1 with --quick)")
        wc.set_defaults(func=func)

    kw = bsub.add_parser("kv-window", help="fanin WordCount time at several sender windows (the default W's measurement)",
                         description="The fanin arm of kv-wordcount only, at each window of --windows, interleaved "
                                     "in one process against one switch and daemon; every count is checked against "
                                     "Counter. Reports the median time and the share of packets retransmitted.")
    kw.add_argument("--windows", default="1024,2048,4096", help="comma list of windows, 1..4096 (default %(default)s)")
    kw.add_argument("--auth", action="store_true", help="keyed tasks (every datagram sealed)")
    corpus_options(kw, "runs per window (default 5, 2 with --quick)")
    kw.set_defaults(func=_cmd_bench_kv_window)

    kvd = sub.add_parser("kv", help="key-value aggregation service (ASK)")
    kvsub = kvd.add_subparsers(dest="kv_command", required=True)
    dm = kvsub.add_parser("daemon", help="run the key-value host daemon in the foreground",
                          description="The host daemon of docs/kv.md §10: local API on a Unix socket, "
                                      "control channel (TCP) to other daemons, UDP data channels to the switch.")
    dm.add_argument("--socket", default="/tmp/fanin-kv.sock", help="local API socket (default %(default)s)")
    dm.add_argument("--switch-control", default="127.0.0.1:9100", help="switch control API (default %(default)s)")
    dm.add_argument("--switch-token", help="bearer token of the switch control API")
    dm.add_argument("--control-addr", default="127.0.0.1:0", help="daemon control channel, TCP (default %(default)s)")
    dm.add_argument("--bind-ip", default="127.0.0.1", help="address of the UDP data channels (default %(default)s)")
    dm.add_argument("--receive-channels", type=int, default=1, help="data channels for receivers (default 1)")
    dm.add_argument("--send-channels", type=int, default=1, help="data channels for senders (default 1)")
    dm.add_argument("--tenant", type=int, default=0, help="tenant of the tasks created here (switch memory cap)")
    dm.add_argument("--rto-us", type=int, default=20000, help="sender retransmission timeout in us (default %(default)s)")
    dm.add_argument("--silence-ms", type=int, default=5000, help="fail a task after this long without traffic")
    dm.add_argument("--config-json", help="the whole config as JSON (overrides the options above)")
    dm.add_argument("--print-ready", action="store_true", help="print one JSON line when ready (for scripts)")
    dm.set_defaults(func=_cmd_kv_daemon)

    _add_torch_benches(bsub, common)
    _add_tree_benches(bsub, common)
    _add_testbed(sub)

    from fanin.controller.command import add_parser as add_controller_parser

    add_controller_parser(sub)

    from fanin.goat.command import add_bench_parser, add_plan_parser

    add_bench_parser(bsub, common)
    add_plan_parser(sub)
    return parser


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
  fanin testbed exec s0 -- python3 -m fanin switch --data-addr 0.0.0.0:9000 \\
        --control-addr MGMT_IP:9100 --job id=1,sources=2
  fanin testbed down                            # idempotent; removes processes started inside too
"""


def _cmd_testbed(args: argparse.Namespace) -> int:
    import os

    from fanin import testbed, topology

    try:
        if args.action == "up":
            topo = topology.load(args.topology)
            tb = testbed.Testbed.up(topo, name=args.name, rate_mbit=args.rate_mbit, routing=args.routing)
            st = tb.state
            _emit(tb.status(), f"fanin testbed {tb.name}: {topo.name} up, {len(st['nodes'])} namespaces "
                               f"({tb.name}-*), {len(st['links'])} links, management {st['mgmt_net']} "
                               f"(root {st['root_mgmt_addr']} on {st['bridge']}), offloads {st['offloads']}",
                  args.json)
        elif args.action == "down":
            removed = testbed.down(args.name)
            _emit(removed, f"fanin testbed {args.name}: down ({removed['namespaces']} namespaces, "
                           f"{removed['processes']} processes, {removed['root_links']} root links removed)", args.json)
        elif args.action == "status":
            names = [args.name] if args.name else testbed.list_testbeds()
            if not names:
                _emit({}, "fanin testbed: none up", args.json)
            for name in names:
                tb = testbed.Testbed.attach(name)
                _emit(tb.status(), _describe_testbed(tb), args.json)
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


def _add_testbed(sub: Any) -> None:
    tb = sub.add_parser("testbed", help="network-namespace testbed: a topology of namespaces, veth links, tbf limits",
                        description="Build a topology (file or generator spec) out of Linux network namespaces and "
                                    "veth links, run commands inside, take it down again.",
                        epilog=EPILOG_TESTBED, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _add_tree_benches(bsub: Any, common: Any) -> None:
    tl = bsub.add_parser("tree-levels", help="trees of 1, 2, 3 levels vs one switch on the testbed (SwitchML++ thesis)",
                         description="2 workers, CHUNKS blocks, loss in each worker-switch direction, rate-limited "
                                     "links: one switch (job admitted directly) and trees of 1, 2 and 3 levels "
                                     "built by the controller, interleaved; means, quartiles, Mann-Whitney U vs 1 "
                                     "level; CSV + PNG to --out. Needs root (network namespaces).")
    tl.add_argument("--reps", type=int, help="allreduces per configuration (default 50, 10 with --quick)")
    tl.add_argument("--chunks", type=int, default=42, help="blocks per allreduce (default %(default)s, as the thesis)")
    tl.add_argument("--elems-per-packet", type=int, default=256)
    tl.add_argument("--window", type=int, default=64)
    tl.add_argument("--loss", type=float, default=0.3, help="drop probability in each worker-switch direction")
    tl.add_argument("--rate-mbit", type=float, default=1000.0, help="tbf limit on every link (default 1 Gbit/s)")
    tl.add_argument("--out", default="out/trees")
    common(tl)
    tl.set_defaults(func=lambda a: __import__("fanin.bench.trees", fromlist=["x"]).run_tree_levels(a))
    ts = bsub.add_parser("tree-scaling", help="8 workers: 2-level tree vs one switch, bytes on the veth links",
                         description="8 workers over a 2-level tree (1 spine, 2 leaves) built by the controller vs "
                                     "one switch (star:8), interleaved on the testbed; completion time and the "
                                     "bytes measured on every veth link. Needs root.")
    ts.add_argument("--size", help="tensor per worker (default 8MB, 1MB with --quick)")
    ts.add_argument("--reps", type=int, help="allreduces per configuration (default 10, 3 with --quick)")
    ts.add_argument("--elems-per-packet", type=int, default=1024)
    ts.add_argument("--window", type=int, default=64)
    ts.add_argument("--rate-mbit", type=float, default=1000.0)
    ts.add_argument("--out", default="out/trees")
    common(ts)
    ts.set_defaults(func=lambda a: __import__("fanin.bench.trees", fromlist=["x"]).run_tree_scaling(a))


def _add_torch_benches(bsub: Any, common: Any) -> None:
    ta = bsub.add_parser("torch-allreduce", help="torch.distributed all_reduce: fanin backend vs Gloo, side by side",
                         description="dist.all_reduce through the 'fanin' backend and through 'gloo' at each process "
                                     "count and size, alternating, on loopback; writes CSV and PNG to --out.")
    ta.add_argument("--workers", help="comma-separated process counts (default 2,4,8; 2,4 with --quick)")
    ta.add_argument("--sizes", help="comma-separated sizes (default 1MB,16MB,64MB,256MB; 1MB,16MB with --quick)")
    ta.add_argument("--elems-per-packet", type=int, default=1024)
    ta.add_argument("--window", type=int, default=256)
    ta.add_argument("--iters", type=int, help="timed iterations per point (default 5, 3 for >=64MB or --quick)")
    ta.add_argument("--switch-process", action="store_true",
                    help="run the switch as its own process (FANIN_SWITCH) instead of embedded in rank 0")
    ta.add_argument("--out", default="out/bench/torch", help="directory for CSV and PNG (default %(default)s)")
    common(ta)
    ta.set_defaults(func=_cmd_bench_torch)

    tt = bsub.add_parser("time-to-accuracy", help="digits MLP training with stragglers (cf. Trio-ML Fig. 12)",
                         description="Train an MLP on scikit-learn's digits with torchrun: fanin with straggler "
                                     "mitigation (block_exp_ms), fanin without it, and Gloo without stragglers "
                                     "(the ideal), under the Slow Worker Pattern; writes CSV and PNG to --out.")
    tt.add_argument("--workers", type=int, default=4)
    tt.add_argument("--straggler-p", type=float, default=0.16)
    tt.add_argument("--block-exp-ms", type=int, default=10, help="block aging of the mitigation arm (default 10)")
    tt.add_argument("--typical-iter-s", type=float, help="straggler scale (default: Gloo's median iteration time)")
    tt.add_argument("--target-acc", type=float, default=0.95)
    tt.add_argument("--epochs", type=int, help="epochs per run (default 30, 10 with --quick)")
    tt.add_argument("--eval-every", type=int, default=5)
    tt.add_argument("--repeats", type=int, help="runs per arm (default 3, 1 with --quick)")
    tt.add_argument("--out", default="out/bench/torch", help="directory for CSV and PNG (default %(default)s)")
    common(tt)
    tt.set_defaults(func=_cmd_bench_torch)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        if getattr(args, "command", None) in ("bench", "plan"):
            parser.parse_args([args.command, "--help"])
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as e:
        print(f"fanin {args.command}: {e}", file=sys.stderr)
        return 1
