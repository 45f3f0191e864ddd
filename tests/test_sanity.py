"""Sanity checks (probe.study.sanity): degeneracy, IG completeness, cascading randomisation,
redundancy; each can fail, and each says why when it cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import probe.explainers.gradient_forward as GF
import probe.explainers.integrated_gradients as IG
from probe.explainers import gradients as G
from probe.names import describe_group
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec
from probe.study import randomisation as R
from probe.study import replay as P
from probe.study import sanity as S
from probe.study import weights as W

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]


def test_degeneracy_fires_at_word_site_on_bert_only(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    word = {c.method: c for c in S.degeneracy(pm, examples, ["input_x_gradient", "saliency_sum"],
                                               params={"input_x_gradient": {"site": "word"},
                                                       "saliency_sum": {"site": "word"}})}
    assert word["input_x_gradient"].status == "fail" and word["input_x_gradient"].value < 1e-5
    assert word["saliency_sum"].status == "fail"
    module = {c.method: c for c in S.degeneracy(pm, examples, ["input_x_gradient", "saliency_sum"])}
    assert module["input_x_gradient"].status == "pass" and module["input_x_gradient"].value > 1e-3
    assert module["saliency_sum"].status == "pass"


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_degeneracy_silent_without_norm_before_first_layer(loaded, kind):
    """No norm before the first layer: input x gradient is not scale-degenerate. The signed gradient
    sum still is on GPT-2: every path from its input meets a LayerNorm (ln_1 of each layer, ln_f at
    the end of the residual stream), whose mean subtraction makes the model invariant to adding a
    constant to every coordinate; Llama's RMSNorm subtracts no mean."""
    pm = loaded(kind)
    examples = prepare(pm, TEXTS[:2], TargetSpec())
    checks = S.degeneracy(pm, examples, ["input_x_gradient", "saliency_sum"])
    assert [c.status for c in checks] == ["pass", "fail" if kind == "gpt2" else "pass"]


def test_degeneracy_on_missing_site_is_not_run(loaded):
    pm = loaded("gpt2")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    (check,) = S.degeneracy(pm, examples, ["input_x_gradient"], params={"input_x_gradient": {"site": "embeddings"}})
    assert check.status == "not run" and "transformer.wte" in check.detail


def test_constant_scores():
    flat = S.constant_scores("m", [torch.zeros(4), torch.full((3,), 2.0)], [[True] * 4, [True] * 3])
    assert flat.status == "fail"
    varied = S.constant_scores("m", [torch.zeros(4), torch.arange(3.0)], [[True] * 4, [True] * 3])
    assert varied.status == "pass" and varied.value == 0.5


def test_completeness_reports_steps_needed(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:2], TargetSpec())
    coarse = IG.integrated_gradients(pm, examples, steps=2, rule="riemann_left")
    check = S.completeness(pm, examples, coarse, params={"rule": "riemann_left"})
    assert check.status == "fail" and "steps bring it under" in check.detail
    fine = IG.integrated_gradients(pm, examples, steps=64)
    assert S.completeness(pm, examples, fine).status == "pass"


def _whole_sample_search(pm, examples, steps: int, **kwargs) -> int | None:
    """The completeness search as it ran before issue 64: every example of the sample at every try."""
    trial = steps
    while trial * 2 <= S.MAX_STEPS:
        trial *= 2
        again = S._relative_delta(IG.integrated_gradients(pm, examples, steps=trial, **kwargs))
        if again is not None and again <= S.COMPLETENESS_TOLERANCE:
            return trial
    return None


def test_completeness_search_gives_the_whole_samples_answer_on_fewer_examples(loaded, monkeypatch):
    """Issue 64: the search for the points that would do reran IG on every sampled example at every try
    (SmolLM2: 32 + 64 + 128 + 256 points on each, minutes). A try's median is decided by a few
    examples; the rest are not run. The answer is the one the whole sample gives, and where every try
    fails far off, each try runs 2 of the 4 examples: the rows with gradients count it."""
    from probe.study.batch import ForwardCounter

    pm = loaded("bert")
    examples = prepare(pm, [*TEXTS, "an utterly forgettable film"], TargetSpec())
    coarse = IG.integrated_gradients(pm, examples, steps=2, rule="riemann_left")
    check = S.completeness(pm, examples, coarse, params={"rule": "riemann_left"})
    needed = _whole_sample_search(pm, examples, 2, rule="riemann_left")
    assert needed is not None and check.status == "fail" and f"; {needed} steps bring it under" in check.detail
    monkeypatch.setattr(S, "COMPLETENESS_TOLERANCE", 1e-12)  # no try passes
    monkeypatch.setattr(S, "MAX_STEPS", 32)
    counter = ForwardCounter(pm.model)
    try:
        never = S.completeness(pm, examples, coarse, params={"rule": "riemann_left"})
    finally:
        counter.close()
    assert never.status == "fail" and "still above 1e-12 at 32 steps" in never.detail
    assert counter.backward_rows == 2 * (4 + 8 + 16 + 32)  # the whole sample: 4 * (4 + 8 + 16 + 32)


