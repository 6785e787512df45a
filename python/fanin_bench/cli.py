"""`fanin bench`, `fanin sim` and `fanin testbed`: fanin.cli forwards their whole command line to :func:`main`.
Each area registers its own sub-parser; the code behind a command is imported when it runs."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from fanin._cli_util import Parser, dispatch
from fanin_bench import testbed_command
from fanin_bench.bench import command as bench_command
from fanin_bench.sim import command as sim_command

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    # prog "fanin": the usage lines read `fanin bench allreduce ...`, the command users type.
    parser = Parser(prog="fanin", description="fanin's benchmarks, simulator and testbed "
                                                               "(the other commands: fanin --help).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_command.register(sub)
    sim_command.register(sub)
    testbed_command.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    # `fanin bench` alone lists the benches
    return dispatch(build_parser(), argv, listing="bench")
