"""Real processes: `fanin switch` as a child process, workers as processes,
raw malformed datagrams, signals, and the CLI."""

import json
import multiprocessing as mp
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import fanin
from fanin.proc import SwitchProcess, check_result, worker_inputs
from fanin.switch import job_config, switch_config


def fanin_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fanin", *args], capture_output=True, text=True, timeout=timeout)


def switch_proc(jobs, **kw):
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr="127.0.0.1:0", jobs=jobs, **kw)
    return SwitchProcess(cfg)


def _worker(rank, addr, n, size, q):
    try:
        s = fanin.Session(addr, 1, rank)
        y = s.allreduce(worker_inputs(rank, size, "float32"))
        q.put((rank, check_result(y, n, "float32", 1024)["ok"], y.tobytes()))
    except BaseException as e:
        q.put((rank, False, repr(e)))


def test_worker_processes_through_a_switch_process():
    n, size = 4, 200_000
    with switch_proc([job_config(1, n)], shards=2) as sw:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, sw.data_addr, n, size, q)) for r in range(n)]
        for p in procs:
            p.start()
        res = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        counters = sw.counters()
    assert all(ok for _, ok, _ in res), res
    assert len({b for _, _, b in res}) == 1, "bit-identical across worker processes"
    assert counters["blocks_completed"] >= size // 1024


def _send_raw(addr, payloads):
    host, port = addr.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for p in payloads:
        s.sendto(p, (host, int(port)))
    s.close()


def header(msg=1, job=1, src=0, block=0, grad=0, version=1, magic=0xFA17, flags=0, dtype=0):
    return struct.pack(">HBBBBHHHIIHbb", magic, version, msg, flags, dtype, src, 0, 0, job, block, grad, -128, -128)


def test_malformed_datagrams_are_counted_by_reason_and_other_jobs_keep_working():
    with switch_proc([job_config(1, 1)]) as sw:
        good = header(grad=1) + struct.pack(">i", 5)
        _send_raw(sw.data_addr, [
            b"",                                   # truncated
            good[:10],                             # truncated header
            header(magic=0xBEEF),                  # bad magic
            header(version=9),                     # bad version
            header(msg=0x55),                      # unknown message type
            header(grad=2) + b"\x00\x00\x00\x01",  # inconsistent length
            header(grad=60000),                    # too many elements
            header(dtype=7),                       # unknown dtype
            header(job=77, grad=1) + b"\0\0\0\1",  # unknown job
            header(src=9, grad=1) + b"\0\0\0\1",   # non-member
        ])
        time.sleep(0.3)
        c = sw.counters()
        assert c["malformed.truncated"] == 2
        assert c["malformed.bad_magic"] == 1 and c["malformed.bad_version"] == 1
        assert c["malformed.unknown_msg_type"] == 1 and c["malformed.length_mismatch"] == 1
        assert c["malformed.too_many_elements"] == 1 and c["malformed.unknown_dtype"] == 1
        assert c["unknown_job"] == 1 and c["non_member"] == 1
        assert c["accepted"] == 0
        # the daemon still serves the job
        s = fanin.Session(sw.data_addr, 1, 0)
        assert s.allreduce(np.arange(4, dtype=np.int32)).tolist() == [0, 1, 2, 3]


