"""Habits users bring from captum, inseq and bertviz: probe computes the same numbers once the
defaults are matched, and says where its defaults differ.

- IG: ``keep_special=True`` with the pad baseline is captum's ``LayerIntegratedGradients`` from the
  tutorial reference ``[CLS] [PAD] ... [PAD] [SEP]``; the default (False) is LIG from all-pad.
- saliency: ``saliency`` is the L2 norm over the embedding axis of captum's ``Saliency`` (inseq 0.7's
  ``vnorm`` aggregation), ``saliency_l1`` the L1 norm (captum's tutorials sum the attribution over
  the embedding axis); inseq then divides by the sum over the attributed tokens.
- ``top_tokens`` of a per-head method averages the heads when no head is given, as the HTML table,
  ``matrix`` and the plots do, and says so.
- ``registry.names(family=...)`` takes the README's family names in any spelling.
"""

from __future__ import annotations

import pytest
import torch

from probe import registry
from probe.api import explain
from probe.errors import InputError
from probe.explainers import gradients as G
from probe.explainers import integrated_gradients as IG
from probe.methods import run_method, run_shared_gradients
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tolerances import assert_fp_close, model_depth

TEXTS = ["not a good movie , but fun", "bad film", "the acting was great"]
STEPS = 16


# --------------------------------------------------------------------------- the oracles (captum, by hand)


def _class_prob(pm, label: int):
    """probe's default classifier target (the predicted class's probability) as captum's forward function."""
    def forward(input_ids=None, inputs_embeds=None):
        logits = pm.model(input_ids=input_ids, inputs_embeds=inputs_embeds).logits  # [n, classes]
        return torch.softmax(logits.float(), dim=-1)[:, label]  # [n]
    return forward


def _tutorial_reference(pm, example) -> torch.Tensor:
    """captum's BERT tutorial reference: the text's special tokens kept, every other token [PAD]. [1, tokens]"""
    pad = pm.tokenizer.pad_token_id
    return torch.tensor([[t if special else pad for t, special in zip(example.input_ids, example.special)]])


def _captum_lig(pm, example, layer, *, keep_special: bool, steps: int) -> torch.Tensor:
    """captum LayerIntegratedGradients on ``layer`` from the pad reference, summed over the embedding axis. [tokens]"""
    from captum.attr import LayerIntegratedGradients

    ids = torch.tensor([example.input_ids])  # [1, tokens]
    reference = (_tutorial_reference(pm, example) if keep_special
                 else torch.full_like(ids, pm.tokenizer.pad_token_id))
    lig = LayerIntegratedGradients(_class_prob(pm, example.label), layer)
    pm.model.eval()
    return lig.attribute(ids, baselines=reference, n_steps=steps).sum(dim=-1)[0].detach()


def _captum_saliency(pm, example) -> torch.Tensor:
    """captum Saliency (abs=True, its default) of the word embeddings: [tokens, dim] >= 0."""
    from captum.attr import Saliency

    ids = torch.tensor([example.input_ids])
    embeds = pm.model.get_input_embeddings()(ids).detach()  # [1, tokens, dim]
    forward = _class_prob(pm, example.label)
    pm.model.eval()
    return Saliency(lambda e: forward(inputs_embeds=e)).attribute(embeds.requires_grad_(), abs=True)[0].detach()


def _close(actual, expected, pm, msg):
    """Equal to fp32 rounding after a forward and backward pass, at the scale of the oracle's terms."""
    assert_fp_close(actual, expected, depth=model_depth(pm, backward=True), scale=float(expected.abs().max()), msg=msg)


# --------------------------------------------------------------------------- IG and captum's reference


@pytest.mark.parametrize("site", ["embeddings", "word"])
def test_ig_with_keep_special_is_captums_layer_ig_from_the_tutorial_reference(loaded, site):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    layer = pm.model.bert.embeddings if site == "embeddings" else pm.model.get_input_embeddings()
    kept = IG.integrated_gradients(pm, examples, steps=STEPS, keep_special=True, site=site)
    replaced = IG.integrated_gradients(pm, examples, steps=STEPS, site=site)  # default: keep_special False
    assert kept.params["baseline_keeps_special"] is True and replaced.params["baseline_keeps_special"] is False
    for i, example in enumerate(examples):
        tutorial = _captum_lig(pm, example, layer, keep_special=True, steps=STEPS)
        _close(kept.scores[i], tutorial, pm, f"keep_special=True #{i}")
        _close(replaced.scores[i], _captum_lig(pm, example, layer, keep_special=False, steps=STEPS), pm,
               f"keep_special=False #{i}")
        special = torch.tensor(example.special)
        assert torch.all(kept.scores[i][special] == 0)  # kept at their own embedding: no path, no score
        # the defaults differ where it shows: replacing [CLS]/[SEP] too changes the text tokens' scores
        assert not torch.allclose(replaced.scores[i][~special], tutorial[~special], rtol=1e-3, atol=0)


