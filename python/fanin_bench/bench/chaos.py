"""``fanin bench chaos``: a bounded chaos soak on the namespace testbed.

Several jobs run at once through one real switch daemon: value-stream
allreduce jobs (int32 and float32, free-running worker processes that
verify every result themselves, see ``chaos_worker``) and key-value
word-count tasks over real text (``fanin kv daemon`` on three hosts,
checked against ``collections.Counter``). Meanwhile a seeded chaos driver
injects, one fault at a time:

* all along: seeded loss of what every worker sends and loss, duplication
  and reordering of what it receives (counted by the workers);
* ``garbage``: malformed datagrams and datagrams for an unknown job;
* ``forge``: contributions to the (authenticated) value jobs sealed with a
  wrong key, with another job's member key, or not sealed;
* ``replay``: real value-stream datagrams captured on a worker's link,
  replayed later;
* ``kv_forge`` / ``kv_replay``: a keyed key-value task of the driver's own
  is attacked between its two channels (so it is certainly running): Data
  and Release datagrams forged from the attacker host (wrong key, another
  task's member key, unsealed), or its sender's real datagrams captured on
  the sender's link and replayed; its count must stay exact;
* ``kill_worker``: SIGKILL of a worker of the degradable job, restarted a
  few seconds later (it rejoins the running job, SwitchML++ sync);
* ``restart_rank``: SIGKILL of one worker of either job, restarted a few
  seconds later with a plain join (a new incarnation, as ``torchrun
  --max-restarts`` does): the job's round ends, every survivor's call
  raises ``MemberRestarted`` (or ``MemberFailed``, if the member timeout
  came first) and never returns the old round's sums; the survivors start
  new sessions (``--rejoin``, as an elastic agent restarts its group) and
  the job's next round runs with all three;
* ``restart_job``: SIGKILL of every worker of either job, all restarted
  with plain joins: a whole-job restart starts a fresh round at once;
* ``kill_kv_sender``: SIGKILL of a key-value sender daemon (h1 or h2),
  most likely mid-task (tasks run back to back), restarted a moment later:
  the running task must end in ``SenderFailed`` naming the channel, with a
  partial count that holds the other channel exactly and never more than
  the failed one sent (``partial_verified``), or fail cleanly;
* ``restart_switch``: SIGKILL of the switch daemon, started again on the
  same ports (a new incarnation: the workers must recover).

At the end the chaos stops, every surviving worker must complete fresh
allreduces (nothing hung), and the report checks:

* zero wrong results (value and key-value);
* zero hangs (no worker silent longer than ``--hang-s``; every kv task
  ends, with a result or a clean error, within its deadline);
* zero errors, and every raised call (``MemberRestarted``, ``MemberFailed``)
  of a worker inside a restart fault of its own job: a raise anywhere else
  counts as an error;
* the switch's counters account for every injected garbage datagram by
  reason, every forged and replayed value and key-value datagram by its
  ``auth_*`` counter (``kv.auth_*`` for key-value), summed over
  incarnations (counters are scraped after every fault, before any kill).

    fanin bench chaos --quick --json        # 1 minute
    fanin bench chaos --duration 600        # the 10-minute soak
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from fanin import topology
from fanin.auth import derive_member_key, new_job_key
from fanin.switch import job_config

INT_JOB, FLOAT_JOB = 1, 2
WORKERS = 3
BLOCKS, EPP, WINDOW = 24, 256, 16
# Job 1 degrades around a dead worker: blocks wait this long, then age out.
BLOCK_EXP_MS = 200
FAULTS = ("garbage", "forge", "replay", "kill_worker", "restart_rank", "restart_job", "restart_switch", "kv_forge",
          "kv_replay", "kill_kv_sender")
# Network faults all along, injected by every worker (seeded and counted;
# netem is not available on every kernel): loss of what it sends; loss,
# duplication and reordering of what it receives. Not at the switch's
# ingress, which would also drop or duplicate the garbage the driver must
# account for exactly.
NETWORK = {"send_drop": 0.01, "recv_drop": 0.01, "recv_duplicate": 0.01, "recv_reorder": 0.02}
# Send lanes per rank (docs/network.md): ranks 0 and 2 of each job send from
# two sockets and threads (one per switch shard), rank 1 from one, so a job
# mixes both and every fault also meets a worker whose shards' datagrams
# leave from different addresses.
SHARDS = 2
LANES = {0: 2, 1: 1, 2: 2}


def _log(msg: str) -> None:
    print(f"chaos: {msg}", file=sys.stderr, flush=True)


class Worker:
    """One chaos_worker process and the lines it printed (read by a thread)."""

    def __init__(self, tb, host: str, argv: list[str], job: int, label: str, lanes: int) -> None:
        self.label, self.host, self.argv, self.job, self.lanes = label, host, argv, job, lanes
        self.proc = tb.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines: list[dict[str, Any]] = []
        self.last_progress = time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rec["t_seen"] = self.last_progress = time.monotonic()
            self.lines.append(rec)

    def done(self) -> list[dict[str, Any]]:
        return [r for r in self.lines if r.get("event") == "done"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)

    def wait(self, timeout: float) -> Optional[int]:
        """Wait for the worker to exit; SIGKILL and None if it did not in time."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            code = None
        self._reader.join(timeout=5)
        return code


