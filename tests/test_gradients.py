"""Gradient explainers (saliency, input x gradient, IG, GradientSHAP) and word aggregation.

Tiny random models of every kind for the properties, the MiniLM weights shipped in a package (with
a random classifier head, which is fine for these properties) for one real-model check of each.
"""

from __future__ import annotations

import math

import pytest
import torch

from probe.errors import InputError
from probe.explainers import gradients as G
from probe.explainers import integrated_gradients as IG
from probe.explainers.words import (
    aggregate,
    groups_from_prefixes,
    word_groups,
    word_scores,
)
from probe.models.loading import load_model
from probe.rows.forward import build_rows
from probe.rows.prepare import prepare
from probe.rows.scores import TokenScores
from probe.rows.target import TargetSpec
from probe.rows.values import evaluate, target_values

from tiny_models import TINY_KINDS
from tolerances import (
    assert_fp_close,
    fp_close,
    fp_tol,
    gradient_term_scales,
    model_depth,
)

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]
MINILM_TEXTS = ["an unbelievably wonderful film", "a dull mess",
                "the acting is superb but the plot drags on"]
FAST = {"integrated_gradients": {"steps": 8}, "gradient_shap": {"n_samples": 4}}



def _completeness_slack(pm, scores, fx, fb):
    """The fp32 rounding a convergence delta carries on top of the method's own error: that of the
    terms it is the difference of (sum |score|, |f(x)|, |f(baseline)|) after a forward and backward
    pass (tolerances.py). A method tolerance is a fraction of |f(x) - f(baseline)| plus this, never a
    fixed floor: the gaps of the tiny classifiers are ~3e-3, where a floor of 1 would let any delta pass."""
    return fp_tol(float(scores.abs().sum()) + abs(fx) + abs(fb), depth=model_depth(pm, backward=True))


def _by_hand(pm, examples):
    """d target / d word embeddings with plain autograd (no captum, no probe forward): [rows, seq, dim]."""
    batch = build_rows(pm, [(e.input_ids, e) for e in examples])
    inputs = dict(batch.inputs)
    embeds = pm.model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_()
    with torch.enable_grad():
        values = target_values(pm, batch, pm.model(inputs_embeds=embeds, **inputs).logits)
        (grad,) = torch.autograd.grad(values.sum(), embeds)
    return embeds.detach(), grad


def _assert_matches_autograd(pm, examples):
    embeds, grad = _by_hand(pm, examples)
    sal = G.saliency(pm, examples, site="word")  # the oracle differentiates the word embeddings
    signed = G.saliency_sum(pm, examples, site="word")
    ixg = G.input_x_gradient(pm, examples, site="word")
    depth = model_depth(pm, backward=True)
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        g, x = grad[i, :n], embeds[i, :n]  # [tokens, dim]
        # fp32 rounding of a forward and backward pass: with the weights frozen (probe's passes) autograd
        # may order the backward's sums differently from this oracle's (seen: 4.7e-6 relative on tiny t5).
        # The signed sums are rounded at the scale of their terms (|g_d|, |x_d g_d|), not of the sum,
        # which LayerNorm drives to ~0 (tolerances.py)
        assert_fp_close(sal.scores[i], g.norm(dim=-1), depth=depth, msg=f"saliency #{i}")
        assert_fp_close(signed.scores[i], g.sum(dim=-1), depth=depth, scale=float(g.abs().sum(-1).max()),
                        msg=f"saliency_sum #{i}")
        assert_fp_close(ixg.scores[i], (x * g).sum(dim=-1), depth=depth, scale=float((x * g).abs().sum(-1).max()),
                        msg=f"input_x_gradient #{i}")


