"""The chaos soak (`fanin bench chaos`): its result checker, and a short
soak on the real namespace testbed (root; skipped with the reason when
network namespaces are not available)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fanin_bench.bench.chaos_inject import garbage
from fanin_bench.bench.chaos_worker import chaos_input, verify

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sum(ranks, elements=64, step=5, dtype="int32"):
    return sum(chaos_input(r, elements, step, dtype).astype(np.int64) for r in ranks).astype(dtype)


def test_verify_accepts_full_and_reported_partial_sums():
    full = _sum(range(3))
    assert verify(full, step=5, workers=3, epp=16, degraded_blocks=[]) is None
    assert verify(full.astype(np.float32), step=5, workers=3, epp=16, degraded_blocks=[]) is None
    part = full.copy()
    part[16:32] = _sum([0, 2])[16:32]
    assert verify(part, step=5, workers=3, epp=16, degraded_blocks=[(9, 2)]) is None


@pytest.mark.parametrize("corrupt, why", [
    (lambda x: x.__setitem__(0, x[0] + 1), "whole multiple"),                            # a flipped value
    (lambda x: x.__setitem__(slice(0, 16), x[:16] + _sum([0])[:16]), "outside the job"),  # rank 0 counted twice
    (lambda x: x.__setitem__(slice(0, 8), _sum([1])[:8]), "mixes"),                        # half a block from elsewhere
    (lambda x: x.__setitem__(slice(16, 32), _sum([0, 1])[16:32]), "degraded"),             # partial but not reported
])
def test_verify_rejects_wrong_sums(corrupt, why):
    x = _sum(range(3))
    corrupt(x)
    problem = verify(x, step=5, workers=3, epp=16, degraded_blocks=[])
    assert problem is not None and why in problem


def test_verify_rejects_another_steps_data():
    assert verify(_sum(range(3), step=4), step=5, workers=3, epp=16, degraded_blocks=[]) is not None


def test_garbage_kinds_are_what_they_claim():
    import random

    rng = random.Random(3)
    seen = {}
    for _ in range(200):
        counter, data = garbage(rng)
        seen.setdefault(counter, data)
    assert set(seen) == {"malformed.truncated", "malformed.bad_magic", "malformed.bad_version",
                         "malformed.unknown_msg_type", "unknown_job"}
    assert len(seen["malformed.truncated"]) < 4
    assert seen["malformed.bad_magic"][:2] != b"\xfa\x17"
    assert seen["malformed.bad_version"][:2] == b"\xfa\x17" and seen["malformed.bad_version"][2] != 1


def test_quick_chaos_soak_on_the_testbed(tmp_path):
    from fanin_bench.testbed import why_unavailable

    reason = why_unavailable("fbchprobe")
    if reason:
        pytest.skip(f"namespace testbed unavailable: {reason}")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    r = subprocess.run([sys.executable, "-m", "fanin", "bench", "chaos", "--quick", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.stdout, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["value"]["wrong"] == 0 and report["value"]["verified"] > 0, report["wrong_examples"]
    assert report["hangs"] == [], report["hangs"]
    assert report["kv"]["wrong"] == 0 and report["kv"]["hung"] == 0 and report["kv"]["verified"] > 0
    for counter, a in report["accounting"].items():
        assert a["counted"] == a["injected"], (counter, a)
    assert sum(report["faults"].values()) >= 5
    # every killed worker's replacement finished an allreduce before the next fault
    assert all(e["rejoin_s"] is not None for e in report["events"] if e["fault"] == "kill_worker"), report["events"]
    # every restarted rank or job ran a new round with all of its workers, and
    # no call raised outside a restart of its own job
    restarts = [e for e in report["events"] if e["fault"] in ("restart_rank", "restart_job")]
    assert all(e["recovered_s"] is not None for e in restarts), restarts
    assert report["value"]["raised_outside_restarts"] == 0, report["error_examples"]
    # ranks 0 and 2 send from two lanes, rank 1 from one: both kinds of
    # session met the faults (a session given fewer lanes is an error above)
    assert set(report["sessions_by_lanes"]) == {"1", "2"}, report["sessions_by_lanes"]
    assert report["ok"], {k: report[k] for k in ("value", "error_examples", "kv", "hangs", "accounting")}
    assert r.returncode == 0


@pytest.mark.parametrize("skip, says", [
    (["bogus"], "fanin bench chaos: --skip bogus: no such fault; the faults are garbage, forge, replay, "
                "kill_worker, restart_rank, restart_job, restart_switch, kv_forge, kv_replay, kill_kv_sender"),
    (["garbage", "forj"], "fanin bench chaos: --skip forj: no such fault; the faults are garbage, forge, "),
    (["garbage", "forge", "replay", "kill_worker", "restart_rank", "restart_job", "restart_switch", "kv_forge",
      "kv_replay", "kill_kv_sender"], "fanin bench chaos: --skip leaves no fault to inject; skip fewer"),
])
def test_chaos_refuses_unknown_or_all_skipped_faults_before_anything_starts(skip, says, capsys):
    """`--skip bogus` was silently accepted (a typo ran the fault it meant to leave out); it is refused
    with the list of fault names, before the testbed is checked or built."""
    from fanin_bench.cli import main

    assert main(["bench", "chaos", "--quick", "--skip", *skip]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says), err


def test_chaos_refuses_kv_faults_skipped_with_no_kv_only_when_they_leave_nothing(capsys):
    from fanin_bench.cli import main

    assert main(["bench", "chaos", "--quick", "--no-kv", "--skip", "garbage", "forge", "replay", "kill_worker",
                 "restart_rank", "restart_job", "restart_switch"]) == 2
    assert "--skip leaves no fault to inject" in capsys.readouterr().err