class Soak:
    """The testbed, the daemons, the workloads and the fault log of one run."""

    def __init__(self, stack: ExitStack, args) -> None:
        from fanin_bench.testbed import Testbed

        self.args = args
        self.rng = random.Random(args.seed)
        self.stack = stack
        for job in (INT_JOB, FLOAT_JOB):
            self.stop_file(job).unlink(missing_ok=True)
        # h0..h2 run job 1, h1..h3 job 2; h0 receives kv tasks, h1/h2 send; h4 is the attacker.
        self.topo = topology.star(5)
        self.tb = stack.enter_context(Testbed.up(self.topo, name="fbchaos"))
        self.tb.enable_routing()
        # Both value jobs are authenticated (docs/security.md): every
        # member seals its datagrams with its own key.
        self.job_keys = {job: new_job_key() for job in (INT_JOB, FLOAT_JOB)}
        self.jobs = [job_config(INT_JOB, sources=WORKERS, block_cnt_max=WINDOW, block_grad_max=EPP,
                                block_exp_ms=BLOCK_EXP_MS, slow_after_windows=2, key=self.job_keys[INT_JOB]),
                     job_config(FLOAT_JOB, sources=WORKERS, block_cnt_max=WINDOW, block_grad_max=EPP,
                                key=self.job_keys[FLOAT_JOB])]
        self.counter_base: Counter = Counter()  # counters of the incarnations already gone
        self.counter_last: dict[str, int] = {}
        self.switch = self._start_switch()
        self.workers: dict[tuple[int, int], Worker] = {}
        self.retired: list[Worker] = []
        for rank in range(WORKERS):
            self.workers[(INT_JOB, rank)] = self._worker(INT_JOB, rank, "int32", f"h{rank}")
            self.workers[(FLOAT_JOB, rank)] = self._worker(FLOAT_JOB, rank, "float32", f"h{rank + 1}")
        self.faults: Counter = Counter()
        self.injected: Counter = Counter()  # by the counter that must account for it
        self.replays: list[dict[str, Any]] = []
        self.recoveries: list[float] = []
        self.rejoins: list[float] = []
        # restart_rank / restart_job: (job, start, end) of each, and the time
        # from the kill until every worker of the job had a result again
        self.restart_windows: list[tuple[int, float, float]] = []
        self.restarts: list[float] = []
        self.events: list[dict[str, Any]] = []
        self.kv = KvLoad(self) if not args.no_kv else None

    # -- components -------------------------------------------------------------------------------

    def _start_switch(self):
        sw = self.tb.switch("s0", jobs=self.jobs, shards=SHARDS)
        self.incarnation = sw.info.get("incarnation")
        return sw

    def data_addr(self, host: str) -> str:
        return f"{self.tb.addr('s0', toward=host)}:{self.tb.SWITCH_DATA_PORT}"

    def _worker(self, job: int, rank: int, dtype: str, host: str, *, sync_join: bool = False) -> Worker:
        argv = [sys.executable, "-m", "fanin_bench.bench.chaos_worker", "--addr", self.data_addr(host),
                "--job", str(job), "--rank", str(rank), "--workers", str(WORKERS), "--blocks", str(BLOCKS),
                "--elems-per-packet", str(EPP), "--window", str(WINDOW), "--dtype", dtype,
                "--lanes", str(LANES[rank]), "--seed", str(self.rng.randrange(1 << 30)),
                *(f"--{k.replace('_', '-')}={v}" for k, v in NETWORK.items())]
        if sync_join:
            argv.append("--sync-join")
        argv += ["--auth-key", derive_member_key(self.job_keys[job], job, rank).hex()]
        argv += ["--stop-file", str(self.stop_file(job)), "--rejoin"]
        return Worker(self.tb, host, argv, job, f"job{job}/rank{rank}", LANES[rank])

    def stop_file(self, job: int) -> Path:
        return Path(self.args.out) / f"stop-job{job}"

    def scrape(self) -> dict[str, int]:
        from fanin.proc import scrape_counters

        try:
            self.counter_last = scrape_counters(self.switch.metrics_addr)
        except OSError as e:
            _log(f"could not scrape the switch counters: {e}")
        return self.counter_last

    def counters(self) -> Counter:
        total = Counter(self.counter_base)
        total.update(self.counter_last)
        return total

    # -- faults -----------------------------------------------------------------------------------

    def inject(self, kind: str) -> dict[str, Any]:
        return getattr(self, f"_fault_{kind}")()

    def _fault_garbage(self) -> dict[str, Any]:
        count = self.rng.randrange(20, 80)
        out = self._inject_tool("h4", ["garbage", "--to", self.data_addr("h4"), "--count", str(count),
                                       "--seed", str(self.rng.randrange(1 << 30))])
        self.injected.update(out["sent"])
        return {"count": count, "sent": out["sent"]}

    def _fault_forge(self) -> dict[str, Any]:
        job = self.rng.choice([INT_JOB, FLOAT_JOB])
        other = FLOAT_JOB if job == INT_JOB else INT_JOB
        # The attacker is a member of the other job: it holds that job's member key.
        other_key = derive_member_key(self.job_keys[other], other, 0).hex()
        count = self.rng.randrange(20, 80)
        out = self._inject_tool("h4", ["forge", "--to", self.data_addr("h4"), "--job", str(job), "--members",
                                       str(WORKERS), "--other-key", other_key, "--count", str(count),
                                       "--seed", str(self.rng.randrange(1 << 30))])
        self.injected.update(out["sent"])
        return {"job": job, "count": count, "sent": out["sent"]}

    def _fault_replay(self) -> dict[str, Any]:
        host = self.rng.choice(["h0", "h1", "h2"])
        iface = self.tb.interface(host, toward="s0")
        port = self.tb.SWITCH_DATA_PORT
        out = self._inject_tool(host, ["replay", "--iface", iface, "--ports", f"{port}-{port + 1}",
                                       "--capture", str(self.rng.randrange(10, 40)), "--delay", "1"])
        self.replays.append(out)
        self.injected["replayed_datagrams"] += out["replayed"]
        self.injected["auth_replayed"] += out["sealed_value"]
        return {"host": host, **out}

    def _fault_kv_forge(self) -> dict[str, Any]:
        return self.kv.attack("forge")

    def _fault_kv_replay(self) -> dict[str, Any]:
        return self.kv.attack("replay")

    def _fault_kill_kv_sender(self) -> dict[str, Any]:
        return self.kv.kill_sender(self.rng.choice(["h1", "h2"]), self.rng.uniform(0.5, 2.0))

    def _fault_kill_worker(self) -> dict[str, Any]:
        rank = self.rng.randrange(WORKERS)
        w = self.workers[(INT_JOB, rank)]
        w.kill()
        self.retired.append(w)
        down = self.rng.uniform(1.0, 3.0)
        time.sleep(down)
        started = time.monotonic()
        replacement = self._worker(INT_JOB, rank, "int32", w.host, sync_join=True)
        self.workers[(INT_JOB, rank)] = replacement
        # The fault lasts until the replacement has finished an allreduce
        # (start-up, sync join, first result), so faults never overlap: a
        # switch restart right after would otherwise time the replacement's
        # Python start-up as restart recovery. A replacement that never gets
        # there is left to the hang check.
        rejoin = None
        while time.monotonic() - started < self.args.hang_s and replacement.alive():
            if replacement.done():
                rejoin = time.monotonic() - started
                break
            time.sleep(0.02)
        if rejoin is not None:
            self.rejoins.append(rejoin)
        return {"job": INT_JOB, "rank": rank, "down_s": round(down, 2),
                "rejoin_s": None if rejoin is None else round(rejoin, 3)}

    def _fault_restart_rank(self) -> dict[str, Any]:
        job = self.rng.choice([INT_JOB, FLOAT_JOB])
        return self._restart(job, [self.rng.randrange(WORKERS)])

    def _fault_restart_job(self) -> dict[str, Any]:
        return self._restart(self.rng.choice([INT_JOB, FLOAT_JOB]), list(range(WORKERS)))

    def _restart(self, job: int, ranks: list[int]) -> dict[str, Any]:
        """SIGKILL `ranks` of `job` and start them again with plain joins (new
        incarnations). The fault lasts until every worker of the job has
        finished an allreduce that started after the last replacement was up,
        so the survivors' raises and rejoins fall inside it."""
        dtype = "int32" if job == INT_JOB else "float32"
        t0 = time.monotonic()
        for rank in ranks:
            w = self.workers[(job, rank)]
            w.kill()
            self.retired.append(w)
        down = self.rng.uniform(1.0, 3.0)
        time.sleep(down)
        for rank in ranks:
            host = self.workers[(job, rank)].host
            self.workers[(job, rank)] = self._worker(job, rank, dtype, host)
        started = time.monotonic()
        members = {rank: self.workers[(job, rank)] for rank in range(WORKERS)}
        recovered = None
        while time.monotonic() - started < self.args.hang_s:
            if all(any(r["t_seen"] > started for r in w.done()) for w in members.values()):
                recovered = time.monotonic() - t0
                break
            time.sleep(0.02)
        # The window for raises: from the kill until the job runs again (or
        # the hang bound, when it does not: the hang check reports that).
        self.restart_windows.append((job, t0, time.monotonic()))
        if recovered is not None:
            self.restarts.append(recovered)
        raised = sum(1 for w in members.values() for r in w.lines if r.get("event") == "raised" and r["t_seen"] >= t0)
        return {"job": job, "ranks": ranks, "down_s": round(down, 2), "survivors_raised": raised,
                "recovered_s": None if recovered is None else round(recovered, 3)}

    def _fault_restart_switch(self) -> dict[str, Any]:
        self.scrape()
        self.counter_base.update(self.counter_last)
        self.counter_last = {}
        old = self.incarnation
        self.switch.proc.kill()
        self.switch.proc.wait(timeout=10)
        t0 = time.monotonic()
        marks = {k: len(w.done()) for k, w in self.workers.items()}
        self.switch = self._start_switch()
        ready = time.monotonic()
        # Recovery: from the new daemon being ready until every worker has
        # finished an allreduce on it.
        recovery = None
        while time.monotonic() - ready < self.args.hang_s:
            if all(len(w.done()) > marks[k] for k, w in self.workers.items()):
                recovery = time.monotonic() - ready
                break
            time.sleep(0.02)
        if recovery is not None:
            self.recoveries.append(recovery)
        return {"old_incarnation": old, "new_incarnation": self.incarnation,
                "restart_s": round(ready - t0, 3), "recovery_s": None if recovery is None else round(recovery, 3)}

    def _inject_tool(self, host: str, argv: list[str]) -> dict[str, Any]:
        r = self.tb.run(host, [sys.executable, "-m", "fanin_bench.bench.chaos_inject", *argv], timeout=60)
        return json.loads(r.stdout.strip().splitlines()[-1])

    # -- the run ----------------------------------------------------------------------------------

    def hung_workers(self) -> list[str]:
        now = time.monotonic()
        return [w.label for w in self.workers.values() if w.alive() and now - w.last_progress > self.args.hang_s]

    def run(self) -> dict[str, Any]:
        allowed = [f for f in FAULTS if f not in self.args.skip and (self.kv or "kv_" not in f)]
        t_end = time.monotonic() + self.args.duration
        hangs: set[str] = set()
        _log(f"{self.args.duration:.0f} s of chaos: {', '.join(allowed)}")
        while time.monotonic() < t_end:
            kind = self.rng.choice(allowed)
            t0 = time.monotonic()
            detail = self.inject(kind)
            self.faults[kind] += 1
            time.sleep(self.rng.uniform(0.5, 1.5))
            self.scrape()
            hangs.update(self.hung_workers())
            self.events.append({"t": round(t0 - (t_end - self.args.duration), 2), "fault": kind, **detail})
            _log(f"{kind}: {json.dumps(detail)}")
        return self.finish(hangs)

    def finish(self, hangs: set[str]) -> dict[str, Any]:
        _log("chaos over; every worker must now make progress")
        marks = {k: len(w.done()) for k, w in self.workers.items()}
        deadline = time.monotonic() + self.args.hang_s
        while time.monotonic() < deadline:
            if all(len(w.done()) >= marks[k] + 2 or not w.alive() for k, w in self.workers.items()):
                break
            time.sleep(0.2)
        stalled = [w.label for k, w in self.workers.items() if len(w.done()) < marks[k] + 2]
        hangs.update(stalled)
        kv_report = self.kv.stop() if self.kv else None
        self.scrape()
        # Every worker of a job stops after the same allreduce. The workers
        # keep going while this is decided, so it lies as many steps past the
        # furthest one seen as a job makes in 2 s: nobody is past it yet.
        for job in (INT_JOB, FLOAT_JOB):
            done = [w.done() for (j, _), w in self.workers.items() if j == job]
            furthest = max((d[-1]["step"] for d in done if d), default=0)
            now = time.monotonic()
            recent = max((sum(1 for r in d if now - r["t_seen"] < 2.0) for d in done), default=0)
            # Written whole and renamed into place: a worker must never read a
            # half-written (empty) file, or it stops a step before the others.
            tmp = self.stop_file(job).with_suffix(".tmp")
            tmp.write_text(str(furthest + recent + 2))
            os.replace(tmp, self.stop_file(job))
        exit_codes = {w.label: w.wait(timeout=self.args.hang_s) for w in self.workers.values()}
        hangs.update(label for label, code in exit_codes.items() if code is None)
        return self.report(sorted(hangs), kv_report, exit_codes)

    def network_faults(self) -> dict[str, int]:
        """Faults the workers injected (their last report each; a killed
        worker's count dies with it)."""
        total: Counter = Counter()
        for w in list(self.workers.values()) + self.retired:
            last = next((r["faults"] for r in reversed(w.lines) if "faults" in r), None)
            if last:
                total.update(last)
        return dict(total)

    def report(self, hangs: list[str], kv_report: Optional[dict[str, Any]], exit_codes: dict) -> dict[str, Any]:
        value = {"allreduces": 0, "verified": 0, "wrong": 0, "degraded": 0, "errors": 0, "raised": 0,
                 "raised_outside_restarts": 0}
        # Sessions by the send lanes they really used; one that got fewer
        # than its rank asked for is an error (the mix is part of the test).
        lanes: Counter = Counter()
        wrong_examples, error_examples = [], []
        for w in list(self.workers.values()) + self.retired:
            for rec in w.lines:
                if rec.get("event") == "ready":
                    lanes[str(rec.get("lanes"))] += 1
                    if rec.get("lanes") != w.lanes:
                        value["errors"] += 1
                        if len(error_examples) < 5:
                            error_examples.append({"worker": w.label, "asked_lanes": w.lanes, **rec})
                elif rec.get("event") == "done":
                    value["allreduces"] += 1
                    value["verified" if rec["ok"] else "wrong"] += 1
                    value["degraded"] += rec.get("degraded", 0) > 0
                    if not rec["ok"] and len(wrong_examples) < 5:
                        wrong_examples.append({"worker": w.label, "step": rec["step"], "problem": rec["problem"]})
                elif rec.get("event") == "raised":
                    # A raise is the right answer inside a restart of the
                    # worker's own job and an error anywhere else.
                    inside = any(j == w.job and t0 <= rec["t_seen"] <= t1 + 1.0 for j, t0, t1 in self.restart_windows)
                    value["raised"] += 1
                    if not inside:
                        value["raised_outside_restarts"] += 1
                        if len(error_examples) < 5:
                            error_examples.append({"worker": w.label, **rec})
                elif rec.get("event") in ("error", "join_failed"):
                    value["errors"] += 1
                    if len(error_examples) < 5:
                        error_examples.append({"worker": w.label, **rec})
        counters = self.counters()
        accounting = {}
        for counter, sent in sorted(self.injected.items()):
            if counter == "replayed_datagrams":
                continue
            accounting[counter] = {"injected": sent, "counted": counters.get(counter, 0),
                                   "accounted": counters.get(counter, 0) == sent}
        kv_wrong = kv_report["wrong"] if kv_report else 0
        kv_hung = kv_report["hung"] if kv_report else 0
        kv_wrong += kv_report["attacks_failed"] if kv_report else 0
        ok = (value["wrong"] == 0 and value["errors"] == 0 and value["raised_outside_restarts"] == 0
              and len(self.restarts) == self.faults.get("restart_rank", 0) + self.faults.get("restart_job", 0)
              and len(self.recoveries) == self.faults.get("restart_switch", 0)
              and len(self.rejoins) == self.faults.get("kill_worker", 0) and kv_wrong == 0 and not hangs and kv_hung == 0
              and all(a["accounted"] for a in accounting.values()) and value["verified"] > 0)
        return {
            "benchmark": "chaos", "ok": ok, "duration_s": self.args.duration, "seed": self.args.seed,
            "faults": dict(self.faults), "value": value, "sessions_by_lanes": dict(lanes),
            "wrong_examples": wrong_examples,
            "error_examples": error_examples,
            "kv": kv_report, "hangs": hangs, "hang_bound_s": self.args.hang_s,
            "accounting": accounting,
            "network_faults": {"rates": NETWORK, **self.network_faults(),
                               "switch_duplicates": counters.get("duplicate", 0),
                               "switch_retransmissions": counters.get("retransmissions", 0)},
            "replay": {"captured_and_replayed": self.injected.get("replayed_datagrams", 0)},
            "switch_restart_recovery_s": {
                **_spread(self.recoveries),
                # the target: recovery within two of the int job's block timeouts
                "within_two_block_timeouts": sum(r <= 2 * BLOCK_EXP_MS / 1000 for r in self.recoveries)},
            # a killed worker's replacement: process start to its first allreduce
            "worker_rejoin_s": _spread(self.rejoins),
            # restart_rank / restart_job: kill until every worker of the job
            # has a result of the new round
            "job_restart_s": _spread(self.restarts),
            "switch_counters": {k: v for k, v in sorted(counters.items()) if v},
            "worker_exit_codes": exit_codes, "events": self.events,
        }