# ---------------------------------------------------------------------------
# the forward function
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_forward_over_embeddings_equals_evaluate(loaded, kind):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    problem = G.embedding_forward(pm, examples)
    assert problem.embeds.shape == (3, max(len(e.input_ids) for e in examples), pm.model.get_input_embeddings().weight.shape[1])
    expected = evaluate(pm, [(e.input_ids, e) for e in examples])
    assert_fp_close(IG._values(problem, problem.embeds), expected, depth=model_depth(pm))  # target values, one forward


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_padding_and_continuation_positions_are_inert(loaded, kind):
    """Whatever sits in the attributed tensor beyond a row's explained tokens (padding, and for a
    causal LM the continuation) never reaches the model, so its gradient and attribution are 0."""
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    problem = G.embedding_forward(pm, examples)
    outside = ~problem.mask  # [rows, width]
    assert outside.any()  # "bad film" is padded
    noisy = problem.embeds + torch.randn_like(problem.embeds) * outside[..., None] * 10
    torch.testing.assert_close(IG._values(problem, noisy), IG._values(problem, problem.embeds), atol=0, rtol=0)
    grads, _ = G._gradients(pm, examples, times_input=False)  # [rows, width, dim]
    assert torch.count_nonzero(grads[outside]) == 0
    ig = IG.integrated_gradients(pm, examples, steps=4)
    assert [len(s) for s in ig.scores] == [len(e.input_ids) for e in examples]
    assert all(torch.isfinite(s).all() for s in ig.scores)


def test_causal_continuation_is_held_fixed(loaded):
    """The continuation is in the model input but not attributed: IG from a baseline that replaces
    only the prompt is complete (sum of prompt attributions = f(x) - f(baseline prompt + continuation))."""
    pm = loaded("gpt2")
    examples = prepare(pm, ["the cat sat on the", "hello"], TargetSpec(continuation="mat . the dog"))
    assert len(examples[0].target_ids) == 4
    problem = G.embedding_forward(pm, examples)
    seq = problem.fixed.shape[1]
    # the continuation but its last token is fed: no target reads the logits after it
    assert seq == len(examples[0].input_ids) + 3 and problem.embeds.shape[1] == len(examples[0].input_ids)
    assert not problem.explained[0, len(examples[0].input_ids):].any()
    ig = IG.integrated_gradients(pm, examples, steps=64)
    assert [len(s) for s in ig.scores] == [5, 1]
    for scores, delta, fx, fb in zip(ig.scores, ig.extras["convergence_delta"], ig.extras["target_value"],
                                     ig.extras["baseline_value"]):
        assert abs(delta) <= 1e-3 * abs(fx - fb) + _completeness_slack(pm, scores, fx, fb), (delta, fx - fb)


# ---------------------------------------------------------------------------
# gradients equal a hand computation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_saliency_and_input_x_gradient_equal_autograd(loaded, kind):
    pm = loaded(kind)
    _assert_matches_autograd(pm, prepare(pm, TEXTS))


def test_saliency_and_input_x_gradient_equal_autograd_on_minilm(minilm):
    _assert_matches_autograd(minilm, prepare(minilm, MINILM_TEXTS))


