"""`fanin bench network` on the namespace testbed (root): packets that fit
the link, proved with the kernel's own fragmentation counters, and the
benchmark's report. Skipped, with the reason, where network namespaces
cannot be created."""

import json
import os
import subprocess
import sys

import pytest

from fanin_bench.testbed import why_unavailable

_WHY_NOT = why_unavailable("fbn-probe")
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=f"no network namespaces: {_WHY_NOT}")


def _bench(tmp_path, *extra):
    # a testbed name of this process's own, so parallel runs never collide
    name = f"fbn{os.getpid() % 36**4:x}"[:8]
    argv = [sys.executable, "-m", "fanin", "bench", "network", "--quick", "--no-gloo", "--json", "--workers", "2",
            "--rates", "100", "--size", "1MB", "--reps", "2", "--name", name, "--out", str(tmp_path), *extra]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_default_packets_fit_a_1500_byte_link_and_nothing_is_fragmented(tmp_path):
    report = _bench(tmp_path)
    (row,) = report["rates"]
    # 1500 - IPv4 20 - UDP 8 - fanin header 24 - seal 16 = 1432 bytes = 358 float32
    assert row["elems_per_packet"] == 358, row
    assert row["ip_fragments"] == 0, row
    assert row["fanin_verified"]
    assert 50 < row["capacity_mbit"] <= 105, row  # tbf at 100 Mbit/s, measured
    assert (tmp_path / "network.csv").exists() and (tmp_path / "network.png").stat().st_size > 0
    assert not report["fanin_settings"]["overrides"]


def test_the_old_default_of_1024_elements_is_cut_into_fragments(tmp_path):
    # The counter the test above reads is real: 4 KB datagrams on a
    # 1500-byte link are fragmented by the kernel, three frames each.
    report = _bench(tmp_path, "--elems-per-packet", "1024")
    (row,) = report["rates"]
    assert row["elems_per_packet"] == 1024
    assert row["ip_fragments"] > 0, row
    assert report["fanin_settings"]["overrides"]


def test_a_shallow_queue_is_found_by_congestion_signals_not_timeouts(tmp_path):
    # 4 workers whose links queue 8 ms (100 KB at 100 Mbit/s, 66 frames):
    # the default window (256 blocks, 367 KB) would overrun it almost 4x.
    # Each overflow is found by fast retransmit within a round trip and
    # marked by the switch, and every member cuts its window at the same
    # result; no stall timer ever fires. (Below the floor of 64 blocks a
    # queue keeps overflowing: docs/congestion.md.)
    report = _bench(tmp_path, "--workers", "4", "--size", "2MB", "--queue-ms", "8")
    (row,) = report["rates"]
    assert row["fanin_verified"] and row["ip_fragments"] == 0, row
    assert row["fast_retransmits"] > 0, row  # the queue did overflow, and it was seen
    assert row["timeouts"] == 0, row
    assert all(w < 256 for w in row["window_final"]), row
    assert len(set(row["window_final"])) == 1, row  # the same marks, the same window
