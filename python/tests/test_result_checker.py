"""The benchmarks' result check (fanin.proc.ResultChecker): a result is
compared with the float64 reference within the documented block floating
point bound, and a repeat of a result that passed is recognised by its
bytes, never let through for being close."""

import numpy as np

from fanin.proc import ResultChecker


def _a_passing_result(checker: ResultChecker) -> np.ndarray:
    # the exact sum rounded once to float32: inside the bound
    return checker.ref.astype(np.float32)


def test_a_repeated_result_is_checked_in_full_once():
    checker = ResultChecker(4, 10_000, "float32", 358)
    out = _a_passing_result(checker)
    first = checker.check(out)
    assert first["ok"]
    for _ in range(3):
        assert checker.check(out.copy()) == first
    assert checker.full_checks == 1


def test_one_changed_bit_gets_the_full_check_and_fails_if_outside_the_bound():
    checker = ResultChecker(4, 10_000, "float32", 358)
    out = _a_passing_result(checker)
    assert checker.check(out)["ok"]
    wrong = out.copy()
    i = int(np.argmax(np.abs(out)))
    wrong[i] = np.float32(out[i] * 1.001)  # far outside 4 * 2^(e - 29)
    report = checker.check(wrong)
    assert not report["ok"] and report["max_abs_error"] > report["max_bound"]
    assert checker.full_checks == 2
    # within the bound but not the same bits: checked in full, and passes
    close = out.copy()
    close[i] = np.nextafter(out[i], np.float32(np.inf))
    assert checker.check(close)["ok"]
    assert checker.full_checks == 3


def test_a_result_that_failed_is_never_remembered():
    checker = ResultChecker(2, 1_000, "float32", 358)
    wrong = _a_passing_result(checker) + np.float32(1.0)
    assert not checker.check(wrong)["ok"]
    assert not checker.check(wrong)["ok"]
    assert checker.full_checks == 2


def test_another_part_of_a_reduce_scatter_is_checked_in_full():
    checker = ResultChecker(4, 8_000, "float32", 358)
    out = _a_passing_result(checker)
    assert checker.check(out, keep=(0, 2_000))["ok"]
    broken = out.copy()
    broken[2_000:4_000] = 0.0  # outside the part checked first
    assert not checker.check(broken, keep=(2_000, 4_000))["ok"]
    assert checker.check(out, keep=(0, 2_000))["ok"]
    assert checker.full_checks == 2


def test_int32_results_are_compared_exactly():
    checker = ResultChecker(3, 5_000, "int32", 1024)
    out = checker.ref.copy()
    assert checker.check(out)["ok"] and checker.check(out)["ok"]
    out[17] += 1
    assert not checker.check(out)["ok"]
    assert checker.full_checks == 2


def test_noaggr_results_are_checked_against_the_workers_own_input():
    from fanin.proc import worker_inputs
    from fanin_bench.bench.runner import _check_own

    checker = ResultChecker(4, 10_000, "float32", 358)
    x = worker_inputs(1, 10_000, "float32")
    assert _check_own(x.copy(), x, checker, "float32")["ok"]
    assert not _check_own(worker_inputs(2, 10_000, "float32"), x, checker, "float32")["ok"]
    assert not _check_own(np.zeros_like(x), x, checker, "float32")["ok"]
    xi = worker_inputs(1, 1000, "int32")
    assert _check_own(xi.copy(), xi, ResultChecker(4, 1000, "int32", 358), "int32")["ok"]
    wrong = xi.copy()
    wrong[7] += 1
    assert not _check_own(wrong, xi, ResultChecker(4, 1000, "int32", 358), "int32")["ok"]