def test_params_record_the_choices(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    sal = G.saliency(pm, examples, site="word")
    assert sal.method == "saliency" and sal.params["reduction"].startswith("l2 norm")
    assert sal.params["space"] == "word_embeddings" and "position" in sal.params["space_note"]
    assert sal.params["site"] == "word" and G.saliency(pm, examples).params["site"] == "embeddings"
    assert "Jain" in G.input_x_gradient(pm, examples).params["note"]
    ig = IG.integrated_gradients(pm, examples, steps=4, baseline="unk")
    assert ig.params["baseline"] == "unk" and ig.params["steps"] == 4 and ig.params["rule"] == "gausslegendre"
    assert len(ig.extras["convergence_delta"]) == 3


# ---------------------------------------------------------------------------
# batch of 1 == batch of N
# ---------------------------------------------------------------------------


def _assert_batch_invariant(pm, examples, method, **params):
    """Batch of 1 against batch of N: the same arithmetic in another order, so fp32 rounding of a forward
    and backward pass (tolerances.py) at the scale of what was summed. Scores: one tolerance per example
    from the largest magnitude of its scores and of their per-dim terms (scores reach ~5-10 on the tiny
    T5, signed sums over the embedding dim cancel, so rtol per element would not do). The convergence
    delta, sum of scores - (f(x) - f(baseline)), is a difference of terms ~30x larger than itself (its
    error is theirs): scale sum |score| + |f(x)| + |f(baseline)|."""
    together = G.gradient_scores(pm, examples, method, **params)
    terms = gradient_term_scales(pm, examples, method, **params)
    depth = model_depth(pm, backward=True)
    for i, example in enumerate(examples):
        alone = G.gradient_scores(pm, [example], method, **params)
        assert_fp_close(alone.scores[0], together.scores[i], depth=depth, scale=terms[i], msg=f"{method} #{i}")
        if "convergence_delta" in together.extras:
            extras = together.extras
            scale = float(together.scores[i].abs().sum()) + abs(extras["target_value"][i]) + abs(extras["baseline_value"][i])
            assert fp_close(alone.extras["convergence_delta"][0], extras["convergence_delta"][i], depth=depth, scale=scale), \
                (method, i, alone.extras["convergence_delta"][0], extras["convergence_delta"][i], scale)


@pytest.mark.parametrize("method", G.GRADIENT_METHODS)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_batch_of_one_equals_batch_of_n(loaded, kind, method):
    pm = loaded(kind)
    _assert_batch_invariant(pm, prepare(pm, TEXTS), method, **FAST.get(method, {}))


def test_batch_of_one_equals_batch_of_n_on_minilm(minilm):
    examples = prepare(minilm, MINILM_TEXTS[:2])
    for method in G.GRADIENT_METHODS:
        _assert_batch_invariant(minilm, examples, method, **FAST.get(method, {}))


def test_ig_internal_batching_does_not_change_results(loaded):
    pm = loaded("llama_gqa")
    examples = prepare(pm, TEXTS)
    whole = IG.integrated_gradients(pm, examples, steps=10, internal_batch_size=None)
    chunked = IG.integrated_gradients(pm, examples, steps=10, internal_batch_size=7)  # 1 step per chunk
    terms = gradient_term_scales(pm, examples, "integrated_gradients", steps=10)
    for a, b, scale in zip(whole.scores, chunked.scores, terms):
        assert_fp_close(a, b, depth=model_depth(pm, backward=True), scale=scale)


# ---------------------------------------------------------------------------
# integrated gradients: completeness and baselines
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_ig_completeness_on_tiny_models(loaded, kind):
    """From the unk embedding (non-zero in every tiny model; see the next test for zero)."""
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    ig = IG.integrated_gradients(pm, examples, steps=100, baseline="unk")
    for i, example in enumerate(examples):
        fx, fb = ig.extras["target_value"][i], ig.extras["baseline_value"][i]
        # f(x) over the embeddings against prepare's forward over ids: one forward each
        assert fp_close(fx, example.original_value, depth=model_depth(pm)), (fx, example.original_value)
        # the delta summed again here, in double, from the fp32 scores (one reduction, at their scale)
        recomputed = float(ig.scores[i].double().sum()) - (fx - fb)
        scale = float(ig.scores[i].abs().sum()) + abs(fx) + abs(fb)
        assert fp_close(recomputed, ig.extras["convergence_delta"][i], depth=1, scale=scale), (recomputed, scale)
        # measured: |delta| / |gap| <= 8.3e-3 (tiny t5); bert's gap is 3e-3
        delta = ig.extras["convergence_delta"][i]
        assert abs(delta) <= 0.02 * abs(fx - fb) + _completeness_slack(pm, ig.scores[i], fx, fb), (kind, i, delta, fx - fb)


def test_ig_from_a_zero_pad_row_on_rmsnorm_model_needs_many_steps(loaded):
    """Llama's pad row is zero (padding_idx) and RMSNorm is scale-invariant, so f jumps close to the
    baseline: 50 steps leave a large delta that 400 steps remove. The delta is what tells."""
    pm = loaded("llama_gqa")
    examples = prepare(pm, ["bad film"])
    few = IG.integrated_gradients(pm, examples, steps=50)
    many = IG.integrated_gradients(pm, examples, steps=400)
    assert few.params["baseline_norm"] == 0.0
    gap = abs(many.extras["target_value"][0] - many.extras["baseline_value"][0])
    assert abs(few.extras["convergence_delta"][0]) > 0.1 * gap
    assert abs(many.extras["convergence_delta"][0]) < 1e-3 * gap


def test_ig_completeness_converges_on_minilm(minilm):
    examples = prepare(minilm, MINILM_TEXTS[:2], TargetSpec(kind="logit"))
    coarse = IG.integrated_gradients(minilm, examples, steps=10)
    fine = IG.integrated_gradients(minilm, examples, steps=200)
    for i in range(len(examples)):
        gap = fine.extras["target_value"][i] - fine.extras["baseline_value"][i]
        # completeness computed here, independently of the extras
        fx, fb = fine.extras["target_value"][i], fine.extras["baseline_value"][i]
        assert abs(float(fine.scores[i].sum()) - gap) <= 1e-3 * abs(gap) + _completeness_slack(minilm, fine.scores[i], fx, fb)
        assert abs(fine.extras["convergence_delta"][i]) < abs(coarse.extras["convergence_delta"][i])


@pytest.mark.parametrize("baseline", IG.BASELINES)
def test_ig_baselines(loaded, baseline):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    # from zero at the embeddings output IG needs more steps (the completeness check says how many)
    ig = IG.integrated_gradients(pm, examples, steps=32, baseline=baseline, site="word")
    assert ig.params["baseline"] == baseline
    for i, delta in enumerate(ig.extras["convergence_delta"]):
        fx, fb = ig.extras["target_value"][i], ig.extras["baseline_value"][i]
        assert abs(delta) <= 0.02 * abs(fx - fb) + _completeness_slack(pm, ig.scores[i], fx, fb), (baseline, i, delta)


def test_ig_baseline_the_tokenizer_lacks_is_a_user_error(loaded):
    pm = loaded("gpt2")  # no [MASK]
    with pytest.raises(InputError, match="mask.*zero"):
        IG.integrated_gradients(pm, prepare(pm, TEXTS), baseline="mask", steps=2)
    with pytest.raises(InputError, match="pad, zero, mask, unk"):
        IG.integrated_gradients(pm, prepare(pm, TEXTS), baseline="blank", steps=2)
    with pytest.raises(InputError, match="saliency"):
        G.gradient_scores(pm, prepare(pm, TEXTS), "deeplift")


def test_ig_baseline_keeping_special_tokens_gives_them_zero(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    ig = IG.integrated_gradients(pm, examples, steps=16, keep_special=True)
    for example, scores in zip(examples, ig.scores):
        special = torch.tensor(example.special)
        assert special.any() and torch.count_nonzero(scores[special]) == 0
        assert torch.count_nonzero(scores[~special]) > 0


# ---------------------------------------------------------------------------
# GradientSHAP, dtype, eval mode
# ---------------------------------------------------------------------------


def test_gradient_shap_is_seeded(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    a = IG.gradient_shap(pm, examples, n_samples=4, seed=1)
    b = IG.gradient_shap(pm, examples, n_samples=4, seed=1)
    c = IG.gradient_shap(pm, examples, n_samples=4, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))
    assert not all(torch.equal(x, y) for x, y in zip(a.scores, c.scores))
    assert a.params["seed"] == 1 and a.params["n_samples"] == 4


def test_gradient_shap_without_noise_approaches_ig(loaded):
    """With one baseline and no noise GradientSHAP is IG with random alphas: many samples agree."""
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:1])
    shap = IG.gradient_shap(pm, examples, n_samples=400, noise=0.0, internal_batch_size=None)
    ig = IG.integrated_gradients(pm, examples, steps=50)
    scale = float(ig.scores[0].abs().max())
    assert float((shap.scores[0] - ig.scores[0]).abs().max()) <= 0.15 * scale


