"""CPU accounting of the benches (fanin_bench.bench.cpu) against real processes
that burn a known amount of CPU and then disappear the ways a Spark job's
processes do: a thread that exits, a child reaped by a parent that ignores
SIGCHLD (PySpark's worker daemon: the kernel reaps, no parent's cutime
keeps the time). Reading /proc loses both; the cgroup keeps them."""

import os
import subprocess
import sys
import time

import pytest

from fanin_bench.bench.cpu import CpuGroups, process_cpu_seconds

NO_GROUPS = CpuGroups.unavailable()
needs_groups = pytest.mark.skipif(NO_GROUPS is not None, reason=f"cgroup CPU accounting: {NO_GROUPS}")

# Burns about argv[1] seconds of CPU in a thread that then exits.
THREAD_BURN = ("import sys, threading, time\n"
               "def burn():\n"
               "    end = time.thread_time() + float(sys.argv[1])\n"
               "    while time.thread_time() < end: pass\n"
               "t = threading.Thread(target=burn); t.start(); t.join()\n")

# Ignores SIGCHLD, forks a child that burns argv[1] s and exits, waits
# until the kernel has reaped it, prints "reaped" and stays alive.
IGNORED_CHILD = ("import os, signal, sys, time\n"
                 "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
                 "pid = os.fork()\n"
                 "if pid == 0:\n"
                 "    end = time.process_time() + float(sys.argv[1])\n"
                 "    while time.process_time() < end: pass\n"
                 "    os._exit(0)\n"
                 "while os.path.exists(f'/proc/{pid}'): time.sleep(0.01)\n"
                 "print('reaped', flush=True)\n"
                 "time.sleep(30)\n")


@needs_groups
def test_exited_threads_and_kernel_reaped_children_are_counted():
    with CpuGroups() as groups:
        before = groups.seconds()
        subprocess.run([sys.executable, "-c", THREAD_BURN, "0.3"], check=True)
        parent = subprocess.Popen([sys.executable, "-c", IGNORED_CHILD, "0.3"], stdout=subprocess.PIPE, text=True)
        try:
            assert parent.stdout.readline().strip() == "reaped"
            # /proc has nothing left of the child's 0.3 s: the parent's own
            # and collected times stay at interpreter start-up.
            fields = open(f"/proc/{parent.pid}/stat").read().rsplit(")", 1)[1].split()
            assert sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK") < 0.25
            used = groups.seconds() - before
        finally:
            parent.kill()
            parent.wait()
    assert used >= 0.55, used


@needs_groups
def test_an_adopted_process_is_counted_in_its_own_group_and_in_the_total():
    with CpuGroups() as groups:
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()\n" + THREAD_BURN, "0.3"],
                             stdin=subprocess.PIPE, text=True)
        try:
            groups.adopt(p.pid, "switch")
            t0, s0, h0 = groups.seconds(), groups.seconds("switch"), groups.seconds("host")
            p.communicate("go\n", timeout=30)
            assert p.returncode == 0
        finally:
            p.kill()
        switch = groups.seconds("switch") - s0
        total = groups.seconds() - t0
        host = groups.seconds("host") - h0
    assert switch >= 0.25, switch
    assert total >= switch
    assert host < 0.2, host  # this test process only waited


@needs_groups
def test_leaving_restores_the_original_cgroup_and_removes_the_groups():
    own = open("/proc/self/cgroup").read()
    with CpuGroups() as groups:
        base = groups.base
        assert open("/proc/self/cgroup").read() != own
        with pytest.raises(ValueError, match="unknown CPU group 'nope'"):
            groups.adopt(os.getpid(), "nope")
    assert open("/proc/self/cgroup").read() == own
    assert not os.path.exists(base)


def test_live_thread_reader_counts_a_busy_process_and_nothing_for_a_gone_one():
    p = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                          "while time.process_time() < end: pass\nprint('done', flush=True)\ntime.sleep(30)\n"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "done"
        assert process_cpu_seconds(p.pid) >= 0.25
    finally:
        p.kill()
        p.wait()
    time.sleep(0.05)
    assert process_cpu_seconds(p.pid) == 0.0
