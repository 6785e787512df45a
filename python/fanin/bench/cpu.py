"""CPU time of processes and process trees, read from /proc.

Wall time alone hides where a 2-core machine's cycles go: a system that
leaves a core idle and one that burns both can take equally long. The
benches report CPU seconds next to wall seconds, measured the same way for
every system compared.

* :func:`process_cpu_seconds`: every live thread of one process, from
  ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds, so short runs are not
  rounded to clock ticks).
* :func:`tree_cpu_seconds`: a process and all its live descendants, plus
  what each of them has collected from children it already reaped
  (``cutime``/``cstime``): a PySpark job's JVM, its Python worker daemon
  and the workers that daemon forked and reaped are all counted, and a
  ``multiprocessing`` pool that exited inside the measured span is too.
  Sample before and after the work and subtract.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional

__all__ = ["process_cpu_seconds", "tree_cpu_seconds"]

_TICK = os.sysconf("SC_CLK_TCK")


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


def _stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (which may
    itself contain spaces and parentheses), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def tree_cpu_seconds(root: int) -> float:
    """CPU time of ``root`` and every live descendant, including the time of
    children they have already waited for."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children[int(fields[1])].append(int(entry))  # fields[1] = ppid
    total = 0.0
    stack = [root]
    while stack:
        pid = stack.pop()
        fields = _stat_fields(pid)
        if fields is None:
            continue
        # fields[13], fields[14] = cutime, cstime (stat fields 16 and 17).
        total += process_cpu_seconds(pid) + (int(fields[13]) + int(fields[14])) / _TICK
        stack.extend(children.get(pid, ()))
    return total
