"""`fanin bench kv-network`: key-value word count over rate-limited links.

A star testbed (root): the receiver's daemon on h0, one sender daemon per
sender host, the switch on s0, every link limited by tbf. Per link rate:
the capacity the links offer (the network bench's blast), then the same
word count of real text (every count checked against ``Counter``) from
senders whose window and timeout adapt to the path (the default,
docs/kv.md "Congestion") and, alternated with it, from senders with ASK's
fixed window and timeout (``congestion = false`` on their daemons: the
baseline, in the same run): after an untimed warm-up task per arm, the
arm that goes first alternates from one repetition to the next (counted
over every rate). A wrong count fails the run at once, before any figure.
Reported per arm: median time, retransmissions and timeouts per packet,
and the fraction of the link capacity the task needed (every packet once,
as frames) over the time it took: the senders' links are the bottleneck,
each carrying its channel's packets. A fraction above 1.02 means the
capacity was under-read: the row says so (``measurement_problems``)."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from fanin_bench.report import emit

ARMS = ("adaptive", "fixed")
#: Ethernet (14), IPv4 (20) and UDP (8) headers of each datagram on a veth.
FRAME_OVERHEAD = 42


def _task(rx_socket: str, tx_sockets: list[str], inputs: list[list[tuple[str, int]]]) -> dict[str, Any]:
    """One word count: a task of len(tx_sockets) channels; its result
    checked against Counter (raises if any count is wrong)."""
    from fanin.kv import Client

    sends: dict[int, Any] = {}
    errors: list[str] = []
    t0 = time.perf_counter()
    with Client(rx_socket, timeout=300) as rx:
        ticket = rx.create(senders=len(tx_sockets))

        def send(ch: int) -> None:
            try:
                with Client(tx_sockets[ch], timeout=300) as tx:
                    sends[ch] = tx.send(ticket, ch, inputs[ch])
            except Exception as e:  # reported with the result below
                errors.append(f"channel {ch}: {e}")

        threads = [threading.Thread(target=send, args=(ch,)) for ch in range(len(tx_sockets))]
        for t in threads:
            t.start()
        got = rx.wait(ticket)
        for t in threads:
            t.join(300)
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    expected = Counter(w for chunk in inputs for w, _ in chunk)
    got = dict(got)
    if got != dict(expected):
        # a wrong count fails the run here, before any figure of it is reported
        wrong = [w for w in set(got) | set(expected) if got.get(w) != expected.get(w)]
        raise RuntimeError(f"kv-network: the word count is wrong for {len(wrong)} of {len(expected)} words, e.g. "
                           + ", ".join(f"{w!r}: {got.get(w)} (expected {expected.get(w)})" for w in sorted(wrong)[:3]))
    return {"seconds": seconds, "exact": True, "sends": [sends[ch] for ch in sorted(sends)]}


def run_kv_network(args: Any) -> int:
    from fanin.kv import DaemonProcess
    from fanin.topology import star
    from fanin_bench.bench.corpus import build_corpus
    from fanin_bench.bench.network import _parse_rates, measure_capacity
    from fanin_bench.testbed import Testbed, unwind_on_sigterm, why_unavailable

    why = why_unavailable()
    if why:
        print(f"fanin bench kv-network: needs the namespace testbed: {why}", file=sys.stderr)
        return 2
    unwind_on_sigterm()
    started = time.perf_counter()
    rates = _parse_rates(args.rates or ("100" if args.quick else "100,400"))
    senders = args.senders
    if not 1 <= senders <= 8:
        print(f"fanin bench kv-network: --senders {senders} must be 1 to 8", file=sys.stderr)
        return 2
    words = args.words or (60_000 if args.quick else 300_000)
    reps = args.reps or (1 if args.quick else 3)
    out = Path(args.out)
    corpus = build_corpus(str(out / "corpus"), max(1 << 20, words * senders * 8))
    with open(corpus["path"], encoding="ascii") as f:
        tokens = f.read().split()
    if len(tokens) < words * senders:
        print(f"fanin bench kv-network: the corpus has {len(tokens)} words, fewer than {words} x {senders}",
              file=sys.stderr)
        return 2
    inputs = [[(w, 1) for w in tokens[i * words:(i + 1) * words]] for i in range(senders)]
    hosts = [f"h{i}" for i in range(senders + 1)]
    print(f"kv-network: star, receiver h0, {senders} senders of {words} words each, links "
          f"{', '.join(f'{r:g}' for r in rates)} Mbit/s, {reps} tasks per arm per rate", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tb = stack.enter_context(Testbed.up(star(senders + 1), name=args.name, rate_mbit=rates[0], routing=True))
        tb.switch("s0")
        control = f"{tb.mgmt_addr('s0')}:{tb.SWITCH_CONTROL_PORT}"

        def daemon(host: str, congestion: bool) -> Any:
            d = DaemonProcess(control, netns=tb.namespace(host), control_addr=f"{tb.mgmt_addr(host)}:0",
                              bind_ip=tb.addr(host, toward="s0"), switch_data_ip=tb.addr("s0", toward=host),
                              congestion=congestion)
            stack.callback(d.stop)
            return d

        rx = daemon("h0", True)
        tx = {arm: [daemon(h, arm == "adaptive") for h in hosts[1:]] for arm in ARMS}
        turn = 0  # counts repetitions over every rate: which arm goes first alternates
        for rate in rates:
            tb.set_rate(rate)
            cap = measure_capacity(tb, hosts, rate, 2.0 if args.quick else 3.0)
            # a warm-up task per arm at this rate, checked as well, in no figure
            warm = {arm: _task(rx.socket_path, [d.socket_path for d in tx[arm]], inputs)["seconds"]
                    for arm in _order(turn)}
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for _rep in range(reps):
                for arm in _order(turn):
                    before = [tb.link_bytes(h, "s0") for h in hosts[1:]]
                    r = _task(rx.socket_path, [d.socket_path for d in tx[arm]], inputs)
                    after = [tb.link_bytes(h, "s0") for h in hosts[1:]]
                    r["uplink_bytes"] = [b.a_to_b - a.a_to_b for a, b in zip(before, after)]
                    r["first"] = arm == _order(turn)[0]
                    runs[arm].append(r)
                turn += 1
            rows.append(_row(rate, cap, runs, warm))
            print(_summary_line(rows[-1]), file=sys.stderr)
    report = {"bench": "kv-network", "senders": senders, "words_per_sender": words, "reps": reps,
              "corpus": {k: corpus[k] for k in ("path", "bytes", "words") if k in corpus},
              "rates": rows, "wall_s": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    _write(out, rows)
    emit(report, "\n".join(_summary_line(r) for r in rows), args.json)
    return 0


def _order(turn: int) -> tuple[str, ...]:
    """The arms in the order they run at repetition `turn` (counted over
    every rate): the first one alternates."""
    return ARMS if turn % 2 == 0 else ARMS[::-1]


def _row(rate: float, cap: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
         warm: Optional[dict[str, float]] = None) -> dict[str, Any]:
    from fanin_bench.bench.network import flag_fractions

    row: dict[str, Any] = {"rate_mbit": rate, "capacity_mbit": round(cap["capacity_mbit"], 1),
                           "capacity_vs_tbf": cap.get("capacity_vs_tbf"),
                           "capacity_low": cap.get("capacity_low", False)}
    for arm, rs in runs.items():
        packets = sum(s["packets"] for r in rs for s in r["sends"])
        resent = sum(s["retransmissions"] for r in rs for s in r["sends"])
        seconds = statistics.median(r["seconds"] for r in rs)
        # the frames the busiest sender link had to carry: each packet once,
        # with its UDP, IP and Ethernet headers (what the link counters and
        # the capacity blast count)
        fractions = []
        for r in rs:
            needed = max(s["first_bytes"] + s["packets"] * FRAME_OVERHEAD for s in r["sends"])
            fractions.append(needed * 8 / (cap["capacity_mbit"] * 1e6) / r["seconds"])
        row[arm] = {
            "seconds": round(seconds, 3),
            "exact": all(r["exact"] for r in rs),
            "fraction_of_capacity": round(statistics.median(fractions), 3),
            "retransmissions_per_packet": round(resent / max(1, packets), 4),
            "timeouts": sum(s.get("timeouts", 0) for r in rs for s in r["sends"]),
            "window_cuts": sum(s.get("window_cuts", 0) for r in rs for s in r["sends"]),
            "final_cwnd": [s.get("cwnd") for s in rs[-1]["sends"]],
            "final_rto_us": [s.get("rto_us") for s in rs[-1]["sends"]],
            "packets": packets,
            "uplink_mbytes": round(sum(sum(r["uplink_bytes"]) for r in rs) / 1e6, 2),
            # repetitions in which this arm ran first
            "went_first": sum(bool(r.get("first")) for r in rs),
            # the untimed warm-up task's time (in no figure above)
            "warm_up_seconds": round(warm[arm], 3) if warm and arm in warm else None,
        }
    row["speedup_vs_fixed"] = round(row["fixed"]["seconds"] / row["adaptive"]["seconds"], 2)
    # faster than the measured capacity: the capacity was under-read
    flag_fractions(row, f"kv-network {rate:g} Mbit/s")
    return row


def _summary_line(row: dict[str, Any]) -> str:
    a, f = row["adaptive"], row["fixed"]
    return (f"{row['rate_mbit']:g} Mbit/s (measured {row['capacity_mbit']:g}): adaptive {a['seconds']:.3f} s = "
            f"{a['fraction_of_capacity']:.2f} of capacity, {a['retransmissions_per_packet']:.3f} resends/packet; "
            f"ASK's fixed window {f['seconds']:.3f} s = {f['fraction_of_capacity']:.2f}, "
            f"{f['retransmissions_per_packet']:.3f} resends/packet; {row['speedup_vs_fixed']:.2f}x; "
            f"exact {a['exact'] and f['exact']}"
            + (f" [MEASUREMENT PROBLEM: {'; '.join(row['measurement_problems'])}]"
               if row.get("measurement_problems") else ""))


def _write(out: Path, rows: list[dict[str, Any]]) -> None:
    import csv

    with open(out / "kv-network.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rate_mbit", "capacity_mbit", "arm", "seconds", "fraction_of_capacity",
                    "retransmissions_per_packet", "exact"])
        for r in rows:
            for arm in ARMS:
                a = r[arm]
                w.writerow([r["rate_mbit"], r["capacity_mbit"], arm, a["seconds"], a["fraction_of_capacity"],
                            a["retransmissions_per_packet"], a["exact"]])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    for i, arm in enumerate(ARMS):
        ax.bar([x + (i - 0.5) * 0.38 for x in xs], [r[arm]["fraction_of_capacity"] for r in rows], width=0.36,
               label={"adaptive": "adaptive window and timeout (default)", "fixed": "ASK's fixed window"}[arm])
    ax.set_xticks(list(xs), [f"{r['rate_mbit']:g}" for r in rows])
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("fraction of link capacity")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("key-value word count over rate-limited links")
    fig.tight_layout()
    fig.savefig(out / "kv-network.png", dpi=120)
    plt.close(fig)
