"""`fanin sim` runs the simulator binary that setup builds, and plots its CSV."""

import json
import os
import subprocess
import sys


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fanin", "sim", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_incast_prints_json_and_a_summary():
    r = run("incast", "--senders", "8", "--pkts", "20", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["senders"] == 8 and out["timeouts"] == 0
    # every flow finishes, within a few percent of the line-rate optimum
    assert 1.0 <= out["last_over_optimal"] < 1.2
    assert "incast 8 x 20 packets" in r.stderr


def test_trimming_figure_6_quick_writes_csv_and_png(tmp_path):
    r = run("trimming", "--figure", "6", "--quick", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["figure"] == 6 and out["events"] > 0
    assert os.path.exists(tmp_path / "fig6_senders.csv")
    assert os.path.exists(tmp_path / "fig6_senders.png")


def test_bad_arguments_are_refused_with_a_message():
    r = run("trimming", "--figure", "42", "--quick")
    assert r.returncode != 0
    assert "figure" in (r.stderr + r.stdout).lower()
