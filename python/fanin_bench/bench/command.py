"""`fanin bench ...`: the benchmark sub-parsers. Each bench's code is imported when it runs (`_lazy`), so
`fanin bench X --help` needs neither torch nor matplotlib."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable

from fanin._cli_util import rate_limit_tuple
from fanin_bench.plotting import set_quick

__all__ = ["register"]


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """The command function `fanin_bench.bench.<module>.<function>(args)`, imported when called."""
    def run(args: argparse.Namespace) -> int:
        set_quick(getattr(args, "quick", False))
        return getattr(importlib.import_module(f"fanin_bench.bench.{module}"), function)(args)

    return run


def _run_torch(args: argparse.Namespace) -> int:
    set_quick(getattr(args, "quick", False))
    # torch is an optional extra: say how to get it instead of a traceback.
    try:
        from fanin_bench.bench import torch_bench
    except ImportError as e:
        print(f"fanin bench {args.bench}: {e} (pip install -r requirements-bench.txt)", file=sys.stderr)
        return 2
    if args.bench == "torch-allreduce":
        return torch_bench.run_torch_allreduce(args)
    if args.model == "lm":
        from fanin_bench.bench import lm_steps

        return lm_steps.run_lm_time_to_accuracy(args)
    return torch_bench.run_time_to_accuracy(args)


def _lm_model_args(p: argparse.ArgumentParser) -> None:
    """The language model's size and device (examples/train_lm.py)."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="windows per worker per step (default %(default)s)")
    p.add_argument("--context", type=int, default=64, help="bytes per window (default %(default)s)")
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size, MB (torch's default %(default)s)")
    p.add_argument("--corpus", default="/usr/share/doc", help="text to train on: a directory or one file "
                   "(default %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or auto (the ranks share the GPU; the namespaces do not hide it) "
                        "(default %(default)s)")


def _cluster_option(b: argparse.ArgumentParser) -> None:
    b.add_argument("--cluster", action="store_true",
                   help="run Spark as a standalone cluster started here (a master and 2 worker JVMs with 1 core "
                        "each, each worker with its own fanin kv daemon; fanin.spark.cluster) instead of local[2]: "
                        "tasks in executor processes apart from the driver, each receiver on its worker's daemon")


def _common(b: argparse.ArgumentParser) -> None:
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout (summary to stderr)")
    b.add_argument("--quick", action="store_true", help="reduced run that finishes in about a minute")
    b.add_argument("--seed", type=int, default=1)


def _results_option(b: argparse.ArgumentParser) -> None:
    b.add_argument("--results", choices=["multicast", "unicast"], default="multicast",
                   help="how the switch delivers results: once to the job's multicast group on loopback, which "
                        "every worker listens on, or a copy to each worker (default %(default)s; a keyed job's "
                        "group results are sealed once under its result key; NoAggr is unicast either way)")


def _corpus_options(b: argparse.ArgumentParser, repeats_help: str) -> None:
    """The word-count benches' corpus, repeat and AA-size options."""
    b.add_argument("--corpus-mb", type=float, help="corpus size in MB (default 64, 8 with --quick)")
    b.add_argument("--repeats", type=int, help=repeats_help)
    b.add_argument("--aa-size", type=int, default=4096, help="aggregators per AA per copy (default %(default)s)")
    _common(b)


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON with --json; --quick for a ~1 minute run)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    _add_value_benches(bsub)
    _add_kv_benches(bsub)
    _add_torch_benches(bsub)
    _add_tree_benches(bsub)
    _add_goat_benches(bsub)


