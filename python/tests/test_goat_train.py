"""`fanin bench goat-train` (issue 31 part 2): the parameters cut into the
plan's sub-models, time to target, and a short training run of the digits MLP
scheduled by a GOAT plan on the namespace testbed (root only; skipped with
the reason otherwise)."""

import os

import pytest

from fanin_bench.bench.goat_train import split_elements, time_to
from fanin_bench.bench.goat_worker import digits_param_count


def test_the_parameters_are_cut_in_the_planned_proportions():
    plan = {"submodels": [{"size_mb": 1.0}, {"size_mb": 2.0}, {"size_mb": 1.0}]}
    assert split_elements(plan, 10) == [2, 5, 3]  # rounding lands on the last
    assert sum(split_elements(plan, digits_param_count())) == digits_param_count() == 50826
    with pytest.raises(ValueError, match="cannot fill 3 sub-models"):
        split_elements(plan, 2)


def test_switch_memory_is_parsed_or_refused_with_the_form_to_use():
    from fanin_bench.bench.goat_train import parse_memory

    assert parse_memory("agg=12, tor0=4") == {"agg": 12.0, "tor0": 4.0}
    for bad in ("agg", "agg=x", "=3"):
        with pytest.raises(SystemExit, match="expected NAME=MB"):
            parse_memory(bad)


def test_time_to_target_is_the_first_point_at_or_below_it():
    curve = [{"time_s": 1.0, "held_out_loss": 2.0}, {"time_s": 2.5, "held_out_loss": 0.3},
             {"time_s": 3.0, "held_out_loss": 0.1}]
    assert time_to(curve, 0.3) == 2.5
    assert time_to(curve, 0.05) is None


class _Deployment:
    def __init__(self):
        self.installs = []

    def install_quorums(self, participating):
        self.installs.append(sorted(participating))


def test_the_async_controller_leaves_out_a_persistent_straggler_once_and_ignores_noise():
    from fanin_bench.bench.goat_train import AsyncController

    dep = _Deployment()
    ctl = AsyncController(dep, list(range(8)))
    noisy = {r: 0.005 + 0.0004 * ((r * 5) % 8) for r in range(8)}  # 5.0-7.8 ms: noise, nobody slow
    assert ctl.after(noisy) == 0.0 and dep.installs == [] and ctl.k_history == [8]
    slow = {**noisy, 7: 0.2}
    ctl.after(slow)
    assert dep.installs == [[0, 1, 2, 3, 4, 5, 6]] and ctl.participants == set(range(7))
    for _ in range(3):  # the same again, or the fast ones reshuffled by noise: nothing to reinstall
        ctl.after({**slow, 0: 0.0079, 6: 0.005})
    assert len(dep.installs) == 1 and ctl.k_history == [8, 7, 7, 7, 7]
    for _ in range(30):  # rank 7 caught up: once its mean does, everyone again (ψ(8) < ψ(7) by 10 %)
        ctl.after({r: 0.005 for r in range(8)})
    assert dep.installs[-1] == list(range(8)) and ctl.k_history[-1] == 8
    # margin 0 and no smoothing follow Algorithm 2 every epoch, noise included
    eager = AsyncController(_Deployment(), list(range(8)), margin=0, smoothing=1)
    eager.after(noisy)
    assert eager.k_history[-1] < 8 and eager.dep.installs


def test_a_goat_plan_trains_the_digits_mlp_on_the_testbed():
    """Every replica the same after every step, the same loss on GOAT's plan
    as on the PS alone (the same mean gradient, summed exactly in
    integers either way), and the PS receiving what the plan says; with
    rank 7 straggling 300 ms a step, GOAT-Async's controller leaves it out
    after the first step (Algorithm 2's K < 8 installed on the switches),
    its steps no longer wait for it, and its replicas still agree."""
    from fanin_bench.testbed import why_unavailable

    why = why_unavailable("fbtt-probe")
    if why:
        pytest.skip(f"no network namespaces: {why}")
    from test_goat_deploy import _testbed_plan
    from test_testbed import _tag

    from fanin_bench.bench.goat_train import plans_of, train_arms

    topo, plan = _testbed_plan()
    plans = plans_of(plan, topo, ["goat", "ps-only", "goat-async"])
    curves = train_arms(topo, plans, name=f"fbtt{_tag(os.getpid())}", steps=4, rate_mbit=100, epp=256,
                        window=64, seed=1, batch=16, lr=0.1, slow_ranks=[7], slow_ms=300)
    for arm, curve in curves.items():
        assert [p["step"] for p in curve] == [1, 2, 3, 4]
        assert all(p["replicas_agree"] for p in curve), arm
        assert curve[-1]["held_out_loss"] < curve[0]["held_out_loss"], (arm, curve)
    for a, b in zip(curves["goat"], curves["ps-only"]):
        assert a["held_out_loss"] == pytest.approx(b["held_out_loss"], rel=1e-6)
    ingress = {arm: sorted(p["ps_ingress_bytes"] for p in c)[1] for arm, c in curves.items()}
    assert ingress["ps-only"] / ingress["goat"] == pytest.approx(plans["ps-only"]["ps_mb"] / plan["ps_mb"], rel=0.1)
    sync, late = curves["goat"], curves["goat-async"]
    assert all(p["k"] == 8 and p["cut"] == 0 and p["step_s"] > 0.2 for p in sync)  # every step waits for rank 7
    assert late[0]["k"] == 8  # nothing known yet: every member
    for p in late[1:]:
        assert p["k"] < 8 and p["cut"] >= 1, p  # rank 7 (at least) left out, told the epoch ended
    assert max(p["step_s"] for p in late[1:]) < min(p["step_s"] for p in sync[1:]), (late, sync)


def test_goat_async_through_on_path_relays_leaves_the_straggler_out():
    """Algorithm 2's K_t^s installed on the switches while every worker
    sends to its rack switch and the switches relay (on-path filtering):
    the replicas agree, the straggler is left out after the first step."""
    from fanin_bench.testbed import why_unavailable

    why = why_unavailable("fbtp-probe")
    if why:
        pytest.skip(f"no network namespaces: {why}")
    from test_goat_deploy import _testbed_plan
    from test_testbed import _tag

    from fanin_bench.bench.goat_train import plans_of, train_arms

    topo, plan = _testbed_plan()
    curves = train_arms(topo, plans_of(plan, topo, ["goat", "goat-async"]), name=f"fbtp{_tag(os.getpid())}",
                        steps=3, rate_mbit=100, epp=256, window=64, seed=1, batch=16, lr=0.1, slow_ranks=[7],
                        slow_ms=300, on_path=True)
    for arm, curve in curves.items():
        assert all(p["replicas_agree"] for p in curve), arm
    late = curves["goat-async"]
    assert all(p["k"] < 8 and p["cut"] >= 1 for p in late[1:]), late
    assert max(p["step_s"] for p in late[1:]) < min(p["step_s"] for p in curves["goat"][1:])
