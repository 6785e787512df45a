"""`fanin sim ...`: runs the Rust simulator binary fanin-sim; the trimming study's CSV is plotted here, and
`allreduce` (tree vs ring) and `goat` are driven by fanin_bench.sim.allreduce and fanin_bench.sim.goat."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from fanin_bench.plotting import set_quick

__all__ = ["register"]

SIMS = ["trimming", "incast", "end-to-end", "permutation", "allreduce", "background", "goat", "bench-events"]


def register(sub: Any) -> None:
    sim = sub.add_parser("sim", help="the packet-level simulator (fanin-sim): trimming study, incast, end-to-end latency, permutation, allreduce, background traffic, GOAT, event rate",
                         description="Run the Rust simulator binary fanin-sim (build it with "
                                     "`cargo build --release -p fanin-sim`). Arguments after the subcommand are passed "
                                     "through; for `trimming` the CSV it writes is also plotted to PNG.",
                         epilog="examples:\n  fanin sim trimming --figure 6 --quick --json\n"
                                "  fanin sim trimming --figure 5 --out out/sim\n  fanin sim bench-events --runs 5\n"
                                "  fanin sim end-to-end --quick --json   (the trimming paper's §6.5: ping and request "
                                "latency with small buffers)\n"
                                "  fanin sim allreduce --quick --loss 0.01 --json   (see fanin sim allreduce --help; "
                                "--star: the one-switch fanin-sim allreduce)\n"
                                "  fanin sim background --quick --json   (one root vs spread roots, equal and weighed "
                                "by port counters, vs ring, as other tenants load a leaf-spine)\n"
                                "  fanin sim goat --quick --json   (a GOAT study point at packet level vs flow level; "
                                "see fanin sim goat --help)")
    # optional here so that `fanin sim` alone says which word is missing (argparse counts a REMAINDER
    # positional as required, and `fanin sim goat` needs nothing after it); _cmd_sim refuses it missing
    sim.add_argument("sim", nargs="?", choices=SIMS, help="simulator command (fanin sim SIM --help)")
    sim.add_argument("--no-plot", action="store_true", help="CSV/JSON only, no PNG")
    sim.add_argument("sim_args", nargs=argparse.REMAINDER, help="the command's own options (e.g. --figure 6 --quick "
                                                                "--json; fanin sim SIM --help lists them)")
    sim.set_defaults(func=_cmd_sim, sim_parser=sim)


def _find_sim_binary() -> Optional[str]:
    """`target/release/fanin-sim` of the source tree this package lives in (three levels above this
    file), else PATH."""
    import os
    import shutil

    env = os.environ.get("FANIN_SIM")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (os.path.join(here, "..", "..", ".."), os.getcwd()):
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


def _help_of_binary(argv: list, sim: str) -> int:
    """The Rust binary's own help of `sim`, its usage lines saying `fanin sim SIM` (what the user types: the
    same width as `fanin-sim SIM`, so the aligned lines stay aligned). For `allreduce --star` only the
    one-switch usage is the user's (`fanin sim allreduce` without --star is the Python driver; the binary's
    `--spec FILE` form is what that driver runs)."""
    import subprocess

    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if sim == "allreduce":
        text = proc.stdout.replace("fanin-sim allreduce [", "fanin sim allreduce --star [", 1)
    else:
        text = proc.stdout.replace(f"fanin-sim {sim} ", f"fanin sim {sim} ")
    sys.stdout.write(text)
    return proc.returncode


def _cmd_sim(args: argparse.Namespace) -> int:
    import subprocess

    if args.sim is None:
        args.sim_parser.print_usage(sys.stderr)
        print(f"fanin sim: error: name a simulator command: {', '.join(SIMS)} (fanin sim SIM --help)",
              file=sys.stderr)
        return 2
    binary = _find_sim_binary()
    if not binary:
        print("fanin sim: the simulator binary is not built; run `cargo build --release -p fanin-sim` "
              "(or put fanin-sim on PATH, or set FANIN_SIM)", file=sys.stderr)
        return 2
    rest = list(args.sim_args or [])
    set_quick("--quick" in rest)
    no_plot = args.no_plot or "--no-plot" in rest
    rest = [a for a in rest if a != "--no-plot"]
    if args.sim == "goat":
        from fanin_bench.sim.goat import main as sim_goat

        return sim_goat(binary, rest)
    if args.sim == "background":
        from fanin_bench.sim.background import main as sim_background

        return sim_background(binary, rest + (["--no-plot"] if no_plot else []))
    if args.sim == "allreduce" and not _minimal_allreduce(rest):
        from fanin_bench.sim.allreduce import main as sim_allreduce

        return sim_allreduce(binary, rest + (["--no-plot"] if no_plot else []))
    argv = [binary, args.sim] + rest
    if "-h" in rest or "--help" in rest:
        return _help_of_binary(argv, args.sim)
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
            from fanin_bench.sim.plots import plot_figure

            for path in plot_figure(figure, out):
                print(f"fanin sim: wrote {path}", file=sys.stderr)
        except ImportError as e:
            print(f"fanin sim: no PNG ({e}); the CSV is in {out}", file=sys.stderr)
    return 0