def _add_value_benches(bsub: Any) -> None:
    """allreduce, gloo-compare, the sweeps, the straggler, overload, chaos and flood benches."""
    ar = bsub.add_parser("allreduce", help="fanin allreduce vs the NoAggr baseline through the same daemon",
                         description="Time allreduce through a switch process with N worker processes, and the same "
                                     "packets through the same daemon with aggregation replaced by forwarding "
                                     "(NoAggr, ASK §5.7), alternating in one run. Every worker's result is verified.")
    ar.add_argument("--workers", type=int, default=4, help="worker processes (default %(default)s)")
    ar.add_argument("--size", help="tensor size per worker, e.g. 100MB (default 100MB, 16MB with --quick)")
    ar.add_argument("--dtype", default="float32", choices=["float32", "int32"], help="(default %(default)s)")
    ar.add_argument("--elems-per-packet", type=int, default=1024, help="elements per datagram (default %(default)s)")
    ar.add_argument("--window", type=int, default=256,
                    help="blocks in flight (= the job's block_cnt_max; default %(default)s)")
    ar.add_argument("--loss", type=float, default=0.0,
                    help="drop probability on every send, both directions (default %(default)s)")
    ar.add_argument("--iters", type=int, help="timed iterations (default 7, 3 with --quick)")
    ar.add_argument("--shards", type=int, default=1, help="switch shards (default %(default)s)")
    _results_option(ar)
    ar.add_argument("--auth", action="store_true",
                    help="compare against the same allreduce on an authenticated job (every datagram sealed and "
                         "verified, docs/security.md) instead of NoAggr; reports auth_goodput_ratio and auth_cpu_ratio "
                         "(CPU seconds of workers and switch per allreduce, unkeyed / keyed)")
    _common(ar)
    ar.set_defaults(func=_lazy("runner", "run_bench_allreduce"))

    gl = bsub.add_parser("gloo-compare", help="fanin vs torch.distributed Gloo allreduce, side by side",
                         description="Run torch.distributed Gloo allreduce (what a PyTorch user has today) and fanin "
                                     "allreduce at the same N and size in the same run: exactly --iters timed "
                                     "allreduces of each, in blocks whose first system alternates. Every result is "
                                     "checked (Gloo's per element against the bound of a recursive sum, fanin's "
                                     "against its block floating point bound); a wrong one fails the run before any "
                                     "figure is reported.")
    gl.add_argument("--workers", type=int, default=4, help="ranks of each system (default %(default)s)")
    gl.add_argument("--size", help="tensor size per worker (default 100MB, 16MB with --quick)")
    gl.add_argument("--elems-per-packet", type=int, default=4096, help="fanin's elements per datagram (default %(default)s)")
    gl.add_argument("--window", type=int, default=128, help="fanin's blocks in flight (default %(default)s)")
    gl.add_argument("--shards", type=int, default=1, help="switch shards (default %(default)s)")
    _results_option(gl)
    gl.add_argument("--iters", type=int, help="timed allreduces per system (default 7, 3 with --quick)")
    _common(gl)
    gl.set_defaults(func=_lazy("gloo", "run_gloo_compare"))

    for name, help_text in (("epp-sweep", "aggregation latency vs elements per packet (Trio Fig. 15)"),
                            ("window-sweep", "throughput and latency vs window (Trio Fig. 16)")):
        sp = bsub.add_parser(name, help=help_text, description=help_text + "; writes CSV and PNG to --out.")
        sp.add_argument("--workers", type=int, default=4)
        sp.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
        _common(sp)
        sp.set_defaults(func=_lazy("sweeps", "run_sweep"), sweep=name)

    sr = bsub.add_parser("straggler-recovery", help="time to a partial result vs the timeout (Trio Fig. 14)",
                         description="One member of the job never sends; for timeouts 1-50 ms the two others stream "
                                     "20 back-to-back blocks and measure each block's time from first send to its "
                                     "partial result, with Trio's single REF flag (checks=1) and fanin's default "
                                     "(checks=4) side by side. Writes CSV and PNG to --out.")
    sr.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    _common(sr)
    sr.set_defaults(func=_lazy("stragglers", "run_recovery"))

    si = bsub.add_parser("straggler-iterations", help="iteration time under the Slow Worker Pattern (Trio Fig. 13)",
                         description="Worker processes run iterations of compute + allreduce of a model-sized tensor "
                                     "(25M float32; 2M with --quick); at three delay points per iteration one worker "
                                     "straggles with probability p for U(0.5, 2) x the typical iteration time. fanin "
                                     "with mitigation vs without (SwitchML behaviour) vs an ideal run beside each p, "
                                     "one run: each runs the first half of the iterations, then the second half in "
                                     "the reverse order. Iteration time: per iteration, the slowest worker the "
                                     "schedule did not delay (not filtered by outcome), with the fraction of "
                                     "contributions the partial results dropped. The warm-up's and three timed results "
                                     "per worker and arm are checked (partial sums against the sum of as many "
                                     "workers' inputs); a wrong one fails the run.")
    si.add_argument("--workers", type=int, default=4)
    si.add_argument("--iters", type=int, help="iterations per arm and p (default 20, 10 with --quick)")
    si.add_argument("--compute-ms", type=float, default=100.0, help="simulated compute per iteration (default %(default)s)")
    si.add_argument("--block-exp-ms", type=int, default=50,
                    help="straggler timeout of the mitigation arm (default %(default)s; Trio uses 10 ms on dedicated "
                         "hosts, but 5 processes sharing 2 cores are descheduled for longer than that)")
    si.add_argument("--slow-after-windows", type=int, default=1,
                    help="K of the mitigation arm: windows a worker may miss before it is declared slow (default %(default)s)")
    si.add_argument("--probs", type=float, nargs="+", help="straggling probabilities (default 0 0.04 0.08 0.16 0.32)")
    si.add_argument("--arms", nargs="+", choices=["mitigation", "none"], help="arms besides ideal (default both)")
    si.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    _common(si)
    si.set_defaults(func=_lazy("stragglers", "run_iterations"))

    ov = bsub.add_parser("overload", help="allreduce through an overloaded switch: drop-tail, trimming (NDP "
                                          "return-to-sender) and marking (ECN at the switch)",
                         description="Three switches, identical but for [trim], one overloaded shard each "
                                     "(small receive buffer, full windows from every worker): drop-tail, "
                                     "trimming above --watermark, and marking above half of it (the block's result "
                                     "says congestion, nothing is discarded); each worker alternates between "
                                     "them. Completion time, kernel drops, trims, marks and retransmissions per "
                                     "arm, and trim/drop and mark/drop ratios. Writes CSV and PNG to --out. "
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
                    help="trim arm: fraction of the receive buffer above which it trims; the mark arm marks above "
                         "half of it (default %(default)s)")
    ov.add_argument("--out", default="out/bench", help="directory for CSV and PNG (default %(default)s)")
    _common(ov)
    ov.set_defaults(func=_lazy("overload", "run_overload"))

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
                                "  fanin bench chaos --quick --skip restart_switch replay")
    ch.add_argument("--duration", type=float, default=600.0, help="seconds of chaos (default %(default)s; --quick: 60)")
    ch.add_argument("--hang-s", type=float, default=30.0,
                    help="a worker or kv task without progress this long counts as hung (default %(default)s)")
    ch.add_argument("--skip", nargs="*", default=[], metavar="FAULT",
                    help="fault kinds to leave out (garbage forge replay kill_worker restart_rank restart_job "
                         "restart_switch kv_forge kv_replay kill_kv_sender; an unknown name is refused)")
    ch.add_argument("--no-kv", action="store_true", help="value-stream jobs only")
    ch.add_argument("--out", default="out/chaos", help="directory for the JSON report (default %(default)s)")
    _common(ch)
    ch.set_defaults(func=_lazy("chaos", "run_bench_chaos"))

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
    fl.add_argument("--limit", type=rate_limit_tuple, default=(2000, 64), metavar="PPS,BURST",
                    help="job C's per-source rate limit (default 2000,64)")
    fl.add_argument("--flood-pps", type=int, default=50_000,
                    help="the flooder's paced rate, the same in every arm (default %(default)s)")
    _common(fl)
    fl.set_defaults(func=_lazy("flood", "run_flood"))


