"""How the commands print a result: one JSON object on stdout with --json (the summary line to stderr, for
scripts that parse stdout), else the summary line on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["emit"]


def emit(result: Any, human: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        print(human, file=sys.stderr)
    else:
        print(human)