def test_keep_special_reaches_ig_through_explain(loaded):
    pm = loaded("bert")
    ex = explain(pm, TEXTS[:1], "integrated_gradients",
                 params={"integrated_gradients": {"steps": STEPS, "keep_special": True}})
    example = ex.examples[0]
    _close(ex["integrated_gradients"].scores[0],
           _captum_lig(pm, example, pm.model.bert.embeddings, keep_special=True, steps=STEPS), pm, "explain")


@pytest.mark.slow
def test_ig_keep_special_on_pretrained_minilm_is_captums_tutorial_ig(minilm):
    """The real model: probe's IG with keep_special and 50 steps (captum's default n_steps) is the
    tutorial's LIG on ``bert.embeddings``; the default baseline gives other scores for the text's tokens."""
    examples = prepare(minilm, ["not a good movie", "an unbelievably wonderful film"], TargetSpec())
    kept = IG.integrated_gradients(minilm, examples, keep_special=True)
    replaced = IG.integrated_gradients(minilm, examples)
    assert kept.params["site"] == "embeddings" and kept.params["steps"] == 50
    for i, example in enumerate(examples):
        tutorial = _captum_lig(minilm, example, minilm.model.bert.embeddings, keep_special=True, steps=50)
        _close(kept.scores[i], tutorial, minilm, f"minilm keep_special #{i}")
        special = torch.tensor(example.special)
        assert not torch.allclose(replaced.scores[i][~special], tutorial[~special], rtol=1e-2, atol=0)


# --------------------------------------------------------------------------- saliency norms


def test_saliency_l1_is_registered_beside_saliency_and_shares_its_gradient():
    entry = registry.method("saliency_l1")
    assert (entry.family, entry.group, entry.reduction, entry.signed) == ("gradient", "gradient", "l1", False)
    assert entry.load() is G.saliency_l1
    assert "saliency_l1" in G.SHARED_GRADIENT_METHODS
    assert entry.applies.by_name  # by name only: the default method set does not grow


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_saliency_norms_are_captums_saliency_reduced_over_the_embedding_axis(loaded, kind):
    pm = loaded(kind)
    if kind == "bert":
        examples = prepare(pm, TEXTS, TargetSpec())
        oracle = [_captum_saliency(pm, e) for e in examples]
    else:  # a causal LM: the log-prob of a continuation, its gradient by hand at the word site
        examples = prepare(pm, TEXTS, TargetSpec(continuation=" good"))
        oracle = [_lm_gradient(pm, e).abs() for e in examples]
    l2 = G.saliency(pm, examples, site="word")
    l1 = G.saliency_l1(pm, examples, site="word")
    assert l1.params["reduction"] == "l1 norm over embedding dim"
    for i, grad in enumerate(oracle):
        _close(l2.scores[i], grad.norm(dim=-1), pm, f"L2 #{i}")
        _close(l1.scores[i], grad.sum(dim=-1), pm, f"L1 #{i}")
        assert not torch.allclose(l1.scores[i], l2.scores[i])  # the two norms are different numbers
        assert torch.all(l1.scores[i] >= l2.scores[i])  # |g|_1 >= |g|_2


def _lm_gradient(pm, example) -> torch.Tensor:
    """d log p(continuation | prompt) / d word embeddings of the prompt, plain autograd. [prompt tokens, dim]"""
    n = len(example.input_ids)
    ids = torch.tensor([list(example.input_ids) + list(example.target_ids)])  # [1, seq]
    embeds = pm.model.get_input_embeddings()(ids).detach().requires_grad_()
    pm.model.eval()
    with torch.enable_grad():
        logprobs = torch.log_softmax(pm.model(inputs_embeds=embeds).logits.float(), dim=-1)[0]  # [seq, vocab]
        value = sum(logprobs[n - 1 + k, t] for k, t in enumerate(example.target_ids))
        (grad,) = torch.autograd.grad(value, embeds)
    return grad[0, :n]


def test_saliency_l1_batch_of_one_equals_batch_of_several_and_the_shared_pass(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec())
    together = run_method(pm, examples, "saliency_l1")
    shared = run_shared_gradients(pm, examples, ["saliency", "saliency_l1"])
    for i in range(len(examples)):
        alone = run_method(pm, [examples[i]], "saliency_l1")
        assert_fp_close(together.scores[i], alone.scores[0], depth=model_depth(pm, backward=True), msg=f"#{i}")
        assert torch.equal(shared["saliency_l1"].scores[i], together.scores[i])


@pytest.mark.slow
def test_saliency_norms_on_pretrained_minilm(minilm):
    examples = prepare(minilm, ["not a good movie", "a dull mess"], TargetSpec())
    l2 = G.saliency(minilm, examples, site="word")
    l1 = G.saliency_l1(minilm, examples, site="word")
    for i, example in enumerate(examples):
        grad = _captum_saliency(minilm, example)
        _close(l2.scores[i], grad.norm(dim=-1), minilm, f"minilm L2 #{i}")
        _close(l1.scores[i], grad.sum(dim=-1), minilm, f"minilm L1 #{i}")


