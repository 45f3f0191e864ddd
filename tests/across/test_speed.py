"""Issue 18's speed work: width buckets for gradient passes, one gradient shared by saliency and
input x gradient, integrated gradients with ``steps: auto``, and rollout in memory linear in T.

Every speed-up is checked against the plain computation it replaces (oracles: the explainer run on
all examples in one call, each example alone, captum at a fixed number of steps).
"""

from __future__ import annotations

import math

import pytest
import torch

import probe
import probe.explainers.integrated_gradients as IG
import probe.explainers.rollout as RO
from probe import registry
from probe.errors import InputError
from probe.explainers import gradients as G
from probe.rows.prepare import prepare

from tiny_models import TINY_KINDS
from tolerances import (
    assert_fp_close,
    fp_close,
    fp_tol,
    gradient_term_scales,
    model_depth,
)

# widths from 4 to ~40 tokens: buckets are cut between the short and the long ones
TEXTS = ["bad film", "the movie was good and the cast was great , the music too , and the story moved me "
         "from the first scene to the very last one", "not a good movie , but fun", "awful",
         "i loved every minute of it , the acting , the score , the photography , all of it"]


# --------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("label", [None, 0])
def test_prepare_labels_and_values_a_classifier_in_one_forward_per_width_group(minilm, monkeypatch, label):
    """The prediction's logits give the target value: one forward per group of similar widths
    (not a second pass), each example's label and value those of a forward on it alone."""
    from probe.rows import prepare as P
    from probe.rows import target as T
    from probe.study.batch import ForwardCounter

    monkeypatch.setattr(P, "PREPARE_TOKEN_BUDGET", 64)  # the long text gets a group of its own
    counter = ForwardCounter(minilm.model)
    try:
        examples = prepare(minilm, TEXTS, T.TargetSpec(label=label))
    finally:
        counter.close()
    groups = P._width_groups([len(e.input_ids) for e in examples], 64)
    assert 1 < len(groups) < len(TEXTS) and counter.calls == len(groups)
    assert max(len(examples[i].input_ids) for i in groups[-1]) == max(len(e.input_ids) for e in examples)
    for example in examples:
        with torch.no_grad():
            logits = minilm.model(input_ids=torch.tensor([example.input_ids])).logits[0]
        assert example.label == (label if label is not None else int(logits.argmax()))
        # a probability (bounded by 1) from the same logits of MiniLM's random head (|logit| < 1): absolute
        assert example.original_value == pytest.approx(float(logits.softmax(-1)[example.label]), abs=1e-6)
        assert example.label_name == str(minilm.model.config.id2label[example.label])


# --------------------------------------------------------------------------- width buckets


