"""Drivers of the packet-level simulator fanin-sim (crates/fanin-sim): `fanin sim allreduce` (fanin's tree vs
ring allreduce, :mod:`.allreduce`), `fanin sim goat` (a GOAT study point at packet level, :mod:`.goat`) and the
plots of their CSV (:mod:`.plots`). :mod:`.command` is the `fanin sim` sub-parser; :func:`out_of_range` checks
the drivers' options before anything runs."""

from __future__ import annotations

from typing import Any, Optional, Union

__all__ = ["out_of_range"]

# what a value of each kind must be, and what the error tells the user to give
_KINDS = {
    "count": (lambda v: v >= 1, "give at least 1"),
    "nonnegative": (lambda v: v >= 0, "give 0 or more"),
    "positive": (lambda v: v > 0, "give more than 0"),
    "probability": (lambda v: 0 <= v < 1, "give a probability in [0, 1)"),
    "fraction": (lambda v: 0 <= v <= 1, "give a fraction in [0, 1]"),
}


def out_of_range(args: Any, **kinds: Union[str, tuple[int, int]]) -> Optional[str]:
    """The first option of `args` (by dest, None = not given) outside its kind (a name of `_KINDS`, or an
    inclusive (lowest, highest)), as 'FLAG VALUE is out of range: give ...'; None when all are in range
    (NaN is in none)."""
    for dest, kind in kinds.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if isinstance(kind, tuple):
            ok, give = (lambda v, lo=kind[0], hi=kind[1]: lo <= v <= hi), f"give {kind[0]}..{kind[1]}"
        else:
            ok, give = _KINDS[kind]
        if not ok(value):
            return f"--{dest.replace('_', '-')} {value} is out of range: {give}"
    return None