def test_bf16_model_gives_fp32_scores(loaded):
    pm = loaded("bert", dtype="bf16")
    examples = prepare(pm, TEXTS)
    for method in G.GRADIENT_METHODS:
        scores = G.gradient_scores(pm, examples, method, **FAST.get(method, {}))
        assert scores.params["model_dtype"] == "bfloat16" and scores.params["gradient_dtype"] == "float32"
        assert all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in scores.scores), method


def test_runs_in_eval_mode_and_restores_the_mode(minilm):
    """MiniLM has dropout 0.1: a result taken in training mode would differ from call to call."""
    examples = prepare(minilm, MINILM_TEXTS[:2])
    expected = G.saliency(minilm, examples)
    minilm.model.train()
    try:
        again = G.saliency(minilm, examples)
        assert minilm.model.training
    finally:
        minilm.model.eval()
    for a, b in zip(expected.scores, again.scores):
        assert_fp_close(a, b, depth=model_depth(minilm, backward=True))  # L2 norms: their own scale


def test_parameters_are_left_out_of_the_graph_and_their_flags_restored(loaded, monkeypatch):
    """Gradient passes hold the parameters' requires_grad off (no weight gradients are read): the
    scores equal a model whose parameters require gradients, every flag is as it was after the call
    (one the caller had turned off stays off), and no parameter is left with a .grad."""
    pm = loaded("bert")
    examples = prepare(pm, TEXTS)
    parameters = list(pm.model.parameters())
    by_hand = parameters[0]
    by_hand.requires_grad_(False)
    seen = []
    handle = pm.model.register_forward_pre_hook(lambda *_: seen.append(any(p.requires_grad for p in parameters)))
    try:
        ig = IG.integrated_gradients(pm, examples, steps=8)
        saliency = G.saliency(pm, examples)
        assert [p.requires_grad for p in parameters] == [False] + [True] * (len(parameters) - 1)
        assert all(p.grad is None for p in parameters)
        assert False in seen  # the differentiated passes ran with every parameter's flag off
    finally:
        handle.remove()
        by_hand.requires_grad_(True)
    # the same scores from an autograd graph that includes the parameters
    from probe.rows.queries import eval_mode

    for module in (G, IG):  # the modules that call it with inputs_only=True
        monkeypatch.setattr(module, "eval_mode", lambda model, *, grad=None, inputs_only=False: eval_mode(model, grad=grad))
    ig_plain, saliency_plain = IG.integrated_gradients(pm, examples, steps=8), G.saliency(pm, examples)
    monkeypatch.undo()
    depth = model_depth(pm, backward=True)
    terms = gradient_term_scales(pm, examples, "integrated_gradients", steps=8)  # IG sums signed per-dim terms
    for a, b, scale in zip(ig.scores, ig_plain.scores, terms):
        assert_fp_close(a, b, depth=depth, scale=scale)
    for a, b in zip(saliency.scores, saliency_plain.scores):
        assert_fp_close(a, b, depth=depth)


