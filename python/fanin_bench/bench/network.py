"""`fanin bench network`: fanin and Gloo's ring on a rate-limited network,
the only place in-network aggregation can win (issue 28; docs/network.md).

A star testbed (``star:N``: one switch namespace, N host namespaces, every
veth limited by tbf in both directions). The real switch daemon runs in the
switch namespace; N long-lived fanin workers and N long-lived Gloo ranks
(``torch.distributed``, TCP, its ring routed through the switch namespace by
the kernel) run in the host namespaces. For every link rate:

1. **capacity**: every host blasts UDP at the switch, then the switch at
   every host, for a few seconds each; what the veth counters saw pass is the
   capacity each link really offers with all links of a direction busy (above
   a few Gbit/s the veths and the CPU, not tbf, set it). Then both directions
   at once, the load an allreduce makes: the duplex capacity, reported beside
   it (``fanin_fraction_of_duplex_capacity``) to show how much of a shortfall
   is the testbed machine's own. The counters are read only while every
   blaster says it is sending; a capacity below 0.8 of the tbf rate is
   flagged (``capacity_low``);
2. **allreduce**: one fanin allreduce and one Gloo allreduce of the same
   tensor (float32, or float16 / bfloat16 with --dtype), alternating (the
   order swapped every repetition), each result checked against the float64
   reference; the veth counters around every allreduce give the bytes each
   worker's link carried per element, each direction.

With ``--collective reduce-scatter`` both systems reduce-scatter instead
(fanin: owner-only results, each worker keeps its 1/N shard and gets the
other blocks as 24-byte headers; Gloo: ``reduce_scatter_tensor``); the ideal
is then S/C for fanin (its whole tensor still goes up) and (N-1)/N * S/C for
the ring, and what fanin gains is the bytes down each link.

Reported per rate: medians; the ideal times at the measured capacity (S/C
for fanin, whose every link carries the tensor once each way, 2(N-1)/N * S/C
for the ring's allreduce); fanin's fraction of the capacity (ideal / median); the
speed-up vs Gloo; fanin's retransmissions and trims; the IP fragments every
namespace created. A fraction of capacity above 1.02 (fanin, keyed, lanes
or Gloo's of its ideal) is no result but an under-read capacity: the row
lists it in ``measurement_problems`` and a warning goes to stderr. fanin
runs with every setting at its default: nothing is tuned per rate.

``--mtu 9000`` builds the testbed with jumbo frames (every interface); fanin
learns the MTU at join, the capacity blast sends full frames. ``--auth`` adds
a third arm, the same allreduce in a keyed job (docs/security.md), and
reports its goodput against the unkeyed one (``keyed_goodput_ratio``).
``--lanes N`` sends each fanin worker's datagrams from N sockets and threads
(``fanin.Session(lanes=N)``); ``--lanes-arm N`` adds an arm that does while
the main one keeps ``--lanes``, alternated in the same run
(``lanes_speedup``: the main arm's median over the lanes arm's).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from fanin import topology
from fanin.auth import derive_member_key, new_job_key
from fanin.controller import Controller, JobParams, TestbedFabric
from fanin.proc import format_size, parse_size
from fanin.session import MAX_LANES
from fanin.switch import job_config
from fanin_bench.bench.net_worker import MEMBER_KEY_ENV
from fanin_bench.bench.trees import step_workers, stop_workers, wait_ready
from fanin_bench.report import emit
from fanin_bench.plotting import save_figure

JOB = 1
KEYED_JOB = 2  # --auth: the same allreduce in a keyed job, every datagram sealed
LANES_JOB = 3  # --lanes-arm N: the same allreduce sent from N lanes per worker
# --results group: the switch sends each result once to this group (port
# RESULT_GROUP_PORT + job), its namespace's data plane copies it to every host
RESULT_GROUP_ADDR = "239.77.0.1"
RESULT_GROUP_PORT = 9500
GLOO_PORT = 29500
BLAST_PORT = 9  # discard: nothing listens; the counters measure what arrived


def payload_per_frame(mtu: int) -> float:
    """UDP payload per byte of Ethernet frame on a full-size frame: a
    1472-byte payload in a 1514-byte frame at MTU 1500 (IPv4). Capacity in
    UDP payload terms is the frame rate times this."""
    return (mtu - 28) / (mtu + 14)


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"fanin bench network: --rates {text!r} is not a comma-separated list of Mbit/s") from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"fanin bench network: --rates {text!r} needs at least one rate > 0 (Mbit/s)")
    return rates


def _worker_argv(kind: str, **kw: Any) -> list[str]:
    argv = [sys.executable, "-m", "fanin_bench.bench.net_worker", kind]
    for k, v in kw.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


#: A link that measures below this fraction of its tbf rate is flagged
#: (``capacity_low``): above a few Gbit/s the testbed machine, not tbf, is
#: the limit, and every fraction of capacity is then against that.
CAPACITY_LOW = 0.8
#: An arm faster than this fraction of the measured capacity means the
#: capacity was under-read: flagged as a measurement problem, not a result.
FRACTION_SUSPECT = 1.02


def _wait_sending(procs: list[subprocess.Popen], timeout: float) -> list[dict[str, Any]]:
    """Each blaster's {"sending": true, "t0", "until"} line (net_worker
    `_blast`), waiting at most `timeout` seconds for all of them."""
    import select

    deadline = time.monotonic() + timeout
    lines: list[Optional[dict[str, Any]]] = [None] * len(procs)
    while any(x is None for x in lines):
        left = deadline - time.monotonic()
        waiting = [p.stdout for p, x in zip(procs, lines) if x is None]
        ready, _, _ = select.select(waiting, [], [], max(0.0, left)) if left > 0 else ([], [], [])
        if not ready:
            late = sum(x is None for x in lines)
            raise RuntimeError(f"capacity blast: {late} of {len(procs)} blasters did not start sending within "
                               f"{timeout:g} s")
        for i, p in enumerate(procs):
            if lines[i] is None and p.stdout in ready:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"capacity blast: a blaster exited ({p.wait()}) before it was sending")
                msg = json.loads(line)
                if msg.get("sending"):
                    lines[i] = msg
    return [x for x in lines if x is not None]


def measure_capacity(tb: Any, hosts: list[str], rate_mbit: float, seconds: float, mtu: int = 1500,
                     edge: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """What each direction of each link carries with every link of that
    direction busy at once, from the veth counters: first all uplinks (every
    host blasts UDP at the switch), then all downlinks (one blaster per host
    in the switch namespace); each link is read with its own timestamps, since
    one read takes milliseconds. That is ``capacity_mbit``, the figure every
    fraction of capacity is taken against.

    Counting starts only once every blaster has said it is sending (a
    blaster slow to start would otherwise be counted for part of the window
    and under-read its link), after a settling time for the queues to fill,
    and stops before the first blaster's end. A capacity below
    ``CAPACITY_LOW`` of the tbf rate is flagged (``capacity_low``, and a
    warning on stderr).

    Then both directions at once (``capacity_duplex_mbit``), the load an
    allreduce puts on the testbed: every link busy each way. Where the links
    (tbf) are the limit the two agree; where the machine running the testbed
    is (veths, softirqs and every endpoint on shared cores, docs/network.md)
    the duplex figure is lower and says how much of a shortfall is the
    testbed's. The blasters send 64 KB GSO batches, so their own CPU stays
    small even on the 2-core VM."""

    edge = edge or {h: "s0" for h in hosts}  # each host's switch
    windows: list[dict[str, float]] = []

    def blast(direction: str) -> list[float]:
        """Per-link Mbit/s up, down, or (``both``) up then down of one run."""
        offer = rate_mbit * 1.3  # over the limit, so tbf's queue stays full
        payload = mtu - 28  # full frames, as the allreduces send
        procs = []
        if direction in ("up", "both"):
            procs += [tb.popen(h, _worker_argv("blast", to=f"{tb.addr(edge[h], toward=h)}:{BLAST_PORT}", mbit=offer,
                                               seconds=seconds, payload=payload),
                               stdout=subprocess.PIPE, text=True) for h in hosts]
        if direction in ("down", "both"):
            procs += [tb.popen(edge[h], _worker_argv("blast", to=f"{tb.addr(h, toward=edge[h])}:{BLAST_PORT}", mbit=offer,
                                                  seconds=seconds, payload=payload),
                               stdout=subprocess.PIPE, text=True) for h in hosts]

        def read() -> dict[str, tuple[float, Any]]:
            out = {}
            for h in hosts:
                t = time.monotonic()
                b = tb.link_bytes(h, edge[h])
                out[h] = ((t + time.monotonic()) / 2, b)
            return out

        try:
            started = _wait_sending(procs, timeout=30 + seconds)
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
        # the blasters' monotonic clock is this process's (one per machine)
        all_sending = max(m["t0"] for m in started)
        first_end = min(m["until"] for m in started)
        # let the queues fill before counting, stop counting before the first blast ends
        t_first = all_sending + min(0.5, seconds / 4)
        t_last = min(t_first + seconds / 2, first_end - min(0.25, seconds / 8))
        if t_last - t_first < seconds / 8:
            for p in procs:
                p.wait(timeout=seconds + 30)
            raise RuntimeError(f"capacity blast ({direction}): the blasters started "
                               f"{all_sending - min(m['t0'] for m in started):.2f} s apart, leaving no "
                               f"{seconds / 8:.2f} s while all were sending; rerun on a quieter machine")
        time.sleep(max(0.0, t_first - time.monotonic()))
        first = read()
        time.sleep(max(0.0, t_last - time.monotonic()))
        last = read()
        for p in procs:
            p.wait(timeout=seconds + 30)
            if p.stdout:
                p.stdout.close()
        windows.append({"start_spread_s": all_sending - min(m["t0"] for m in started),
                        "window_s": min(t1 for t1, _ in last.values()) - max(t0 for t0, _ in first.values())})
        rates = []
        for way in ("up", "down"):
            if direction not in (way, "both"):
                continue
            for h in hosts:
                (t0, b0), (t1, b1) = first[h], last[h]
                sent = b1.a_to_b - b0.a_to_b if way == "up" else b1.b_to_a - b0.b_to_a
                rates.append(sent * 8 / (t1 - t0) / 1e6)
        return rates

    up = blast("up")
    dn = blast("down")
    one_way = up + dn
    duplex = blast("both")
    capacity = statistics.median(one_way)
    low = capacity < CAPACITY_LOW * rate_mbit
    if low:
        print(f"capacity: WARNING the links measured {capacity:.0f} Mbit/s, {capacity / rate_mbit:.2f} of tbf's "
              f"{rate_mbit:g}: below {CAPACITY_LOW:g}, the testbed machine (not the links) is the limit, and "
              f"every fraction of capacity is taken against what it carries", file=sys.stderr)
    return {"capacity_mbit": capacity, "capacity_min_mbit": min(one_way), "mtu": mtu,
            "uplink_mbit": up, "downlink_mbit": dn,
            "capacity_duplex_mbit": statistics.median(duplex), "capacity_duplex_min_mbit": min(duplex),
            "duplex_uplink_mbit": duplex[:len(hosts)], "duplex_downlink_mbit": duplex[len(hosts):],
            "capacity_vs_tbf": capacity / rate_mbit, "capacity_low": low,
            # per blast (up, down, both): how far apart the blasters started
            # sending, and the seconds counted while all were
            "blast_start_spread_s": max(w["start_spread_s"] for w in windows),
            "blast_window_s": min(w["window_s"] for w in windows)}


def flag_fractions(row: dict[str, Any], label: str) -> list[str]:
    """Every ``*fraction_of*`` figure of `row` (nested dicts too) above
    ``FRACTION_SUSPECT``: faster than the measured capacity allows, so the
    capacity was under-read. Marks the row (``measurement_problems``,
    ``measurement_suspect``) and warns on stderr; the problems."""
    problems = []

    def scan(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                scan(v, f"{prefix}{k}.")
            elif "fraction_of" in k and isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and v > FRACTION_SUSPECT:
                problems.append(f"{prefix}{k} = {v:.3f} > {FRACTION_SUSPECT:g}: faster than the measured capacity, "
                                "which was under-read")

    scan(row, "")
    if row.get("capacity_low"):
        problems.append(f"capacity {row.get('capacity_mbit', 0):.0f} Mbit/s is below {CAPACITY_LOW:g} of the tbf rate")
    row["measurement_problems"] = problems
    row["measurement_suspect"] = bool(problems)
    for p in problems:
        print(f"{label}: WARNING measurement problem: {p}", file=sys.stderr)
    return problems


class _LinkBytes:
    """Bytes every worker's link carried during one system's allreduces, each
    direction, from the veth counters read just before and after each one
    (Ethernet frames: the headers of every layer are counted)."""

    def __init__(self, tb: Any, hosts: list[str], edge: dict[str, str]) -> None:
        self.tb, self.hosts, self.edge = tb, hosts, edge
        self.up = {h: 0 for h in hosts}
        self.down = {h: 0 for h in hosts}
        self.allreduces = 0
        self._at: dict[str, Any] = {}

    def start(self) -> None:
        self._at = {h: self.tb.link_bytes(h, self.edge[h]) for h in self.hosts}

    def stop(self) -> None:
        for h in self.hosts:
            now = self.tb.link_bytes(h, self.edge[h])
            self.up[h] += now.a_to_b - self._at[h].a_to_b
            self.down[h] += now.b_to_a - self._at[h].b_to_a
        self.allreduces += 1

    def per_element(self, elements: int, system: str) -> dict[str, Any]:
        per = elements * self.allreduces
        up = [self.up[h] / per for h in self.hosts]
        down = [self.down[h] / per for h in self.hosts]
        return {f"{system}_link_bytes_per_element_up": up, f"{system}_link_bytes_per_element_down": down,
                f"{system}_link_bytes_per_element_max": max(up + down)}


def _cpu_per_allreduce(steps: list[list[dict[str, Any]]], system: str) -> dict[str, Any]:
    """What the whole machine's CPUs did during a system's allreduces, per
    allreduce: each step's slowest worker read /proc/stat around its own
    allreduce, which every other worker's overlaps (clock ticks, coarse:
    summed over the repetitions). Where a rate is CPU-bound it says whether
    user space (the workers' and the switch's work) or the kernel (sockets,
    veths, softirqs) takes the cores."""
    windows = [max(answers, key=lambda a: a["s"]) for answers in steps]
    windows = [w for w in windows if "cpu_ticks" in w]
    if not windows:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    total = [sum(w["cpu_ticks"][i] for w in windows) / hz / len(windows) for i in range(8)]
    user, nice, sys_, idle, iowait, irq, softirq, steal = total
    busy = user + nice + sys_ + irq + softirq + steal
    return {f"{system}_cpu_s_per_allreduce": {"user": user + nice, "system": sys_, "softirq": softirq + irq,
                                              "idle": idle + iowait, "steal": steal},
            f"{system}_cpu_busy_fraction": busy / (busy + idle + iowait) if busy + idle + iowait else None}


def _frag_counts(tb: Any, nodes: list[str]) -> dict[str, int]:
    return {n: tb.ip_stats(n).get("Ip.FragCreates", 0) for n in nodes}


def run_network(args: Any) -> int:
    from fanin_bench.testbed import Testbed, unwind_on_sigterm, why_unavailable

    why = why_unavailable()
    if why:
        print(f"fanin bench network: needs the namespace testbed: {why}", file=sys.stderr)
        return 2
    # a `timeout` or `kill` must still take the testbed down (Testbed.up does
    # this too; here it covers the set-up before it as well)
    unwind_on_sigterm()
    started = time.perf_counter()
    gloo = not args.no_gloo
    if gloo:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("fanin bench network: PyTorch is not installed, so Gloo cannot run "
                  "(pip install -r requirements-bench.txt, or --no-gloo)", file=sys.stderr)
            return 2
    rates = _parse_rates(args.rates or ("200" if args.quick else "100,200,400"))
    if not 1 <= args.lanes <= MAX_LANES:
        print(f"fanin bench network: --lanes {args.lanes} must be 1 to {MAX_LANES}", file=sys.stderr)
        return 2
    if args.lanes_arm is not None and not 1 <= args.lanes_arm <= MAX_LANES:
        print(f"fanin bench network: --lanes-arm {args.lanes_arm} must be 1 to {MAX_LANES}", file=sys.stderr)
        return 2
    topo = _topology(args)
    if topo is None:
        return 2
    group_results = args.results == "group"
    if group_results and len(topo.switches) != 1:
        print("fanin bench network: --results group needs the star (one switch whose ports reach every worker); "
              "a tree's switches return results hop by hop", file=sys.stderr)
        return 2
    n = len(topo.hosts)
    size = parse_size(args.size) if args.size else (4_000_000 if args.quick else 16_000_000)
    elem_bytes = 4 if args.dtype == "float32" else 2
    elements = max(1, size // elem_bytes)
    reps = args.reps or (3 if args.quick else 7)
    seconds = 2.0 if args.quick else 3.0
    hosts = [h.name for h in topo.hosts]
    edge = {h: topo.attachment(h) for h in hosts}
    out = Path(args.out)
    scatter = args.collective == "reduce-scatter"
    mtu = args.mtu or 1500
    print(f"network: {topo.name}, {n} workers, {format_size(size)} {args.dtype} per worker, links {', '.join(f'{r:g}' for r in rates)} "
          f"Mbit/s, {reps} {args.collective}s per system per rate", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(topo, name=args.name, rate_mbit=rates[0], routing=True, mtu=args.mtu,
                                            gro=args.gro))
        job = {k: v for k, v in (("block_grad_max", args.block_grad_max), ("block_cnt_max", args.block_cnt_max))
               if v is not None}
        switch_config = {"shards": args.shards} if args.shards else {}
        targets: dict[int, dict[int, tuple[str, Optional[bytes]]]] = {}  # job -> rank -> (data address, member key)
        # each arm is one job
        arms = (JOB,) + ((KEYED_JOB,) if args.auth else ()) + ((LANES_JOB,) if args.lanes_arm else ())
        result_groups: dict[int, Optional[str]] = {arm: None for arm in arms}
        if len(topo.switches) == 1:
            job_key = new_job_key() if args.auth else None
            if group_results:
                # one group address for every arm (the switch's data plane
                # copies it to every host link), a port per arm's job
                tb.replicate_group(topo.switches[0].name, RESULT_GROUP_ADDR)
                result_groups = {arm: f"{RESULT_GROUP_ADDR}:{RESULT_GROUP_PORT + arm}" for arm in arms}
            jobs = [job_config(arm, n, result_group=result_groups[arm],
                               **(dict(job, key=job_key) if arm == KEYED_JOB else job)) for arm in arms]
            switches = [tb.switch(topo.switches[0].name, jobs=jobs, **switch_config)]
            for arm in arms:
                targets[arm] = {r: (f"{tb.addr(edge[h], toward=h)}:{tb.SWITCH_DATA_PORT}",
                                    derive_member_key(job_key, arm, r) if arm == KEYED_JOB else None)
                                for r, h in enumerate(hosts)}
        else:
            # an aggregation tree over the switches, programmed by the
            # controller (docs/trees.md) as a user's would be
            switches = list(tb.switches(**switch_config).values())
            ctl = Controller(topo, TestbedFabric(tb))
            stack.callback(ctl.close)
            for arm in arms:
                ctl.create_job(JobParams(arm, max_workers=n, auth=arm == KEYED_JOB, **job))
                subs = {r: ctl.subscribe(arm, r, h) for r, h in enumerate(hosts)}
                targets[arm] = {r: (sub["data_addr"], sub["member_key"]) for r, sub in subs.items()}
            print(f"  tree: root {ctl.tree(JOB).root}, {len(ctl.tree(JOB).parent)} switches", file=sys.stderr)

        def counters() -> dict[str, Any]:
            total: dict[str, Any] = {}
            for s in switches:
                for k, v in s.counters().items():
                    if isinstance(v, int):
                        total[k] = total.get(k, 0) + v
            return total

        def fanin_workers(arm: int) -> list[subprocess.Popen]:
            procs = []
            for r, h in enumerate(hosts):
                env = dict(os.environ)
                addr, key = targets[arm][r]
                if key is not None:
                    # not on the command line, where every process could read it
                    env[MEMBER_KEY_ENV] = key.hex()
                procs.append(tb.popen(h, _worker_argv(
                    "fanin", addr=addr, job=arm, rank=r,
                    workers=n, elements=elements, dtype=args.dtype, elems_per_packet=args.elems_per_packet,
                    window=args.window, lanes=args.lanes_arm if arm == LANES_JOB else args.lanes,
                    collective=args.collective, result_group=result_groups[arm]),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
            stack.callback(stop_workers, procs)
            wait_ready(procs, "fanin")
            return procs

        fanin_procs = fanin_workers(JOB)
        keyed_procs = fanin_workers(KEYED_JOB) if args.auth else []
        lanes_procs = fanin_workers(LANES_JOB) if args.lanes_arm else []
        gloo_procs: list[subprocess.Popen] = []
        if gloo:
            master = f"{tb.addr(hosts[0], toward=edge[hosts[0]])}:{GLOO_PORT}"
            gloo_procs = [tb.popen(h, _worker_argv("gloo", master=master, ifname=tb.interface(h, edge[h]), rank=r,
                                                   workers=n, elements=elements, dtype=args.dtype,
                                                   collective=args.collective),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                          for r, h in enumerate(hosts)]
            stack.callback(stop_workers, gloo_procs)
            wait_ready(gloo_procs, "gloo")
        for rate in rates:
            tb.set_rate(rate, args.queue_ms)
            cap = measure_capacity(tb, hosts, rate, seconds, mtu, edge)
            nodes = [s.name for s in topo.switches] + hosts
            frags0 = _frag_counts(tb, nodes)
            sw0 = counters()
            fanin_t, gloo_t, keyed_t, fanin_answers, keyed_answers = [], [], [], [], []
            lanes_t, lanes_answers = [], []
            steps: dict[str, list[list[dict[str, Any]]]] = {"fanin": [], "gloo": []}
            link_bytes = {"fanin": _LinkBytes(tb, hosts, edge), "gloo": _LinkBytes(tb, hosts, edge)}
            step_workers(fanin_procs, "fanin", verify=True)  # warm-up at this rate
            if keyed_procs:
                step_workers(keyed_procs, "fanin-keyed", verify=True)
            if lanes_procs:
                step_workers(lanes_procs, "fanin-lanes", verify=True)
            if gloo:
                step_workers(gloo_procs, "gloo", verify=True)
            systems = (["fanin"] + (["fanin-keyed"] if keyed_procs else []) + (["fanin-lanes"] if lanes_procs else [])
                       + (["gloo"] if gloo else []))
            for rep in range(reps):
                # every system goes first in turn
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                for system in order:
                    if system == "fanin-keyed":
                        answers = step_workers(keyed_procs, "fanin-keyed", verify=True)
                        keyed_answers += answers
                        keyed_t.append(max(a["s"] for a in answers))
                    elif system == "fanin-lanes":
                        answers = step_workers(lanes_procs, "fanin-lanes", verify=True)
                        lanes_answers += answers
                        lanes_t.append(max(a["s"] for a in answers))
                    elif system == "fanin":
                        link_bytes["fanin"].start()
                        answers = step_workers(fanin_procs, "fanin", verify=True)
                        link_bytes["fanin"].stop()
                        steps["fanin"].append(answers)
                        fanin_answers += answers
                        fanin_t.append(max(a["s"] for a in answers))
                    elif gloo:
                        link_bytes["gloo"].start()
                        answers = step_workers(gloo_procs, "gloo", verify=True)
                        link_bytes["gloo"].stop()
                        steps["gloo"].append(answers)
                        if not all(a["verified"] for a in answers):
                            raise RuntimeError("gloo: a rank's sum is wrong")
                        gloo_t.append(max(a["s"] for a in answers))
                print(f"  {rate:g} Mbit/s rep {rep + 1}/{reps}: fanin {fanin_t[-1]:.3f} s"
                      + (f", keyed {keyed_t[-1]:.3f} s" if keyed_t else "")
                      + (f", {args.lanes_arm} lanes {lanes_t[-1]:.3f} s" if lanes_t else "")
                      + (f", gloo {gloo_t[-1]:.3f} s" if gloo_t else ""), file=sys.stderr)
            frags1 = _frag_counts(tb, nodes)
            sw1 = counters()
            row = _row(rate, n, size, cap, fanin_t, gloo_t, fanin_answers, frags0, frags1, sw0, sw1, scatter)
            for system, counted in link_bytes.items():
                if counted.allreduces:
                    row.update(counted.per_element(elements, system))
                    row.update(_cpu_per_allreduce(steps[system], system))
            if keyed_t:
                row.update(_keyed(rate, row, keyed_t, keyed_answers))
            if lanes_t:
                row.update(_lanes_arm(rate, row, lanes_t, lanes_answers))
            # faster than the measured capacity: the capacity was under-read
            flag_fractions(row, f"network {rate:g} Mbit/s")
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "network.csv", rows)
    _plot(rows, out / "network.png", n, size, args.dtype, args.collective)
    result = {"topology": topo.name, "workers": n, "size_bytes": size, "dtype": args.dtype, "collective": args.collective, "mtu": mtu,
              "gro": bool(args.gro), "results": "group" if group_results else "unicast",
              "elements": elements, "reps": reps,
              "queue_ms": args.queue_ms,
              "rates": rows,
              # a rate whose fractions exceed the measured capacity, or whose
              # capacity fell below CAPACITY_LOW of tbf (each row says which)
              "measurement_suspect": any(r["measurement_suspect"] for r in rows),
              "fanin_settings": {"elems_per_packet": rows[0]["elems_per_packet"] if rows else None,
                                 "window": args.window, "shards": args.shards, "keyed_arm": bool(args.auth),
                                 "lanes": args.lanes, "lanes_arm": args.lanes_arm,
                                 "overrides": bool(
                                     args.elems_per_packet or args.window or args.shards or args.block_grad_max or args.block_cnt_max
                                     or args.lanes > 1)},
              "csv": str(out / "network.csv"), "png": str(out / "network.png"),
              # the whole run, testbed set-up and capacity blasts included:
              # what a device lease must allow for it
              "wall_s": round(time.perf_counter() - started, 1)}
    human = "; ".join(
        f"{r['rate_mbit']:g} Mbit/s (measured {r['capacity_mbit']:.0f}, both ways at once "
        f"{r['capacity_duplex_mbit']:.0f}): fanin {r['fanin_median_s']:.3f} s = "
        f"{r['fanin_fraction_of_capacity']:.2f} of capacity ({r['fanin_fraction_of_duplex_capacity']:.2f} of duplex)"
        + (f", Gloo {r['gloo_median_s']:.3f} s, fanin {r['speedup_vs_gloo']:.2f}x Gloo (ideal {r['ideal_speedup']:.2f}x)"
           if r.get("gloo_median_s") else "")
        + f", {r['retransmissions']} retransmissions ({r['fast_retransmits']} losses found fast, {r['timeouts']} "
          f"timeouts), {r['ip_fragments']} IP fragments, fanin's busiest link {r['fanin_link_bytes_per_element_max']:.2f} "
          f"bytes per element each way"
        + (f", keyed {r['keyed_median_s']:.3f} s = {r['keyed_goodput_ratio']:.2f} of unkeyed goodput"
           if "keyed_median_s" in r else "")
        + (f", {r['lanes_arm']} lanes {r['lanes_median_s']:.3f} s = {r['lanes_fraction_of_capacity']:.2f} of capacity, "
           f"{r['lanes_speedup']:.2f}x the {args.lanes}-lane arm" if "lanes_median_s" in r else "")
        + (f" [MEASUREMENT PROBLEM: {'; '.join(r['measurement_problems'])}]" if r["measurement_problems"] else "")
        for r in rows)
    emit(result, f"network, {topo.name}, {args.collective}, {n} workers x {format_size(size)}: {human}", args.json)
    return 0


def _topology(args: Any) -> Optional[Any]:
    """star:N (--workers) by default; --topology leaf-spine:S,L,H for a
    two-level fabric, every host a worker."""
    if not args.topology:
        return topology.star(args.workers)
    try:
        topo = topology.load(args.topology)
    except (ValueError, OSError) as e:
        print(f"fanin bench network: --topology {args.topology!r}: {e}", file=sys.stderr)
        return None
    if not topo.name.startswith(("star", "leaf-spine")) or len(topo.hosts) < 2:
        print(f"fanin bench network: --topology must be star:N or leaf-spine:S,L,H with at least 2 hosts "
              f"(got {topo.name}, {len(topo.hosts)} hosts)", file=sys.stderr)
        return None
    return topo


def _row(rate: float, n: int, size: int, cap: dict[str, Any], fanin_t: list[float], gloo_t: list[float],
         answers: list[dict[str, Any]], frags0: dict[str, int], frags1: dict[str, int],
         sw0: dict[str, Any], sw1: dict[str, Any], scatter: bool = False) -> dict[str, Any]:
    payload_bps = cap["capacity_mbit"] * 1e6 * payload_per_frame(cap["mtu"]) / 8
    fanin_ideal = size / payload_bps
    # a ring reduce-scatter is the first half of its allreduce
    ring_ideal = (1 if scatter else 2) * (n - 1) / n * size / payload_bps
    row: dict[str, Any] = {
        "rate_mbit": rate,
        "mtu": cap["mtu"],
        "capacity_mbit": cap["capacity_mbit"],
        "capacity_min_mbit": cap["capacity_min_mbit"],
        # the measured capacity over tbf's rate; capacity_low below CAPACITY_LOW
        "capacity_vs_tbf": cap.get("capacity_vs_tbf"),
        "capacity_low": cap.get("capacity_low", False),
        "blast_start_spread_s": cap.get("blast_start_spread_s"),
        "blast_window_s": cap.get("blast_window_s"),
        "fanin_median_s": statistics.median(fanin_t),
        "fanin_ideal_s": fanin_ideal,
        "ring_ideal_s": ring_ideal,
        "ideal_speedup": ring_ideal / fanin_ideal,
        "fanin_fraction_of_capacity": fanin_ideal / statistics.median(fanin_t),
        # the same against what the testbed carries both ways at once
        "capacity_duplex_mbit": cap["capacity_duplex_mbit"],
        "capacity_duplex_min_mbit": cap["capacity_duplex_min_mbit"],
        "fanin_fraction_of_duplex_capacity":
            fanin_ideal * cap["capacity_mbit"] / cap["capacity_duplex_mbit"] / statistics.median(fanin_t),
        "fanin_verified": all(a["verified"] for a in answers),
        # sockets and threads each worker sent from, as its session reports
        "fanin_lanes": max(a.get("lanes", 1) for a in answers),
        "retransmissions": sum(a.get("retransmissions") or 0 for a in answers),
        "trimmed": sum(a.get("trimmed") or 0 for a in answers),
        "fast_retransmits": sum(a.get("fast_retransmits") or 0 for a in answers),
        "timeouts": sum(a.get("timeouts") or 0 for a in answers),
        "window_final": [a.get("window") for a in answers[-n:]],
        "elems_per_packet": answers[0].get("elems_per_packet") if answers else None,
        "ip_fragments": sum(frags1[k] - frags0[k] for k in frags1),
        "switch_socket_drops": _delta(sw0, sw1, "socket_drops"),
        "results_without_data": _delta(sw0, sw1, "results_without_data"),
        # --results group: the datagrams each worker had read from the group
        # so far (the least of them, at the last repetition); 0 with unicast
        "fanin_datagrams_from_group_min": min(a.get("datagrams_from_group", 0) for a in answers[-n:]),
        "fanin_times_s": fanin_t,
    }
    if gloo_t:
        row.update({"gloo_median_s": statistics.median(gloo_t),
                    "gloo_fraction_of_ideal": ring_ideal / statistics.median(gloo_t),
                    "gloo_fraction_of_duplex_ideal":
                        ring_ideal * cap["capacity_mbit"] / cap["capacity_duplex_mbit"] / statistics.median(gloo_t),
                    "speedup_vs_gloo": statistics.median(gloo_t) / statistics.median(fanin_t),
                    "gloo_times_s": gloo_t})
    if not row["fanin_verified"]:
        raise RuntimeError(f"fanin at {rate:g} Mbit/s: a worker's sum is outside its bound")
    return row


def _keyed(rate: float, row: dict[str, Any], keyed_t: list[float], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The keyed arm next to the unkeyed one of the same run."""
    if not all(a["verified"] for a in answers):
        raise RuntimeError(f"fanin keyed at {rate:g} Mbit/s: a worker's sum is outside its bound")
    median = statistics.median(keyed_t)
    return {"keyed_median_s": median, "keyed_fraction_of_capacity": row["fanin_ideal_s"] / median,
            "keyed_goodput_ratio": row["fanin_median_s"] / median,
            "keyed_retransmissions": sum(a.get("retransmissions") or 0 for a in answers),
            "keyed_times_s": keyed_t}