def _add_kv_benches(bsub: Any) -> None:
    kv = bsub.add_parser("kv-prioritisation", help="key-value on-switch aggregation vs memory (ASK Fig. 9)",
                         description="On-switch aggregation ratio vs aggregator-to-distinct-key ratio, with and "
                                     "without shadow copies, on Uniform/Zipf/Zipf-reversed streams; runs the real "
                                     "key-value machines (cargo example kv_prioritisation) and writes CSV and PNG.")
    kv.add_argument("--out", default="out/kv", help="directory for CSV and PNG (default %(default)s)")
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
    _common(kv)
    kv.set_defaults(func=_lazy("kv", "run_kv_prioritisation"))

    for name, func, help_text in (
        ("kv-traffic", _lazy("kv_wordcount", "run_kv_traffic"),
         "word counts over real text through switch + kv daemon: tuples/packets absorbed (ASK Table 1, Fig. 8b)"),
        ("kv-wordcount", _lazy("kv_wordcount", "run_kv_wordcount"),
         "WordCount: fanin vs PreAggr vs PySpark reduceByKey vs Spark DataFrame groupBy, results checked equal"),
    ):
        wc = bsub.add_parser(name, help=help_text, description=help_text + "; writes CSV and PNG to --out.")
        wc.add_argument("--out", default="out/kv", help="directory for CSV and PNG (default %(default)s)")
        _corpus_options(wc, "runs per system, median reported (default 3, 1 with --quick)")
        if name == "kv-wordcount":
            _cluster_option(wc)
        wc.set_defaults(func=func)

    mem = bsub.add_parser(
        "memory", help="the switch's memory models: jobs admitted and run at once, reserved vs pooled (Trio-ML)",
        description="One switch process with --memory-mb of aggregation memory, first reserving every job's "
                    "buffers (SwitchML), then pooling them (Trio-ML, the default: one buffer reserved per job, "
                    "the rest shared and freed as members acknowledge results; docs/memory.md). Jobs of one "
                    "shape are admitted until the switch refuses one, then all run an int32 allreduce at once; "
                    "every result is checked exactly. JSON with --json, CSV and PNG to --out.",
        epilog="example: fanin bench memory --quick --json\n"
               "         fanin bench memory --memory-mb 1 --jobs 32 --slots 32 --packet 1024")
    mem.add_argument("--out", default="out/memory", help="directory for CSV and PNG (default %(default)s)")
    mem.add_argument("--memory-mb", type=int, default=1, help="switch aggregation memory (default %(default)s)")
    mem.add_argument("--jobs", type=int, default=16, help="most jobs to admit (default %(default)s: with the "
                     "other defaults, caps four times the memory)")
    mem.add_argument("--members", type=int, default=2, help="workers per job (default %(default)s)")
    mem.add_argument("--slots", type=int, default=32, help="block_cnt_max of each job (default %(default)s)")
    mem.add_argument("--packet", type=int, default=1024, help="block_grad_max and elements per packet "
                     "(default %(default)s)")
    mem.add_argument("--elems", type=int, help="int32 elements per worker (default 4x10^6, 10^5 with --quick)")
    mem.add_argument("--repeats", type=int, help="runs per model, median reported (default 3, 1 with --quick)")
    _common(mem)
    mem.set_defaults(func=_lazy("memory", "run_memory"))

    gb = bsub.add_parser(
        "kv-groupby", help="DataFrame group-by: fanin.spark.aggregate vs Spark's groupBy().agg(), results checked equal",
        description=("A generated table (k long, v double by default; uniform or Zipf-like keys) cached in Spark "
                    "on local[2] (or --cluster); Spark's groupBy('k').agg(sum, count, min, max of v) and fanin.spark.aggregate "
                    "with the same aggregates alternate (a real switch and kv daemon). Results are compared in "
                    "Spark (float sums within rounding, everything else exactly). Medians, speed-up; JSON with "
                    "--json, CSV and PNG to --out."),
        epilog="example: fanin bench kv-groupby --quick --json\n"
               "         fanin bench kv-groupby --rows 10000000 --groups 100000,1000000 --dists uniform,zipf\n"
               "         fanin bench kv-groupby --cluster --quick --json")
    gb.add_argument("--out", default="out/kv", help="directory for CSV and PNG (default %(default)s)")
    gb.add_argument("--rows", type=int, help="rows of the table (default 10^7, 10^6 with --quick)")
    gb.add_argument("--groups", help="comma list of distinct keys (default 100000,1000000; 100000 with --quick)")
    gb.add_argument("--dists", help="comma list of uniform,zipf (default both)")
    gb.add_argument("--repeats", type=int, help="runs per system, median reported (default 3, 1 with --quick)")
    gb.add_argument("--value-type", choices=("float64", "int64"), default="float64",
                    help="type of the value column v: double (float64 registers on the switch) or long "
                         "(default %(default)s)")
    _cluster_option(gb)
    _common(gb)
    gb.set_defaults(func=_lazy("kv_groupby", "run_kv_groupby"))

    kn = bsub.add_parser(
        "kv-network", help="key-value word count over rate-limited links (testbed, root): adaptive vs ASK's fixed window",
        description=("A star testbed: the receiver's kv daemon on h0, a sender daemon on each other "
                    "host, the switch on s0, every link limited by tbf. Per link rate: the links' measured capacity, "
                    "then the same word count of real text (every count checked against Counter; a wrong one fails "
                    "the run) from senders whose window and timeout adapt to the path (the default; docs/kv.md "
                    "'Congestion'), alternated with senders that keep ASK's fixed window and timeout, after an "
                    "untimed warm-up task of each, the first arm alternating. Median time, fraction of the capacity "
                    "(above 1.02 flagged as a measurement problem), retransmissions per packet. JSON with --json, "
                    "CSV and PNG to --out. Needs root."),
        epilog="example: fanin bench kv-network --quick --json\n"
               "         fanin bench kv-network --rates 100,400,1000 --words 500000 --reps 5")
    kn.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 100,400; 100 with --quick)")
    kn.add_argument("--senders", type=int, default=2, help="sender hosts, one channel each (default %(default)s)")
    kn.add_argument("--words", type=int, help="words per sender (default 300000, 60000 with --quick)")
    kn.add_argument("--reps", type=int, help="tasks per arm per rate (default 3, 1 with --quick)")
    kn.add_argument("--name", default="fbkvnet", help="testbed name (default %(default)s)")
    kn.add_argument("--out", default="out/kv-network", help="directory for CSV and PNG (default %(default)s)")
    _common(kn)
    kn.set_defaults(func=_lazy("kv_network", "run_kv_network"))

    kw = bsub.add_parser("kv-window", help="fanin WordCount time at several sender windows (the default W's measurement)",
                         description="The fanin arm of kv-wordcount only, at each window of --windows, interleaved "
                                     "in one process against one switch and daemon; every count is checked against "
                                     "Counter. Reports the median time and the share of packets retransmitted.")
    kw.add_argument("--windows", default="1024,2048,4096", help="comma list of windows, 1..4096 (default %(default)s)")
    kw.add_argument("--auth", action="store_true", help="keyed tasks (every datagram sealed)")
    _corpus_options(kw, "runs per window (default 5, 2 with --quick)")
    kw.set_defaults(func=_lazy("kv_wordcount", "run_kv_window"))


