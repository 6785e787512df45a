"""Every `fanin ... --help` reads as written: paragraphs wrapped to the terminal, example lists one command per
line. argparse's two stock layouts each break one of these (fanin._cli_util.HelpFormatter says how), and a
command added with either would pass every other test."""

from __future__ import annotations

import argparse
import os
from typing import Iterator

import pytest

from fanin import cli as fanin_cli
from fanin_bench import cli as bench_cli
from fanin_bench.sim import allreduce as sim_allreduce
from fanin_bench.sim import background as sim_background
from fanin_bench.sim import goat as sim_goat

WIDTH = 100


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    roots = [fanin_cli.build_parser(), bench_cli.build_parser(), sim_allreduce._parser(),
             sim_background._parser(), sim_goat._parser()]
    stack = list(roots)
    seen: set[str] = set()
    while stack:
        parser = stack.pop()
        if parser.prog not in seen:
            seen.add(parser.prog)
            yield parser.prog, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())


PARSERS = dict(_parsers())


def test_the_walk_finds_the_nested_commands():
    for prog in ("fanin switch", "fanin keys", "fanin bench network", "fanin controller serve", "fanin plan goat",
                 "fanin testbed up", "fanin sim goat"):
        assert prog in PARSERS, sorted(PARSERS)


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_wraps_paragraphs_and_keeps_example_lines(prog, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    parser = PARSERS[prog]
    text = parser.format_help()
    lines = text.splitlines()
    verbatim = set()
    for block in (parser.description, parser.epilog):
        if block and "\n" in block.strip("\n"):
            # Written with line breaks: each line must come out as written (a list of examples is never run
            # together into one paragraph), and may be as long as its author made it.
            for line in block.splitlines():
                assert line.rstrip() in {seen.rstrip() for seen in lines}, \
                    f"{prog} --help does not keep the line {line!r}:\n{text}"
                verbatim.add(line.rstrip())
    too_long = [line for line in lines if len(line) > WIDTH and line.rstrip() not in verbatim
                # argparse does not break a single word (a long option name or URL) or a usage line
                and " " in line.strip() and not line.lstrip().startswith(("usage:", "["))]
    assert not too_long, f"{prog} --help has unwrapped lines (wider than COLUMNS={WIDTH}):\n" + "\n".join(too_long)
    assert os.environ["COLUMNS"] == str(WIDTH)
