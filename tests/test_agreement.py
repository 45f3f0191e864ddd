"""probe.metrics.agreement: rank agreement (Kendall tau-b, Spearman, top-k overlap) against scipy."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy import stats

from probe.metrics.agreement import agreement, kendall_tau_b, spearman, top_k_overlap

T_VALUES = [2, 3, 7, 30, 60]


def _scores(rng: np.random.Generator, shape, ties: bool) -> np.ndarray:
    """Continuous scores, or small integers (many ties, some constant rows) when ties=True."""
    if ties:
        return rng.integers(0, 4, size=shape).astype(np.float64)
    return rng.normal(size=shape)


def _reference(fn, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scipy's (statistic, pvalue) row by row."""
    stat, p = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on constant input / tiny samples
        for m in range(x.shape[0]):
            res = fn(x[m], y if y.ndim == 1 else y[m])
            stat.append(float(res.statistic))
            p.append(float(res.pvalue))
    return np.array(stat), np.array(p)


def _assert_close(got: np.ndarray, want: np.ndarray, atol: float) -> None:
    """Correlations (in [-1, 1]) and p-values (in [0, 1]) in fp64 against scipy: bounded, so absolute."""
    assert got.dtype == np.float64
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


# --------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize("x_ties,y_ties", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("y_2d", [False, True])
def test_kendall_and_spearman_match_scipy(T, x_ties, y_ties, y_2d):
    rng = np.random.default_rng([T, x_ties, y_ties, y_2d])
    M = 25
    x = _scores(rng, (M, T), x_ties)
    y = _scores(rng, (M, T) if y_2d else (T,), y_ties)
    if y_ties and not y_2d and np.all(y == y[0]):
        y[0] += 1  # keep the shared reference informative

    tau, tau_p = kendall_tau_b(x, y)
    want_tau, want_p = _reference(stats.kendalltau, x, y)
    _assert_close(tau, want_tau, 1e-10)
    _assert_close(tau_p, want_p, 1e-8)

    rho, rho_p = spearman(x, y)
    want_rho, want_rho_p = _reference(stats.spearmanr, x, y)
    _assert_close(rho, want_rho, 1e-10)
    _assert_close(rho_p, want_rho_p, 1e-8)

    if T > 2:  # the comparison is not vacuous
        assert np.isfinite(tau).sum() >= M // 2


@pytest.mark.parametrize("T", [5, 12, 33, 34, 60])
def test_kendall_exact_and_asymptotic_boundary(T):
    # without ties scipy's 'auto' is exact up to T = 33, and beyond that only when at most one
    # pair is discordant (or concordant); these rows cover c = 0, 1, 2 from both ends
    base = np.arange(T, dtype=np.float64)
    one_swap = base.copy()
    one_swap[[3, 4]] = one_swap[[4, 3]]
    two_swaps = one_swap.copy()
    two_swaps[[0, 1]] = two_swaps[[1, 0]]
    rng = np.random.default_rng(T)
    x = np.stack([base, one_swap, two_swaps, base[::-1], one_swap[::-1], two_swaps[::-1],
                  rng.permutation(T).astype(np.float64), rng.normal(size=T)])
    tau, p = kendall_tau_b(x, base)
    want_tau, want_p = _reference(stats.kendalltau, x, base)
    _assert_close(tau, want_tau, 1e-10)
    _assert_close(p, want_p, 1e-8)
    # tiny p-values: exact (e.g. 2 / (T - 1)! for one swap) and normal-approximation values
    # differ by orders of magnitude, which only a relative comparison sees
    np.testing.assert_allclose(p, want_p, rtol=1e-9, atol=0)
    if T >= 12:
        assert p[0] < 1e-6 and p[3] < 1e-6


def test_kendall_exact_p_by_enumeration():
    # the exact two-sided p-value is 2 P(C <= min(con, dis)) over all n! equally likely orders
    n = 6
    tot = n * (n - 1) // 2
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.float64)
    i, j = np.triu_indices(n, 1)
    inversions = (perms[:, j] < perms[:, i]).sum(axis=1)
    dist = np.bincount(inversions, minlength=tot + 1) / math.factorial(n)
    tau, p = kendall_tau_b(perms, np.arange(n, dtype=np.float64))
    con = tot - inversions
    c = np.minimum(con, inversions)
    want_p = np.minimum(1.0, 2 * np.cumsum(dist)[c])
    np.testing.assert_allclose(p, want_p, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tau, (con - inversions) / tot, rtol=0, atol=1e-12)