# ---------------------------------------------------------------------------
# words
# ---------------------------------------------------------------------------


def _assert_partition(groups, n):
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(g == sorted(g) and g == list(range(g[0], g[-1] + 1)) for g in groups)  # contiguous


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_word_groups_cover_every_token_once_on_tiny_models(loaded, kind):
    pm = loaded(kind)
    for example in prepare(pm, TEXTS):
        groups = word_groups(pm, example)
        _assert_partition(groups, len(example.input_ids))
        assert len(groups) == len(example.input_ids)  # word-level vocabularies: one token per word


def test_wordpiece_pieces_join_their_word_on_minilm(minilm):
    example = prepare(minilm, ["An unbelievably interdependent film, don't you think?"])[0]
    groups = word_groups(minilm, example)
    _assert_partition(groups, len(example.input_ids))
    words = [[example.tokens[i] for i in g] for g in groups]
    assert ["un", "##bel", "##ie", "##va", "##bly"] in words
    assert ["inter", "##de", "##pen", "##dent"] in words
    assert words[0] == ["[CLS]"] and words[-1] == ["[SEP]"]
    assert all(not t.startswith("##") for g in words for t in g[:1])  # no word starts with a piece
    # a perturbed row (ids no longer those of the text) falls back to the "##" convention
    keep = [i for i, t in enumerate(example.tokens) if t != "film"]
    perturbed = type(example)(text=example.text, input_ids=[example.input_ids[i] for i in keep],
                              special=[example.special[i] for i in keep], tokens=[example.tokens[i] for i in keep],
                              kind=example.kind)
    fallback = [[perturbed.tokens[i] for i in g] for g in word_groups(minilm, perturbed)]
    assert fallback == [w for w in words if w != ["film"]]