def test_a_flood_at_the_wrong_shard_is_bounded_counted_and_spares_the_jobs():
    """Every datagram sent to a shard that does not own it is either handed
    to its owner or counted dropped there (at most 1 024 wait per owner);
    none is lost uncounted, and the daemon keeps serving its job."""
    n = 60_000
    with switch_proc([job_config(1, 1)], shards=2) as sw:
        # a key-value datagram of task 1, which shard 1 owns, at shard 0's port
        kv = struct.pack(">HBBBBHI", 0xFA17, 1, 0x20, 0, 0, 0, 1) + bytes(20)
        _send_raw(sw.data_addr, [kv] * n)
        deadline = time.monotonic() + 10
        while True:
            c = sw.counters()
            seen = c.get("kv.rx_datagrams", 0) + c["handover_dropped"] + c.get("socket_drops", 0)
            if seen == n or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert seen == n, c
        print(f"handed over {c.get('kv.rx_datagrams', 0)}, dropped at the wrong shard {c['handover_dropped']}")
        # the owner refused every one it took (a body of the wrong length)
        assert c.get("kv.malformed.length_mismatch", 0) == c.get("kv.rx_datagrams", 0)
        s = fanin.Session(sw.data_addr, 1, 0)
        assert s.allreduce(np.arange(3000, dtype=np.int32)).tolist() == list(range(3000))


def _join_then_hang(addr, q):
    s = fanin.Session(addr, 1, 1)
    q.put("joined")
    time.sleep(3600)


def test_a_worker_killed_mid_job_fails_the_others_cleanly_and_spares_other_jobs():
    with switch_proc([job_config(1, 2), job_config(2, 1)]) as sw:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        victim = ctx.Process(target=_join_then_hang, args=(sw.data_addr, q))
        victim.start()
        # the round starts once both ranks joined (the job's barrier)
        s = fanin.Session(sw.data_addr, 1, 0, dead_after_s=0.8, join_timeout_s=30)
        assert q.get(timeout=30) == "joined"
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        t = time.monotonic()
        with pytest.raises(fanin.FaninTimeout, match="silent"):
            s.allreduce(np.ones(100_000, dtype=np.float32))
        assert time.monotonic() - t < 5
        other = fanin.Session(sw.data_addr, 2, 0)
        assert other.allreduce(np.ones(3, dtype=np.int32)).tolist() == [1, 1, 1]


def test_sigterm_stops_the_switch_gracefully_and_metrics_are_prometheus_text():
    import urllib.request

    sw = switch_proc([job_config(1, 1)])
    text = urllib.request.urlopen(f"http://{sw.metrics_addr}/metrics", timeout=5).read().decode()
    assert "# TYPE fanin_switch_packets_total counter" in text
    assert 'fanin_switch_packets_total{shard="0",counter="accepted"} 0' in text
    assert sw.stop() == 0


