"""What the command lines share: argument types (the switch's `--job`/`--rate-limit`, the benches' rate
limits in fanin_bench, which imports them from here; fanin never imports fanin_bench) and the dispatch of a
parsed command, and how every `--help` is laid out (:class:`Parser`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

__all__ = ["HelpFormatter", "Parser", "dispatch", "job_arg", "rate_limit_dict", "rate_limit_tuple", "int_in",
           "drop_probability", "ip_port", "listen_addr", "data_ip"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, except that a description or epilog written with line breaks keeps them.

    A text on one line (a paragraph) is wrapped to the terminal, as argparse does; a text with line breaks
    (example command lines, a module docstring) is printed as written. argparse offers either one for both
    (`RawDescriptionHelpFormatter` leaves a one-line description as one very long line) or wrapping for both,
    which runs a list of examples together into one paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text.strip("\n"):
            return super()._fill_text(text, width, indent)
        # as written, except that a line too long for the terminal that is
        # not indented (a paragraph, not an example command) is wrapped
        out = []
        for line in text.splitlines(keepends=True):
            if len(line.rstrip("\n")) > width and not line[:1].isspace():
                out.append(super()._fill_text(line, width, indent) + ("\n" if line.endswith("\n") else ""))
            else:
                out.append(indent + line if line.strip() else line)
        return "".join(out)


class Parser(argparse.ArgumentParser):
    """The ArgumentParser of every fanin command: :class:`HelpFormatter` by default, and so for every
    sub-parser too (`add_subparsers` makes sub-parsers of its parser's own class)."""

    def __init__(self, *args: Any, formatter_class: Any = HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def dispatch(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]], listing: str) -> int:
    """Parse `argv` and run the chosen command's `func`. An area given alone (`fanin plan`, `fanin bench`:
    `listing`) prints its own help, anything else without a command the top help (exit 2); a ValueError or
    RuntimeError of the command is printed as one line (exit 1)."""
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        if getattr(args, "command", None) == listing:
            parser.parse_args([args.command, "--help"])
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as e:
        print(f"fanin {args.command}: {e}", file=sys.stderr)
        return 1


# How `--job` reads the fields whose Rust default is unset (None); a field with a default takes that default's type.
_JOB_FIELD_FORMS = {"members": "0:1:2", "sources": "N", "key": "32 hex digits", "on_failure": "degrade|fail",
                    "rate_limit": "PPS:BURST", "result_group": "IPV4:PORT"}


def job_arg(text: str) -> dict[str, Any]:
    """Parse 'id=1,sources=4,block_cnt_max=256,block_grad_max=1024,mode=forward'. The field names are the
    Rust job description's (`fanin.switch.JOB_SCHEMA`); `id` is short for job_id."""
    from fanin.switch import JOB_INT_RANGES, JOB_SCHEMA, U32, check_job, range_text

    job: dict[str, Any] = {}
    for part in text.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"job field {part!r} is not key=value")
        given, v = (s.strip() for s in part.split("=", 1))
        k = {"id": "job_id"}.get(given, given)
        if k == "key_file":
            # the job key from a file (`fanin keys` writes one), not on the command line other users can read
            from fanin.auth import key_hex, read_key_file

            try:
                job["key"] = key_hex(read_key_file(v))
            except (OSError, ValueError) as e:
                raise argparse.ArgumentTypeError(f"key_file: {getattr(e, 'strerror', None) or e} ({v})") from None
            continue
        if k not in JOB_SCHEMA:
            forms = ", ".join(f"{name}={_JOB_FIELD_FORMS.get(name, 'N' if name != 'mode' else 'aggregate|forward')}"
                              for name in JOB_SCHEMA if name != "job_id") + ", key_file=PATH"
            raise argparse.ArgumentTypeError(f"unknown job field {k!r} (use id=N, {forms})")
        default = JOB_SCHEMA[k]
        label = f"job field {given}"
        if k == "members":
            try:
                job[k] = [int(x) for x in v.split(":") if x]
            except ValueError:
                raise argparse.ArgumentTypeError(f"job field members={v}: give source ids as 0:1:2") from None
            label = f"job field members={v}"
        elif k == "rate_limit":
            job[k] = rate_limit_dict(v.replace(":", ","))
        elif isinstance(default, str) or k in ("key", "on_failure", "result_group"):
            job[k] = v
        else:
            lo, hi = JOB_INT_RANGES.get(k, (0, U32))
            try:
                job[k] = int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"job field {given} must be an integer {range_text(lo, hi)}, "
                                                 f"got {v!r}") from None
        try:
            check_job({k: job[k]}, label)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if "job_id" not in job:
        raise argparse.ArgumentTypeError("a job needs id=N")
    return job


def rate_limit_dict(text: str) -> dict[str, int]:
    """Parse 'PPS,BURST' (two positive integers)."""
    try:
        pps, burst = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate limit {text!r}: expected PPS,BURST (e.g. 100000,256)") from None
    if pps < 1 or burst < 1:
        raise argparse.ArgumentTypeError(f"rate limit {text!r}: rate and burst must be at least 1")
    if pps > 2**32 - 1 or burst > 2**32 - 1:
        raise argparse.ArgumentTypeError(f"rate limit {text!r}: rate and burst are at most 2**32-1")
    return {"pps": pps, "burst": burst}


def rate_limit_tuple(text: str) -> tuple[int, int]:
    d = rate_limit_dict(text)
    return d["pps"], d["burst"]


# Argument types that say what a flag takes: argparse prints "argument --shards: -1 is out of range (1 to 64)"
# where the daemon's parser said "invalid value: integer -1, expected u16 at line 1 column 384" about a JSON the
# user never saw.
_U32, _U64 = 2**32 - 1, 2**64 - 1


def int_in(lo: int, hi: int, unit: str = "") -> Any:
    """An argparse type: an integer within lo..hi."""
    from fanin.switch import range_text

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer {range_text(lo, hi, unit)}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range {range_text(lo, hi, unit)}")
        return value

    return parse


def drop_probability(text: str) -> float:
    """An argparse type: a fault-injection drop probability, 0 up to (not including) 1 (1 drops everything)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:  # NaN compares false
        raise argparse.ArgumentTypeError(f"{text} is not a probability (0 to below 1: the share of datagrams "
                                         "dropped, e.g. 0.05)")
    return value


def ip_port(example: str) -> Any:
    """An argparse type: IP:PORT ([IPV6]:PORT), as the daemons parse addresses (no host names)."""
    from fanin.switch import ip_port_error

    def parse(text: str) -> str:
        why = ip_port_error(text, example)
        if why:
            raise argparse.ArgumentTypeError(why)
        return text

    return parse


def listen_addr(example: str) -> Any:
    """An argparse type: 'auto', 'off' or IP:PORT (a switch's control API or metrics endpoint)."""
    from fanin.switch import ip_port_error

    def parse(text: str) -> str:
        if text in ("auto", "off"):
            return text
        why = ip_port_error(text, example)
        if why:
            raise argparse.ArgumentTypeError(why if why.startswith("port") else
                                             f'{text!r} is not an address: give "auto", "off" or ip:port '
                                             f"(e.g. {example})")
        return text

    return parse


def data_ip(text: str) -> str:
    """An argparse type: this host's IP address toward the switch, which sends results to it (so not 0.0.0.0)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (e.g. 127.0.0.1)") from None
    if ip.is_unspecified or ip.is_multicast:
        raise argparse.ArgumentTypeError(f"{text} is not an address the switch can send to: give this host's "
                                         "address toward the switch (e.g. 127.0.0.1)")
    return text