def test_groups_from_prefixes_conventions():
    bpe = ["The", "Ġunbelie", "v", "ably", "Ġfilm", ",", "Ġ", "<|endoftext|>"]
    assert groups_from_prefixes(bpe, [False] * 7 + [True]) == [[0], [1, 2, 3], [4, 5], [6], [7]]
    sp = ["<s>", "▁inter", "depend", "ent", "▁film"]
    assert groups_from_prefixes(sp, [True] + [False] * 4) == [[0], [1, 2, 3], [4]]
    wp = ["[CLS]", "##x", "play", "##ing", "[SEP]", "##y"]  # a piece never joins a special token
    assert groups_from_prefixes(wp, [True, False, False, False, True, False]) == [[0], [1], [2, 3], [4], [5]]
    assert groups_from_prefixes(["a", "b"]) == [[0], [1]]


def test_aggregate_tokens_and_heads():
    groups = [[0], [1, 2, 3], [4]]
    scores = torch.tensor([1.0, 2.0, -3.0, 4.0, 5.0])
    # small integers: every sum and mean here is exact in fp32
    torch.testing.assert_close(aggregate(scores, groups, "sum"), torch.tensor([1.0, 3.0, 5.0]), atol=0, rtol=0)
    torch.testing.assert_close(aggregate(scores, groups, "max"), torch.tensor([1.0, 4.0, 5.0]), atol=0, rtol=0)
    torch.testing.assert_close(aggregate(scores, groups, "mean"), torch.tensor([1.0, 1.0, 5.0]), atol=0, rtol=0)
    per_head = torch.randn(2, 3, 5)  # [layer, head, tokens]
    folded = aggregate(per_head, groups, "sum")
    assert folded.shape == (2, 3, 3)
    # sums of 3 and 5 terms in another order: one reduction, at the scale of its terms
    assert_fp_close(folded[..., 1], per_head[..., 1:4].sum(-1), depth=1, scale=float(per_head.abs().sum(-1).max()))
    # a sum keeps the total
    assert_fp_close(folded.sum(-1), per_head.sum(-1), depth=1, scale=float(per_head.abs().sum(-1).max()))


def test_aggregate_is_nan_aware():
    groups = [[0, 1], [2, 3]]
    scores = torch.tensor([float("nan"), 2.0, float("nan"), float("nan")])
    for how, expected in (("sum", 2.0), ("max", 2.0), ("mean", 2.0)):
        out = aggregate(scores, groups, how)
        assert out[0].item() == expected and math.isnan(out[1].item()), how


def test_aggregate_refuses_bad_groups():
    with pytest.raises(InputError, match="exactly once"):
        aggregate(torch.zeros(3), [[0], [0, 1]])
    with pytest.raises(InputError, match="exactly once"):
        aggregate(torch.zeros(3), [[0], [1]])
    with pytest.raises(InputError, match="sum, max, mean"):
        aggregate(torch.zeros(2), [[0], [1]], "median")


def test_word_scores_fold_a_whole_result(minilm):
    examples = prepare(minilm, MINILM_TEXTS[:2])
    tokens = G.input_x_gradient(minilm, examples)
    words = word_scores(minilm, examples, tokens, how="sum")
    assert isinstance(words, TokenScores) and words.params["word_aggregation"] == "sum"
    assert words.extras["words"][0][:3] == ["[CLS]", "an", "unbelievably"]
    assert words.extras["word_special"][0][0] and not words.extras["word_special"][0][1]
    for t, w in zip(tokens.scores, words.scores):
        # the same fp32 numbers summed in two groupings (one reduction), at the scale of the terms
        assert fp_close(float(t.sum()), float(w.sum()), depth=1, scale=float(t.abs().sum()))


# ---------------------------------------------------------------------------
# the fine-tuned built-in (only where a colleague's build already sits in the cache)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_ig_on_the_fine_tuned_builtin(builtin_cache):
    pm = load_model("builtin:minilm-rt", cache_dir=str(builtin_cache))
    examples = prepare(pm, ["a gorgeous , witty , seductive movie .", "the plot is a dull , lifeless mess ."])
    ig = IG.integrated_gradients(pm, examples, steps=100)
    for i, delta in enumerate(ig.extras["convergence_delta"]):
        fx, fb = ig.extras["target_value"][i], ig.extras["baseline_value"][i]
        assert abs(delta) <= 1e-2 * abs(fx - fb) + _completeness_slack(pm, ig.scores[i], fx, fb), (i, delta, fx - fb)
    _assert_batch_invariant(pm, examples, "saliency")


