"""Gradient attribution sites: ``word`` (the word-embedding output) and ``embeddings`` (the output of
the model's embeddings module), the default decided from the model's structure, and the oracle
(plain autograd through a forward hook, no captum, no probe forward) at the embeddings site."""

from __future__ import annotations

import pytest
import torch

import probe.explainers.gradient_forward as GF
import probe.explainers.integrated_gradients as IG
from probe.errors import InputError
from probe.explainers import gradients as G
from probe.rows.forward import build_rows
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec
from probe.rows.values import target_values

from tolerances import assert_fp_close, fp_tol, gradient_term_scales, model_depth

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]
FAST = {"integrated_gradients": {"steps": 8}, "gradient_shap": {"n_samples": 4}}


def _oracle_at_embeddings_output(pm, examples):
    """(e, d target / d e) with e the output of the embeddings module, by plain autograd: [rows, seq, dim]."""
    name, module = GF.embeddings_module(pm.model)
    batch = build_rows(pm, [(e.input_ids, e) for e in examples])
    held = {}

    def keep(mod, args, output):
        output.retain_grad()
        held["e"] = output

    handle = module.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            values = target_values(pm, batch, pm.model(**batch.inputs).logits)
            values.sum().backward()
    finally:
        handle.remove()
    pm.model.zero_grad(set_to_none=True)
    return held["e"].detach(), held["e"].grad.detach()


def _assert_equals_oracle(pm, got, e, grad, n, times_input, msg=None):
    """A signed sum over dim against the oracle's: fp32 rounding of a forward and backward pass at the
    scale of the summed terms (e_d g_d or g_d; the sum itself may cancel, tolerances.py)."""
    terms = e[:n] * grad[:n] if times_input else grad[:n]
    assert_fp_close(got, terms.sum(-1), depth=model_depth(pm, backward=True), scale=float(terms.abs().sum(-1).max()),
                    msg=msg)


def test_default_site_is_detected_from_structure(loaded):
    bert = loaded("bert")
    assert GF.embeddings_module(bert.model)[0].endswith("embeddings")
    assert GF.normalising_module(bert.model) is not None
    assert GF.default_site(bert) == "embeddings"
    for kind in ("gpt2", "llama_gqa", "bart", "t5"):
        pm = loaded(kind)
        assert GF.embeddings_module(pm.model) is None, kind
        assert GF.default_site(pm) == "word", kind


@pytest.mark.parametrize("site", ["word", "embeddings"])
def test_site_recorded_in_params(loaded, site):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:2], TargetSpec())
    for method in G.GRADIENT_METHODS:
        result = G.gradient_scores(pm, examples, method, site=site, **FAST.get(method, {}))
        assert result.params["site"] == site
        assert result.params["site_default"] == "embeddings"
        assert result.params["space"] == GF.SITE_SPACES[site][0]