def test_a_tries_median_decided_early_is_the_whole_samples_median():
    """The rule of probe.study.completeness on many random samples (values about the tolerance, some
    undefined gaps, NaN): the points it finds are the whole sample's, and it never runs an example twice
    in one try."""
    from types import SimpleNamespace

    from probe.study.completeness import decided, decisive_count, examples_to_decide, search_steps

    assert decided([], 4, 0.05) is None and decided([1.0, 1.0], 2, 0.05) is False
    assert decided([0.01] * 3, 1, 0.05) is None and decided([0.01] * 3, 0, 0.05) is True  # an unknown may be NaN
    assert decided([float("nan")], 3, 0.05) is False
    assert [decisive_count([], n, 0.05) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert examples_to_decide([27.0, 30.0, 1.0, 0.01], 0.05) == 2 and examples_to_decide([0.01] * 4, 0.05) == 4
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 8))
        table = {steps: rng.choice([0.01, 0.04, 0.05, 0.06, 0.2, 3.0, float("nan")], size=n,
                                   p=[0.2, 0.2, 0.1, 0.15, 0.15, 0.15, 0.05]) for steps in (2, 4, 8, 16, 32)}
        gaps = np.where(rng.random(n) < 0.15, 0.0, 1.0)
        ran: list[int] = []

        def scores(indices, steps, table=table, gaps=gaps, ran=ran):
            ran.append(len(indices))
            return SimpleNamespace(extras={"convergence_delta": [table[steps][i] * gaps[i] for i in indices],
                                           "target_value": [gaps[i] for i in indices],
                                           "baseline_value": [0.0] * len(indices)})

        found, _ = search_steps(scores, scores(list(range(n)), 2), 2, tolerance=0.05, max_steps=32)
        ok = gaps > 0
        whole = next((s for s in (4, 8, 16, 32) if ok.any() and np.median(table[s][ok]) <= 0.05), None)
        assert found == whole
        assert sum(ran[1:]) <= 4 * int(ok.sum())


def test_randomisation_falls_for_gradients_and_stays_flat_for_position(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    before = {n: p.detach().clone() for n, p in pm.model.named_parameters()}
    scorers = {"input_x_gradient": lambda pm, ex: G.input_x_gradient(pm, ex).scores,
               "position": lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]}
    checks = {c.method: c for c in R.randomisation(pm, examples, scorers, seed=0, fractions=(0.5, 1.0))}
    assert checks["position"].status == "fail" and checks["position"].value == pytest.approx(1.0)
    assert all(rho == pytest.approx(1.0) for _, rho in checks["position"].curve)
    curve = checks["input_x_gradient"].curve  # 2 layers: trained (0, 1), the head (0, .), (0.5, .), (1, .)
    assert [frac for frac, _ in curve] == [0.0, 0.0, 0.5, 1.0]
    assert curve[-1][1] < 0.5
    for name, value in pm.model.named_parameters():  # trained weights restored
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def _counted_input_x_gradient(calls: list) -> object:
    """Input x gradient as a randomisation check's scorer, appending to ``calls`` at each run."""
    def scorer(pm, ex):
        calls.append(1)
        return G.input_x_gradient(pm, ex).scores
    return scorer


