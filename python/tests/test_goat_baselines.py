"""GOAT's baselines (Geryon, ATP, ESA, K-SGD) and Algorithm 2 on hand-checked
instances, in the same evaluator as GOAT."""

import numpy as np
import pytest

from fanin.goat.async_ import Convergence, algorithm2, compare_async, per_switch_k
from fanin.goat.baselines import _switch, evaluate_atp, evaluate_esa
from fanin.goat.evaluate import Scenario, evaluate_geryon, evaluate_plan
from fanin.goat.krgs import plan
from fanin.goat.model import GoatError, submodels_from_sizes
from fanin.topology import Host, Link, Switch, Topology


def _two_workers(rates, memory_mb=1.0):
    """w0, w1 -- s1 (programmable, memory_mb) -- s0 (not programmable) -- ps."""
    topo = Topology("hand", [Switch("s0", 0.0, False), Switch("s1", memory_mb, True)],
                    [Host("w0"), Host("w1"), Host("ps", "ps")],
                    [Link("w0", "s1"), Link("w1", "s1"), Link("s1", "s0"), Link("s0", "ps")]).validate()
    # a 2 MB gradient: with 1 MB fragments, two fragments, both in the switch's single unit
    return Scenario(topo, "ps", ["w0", "w1"], np.array(rates, float), submodels_from_sizes([1.0, 1.0]))


def test_geryon_hand_checked():
    m = evaluate_geryon(_two_workers([10, 10]))
    assert (m.ps_mb, m.ina_mb, m.comm_mb) == (4.0, 0.0, 12.0)     # 2 workers x 2 MB x 3 hops


def test_atp_synchronous_aggregates_everything_at_the_first_switch():
    m = evaluate_atp(_two_workers([10, 10]))
    # fragment i of both workers arrives together: one aggregate per fragment
    assert m.ps_mb == 2.0 and m.ina_mb == 2.0
    assert m.comm_mb == 4.0 + 2.0 + 2.0                              # host links, s1->s0, s0->ps


def test_atp_asynchronous_collision_forwards_a_fragment():
    # w0 at 10 Gbit/s: fragments done at 0.8, 1.6 ms; w1 at 2.5: 3.2, 6.4 ms.
    # 0.8 w0.f0 takes the unit; 1.6 w0.f1 finds it holding f0 -> forwarded;
    # 3.2 w1.f0 completes f0 -> aggregate; 6.4 w1.f1 alone -> sent. The PS gets 3 MB.
    m = evaluate_atp(_two_workers([10, 2.5]))
    assert m.ps_mb == 3.0 and m.ina_mb == 1.0
    assert m.comm_mb == 4.0 + 3.0 + 3.0


def test_more_memory_removes_the_collision():
    m = evaluate_atp(_two_workers([10, 2.5], memory_mb=2.0))
    assert m.ps_mb == 2.0


def test_switch_traces_atp_vs_esa():
    arrivals = [(1.0, 1, 1.0, 1), (2.0, 0, 1.0, 1), (3.0, 1, 1.0, 1), (4.0, 0, 1.0, 1)]
    # ATP: f1 holds the unit; f0 forwarded; f1 completes at 3; the second f0 alone at 4
    assert _switch(list(arrivals), 1, "atp") == [(2.0, 0, 1.0, 1), (3.0, 1, 1.0, 2), (4.0, 0, 1.0, 1)]
    # ESA: f0 (higher priority) evicts f1's partial aggregate at 2; the second f1 is forwarded; f0 completes at 4
    assert _switch(list(arrivals), 1, "esa") == [(2.0, 1, 1.0, 1), (3.0, 1, 1.0, 1), (4.0, 0, 1.0, 2)]


def test_esa_and_atp_conserve_contributions_on_a_fat_tree():
    from fanin import topology as T
    from fanin.goat.evaluate import draw_rates

    topo = T.with_ps(T.with_programmable(T.load("fat-tree:4"), 0.5, 2, 8.0), "h0_0_0")
    workers = [h.name for h in topo.hosts if h.role == "worker"]
    scn = Scenario(topo, "h0_0_0", workers, draw_rates(len(workers), 0.6, np.random.default_rng(1)),
                   submodels_from_sizes([2.0] * 10))
    for m in (evaluate_atp(scn), evaluate_esa(scn)):            # raises if a fragment's count is wrong at the PS
        assert 0 < m.ps_mb <= 20.0 * len(workers)
    goat = evaluate_plan(scn, plan(scn.instance(), seed=1))
    assert goat.ps_mb + goat.ina_mb == pytest.approx(20.0 * len(workers))