@pytest.mark.parametrize("method", ["rollout", "integrated_gradients"])
def test_out_of_memory_in_an_explainer_halves_the_examples(loaded, method, simulated_oom):
    """An explainer that runs out of memory is rerun on each half of its examples: the scores and
    per-example extras equal an uninterrupted run, in order, each example once."""
    from probe.methods import run_method

    pm = loaded("llama_gqa")
    examples = prepare(pm, ["the movie was good and fun", "bad film , not fun at all", "i loved the acting"])
    params = {"steps": 8} if method == "integrated_gradients" else {}
    expected = run_method(pm, examples, method, params=params)
    with simulated_oom(pm, lambda call, _: call == 1) as calls:  # the first model call fails
        got = run_method(pm, examples, method, params=params)
    assert calls["failed"] == 1 and calls["calls"] > 2
    assert len(got.scores) == len(examples)
    # each half is a smaller batch of the same rows: batch of 1 against N (see _assert_batch_invariant)
    depth = model_depth(pm, backward=method == "integrated_gradients")
    terms = (gradient_term_scales(pm, examples, method, **params) if method == "integrated_gradients"
             else [0.0] * len(examples))  # rollout: rows of attention distributions, their own scale (<= 1)
    for a, b, scale in zip(got.scores, expected.scores, terms):
        assert_fp_close(a, b, depth=depth, scale=scale)
    for key, value in expected.extras.items():
        if isinstance(value, list):  # IG's delta, f(x), f(baseline): at the scale of f and the scores
            for i, (x, y) in enumerate(zip(got.extras[key], value)):
                scale = float(expected.scores[i].abs().sum()) + abs(expected.extras["target_value"][i]) + \
                    abs(expected.extras["baseline_value"][i])
                assert fp_close(x, y, depth=depth, scale=scale), (key, i, x, y)


OOM_TEXTS = ["the movie was good and fun", "bad film , not fun at all", "i loved the acting", "slow plot",
             "a great story with wonderful acting", "i hated this film , it was boring", "the cast sparkles",
             "too long and too slow", "an utterly compelling film", "dull", "a masterpiece", "it is fun",
             "the plot is a mess", "witty and warm", "not worth it", "a gorgeous movie"]


def test_out_of_memory_settles_the_examples_per_call_of_a_method(loaded, simulated_oom):
    """A method whose calls run out of memory over X examples: the first call that does is halved,
    the examples after it are cut at the most that ran (<= X, recorded in the engine's stats), and a
    later run with the same engine starts there: the same scores as an uninterrupted run, each
    example once, in order, and 3 errors in all (retrying every half would raise 7, and 7 again)."""
    from probe.intervene.engine import Engine
    from probe.methods import run_method

    pm = loaded("llama_gqa")
    examples = prepare(pm, OOM_TEXTS)
    expected = run_method(pm, examples, "rollout")
    engine = Engine(pm)
    limit = 2
    with simulated_oom(pm, lambda _, ids: ids is not None and ids.shape[0] > limit) as calls:
        got = run_method(pm, examples, "rollout", engine=engine)
    assert len(got.scores) == len(examples) and calls["calls"] - calls["failed"] == len(examples) // limit
    for a, b in zip(got.scores, expected.scores):  # rows of attention distributions: their own scale (<= 1)
        assert_fp_close(a, b, depth=model_depth(pm))
    assert engine.stats.examples_per_call_used == {"rollout": limit}
    assert calls["failed"] == 3 == engine.stats.oom_splits  # 16, 8 and 4 examples; then 2 at a time
    with simulated_oom(pm, lambda _, ids: ids is not None and ids.shape[0] > limit) as later:
        again = run_method(pm, examples, "rollout", engine=engine)
    assert later["failed"] == 0 and later["calls"] == len(examples) // limit
    assert all(torch.equal(a, b) for a, b in zip(again.scores, got.scores))
