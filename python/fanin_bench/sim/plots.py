"""PNG plots for `fanin sim trimming` from the CSV files the simulator writes.

`plot_figure(n, out_dir)` reads `out_dir/fig<n>_*.csv` and writes
`out_dir/fig<n>*.png`; it returns the paths written. Only matplotlib and the
standard library are needed.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from typing import Callable, Dict, List
from fanin_bench.plotting import save_figure

__all__ = ["plot_figure", "plot_allreduce"]

DESIGN_LABEL = {"ideal": "Ideal", "mod": "MoD", "dod-only": "DoD only", "tofino": "Tofino (full)",
                "tofino-2m": "Tofino, two meters (switch.p4)"}


def _rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fig5(out: str) -> List[str]:
    plt = _plt()
    rows = _rows(os.path.join(out, "fig5_header_cdf.csv"))
    titles = {"64to1": "(a) 64 -> 1", "16to1x4": "(b) 16 -> 1 x 4", "64to16": "(c) 64 -> 16"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (w, title) in zip(axes, titles.items()):
        curves: Dict[str, List[tuple]] = defaultdict(list)
        for r in rows:
            if r["workload"] == w:
                curves[r["design"]].append((float(r["arrival_us"]), float(r["cdf"])))
        for d, pts in curves.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=DESIGN_LABEL.get(d, d))
        ax.set_title(title)
        ax.set_xlabel("header arrival time (µs)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend()
    path = os.path.join(out, "fig5_header_cdf.png")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return [path]


def _fig6(out: str) -> List[str]:
    plt = _plt()
    rows = _rows(os.path.join(out, "fig6_senders.csv"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for d in ("ideal", "tofino", "tofino-2m"):
        rs = [r for r in rows if r["design"] == d]
        n = [int(r["senders"]) for r in rs]
        a.plot(n, [float(r["avg_throughput_gbps"]) for r in rs], marker=".", label=DESIGN_LABEL[d])
        b.plot(n, [int(r["trims"]) for r in rs], marker=".", label=DESIGN_LABEL[d])
    a.set_xlabel("senders")
    a.set_ylabel("average throughput (Gbit/s)")
    a.set_title("(a) throughput")
    b.set_xlabel("senders")
    b.set_ylabel("trimmed packets")
    b.set_title("(b) trimmed packets")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    path = os.path.join(out, "fig6_senders.png")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return [path]


def _fig7(out: str) -> List[str]:
    plt = _plt()
    rows = _rows(os.path.join(out, "fig7_pessimistic.csv"))
    counts = sorted({int(r["senders"]) for r in rows}) or [18, 32, 64]
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for r in rows:
            if int(r["senders"]) == n:
                p = int(r["receiver_port"])
                ax.plot([float(r["start_us"]), float(r["end_us"])], [p, p], color="C3", linewidth=3)
        ax.set_title(f"{n} senders: pessimistic mode")
        ax.set_xlabel("time (µs)")
        ax.set_ylabel("destination port")
        ax.set_ylim(-1, 16)
        ax.grid(alpha=0.3)
    path = os.path.join(out, "fig7_pessimistic.png")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return [path]


def _response(out: str, name: str, csv_name: str) -> List[str]:
    plt = _plt()
    rows = _rows(os.path.join(out, csv_name))
    groups: Dict[tuple, List[Dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[(r["variant"], int(r["senders"]))].append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for (variant, n), rs in sorted(groups.items()):
        x = [float(r["t0_us"]) for r in rs]
        label = f"{variant}, {n} senders"
        axes[0].plot(x, [float(r["trims_vs_ideal"]) for r in rs], marker=".", label=label)
        axes[1].plot(x, [float(r["avg_throughput_gbps"]) for r in rs], marker=".", label=label)
        axes[2].plot(x, [max(1, int(r["max_dod_queue_pkts"])) for r in rs], marker=".", label=label)
    axes[0].set_ylabel("trimmed packets / Ideal")
    axes[1].set_ylabel("average throughput (Gbit/s)")
    axes[2].set_ylabel("max DoD queue (packets)")
    axes[2].set_yscale("log")
    for ax, t in zip(axes, ("(a) trimmed packets", "(b) throughput", "(c) max DoD queue")):
        ax.set_xlabel("congestion response T0 (µs)")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    path = os.path.join(out, f"{name}.png")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return [path]


_PLOTTERS: Dict[int, Callable[[str], List[str]]] = {
    5: _fig5,
    6: _fig6,
    7: _fig7,
    8: lambda out: _response(out, "fig8_response", "fig8_response.csv"),
    9: lambda out: _response(out, "fig9_variants", "fig9_variants.csv"),
}


def plot_figure(n: int, out_dir: str) -> List[str]:
    """Render figure `n` (5-9) from the CSV in `out_dir`; returns the PNG paths."""
    if n not in _PLOTTERS:
        raise ValueError(f"no plot for figure {n}")
    return _PLOTTERS[n](out_dir)


def _grouped_bars(ax, groups: List[str], series: List[str], value: Callable[[str, str], float], label_bars: bool = False) -> None:
    """One bar per (group, series), series side by side within a group."""
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        bars = ax.bar([i + k * width for i in range(len(groups))], [value(g, name) for g in groups], width, label=name)
        if label_bars:
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax.legend()


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


_LAYER_ORDER = {"host": 1, "edge-agg": 2, "agg-core": 3}


def plot_allreduce(out: str) -> List[str]:
    """`fanin sim allreduce`: completion time per scenario and algorithm, and
    bytes per link layer and per link (first scenario)."""
    plt = _plt()
    rows = _rows(os.path.join(out, "allreduce_summary.csv"))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    time = {(r["scenario"], r["algorithm"]): float(r["completion_us"]) for r in rows}
    fig, ax = plt.subplots(figsize=(1.8 * len(scenarios) * len(algorithms) + 2, 4))
    _grouped_bars(ax, scenarios, algorithms, lambda s, a: time.get((s, a), 0.0), label_bars=True)
    ax.set_ylabel("completion time (µs, last worker)")
    ax.set_yscale("log")
    ax.set_title("allreduce completion time")
    paths = [_save(plt, fig, os.path.join(out, "allreduce_completion.png"))]

    links = [r for r in _rows(os.path.join(out, "allreduce_links.csv")) if r["scenario"] == scenarios[0]]
    layers = sorted({r["layer"] for r in links}, key=lambda n: _LAYER_ORDER.get(n, 99))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    layer_bytes: Dict[tuple, float] = defaultdict(float)
    for r in links:
        layer_bytes[(r["layer"], r["algorithm"])] += int(r["bytes"]) / 1e6
    _grouped_bars(a1, layers, algorithms, lambda layer, a: layer_bytes[(layer, a)])
    a1.set_ylabel("MB on the layer's links (both directions)")
    a1.set_title(f"bytes per layer ({scenarios[0]})")
    for alg in algorithms:
        per_link = sorted((int(r["bytes"]) / 1e6 for r in links if r["algorithm"] == alg), reverse=True)
        a2.plot(range(len(per_link)), per_link, label=alg)
    a2.set_xlabel("link (sorted by bytes)")
    a2.set_ylabel("MB on the link (both directions)")
    a2.set_title(f"per-link bytes ({scenarios[0]})")
    a2.legend()
    paths.append(_save(plt, fig, os.path.join(out, "allreduce_layers.png")))
    return paths


if __name__ == "__main__":
    import sys

    for arg in sys.argv[2:]:
        print("\n".join(plot_figure(int(arg), sys.argv[1])))
