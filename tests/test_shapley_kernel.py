"""The regression estimator of Shapley values (probe.intervene.shapley_kernel) and the estimator
choice (``estimator``: permutation, kernel, auto; ``target_se``): the regression converges to the
exact values and is exact once every coalition is a row, efficiency holds at any budget, its
standard errors match the spread over seeds, its samples come in complementary pairs, its size game
has the exact values it claims, cuts the error on a saturating game and keeps a game of order two
exact, and ``auto`` picks the estimator its pilot shows cheaper per standard error and records it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.intervene.shapley import shapley
from probe.intervene.shapley_kernel import kernel_plan, kernel_values, size_game_map, size_mass, size_terms
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

TEXT = "i hated this film , it was too long"  # 9 players: 2^9 = 512 coalitions


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    return load_model(str(tiny_dirs["bert"]))


@pytest.fixture(scope="module")
def case(bert):
    """The example, an engine whose cache every run shares (identical coalitions run once), and the
    exact values over the scorable tokens."""
    examples = prepare(bert, [TEXT], TargetSpec(kind="logit"))
    engine = Engine(bert)
    exact = shapley(engine, examples, "pad", exact_max=16)
    scored = ~torch.tensor(examples[0].special)
    return examples, engine, scored, exact.scores[0][scored].double().numpy()


def _kernel(case, orders: int, seed: int = 0):
    examples, engine, scored, _ = case
    result = shapley(engine, examples, "pad", exact_max=0, permutations=orders, seed=seed, estimator="kernel")
    errors = result.extras["standard_error"][0][scored].double().numpy()
    return result, result.scores[0][scored].double().numpy(), errors


def test_the_regression_converges_to_the_exact_values_and_is_exact_with_every_coalition(case):
    exact = case[3]
    scale = float(np.ptp(exact))
    assert scale > 1e-3  # the model's values differ between tokens: the test can see an error
    errors = {}
    for orders in (2, 8, 32):
        errors[orders] = np.mean([np.mean(np.abs(_kernel(case, orders, seed)[1] - exact)) for seed in range(4)])
    assert errors[32] < errors[8] < errors[2]
    assert errors[32] < 0.1 * scale
    # 60 x 10 coalitions cover all 512: every size class enumerated, the values exact, no error left
    full, values, se = _kernel(case, 60)
    assert full.extras["coalitions"] == [2 ** 9]
    np.testing.assert_allclose(values, exact, atol=1e-5 * max(1.0, scale))
    assert np.all(se == 0)


@pytest.mark.parametrize("orders", [2, 3, 8])
def test_efficiency_holds_exactly_at_any_budget(case, orders):
    result, values, _ = _kernel(case, orders, seed=orders)
    assert result.extras["estimator"] == ["kernel"] and result.params["estimator"] == "kernel"
    assert abs(result.extras["efficiency_delta"][0]) < 1e-5
    assert math.isclose(float(values.sum()), result.extras["full_value"][0] - result.extras["empty_value"][0],
                        abs_tol=1e-5)


def test_standard_errors_match_the_spread_over_seeds(case):
    runs = [_kernel(case, 6, seed) for seed in range(24)]
    values = np.stack([v for _, v, _ in runs])  # [seeds, players]
    errors = np.stack([e for _, _, e in runs])
    assert np.isfinite(errors).all() and (errors > 0).all()
    spread = values.std(axis=0, ddof=1)  # the empirical standard deviation per player
    ratio = float(np.sqrt(np.mean(errors ** 2)) / np.sqrt(np.mean(spread ** 2)))
    print("mean standard error / spread over seeds:", round(ratio, 3))
    assert 0.6 < ratio < 1.6
    # and player by player (each spread from 24 seeds: loose)
    per_player = np.sqrt(np.mean(errors ** 2, axis=0)) / spread
    assert ((per_player > 0.4) & (per_player < 2.5)).mean() >= 0.8


@pytest.mark.parametrize("n, rows", [(9, 60), (12, 200), (30, 400)])
def test_sampled_coalitions_come_in_complementary_pairs(n, rows):
    plan = kernel_plan(n, rows, [0])
    assert len(plan.pairs) > 0
    first, second = plan.coalitions[plan.pairs[:, 0]], plan.coalitions[plan.pairs[:, 1]]
    assert (first == ~second).all()  # each sampled coalition's complement is a row
    sizes = first.sum(axis=1)
    assert ((sizes >= 1) & (sizes <= n - 1)).all()
    assert plan.coalitions[plan.empty].sum() == 0 and plan.coalitions[plan.full].all()
    # no two rows alike: the plan's coalitions are distinct
    assert len({row.tobytes() for row in plan.coalitions}) == len(plan.coalitions)
    # the enumerated classes are whole: both the smallest sizes' coalitions, all of them
    enumerated_sizes = plan.coalitions[plan.enumerated].sum(axis=1)
    for s in set(enumerated_sizes.tolist()):
        assert (enumerated_sizes == s).sum() == math.comb(n, s)
    assert math.isclose(plan.weights.sum() + plan.sampled_mass, 1.0, abs_tol=1e-9)


def test_sizes_follow_the_kernel_and_a_larger_budget_draws_a_smaller_ones_pairs_first():
    n = 40
    mass = size_mass(n)
    big = kernel_plan(n, 4000, [5])
    small = kernel_plan(n, 1000, [5])
    assert len(big.enumerated) == len(small.enumerated) == 2 * n  # sizes 1 and n - 1 enumerated in both
    drawn = big.coalitions[big.pairs[:, 0]].sum(axis=1)
    inner = mass[2:n - 1] / mass[2:n - 1].sum()
    observed = np.bincount(np.minimum(drawn, n - drawn), minlength=n // 2 + 1)[2:] / len(drawn)
    expected = np.array([inner[s - 2] + (inner[n - s - 2] if s != n - s else 0) for s in range(2, n // 2 + 1)])
    assert np.abs(observed - expected).max() < 0.05
    small_rows = {row.tobytes() for row in small.coalitions}
    big_rows = {row.tobytes() for row in big.coalitions}
    assert small_rows <= big_rows


def test_kernel_values_of_an_additive_game_are_its_weights_at_any_budget():
    n = 14
    weights = np.random.default_rng(1).normal(size=n)
    plan = kernel_plan(n, 40, [2])
    values = plan.coalitions.astype(float) @ weights + 0.3  # v(S) = 0.3 + sum of the weights in S
    phi, se = kernel_values(values, plan)
    np.testing.assert_allclose(phi, weights, atol=1e-9)
    assert np.abs(se).max() < 1e-9


def _all_coalitions(n: int) -> np.ndarray:
    codes = np.arange(2 ** n)
    return ((codes[:, None] >> np.arange(n)) & 1).astype(bool)  # [2^n, n]: bit j of a code = player j


def _codes(coalitions: np.ndarray) -> np.ndarray:
    return (coalitions.astype(np.int64) << np.arange(coalitions.shape[1])).sum(axis=1)


def _exact(values: np.ndarray, n: int) -> np.ndarray:
    """Shapley values of a game given on all 2^n coalitions, by the formula (a test's own)."""
    codes = np.arange(2 ** n)
    sizes = np.array([bin(c).count("1") for c in codes])
    weights = np.array([math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)])
    return np.array([sum(weights[sizes[c]] * (values[c | (1 << j)] - values[c]) for c in codes if not c >> j & 1)
                     for j in range(n)])


