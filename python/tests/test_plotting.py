"""Benchmark figures: a --quick run's PNG says so; a full run's does not."""

import pytest

pytest.importorskip("matplotlib")


def test_only_a_quick_run_stamps_its_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from fanin_bench.plotting import QUICK_NOTE, save_figure, set_quick

    for quick in (True, False):
        set_quick(quick)
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 2])
        path = tmp_path / f"quick-{quick}.png"
        save_figure(fig, path)
        plt.close(fig)
        assert (Image.open(path).text.get("Description") == QUICK_NOTE) is quick
        assert any(t.get_text() == QUICK_NOTE for t in fig.texts) is quick
    set_quick(False)


def test_the_bench_dispatcher_passes_quick_on():
    """`fanin bench X --quick` sets the flag before the bench runs."""
    import fanin_bench.bench.stragglers as stragglers
    from fanin_bench import plotting
    from fanin_bench.cli import build_parser

    seen = []
    args = build_parser().parse_args(["bench", "straggler-recovery", "--quick"])
    # the lazy wrapper imports the bench when it runs: run it with the bench swapped for a probe

    original = stragglers.run_recovery
    stragglers.run_recovery = lambda a: seen.append(plotting._quick) or 0
    try:
        assert args.func(args) == 0
    finally:
        stragglers.run_recovery = original
        plotting.set_quick(False)
    assert seen == [True]