def _add_tree_benches(bsub: Any) -> None:
    nw = bsub.add_parser(
        "network", help="fanin vs Gloo's ring on rate-limited links (testbed, root): where INA wins",
        description="A star testbed of N hosts, every link limited by tbf: for each link rate, the capacity the "
                    "links really offer (a UDP blast over all of them at once, counted once every blaster is "
                    "sending; below 0.8 of the tbf rate it is flagged), then fanin and Gloo's ring "
                    "(torch.distributed, routed through the switch namespace) allreduce the same float32 tensor, "
                    "alternating. Per rate: medians, ideal times at the measured capacity, fanin's fraction of "
                    "it (above 1.02 flagged as a measurement problem: the capacity was under-read), the speed-up "
                    "vs Gloo, retransmissions, trims and IP fragments. fanin runs with its "
                    "defaults unless told otherwise. JSON with --json, CSV and PNG to --out. Needs root.",
        epilog="example: fanin bench network --workers 4 --rates 100,200,400 --json\n"
               "         fanin bench network --quick --dtype float16 --json\n"
               "         fanin bench network --quick --collective reduce-scatter --json\n"
               "         fanin bench network --workers 8 --rates 5000,10000 --mtu 9000 --auth --json")
    nw.add_argument("--workers", type=int, default=4, help="hosts of the star (default %(default)s)")
    nw.add_argument("--topology",
                    help="leaf-spine:S,L,H for a two-level fabric (S spines, L leaves, H hosts each, every host a "
                         "worker): fanin runs as an aggregation tree the controller programs (docs/trees.md), Gloo's "
                         "ring crosses the leaves' uplinks; default star:--workers")
    nw.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 100,200,400; 200 with --quick)")
    nw.add_argument("--size", help="tensor per worker (default 16MB, 4MB with --quick)")
    nw.add_argument("--reps", type=int, help="allreduces per system per rate (default 7, 3 with --quick)")
    nw.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="element type of the tensor (both systems): 16-bit floats travel as 2 bytes per element "
                         "each way; the bytes per element each link carried are reported (default %(default)s)")
    nw.add_argument("--collective", choices=("allreduce", "reduce-scatter"), default="allreduce",
                    help="reduce-scatter: every worker keeps only its 1/N shard of the sum (fanin: owner-only "
                         "results, the other blocks come down as headers; Gloo: reduce_scatter_tensor). Its ideal "
                         "is S/C for fanin (the whole tensor goes up) and (N-1)/N S/C for the ring: the gain is the "
                         "link bytes down, reported per element (default %(default)s)")
    nw.add_argument("--no-gloo", action="store_true", help="fanin only (no PyTorch needed)")
    nw.add_argument("--auth", action="store_true",
                    help="a third arm: the same allreduce in a keyed job (every datagram sealed, docs/security.md); "
                         "reports keyed_goodput_ratio, keyed goodput over unkeyed")
    nw.add_argument("--mtu", type=int,
                    help="MTU of every testbed interface, e.g. 9000 for jumbo frames (default: 1500); fanin learns "
                         "it at join, the capacity blast sends full frames")
    nw.add_argument("--gro", action="store_true",
                    help="receive offload (GRO) on every testbed interface, as a real NIC's driver does: frames that "
                         "arrive together reach the stack as one packet, which cuts the per-frame CPU of every arm "
                         "and of the capacity blast (links, rates and counters stay per frame; default off; "
                         "docs/network.md)")
    nw.add_argument("--results", choices=("unicast", "group"), default="unicast",
                    help="how the switch returns each result: unicast, a copy per worker sent by the daemon; or "
                         "group, one send to a multicast group that the switch namespace's data plane copies to "
                         "every host link (tc mirred, as a switch ASIC's multicast engine; star only). The links "
                         "carry the same bytes either way; group takes the per-worker sends off the switch's CPU "
                         "(default %(default)s; docs/network.md)")
    nw.add_argument("--queue-ms", type=float, default=20.0,
                    help="each link's queue, in ms at its rate (tbf latency; default %(default)s)")
    nw.add_argument("--name", default="fbnet", help="testbed name (namespace prefix; default %(default)s)")
    nw.add_argument("--out", default="out/network")
    tune = nw.add_argument_group("overrides (default: fanin's own defaults, the point of the benchmark)")
    tune.add_argument("--elems-per-packet", type=int,
                      help="elements per datagram (default: what fits the MTU the switch measured, one per frame)")
    tune.add_argument("--window", type=int,
                      help="the most blocks a worker keeps in flight; its congestion window adapts below it "
                           "(docs/congestion.md; default 256, at most the job's slots)")
    tune.add_argument("--shards", type=int, help="switch shard threads (default: one per two cores, 1 to 8)")
    tune.add_argument("--block-grad-max", type=int, help="largest block in elements (default 1024)")
    tune.add_argument("--block-cnt-max", type=int, help="the job's slots (the most blocks in flight)")
    tune.add_argument("--lanes", type=int, default=1,
                      help="send lanes per fanin worker (fanin.Session(lanes=N)): the worker's datagrams leave from "
                           "N sockets (lane 0 from the worker's own thread, the others from a thread each), so its "
                           "per-frame kernel work spreads over N cores (docs/network.md, 'A worker on several threads'; default %(default)s)")
    nw.add_argument("--lanes-arm", type=int, metavar="N",
                    help="add an arm: the same allreduce (its own job) with N send lanes per worker, alternated "
                         "with the main arm in the same run; reports lanes_speedup")
    _common(nw)
    nw.set_defaults(func=_lazy("network", "run_network"))
    lm = bsub.add_parser(
        "lm-steps", help="DDP steps/s of the byte-level GPT (examples/train_lm.py) on rate-limited links, fanin vs Gloo",
        description="The namespace testbed (star:N, tbf on every link, needs root), the switch daemon in the switch "
                    "namespace, one training process per host namespace. Every system trains the same model from the "
                    "same seed for the same steps: fanin (allreduce_hook), fanin-fp16 (fp16_compress_hook: 2 bytes "
                    "per gradient element each way), gloo. Reports steps per second and the final held-out loss "
                    "(the systems must agree) per link rate; CSV + PNG to --out.",
        epilog="example: fanin bench lm-steps --quick --json")
    lm.add_argument("--workers", type=int, default=4)
    lm.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 50,100,200; 100 with --quick)")
    lm.add_argument("--steps", type=int, help="training steps per system per rate (default 80, 30 with --quick)")
    lm.add_argument("--systems", default="fanin,fanin-fp16,gloo",
                    help="comma-separated, from fanin, fanin-fp16, gloo (DDP) and fanin-fsdp, fanin-fsdp-fp16, "
                         "gloo-fsdp (FSDP2) (default %(default)s)")
    _lm_model_args(lm)
    lm.add_argument("--overlap-steps", type=int, default=10,
                    help="DDP systems: after training, this many timed forward+backward passes with and without "
                         "gradient communication and allreduces of the gradients alone: how much of the "
                         "communication the backward pass hides (0: skip; default %(default)s)")
    lm.add_argument("--name", default="fblm", help="testbed name (namespace prefix; default %(default)s)")
    lm.add_argument("--out", default="out/lm-steps")
    _common(lm)
    lm.set_defaults(func=_lazy("lm_steps", "run_lm_steps"))
    im = bsub.add_parser(
        "image-steps", help="DDP images/s of ResNet-18 (examples/train_resnet.py) on rate-limited links, fanin vs Gloo",
        description="ResNet-18 (random initialisation, 11.7 M parameters: 46.8 MB of float32 gradients per step) on "
                    "synthetic images, one training process per host namespace of the testbed (star:N, tbf on every "
                    "link, needs root), the switch daemon in the switch namespace: fanin (allreduce_hook), "
                    "fanin-fp16 (fp16_compress_hook) and gloo from the same seed. Reports images per second per link "
                    "rate and whether every rank ended with the same parameters; CSV + PNG to --out.",
        epilog="examples:\n  fanin bench image-steps --quick --json\n"
               "  fanin bench image-steps --device cuda --workers 8 --rates 1000,2500 --image-size 224")
    im.add_argument("--workers", type=int, default=4)
    im.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 200,400; 200 with --quick)")
    im.add_argument("--steps", type=int, help="timed steps per system per rate (default 20, 4 with --quick)")
    im.add_argument("--warmup", type=int, default=2, help="steps before the clock starts (default %(default)s)")
    im.add_argument("--systems", default="fanin,fanin-fp16,gloo", help="comma-separated (default %(default)s)")
    im.add_argument("--batch", type=int, default=8, help="images per worker per step (default %(default)s)")
    im.add_argument("--image-size", type=int, default=64,
                    help="pixels per side (default %(default)s: a CPU step stays short; 224 on a GPU)")
    im.add_argument("--device", default="cpu", help="cpu, cuda or auto (default %(default)s)")
    im.add_argument("--name", default="fbim", help="testbed name (namespace prefix; default %(default)s)")
    im.add_argument("--out", default="out/image-steps")
    _common(im)
    im.set_defaults(func=_lazy("image_steps", "run_image_steps"))
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
    _common(tl)
    tl.set_defaults(func=_lazy("trees", "run_tree_levels"))
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
    _common(ts)
    ts.set_defaults(func=_lazy("trees", "run_tree_scaling"))