def test_randomisation_takes_the_trained_scores_it_is_given(loaded):
    """A study already has each method's scores on the trained model: passed in, the scorer runs
    only on the randomised models, and the checks are the same as when it runs them itself."""
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    calls = []
    scorer = _counted_input_x_gradient(calls)

    alone = R.randomisation(pm, examples, {"input_x_gradient": scorer}, seed=0, fractions=(0.5, 1.0))
    steps = 3 * R.RANDOM_DRAWS  # the head, half, all layers; each drawn RANDOM_DRAWS times
    assert len(calls) == 1 + steps  # and the trained model once
    given = R.randomisation(pm, examples, {"input_x_gradient": scorer}, seed=0, fractions=(0.5, 1.0),
                            trained_scores={"input_x_gradient": G.input_x_gradient(pm, examples).scores})
    assert len(calls) == 1 + 2 * steps and given == alone
    shifted = R.randomisation(pm, examples, {"input_x_gradient": scorer}, seed=0, fractions=(0.5, 1.0),
                              trained_scores={"input_x_gradient": [torch.arange(len(e.input_ids), dtype=torch.float32)
                                                                   for e in examples]})
    assert shifted[0].curve != alone[0].curve  # the given scores are the ones compared


def test_the_judged_stage_alone_answers_as_the_whole_cascade(loaded):
    """By default the cascade draws only the stage it is judged at (issue 63): a third of the
    randomised models, and every check's answer, value and words as the whole cascade gives them,
    with the head re-initialised at that stage though the head-alone stage is not drawn."""
    from probe.methods import run_method

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    calls = []
    scorer = _counted_input_x_gradient(calls)

    scorers = {"input_x_gradient": scorer,
               "position": lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]}
    reference = ("loo_delete", lambda pm, ex: run_method(pm, ex, "loo_delete"))
    judged = R.randomisation(pm, examples, scorers, seed=0, reference=reference)
    assert len(calls) == 1 + R.RANDOM_DRAWS
    whole = R.randomisation(pm, examples, scorers, seed=0, reference=reference, fractions=(0.5, 1.0))
    assert len(calls) == 2 + 4 * R.RANDOM_DRAWS
    assert [c.method for c in judged] == [c.method for c in whole] == ["loo_delete", "input_x_gradient", "position"]
    for one, all_ in zip(judged, whole):
        assert (one.status, one.value, one.detail) == (all_.status, all_.value, all_.detail)
        assert one.curve == (all_.curve[0], all_.curve[2])  # the trained model, the head and half the layers
    assert "once the head and the top half of the layers are random" in judged[1].detail


def test_randomisation_cascades_from_the_head_and_restores_it(loaded):
    """The classifier and pooler are the cascade's first step (Adebayo et al. go from the logits
    down): the output moves at that step though no layer changed, and every weight comes back."""
    from probe.methods import run_method

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    layers = W.layer_stack(pm.model, pm.contract.n_layers)
    head = dict(W.head_parameters(pm.model, layers))
    assert any(n.startswith("classifier") for n in head) and any("pooler" in n for n in head)
    assert not any(p is pm.model.get_input_embeddings().weight for p in head.values())
    before = {n: p.detach().clone() for n, p in pm.model.named_parameters()}
    reference = ("loo_delete", lambda pm, ex: run_method(pm, ex, "loo_delete"))
    checks = {c.method: c for c in R.randomisation(pm, examples, {"position": lambda pm, ex: [
        torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]}, seed=0, reference=reference,
        fractions=(0.5, 1.0))}
    ref = checks["loo_delete"]
    assert ref.status == "pass" and ref.curve[1][1] < 0.9  # the head alone moved the reference's ranking
    assert "the target moved by" in ref.detail
    assert checks["position"].status == "fail"  # the reference changed, the position ranking did not
    for name, value in pm.model.named_parameters():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_randomisation_that_leaves_the_reference_unchanged_is_not_informative(loaded):
    """Where re-initialising does not change the reference's own ranking, a flat explainer curve
    says nothing about the explainer: not informative, which is no failure."""
    from types import SimpleNamespace

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    position = lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]  # noqa: E731
    fixed = ("loo_delete", lambda pm, ex: SimpleNamespace(scores=position(pm, ex), extras={"original_values": [0.5] * len(ex)}))
    checks = {c.method: c for c in R.randomisation(pm, examples, {"position": position}, seed=0, reference=fixed)}
    assert checks["loo_delete"].status == "not informative"
    assert checks["position"].status == "not informative" and "not informative" in checks["position"].detail
    assert S.failed_methods(list(checks.values())) == {}


