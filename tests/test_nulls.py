"""Chance as a distribution (probe.metrics.nulls): each unit against the permutation null of its own
mean agreement, units of a family together (max-T), and the small-n tests of the claims
(probe.claims.rules). Oracles: probe.metrics.agreement (itself equal to scipy) for the observed
statistic, exact enumeration of every permutation for the p-value, scipy's permutation_test for the
sign-flip test and scipy's wilcoxon for the paired comparisons."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from probe.claims.kinds import KINDS
from probe.claims.rules import MIN_EVIDENCE, Rule, judge, sign_flip_p
from probe.metrics.agreement import agreement
from probe.metrics.nulls import NullBlock, agreement_values, exact_top_k, max_t_test, permutation_means
from probe.metrics.statistics import paired_test, wilcoxon_method

MEASURES = ["kendall_tau", "spearman", "top1", "top2"]


def _blocks(rng, n_examples=8, n_units=4, ties=True):
    blocks = []
    for e in range(n_examples):
        n = int(rng.integers(3, 10))
        x = rng.normal(size=(n_units, n))
        y = rng.normal(size=n)
        if ties:  # ties on both sides, as stored scores have them (zeros, equal attention)
            x[1] = np.round(x[1])
            y = np.round(y * 2) / 2
        blocks.append(NullBlock(owner=e, key=e, units=np.arange(n_units), x=x, y=y, positions=np.arange(n)))
    return blocks


@pytest.mark.parametrize("measure", MEASURES)
def test_the_observed_statistic_is_the_mean_agreement_the_study_computes(measure):
    blocks = _blocks(np.random.default_rng(0))
    observed, null = permutation_means(blocks, 4, measure, permutations=1000, seed=3)
    per_example = np.array([agreement(b.x, b.y, k=[1, 2])[measure] for b in blocks])  # [example, unit]
    assert observed == pytest.approx(np.nanmean(per_example, axis=0), abs=1e-12)
    assert null.shape == (4, 1000) and np.isfinite(null).all()


@pytest.mark.parametrize("measure", ["kendall_tau", "top1"])
def test_the_permutation_p_value_equals_exact_enumeration_within_its_monte_carlo_error(measure):
    x1, y1 = np.array([[0.1, 0.5, 0.3, 0.9]]), np.array([1.0, 0.0, 3.0, 2.0])
    x2, y2 = np.array([[2.0, 1.0, 0.0, 3.0, 0.5]]), np.array([0.0, 2.0, 1.0, 3.0, 3.0])
    blocks = [NullBlock(0, 0, np.array([0]), x1, y1, np.arange(4)), NullBlock(1, 1, np.array([0]), x2, y2, np.arange(5))]

    def stat(a, b):
        return (agreement(x1, a, k=[1])[measure][0] + agreement(x2, b, k=[1])[measure][0]) / 2

    observed = stat(y1, y2)
    draws = np.array([stat(y1[list(p)], y2[list(q)]) for p in itertools.permutations(range(4))
                      for q in itertools.permutations(range(5))])
    exact = float((draws >= observed - 1e-12).mean())
    b = 20000
    got, null = permutation_means(blocks, 1, measure, permutations=b, seed=1)
    assert got[0] == pytest.approx(observed)
    p = max_t_test(got, null)["p_raw"][0]
    assert abs(p - exact) < 4 * math.sqrt(exact * (1 - exact) / b) + 1e-3
    assert null.mean() == pytest.approx(draws.mean(), abs=4 * draws.std() / math.sqrt(b))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_closed_form_top_k_null_equals_exact_enumeration(k):
    # three examples, n = 4, 5 and 3 tokens, no tie in the reference: every permutation enumerated
    xs = [np.array([[0.1, 0.5, 0.3, 0.9], [0.9, 0.8, 0.1, 0.2]]), np.array([[2.0, 1.0, 0.0, 3.0, 0.5], [0.0, 0.0, 1.0, 0.0, 0.0]]),
          np.array([[0.2, 0.1, 0.3], [1.0, 2.0, 3.0]])]
    ys = [np.array([1.0, 0.0, 3.0, 2.0]), np.array([0.0, 2.0, 1.0, 3.0, 2.5]), np.array([5.0, 1.0, 2.0])]
    blocks = [NullBlock(e, e, np.array([0, 1]), x, y, np.arange(y.size)) for e, (x, y) in enumerate(zip(xs, ys))]
    got = exact_top_k(blocks, 2, k)
    assert got["exact"].all()

    for unit in range(2):
        # per example, the overlap under each of its permutations; the null of the mean is every combination
        per = [np.array([agreement(x[unit:unit + 1], y[list(q)], k=[k])[f"top{k}"][0]
                         for q in itertools.permutations(range(y.size))]) for x, y in zip(xs, ys)]
        observed = np.mean([agreement(x[unit:unit + 1], y, k=[k])[f"top{k}"][0] for x, y in zip(xs, ys)])
        draws = np.mean(np.meshgrid(*per, indexing="ij"), axis=0).ravel()
        assert got["p_raw"][unit] == pytest.approx(float((draws >= observed - 1e-12).mean()), abs=1e-12)
        assert got["null_mean"][unit] == pytest.approx(draws.mean(), abs=1e-12)
        high = got["null_high"][unit]
        assert (draws <= high + 1e-12).mean() >= 0.95 > (draws < high - 1e-12).mean()


def test_the_closed_form_single_example_is_scipys_hypergeometric_tail():
    rng = np.random.default_rng(4)
    n, k = 30, 5
    x, y = rng.normal(size=(1, n)), rng.normal(size=n)
    y[np.argsort(-x[0])[:3]] += 10.0  # three of the unit's top five are the reference's top five
    got = exact_top_k([NullBlock(0, 0, np.array([0]), x, y, np.arange(n))], 1, k)
    hits = int(round(agreement(x, y, k=[k])[f"top{k}"][0] * k))
    assert hits >= 3
    assert got["p_raw"][0] == pytest.approx(stats.hypergeom.sf(hits - 1, n, k, k), rel=1e-10)


def test_the_closed_form_agrees_with_the_permutations_on_a_study_sized_family():
    rng = np.random.default_rng(5)
    blocks = []
    for e in range(40):
        n = int(rng.integers(2, 25))  # some examples shorter than k: k becomes n there
        x, y = rng.normal(size=(3, n)), rng.normal(size=n)
        x[0] += y  # unit 0 tracks, units 1 and 2 do not
        blocks.append(NullBlock(e, e, np.arange(3), x, y, np.arange(n)))
    got = exact_top_k(blocks, 3, 3)
    observed, null = permutation_means(blocks, 3, "top3", permutations=20000, seed=2)
    mc = max_t_test(observed, null)
    assert got["exact"].all()
    for unit in range(3):
        p = got["p_raw"][unit]
        assert abs(mc["p_raw"][unit] - p) < 4 * math.sqrt(max(p * (1 - p), 1e-4) / 20000) + 2e-4
    assert got["null_mean"] == pytest.approx(null.mean(axis=1), abs=0.003)
    assert got["p_raw"][0] < 1e-6 < got["p_raw"][1]  # below what 20,000 permutations can resolve


def test_the_closed_form_steps_aside_for_ties_at_the_k_th_place_and_averaged_output_tokens():
    x = np.array([[0.3, 0.2, 0.1, 0.0]])
    tied = NullBlock(0, 0, np.array([0]), x, np.array([2.0, 1.0, 1.0, 0.0]), np.arange(4))  # tie across 2nd place
    assert not exact_top_k([tied], 1, 2)["exact"][0]
    assert exact_top_k([tied], 1, 1)["exact"][0]  # the tie is below the top 1
    steps = [NullBlock(0, key, np.array([0]), x, np.array([3.0, 1.0, 2.0, 0.0]), np.arange(4)) for key in (0, 1)]
    got = exact_top_k(steps, 1, 1)  # two output tokens of one example, averaged first
    assert not got["exact"][0] and np.isnan(got["p_raw"][0])


def test_a_top_k_family_reports_the_exact_null_and_a_rank_correlation_the_permutations():
    import pandas as pd

    from probe.study.chance import ChanceFamily

    blocks = tuple(_blocks(np.random.default_rng(6), n_examples=12, n_units=3, ties=False))
    units = pd.DataFrame({"explainer": ["attention"] * 3, "layer": [0, 0, 0], "head": [0, 1, 2]})
    for measure, kind in (("top2", "exact"), ("kendall_tau", "permutation")):
        rows = ChanceFamily("attention weights", "loo_delete", measure, units, blocks, (12, 12, 12)).test(
            permutations=500, seed=0)
        assert list(rows["null"]) == [kind] * 3
        assert (rows.p_family >= rows.p_chance - 1e-12).all()
    exact = exact_top_k(blocks, 3, 2)
    assert rows.shape[0] == 3 and exact["exact"].all()
    top = ChanceFamily("attention weights", "loo_delete", "top2", units, blocks, (12, 12, 12)).test(permutations=500, seed=0)
    assert top.p_chance.to_numpy() == pytest.approx(exact["p_raw"])
    assert top.chance_mean.to_numpy() == pytest.approx(exact["null_mean"])


def test_every_unit_of_an_example_sees_the_same_permutations_also_on_a_subset_of_its_tokens():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 9))
    y = rng.normal(size=9)
    whole = [NullBlock(0, 7, np.array([0, 1]), x, y, np.arange(9))]
    split = [NullBlock(0, 7, np.array([0]), x[:1], y, np.arange(9)), NullBlock(0, 7, np.array([1]), x[1:], y, np.arange(9))]
    a = permutation_means(whole, 2, "kendall_tau", permutations=50, seed=5)[1]
    b = permutation_means(split, 2, "kendall_tau", permutations=50, seed=5)[1]
    assert np.array_equal(a, b)
    # a unit that skips a token is permuted by the same keys' order over the tokens it has
    keep = np.array([0, 1, 2, 4, 5, 6, 7, 8])
    sub = [NullBlock(0, 7, np.array([0]), x[:1, keep], y[keep], keep)]
    again = [NullBlock(0, 7, np.array([0]), x[:1, keep], y[keep], keep)]
    assert np.array_equal(permutation_means(sub, 1, "top1", permutations=50, seed=5)[1],
                          permutation_means(again, 1, "top1", permutations=50, seed=5)[1])
    assert not np.array_equal(permutation_means(sub, 1, "top1", permutations=50, seed=6)[1],
                              permutation_means(sub, 1, "top1", permutations=50, seed=5)[1])


def test_a_unit_at_chance_level_never_passes_because_one_random_ranking_scored_zero():
    """The failure the single random ranking had: 4 top-1 hits in 40 texts of 10 tokens is what
    chance gives (3.75 hits expected); against a random ranking that scored 0 on every text (its CI
    [0, 0]) it passed. Against its own null it is nowhere near."""
    rng = np.random.default_rng(2)
    blocks = []
    for e in range(40):
        y = rng.normal(size=10)
        x = rng.normal(size=(1, 10))
        if e < 4:  # a hit on 4 texts
            x[0, int(np.argmax(y))] = 10.0
        else:
            x[0, int(np.argmax(y))] = -10.0
        blocks.append(NullBlock(e, e, np.array([0]), x, y, np.arange(10)))
    observed, null = permutation_means(blocks, 1, "top1", permutations=1000, seed=0)
    assert observed[0] == pytest.approx(0.1)
    test = max_t_test(observed, null)
    assert test["p_raw"][0] > 0.3 and test["null_mean"][0] == pytest.approx(0.1, abs=0.01)


def test_a_unit_with_nothing_to_permute_gets_p_one_and_nan_stays_nan():
    observed = np.array([0.5, np.nan, 0.2])
    null = np.array([[0.5] * 10, [np.nan] * 10, np.linspace(-0.1, 0.1, 10)])
    test = max_t_test(observed, null)
    assert test["p_raw"][0] == 1.0 and test["p_family"][0] == 1.0
    assert np.isnan(test["p_raw"][1]) and np.isnan(test["p_family"][1])
    assert test["p_raw"][2] == pytest.approx(1 / 11) and test["p_family"][2] >= test["p_raw"][2]


def test_max_t_controls_the_family_wise_error_on_many_correlated_null_units():
    """30 units that share half their scores (correlated, as heads of one model are), a reference
    drawn independently of them: over 200 datasets, the family passes any unit in at most 5% (plus
    the Monte Carlo margin), while the raw p-values pass one in most datasets."""
    alpha, datasets, units = 0.05, 200, 30
    family_hits = raw_hits = 0
    for d in range(datasets):
        rng = np.random.default_rng(100 + d)
        blocks = []
        for e in range(12):
            n = 6
            shared = rng.normal(size=n)
            x = 0.7 * shared + rng.normal(size=(units, n))
            blocks.append(NullBlock(e, e, np.arange(units), x, rng.normal(size=n), np.arange(n)))
        observed, null = permutation_means(blocks, units, "kendall_tau", permutations=1000, seed=d)
        test = max_t_test(observed, null)
        family_hits += bool((test["p_family"] <= alpha).any())
        raw_hits += bool((test["p_raw"] <= alpha).any())
    assert family_hits / datasets <= alpha + 2 * math.sqrt(alpha * (1 - alpha) / datasets)
    assert raw_hits / datasets > 0.3


def test_a_unit_that_tracks_passes_the_family_test_among_many_null_units():
    rng = np.random.default_rng(4)
    blocks = []
    for e in range(30):
        y = rng.normal(size=8)
        x = rng.normal(size=(40, 8))
        x[17] = y + 0.5 * rng.normal(size=8)  # unit 17 carries the reference
        blocks.append(NullBlock(e, e, np.arange(40), x, y, np.arange(8)))
    test = max_t_test(*permutation_means(blocks, 40, "kendall_tau", permutations=1000, seed=0))
    assert np.flatnonzero(test["p_family"] <= 0.05).tolist() == [17]
    assert test["p_family"][17] == pytest.approx(1 / 1001)


def test_owners_average_their_blocks_first_as_a_study_of_generated_text_does():
    rng = np.random.default_rng(5)
    blocks = [NullBlock(o, k, np.array([0]), rng.normal(size=(1, 6)), rng.normal(size=6), np.arange(6))
              for k, o in enumerate([0, 0, 0, 1])]
    observed, _ = permutation_means(blocks, 1, "kendall_tau", permutations=10, seed=0)
    taus = [agreement(b.x, b.y)["kendall_tau"][0] for b in blocks]
    assert observed[0] == pytest.approx((np.mean(taus[:3]) + taus[3]) / 2)


# --------------------------------------------------------------------------- claims on little evidence


def test_no_claim_is_decided_on_fewer_than_the_minimum_of_examples():
    two = judge([1.0, 1.0], KINDS["token_importance"].rule(None))
    assert two.verdict == "inconclusive" and two.why == f"n = 2, at least {MIN_EVIDENCE} needed"
    assert all(math.isnan(b) for b in two.ci) and two.n_needed >= MIN_EVIDENCE
    nine = judge([0.9, 0.8, 0.95, 0.7, 0.85, 0.9, 0.8, 0.75, 0.9], KINDS["specific_tokens"].rule(None))
    assert nine.verdict == "inconclusive" and "at least 10" in nine.why
    ten = judge([0.9, 0.8, 0.95, 0.7, 0.85, 0.9, 0.8, 0.75, 0.9, 0.8], KINDS["specific_tokens"].rule(None))
    assert ten.verdict == "supported" and ten.why is None and ten.p_value == pytest.approx(1 / 1024)


def test_a_small_sample_needs_the_sign_flip_test_to_agree_with_the_bootstrap_interval():
    """0/1 hits against 0.5: 11 of 15 put the percentile bootstrap CI above 0.5, but the exact sign
    test gives p = 0.059 > 0.025: inconclusive, and it says why."""
    hits = [1] * 11 + [0] * 4
    j = judge(hits, KINDS["token_importance"].rule(None), n_boot=2000, seed=0)
    assert j.ci[0] > 0.5  # the interval alone would have said supported
    assert j.verdict == "inconclusive" and "sign-flip" in j.why
    assert j.p_value == pytest.approx(stats.binomtest(11, 15, 0.5, alternative="greater").pvalue)
    nine_of_ten = judge([1] * 10 + [1] * 9 + [0], KINDS["token_importance"].rule(None))  # 19 of 20
    assert nine_of_ten.verdict == "supported"


@pytest.mark.parametrize("n", [6, 12, 25])
def test_the_sign_flip_p_value_equals_scipys_permutation_test(n):
    d = np.random.default_rng(n).normal(0.3, 1.0, size=n)
    for greater in (True, False):
        ours = sign_flip_p(d, greater=greater, seed=0)
        theirs = stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf if n <= 20 else 100_000,
                                        alternative="greater" if greater else "less", random_state=0).pvalue
        tol = 1e-12 if n <= 20 else 4 * math.sqrt(theirs * (1 - theirs) / 100_000) + 1e-4
        assert ours == pytest.approx(theirs, abs=tol)


def test_a_refutation_on_a_small_sample_is_checked_the_same_way():
    rule = Rule(0.0, refute_inclusive=True)
    j = judge([-0.5, -0.4, -0.6, -0.5, -0.45, -0.55, -0.5, -0.4, -0.6, -0.5], rule)
    assert j.verdict == "refuted" and j.p_value == pytest.approx(1 / 1024)


# --------------------------------------------------------------------------- paired comparisons


def test_paired_tests_use_the_tie_corrected_normal_approximation_where_ties_or_zeros_are():
    a = np.array([0.5, 0.5, 0.25, 0.0, 1.0, 0.5, 0.75, 0.5, 0.25, 0.5, 0.5, 1.0, 0.5])
    b = np.array([0.25, 0.5, 0.0, 0.25, 0.5, 0.25, 0.5, 0.0, 0.5, 0.25, 0.0, 0.75, 0.25])
    assert wilcoxon_method(a - b) == "approx"
    assert paired_test(a, b)["wilcoxon_p"] == pytest.approx(stats.wilcoxon(a, b, method="approx").pvalue, rel=1e-12)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=14), rng.normal(size=14)
    assert wilcoxon_method(x - y) == "exact"
    assert paired_test(x, y)["wilcoxon_p"] == pytest.approx(stats.wilcoxon(x, y).pvalue, rel=1e-12)
    long = rng.normal(size=60)
    assert wilcoxon_method(long) == "approx"


# ----------------------------------------------------------------- Monte Carlo error (issue 61, item 3)


@pytest.mark.parametrize("measure", MEASURES)
def test_the_null_moments_equal_exact_enumeration(measure):
    from probe.metrics.nulls import null_moments

    rng = np.random.default_rng(11)
    blocks = _blocks(rng, n_examples=3, n_units=3, ties=not measure.startswith("top"))
    blocks = [b for b in blocks if b.x.shape[1] <= 7]  # 7! permutations at most
    means = []
    for b in blocks:
        perms = np.array(list(itertools.permutations(range(b.x.shape[1]))))
        means.append(agreement_values(measure, b.x, b.y[perms]))  # [U, n!]
    # the unit's mean over examples: independent examples, so the variances add
    want_mean = np.mean([v.mean(axis=1) for v in means], axis=0)
    want_sd = np.sqrt(np.sum([v.var(axis=1) for v in means], axis=0)) / len(means)
    mean, sd = null_moments(blocks, 3, measure)
    assert len(blocks) >= 2 and mean == pytest.approx(want_mean, abs=1e-12) and sd == pytest.approx(want_sd, rel=1e-9)


def _spread_family(n_units=12, n_examples=12, n=6, seed=21):
    rng = np.random.default_rng(seed)
    blocks = []
    for e in range(n_examples):
        shared = rng.normal(size=n)
        y = rng.normal(size=n)
        x = 0.7 * shared + rng.normal(size=(n_units, n))
        x[0] += 0.6 * y  # unit 0 carries a little
        blocks.append(NullBlock(e, e, np.arange(n_units), x, y, np.arange(n)))
    return blocks


def test_p_family_varies_over_seeds_by_its_binomial_monte_carlo_error_only():
    """Standardised by the draws' own mean and sd, a discrete measure's ``p_family`` moved over seeds
    by several times sqrt(p (1 - p) / B) (issue 61); by the exact moments, by that error alone."""
    from probe.metrics.nulls import null_moments

    blocks = _spread_family()
    center, scale = null_moments(blocks, 12, "top1")
    ps = []
    for seed in range(60):
        observed, null = permutation_means(blocks, 12, "top1", permutations=1000, seed=seed)
        ps.append(max_t_test(observed, null, center=center, scale=scale)["p_family"][0])
    p = float(np.mean(ps))
    assert 0.02 < p < 0.98
    assert np.std(ps, ddof=1) < 1.4 * math.sqrt(p * (1 - p) / 1000)


def _near_alpha_family(data_seed):
    """One unit of three whose true family-wise p-value (40,000 rankings) is 0.056 (data seed 26),
    0.040 (85), or about 1e-3 and 0.5 for its two others."""
    import pandas as pd

    from probe.study.chance import ChanceFamily

    rng = np.random.default_rng(data_seed)
    blocks = []
    for e in range(10):
        y = rng.normal(size=6)
        x = rng.normal(size=(3, 6))
        x[0] = 0.25 * y + x[0]
        blocks.append(NullBlock(e, e, np.arange(3), x, y, np.arange(6)))
    units = pd.DataFrame({"explainer": ["attention"] * 3, "layer": [0, 0, 0], "head": [0, 1, 2]})
    return ChanceFamily("attention weights", "loo_delete", "kendall_tau", units, tuple(blocks), (10, 10, 10))


@pytest.mark.parametrize(("data_seed", "passes"), [(26, False), (85, True)])
def test_a_unit_near_alpha_draws_more_and_its_decision_agrees_across_seeds_or_says_near_alpha(data_seed, passes):
    from probe.study.chance import MC_MAX_PERMUTATIONS

    family = _near_alpha_family(data_seed)
    alpha = 0.05
    decided = []
    for seed in range(20):
        row = family.test(permutations=1000, seed=seed, alpha=alpha).iloc[0]
        assert row.permutations > 1000  # within Monte Carlo error of alpha at 1,000: it draws more
        assert row.permutations <= MC_MAX_PERMUTATIONS
        assert row.p_mc_se == pytest.approx(math.sqrt(row.p_family * (1 - row.p_family) / row.permutations))
        if row.near_alpha:
            assert row.permutations == MC_MAX_PERMUTATIONS
        else:
            decided.append(bool(row.p_family <= alpha))
    assert decided and set(decided) == {passes}  # every stable decision is the true one
    plain = [family.test(permutations=1000, seed=s).iloc[0] for s in range(20)]
    assert all(r.permutations == 1000 and not r.near_alpha for r in plain)  # no alpha: the plain test


def test_a_family_far_from_alpha_draws_nothing_more_and_the_rule_is_deterministic():
    import pandas as pd

    from probe.study.chance import ChanceFamily, stage_seed

    rng = np.random.default_rng(4)
    blocks = []
    for e in range(30):
        y = rng.normal(size=8)
        x = rng.normal(size=(6, 8))
        x[2] = y + 0.5 * rng.normal(size=8)  # unit 2 carries the reference; the others nothing
        blocks.append(NullBlock(e, e, np.arange(6), x, y, np.arange(8)))
    units = pd.DataFrame({"explainer": ["attention"] * 6, "layer": [0] * 6, "head": list(range(6))})
    family = ChanceFamily("attention weights", "loo_delete", "kendall_tau", units, tuple(blocks), (30,) * 6)
    plain = family.test(permutations=1000, seed=3)
    sequential = family.test(permutations=1000, seed=3, alpha=0.05)
    assert not (plain.p_family.between(0.02, 0.1)).any()
    pd.testing.assert_frame_equal(plain, sequential)  # nothing more drawn, the same numbers
    assert (sequential.permutations == 1000).all() and not sequential.near_alpha.any()
    near = _near_alpha_family(26)
    first = near.test(permutations=1000, seed=7, alpha=0.05)
    pd.testing.assert_frame_equal(first, near.test(permutations=1000, seed=7, alpha=0.05))
    assert stage_seed(7, 0) == 7 and len({stage_seed(7, s) for s in range(6)}) == 6
    assert stage_seed(7, 1) == stage_seed(7, 1) != stage_seed(8, 1)


def test_the_cap_bounds_the_draws_and_is_checked():
    family = _near_alpha_family(26)
    rows = family.test(permutations=1000, seed=0, alpha=0.05, max_permutations=3000)
    assert rows.permutations.iloc[0] in (2000, 3000)
    assert (rows.permutations == rows.permutations.iloc[0]).all()  # a family's units rest on one draw
    with pytest.raises(ValueError, match="max_permutations"):
        family.test(permutations=1000, seed=0, alpha=0.05, max_permutations=500)
    with pytest.raises(ValueError, match="max_permutations"):
        family.test(permutations=1000, seed=0, alpha=0.05, max_permutations=10**7)


def test_kendall_null_from_dense_ranks_equals_the_null_from_values():
    """The null permutes y's ranks (small integers) instead of its values: every tau the same, ties too."""
    from probe.metrics.nulls import agreement_values, dense_ranks

    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 25))
    y = np.round(rng.normal(size=25), 1)  # ties
    order = np.array([rng.permutation(25) for _ in range(300)])
    ranks = dense_ranks(y)
    assert ranks.dtype == np.int16 and (np.argsort(ranks, kind="stable") == np.argsort(y, kind="stable")).all()
    np.testing.assert_array_equal(agreement_values("kendall_tau", x, ranks[order]),
                                  agreement_values("kendall_tau", x, y[order]))
    assert dense_ranks(np.array([1.0, np.nan])).dtype == np.float64  # not finite: the values, as before