@pytest.mark.parametrize("n, leaders", [(3, (1,)), (7, ()), (8, (5, 0))])
def test_the_size_games_exact_values_match_the_formula(n, leaders):
    coalitions = _all_coalitions(n).astype(float)
    terms = size_terms(coalitions, leaders)  # [2^n, terms]
    assert terms.shape[1] == (3 + len(leaders)) * n
    coef = np.random.default_rng(n).normal(size=terms.shape[1])
    np.testing.assert_allclose(size_game_map(n, leaders) @ coef, _exact(terms @ coef, n), atol=1e-12)


def _logistic_game(n: int, seed: int) -> np.ndarray:
    """A saturating game on all 2^n coalitions: a probability, the sigmoid of an additive score."""
    weights = np.random.default_rng(seed).normal(scale=1.5, size=n)
    return 1 / (1 + np.exp(-(_all_coalitions(n) @ weights - weights.sum() / 2)))


def _plain_regression(values: np.ndarray, n: int, plan) -> np.ndarray:
    """The constrained kernel regression alone (no size game), written out here."""
    z = plan.coalitions.astype(float)
    weight = np.zeros(len(z))
    weight[plan.enumerated] += plan.weights
    np.add.at(weight, plan.pairs.ravel(), np.repeat(0.5 * plan.carried, 2))
    y = values - values[plan.empty]
    system = np.zeros((n + 1, n + 1))
    system[:n, :n], system[:n, n], system[n, :n] = (z * weight[:, None]).T @ z, 1.0, 1.0
    return np.linalg.solve(system, np.append(z.T @ (weight * y), y[plan.full]))[:n]


def test_the_size_game_cuts_the_error_on_a_saturating_game_and_keeps_a_quadratic_one_exact():
    n = 10
    game, errors = _logistic_game(n, 3), {"kernel": [], "plain": []}
    truth = _exact(game, n)
    for seed in range(8):
        plan = kernel_plan(n, 5 * (n + 1), [seed])
        values = game[_codes(plan.coalitions)]
        phi, _ = kernel_values(values, plan)
        errors["kernel"].append(np.mean(np.abs(phi - truth)))
        errors["plain"].append(np.mean(np.abs(_plain_regression(values, n, plan) - truth)))
        assert math.isclose(phi.sum(), game[-1] - game[0], abs_tol=1e-9)  # efficiency, exactly
    print("mean error, kernel / plain regression:", np.mean(errors["kernel"]) / np.mean(errors["plain"]))
    assert np.mean(errors["kernel"]) < 0.9 * np.mean(errors["plain"])
    # a game of order two: the plain regression is exact at any budget, and so is the estimate
    rng = np.random.default_rng(4)
    first, second = rng.normal(size=n), np.triu(rng.normal(size=(n, n)), 1)
    coalitions = _all_coalitions(n).astype(float)
    quadratic = coalitions @ first + np.einsum("ri,ij,rj->r", coalitions, second, coalitions)
    plan = kernel_plan(n, 4 * (n + 1), [1])
    phi, se = kernel_values(quadratic[_codes(plan.coalitions)], plan)
    np.testing.assert_allclose(phi, _exact(quadratic, n), atol=1e-9)
    assert np.abs(se).max() < 1e-9


