"""The verdict's rules on synthetic tables (no model): an unreliable unit never tracks, families are
answered separately, and nothing is decided where nothing can be (probe.study.summary, probe.study.decide).
The planted-truth models test the same rules end to end (tests/test_study_planted.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from probe.spec.study import study_from_dict
from probe.study import decide
from probe.study.summary import summary_table, verdict
from probe.study.units import verdict_family

N = 20


def _study(**statistics):
    return study_from_dict({
        "name": "synthetic", "model": {"id": "x"}, "dataset": {"name": "builtin:rotten_tomatoes", "n": N},
        "explainers": ["attention_mean", "rollout", "alti", "saliency", "input_x_gradient"],
        "references": ["loo_delete", "loo_mask"],
        "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None},
        "statistics": {"bootstrap": 200, "reference": "loo_delete", **statistics}})


def _agreement(means: dict[tuple[str, str, str], float], seed: int = 0) -> pd.DataFrame:
    """Rows per example for each (role, explainer, reference) at the given mean tau (small noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for (role, explainer, reference), mean in means.items():
        layer = 0 if explainer in ("attention_mean", "rollout", "alti") else -1
        for e in range(N):
            tau = float(np.clip(mean + rng.normal(0, 0.05), -1, 1))
            rows.append({"example": e, "explainer": explainer, "reference": reference, "role": role, "layer": layer,
                         "head": -1, "n_tokens": 10, "kendall_tau": tau, "kendall_p": 0.5, "top1": tau})
    return pd.DataFrame(rows)


def _chance(summary: pd.DataFrame) -> pd.DataFrame:
    """Rule 1's tests as the permutation engine would give them on these synthetic tables, which hold
    no token scores to permute: a unit (or a ceiling pair) with a mean above 0.2 is far above chance
    (p = 0.001), any other is not (p = 0.5). probe.metrics.nulls is tested on its own
    (tests/test_nulls.py)."""
    from probe.study.chance import CHANCE_COLUMNS

    if not len(summary):
        return pd.DataFrame(columns=CHANCE_COLUMNS)
    rows = summary[(summary.reference == "loo_delete") | (summary.role == "ceiling")]
    rows = rows[[r == "ceiling" or verdict_family(e) is not None for r, e in zip(rows.role, rows.explainer)]]
    rows = rows.drop_duplicates(["role", "explainer", "reference", "layer", "head"])
    p = np.where(rows["mean"] > 0.2, 0.001, 0.5)
    return pd.DataFrame({"family": ["ceiling" if r == "ceiling" else verdict_family(e) for r, e in
                                    zip(rows.role, rows.explainer)],
                         "explainer": rows.explainer, "reference": rows.reference, "layer": rows.layer,
                         "head": rows["head"], "n": rows.n, "observed": rows["mean"], "chance_mean": 0.0,
                         "chance_high": 0.2, "p_chance": p, "p_family": p})


def _verdict(agreement, summary, study, name, **kw):
    return verdict(agreement, summary, study, name, chance=_chance(summary), **kw)


GOOD = {("explainer", "attention_mean", "loo_delete"): 0.6, ("explainer", "rollout", "loo_delete"): 0.1,
        ("explainer", "alti", "loo_delete"): 0.6, ("explainer", "saliency", "loo_delete"): 0.5,
        ("explainer", "input_x_gradient", "loo_delete"): 0.55, ("baseline", "random", "loo_delete"): 0.0,
        ("ceiling", "loo_mask", "loo_delete"): 0.8}


def _run(means=GOOD, unreliable=None, profile=None, **statistics):
    study = _study(**statistics)
    agreement = _agreement(means)
    return _verdict(agreement, summary_table(agreement, study), study, "m", unreliable=unreliable, profile=profile)[0]


def test_families_are_answered_separately_and_the_headline_is_the_attention_weights():
    v = _run()
    assert v["answer"] == "yes" and v["headline_family"] == "attention weights"
    assert v["families"]["attention weights"]["answer"] == "yes"
    assert v["families"]["attention-derived"]["answer"] == "no"  # rollout at 0.1 is below the bar
    assert v["families"]["context mixing"]["answer"] == "yes"
    assert "Other attention explanations: attention-derived: no" in v["headline"]
    assert "signed loo_delete" in v["headline"] and v["reference_sign"] == "signed"
    # no per-head explainer in the study: the headline counts layer-level units only, never "0/0 heads"
    assert v["head_units"]["total"] == 0 and "0/0" not in v["headline"] and " heads" not in v["headline"]
    assert "layer-level units pass the rule." in v["headline"]


def test_passing_units_leaves_out_the_heads_only_where_there_are_none():
    from probe.study.headline import passing_units

    layer, heads, none = {"tracking": 3, "total": 6}, {"tracking": 2, "total": 48}, {"tracking": 0, "total": 0}
    assert passing_units(layer, heads) == "3/6 layer-level units and 2/48 heads"
    assert passing_units(layer, heads, short=True) == "3/6 layer-level, 2/48 heads"
    assert passing_units(layer, none) == "3/6 layer-level units"
    assert passing_units(none, heads) == "2/48 heads"


def test_a_unit_whose_method_failed_a_check_never_tracks_and_cannot_carry_the_verdict():
    v = _run(unreliable={"attention_mean": ["randomisation"]})
    assert v["answer"] == "no" and v["families"]["attention weights"]["answer"] == "no"
    assert "every method of this family failed a sanity check" in v["headline"]
    assert v["families"]["context mixing"]["answer"] == "yes"  # named beside it, not carrying it
    assert v["best_layers"][0]["unreliable"] and not v["best_layers"][0]["tracks"]


def test_the_gradient_bar_says_which_method_it_is_and_why_others_were_excluded():
    v = _run(unreliable={"input_x_gradient": ["sign"]})
    assert v["gradient_bar"]["explainer"] == "saliency" and v["gradient_bar"]["excluded"] == {"input_x_gradient": ["sign"]}
    assert "excluded: input_x_gradient (sign)" in v["headline"]
    none = _run(unreliable={"input_x_gradient": ["sign"], "saliency": ["randomisation"]})
    assert none["gradient_bar"]["explainer"] is None and "no gradient explainer passed" in none["gradient_bar"]["text"]


def test_references_that_do_not_agree_above_random_are_undecidable():
    means = {**GOOD, ("ceiling", "loo_mask", "loo_delete"): 0.0}
    v = _run(means)
    assert v["answer"] == "undecidable" and "do not agree with each other above chance" in v["undecidable"]
    assert v["headline"].startswith("On m, whether attention tracks causal importance cannot be decided")


def _profile(**kw):
    base = dict(method="loo_delete", n_examples=N, max_abs=0.5, eps=1.19e-7, scale=0.9, at_floor=(), all_zero=False,
                top1_share=0.3, top2_share=0.5)
    return decide.ReferenceProfile(**{**base, **kw})


def test_an_output_that_ignores_the_input_and_effects_at_the_noise_floor_are_undecidable():
    zero = _run(profile=_profile(max_abs=0.0, all_zero=True))
    assert zero["answer"] == "undecidable" and "does not depend on the input" in zero["undecidable"]
    noise = _run(profile=_profile(max_abs=1e-8, at_floor=tuple(range(N))))
    assert noise["answer"] == "undecidable" and "noise floor" in noise["undecidable"] and "16 x eps" in noise["undecidable"]
    assert _run(profile=_profile())["answer"] == "yes"


def test_too_few_examples_are_undecidable():
    study = _study()
    agreement = _agreement(GOOD)
    few = agreement[agreement.example < decide.MIN_EXAMPLES - 1]
    v = _verdict(few, summary_table(few, study), study, "m")[0]
    assert v["answer"] == "undecidable" and "too few scored examples" in v["undecidable"]


def _tables(scores_by_example: list[list[float]], target: float = 0.9) -> dict:
    scores, tokens = [], []
    for e, values in enumerate(scores_by_example):
        for p, s in enumerate(values):
            scores.append({"example": e, "method": "loo_delete", "layer": -1, "head": -1, "position": p, "score": s})
            tokens.append({"example": e, "position": p, "scored": True})
    examples = pd.DataFrame({"example": range(len(scores_by_example)), "target_value": target})
    return {"scores": pd.DataFrame(scores), "tokens": pd.DataFrame(tokens), "examples": examples}


def test_profile_floor_concentration_and_the_auto_measure():
    sparse = decide.reference_profile(_tables([[0.8, 1e-4, -2e-4, 0], [1e-5, 0.7, 1e-4, 0], [1e-9, 0, 0, 0]]),
                                      "loo_delete", "fp32")
    assert sparse.at_floor == (2,)  # 1e-9 is below 16 x eps x 0.9
    assert sparse.floor == pytest.approx(16 * np.finfo(np.float32).eps * 0.9)
    assert sparse.top1_share > 0.99
    # an example whose largest effect is under 1% of the study's large effects has no token that matters
    small = decide.reference_profile(_tables([[0.8, 0.1, 0], [0.7, 0.2, 0], [1e-4, 5e-5, 0]]), "loo_delete", "fp32")
    # 90th percentile of 0.7, 0.8 and 1e-4: 0.78
    assert small.small == (2,) and small.at_floor == () and small.effect_floor == pytest.approx(0.01 * 0.78, rel=1e-6)
    assert decide.choose_measure("auto", sparse, ["kendall_tau", "top1", "top3"])[0] == "top1"
    assert "top two tokens" in decide.concentration_warning("kendall_tau", sparse)
    pair = decide.reference_profile(_tables([[0.5, 0.5, 1e-3, 0], [0.4, 1e-3, 0.45, 0]]), "loo_delete", "fp32")
    assert decide.choose_measure("auto", pair, ["kendall_tau", "top1", "top3"])[0] == "top3"
    spread = decide.reference_profile(_tables([[0.3, 0.2, -0.25, 0.1, 0.2]]), "loo_delete", "fp32")
    assert decide.choose_measure("auto", spread, ["kendall_tau", "top1"])[0] == "kendall_tau"
    assert decide.concentration_warning("kendall_tau", spread) is None
    assert decide.choose_measure("spearman", sparse, [])[0] == "spearman"  # an explicit choice is kept


def test_pairs_with_a_reference_at_its_floor_are_left_out_with_the_reason():
    agreement = _agreement(GOOD)
    profile = _profile(at_floor=(0, 1))
    kept, left = decide.without_noise(agreement, {"loo_delete": profile})
    assert set(kept[kept.reference == "loo_delete"].example) == set(range(2, N))
    assert set(left.reason) == {"reference at the noise floor"} and set(left.example) == {0, 1}


def test_measure_is_validated():
    from probe.errors import InputError

    with pytest.raises(InputError, match="top5 is not computed"):
        _study(measure="top5")
    with pytest.raises(InputError, match="is not a measure"):
        _study(measure="tau")
    assert _study(measure="top1").statistics.measure == "top1"


def test_nothing_compared_at_all_is_undecidable_not_an_error():
    study = _study()
    empty = _agreement(GOOD).iloc[0:0]
    v = _verdict(empty, summary_table(empty, study), study, "m", profile=_profile(max_abs=0.0, all_zero=True))[0]
    assert v["answer"] == "undecidable" and v["families"] == {} and v["best_gradient"] is None


def test_the_verdict_is_whole_when_built_and_its_table_has_a_row_per_family():
    from probe.study.sanity import Check
    from probe.study.verdict import Verdict

    study = _study()
    agreement = _agreement(GOOD)
    check = Check(method="rollout", check="randomisation", status="fail", value=0.99, detail="unchanged")
    groups = [{"description": "attention_mean L0 = alti L0", "units": ["attention_mean L0", "alti L0"]}]
    v, _ = _verdict(agreement, summary_table(agreement, study), study, "m", unreliable={"rollout": ["randomisation"]},
                   sanity=[check], redundant=groups)
    assert list(v)[-5:] == ["headline", "sanity", "unreliable", "unreliable_units", "redundant"]
    assert v["sanity"] == [check.to_dict()] and v["redundant"] == groups
    assert v["headline"].endswith("rollout (randomisation). Identical rankings: attention_mean L0 = alti L0.")
    decided = Verdict.from_dict(v)
    assert decided.to_dict() == v and decided.to_dict() is not decided.data
    table = decided.to_pandas()
    assert list(table.family) == list(v["families"]) == ["attention weights", "attention-derived", "context mixing"]
    derived = table.set_index("family").loc["attention-derived"]
    # rollout failed its check
    assert derived.answer == "no" and derived.layer_tracking == 0 and derived.layer_total == 1
    weights = table.set_index("family").loc["attention weights"]
    assert weights.best_layer == "attention_mean L0" and weights.layer_tracking == 1
    assert weights.best_layer_mean == pytest.approx(v["families"]["attention weights"]["best_layer"]["mean"])
    assert weights.best_head is None and np.isnan(weights.best_head_mean)  # this study has no single heads
    empty = Verdict.from_dict({**v, "families": {}}).to_pandas()
    assert not len(empty) and "best_head_mean" in empty.columns


def test_a_signed_mixing_matrix_that_ranks_tokens_in_reverse_is_named_never_counted():
    """A token mixer's implicit matrix is signed: a unit far below the random ranking carries the
    ranking reversed. The verdict names it in a warning (only for a mixer: softmax attention is
    non-negative, there it is just a bad ranking) and never counts it as tracking."""
    means = {**GOOD, ("explainer", "attention_mean", "loo_delete"): -0.5}
    study = _study()
    agreement = _agreement(means)
    summary = summary_table(agreement, study)
    mixer = _verdict(agreement, summary, study, "m", mixing="its mixing matrix (implicit attention)")[0]
    assert mixer["families"]["attention weights"]["answer"] == "no"
    assert mixer["headline"].startswith("On m, its mixing matrix (implicit attention) does not track")
    (warning,) = [w for w in mixer["warnings"] if "reverse" in w]
    assert "1 unit(s)" in warning and "attention_mean L0 -0.5" in warning
    softmax = _verdict(agreement, summary, study, "m")[0]
    assert not [w for w in softmax["warnings"] if "reverse" in w]
    assert softmax["headline"].startswith("On m, attention does not track")


def test_a_unit_that_failed_its_own_check_never_tracks_and_only_that_unit():
    study = _study()
    agreement = _agreement(GOOD)
    v = _verdict(agreement, summary_table(agreement, study), study, "m",
                 unreliable_units={("attention_mean", 0, -1): ["randomisation"]})[0]
    assert v["families"]["attention weights"]["answer"] == "no"
    assert v["families"]["context mixing"]["answer"] == "yes"  # alti L0, the same layer, is not touched
    assert v["unreliable_units"] == {"attention_mean L0": ["randomisation"]} and v["unreliable"] == {}
    assert "Failed randomisation as units" in v["headline"] and "attention_mean L0" in v["headline"]


def test_rule_1_is_the_family_wise_p_value_never_the_random_ranking():
    """A unit far above a random ranking that happened to score 0 everywhere (its CI [0, 0]) does not
    pass when its own permutation test says chance; one below that line passes when its test says so."""
    study = _study()
    agreement = _agreement(GOOD)
    summary = summary_table(agreement, study)
    chance = _chance(summary)
    chance.loc[chance.explainer == "attention_mean", ["p_chance", "p_family"]] = [0.01, 0.2]
    v = verdict(agreement, summary, study, "m", chance=chance)[0]
    assert v["families"]["attention weights"]["answer"] == "no" and not v["best_layers"][0]["tracks"]
    assert v["best_layers"][0]["p_family"] == 0.2
    chance.loc[chance.explainer == "attention_mean", ["p_chance", "p_family"]] = [0.001, 0.01]
    assert verdict(agreement, summary, study, "m", chance=chance)[0]["answer"] == "yes"
    with pytest.raises(ValueError, match="chance tests"):
        verdict(agreement, summary, study, "m")


# Rule 2 on evidence (probe.study.power): a unit tracks only when it is shown within the margin of the
# gradient bar; shown worse it does not; where the study cannot tell, the answer is undecidable with n
# and the n that would decide.

def _means(attention: float, gradient: float) -> dict:
    return {("explainer", "attention_mean", "loo_delete"): attention, ("explainer", "rollout", "loo_delete"): 0.1,
            ("explainer", "alti", "loo_delete"): 0.1, ("explainer", "saliency", "loo_delete"): gradient,
            ("explainer", "input_x_gradient", "loo_delete"): gradient - 0.05,
            ("baseline", "random", "loo_delete"): 0.0, ("ceiling", "loo_mask", "loo_delete"): 0.8}


def _noisy(means: dict, sd: float, seed: int = 0) -> pd.DataFrame:
    """Like :func:`_agreement`, with per-example noise ``sd`` on every unit (so the paired
    differences vary)."""
    rng = np.random.default_rng(seed)
    frame = _agreement(means, seed)
    frame["kendall_tau"] = np.clip(frame["kendall_tau"] + rng.normal(0, sd, len(frame)), -1, 1)
    frame["top1"] = frame["kendall_tau"]
    return frame


def summary_mean(v: dict, explainer: str) -> float:
    return float(v["best_gradient"]["mean"]) if v["best_gradient"]["explainer"] == explainer else float("nan")


def _judge(agreement: pd.DataFrame, unreliable=None, **statistics):
    study = _study(measure="kendall_tau", **statistics)
    return _verdict(agreement, summary_table(agreement, study), study, "m", unreliable=unreliable)


def test_rule_2_passes_only_when_shown_within_the_margin_of_the_bar():
    v, paired = _judge(_agreement(_means(0.6, 0.62)))
    row = paired[paired.unit == "attention_mean L0"].iloc[0]
    assert row.margin == pytest.approx(0.2 * (summary_mean(v, "saliency") - v["random"]["mean"]))
    assert row.rule2 == "not worse" and row.rule2_low > -row.margin and row.tracks
    assert v["answer"] == "yes" and v["n"] == N and v["margin_share"] == 0.2
    assert v["gradient_bar"]["margin"] == pytest.approx(row.margin)
    worse, paired = _judge(_agreement(_means(0.3, 0.6)))
    row = paired[paired.unit == "attention_mean L0"].iloc[0]
    assert row.rule2 == "worse" and row.rule2_high < -row.margin and row.below_gradient and not row.tracks
    assert worse["answer"] == "no"


def test_a_unit_the_study_cannot_compare_with_gradients_makes_the_answer_undecidable_with_n():
    v, paired = _judge(_noisy(_means(0.5, 0.6), sd=0.25))
    row = paired[paired.unit == "attention_mean L0"].iloc[0]
    assert row.rule2_low < -row.margin < row.rule2_high and row.rule2 == "undecided"
    assert row.above_chance and row.undecided and not row.tracks
    assert row.n_needed > N
    assert v["answer"] == "undecidable" and v["n"] == N and v["n_needed"] == row.n_needed
    assert v["undecidable"].startswith(f"too few examples to compare with gradients: n = {N}; about ")
    assert f"n = {N} scored examples" in v["headline"]
    # a gap well beyond the margin at the same n is decided: shown worse than the bar
    big = _judge(_noisy(_means(0.3, 0.7), sd=0.25, seed=1))[0]
    assert big["answer"] == "no"


def test_a_smaller_margin_is_harder_to_pass():
    assert _judge(_agreement(_means(0.56, 0.6)))[0]["answer"] == "yes"
    assert _judge(_agreement(_means(0.56, 0.6)), margin=0.02)[0]["answer"] != "yes"


def test_the_margin_is_a_share_of_the_bars_lead_over_chance():
    from probe.study.power import margin_of

    assert margin_of(0.37, 0.0, 0.2) == pytest.approx(0.074)
    assert margin_of(0.83, 0.08, 0.2) == pytest.approx(0.15)
    assert margin_of(0.05, 0.1, 0.2) == 0.0  # a bar not above chance: only a unit shown better passes
    v, _ = _judge(_agreement(_means(0.3, -0.2)))  # the best gradient ranks against the reference
    assert v["gradient_bar"]["margin"] == 0.0
    assert "is not above the random ranking: no margin, a unit must be shown above it" in v["gradient_bar"]["text"]
    assert "of its lead over the random ranking" not in v["headline"]


def test_without_a_gradient_that_passed_its_checks_the_answer_says_what_was_not_compared():
    failed = {"saliency": ["randomisation"], "input_x_gradient": ["sign"]}
    v, paired = _judge(_agreement(_means(0.6, 0.6)), unreliable=failed)
    assert set(paired.rule2) == {"not compared"}
    assert v["answer"] == "undecidable" and v["undecidable"].startswith("not compared with gradients")
    study = study_from_dict({**_study().model_dump(mode="json"), "explainers": ["attention_mean", "rollout", "alti"]}) \
        if hasattr(_study(), "model_dump") else None
    if study is not None:
        agreement = _agreement({k: m for k, m in _means(0.6, 0.6).items() if k[1] not in ("saliency", "input_x_gradient")})
        none, paired = _verdict(agreement, summary_table(agreement, study), study, "m")
        assert set(paired.rule2) == {"not applied"} and none["answer"] == "yes"
        assert "Rule 2 not applied: no gradient explainer in the study" in none["headline"]


def test_n_needed_is_the_sample_size_at_which_the_rule_decides_with_the_stated_power():
    from probe.metrics.statistics import paired_bootstrap_ci
    from probe.study.power import N_NEEDED_CAP, n_needed, rule2_state

    rng = np.random.default_rng(0)
    z = rng.normal(0, 1, 15)
    d = -0.05 + 0.2 * (z - z.mean()) / z.std(ddof=1)  # mean -0.05, sd 0.2 exactly
    need = n_needed(d, margin=0.1, alpha=0.05)
    assert need == int(np.ceil(((1.644854 + 0.841621) * 0.2 / 0.05) ** 2))  # 99
    decided = 0
    for i in range(60):  # at about n_needed examples, about POWER (0.8) of studies decide "not worse"
        d = np.random.default_rng(100 + i).normal(-0.05, 0.2, 99)
        low, high = paired_bootstrap_ci(d, np.zeros_like(d), n_boot=500, level=0.9, seed=i)
        decided += rule2_state(low, high, 0.1) == "not worse"
    assert 0.6 <= decided / 60 <= 0.95
    assert n_needed(np.array([-0.2, 0.0, -0.1]), margin=0.1, alpha=0.05) > N_NEEDED_CAP  # at the margin: never


def test_a_reference_its_own_pair_check_distrusts_makes_the_answer_undecidable_naming_shapley():
    found = {"pairs": 40, "examples": 40,
             "substitutes": {"examples": list(range(39)), "strongest": {"example": 0, "tokens": ["zz", "zz"],
                                                                         "joint": -0.9, "singles": [0.0, 0.0]}},
             "complements": {"examples": [], "strongest": None}}
    why = decide.undecidable_reason(None, 40, None, 0.05, found)
    assert why is None  # no reference profile: nothing to name
    why = decide.misjudged_reason(found, "loo_delete")
    assert "39 of the 40 examples" in why and "statistics.reference: shapley" in why
    complements = {**found, "substitutes": {"examples": [], "strongest": None},
                   "complements": found["substitutes"]}
    assert decide.misjudged_reason(complements, "loo_delete") is None  # named in the warning, deciding nothing
    assert decide.misjudged_reason(found, "shapley") is None
    few = {**found, "substitutes": {**found["substitutes"], "examples": list(range(10))}}
    assert decide.misjudged_reason(few, "loo_delete") is None