def test_sign_check_flags_an_inverted_explainer():
    reference = [torch.tensor([0.9, 0.01, -0.02, 0.0]), torch.tensor([0.0, -0.5, 0.05, 0.01])]
    scored = [[True, True, True, False], [True, True, True, True]]
    same = S.sign_check("input_x_gradient", [r * 2 for r in reference], reference, scored)
    inverted = S.sign_check("input_x_gradient", [-r for r in reference], reference, scored)
    assert same.status == "pass" and same.value == pytest.approx(1.0)
    assert inverted.status == "fail" and inverted.value == pytest.approx(0.0) and "inverted" in inverted.detail
    # only the big effects' signs count: flipping the small ones leaves the check passing
    small = [torch.tensor([0.9, -0.01, 0.02, 0.0]), torch.tensor([0.0, -0.5, -0.05, 0.01])]
    assert S.sign_check("x", small, reference, scored).status == "pass"
    zero = S.sign_check("x", reference, [torch.zeros(4), torch.zeros(4)], scored)
    assert zero.status == "not run"


def test_randomisation_without_layers_is_not_run(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    contract = pm.contract
    fake = type("P", (), {"model": pm.model, "contract": type("C", (), {"n_layers": 99})()})()
    (check,) = R.randomisation(fake, examples, {"x": lambda pm, ex: [torch.zeros(3)]})
    assert check.status == "not run" and "99 layers" in check.detail
    assert contract.n_layers != 99


def test_redundancy_finds_a_constructed_duplicate():
    rng = np.random.default_rng(0)
    base = [rng.normal(size=n) for n in (5, 7, 4, 9)]
    rankings = {"attention_mean L0": base, "flow L1": [2 * b + 1 for b in base], "flow L2": [b ** 3 for b in base],
                "rollout L1": [rng.normal(size=len(b)) for b in base]}
    groups = S.redundancy_groups(rankings)
    assert groups == [["attention_mean L0", "flow L1", "flow L2"]]
    assert describe_group(groups[0]) == "attention_mean L0 = flow L1-L2"
    assert describe_group(["flow L1", "flow L2", "flow L3", "flow L5", "attention_mean L0"]) == \
        "flow L1-L3,L5 = attention_mean L0"


def _cli(*args, timeout=600):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_probe_explain_sums_up_checks_and_takes_a_site(tiny_dirs):
    proc = _cli("explain", str(tiny_dirs["bert"]), "the movie was good", "--methods",
                "saliency_sum,input_x_gradient,integrated_gradients", "--site", "word", "--steps", "16")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sanity ")]
    assert len(lines) == 3
    assert any(line.startswith("sanity saliency_sum: FAILED degeneracy") for line in lines)
    assert any(line.startswith("sanity input_x_gradient: FAILED degeneracy") for line in lines)
    proc = _cli("explain", str(tiny_dirs["bert"]), "the movie was good", "--methods", "input_x_gradient", "--json")
    data = json.loads(proc.stdout)
    assert data["params"]["input_x_gradient"]["site"] == "embeddings"
    assert [c["status"] for c in data["sanity"] if c["check"] == "degeneracy"] == ["pass"]


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_probe_explain_bad_sites_are_one_line(tiny_dirs):
    proc = _cli("explain", str(tiny_dirs["bert"]), "good", "--site", "layer3")
    assert proc.returncode != 0 and "unknown gradient site 'layer3'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = _cli("explain", str(tiny_dirs["gpt2"]), "good", "--site", "embeddings")
    assert proc.returncode != 0 and "transformer.wte" in proc.stderr and "Traceback" not in proc.stderr


def test_randomisation_on_the_builtin_llama(builtin_cache):
    """Real model (SmolLM2, 30 layers): input x gradient's curve falls, a position ranking stays at 1;
    no norm inside an embeddings module, so the default site is word and nothing is degenerate."""
    from probe.models.loading import load_model

    pm = load_model("builtin:smollm2-135m")
    assert GF.default_site(pm) == "word"
    examples = prepare(pm, ["The movie was wonderful. Sentiment:", "A dull and tedious film. Sentiment:"],
                       TargetSpec(continuation=" positive"))
    assert [c.status for c in S.degeneracy(pm, examples, ["input_x_gradient", "saliency_sum"])] == ["pass", "pass"]
    scorers = {"input_x_gradient": lambda pm, ex: G.input_x_gradient(pm, ex).scores,
               "position": lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]}
    checks = {c.method: c for c in R.randomisation(pm, examples, scorers, fractions=(0.5,))}
    assert checks["input_x_gradient"].status == "pass" and checks["input_x_gradient"].value < 0.5
    assert checks["position"].status == "fail"