def test_families_tested_together_give_each_family_its_own_rows():
    """A study's families share their examples' permutations (issue 63): tested together, every
    family's rows are the ones it gets alone, bit for bit, the sequential rule's extra draws
    included, whatever its measure or reference."""
    import pandas as pd

    from probe.study.chance import ChanceFamily, test_families

    rng = np.random.default_rng(11)
    near = _near_alpha_family(26)
    shared = [NullBlock(b.owner, b.key, np.arange(2), rng.normal(size=(2, b.x.shape[1])), b.y, b.positions)
              for b in near.blocks]  # the same reference values: the same permutations, stacked
    other_ref = [NullBlock(b.owner, b.key, np.arange(1), b.x[:1], rng.normal(size=b.y.size), b.positions)
                 for b in near.blocks]

    def family(name, measure, blocks, units, reference="loo_delete"):
        frame = pd.DataFrame({"explainer": [name] * units, "layer": [0] * units, "head": list(range(units))})
        return ChanceFamily(name, reference, measure, frame, tuple(blocks), (len(blocks),) * units)

    plan = [near, family("gradients", "kendall_tau", shared, 2), family("ceiling", "kendall_tau", other_ref, 1, "loo_mask"),
            family("spearman", "spearman", shared, 2), family("top", "top2", shared, 2)]
    together = test_families(plan, permutations=1000, seed=5, alpha=0.05)
    assert together[0].permutations.iloc[0] > 1000  # the near family drew more
    for fam, rows in zip(plan, together, strict=True):
        pd.testing.assert_frame_equal(rows, fam.test(permutations=1000, seed=5, alpha=0.05))


def test_kendall_null_from_large_integers_and_long_rows_equals_the_oracle():
    """The pair signs come from small integer ranks a row position at a time: integer values beyond
    int8 or int16, and rows of 128 tokens and more, give the taus scipy gives."""
    from probe.metrics.nulls import dense_ranks

    rng = np.random.default_rng(8)
    for n in (7, 130):
        x = rng.normal(size=(3, n))
        y = rng.integers(0, n // 2, size=n)  # ties
        order = np.array([rng.permutation(n) for _ in range(40)])
        for values in (y * 1000 + 70000, dense_ranks(y.astype(float)), y.astype(float)):
            got = agreement_values("kendall_tau", x, values[order])
            want = [[stats.kendalltau(x[u], y[o]).statistic for o in order] for u in range(3)]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