def test_goat_on_the_hand_instance_aggregates_at_s1():
    scn = _two_workers([10, 2.5], memory_mb=2.0)
    m = evaluate_plan(scn, plan(scn.instance(), seed=0))
    # both sub-models at s1 whatever the rates: PS gets 2 MB, comm 4 + 2*2
    assert m.ps_mb == 2.0 and m.comm_mb == pytest.approx(8.0)


# -- asynchronous training ------------------------------------------------------------------------


def test_algorithm2_hand_checked():
    # four workers, intervals 1, 1, 1, 10; psi flat (sigma2 = 0): T = 4 for every K, so the
    # K that minimises the mean epoch time wins: K = 3 (h = 1 each round), not 4 (h = 10).
    conv = Convergence(f_gap=1.0, epsilon=1.0, sigma2=0.0, n=1)
    k, total = algorithm2([1, 1, 1, 10], conv)
    assert k == 3 and total == pytest.approx(4.0)
    # a variance term that makes small K need many more epochs moves the optimum to K = 4
    conv = Convergence(f_gap=1.0, epsilon=1.0, sigma2=2.9, n=1)
    assert algorithm2([1, 1, 1, 10], conv)[0] == 4


def test_algorithm2_rejects_bad_history():
    with pytest.raises(GoatError, match="positive"):
        algorithm2([1.0, 0.0], Convergence())


def test_per_switch_k_counts_participating_gradients():
    node = np.array([[0, 1, 2], [0, 0, 2], [1, 1, 1]])      # 3 workers x 3 sub-models, alpha = 2
    assert per_switch_k(node, [0, 1], alpha=2) == {0: 3, 1: 1, 2: 2}


def test_ksgd_fixed_k_and_goat_async_reach_the_target():
    base = np.array([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 4.0, 5.0])
    conv = Convergence(f_gap=3.0, epsilon=1.0, sigma2=2.0, n=1)
    r = compare_async(base, conv, seed=1, ksgd=(2, 6))
    assert not r["ksgd_2"]["converged"]                     # psi(2) is infinite: 2 workers never suffice
    for arm in ("goat_async", "sync", "ksgd_6"):
        assert r[arm]["converged"]
    assert r["goat_async"]["time_s"] < r["sync"]["time_s"]  # the two stragglers are left out


def test_stragglers_keep_working_in_goat_async_but_restart_in_ksgd():
    from fanin.goat.async_ import run_epochs

    conv = Convergence(f_gap=1.0, epsilon=1.0, sigma2=0.0, n=1)        # psi(K) = 4 epochs for every K
    base = np.array([1.0, 2.0, 3.0])
    kw = dict(conv=conv, h_alpha=0.0, jitter=0.0)
    # K = 2 with intervals 1, 2, 3 and no jitter. Kept work: epochs end at 2, 1, 1, 2 (the slow worker's
    # leftover makes it one of the two fastest every other epoch) = 6 s; restarted (K-SGD): 2 s each = 8 s.
    keep = run_epochs(base, lambda h: 2, rng=np.random.default_rng(0), **kw)
    drop = run_epochs(base, lambda h: 2, rng=np.random.default_rng(0), discard_stragglers=True, **kw)
    assert keep["epochs"] == drop["epochs"] == 4
    assert keep["time_s"] == pytest.approx(6.0) and drop["time_s"] == pytest.approx(8.0)


def test_bench_ordering_reports_where_a_baseline_wins():
    from fanin_bench.bench.goat import _instance_wins, _ordering

    def row(scheme, ps, comm, ina=0.0):
        return {"topology": "t", "workers": 4, "scheme": scheme, "ps_mb": ps, "comm_mb": comm, "ina_mb": ina}

    rows = [row("goat", 1.0, 10.0, 7.0), row("esa", 2.0, 9.0, 6.0), row("atp", 2.0, 12.0, 6.0),
            row("geryon", 8.0, 20.0)]
    violations, reductions = _ordering(rows, ("topology", "workers"))
    assert [(v["baseline"], v["metric"]) for v in violations] == [("esa", "comm_mb")]
    assert reductions["ps_mb_vs_geryon"]["median"] == pytest.approx(1 - 1 / 8)
    points = [dict(r, study="workers", sigma=0.2, seed=1) for r in rows]
    wins = _instance_wins(points)
    assert wins["comm_mb_vs_esa"] == {"goat_at_least_as_good": 0, "instances": 1}
    assert wins["comm_mb_vs_atp"] == {"goat_at_least_as_good": 1, "instances": 1}