def _lanes_arm(rate: float, row: dict[str, Any], lanes_t: list[float], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The --lanes-arm arm (the same allreduce, each worker sending from
    more lanes) next to the main fanin arm of the same run."""
    if not all(a["verified"] for a in answers):
        raise RuntimeError(f"fanin with lanes at {rate:g} Mbit/s: a worker's sum is outside its bound")
    median = statistics.median(lanes_t)
    return {"lanes_arm": max(a.get("lanes", 1) for a in answers),
            "lanes_median_s": median, "lanes_fraction_of_capacity": row["fanin_ideal_s"] / median,
            "lanes_speedup": row["fanin_median_s"] / median,
            "lanes_retransmissions": sum(a.get("retransmissions") or 0 for a in answers),
            "lanes_times_s": lanes_t}


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> Optional[int]:
    return b[key] - a[key] if key in a and key in b else None


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    # per-run times and per-link lists stay in the JSON
    cols = [k for k, v in rows[0].items() if not k.endswith("_times_s") and not isinstance(v, (list, dict))] if rows else []
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _plot(rows: list[dict[str, Any]], path: Path, n: int, size: int, dtype: str,
          collective: str = "allreduce") -> None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fanin bench network: matplotlib is not installed, no PNG", file=sys.stderr)
        return
    x = [r["rate_mbit"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [r["fanin_median_s"] for r in rows], "o-", color="tab:blue", label="fanin (median)")
    ax.plot(x, [r["fanin_ideal_s"] for r in rows], "--", color="tab:blue", label="fanin ideal S/C")
    if all("gloo_median_s" in r for r in rows):
        ax.plot(x, [r["gloo_median_s"] for r in rows], "s-", color="tab:orange", label="Gloo ring (median)")
    ring = "(N-1)/N S/C" if collective == "reduce-scatter" else "2(N-1)/N S/C"
    ax.plot(x, [r["ring_ideal_s"] for r in rows], "--", color="tab:orange", label=f"ring ideal {ring}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("link rate (Mbit/s, tbf on every link)")
    ax.set_ylabel(f"{collective} time (s)")
    ax.set_title(f"star:{n}, {collective}, {format_size(size)} {dtype} per worker; C = measured capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)

