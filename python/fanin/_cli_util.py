"""What the command lines share: argument types (the switch's `--job`/`--rate-limit`, the benches' rate
limits in fanin_bench, which imports them from here; fanin never imports fanin_bench) and the dispatch of a
parsed command, and how every `--help` is laid out (:class:`Parser`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

__all__ = ["HelpFormatter", "Parser", "dispatch", "job_arg", "rate_limit_dict", "rate_limit_tuple"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, except that a description or epilog written with line breaks keeps them.

    A text on one line (a paragraph) is wrapped to the terminal, as argparse does; a text with line breaks
    (example command lines, a module docstring) is printed as written. argparse offers either one for both
    (`RawDescriptionHelpFormatter` leaves a one-line description as one very long line) or wrapping for both,
    which runs a list of examples together into one paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text.strip("\n"):
            return super()._fill_text(text, width, indent)
        return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


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
    from fanin.switch import JOB_SCHEMA

    job: dict[str, Any] = {}
    for part in text.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"job field {part!r} is not key=value")
        k, v = (s.strip() for s in part.split("=", 1))
        k = {"id": "job_id"}.get(k, k)
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
        if k == "members":
            job[k] = [int(x) for x in v.split(":") if x]
        elif k == "rate_limit":
            job[k] = rate_limit_dict(v.replace(":", ","))
        elif isinstance(default, str) or k in ("key", "on_failure", "result_group"):
            job[k] = v
        else:
            try:
                job[k] = int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"job field {k} must be an integer, got {v!r}") from None
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
    return {"pps": pps, "burst": burst}


def rate_limit_tuple(text: str) -> tuple[int, int]:
    d = rate_limit_dict(text)
    return d["pps"], d["burst"]