def _add_torch_benches(bsub: Any) -> None:
    ta = bsub.add_parser("torch-allreduce", help="torch.distributed all_reduce: fanin backend vs Gloo, side by side",
                         description="dist.all_reduce through the 'fanin' backend and through 'gloo' at each process "
                                     "count and size, alternating, on loopback; writes CSV and PNG to --out.")
    ta.add_argument("--workers", help="comma-separated process counts (default 2,4,8; 2,4 with --quick)")
    ta.add_argument("--sizes", help="comma-separated sizes (default 1MB,16MB,64MB,256MB; 1MB,16MB with --quick)")
    ta.add_argument("--elems-per-packet", type=int, default=1024)
    ta.add_argument("--window", type=int, default=256)
    ta.add_argument("--iters", type=int, help="timed iterations per point (default 5, 3 for >=64MB or --quick)")
    ta.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live: cuda stages them through pinned host memory for fanin and "
                         "lets Gloo do its own CUDA path (default %(default)s)")
    ta.add_argument("--dtypes", default="float32",
                    help="comma-separated from float32, float16, bfloat16 (default %(default)s); 16-bit tensors "
                         "travel as 2 bytes per element on fanin's wire")
    ta.add_argument("--switch-process", action="store_true",
                    help="run the switch as its own process (FANIN_SWITCH) instead of embedded in rank 0")
    ta.add_argument("--out", default="out/bench/torch", help="directory for CSV and PNG (default %(default)s)")
    _common(ta)
    ta.set_defaults(func=_run_torch)

    tt = bsub.add_parser("time-to-accuracy", help="training with stragglers: digits MLP or the language model "
                                                  "(cf. Trio-ML Fig. 12)",
                         description="Under the Slow Worker Pattern (Trio-ML §6.1): fanin with straggler mitigation "
                                     "(block_exp_ms), fanin without it, and Gloo without stragglers (the ideal), "
                                     "plus fanin without stragglers; writes CSV and PNG to --out.\n\n"
                                     "--model digits (default): an MLP on scikit-learn's digits under torchrun on "
                                     "loopback; time to --target-acc.\n"
                                     "--model lm: the byte-level GPT of examples/train_lm.py on the namespace "
                                     "testbed (star:N, tbf at --rate-mbit, needs root); time to --target-bits "
                                     "of held-out loss (default: what the ideal reaches at 80% of its steps).",
                         epilog="examples:\n  fanin bench time-to-accuracy --quick --json\n"
                                "  fanin bench time-to-accuracy --model lm --rate-mbit 1000 --device cuda --workers 8")
    tt.add_argument("--model", choices=("digits", "lm"), default="digits")
    tt.add_argument("--workers", type=int, default=4)
    tt.add_argument("--straggler-p", type=float, default=0.16)
    tt.add_argument("--block-exp-ms", type=int, default=10, help="block aging of the mitigation arm (default 10)")
    tt.add_argument("--typical-iter-s", type=float, help="straggler scale (default: Gloo's median iteration time)")
    tt.add_argument("--target-acc", type=float, default=0.95)
    tt.add_argument("--epochs", type=int, help="epochs per run (default 30, 10 with --quick)")
    tt.add_argument("--eval-every", type=int, default=5)
    tt.add_argument("--repeats", type=int, help="runs per arm (default 3, 1 with --quick; lm: 1)")
    lm = tt.add_argument_group("--model lm")
    lm.add_argument("--rate-mbit", type=float, default=100.0, help="tbf on every link (default %(default)s)")
    lm.add_argument("--steps", type=int, help="training steps per arm (default 200, 60 with --quick)")
    lm.add_argument("--target-bits", type=float, help="held-out loss target in bits per byte")
    lm.add_argument("--name", default="fbtta", help="testbed name (namespace prefix; default %(default)s)")
    _lm_model_args(lm)
    tt.add_argument("--out", default="out/bench/torch", help="directory for CSV and PNG (default %(default)s)")
    _common(tt)
    tt.set_defaults(func=_run_torch)