def test_auto_picks_the_estimator_its_pilot_shows_cheaper_and_records_it(bert):
    texts = ["i hated this film , it was boring and too long", "a great story with wonderful acting , really"]
    examples = prepare(bert, texts, TargetSpec(kind="logit"))
    engine = Engine(bert)
    before = engine.stats.rows_evaluated
    auto = shapley(engine, examples, "pad", exact_max=0, permutations=16, estimator="auto", seed=4)
    ran = engine.stats.rows_evaluated - before
    assert auto.params["estimator"] == "auto"
    assert set(auto.extras["estimator"]) <= {"permutation", "kernel"} and len(auto.extras["estimator"]) == 2
    pilots = {name: shapley(Engine(bert), examples, "pad", exact_max=0, permutations=4, estimator=name, seed=4)
              for name in ("permutation", "kernel")}
    for j, example in enumerate(examples):
        scored = ~torch.tensor(example.special)
        cost = {name: p.extras["coalitions"][j] * float(np.mean(p.extras["standard_error"][j][scored].numpy() ** 2))
                for name, p in pilots.items()}
        assert auto.extras["estimator"][j] == min(cost, key=cost.get), cost
        alone = shapley(Engine(bert), examples, "pad", exact_max=0, permutations=16, seed=4,
                        estimator=auto.extras["estimator"][j])
        assert torch.allclose(auto.scores[j], alone.scores[j], atol=1e-5, equal_nan=True)  # then the chosen one at 16
        assert abs(auto.extras["efficiency_delta"][j]) < 1e-5
    # the chosen pilot's rows are the final run's first draws: only the other pilot's rows are extra
    other = sum(pilots["kernel" if chosen == "permutation" else "permutation"].extras["coalitions"][j]
                for j, chosen in enumerate(auto.extras["estimator"]))
    assert ran <= sum(auto.extras["coalitions"]) + other


def test_a_target_standard_error_stops_early_and_a_tighter_one_runs_longer(case):
    examples, _, scored, exact = case
    loose = shapley(Engine(case[1].pm), examples, "pad", exact_max=0, permutations=512,
                    estimator="permutation", target_se=0.2)
    tight = shapley(Engine(case[1].pm), examples, "pad", exact_max=0, permutations=512,
                    estimator="permutation", target_se=0.002)
    assert loose.extras["permutations"][0] < tight.extras["permutations"][0] <= 512
    rms = float(np.sqrt(np.mean(tight.extras["standard_error"][0][scored].double().numpy() ** 2)))
    assert rms <= 2 * 0.002 * float(np.ptp(exact))  # near the target (projected from a pilot)
    assert tight.extras["rows_asked"][0] == tight.extras["permutations"][0] * (len(exact) + 1)


@pytest.mark.parametrize("bad, match", [({"estimator": "regression"}, "shapley.estimator"),
                                        ({"target_se": 2.0}, "target_se")])
def test_bad_estimator_parameters_are_one_line(bert, bad, match):
    examples = prepare(bert, [TEXT])
    with pytest.raises(InputError, match=match):
        shapley(Engine(bert), examples, **bad)


def test_explain_runs_the_estimators_on_a_builtin_model(builtin_cache):
    import probe

    pm = probe.load_model("builtin:minilm-rt")
    text = "a gorgeous , witty , seductive movie , never dull"
    found = {}
    for estimator in ("kernel", "auto"):
        explanation = probe.explain(pm, [text], methods=["shapley"], params={"shapley": {
            "mode": "mask", "exact_max": 0, "permutations": 8, "estimator": estimator}})
        result = explanation.scores["shapley"]
        assert result.params["estimator"] == estimator
        assert result.extras["estimator"][0] in ("kernel", "permutation")
        assert abs(result.extras["efficiency_delta"][0]) < 1e-4
        found[estimator] = result.scores[0]
    exact = probe.explain(pm, [text], methods=["shapley"], params={"shapley": {"mode": "mask", "exact_max": 16}})
    truth = exact.scores["shapley"].scores[0]
    scored = ~torch.isnan(truth)
    scale = float(truth[scored].max() - truth[scored].min())
    for estimator, values in found.items():  # a coarse budget, still near the exact values
        assert float((values[scored] - truth[scored]).abs().mean()) < 0.1 * scale, estimator