def test_inseq_saliency_is_probes_l2_saliency_divided_by_its_sum(loaded, tiny_dirs):
    """inseq's ``saliency`` (captum Saliency, ``vnorm`` aggregation, then each target's column divided by
    its sum) on a causal LM's first output token: probe's ``saliency`` / its sum; the raw granular
    scores' L2 and L1 norms are ``saliency`` and ``saliency_l1`` with ``kind="prob"`` (inseq's default
    attributed function is the probability)."""
    inseq = pytest.importorskip("inseq")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pm = loaded("gpt2")
    ex = explain(pm, ["the movie was"], "saliency,saliency_l1", continuation=" good", kind="prob")
    assert ex["saliency"].params["site"] == "word"
    # inseq wraps (and hooks) the model it is given: its own copy of the same weights
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["gpt2"])
    theirs = inseq.load_model(model, "saliency", tokenizer=AutoTokenizer.from_pretrained(tiny_dirs["gpt2"]))
    out = theirs.attribute("the movie was", "the movie was good", show_progress=False).sequence_attributions[0]
    prompt = len(ex.examples[0].input_ids)
    assert [t.token for t in out.target[:prompt]] == list(ex.examples[0].tokens)
    granular = out.target_attributions[:prompt, 0, :]  # [prompt tokens, dim]: |d p / d e|
    ours_l2, ours_l1 = ex["saliency"].scores[0], ex["saliency_l1"].scores[0]
    _close(ours_l2, granular.norm(dim=-1).float(), pm, "inseq vnorm")
    _close(ours_l1, granular.sum(dim=-1).float(), pm, "inseq L1")
    shown = out.aggregate().target_attributions[:prompt, 0].float()  # what inseq shows
    _close(ours_l2 / ours_l2.sum(), shown, pm, "inseq normalised")


# --------------------------------------------------------------------------- top_tokens and the head mean


def test_top_tokens_of_a_per_head_method_averages_heads_as_the_table_does(loaded):
    from probe.display import unit_row

    pm = loaded("bert")
    ex = explain(pm, TEXTS[:1], "attention")
    values = ex["attention"].scores[0]  # [layer, head, tokens]
    top = ex.top_tokens(3, "attention")  # no head: the mean over heads of the last layer
    mean = values[-1].double().mean(dim=0)
    real = [p for p, s in enumerate(ex.examples[0].special) if not s]
    expected = sorted(real, key=lambda p: -float(mean[p]))[:3]
    assert [p for p, _, _ in top] == expected
    assert [s for _, _, s in top] == pytest.approx([float(mean[p]) for p in expected])
    table, what = unit_row(values.numpy())  # what the HTML table and plot show
    assert what == "last layer, head mean" and [s for _, _, s in top] == pytest.approx([table[p] for p in expected])
    assert top.read_at.endswith("head mean") and "head mean" in repr(top)
    one = ex.top_tokens(3, "attention", head=1)  # a head still picks that head
    assert [s for _, _, s in one] == pytest.approx(sorted((float(values[-1, 1, p]) for p in real), reverse=True)[:3])
    assert one.read_at.endswith("head 1") and "read at" not in repr(one)
    with pytest.raises(InputError, match="head=99 does not exist"):
        ex.top_tokens(3, "attention", head=99)


def test_top_tokens_head_mean_ignores_a_nan_head(loaded):
    pm = loaded("bert")
    ex = explain(pm, TEXTS[:1], "attention")
    values = ex["attention"].scores[0]
    values[-1, 0] = float("nan")  # one head gave no score: the mean is over the others, as the table's
    top = ex.top_tokens(1, "attention")
    assert top[0][2] == pytest.approx(float(values[-1, 1:, top[0][0]].double().mean()))


# --------------------------------------------------------------------------- family names


def test_names_take_the_readme_family_names_in_any_spelling():
    mixing = registry.names(group="context mixing")
    assert mixing == ("value_zeroing", "alti", "globenc")
    for spelling in ("context mixing", "context_mixing", "Context-Mixing"):
        assert registry.names(family=spelling) == mixing, spelling
    assert registry.names(group="context_mixing") == mixing
    # a registry family keeps its meaning (attention includes the context-mixing methods)
    assert set(mixing) < set(registry.names(family="attention"))
    assert registry.names(family="attention-derived") == ("rollout", "flow", "attention_nosink")
    assert registry.names(family="attention_x_gradient") == ("attn_grad",)
    for name in registry.family_names():
        assert registry.names(family=name), name


def test_an_unknown_family_is_refused_naming_the_valid_ones():
    with pytest.raises(InputError) as caught:
        registry.names(family="mixing")
    message = str(caught.value)
    assert "'mixing'" in message and all(name in message for name in registry.family_names())
    with pytest.raises(InputError, match="valid groups are attention, context mixing, gradient, intervention"):
        registry.methods(group="saliency")