def test_cli_help_teaches_and_bad_config_is_rejected(tmp_path):
    r = fanin_cli("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout and "examples:" in r.stdout
    r = fanin_cli("switch", "--help")
    assert r.returncode == 0 and "--job" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('shards = "two"\n')
    r = fanin_cli("switch", "--config", str(bad))
    assert r.returncode == 2 and "invalid type" in r.stderr and "shards" in r.stderr
    bad.write_text("[[jobs]]\njob_id = 1\n")
    r = fanin_cli("switch", "--config", str(bad))
    assert r.returncode == 2 and "jobs[0]: missing `members`" in r.stderr
    r = fanin_cli("switch", "--job", "id=1,sources=x")
    assert r.returncode == 2 and "must be an integer" in r.stderr
    r = fanin_cli("bench", "allreduce", "--dtype", "float64")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_flags_given_with_a_config_file_override_it(tmp_path):
    """`--config` with flags merges, flags winning (they were silently
    ignored): --shards replaces the file's, a --job replaces the file's job
    of the same id and the file's other jobs stay."""
    from fanin.control import ControlClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        control = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = tmp_path / "switch.toml"
    cfg.write_text(f'data_addr = "127.0.0.1:0"\nshards = 1\ncontrol_addr = "{control}"\nmetrics_addr = "127.0.0.1:0"\n'
                   "[[jobs]]\njob_id = 1\nsources = 2\n[[jobs]]\njob_id = 2\nsources = 4\n")
    proc = subprocess.Popen([sys.executable, "-m", "fanin", "switch", "--config", str(cfg), "--shards", "2",
                             "--job", "id=1,sources=3", "--print-ready"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["shards"] == 2, info
        with ControlClient(control) as c:
            jobs = {j["job_id"]: j["members"] for j in c.list_jobs()}
        assert jobs == {1: [0, 1, 2], 2: [0, 1, 2, 3]}, jobs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _free_base_port() -> int:
    """A port P with P..P+21 free for UDP and P+100..P+121 for TCP (three
    switches' data, control and metrics ports)."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 40000)
        try:
            for port, kind in [(base + d, socket.SOCK_DGRAM) for d in range(22)] + \
                              [(base + 100 + d, socket.SOCK_STREAM) for d in range(22)]:
                with socket.socket(socket.AF_INET, kind) as t:
                    t.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    pytest.skip("no free block of ports found on 127.0.0.1")


def test_a_second_switch_on_one_machine_needs_only_another_data_port():
    """The control API and metrics default to the data port + 100 and + 101
    (they were fixed at 9100 and 9101, so a second switch needed three flags);
    a taken port falls back to a free one, printed; a bad value names what to
    give."""
    from fanin.control import ControlClient

    base = _free_base_port()
    procs = []

    def start(data_port):
        proc = subprocess.Popen([sys.executable, "-m", "fanin", "switch", "--data-addr", f"127.0.0.1:{data_port}",
                                 "--shards", "1", "--print-ready"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        return json.loads(line), proc.stderr.readline()

    blocker = socket.socket()
    try:
        a, _ = start(base)
        b, said = start(base + 10)
        assert (a["control_addr"], a["metrics_addr"]) == (f"127.0.0.1:{base + 100}", f"127.0.0.1:{base + 101}")
        assert (b["control_addr"], b["metrics_addr"]) == (f"127.0.0.1:{base + 110}", f"127.0.0.1:{base + 111}")
        assert f"control API 127.0.0.1:{base + 110}" in said, said
        blocker.bind(("127.0.0.1", base + 120))
        blocker.listen()
        c, said = start(base + 20)
        assert c["control_addr"] != f"127.0.0.1:{base + 120}" and c["metrics_addr"] == f"127.0.0.1:{base + 121}"
        assert f"control API {c['control_addr']}" in said, said
        for info in (a, b, c):
            with ControlClient(info["control_addr"]) as client:
                assert client.list_jobs() == []
    finally:
        blocker.close()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    r = fanin_cli("switch", "--data-addr", "127.0.0.1:0", "--control-addr", "nine", timeout=30)
    assert r.returncode != 0 and '"auto", "off" or ip:port' in r.stderr, r.stderr


def test_switch_port_in_use_is_reported():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    r = fanin_cli("switch", "--data-addr", f"127.0.0.1:{port}", "--control-addr", "off", "--metrics-addr", "off",
                  timeout=30)
    s.close()
    assert r.returncode == 1 and "cannot bind data port" in r.stderr


def test_demo_passes_with_loss():
    r = fanin_cli("demo", "--elements", "60000", "--rounds", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["loss"] == 0.05
    assert all(row["identical"] and row["correct"] for row in out["rows"])
    # it says what to try next, and every suggestion exists
    assert "Try next:" in r.stderr
    from fanin.demo import NEXT_STEPS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "examples/train_digits.py" in NEXT_STEPS
    assert os.path.isfile(os.path.join(root, "examples", "train_digits.py"))
    for command in ("fanin switch", "fanin kv daemon", "fanin bench allreduce"):
        assert command in NEXT_STEPS
    # the second part, on rate-limited links, runs wherever namespaces can be made
    from fanin_bench.testbed import why_unavailable

    net = out["network"]
    if why_unavailable("fbd-probe"):
        assert net is None and "skipped:" in r.stderr
    else:
        assert net["fanin_verified"] and net["ip_fragments"] == 0, net
        assert "of capacity" in r.stderr
        assert fanin_cli(*command.split()[1:], "--help").returncode == 0, command


def test_bench_allreduce_quick_json_reports_verified_figures():
    r = fanin_cli("bench", "allreduce", "--workers", "2", "--size", "2MB", "--iters", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("median_s", "goodput_gbps", "elements_per_s", "retransmissions", "verified",
                "noaggr_median_s", "ratio_vs_noaggr"):
        assert key in out
    assert out["verified"] is True and out["median_s"] > 0
    # every timed result of both arms, on both workers, was checked
    assert out["timed_results_checked"] == 2 * 2 * 2, out


def test_bench_allreduce_auth_reports_goodput_and_cpu_ratios():
    r = fanin_cli("bench", "allreduce", "--auth", "--workers", "2", "--size", "2MB", "--iters", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verified"] is True and "noaggr_median_s" not in out
    assert out["timed_results_checked"] == 2 * 6 * 2, out
    assert 0 < out["auth_goodput_ratio"] < 2 and 0 < out["auth_goodput_ratio_paired"] < 2
    cpu = out["cpu_s_per_allreduce"]
    # both arms burn CPU in the workers and the switch
    assert 0 < cpu["fanin"]["switch"] < cpu["fanin"]["total"] and 0 < cpu["auth"]["switch"] < cpu["auth"]["total"]
    # (a 2 MB run is too short to show the tag's cost above the noise)
    assert 0.3 < out["auth_cpu_ratio"] < 1.5, out["auth_cpu_ratio"]


def test_control_api_admits_lists_and_removes_jobs_on_the_real_daemon():
    from fanin.control import ControlClient, ControlError

    cfg = switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr=None, memory_mb=64, jobs=[])
    cfg["control_token"] = "s3cret"
    with SwitchProcess(cfg) as sw:
        c = ControlClient(sw.control_addr, token="s3cret")
        info = c.info()
        assert info["api_version"] == "v1" and info["data_addr"] == sw.data_addr
        # loopback's MTU (65536) caps a datagram's elements at the wire's maximum
        assert info["packet_elems_max"] > 1024, info
        c.admit_job(7, [0, 1], block_cnt_max=16, block_grad_max=256)
        assert [j["job_id"] for j in c.list_jobs()] == [7]
        with pytest.raises(ControlError) as e:
            c.admit_job(7, [0, 1])
        assert "ALREADY_EXISTS" in str(e.value)
        with pytest.raises(ControlError) as e:
            c.admit_job(8, [0], block_cnt_max=1 << 20, block_grad_max=16000)
        assert "RESOURCE_EXHAUSTED" in str(e.value)
        with pytest.raises(ControlError) as e:
            c.admit_job(9, [], block_cnt_max=4, block_grad_max=4)
        assert "INVALID_ARGUMENT" in str(e.value) and "members is empty" in str(e.value)
        with pytest.raises(ControlError) as e:
            ControlClient(sw.control_addr, token="wrong").info()
        assert "UNAUTHENTICATED" in str(e.value)
        # a worker uses the job admitted over the API
        res = []
        import threading

        ts = [threading.Thread(target=lambda r=r: res.append(
            fanin.Session(sw.data_addr, 7, r, elems_per_packet=256).allreduce(np.full(1000, 2, np.int32))))
              for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert all(r.tolist() == [4] * 1000 for r in res) and len(res) == 2
        counters = {(x["name"], x.get("reason") or ""): x["value"] for x in c.counters()}
        assert counters[("accepted", "")] >= 2
        c.remove_job(7)
        assert c.list_jobs() == []
        with pytest.raises(ControlError) as e:
            c.remove_job(7)
        assert "NOT_FOUND" in str(e.value)
        # on-path relays (docs/goat.md): the next hop runs as many shards as this switch
        shards = info["shard_count"]
        with pytest.raises(ControlError) as e:
            c.install_transit(5, "127.0.0.1:9000", shards + 1)
        assert "INVALID_ARGUMENT" in str(e.value) and "same number of shards" in str(e.value)
        with pytest.raises(ControlError) as e:
            c.install_transit(5, "nowhere", shards)
        assert "INVALID_ARGUMENT" in str(e.value) and "not ip:port" in str(e.value)
        with pytest.raises(ControlError) as e:
            c.install_transit(5, "127.0.0.1:9000", shards, sources=[70000])
        assert "INVALID_ARGUMENT" in str(e.value) and "source 70000" in str(e.value)
        c.install_transit(5, "127.0.0.1:9000", shards)
        c.install_transit(5, "127.0.0.1:9100", shards, sources=[0, 3])  # moved, for two workers only
        c.remove_transit(5)
        with pytest.raises(ControlError) as e:
            c.remove_transit(5)
        assert "NOT_FOUND" in str(e.value)


def test_a_capacity_blaster_says_when_it_is_sending_and_until_when():
    # the network benches count a link only while every blaster is sending:
    # each one says so once its first datagrams are out, with the monotonic
    # clock (the driver's too) at its first send and its end
    t_before = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fanin_bench.bench.net_worker", "blast", "--to", "127.0.0.1:9",
                        "--mbit", "20", "--seconds", "0.3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, last = (json.loads(line) for line in r.stdout.splitlines())
    assert first["sending"] is True and t_before < first["t0"] < time.monotonic()
    assert first["until"] == pytest.approx(first["t0"] + 0.3)
    assert last["sent_bytes"] > 0


def test_gloo_results_are_checked_per_element_so_a_wrong_small_element_fails():
    # audit: allclose(atol=1e-6 * max|ref|) passes any error in an element
    # far below the largest; the bound is per element now (net_worker's)
    from fanin.proc import reference_sum
    from fanin_bench.bench.net_worker import gloo_bound

    n = 4096
    ref, allowed = gloo_bound(4, n, "float32")
    assert np.array_equal(ref, reference_sum(4, n, "float32"))
    good = ref.astype(np.float32).astype(np.float64)  # a correctly rounded sum
    assert np.all(np.abs(good - ref) <= allowed)
    small = int(np.argmin(np.abs(ref)))
    bad = good.copy()
    bad[small] += 1e-3 * abs(ref[small]) + 1e-12  # a thousandth off, in the smallest element
    assert np.allclose(bad, ref, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(ref))))  # what the old check did
    assert not np.all(np.abs(bad - ref) <= allowed)


def test_gloo_compare_runs_exactly_the_iterations_asked_alternating_which_system_goes_first():
    pytest.importorskip("torch")
    from fanin_bench.bench.gloo import blocks

    assert blocks(3) == [(2, "gloo"), (1, "fanin")]
    assert blocks(7) == [(2, "gloo"), (2, "fanin"), (2, "gloo"), (1, "fanin")]
    assert blocks(1) == [(1, "gloo")]
    assert all(sum(k for k, _ in blocks(i)) == i for i in range(1, 30))
    r = fanin_cli("bench", "gloo-compare", "--workers", "2", "--size", "1MB", "--iters", "3", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert len(report["gloo_times_s"]) == len(report["fanin_times_s"]) == 3, report
    assert report["gloo_verified"] and report["gloo_timed_results_checked"] == 2 * 3
    assert 0 < report["gloo_worst_fraction_of_bound"] <= 1


def test_gloo_compare_fails_on_a_wrong_gloo_sum_before_reporting_a_speedup(monkeypatch, capsys):
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from fanin_bench.bench import gloo

    def fake_gloo(workers, elements, iters):
        return {"median_s": 1.0, "times_s": [1.0] * iters, "cpu_s": [1.0] * iters, "verified": False,
                "max_abs_error": 0.5, "worst_fraction_of_bound": 3.0, "timed_results_checked": iters * workers}

    class FakeRun:
        def __init__(self, iters):
            self.iters = iters

        def summary(self):
            return {"times_s": [0.5] * self.iters, "verified": True, "retransmissions": 0,
                    "cpu_s_times": [0.5] * self.iters}

    monkeypatch.setattr(gloo, "run_gloo", fake_gloo)
    monkeypatch.setattr(gloo, "run_allreduce", lambda p, label: FakeRun(p.iters))
    args = SimpleNamespace(size="1MB", quick=False, iters=3, workers=2, elems_per_packet=4096, window=128, shards=1,
                           seed=1, results="multicast", json=True)
    with pytest.raises(RuntimeError, match="Gloo rank's sum is outside"):
        gloo.run_gloo_compare(args)
    assert "speedup_vs_gloo" not in capsys.readouterr().out


def test_kv_network_fails_on_a_wrong_word_count_before_any_figure(monkeypatch):
    # audit: a wrong count still produced the full report (exit 1 only)
    import fanin.kv
    from fanin_bench.bench import kv_network

    class FakeClient:
        def __init__(self, path, timeout=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def create(self, senders):
            return 7

        def send(self, ticket, ch, pairs):
            return {"packets": 1, "retransmissions": 0, "first_bytes": 10}

        def wait(self, ticket):
            return {"the": 2, "cat": 2}  # one "cat" too many

    monkeypatch.setattr(fanin.kv, "Client", FakeClient)
    with pytest.raises(RuntimeError, match="word count is wrong for 1 of 2 words.*'cat': 2 \\(expected 1\\)"):
        kv_network._task("rx", ["tx0"], [[("the", 1), ("cat", 1), ("the", 1)]])


def test_a_switch_process_that_fails_to_start_says_why_and_leaves_no_config_behind(tmp_path, monkeypatch):
    """SwitchProcess said only "fanin switch exited with code 2 before it was
    ready (config /tmp/fanin-switch-XXXX.json)", and left that file behind
    (58 of them were found in /tmp)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None)
    cfg["shards"] = 0  # past switch_config's own check, as a config file could have it
    with pytest.raises(RuntimeError, match=r"exited with code 2 before it was ready: .*shards = 0 is out of range"):
        SwitchProcess(cfg)
    assert list(tmp_path.iterdir()) == []
    # a start failure (exit 1): the port is taken
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        cfg = switch_config(data_addr=f"127.0.0.1:{s.getsockname()[1]}", control_addr=None, metrics_addr=None)
        with pytest.raises(RuntimeError, match="cannot bind data port"):
            SwitchProcess(cfg)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, says", [
    (["--workers", "0"], "argument --workers: 0 is out of range (1 to "),
    (["--loss", "-1"], "argument --loss: -1 is not a probability"),
    (["--loss", "nan"], "argument --loss: nan is not a probability"),
    (["--shards", "0"], "argument --shards: 0 is out of range (1 to 64)"),
    (["--elements", "0"], "argument --elements: 0 is out of range (1 to "),
    (["--rounds", "0"], "argument --rounds: 0 is out of range (1 to "),
])
def test_demo_refuses_values_that_test_nothing_or_cannot_run(args, says):
    """`fanin demo --elements 0` (or --rounds 0) reported PASS having tested
    nothing; --workers 0, --loss -1 and --shards 0 failed with only "fanin
    switch exited with code 2"."""
    r = fanin_cli("demo", "--no-network", *args, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "PASS" not in r.stdout + r.stderr, r.stderr


def test_run_demo_refuses_values_that_test_nothing():
    from fanin.demo import run_demo

    for kw, says in [(dict(elements=0), "elements = 0 is out of range"), (dict(rounds=0), "rounds = 0 is out of range"),
                     (dict(workers=0), "workers = 0 is out of range"), (dict(loss=1.5), "loss = 1.5 is not a probability")]:
        with pytest.raises(ValueError, match=says):
            run_demo(network=False, **kw)
