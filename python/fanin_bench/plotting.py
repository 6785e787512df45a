"""Saving a benchmark's figure. A `--quick` run (reduced sizes, fewer
repeats) says so on the figure itself, so a PNG that leaves the terminal is
never mistaken for a published figure."""

from __future__ import annotations

from typing import Any

__all__ = ["QUICK_NOTE", "save_figure", "set_quick"]

QUICK_NOTE = "--quick run: reduced sizes and repeats, not a published figure"
_quick = False


def set_quick(quick: bool) -> None:
    """Called by the command dispatchers (`fanin bench`, `fanin sim`) with the run's `--quick`."""
    global _quick
    _quick = bool(quick)


def save_figure(fig: Any, path: Any, dpi: int = 120) -> None:
    """`fig.savefig(path)`, stamped with [`QUICK_NOTE`] on a --quick run: on the image, and in the PNG's
    Description text chunk for tools (and tests) that read it."""
    if not _quick:
        fig.savefig(path, dpi=dpi)
        return
    fig.text(0.995, 0.005, QUICK_NOTE, ha="right", va="bottom", fontsize=8, color="firebrick",
             bbox={"facecolor": "white", "edgecolor": "firebrick", "alpha": 0.85, "pad": 2})
    fig.savefig(path, dpi=dpi, metadata={"Description": QUICK_NOTE})
