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
    # a --quick figure says so (on the image and in the PNG's text chunk)
    from PIL import Image

    from fanin_bench.plotting import QUICK_NOTE

    assert Image.open(tmp_path / "fig6_senders.png").text.get("Description") == QUICK_NOTE


def test_end_to_end_quick_compares_drop_tail_and_trimming_latency():
    r = run("end-to-end", "--quick", "--clients", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ping = {(p["system"], p["busy"]): p["rtt_us"]["median"] for p in out["pings"]}
    assert ping[("baseline", True)] > 5 * ping[("trimming", True)] > 5 * ping[("trimming", False)] / 2
    req = {(q["system"], q["busy"]): q["total_ms"] for q in out["requests"]}
    assert all(v is not None for v in req.values()), "every request completed"
    assert req[("baseline", True)] / req[("baseline", False)] > 2 * req[("trimming", True)] / req[("trimming", False)]
    assert "closed-loop requests" in r.stderr
    bad = run("end-to-end", "--clients", "two")
    assert bad.returncode != 0 and "--clients is a comma list of counts" in bad.stderr


def test_bad_arguments_are_refused_with_a_message():
    r = run("trimming", "--figure", "42", "--quick")
    assert r.returncode != 0
    assert "figure" in (r.stderr + r.stdout).lower()


def test_allreduce_tree_vs_ring_quick_is_exact_deterministic_and_plotted(tmp_path):
    """fanin's tree (built by fanin.controller.tree) and ring allreduce on
    fat-tree:4 with loss and stragglers: exact sums, the same JSON for the
    same seed, every link in the CSV, PNGs written."""
    args = ("allreduce", "--quick", "--loss", "0.01", "--stragglers", "0.1", "--straggler-delay-us", "50", "--json")
    a = run(*args, "--out", str(tmp_path / "a"))
    assert a.returncode == 0, a.stderr
    b = run(*args, "--no-plot", "--out", str(tmp_path / "b"))
    assert b.returncode == 0, b.stderr
    assert a.stdout == b.stdout, "same seed, same output"
    out = json.loads(a.stdout)
    assert out["workers"] == 16 and out["tree_levels"] == 3
    (scenario,) = out["scenarios"]
    algs = {s["algorithm"]: s for s in scenario["algorithms"]}
    assert set(algs) == {"fanin", "ring"}
    for s in algs.values():
        assert s["exact"] and s["link_drops"] > 0 and s["stragglers"] == 2
        assert s["completion_us"] >= 50
    # fanin sends each element once up and once down each tree link; ring 2(N-1)/N times per hop
    assert scenario["fanin_over_ring"]["total_bytes"] < 1
    with open(tmp_path / "a" / "allreduce_links.csv") as f:
        rows = f.read().splitlines()
    assert len(rows) == 1 + 2 * 48  # header + every fat-tree:4 link for each algorithm
    for name in ("allreduce_completion.png", "allreduce_layers.png", "allreduce_summary.csv", "allreduce_spec.json"):
        assert os.path.exists(tmp_path / "a" / name), name


def test_allreduce_with_background_traffic_reports_it_and_stays_exact(tmp_path):
    # fat-tree:4, 8 workers one per edge switch, the other 8 hosts busy
    r = run("allreduce", "--quick", "--workers", "8", "--spread", "--background-load", "0.3", "--json",
             "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 0, r.stderr[-2000:]
    (scenario,) = json.loads(r.stdout)["scenarios"]
    for a in scenario["algorithms"]:
        assert a["exact"] and a["background_bytes"] > 0, a
        assert 0 < a["goodput_fraction_of_line_rate"] < 1, a
    # every host runs a worker: no room for background, and the message says so
    r = run("allreduce", "--quick", "--background-load", "0.3", "--out", str(tmp_path), "--no-plot")
    assert r.returncode != 0 and "hosts that run no worker" in r.stderr, r.stderr[-2000:]


def test_allreduce_with_a_spread_root_and_trimming_links_reports_both_and_stays_exact(tmp_path):
    # a leaf-spine with 3 spines: the root's role on every spine, NDP queues
    # on every link, shallow enough to overflow under background traffic
    r = run("allreduce", "--topology", "leaf-spine:3,4,4", "--workers", "8", "--spread", "--size", "8192",
            "--background-load", "0.5", "--queue-pkts", "8", "--multi-root", "--trimming", "--json",
            "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["root_shards"] == 3
    spec = json.loads((tmp_path / "allreduce_spec.json").read_text())
    assert len(spec["root_shards"]) == 3 and spec["root_shards"][0] == spec["nodes"].index(
        next(n for n in spec["nodes"] if n["name"] == report["tree_root"]))
    (scenario,) = report["scenarios"]
    for a in scenario["algorithms"]:
        assert a["exact"], a
    # a run that outlives --time-limit-ms stops with the reason, not hours later
    r = run("allreduce", "--quick", "--stragglers", "1.0", "--straggler-delay-us", "5000", "--time-limit-ms", "1",
            "--algorithms", "fanin", "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 2 and "16 of 16 workers had no result after 1 ms" in r.stderr, r.stderr[-2000:]
    # a topology where no other switch reaches all the root's children
    r = run("allreduce", "--topology", "star:4", "--multi-root", "--out", str(tmp_path), "--no-plot")
    assert r.returncode != 0 and "--multi-root" in r.stderr, r.stderr[-2000:]


def test_allreduce_with_root_weights_from_port_counters_avoids_a_full_spine_and_is_faster(tmp_path):
    # leaf-spine:5,16,10, 128 workers, half-rate background (seed 1): three of
    # the five spines have a link the background fills; weighed by the port
    # counters' spare capacity the job leaves them out and runs as fast as on
    # an idle network; with equal shares it waits for them
    common = ["allreduce", "--topology", "leaf-spine:5,16,10", "--workers", "128", "--spread", "--size", "65536",
              "--background-load", "0.5", "--multi-root", "--algorithms", "fanin", "--json", "--no-plot"]
    equal = run(*common, "--out", str(tmp_path / "equal"))
    spare = run(*common, "--root-weights", "spare", "--out", str(tmp_path / "spare"))
    assert equal.returncode == 0 and spare.returncode == 0, (equal.stderr + spare.stderr)[-3000:]
    e, s = json.loads(equal.stdout), json.loads(spare.stdout)
    weights = s["root_weights"]
    assert "root_weights" not in e
    full = [c for c, v in weights["spare"].items() if v < 0.1]
    assert full and all(weights["shards"][c] == 0 for c in full), weights
    assert s["tree_root"] not in full and weights["shards"][s["tree_root"]] > 0
    (fe,), (fs,) = e["scenarios"][0]["algorithms"], s["scenarios"][0]["algorithms"]
    assert fe["exact"] and fs["exact"] and fs["retransmissions"] == 0
    assert fs["goodput_fraction_of_line_rate"] > 0.8 and fe["goodput_fraction_of_line_rate"] < 0.7, (fe, fs)
    assert fs["completion_us"] < 0.85 * fe["completion_us"], (fe, fs)
    # weights need a root to spread
    r = run("allreduce", "--quick", "--root-weights", "spare", "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 2 and "--multi-root" in r.stderr, r.stderr[-2000:]


def test_allreduce_on_links_trimmed_by_the_tofino_design_reports_its_meters_and_stays_exact(tmp_path):
    # the trimming study's Tofino design in every switch (ingress meters,
    # deflect on drop) under shallow queues and background traffic
    r = run("allreduce", "--topology", "leaf-spine:3,4,4", "--workers", "8", "--spread", "--size", "8192",
            "--background-load", "0.5", "--queue-pkts", "8", "--trimming", "tofino", "--json",
            "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 0, r.stderr[-2000:]
    (scenario,) = json.loads(r.stdout)["scenarios"]
    for a in scenario["algorithms"]:
        assert a["exact"], a
    fanin = next(a for a in scenario["algorithms"] if a["algorithm"] == "fanin")
    assert fanin["tofino"]["trims_ingress"] > 0, fanin
    assert fanin["trims"] == fanin["tofino"]["trims_ingress"] + fanin["tofino"]["deflected"], fanin
    assert fanin["tofino"]["notifications"] == fanin["tofino"]["deflected"], fanin
    r = run("allreduce", "--quick", "--trimming", "p4", "--out", str(tmp_path), "--no-plot")
    assert r.returncode == 2 and "invalid choice" in r.stderr, r.stderr[-2000:]


def test_background_sweep_compares_one_root_spread_roots_and_ring_and_plots_them(tmp_path):
    r = run("background", "--quick", "--seeds", "2", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    table = json.loads(r.stdout)
    assert [row["background_load"] for row in table["rows"]] == [0.0, 0.5] and table["seeds"] == [1, 2]
    for row in table["rows"]:
        assert set(row["arms"]) == {"one-root", "many-roots", "weighted-roots", "ring"}
        for a in row["arms"].values():
            assert a["exact"] and a["finished"] == a["runs"] == 2 == len(a["per_seed"]), a
            # the median of two seeds lies between them; the tail is the slower
            assert a["completion_us_min"] <= a["completion_us"] <= a["completion_us_max"], a
            assert a["completion_us_max"] == max(s["completion_us"] for s in a["per_seed"]), a
        assert row["speedup_over_ring"]["weighted-roots"] > 1, row
    quiet, busy = (row["arms"] for row in table["rows"])
    # other tenants slow one root down; weighed shares keep the idle network's pace
    assert busy["one-root"]["completion_us"] > quiet["one-root"]["completion_us"]
    assert busy["weighted-roots"]["completion_us"] <= busy["many-roots"]["completion_us"]
    assert (tmp_path / "background.png").stat().st_size > 0 and (tmp_path / "background.csv").exists()
    # a ring past the time limit is reported unfinished, and fanin's arms still stand
    r = run("background", "--topology", "leaf-spine:3,4,4", "--workers", "8", "--size", "2097152", "--loads", "0",
            "--time-limit-ms", "1", "--json", "--no-plot", "--out", str(tmp_path / "limit"))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)["rows"]
    ring = row["arms"]["ring"]
    assert ring["finished"] == 0 and ring["completion_us"] is None and ring["exact"] is None, row
    assert "speedup_over_ring" not in row and row["arms"]["weighted-roots"]["finished"] == 1, row
    assert "none of 1 done" in r.stderr
    r = run("background", "--loads", "0,2", "--out", str(tmp_path))
    assert r.returncode == 2 and "fraction of the link rate in [0, 1]" in r.stderr, r.stderr[-2000:]


def test_allreduce_with_ecn_marking_switch_ports_reports_the_marks_and_stays_exact(tmp_path):
    # shallow ports that mark from 2 queued datagrams on under background
    # traffic: fanin's datagrams are marked, the run reports it, sums exact
    argv = ["allreduce", "--topology", "leaf-spine:3,4,4", "--workers", "8", "--spread", "--size", "65536",
            "--background-load", "0.5", "--queue-pkts", "16", "--algorithms", "fanin", "--json", "--no-plot"]
    marked = run(*argv, "--ecn-pkts", "2", "--out", str(tmp_path / "ecn"))
    plain = run(*argv, "--out", str(tmp_path / "plain"))
    assert marked.returncode == 0 and plain.returncode == 0, (marked.stderr[-2000:], plain.stderr[-2000:])
    (m,) = json.loads(marked.stdout)["scenarios"][0]["algorithms"]
    (p,) = json.loads(plain.stdout)["scenarios"][0]["algorithms"]
    assert json.loads(marked.stdout)["ecn_pkts"] == 2
    assert m["exact"] and p["exact"]
    assert m["ce_marks"] > 0 and p["ce_marks"] == 0, (m, p)
    assert "ce_marks" in (tmp_path / "ecn" / "allreduce_summary.csv").read_text().splitlines()[0]


def test_quick_keeps_the_flags_given_and_bad_values_are_refused_before_anything_runs(tmp_path):
    """--quick fills in only what the command line left out: an explicit
    --topology, --size or --workers is used as given (fat-tree:3 used to run
    fat-tree-4, goat --workers 0 five workers and PASS). A value the run
    cannot have is refused up front: exit 2, one line naming the flag and
    what to give, nothing written."""
    refused = [
        (["allreduce", "--quick", "--topology", "fat-tree:3"],
         "--topology fat-tree:3: fat-tree k=3 must be an even integer >= 2"),
        (["allreduce", "--quick", "--loss", "2"], "--loss 2.0 is out of range: give a probability in [0, 1)"),
        (["allreduce", "--quick", "--size", "0"], "--size 0 is out of range: give at least 1"),
        (["allreduce", "--quick", "--workers", "0"], "--workers 0 is out of range: give at least 1"),
        (["allreduce", "--quick", "--stragglers", "1.5"],
         "--stragglers 1.5 is out of range: give a fraction in [0, 1]"),
        (["goat", "--quick", "--workers", "0"], "--workers 0 is out of range: give at least 1"),
        (["goat", "--loss", "1.5"], "--loss 1.5 is out of range: give a probability in [0, 1)"),
        (["goat", "--quick", "--bytes-per-mb", "0"], "--bytes-per-mb 0.0 is out of range: give more than 0"),
        (["background", "--quick", "--workers", "0"], "--workers 0 is out of range: give at least 1"),
    ]
    for argv, message in refused:
        out = tmp_path / "refused"
        r = run(*argv, "--out", str(out))
        assert r.returncode == 2 and "Traceback" not in r.stderr, (argv, r.stderr)
        assert r.stderr.strip().splitlines() == [f"fanin sim {argv[0]}: {message}"], (argv, r.stderr)
        assert not out.exists(), argv

    r = run("allreduce", "--quick", "--topology", "star:4", "--size", "20000", "--json", "--no-plot",
            "--out", str(tmp_path / "star"))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["topology"], report["workers"], report["size_elements"]) == ("star-4", 4, 20000)
    r = run("goat", "--quick", "--workers", "4", "--json", "--out", str(tmp_path / "goat"))
    assert r.returncode == 0, r.stderr
    goat = json.loads(r.stdout)
    assert goat["instance"]["workers"] == 4 and goat["instance"]["bytes_per_mb"] == 4096.0


def test_sim_help_and_usage_name_the_commands_users_type():
    """`fanin sim` alone names the missing simulator command only (`fanin sim
    goat` needs no further arguments); the help of a command the Rust binary
    answers says `fanin sim X`, and no help cites internal issue numbers."""
    r = run()
    assert r.returncode == 2 and "sim_args" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("fanin sim: error: name a simulator command: trimming, "), \
        r.stderr
    for sim in ("trimming", "incast"):
        r = run(sim, "--help")
        assert r.returncode == 0 and f"fanin sim {sim} " in r.stdout and "fanin-sim" not in r.stdout, r.stdout
    r = run("goat", "--help")
    assert r.returncode == 0 and "issue" not in r.stdout, r.stdout