def test_constant_rows_give_nan():
    x = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    y = np.array([4.0, 3.0, 2.0, 1.0])
    for fn in (kendall_tau_b, spearman):
        stat, p = fn(x, y)
        assert np.isnan(stat[0]) and np.isnan(p[0])
        assert stat[1] == pytest.approx(-1.0)
        stat, p = fn(x, np.full(4, 0.5))  # constant reference: every row NaN
        assert np.isnan(stat).all() and np.isnan(p).all()
    res = agreement(x, y, k=2)
    assert res["top2"].tolist() == [1.0, 0.0]  # top-k is still defined: ties go to {0, 1}


def test_single_row_input():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, size=20).astype(np.float64)
    y = rng.normal(size=20)
    res = agreement(x, y)
    assert set(res) == {"kendall_tau", "kendall_p", "spearman", "spearman_p", "top1", "top3", "top5"}
    for v in res.values():
        assert v.shape == (1,) and v.dtype == np.float64
    want = stats.kendalltau(x, y)
    assert res["kendall_tau"][0] == pytest.approx(want.statistic, abs=1e-10)
    assert res["kendall_p"][0] == pytest.approx(want.pvalue, abs=1e-8)
    want = stats.spearmanr(x, y)
    assert res["spearman"][0] == pytest.approx(want.statistic, abs=1e-10)
    assert res["spearman_p"][0] == pytest.approx(want.pvalue, abs=1e-8)


def test_agreement_matches_the_single_functions():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 6, size=(12, 15)).astype(np.float64)
    y = rng.normal(size=(12, 15))
    res = agreement(x, y, k=(2, 4))
    assert set(res) == {"kendall_tau", "kendall_p", "spearman", "spearman_p", "top2", "top4"}
    for got, want in zip((res["kendall_tau"], res["kendall_p"]), kendall_tau_b(x, y)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip((res["spearman"], res["spearman_p"]), spearman(x, y)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(res["top4"], top_k_overlap(x, y, 4))


def test_top_k_overlap_hand_example_with_ties():
    x = np.array([0.1, 0.9, 0.9, 0.5, 0.0])  # by importance: 1, 2 (tie: lower first), 3, 0, 4
    y = np.array([0.9, 0.2, 0.9, 0.1, 0.9])  # by importance: 0, 2, 4 (tie), 1, 3
    assert top_k_overlap(x, y, 1).tolist() == [0.0]  # {1} vs {0}
    assert top_k_overlap(x, y, 2).tolist() == [0.5]  # {1, 2} vs {0, 2}
    assert top_k_overlap(x, y, 3).tolist() == pytest.approx([1 / 3])  # {1, 2, 3} vs {0, 2, 4}
    assert top_k_overlap(x, y, 4).tolist() == [0.75]  # {0, 1, 2, 3} vs {0, 1, 2, 4}
    assert top_k_overlap(x, y, 5).tolist() == [1.0]
    assert top_k_overlap(x, y, 50).tolist() == [1.0]  # k clipped to T
    # row-wise reference, and a negated row (lowest scores become the top)
    rows = np.stack([x, -x])
    z = np.array([0.0, 0.0, 0.0, 0.0, 1.0])  # top-2: {4, 0} (ties among 0..3: lowest first)
    assert top_k_overlap(rows, np.stack([y, z]), 2).tolist() == [0.5, 1.0]  # -x top-2: {4, 0}
    assert top_k_overlap(rows, np.stack([y, z]), 1).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="k"):
        top_k_overlap(x, y, 0)


def test_invalid_inputs_raise():
    x = np.array([[0.1, np.nan, 0.3]])
    with pytest.raises(ValueError, match="x has 1 NaN.*position 1 of row 0"):
        kendall_tau_b(x, np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="y has 1 NaN"):
        agreement(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, np.nan]))
    with pytest.raises(ValueError, match="token counts"):
        spearman(np.zeros((2, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        spearman(np.zeros((2, 3)), np.zeros((3, 3)))