def test_each_unit_of_a_bottom_up_method_is_asked_about_the_weights_it_is_computed_from(loaded):
    """Per-unit randomisation (issue 40 item 5): attention_mean's units depend on the weights and pass;
    a per-layer 'method' whose scores are the positions (no weight makes them) stays put while the
    reference moves: every one of its units fails, alone (the method itself is not marked unreliable,
    its units are); two methods with identical rankings get identical answers; the model comes back."""
    from probe.methods import run_method

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    before = {k: v.clone() for k, v in pm.model.state_dict().items()}
    n_layers = pm.contract.n_layers
    attention = lambda pm, ex: run_method(pm, ex, "attention_mean").scores  # noqa: E731
    positional = lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32).repeat(n_layers, 1)  # noqa: E731
                                 for e in ex]
    reference = ("loo_delete", lambda pm, ex: run_method(pm, ex, "loo_delete"))
    checks = R.unit_randomisation(pm, examples, {"attention_mean": attention, "twin": attention, "positional": positional},
                                  seed=0, reference=reference)
    by = {(c.method, c.layer): c for c in checks if c.unit is not None}
    ref = [c for c in checks if c.method == "loo_delete"]
    assert ref and ref[0].status == "pass" and ref[0].value < R.RANDOMISATION_LIMIT
    for layer in range(n_layers):
        assert by[("positional", layer)].status == "fail" and by[("positional", layer)].value == pytest.approx(1.0)
        assert by[("attention_mean", layer)].status == "pass"
        assert by[("twin", layer)].status == by[("attention_mean", layer)].status
        assert by[("twin", layer)].value == by[("attention_mean", layer)].value
        assert f"layers 0..{layer}" in by[("attention_mean", layer)].detail
    assert S.failed_methods(checks) == {}
    assert set(S.failed_units(checks)) == {("positional", layer, -1) for layer in range(n_layers)}
    for name, value in pm.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(torch.nan_to_num(x, nan=7.5), torch.nan_to_num(y, nan=7.5)) and
               torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["bert", "bart", "t5", "gpt2"])
