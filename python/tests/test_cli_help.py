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
            words = " ".join(text.split())
            for line in block.splitlines():
                if len(line.rstrip()) > WIDTH and not line[:1].isspace():
                    # a paragraph on one line, too wide: wrapped, its words kept in order
                    assert " ".join(line.split()) in words, f"{prog} --help loses the paragraph {line!r}:\n{text}"
                    continue
                assert line.rstrip() in {seen.rstrip() for seen in lines}, \
                    f"{prog} --help does not keep the line {line!r}:\n{text}"
                verbatim.add(line.rstrip())
    too_long = [line for line in lines if len(line) > WIDTH and line.rstrip() not in verbatim
                # argparse does not break a single word (a long option name or URL) or a usage line
                and " " in line.strip() and not line.lstrip().startswith(("usage:", "["))]
    assert not too_long, f"{prog} --help has unwrapped lines (wider than COLUMNS={WIDTH}):\n" + "\n".join(too_long)
    assert os.environ["COLUMNS"] == str(WIDTH)


@pytest.mark.parametrize("argv, says", [
    (["switch", "--shards", "-1"], "argument --shards: -1 is out of range (1 to 64)"),
    (["switch", "--shards", "0"], "argument --shards: 0 is out of range (1 to 64)"),
    (["switch", "--shards", "two"], "argument --shards: 'two' is not an integer"),
    (["switch", "--data-addr", "nonsense"], "argument --data-addr: 'nonsense' is not IP:PORT"),
    (["switch", "--data-addr", "127.0.0.1:70000"], "argument --data-addr: port 70000 is out of range (0 to 65535)"),
    (["switch", "--data-addr", "localhost:9000"], "argument --data-addr: 'localhost:9000' is not IP:PORT"),
    (["switch", "--control-addr", "9100"], """argument --control-addr: '9100' is not an address: give "auto", "off" """
                                           "or ip:port (e.g. 127.0.0.1:9100)"),
    (["switch", "--metrics-addr", "x"], """argument --metrics-addr: 'x' is not an address: give "auto", "off" or """
                                        "ip:port (e.g. 127.0.0.1:9101)"),
    (["switch", "--egress-drop", "nan"], "argument --egress-drop: nan is not a probability"),
    (["switch", "--ingress-drop", "-0.1"], "argument --ingress-drop: -0.1 is not a probability"),
    (["switch", "--egress-drop", "1"], "argument --egress-drop: 1 is not a probability (0 to below 1"),
    (["switch", "--seed", "-1"], "argument --seed: -1 is out of range (0 to 2**64-1)"),
    (["switch", "--memory-mb", "0"], "argument --memory-mb: 0 is out of range (1 to "),
    (["switch", "--job", "id=-1,sources=2"], "argument --job: job field id = -1 is out of range (0 to 2**32-1)"),
    (["switch", "--job", "id=1,sources=-1"], "argument --job: job field sources = -1 is out of range (1 to 4096)"),
    (["switch", "--job", "id=1,sources=2,block_exp_ms=-5"], "job field block_exp_ms = -5 is out of range (0 to "),
    (["switch", "--job", "id=1,sources=2,mode=sum"], "job field mode='sum': give aggregate or forward"),
    (["switch", "--job", "id=1,sources=2,on_failure=retry"], "job field on_failure='retry': give degrade or fail"),
    (["switch", "--job", "id=1,members=0:-1"], "job field members=0:-1: member -1 is out of range (0 to 4095)"),
    (["switch", "--job", "id=1,sources=2,result_group=nowhere"], "job field result_group='nowhere' is not IPV4:PORT"),
    (["switch", "--job", "id=1,sources=2,key=abc"], "job field key: give 32 hex digits"),
    (["kv", "daemon", "--receive-channels", "0"], "argument --receive-channels: 0 is out of range (1 to 64)"),
    (["kv", "daemon", "--send-channels", "-3"], "argument --send-channels: -3 is out of range (1 to 64)"),
    (["kv", "daemon", "--silence-ms", "0"], "argument --silence-ms: 0 is out of range (1 to "),
    (["kv", "daemon", "--rto-us", "0"], "argument --rto-us: 0 is out of range (1 to "),
    (["kv", "daemon", "--tenant", "-1"], "argument --tenant: -1 is out of range (0 to 2**32-1)"),
    (["kv", "daemon", "--bind-ip", "nowhere"], "argument --bind-ip: 'nowhere' is not an IP address"),
    (["kv", "daemon", "--bind-ip", "0.0.0.0"], "argument --bind-ip: 0.0.0.0 is not an address the switch can "
                                               "send to"),
    (["kv", "daemon", "--control-addr", "x"], "argument --control-addr: 'x' is not IP:PORT"),
    (["kv", "daemon", "--switch-control", "127.0.0.1"], "argument --switch-control: '127.0.0.1' is not IP:PORT"),
])
def test_bad_flag_values_name_the_flag_and_its_range(argv, says, capsys, monkeypatch):
    """A bad value of `fanin switch` / `fanin kv daemon` used to reach the daemon and come back as a serde
    error about an internal JSON ("invalid value: integer -1, expected u16 at line 1 column 384")."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per message
    with pytest.raises(SystemExit) as e:
        fanin_cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err, err


@pytest.mark.parametrize("argv", [
    ["switch", "--shards", "8", "--data-addr", "[::1]:0", "--control-addr", "off", "--metrics-addr", "auto",
     "--egress-drop", "0.5", "--ingress-drop", "0", "--seed", "18446744073709551615", "--memory-mb", "64",
     "--job", "id=4294967295,members=0:4095,mode=forward,on_failure=degrade,result_group=239.1.0.7:47001"],
    ["switch", "--control-addr", "127.0.0.1:9100", "--metrics-addr", "0.0.0.0:9101"],
    ["kv", "daemon", "--receive-channels", "64", "--silence-ms", "1", "--rto-us", "1", "--bind-ip", "::1",
     "--control-addr", "10.0.0.1:0", "--tenant", "4294967295"],
])
def test_good_flag_values_still_parse(argv):
    fanin_cli.build_parser().parse_args(argv)


def test_the_main_help_names_the_shipped_example_config():
    assert "fanin switch --config examples/switch.toml" in fanin_cli.EPILOG_MAIN
    assert os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "switch.toml"))


@pytest.mark.parametrize("argv, says", [
    (["allreduce", "--quick", "--iters", "0"], "fanin bench allreduce: --iters 0 is out of range: give at least 1"),
    (["allreduce", "--quick", "--size", "0"],
     "fanin bench allreduce: --size 0 is out of range: give at least 4 bytes (one element)"),
    (["allreduce", "--quick", "--size", "3B"],
     "fanin bench allreduce: --size 3B is out of range: give at least 4 bytes (one element)"),
    (["allreduce", "--quick", "--size", "lots"],
     "fanin bench allreduce: --size: size 'lots' is not a number of bytes such as 100MB, 64KiB or 4096"),
    (["allreduce", "--quick", "--workers", "0"], "fanin bench allreduce: --workers 0 is out of range (1..256)"),
    (["allreduce", "--quick", "--loss", "1"], "fanin bench allreduce: --loss 1.0 is not a probability below 1"),
    (["kv-traffic", "--quick", "--corpus-mb", "0"],
     "fanin bench kv-traffic: --corpus-mb 0.0 is out of range: give at least 0.001 (1 kB of text)"),
    (["kv-traffic", "--quick", "--corpus-mb", "-1"],
     "fanin bench kv-traffic: --corpus-mb -1.0 is out of range: give at least 0.001 (1 kB of text)"),
    (["flood", "--quick", "--flood-pps", "0"], "fanin bench flood: --flood-pps 0 is out of range: give at least 1"),
    (["flood", "--quick", "--flood-pps", "-1"], "fanin bench flood: --flood-pps -1 is out of range: give at least 1"),
    (["flood", "--quick", "--iters", "0"], "fanin bench flood: --iters 0 is out of range: give at least 1"),
    (["flood", "--quick", "--workers", "0"], "fanin bench flood: --workers 0 is out of range: give at least 1"),
])
def test_bench_values_out_of_range_are_refused_before_the_bench_runs(argv, says, capsys):
    """A bench option the run cannot honour is refused (exit 2, one line naming the flag and what to give)
    instead of a default in its place (--iters 0 ran 3 iterations, --size 0 one element and verified=True,
    --corpus-mb 0 the default corpus), a ZeroDivisionError (--corpus-mb -1, --flood-pps 0) or a run at
    another rate (--flood-pps -1 reported a 147 kpps flood)."""
    assert bench_cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [says], err