def test_width_buckets_partition_the_examples_by_width(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    widths = [len(e.input_ids) for e in examples]
    buckets = G.width_buckets(pm, examples, points=52)
    assert sorted(i for b in buckets for i in b) == list(range(len(examples)))
    assert all(b == sorted(b) for b in buckets)
    assert len(buckets) > 1  # 50 points of a 4-token example are not padded to 40 tokens
    # groups follow width: every example of a group is no wider than any of the next group
    for a, b in zip(buckets, buckets[1:]):
        assert max(widths[i] for i in a) <= min(widths[i] for i in b)
    # one point per example and tiny widths: one call beats several
    assert len(G.width_buckets(pm, examples[:1] * 3, points=1)) == 1


def test_width_buckets_keep_the_output_tokens_of_a_text_together(loaded):
    """A text's output tokens are one model row between them (one forward per point): a bucket
    holds all of them or none, and the row is counted once, not once per output token."""
    pm = loaded("gpt2")
    examples = probe.prepare(pm, TEXTS, generate=4)
    texts = {e.text for e in examples}
    buckets = G.width_buckets(pm, examples, points=18)
    assert sorted(i for b in buckets for i in b) == list(range(len(examples)))
    for text in texts:
        assert sum(any(examples[i].text == text for i in b) for b in buckets) == 1
    assert len(G.width_buckets(pm, examples, points=1)) == 1


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_bucketed_integrated_gradients_equal_one_call(loaded, kind):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    assert len(G.width_buckets(pm, examples, points=10)) > 1 or kind == "t5"
    bucketed = G.gradient_scores(pm, examples, "integrated_gradients", steps=8)
    whole = IG.integrated_gradients(pm, examples, steps=8)
    # buckets are smaller batches of the same rows: fp32 rounding of a forward and backward pass at the
    # scale of the summed per-dim terms; the extras at that of f and the scores (tolerances.py)
    terms = gradient_term_scales(pm, examples, "integrated_gradients", steps=8)
    depth = model_depth(pm, backward=True)
    for i in range(len(examples)):
        assert_fp_close(bucketed.scores[i], whole.scores[i], depth=depth, scale=terms[i], msg=f"#{i}")
        scale = float(whole.scores[i].abs().sum()) + abs(whole.extras["target_value"][i]) + \
            abs(whole.extras["baseline_value"][i])
        for key in ("convergence_delta", "target_value", "baseline_value"):
            assert fp_close(bucketed.extras[key][i], whole.extras[key][i], depth=depth, scale=scale), (key, i)


# --------------------------------------------------------------------------- one shared gradient


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_shared_gradient_equals_each_method_alone(loaded, kind):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    shared = G.shared_gradient_scores(pm, examples, G.SHARED_GRADIENT_METHODS)
    for method in G.SHARED_GRADIENT_METHODS:
        alone = registry.method(method).load()(pm, examples)
        assert shared[method].params == alone.params
        terms = gradient_term_scales(pm, examples, method)
        for a, b, scale in zip(shared[method].scores, alone.scores, terms):
            assert_fp_close(a, b, depth=model_depth(pm, backward=True), scale=scale, msg=method)


def test_shared_gradient_on_minilm_and_batch_of_one(minilm):
    examples = prepare(minilm, ["an unbelievably wonderful film", "a dull mess",
                                "the acting is superb but the plot drags on and on"])
    shared = G.shared_gradient_scores(minilm, examples, ["saliency", "input_x_gradient"])
    terms = {method: gradient_term_scales(minilm, examples, method) for method in ("saliency", "input_x_gradient")}
    depth = model_depth(minilm, backward=True)
    for i, example in enumerate(examples):
        alone = G.shared_gradient_scores(minilm, [example], ["saliency", "input_x_gradient"])
        for method in ("saliency", "input_x_gradient"):
            assert_fp_close(alone[method].scores[0], shared[method].scores[i], depth=depth, scale=terms[method][i],
                            msg=f"{method} #{i}")
            reference = registry.method(method).load()(minilm, [example]).scores[0]
            assert_fp_close(shared[method].scores[i], reference, depth=depth, scale=terms[method][i],
                            msg=f"{method} #{i}")


def test_shared_gradient_refuses_other_methods(loaded):
    pm = loaded("bert")
    with pytest.raises(InputError, match="integrated_gradients"):
        G.shared_gradient_scores(pm, prepare(pm, TEXTS[:1]), ["saliency", "integrated_gradients"])


# --------------------------------------------------------------------------- steps: auto


def _assert_auto_is_honest(pm, examples, result, tolerance, **params):
    for i, example in enumerate(examples):
        used = result.extras["steps_used"][i]
        history = result.extras["delta_by_steps"][i]
        assert used in IG.AUTO_STEPS and history[-1][0] == used
        assert [h[0] for h in history] == list(IG.AUTO_STEPS[: len(history)])
        delta = result.extras["convergence_delta"][i]
        assert delta == history[-1][1]
        gap = result.extras["target_value"][i] - result.extras["baseline_value"][i]
        ok = abs(delta) <= max(tolerance * abs(gap), IG.AUTO_ABSOLUTE_TOLERANCE)
        assert result.extras["converged"][i] == ok
        # every earlier try missed the tolerance (else it would have stopped there); that try compared
        # with its own gap, which another batch's rounding moves by fp_tol of |f(x)| + |f(baseline)|
        fx, fb = result.extras["target_value"][i], result.extras["baseline_value"][i]
        slack = tolerance * fp_tol(abs(fx) + abs(fb), depth=model_depth(pm))
        for _, earlier in history[:-1]:
            assert abs(earlier) > max(tolerance * abs(gap), IG.AUTO_ABSOLUTE_TOLERANCE) - slack
        # the scores are IG at the steps it settled on, computed alone (independent of the batch)
        fixed = IG.integrated_gradients(pm, [example], steps=used, **params)
        terms = gradient_term_scales(pm, [example], "integrated_gradients", steps=used, **params)[0]
        assert_fp_close(result.scores[i], fixed.scores[0], depth=model_depth(pm, backward=True), scale=terms)


@pytest.mark.parametrize("kind", ["bert", "llama_gqa"])
def test_ig_auto_steps_stop_when_complete(loaded, kind):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    result = G.gradient_scores(pm, examples, "integrated_gradients", steps="auto", tolerance=0.05, baseline="unk")
    assert result.params["steps"] == "auto" and result.params["tolerance"] == 0.05
    _assert_auto_is_honest(pm, examples, result, 0.05, baseline="unk")


def test_ig_auto_steps_on_minilm_converge(minilm):
    examples = prepare(minilm, ["a gorgeous , witty , seductive movie .", "the plot is a dull , lifeless mess ."])
    result = IG.integrated_gradients(minilm, examples, steps="auto", tolerance=0.05)
    assert all(result.extras["converged"])
    _assert_auto_is_honest(minilm, examples, result, 0.05)


def test_ig_auto_steps_raise_the_points_where_the_path_is_hard(loaded):
    """Llama's zero pad row under RMSNorm: 50 points leave > 10% of the gap (see test_gradients);
    auto keeps doubling until the delta is within tolerance, and says where it stopped."""
    pm = loaded("llama_gqa")
    examples = prepare(pm, ["bad film"])
    short = IG.integrated_gradients(pm, examples, steps="auto", max_steps=32)
    assert short.params["max_steps"] == 32 and short.params["auto_steps"] == [16, 32]
    assert short.extras["converged"] == [False] and short.extras["steps_used"] == [32]
    full = IG.integrated_gradients(pm, examples, steps="auto")
    assert full.extras["converged"] == [True] and full.extras["steps_used"][0] >= 64
    _assert_auto_is_honest(pm, examples, full, 0.05)


def test_ig_auto_batch_of_one_equals_batch_of_n(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    together = G.gradient_scores(pm, examples, "integrated_gradients", steps="auto", baseline="unk")
    for i, example in enumerate(examples):
        alone = G.gradient_scores(pm, [example], "integrated_gradients", steps="auto", baseline="unk")
        assert alone.extras["steps_used"][0] == together.extras["steps_used"][i]
        terms = gradient_term_scales(pm, [example], "integrated_gradients", steps=alone.extras["steps_used"][0],
                                     baseline="unk")[0]
        assert_fp_close(alone.scores[0], together.scores[i], depth=model_depth(pm, backward=True), scale=terms)


@pytest.mark.parametrize("params, word", [({"steps": "often"}, "auto"), ({"steps": 0}, "auto"),
                                          ({"steps": "auto", "tolerance": -1}, "tolerance"),
                                          ({"steps": "auto", "max_steps": 8}, "max_steps")])
def test_ig_steps_user_errors(loaded, params, word):
    pm = loaded("bert")
    with pytest.raises(InputError, match=word):
        IG.integrated_gradients(pm, prepare(pm, TEXTS[:1]), **params)


# --------------------------------------------------------------------------- rollout linear in T


@pytest.mark.parametrize("kind", [k for k in TINY_KINDS if k not in ("bart", "t5")])  # seq2seq: the [T, T] path
@pytest.mark.parametrize("block", [1, 3, 256])
def test_row_only_rollout_equals_the_streamed_product(loaded, kind, block):
    """The oracle: the [T, T] product streamed through the layers (the rollout before issue 18),
    on a padded batch, for blocks smaller than, not dividing, and larger than T."""
    from probe.explainers import attention as A

    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    with A.eval_mode(pm.model):
        for batch, tq in A.row_batches(pm, examples, 5):
            streamed, _ = RO.encoder_stream(pm, batch, tq)
            expected = torch.stack(streamed.rows, dim=1)  # [batch, layer, T]
            got = RO._rollout_target_rows(pm, batch, tq, block=block)
            # rows of products of row-stochastic matrices: entries in [0, 1], an absolute tolerance is relative
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_row_only_rollout_on_minilm_is_batch_invariant(minilm):
    from probe.explainers import attention as A

    examples = prepare(minilm, ["an unbelievably wonderful film", "a dull mess"])
    together = RO.rollout(minilm, examples)
    # rollout rows are distributions over the tokens (entries in [0, 1]): absolute tolerances below
    for i, example in enumerate(examples):
        torch.testing.assert_close(RO.rollout(minilm, [example]).scores[0], together.scores[i], atol=1e-5, rtol=0)
        with A.eval_mode(minilm.model):
            (batch, tq), = A.row_batches(minilm, [example], 1)
            streamed, _ = RO.encoder_stream(minilm, batch, tq)
        torch.testing.assert_close(together.scores[i], torch.stack(streamed.rows, dim=1)[0], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- erasure: the first decision flip


def test_first_flip_equals_every_row_run(minilm):
    """The first decision flip the erasure reports equals running every "top j removed"
    row by hand (MiniLM with a random head flips at all depths: early, late, never)."""
    from probe.intervene.engine import Engine
    from probe.intervene.erasure import erasure, random_ranking, ranked_positions

    pm = minilm
    examples = prepare(pm, [TEXTS[1], TEXTS[4], "the acting is superb but the plot drags on and on"])
    ranking = [torch.linspace(1.0, 0.0, len(e.input_ids)) for e in examples]  # left to right
    frame = erasure(Engine(pm), examples, {"left": ranking}, seed=3)
    for name, scores in (("left", ranking), ("random", random_ranking(examples, 3).scores)):
        for i, example in enumerate(examples):
            order = ranked_positions(example, scores[i])
            with torch.no_grad():
                original = int(pm.model(input_ids=torch.tensor([example.input_ids])).logits.argmax(-1))
                labels = []
                for j in range(1, len(order) + 1):
                    kept = [x for s, x in enumerate(example.input_ids) if s not in set(order[:j])]
                    labels.append(int(pm.model(input_ids=torch.tensor([kept])).logits.argmax(-1)))
            changed = [j for j, label in enumerate(labels, start=1) if label != original]
            got = frame[(frame.example == i) & (frame.ranking == name)].flip.iloc[0]
            if changed:
                assert abs(got - changed[0] / len(order)) < 1e-12
            else:
                assert got is None or math.isnan(got)


# --------------------------------------------------------------------------- in a study


def test_study_shares_the_gradient_and_records_ig_steps(tiny_dirs, tmp_path):
    """A study asking for saliency and input x gradient runs one gradient pass for both (one timing
    entry, the same scores as each method alone), and IG steps: auto leaves its delta against
    steps in the convergence table."""
    import pandas as pd

    from probe.models.loading import load_model
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    from test_runner import tiny_study, write_dataset

    data = write_dataset(tmp_path / "data.csv")
    spec = tiny_study(tiny_dirs["bert"], data, tmp_path / "out",
                      explainers=["attention_mean", "saliency", "input_x_gradient", "integrated_gradients"],
                      params={"integrated_gradients": {"steps": "auto", "baseline": "unk"}})
    spec["metrics"] = {"top_k": [1], "erasure": {"rankings": ["saliency"], "bins": [50]}, "counterfactual": None,
                       "heads": None}
    result = run_study(study_from_dict(spec), progress=False, log=lambda _: None)
    assert result.complete
    out = tmp_path / "out"
    info = __import__("json").loads((out / "done" / "b00000.json").read_text())
    assert "saliency+input_x_gradient" in info["timings"] and "saliency" not in info["timings"]
    convergence = pd.read_parquet(out / "convergence.parquet")
    assert set(convergence["steps"]) <= set(IG.AUTO_STEPS)
    assert convergence.groupby("example")["final"].sum().eq(1).all()
    assert convergence["example"].nunique() == 12
    # the report shows delta against steps: a table by number of points and a figure
    from probe.report import analysis as an
    from probe.report.build import build_report
    from probe.report.results import load_result

    table = an.ig_convergence(load_result(out))
    assert table["final"].sum() == 12 and table["tried"].max() == 12
    assert (table["steps"].diff().dropna() > 0).all()
    files = build_report(out, tmp_path / "report")
    assert "completeness by the number of Gauss-Legendre points" in files.markdown.read_text()
    assert any(f.name.startswith("ig_convergence") for f in files.figures)
    # the shared scores equal each method alone
    scores = pd.read_parquet(out / "scores.parquet")
    examples = pd.read_parquet(out / "examples.parquet")
    pm = load_model(str(tiny_dirs["bert"]))
    prepared = prepare(pm, list(examples["text"][:3]))
    for method in ("saliency", "input_x_gradient"):
        alone = registry.method(method).load()(pm, prepared)
        terms = gradient_term_scales(pm, prepared, method)  # the study ran them in other batches
        for i in range(3):
            stored = scores[(scores.method == method) & (scores.example == i)].sort_values("position")["score"]
            assert_fp_close(torch.tensor(stored.to_numpy()), alone.scores[i], depth=model_depth(pm, backward=True),
                            scale=terms[i], msg=f"{method} #{i}")