def test_the_replayed_reference_is_the_computed_one(loaded, kind):
    """ReferenceRuns replays the layers below the re-initialised ones from the trained run instead of
    computing them: on every model of the cascade the reference's scores are those computed in full,
    bit for bit, and the randomisation checks (values, curves, details) are the same; the trained run
    is made once for both randomisation checks. A causal LM's leave-one-out runs with a cache (prefix
    reuse): nothing of it is kept, and every run is computed."""
    from probe.methods import run_method

    pm = loaded(kind)
    examples = prepare(pm, TEXTS, TargetSpec())
    calls = []

    def loo(pm, ex):
        calls.append(1)
        return run_method(pm, ex, "loo_delete")

    layers = W.layer_stack(pm.model, pm.contract.n_layers)
    replayed = P.ReferenceRuns(pm, examples, "loo_delete", loo)
    computed = P.ReferenceRuns(pm, examples, "loo_delete", loo, replay=False)
    assert _bitwise_equal(replayed.trained().scores, computed.trained().scores)
    std = 0.02
    for count in W.cascade_steps(pm.model, layers, (0.5, 1.0)):
        with W.randomised_top(pm.model, layers, count, seed=3, std=std, head=True) as changed:
            again = replayed.randomised(changed)
            plain = run_method(pm, examples, "loo_delete")
            assert _bitwise_equal(again.scores, plain.scores), count
            assert again.extras["original_values"] == plain.extras["original_values"]
    if kind == "gpt2":
        assert replayed.layers_replayed == 0 and replayed.kept_bytes == 0
    else:  # the head step replays every layer, the half step half of them
        assert replayed.layers_replayed > 0 and replayed.kept_bytes > 0
    assert P.replays_layers(pm) == (replayed.layers_replayed > 0)  # what the plan prices the cascade's runs by
    tight = P.ReferenceRuns(pm, examples, "loo_delete", loo, max_bytes=replayed.kept_bytes // 2)
    assert _bitwise_equal(tight.trained().scores, computed.trained().scores)
    assert tight.kept_bytes <= replayed.kept_bytes // 2  # what does not fit is computed

    position = {"position": lambda pm, ex: [torch.arange(len(e.input_ids), dtype=torch.float32) for e in ex]}
    shared = P.ReferenceRuns(pm, examples, "loo_delete", loo)
    calls.clear()
    fast = (R.unit_randomisation(pm, examples, {}, seed=0, reference=shared, draws=2)
            + R.randomisation(pm, examples, position, seed=0, fractions=(0.5, 1.0), reference=shared, draws=2))
    assert len(calls) == 1 + 2 + 2 * len(W.cascade_steps(pm.model, layers, (0.5, 1.0)))  # one trained run
    slow = (R.unit_randomisation(pm, examples, {}, seed=0, reference=("loo_delete", loo), draws=2)
            + R.randomisation(pm, examples, position, seed=0, fractions=(0.5, 1.0),
                              reference=P.ReferenceRuns(pm, examples, "loo_delete", loo, replay=False), draws=2))
    assert repr([c.to_dict() for c in fast]) == repr([c.to_dict() for c in slow])


def test_the_replay_gives_way_where_a_changed_parameter_runs_before_its_layers(loaded):
    """A re-initialised parameter used before the replayed layers (here the word embeddings) makes
    the call's replay wrong: it is computed in full instead, and nothing is replayed after."""
    from probe.methods import run_method

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    layers = W.layer_stack(pm.model, pm.contract.n_layers)
    runs = P.ReferenceRuns(pm, examples, "loo_delete", lambda pm, ex: run_method(pm, ex, "loo_delete"))
    runs.trained()
    hooks = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in pm.model.named_modules()}
    top = [(n, p) for n, p in layers[-1].named_parameters()]
    params = [("embeddings.word_embeddings.weight", pm.model.get_input_embeddings().weight), *top]
    with W.randomised(params, seed=1, std=0.02):
        again = runs.randomised([p for _, p in params])
        assert _bitwise_equal(again.scores, run_method(pm, examples, "loo_delete").scores)
    assert runs.layers_replayed == 0 and runs.replayed == 1  # the first call gave way, none after
    # no hook and no replaced forward survives the call that gave way (probe's own capture hooks,
    # attached by earlier tests on this shared model, stay as they were)
    assert {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks))
            for name, m in pm.model.named_modules()} == hooks
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_fresh_weights_are_drawn_in_place_with_the_numbers_of_a_separate_draw():
    """The randomised weights are drawn in place where torch gives the same numbers as drawing them
    apart and scaling (float32 on the CPU, 16 elements or more), apart otherwise: the same model
    either way, and the trained one back after."""
    lin = torch.nn.Linear(8, 8)  # 64 elements: in place
    small = torch.nn.Linear(3, 2)  # 6 elements: apart
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    params = [("a.weight", lin.weight), ("a.bias", lin.bias), ("b.weight", small.weight), ("c.weight", half.weight),
              ("norm", torch.nn.Parameter(torch.zeros(4)))]
    before = [p.detach().clone() for _, p in params]
    generator = torch.Generator().manual_seed(9)
    expected = [torch.randn(p.shape, generator=generator) * 0.02 for _, p in params if p.ndim >= 2]
    with W.randomised(params, seed=9, std=0.02):
        assert torch.equal(lin.weight, expected[0]) and torch.equal(small.weight, expected[1])
        assert torch.equal(half.weight, expected[2].to(torch.bfloat16))
        assert torch.equal(lin.bias, torch.zeros(8)) and torch.equal(params[-1][1], torch.ones(4))
    for (_, p), b in zip(params, before):
        assert torch.equal(p, b)


def test_methods_one_gradient_pass_gives_are_made_once_per_randomised_model(loaded):
    """Saliency and input x gradient from one gradient pass per randomised model (issue 63), as the
    study's batches make them: the same checks as one call per method, and one pass per model."""
    from probe.methods import run_method, run_shared_gradients

    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    names = ("saliency", "input_x_gradient")
    passes = []

    def both(pm, ex):
        passes.append(1)
        return {m: r.scores for m, r in run_shared_gradients(pm, ex, list(names)).items()}

    alone = {m: (lambda pm, ex, m=m: run_method(pm, ex, m).scores) for m in names}
    apart = R.randomisation(pm, examples, alone, seed=0, fractions=(0.5, 1.0))
    joined = R.randomisation(pm, examples, alone, seed=0, fractions=(0.5, 1.0), together={names: both})
    assert repr([c.to_dict() for c in joined]) == repr([c.to_dict() for c in apart])
    assert len(passes) == 1 + 3 * R.RANDOM_DRAWS  # the trained model, then each randomised one once