class KvLoad:
    """Word-count tasks over real text, one after another, in a thread:
    a receiver daemon on h0, sender daemons on h1 and h2."""

    def __init__(self, soak: Soak) -> None:
        from fanin_bench.bench.corpus import build_corpus

        self.soak = soak
        tb = soak.tb
        corpus = build_corpus(os.path.join(soak.args.out, "corpus"), 2 << 20)
        with open(corpus["path"], encoding="ascii") as f:
            self.lines = f.read().splitlines()
        self.daemons = {host: self._daemon(host) for host in ("h0", "h1", "h2")}
        self.stats = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _daemon(self, host: str):
        from fanin.kv import DaemonProcess

        tb = self.soak.tb
        d = DaemonProcess(f"{tb.mgmt_addr('s0')}:{tb.SWITCH_CONTROL_PORT}", netns=tb.namespace(host),
                          control_addr=f"{tb.mgmt_addr(host)}:0", bind_ip=tb.addr(host, toward="s0"),
                          switch_data_ip=tb.addr("s0", toward=host), silence_ms=3000)
        self.soak.stack.callback(d.stop)
        return d

    def kill_sender(self, host: str, down_s: float) -> dict[str, Any]:
        """SIGKILL the sender daemon on `host`, start a new one `down_s`
        later (the task loop picks it up at its next task)."""
        self.daemons[host].kill()
        time.sleep(down_s)
        self.daemons[host] = self._daemon(host)
        self.stats["sender_kills"] += 1
        return {"host": host, "down_s": round(down_s, 2)}

    def _task(self, seed: int) -> None:
        from fanin.kv import Client, KvError, SenderFailed

        rng = random.Random(seed)
        start = rng.randrange(max(1, len(self.lines) - 400))
        chunks = [self.lines[start:start + 200], self.lines[start + 200:start + 400]]
        inputs = [[(w, 1) for line in chunk for w in line.split()] for chunk in chunks]
        expected = Counter(w for chunk in inputs for w, _ in chunk)
        deadline = self.soak.args.hang_s
        t0 = time.monotonic()
        try:
            with Client(self.daemons["h0"].socket_path, timeout=deadline) as rx:
                ticket = rx.create(senders=2, aa_size=256, auth=True)
                errors: list[str] = []

                def send(ch: int, host: str) -> None:
                    try:
                        with Client(self.daemons[host].socket_path, timeout=deadline) as tx:
                            tx.send(ticket, ch, inputs[ch])
                    except (KvError, OSError) as e:
                        errors.append(str(e))

                senders = [threading.Thread(target=send, args=(i, h)) for i, h in enumerate(("h1", "h2"))]
                for t in senders:
                    t.start()
                got = rx.wait(ticket)
                for t in senders:
                    t.join(deadline)
        except SenderFailed as e:
            # A partial aggregate must hold the finished channels exactly
            # and never more than the failed ones sent.
            failed = {f["channel"] for f in e.failed}
            floor = Counter(w for ch, chunk in enumerate(inputs) if ch not in failed for w, _ in chunk)
            ok = all(floor[k] <= e.partial.get(k, 0) <= expected[k] for k in set(expected) | set(e.partial))
            self.stats["partial_verified" if ok else "wrong"] += 1
            if len(self.failures) < 5:
                self.failures.append(str(e)[:200])
            return
        except (KvError, OSError, TimeoutError) as e:
            hung = time.monotonic() - t0 >= deadline or "timed out" in str(e)
            self.stats["hung" if hung else "failed_cleanly"] += 1
            if len(self.failures) < 5:
                self.failures.append(str(e)[:200])
            # a daemon or the switch is down: do not spin on failing tasks
            self._stop.wait(0.2)
            return
        if got == dict(expected):
            self.stats["verified"] += 1
        else:
            self.stats["wrong"] += 1

    def attack(self, kind: str) -> dict[str, Any]:
        """A keyed task of the driver's own, attacked while it certainly runs:
        channel 0 is sent from h1 (for ``replay`` while h1's link is
        captured), then the forged datagrams (from h4) or the captured ones
        (from h1) go to the switch while the task waits for channel 1, then
        channel 1 is sent from h2. Every injected datagram must land in its
        ``kv.auth_*`` counter and the count must equal ``Counter``'s."""
        from fanin.auth import derive_member_key
        from fanin.kv import Client, KvError

        soak, tb = self.soak, self.soak.tb
        rng = random.Random(soak.rng.randrange(1 << 30))
        start = rng.randrange(max(1, len(self.lines) - 200))
        chunks = [self.lines[start:start + 100], self.lines[start + 100:start + 200]]
        inputs = [[(w, 1) for line in chunk for w in line.split()] for chunk in chunks]
        expected = Counter(w for chunk in inputs for w, _ in chunk)
        timeout = soak.args.hang_s
        detail: dict[str, Any] = {}
        try:
            with Client(self.daemons["h0"].socket_path, timeout=timeout) as rx:
                reply = rx.request({"op": "create", "senders": 2, "aa_size": 256, "key": os.urandom(16).hex()})
                ticket = {"task_id": reply["task_id"], "control": reply["control"]}
                task, port = reply["task_id"], int(reply["switch_addr"].rsplit(":", 1)[1])
                detail["task"] = task
                sniffer = None
                if kind == "replay":
                    argv = [sys.executable, "-m", "fanin_bench.bench.chaos_inject", "replay", "--iface",
                            tb.interface("h1", toward="s0"), "--ports", str(port), "--kv-task", str(task),
                            "--capture", str(rng.randrange(10, 40)), "--capture-s", "5", "--delay", "0.2", "--ready"]
                    sniffer = tb.popen("h1", argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    sniffer.stdout.readline()  # capturing
                with Client(self.daemons["h1"].socket_path, timeout=timeout) as tx:
                    tx.send(ticket, 0, inputs[0])
                if sniffer:
                    out, _ = sniffer.communicate(timeout=60)
                    rep = json.loads(out.strip().splitlines()[-1])
                    soak.injected["kv.auth_replayed"] += rep["sealed_kv"]
                    detail.update(captured=rep["captured"], sealed_kv=rep["sealed_kv"])
                else:
                    # The attacker is a member of another task: it holds one of its member keys.
                    other = derive_member_key(os.urandom(16), task ^ 1, 0).hex()
                    count = rng.randrange(20, 80)
                    out = soak._inject_tool("h4", ["kv-forge", "--to", f"{tb.addr('s0', toward='h4')}:{port}",
                                                   "--task", str(task), "--channels", "2", "--other-key", other,
                                                   "--count", str(count), "--seed", str(rng.randrange(1 << 30))])
                    soak.injected.update(out["sent"])
                    detail.update(count=count, sent=out["sent"])
                with Client(self.daemons["h2"].socket_path, timeout=timeout) as tx:
                    tx.send(ticket, 1, inputs[1])
                got = rx.wait(ticket)
        except (KvError, OSError, TimeoutError, subprocess.TimeoutExpired, ValueError) as e:
            self.stats["attacks_failed"] += 1
            detail["error"] = str(e)[:200]
            return detail
        detail["exact"] = got == dict(expected)
        self.stats["attacks_verified" if detail["exact"] else "attacks_wrong"] += 1
        return detail

    def _loop(self) -> None:
        seed = self.soak.args.seed * 10_000
        while not self._stop.is_set():
            seed += 1
            self._task(seed)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(self.soak.args.hang_s * 2)
        hung = self._thread.is_alive()
        return {"tasks": sum(self.stats[k] for k in ("verified", "wrong", "failed_cleanly", "partial_verified", "hung")),
                "verified": self.stats["verified"], "wrong": self.stats["wrong"] + self.stats["attacks_wrong"],
                "attacked_tasks_verified": self.stats["attacks_verified"], "attacks_failed": self.stats["attacks_failed"],
                "failed_cleanly": self.stats["failed_cleanly"], "partial_verified": self.stats["partial_verified"],
                "sender_kills": self.stats["sender_kills"],
                "hung": self.stats["hung"] + int(hung),
                "failure_examples": self.failures}


def run_bench_chaos(args) -> int:
    from fanin_bench.testbed import why_unavailable

    # checked before the testbed: a misspelt --skip used to be ignored, and the fault it named injected
    unknown = [f for f in args.skip if f not in FAULTS]
    if unknown:
        print(f"fanin bench chaos: --skip {' '.join(unknown)}: no such fault; the faults are {', '.join(FAULTS)}",
              file=sys.stderr)
        return 2
    if not [f for f in FAULTS if f not in args.skip and not (args.no_kv and "kv_" in f)]:  # as Soak.run picks
        print("fanin bench chaos: --skip leaves no fault to inject; skip fewer", file=sys.stderr)
        return 2
    reason = why_unavailable()
    if reason:
        print(f"fanin bench chaos needs the namespace testbed: {reason}", file=sys.stderr)
        return 2
    if args.quick:
        args.duration = min(args.duration, 60.0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        soak = Soak(stack, args)
        report = soak.run()
    (Path(args.out) / "chaos.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(_human(report))
    return 0 if report["ok"] else 1


def _spread(samples: list[float]) -> dict[str, Any]:
    """Count, median and max of a list of durations (None when empty)."""
    ordered = sorted(samples)
    return {"count": len(ordered), "max": round(ordered[-1], 3) if ordered else None,
            "median": round(ordered[len(ordered) // 2], 3) if ordered else None}


def _human(r: dict[str, Any]) -> str:
    v, kv = r["value"], r["kv"] or {}
    lines = [f"chaos soak {r['duration_s']:.0f} s, seed {r['seed']}: {'PASS' if r['ok'] else 'FAIL'}",
             f"  faults: {', '.join(f'{k} {n}' for k, n in sorted(r['faults'].items()))}",
             f"  allreduces: {v['verified']} verified, {v['wrong']} wrong, {v['degraded']} degraded, "
             f"{v['errors']} clean errors",
             f"  kv tasks: {kv.get('verified', 0)} verified, {kv.get('wrong', 0)} wrong, "
             f"{kv.get('failed_cleanly', 0)} failed cleanly, {kv.get('partial_verified', 0)} partial (verified), "
             f"{kv.get('hung', 0)} hung; {kv.get('sender_kills', 0)} sender daemons killed",
             f"  hangs: {', '.join(r['hangs']) or 'none'}",
             f"  switch restarts: recovery median {r['switch_restart_recovery_s']['median']} s, "
             f"max {r['switch_restart_recovery_s']['max']} s, "
             f"{r['switch_restart_recovery_s']['within_two_block_timeouts']} of "
             f"{r['switch_restart_recovery_s']['count']} within two block timeouts ({2 * BLOCK_EXP_MS} ms)",
             f"  killed workers back (start to first allreduce): median {r['worker_rejoin_s']['median']} s, "
             f"max {r['worker_rejoin_s']['max']} s",
             f"  ranks and jobs restarted (kill to a new round's results): median {r['job_restart_s']['median']} s, "
             f"max {r['job_restart_s']['max']} s; {v['raised']} calls raised inside them, "
             f"{v['raised_outside_restarts']} outside"]
    for counter, a in r["accounting"].items():
        lines.append(f"  {counter}: injected {a['injected']}, counted {a['counted']}")
    return "\n".join(lines)