def _add_goat_benches(bsub: Any) -> None:
    b = bsub.add_parser("goat", help="GOAT §VII-D: PS overhead, in-network aggregation, communication vs workers",
                        description="GOAT's simulation study at flow level: leaf-spine (10+10 switches, 50 servers) "
                                    "and fat-tree (80 switches, 192 servers), 20% of switches programmable with "
                                    "64 MB, 221 MB of gradients per worker in equal sub-models, sending rates "
                                    "ratio x 10 Gbit/s with ratio ~ Normal(1, sigma). GOAT (LP + KRGS), Geryon, ATP "
                                    "and ESA in one evaluator; plus GOAT-Async vs K-SGD (Algorithm 2) and the "
                                    "planning time of the full fat-tree. Writes CSV and PNG to --out.")
    b.add_argument("--out", default="out/goat", help="directory for CSV and PNG (default %(default)s)")
    b.add_argument("--repeats", type=int, help="random instances per point (default 3, 1 with --quick)")
    b.add_argument("--submodels", type=int, default=111, help="sub-models of the 221 MB gradient (default %(default)s)")
    b.add_argument("--chunk-mb", type=float, default=1.0,
                   help="fragment size of the ATP/ESA memory-sharing model (default %(default)s)")
    b.add_argument("--sigma", type=float, default=0.2, help="sigma of the worker sweep (default %(default)s)")
    b.add_argument("--no-plot", action="store_true", help="CSV and JSON only")
    _common(b)
    b.set_defaults(func=_lazy("goat", "run_bench_goat"))

    d = bsub.add_parser("goat-deploy", help="a GOAT plan installed on the testbed (3 switches, 8 workers, PS) vs PS-only",
                        description="Plan GOAT on the topology (default examples/goat-testbed.toml: 3 switches, 8 "
                                    "workers and a PS, GOAT's testbed), install it on the namespace testbed (switch "
                                    "jobs as responsibility filters, the PS a host aggregator, static routing), and "
                                    "run allreduces of every sub-model on every worker, interleaved with the PS-only "
                                    "baseline (every sub-model straight to the PS). Every sum is checked exactly; "
                                    "the PS's ingress bytes are measured on its veth link. CSV + PNG to --out. "
                                    "Needs root.")
    d.add_argument("--topology", help="topology file or generator with one host of role ps (or --ps)")
    d.add_argument("--ps", help="host that is the parameter server")
    d.add_argument("--memory-mb", type=float, help="B(s) of every switch (default: as the topology says, 4 MB in "
                                                  "examples/goat-testbed.toml, sized for the default 12 MB model)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--even", metavar="TOTAL_MB,PARTS", help="sub-models (default 12,6)")
    src.add_argument("--model", help="a PyTorch model's parameter tensors (alexnet, resnet18, ...)")
    src.add_argument("--submodels", metavar="FILE.json")
    d.add_argument("--max-submodel-mb", type=float, help="with --model: cut tensors above this size")
    d.add_argument("--bytes-per-mb", type=float,
                   help="testbed bytes per planned MB (default 131072, 16384 with --quick)")
    d.add_argument("--reps", type=int, help="allreduces of the whole model per arm (default 10, 3 with --quick)")
    d.add_argument("--elems-per-packet", type=int, default=256)
    d.add_argument("--window", type=int, default=64)
    d.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="each worker allreduces up to N sub-models at once (default 0: one after the other)")
    d.add_argument("--rate-mbit", type=float, default=1000.0, help="tbf limit on every link (default 1 Gbit/s)")
    d.add_argument("--on-path", action="store_true",
                   help="a third arm, goat-on-path: the same plan with GOAT's on-path filtering (every worker sends "
                        "to its rack switch, the switches relay what they do not aggregate; docs/goat.md); every "
                        "arm then runs unkeyed, so the PS's ingress compares like for like")
    d.add_argument("--out", default="out/goat", help="directory for CSV and PNG (default %(default)s)")
    _common(d)
    d.set_defaults(func=_lazy("goat_deploy", "run_goat_deploy"))

    t = bsub.add_parser("goat-train", help="a training run scheduled by a GOAT plan on the testbed vs ATP-like and "
                                           "PS-only placements",
                        description="Train the digits MLP (examples/train_digits.py) on the 8 workers of "
                                    "examples/goat-testbed.toml (3 switches and a PS, rate-limited links, static "
                                    "routing) by synchronous SGD, each step's gradient cut into the plan's "
                                    "sub-models and each averaged through its aggregation node. Arms, side by side "
                                    "on the same daemons, stepped in turn: GOAT's plan, ATP's placement (first "
                                    "switch on the path with room), every sub-model to the PS. Reports step time, "
                                    "time to --target-loss, held-out loss and accuracy, the PS's ingress per step. "
                                    "CSV + PNG to --out. Needs root.")
    t.add_argument("--topology", help="topology file with one host of role ps (default examples/goat-testbed.toml)")
    tsrc = t.add_mutually_exclusive_group()
    tsrc.add_argument("--even", metavar="TOTAL_MB,PARTS", help="the planned sub-models (default 12,6); the "
                                                              "model's parameters are cut in their proportions")
    tsrc.add_argument("--submodels", metavar="FILE.json")
    t.add_argument("--switch-memory", metavar="NAME=MB,...",
                   help="B(s) of the named switches (e.g. agg=12: a large aggregation switch above small rack "
                        "switches, where placing greedily on the first switch with room falls short of GOAT's plan)")
    t.add_argument("--arms", default=",".join(("goat", "atp-like", "ps-only", "goat-async")),
                   help="comma-separated, of goat, atp-like, ps-only, goat-async (default all four; goat-async is "
                        "GOAT's plan with Algorithm 2's K_t^s installed on the switches as it goes)")
    t.add_argument("--slow-ranks", metavar="R,...", help="workers that straggle every step (e.g. 7)")
    t.add_argument("--replan-margin", type=float, default=0.1,
                   help="goat-async: keep the participants unless Algorithm 2's choice is estimated this much "
                        "faster and they are still the fastest (default %(default)s; 0: re-plan every epoch, as "
                        "the paper)")
    t.add_argument("--smoothing", type=float, default=0.3,
                   help="goat-async: Algorithm 2's p_w is a moving average of each worker's intervals, this the "
                        "newest one's weight (default %(default)s; 1: the last interval only, as the paper)")
    t.add_argument("--slow-ms", type=float, default=0.0,
                   help="how long --slow-ranks straggle per step, ±25%% (e.g. 200)")
    t.add_argument("--steps", type=int, help="SGD steps per arm (default 100, 60 with --quick)")
    t.add_argument("--target-loss", type=float, default=0.3, help="held-out loss for time-to-target (default 0.3)")
    t.add_argument("--batch", type=int, default=16, help="per-worker batch (default %(default)s)")
    t.add_argument("--lr", type=float, default=0.1, help="SGD learning rate, momentum 0.9 (default %(default)s)")
    t.add_argument("--rate-mbit", type=float, default=100.0, help="tbf limit on every link (default 100 Mbit/s)")
    t.add_argument("--elems-per-packet", type=int, default=256)
    t.add_argument("--window", type=int, default=64)
    t.add_argument("--on-path", action="store_true",
                   help="install every arm's plan with GOAT's on-path filtering (every worker sends to its rack "
                        "switch, the switches relay what they do not aggregate; docs/goat.md), every arm unkeyed")
    t.add_argument("--no-plot", action="store_true", help="CSV and JSON only")
    t.add_argument("--out", default="out/goat", help="directory for CSV and PNG (default %(default)s)")
    _common(t)
    t.set_defaults(func=_lazy("goat_train", "run_goat_train"))
