"""CPU time of processes, and of everything a benchmark started.

Wall time alone hides where a 2-core machine's cycles go: a system that
leaves a core idle and one that burns both can take equally long. The
benches report CPU seconds next to wall seconds, measured the same way for
every system compared.

* :func:`process_cpu_seconds`: every live thread of one process, from
  ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds, so short runs are not
  rounded to clock ticks). Threads that have exited are not in it: for a
  process whose threads stay (the switch) over a span of milliseconds.
* :class:`CpuGroups`: throw-away cgroups the bench moves itself (and so
  every process it starts afterwards) and the switch into; their CPU usage
  counts every process and thread that ever ran in them, exited or not.
  Reading ``/proc`` cannot do that: PySpark's worker daemon ignores
  SIGCHLD, so the kernel reaps its forked workers and their CPU time is
  added to no parent's ``cutime`` (a first version summing the process
  tree from ``/proc`` reported a Spark job at a third of its CPU).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["process_cpu_seconds", "CpuGroups"]


def process_cpu_seconds(pid: Optional[int]) -> float:
    """CPU time of every live thread of process ``pid`` so far; 0 if gone."""
    if pid is None:
        return 0.0
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total / 1e9


def _cpu_hierarchy() -> tuple[str, str, str]:
    """(mount point, this process's cgroup path in it, "v2" or "v1") of a
    hierarchy that accounts CPU: the unified one (cgroup2, ``cpu.stat`` is
    there with or without the cpu controller) or else the v1 ``cpuacct``."""
    with open("/proc/self/cgroup") as f:
        own = [line.rstrip("\n").split(":", 2) for line in f]
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    for dev, point, fstype, opts, *_ in mounts:
        if fstype == "cgroup2":
            path = next((p for hid, ctl, p in own if hid == "0" and ctl == ""), None)
            if path is not None:
                return point, path, "v2"
    for dev, point, fstype, opts, *_ in mounts:
        if fstype == "cgroup" and "cpuacct" in opts.split(","):
            path = next((p for hid, ctl, p in own if "cpuacct" in ctl.split(",")), None)
            if path is not None:
                return point, path, "v1"
    raise OSError("no cgroup2 or cgroup-v1 cpuacct hierarchy is mounted")


class CpuGroups:
    """Leaf cgroups (``host`` and ``switch`` by default) under a fresh
    parent; entering moves this process into ``host``.

    ``seconds()`` is the CPU of everything in the parent, ``seconds(leaf)``
    of one leaf; sample before and after the work and subtract. On exit
    every process still in the leaves (this one included) goes back to
    this process's original cgroup and the groups are removed. Needs
    write access to the cgroup filesystem (root); :meth:`unavailable`
    says why not, so a bench can report CPU as absent instead of wrong.
    """

    def __init__(self, leaves: tuple[str, ...] = ("host", "switch")) -> None:
        self.leaves = leaves
        self.mount, self.origin, self.version = _cpu_hierarchy()
        self.base = os.path.join(self.mount, f"fanin-bench-{os.getpid()}")

    @staticmethod
    def unavailable() -> Optional[str]:
        """None if CPU groups can be made here, else the reason."""
        try:
            mount, _, _ = _cpu_hierarchy()
        except OSError as e:
            return str(e)
        if not os.access(os.path.join(mount, "cgroup.procs"), os.W_OK):
            return f"no write access to {mount} (CPU accounting by cgroup needs root)"
        return None

    def __enter__(self) -> "CpuGroups":
        os.mkdir(self.base)
        try:
            for leaf in self.leaves:
                os.mkdir(os.path.join(self.base, leaf))
            self.adopt(os.getpid(), self.leaves[0])
        except BaseException:
            self._remove()
            raise
        return self

    def adopt(self, pid: int, leaf: str) -> None:
        """Move process ``pid`` (all its threads) into ``leaf``; its later
        children start there too."""
        if leaf not in self.leaves:
            raise ValueError(f"unknown CPU group {leaf!r}; the groups are {', '.join(self.leaves)}")
        with open(os.path.join(self.base, leaf, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def seconds(self, leaf: Optional[str] = None) -> float:
        """CPU seconds used so far in ``leaf``, or in all of them."""
        group = self.base if leaf is None else os.path.join(self.base, leaf)
        if self.version == "v2":
            with open(os.path.join(group, "cpu.stat")) as f:
                usage = dict(line.split() for line in f)
            return int(usage["usage_usec"]) / 1e6
        with open(os.path.join(group, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        home = os.path.join(self.mount, self.origin.lstrip("/"), "cgroup.procs")
        for leaf in self.leaves:
            group = os.path.join(self.base, leaf)
            try:
                with open(os.path.join(group, "cgroup.procs")) as f:
                    pids = f.read().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    with open(home, "w") as f:
                        f.write(pid)
                except ProcessLookupError:
                    pass  # exited meanwhile
            try:
                os.rmdir(group)
            except OSError:
                pass  # a process forked in between; the group stays, harmless
        try:
            os.rmdir(self.base)
        except OSError:
            pass