def test_embeddings_site_equals_oracle_tiny_bert(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    e, grad = _oracle_at_embeddings_output(pm, examples)
    ixg = G.input_x_gradient(pm, examples)  # default site: embeddings
    sal_sum = G.saliency_sum(pm, examples)
    sal = G.saliency(pm, examples)
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        # the L2 norm does not cancel, so it sees a gradient that is off by 1e-3 where the signed sums,
        # ~300x smaller than their terms here, cannot (tolerances.py)
        assert_fp_close(sal.scores[i], grad[i, :n].norm(dim=-1), depth=model_depth(pm, backward=True), msg=f"saliency "
                                                                                                           f"#{i}")
        _assert_equals_oracle(pm, ixg.scores[i], e[i], grad[i], n, True, msg=f"input_x_gradient #{i}")
        _assert_equals_oracle(pm, sal_sum.scores[i], e[i], grad[i], n, False, msg=f"saliency_sum #{i}")


def test_word_site_is_degenerate_on_bert_and_embeddings_is_not(loaded):
    """LayerNorm after the embedding sum: saliency_sum is zero at the word site, not at the embeddings site."""
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    word = G.saliency_sum(pm, examples, site="word")
    module = G.saliency_sum(pm, examples, site="embeddings")
    norms = G.saliency(pm, examples, site="word")
    module_norms = G.saliency(pm, examples, site="embeddings")
    for w, m, s, ms in zip(word.scores, module.scores, norms.scores, module_norms.scores):
        # relative to the gradient's own norm already (a zero up to rounding of terms of that size)
        assert w.abs().max() < 1e-5 * s.max()
        assert m.abs().median() > 1e-3 * ms.median()


@pytest.mark.parametrize("site", ["word", "embeddings"])
def test_sites_batch_of_one_equals_batch_of_n(loaded, site):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    for method in ("input_x_gradient", "integrated_gradients", "gradient_shap"):
        params = {**FAST.get(method, {}), "site": site}
        together = G.gradient_scores(pm, examples, method, **params)
        terms = gradient_term_scales(pm, examples, method, **params)  # signed sums: the scale of their terms
        for i, example in enumerate(examples):
            alone = G.gradient_scores(pm, [example], method, **params)
            assert_fp_close(alone.scores[0], together.scores[i], depth=model_depth(pm, backward=True), scale=terms[i],
                            msg=f"{method} #{i}")


def test_ig_completeness_at_embeddings_site(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    result = IG.integrated_gradients(pm, examples, steps=64)
    extras = result.extras
    for scores, delta, fx, fb in zip(result.scores, extras["convergence_delta"], extras["target_value"],
                                     extras["baseline_value"]):
        # 5% of the gap, plus the fp32 rounding of the terms the delta is the difference of (no fixed floor)
        slack = fp_tol(float(scores.abs().sum()) + abs(fx) + abs(fb), depth=model_depth(pm, backward=True))
        assert abs(delta) <= 0.05 * abs(fx - fb) + slack, (delta, fx - fb)


def test_unknown_site_and_missing_module(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    with pytest.raises(InputError, match="unknown gradient site 'layer0'.*word, embeddings"):
        G.saliency(pm, examples, site="layer0")
    gpt2 = loaded("gpt2")
    examples = prepare(gpt2, TEXTS[:1], TargetSpec())
    with pytest.raises(InputError, match=r"looked for the parent module of the word embeddings \(transformer.wte\)"):
        G.saliency(gpt2, examples, site="embeddings")


def test_builtin_default_site_matches_oracle(builtin_cache):
    """On the real fine-tuned MiniLM: input x gradient at the default site is e . d target / d e with e
    the embeddings module's output, and is far from zero (the word site gives -(position + type) . grad)."""
    from probe.models.loading import load_model

    pm = load_model("builtin:minilm-rt")
    examples = prepare(pm, ["an unbelievably wonderful film", "a dull mess , and far too long"], TargetSpec())
    ixg = G.input_x_gradient(pm, examples)
    assert ixg.params["site"] == "embeddings" and ixg.params["site_module"] == "bert.embeddings"
    e, grad = _oracle_at_embeddings_output(pm, examples)
    word_sum = G.saliency_sum(pm, examples, site="word")
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        oracle = (e[i, :n] * grad[i, :n]).sum(-1)
        _assert_equals_oracle(pm, ixg.scores[i], e[i], grad[i], n, True, msg=f"#{i}")
        assert oracle.abs().median() > 1e3 * word_sum.scores[i].abs().max()


def test_pretrained_minilm_default_site_matches_oracle(minilm):
    """The pretrained MiniLM weights (random head: fine for an equality with the oracle): LayerNorm in
    bert.embeddings makes embeddings the default, input x gradient there equals e . d target / d e, and
    the word site's signed gradient sum vanishes while the embeddings site's does not."""
    pm = minilm
    assert GF.resolve_site(pm).module_name == "bert.embeddings" and GF.normalising_module(pm.model) == "LayerNorm"
    examples = prepare(pm, ["an unbelievably wonderful film", "a dull mess"], TargetSpec())
    e, grad = _oracle_at_embeddings_output(pm, examples)
    ixg = G.input_x_gradient(pm, examples)
    word_sum = G.saliency_sum(pm, examples, site="word")
    word_norm = G.saliency(pm, examples, site="word")
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        _assert_equals_oracle(pm, ixg.scores[i], e[i], grad[i], n, True, msg=f"#{i}")
        assert word_sum.scores[i].abs().max() < 1e-4 * word_norm.scores[i].median()
