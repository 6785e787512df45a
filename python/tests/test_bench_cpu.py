"""CPU accounting of the benches (fanin.bench.cpu) against real processes
that burn a known amount of CPU: a live grandchild, and a child that has
exited and been reaped (its time lives on in the parent's cutime)."""

import os
import subprocess
import sys
import time

from fanin.bench.cpu import process_cpu_seconds, tree_cpu_seconds

# Burns about `s` seconds of CPU, then prints "done" and sleeps (stays alive).
BURN = ("import sys, time\n"
        "end = time.process_time() + float(sys.argv[1])\n"
        "while time.process_time() < end: pass\n"
        "print('done', flush=True)\n"
        "time.sleep(30)\n")

# Starts BURN as its own child (our grandchild), relays its "done", sleeps.
PARENT = ("import subprocess, sys, time\n"
          "c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)\n"
          "print(c.stdout.readline().strip(), flush=True)\n"
          "time.sleep(30)\n")


def test_a_live_grandchild_is_counted_in_its_ancestors_tree():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, BURN, "0.4"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "done"
        tree = tree_cpu_seconds(parent.pid)
        alone = process_cpu_seconds(parent.pid)
        # The grandchild's 0.4 s is in the tree, not in the parent alone
        # (which only started an interpreter and waited).
        assert tree - alone >= 0.35, (tree, alone)
        assert alone < 0.35, alone
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)  # the grandchild
        parent.kill()
        parent.wait()


def test_a_reaped_child_stays_counted():
    me = os.getpid()
    before = tree_cpu_seconds(me)
    # The child exits after its burn (no sleep): we wait for it, so its
    # CPU moves into our cutime and must not vanish from the tree.
    subprocess.run([sys.executable, "-c", BURN.replace("time.sleep(30)\n", ""), "0.3"], check=True,
                   stdout=subprocess.DEVNULL)
    grown = tree_cpu_seconds(me) - before
    assert grown >= 0.25, grown


def test_a_gone_process_counts_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    time.sleep(0.05)
    assert process_cpu_seconds(p.pid) == 0.0
    assert tree_cpu_seconds(p.pid) == 0.0
