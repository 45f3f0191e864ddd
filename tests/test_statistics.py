"""probe.metrics.statistics: the dataset statistics (bootstrap CIs, paired tests, summaries, Holm)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from probe.metrics.statistics import (
    bootstrap_ci,
    group_seed,
    holm,
    paired_bootstrap_ci,
    paired_test,
    summarize,
    summarize_groups,
)


def _loop_bootstrap(values, n_boot, level, seed):
    """Plain-Python percentile bootstrap with the same draws as bootstrap_ci."""
    v = sorted(float(a) for a in values if np.isfinite(a))
    n = len(v)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    means = sorted(sum(v[i] for i in row) / n for row in idx.tolist())

    def quantile(q):  # linear interpolation between order statistics (numpy's default)
        h = (n_boot - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, n_boot - 1)
        return means[lo] + (h - lo) * (means[hi] - means[lo])

    tail = (1 - level) / 2
    return quantile(tail), quantile(1 - tail)


def test_bootstrap_ci_basic_properties():
    rng = np.random.default_rng(3)
    small = rng.normal(0.3, 1.0, size=40)
    lo, hi = bootstrap_ci(small)
    assert lo < small.mean() < hi
    assert bootstrap_ci(small) == (lo, hi)  # deterministic
    assert bootstrap_ci(small, seed=1) != (lo, hi)
    assert bootstrap_ci(rng.permutation(small)) == (lo, hi)  # order does not matter
    with_nan = np.concatenate([small, [np.nan, np.nan]])
    assert bootstrap_ci(with_nan) == (lo, hi)  # NaNs dropped
    large = rng.normal(0.3, 1.0, size=4000)
    lo2, hi2 = bootstrap_ci(large)
    assert lo2 < large.mean() < hi2
    assert hi2 - lo2 < (hi - lo) / 4  # ~ 1/sqrt(100) as wide
    narrow = bootstrap_ci(small, level=0.5)
    assert lo < narrow[0] < narrow[1] < hi
    assert all(math.isnan(b) for b in bootstrap_ci([1.0, np.nan]))
    assert all(math.isnan(b) for b in bootstrap_ci([]))


@pytest.mark.parametrize("n,n_boot,level,seed", [(7, 101, 0.95, 0), (30, 500, 0.9, 5), (2, 50, 0.8, 11)])
def test_bootstrap_ci_equals_loop_implementation(n, n_boot, level, seed):
    values = np.random.default_rng(n).normal(size=n)
    got = bootstrap_ci(values, n_boot=n_boot, level=level, seed=seed)
    want = _loop_bootstrap(values, n_boot, level, seed)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_paired_bootstrap_and_paired_test_against_scipy():
    rng = np.random.default_rng(4)
    a = rng.normal(0.2, 1.0, size=60)
    b = a - rng.normal(0.3, 0.5, size=60)
    a[[3, 10]] = np.nan
    b[[10, 20]] = np.nan
    ok = np.isfinite(a) & np.isfinite(b)
    d = a[ok] - b[ok]
    assert paired_bootstrap_ci(a, b, n_boot=300) == bootstrap_ci(d, n_boot=300)

    res = paired_test(a, b, n_boot=300)
    assert set(res) == {"n", "mean_diff", "ci_low", "ci_high", "wilcoxon_p", "t_p"}
    assert res["n"] == 57
    assert res["mean_diff"] == pytest.approx(d.mean(), abs=1e-12)
    assert (res["ci_low"], res["ci_high"]) == bootstrap_ci(d, n_boot=300)
    assert res["wilcoxon_p"] == pytest.approx(stats.wilcoxon(a[ok], b[ok]).pvalue, rel=1e-12)
    assert res["t_p"] == pytest.approx(stats.ttest_rel(a[ok], b[ok]).pvalue, rel=1e-12)
    assert res["wilcoxon_p"] < 0.01 and res["t_p"] < 0.01


def test_paired_test_degenerate_cases():
    same = paired_test([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])
    assert same["n"] == 3 and same["mean_diff"] == 0.0 and same["wilcoxon_p"] == 1.0
    tiny = paired_test([0.1, np.nan], [0.3, 0.2])
    assert tiny["n"] == 1 and math.isnan(tiny["wilcoxon_p"]) and math.isnan(tiny["t_p"])
    assert math.isnan(tiny["ci_low"]) and tiny["mean_diff"] == pytest.approx(-0.2)


def test_summarize_hand_example():
    values = np.array([0.5, -0.2, 0.1, np.nan, 0.4, 0.3])
    p = np.array([0.01, 0.03, 0.2, 0.01, np.nan, 0.05])
    res = summarize(values, p, n_boot=200, seed=3)
    finite = values[np.isfinite(values)]
    assert res["n"] == 5
    assert res["mean"] == pytest.approx(finite.mean())
    assert res["std"] == pytest.approx(finite.std(ddof=1))
    assert (res["ci_low"], res["ci_high"]) == bootstrap_ci(values, n_boot=200, seed=3)
    # value and p both finite: positions 0, 1, 2, 5; p <= 0.05 at 0, 1, 5; of those value > 0: 0, 5
    assert res["sig_frac"] == pytest.approx(3 / 4)
    assert res["sig_pos_frac"] == pytest.approx(2 / 4)
    assert set(summarize(values)) == {"n", "mean", "std", "ci_low", "ci_high"}
    one = summarize([np.nan, 2.0])
    assert one["n"] == 1 and one["mean"] == 2.0 and math.isnan(one["std"]) and math.isnan(one["ci_low"])


def _frame(rng: np.random.Generator) -> pd.DataFrame:
    parts = []
    for method, layer in itertools.product(["attn", "grad", "ig"], range(4)):
        n = int(rng.integers(3, 30))
        v = rng.normal(size=n)
        v[rng.random(n) < 0.1] = np.nan
        parts.append(pd.DataFrame({"method": method, "layer": layer, "tau": v, "p": rng.random(n)}))
    return pd.concat(parts, ignore_index=True)


def test_summarize_groups_equals_summarize_per_group():
    df = _frame(np.random.default_rng(5))
    out = summarize_groups(df, ["method", "layer"], "tau", "p", n_boot=200, seed=7, alpha=0.1)
    assert list(out.columns) == ["method", "layer", "n", "mean", "std", "ci_low", "ci_high",
                                 "sig_frac", "sig_pos_frac"]
    assert len(out) == 12
    for row in out.itertuples(index=False):
        sub = df[(df["method"] == row.method) & (df["layer"] == row.layer)]
        want = summarize(sub["tau"], sub["p"], n_boot=200, alpha=0.1,
                         seed=group_seed((row.method, row.layer), 7))
        got = row._asdict()
        for key, value in want.items():
            np.testing.assert_equal(got[key], value)
    # seeds are derived from the key's values, not their numpy types
    assert group_seed(("ig", 2), 7) == group_seed((np.str_("ig"), np.int64(2)), 7)
    assert group_seed(("ig", 2), 7) != group_seed(("ig", 2), 8)


def test_summarize_groups_invariant_to_order_and_subsetting():
    rng = np.random.default_rng(6)
    df = _frame(rng)
    by = ["method", "layer"]
    full = summarize_groups(df, by, "tau", "p", n_boot=200)

    shuffled = df.sample(frac=1.0, random_state=1).reset_index(drop=True)
    pd.testing.assert_frame_equal(summarize_groups(shuffled, by, "tau", "p", n_boot=200), full)

    subset = df[df["method"].isin(["ig", "attn"]) & (df["layer"] != 2)]
    got = summarize_groups(subset, by, "tau", "p", n_boot=200)
    want = full[full["method"].isin(["ig", "attn"]) & (full["layer"] != 2)].reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want)

    single = summarize_groups(df, ["method"], "tau", n_boot=200)
    assert list(single["method"]) == ["attn", "grad", "ig"]
    assert "sig_frac" not in single.columns


def test_holm_hand_example():
    p = np.array([0.01, 0.04, 0.03, 0.005, np.nan])
    # sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> max(0.06, 0.04)
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02, np.nan], rtol=1e-12)
    np.testing.assert_allclose(holm([0.5, 0.2, 0.6]), [1.0, 0.6, 1.0], rtol=1e-12)
    assert holm([]).shape == (0,)
    with pytest.raises(ValueError):
        holm([0.5, 1.5])


def test_the_paired_p_values_are_scipy_s_bit_for_bit():
    """paired_test's Wilcoxon and t-test p-values come from scipy.special (importing scipy.stats cost
    each study half a second, issue 63): on 2,000 random difference vectors, with zeros and tied
    magnitudes or without, exact and normal, they are scipy.stats' wilcoxon and ttest_rel, to the bit."""
    import warnings

    from scipy import stats

    from probe.metrics.statistics import paired_t_p, wilcoxon_method, wilcoxon_p

    rng = np.random.default_rng(7)
    methods = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for trial in range(2000):
            n = int(rng.integers(2, 70))
            d = [rng.normal(size=n), np.round(rng.normal(size=n), 1), rng.integers(-3, 4, size=n).astype(float),
                 np.round(rng.normal(size=n) * 2) / 4][trial % 4]
            if not d.any():
                continue
            method = wilcoxon_method(d)
            methods.add(method)
            assert wilcoxon_p(d, method) == float(stats.wilcoxon(d, np.zeros(n), method=method).pvalue), d
            ours, theirs = paired_t_p(d), float(stats.ttest_rel(d, np.zeros(n)).pvalue)
            assert ours == theirs or (np.isnan(ours) and np.isnan(theirs)), d
        for d in ([1.0, 1.0, 1.0], [0.0, 0.0, 0.1], [-2.0, -2.0]):  # equal differences: t infinite
            assert paired_t_p(np.array(d)) == float(stats.ttest_rel(np.array(d), np.zeros(len(d))).pvalue)
    assert methods == {"exact", "approx"}


def test_the_paired_tests_and_the_power_need_no_scipy_stats():
    """A study's statistics run without importing scipy.stats (half a second of start-up): the paired
    tests and rule 2's n_needed use scipy.special alone."""
    import subprocess
    import sys

    code = ("import sys; from probe.metrics.statistics import paired_test; from probe.study.power import n_needed; "
            "paired_test([0.1, 0.4, 0.3, 0.9], [0.2, 0.1, 0.0, 0.1]); paired_test([1.0, 1.0, 2.0], [0.0, 1.0, 0.0]); "
            "n_needed([0.1, -0.2, 0.05], 0.1, 0.05); print('scipy.stats' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
