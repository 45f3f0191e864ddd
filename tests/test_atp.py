"""Attribution patching (probe.intervene.atp) against a first-order oracle and the exact knockout.

The oracle never touches probe's hooks or editors: it loads the same weights as a plain transformers
model in eager attention and wraps the modeling file's own ``eager_attention_forward`` so that each
layer's output gets ``delta @ v`` added, ``delta`` a zero leaf of the weights' shape. Autograd on the
hand-computed target then gives ``g = d f / d alpha`` per layer; the knocked-out pattern ``alpha'`` is
built by hand (the blocked weight zeroed, the row renormalised or not), and the estimate is
``-sum (alpha' - alpha) g`` summed over the blocked rows: the directional derivative, not the closed
form the module uses.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from probe.errors import InputError
from probe.intervene.atp import atp, atp_heads, attribution_patching
from probe.intervene.heads import head_ablation_effects, head_importance
from probe.intervene.knockout import edge_knockout
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tolerances import assert_fp_close, model_depth

TEXTS = ["the movie was good and fun", "a bad film", "i loved the music but the plot was slow"]
KINDS = ("bert", "gpt2", "llama_gqa")


def _examples(pm, kind, texts=TEXTS, kind_of_target=None):
    if kind == "bert":
        return prepare(pm, texts, TargetSpec(kind=kind_of_target))
    return prepare(pm, texts, TargetSpec(continuation=" good", kind=kind_of_target))


def _attention_modules(model) -> list[torch.nn.Module]:
    if hasattr(model, "bert"):
        return [layer.attention.self for layer in model.bert.encoder.layer]
    if hasattr(model, "transformer"):
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


@contextlib.contextmanager
def _pattern_leaves(model):
    """Within the block, every layer's eager attention adds ``delta @ v`` to its output (``delta`` a
    zero leaf); yields ``{layer: (alpha, delta)}`` filled by the forward."""
    modules = _attention_modules(model)
    modeling = sys.modules[type(modules[0]).__module__]
    original = modeling.eager_attention_forward
    layer_of = {id(m): layer for layer, m in enumerate(modules)}
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def patched(module, query, key, value, attention_mask, *args, **kwargs):
        output, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        delta = torch.zeros_like(weights, requires_grad=True)  # [batch, head, query, key]
        group = weights.shape[1] // value.shape[1]
        values = value.repeat_interleave(group, dim=1)  # [batch, head, key, dim]
        held[layer_of[id(module)]] = (weights.detach(), delta)
        return output + (delta @ values).transpose(1, 2), weights

    modeling.eager_attention_forward = patched
    try:
        yield held
    finally:
        modeling.eager_attention_forward = original


def _target(model, example) -> torch.Tensor:
    """The example's target from a plain forward of one row, by hand (differentiable)."""
    if example.target_ids:
        ids = list(example.input_ids) + list(example.target_ids[:-1])
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        n = len(example.input_ids)
        if example.kind == "logit":
            return torch.stack([logits[n - 1 + j, t] for j, t in enumerate(example.target_ids)]).sum()
        logprobs = torch.log_softmax(logits, -1)
        return torch.stack([logprobs[n - 1 + j, t] for j, t in enumerate(example.target_ids)]).sum()
    logits = model(input_ids=torch.tensor([example.input_ids])).logits[0].double()
    return torch.softmax(logits, -1)[example.label]


def _oracle(model, example, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edges [layer, head, tokens], heads [layer, head])``: the first-order estimates by hand."""
    with _pattern_leaves(model) as held, torch.enable_grad():
        value = _target(model, example)
        layers = sorted(held)
        grads = torch.autograd.grad(value, [held[layer][1] for layer in layers])
    q = 0 if not example.target_ids else len(example.input_ids) - 1
    n = len(example.input_ids)
    edges = torch.zeros((len(layers), held[0][0].shape[1], n), dtype=torch.float64)
    heads = torch.zeros((len(layers), held[0][0].shape[1]), dtype=torch.float64)
    for layer, g in zip(layers, grads, strict=True):
        alpha, g = held[layer][0][0].double(), g[0].double()  # [head, query, key]
        heads[layer] = (alpha * g).sum(dim=(-1, -2))  # alpha' = 0 everywhere: -sum (0 - alpha) g
        for k in range(n):
            edited = alpha[:, q].clone()  # [head, key]
            edited[:, k] = 0.0
            if renormalise:
                edited = edited / edited.sum(dim=-1, keepdim=True)
            edges[layer, :, k] = -((edited - alpha[:, q]) * g[:, q]).sum(dim=-1)
    return edges, heads


@pytest.fixture(scope="module")
def oracle_models(tiny_dirs):
    import transformers

    out = {}
    for kind in KINDS:
        auto = "AutoModelForSequenceClassification" if kind == "bert" else "AutoModelForCausalLM"
        out[kind] = getattr(transformers, auto).from_pretrained(tiny_dirs[kind], attn_implementation="eager").eval()
    return out


# ----------------------------------------------------------------------------- (a) the oracle


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_atp_equals_the_first_order_estimate_by_hand(loaded, oracle_models, kind, renormalise):
    pm = loaded(kind, "sdpa")
    examples = _examples(pm, kind)
    result = attribution_patching(pm, examples, renormalise=renormalise, keep_special=True, batch_size=2)
    depth = model_depth(pm, backward=True)
    for i, example in enumerate(examples):
        edges, heads = _oracle(oracle_models[kind], example, renormalise)
        assert edges.abs().max() > 0  # the oracle measures something, so equality can fail
        assert_fp_close(result.per_head.scores[i], edges, depth=depth, msg=f"{kind} edges ex {i}")
        assert_fp_close(result.heads.change[i], heads, depth=depth, msg=f"{kind} heads ex {i}")
        # per token: the window's sum of the per-head estimates
        assert_fp_close(result.tokens.scores[i], edges.sum(dim=(0, 1)), depth=depth, msg=f"{kind} tokens ex {i}")


def test_head_estimates_are_the_head_gate_gradient_of_head_importance(loaded):
    """The head estimate is Michel et al.'s gate gradient: head_importance (loss target) is its |.|."""
    pm = loaded("gpt2", "sdpa")
    examples = _examples(pm, "gpt2")
    estimate = atp_heads(pm, examples).change  # [example, layer, head]
    gate = head_importance(pm, examples, loss="target", ablation=False).per_example
    assert_fp_close(estimate.abs(), gate.double(), depth=model_depth(pm, backward=True))


def test_the_registered_form_carries_the_per_head_and_head_estimates(loaded):
    pm = loaded("gpt2", "sdpa")
    examples = _examples(pm, "gpt2")
    full = attribution_patching(pm, examples, layers=1)
    scores = atp(pm, examples, layers="1", per_head=True)
    assert scores.method == "atp" and scores.params["layers"] == [1] and scores.params["per_head"]
    for i in range(len(examples)):
        same = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}  # the same numbers, carried
        torch.testing.assert_close(scores.scores[i], full.tokens.scores[i].float(), **same)
        torch.testing.assert_close(scores.extras["per_head"][i], full.per_head.scores[i].float(), **same)
        torch.testing.assert_close(scores.extras["heads"][i], full.heads.change[i].float(), **same)
        assert bool(scores.extras["per_head"][i][0].isnan().all())  # layer 0 is outside the window
    assert "per_head" not in atp(pm, examples).extras


def test_special_tokens_and_the_window_are_nan_where_knockout_is(loaded):
    pm = loaded("bert", "sdpa")
    examples = _examples(pm, "bert")
    result = attribution_patching(pm, examples, layers=-1, heads="0,2")
    exact = edge_knockout(pm, examples, layers=[-1], heads=[0, 2], per_head=True)
    for got, want in zip(result.per_head.scores, exact.per_head.scores, strict=True):
        assert torch.equal(got.isnan(), want.isnan())
    for got, want in zip(result.tokens.scores, exact.tokens.scores, strict=True):
        assert torch.equal(got.isnan(), want.isnan())


def test_batch_of_one_and_batch_of_n_agree(loaded):
    pm = loaded("llama_gqa", "sdpa")
    examples = _examples(pm, "llama_gqa")
    together = attribution_patching(pm, examples, batch_size=3)
    for i, example in enumerate(examples):
        alone = attribution_patching(pm, [example], batch_size=1)
        assert_fp_close(together.per_head.scores[i], alone.per_head.scores[0], depth=model_depth(pm, backward=True))
        assert_fp_close(together.heads.change[i], alone.heads.change[0], depth=model_depth(pm, backward=True))


def test_query_from_blocks_the_rows_knockout_blocks(loaded):
    """query='from': the estimate is summed over the rows after the key, as the knockout blocks them;
    in the limit of a tiny edit both agree in sign on the clearly measured edges."""
    pm = loaded("gpt2", "sdpa")
    examples = _examples(pm, "gpt2")
    est = attribution_patching(pm, examples, query="from", renormalise=False)
    exact = edge_knockout(pm, examples, query="from", renormalise=False, per_head=True)
    a = torch.cat([s.flatten() for s in est.per_head.scores]).double()
    b = torch.cat([s.flatten() for s in exact.per_head.scores]).double()
    keep = ~(a.isnan() | b.isnan())
    assert float(torch.corrcoef(torch.stack([a[keep], b[keep]]))[0, 1]) > 0.9
    with pytest.raises(InputError, match="query_from"):
        attribution_patching(pm, examples, query="target", query_from=2)


# ----------------------------------------------------------------------------- (b) the limit and the linear case


def _scaled(folder: Path, factor: float):
    """The tiny Llama with every layer's attention output projection times ``factor``: every edge's
    push on the residual stream shrinks with it, so the knockouts become near-linear."""
    pm = load_model(str(folder), attn_implementation="sdpa")
    with torch.no_grad():
        for layer in pm.model.model.layers:
            layer.self_attn.o_proj.weight.mul_(factor)
    return pm


def test_atp_approaches_the_exact_knockout_as_the_edit_shrinks(tiny_dirs):
    errors = []
    for factor in (1.0, 0.1, 0.01):
        pm = _scaled(tiny_dirs["llama_gqa"], factor)
        examples = _examples(pm, "llama_gqa")
        est = attribution_patching(pm, examples)
        exact = edge_knockout(pm, examples, per_head=True)
        a = torch.cat([s.flatten() for s in est.per_head.scores]).double()
        b = torch.cat([s.flatten() for s in exact.per_head.scores]).double()
        keep = ~(a.isnan() | b.isnan())
        errors.append(float((a[keep] - b[keep]).norm() / b[keep].norm()))
    # first order: the relative error falls about as the edit does (tenfold per step here)
    print("relative errors", errors)
    assert errors[1] < errors[0] / 3 and errors[2] < errors[1] / 3, errors
    assert errors[2] < 0.02, errors


@pytest.fixture(scope="module")
def linear_llama(tiny_dirs, tmp_path_factory):
    """One Llama layer whose MLP adds nothing and whose final norm is removed: the target logit is
    linear in the target row's attention weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama_gqa"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.layers[0].self_attn.q_proj.weight.mul_(6.0)  # peaked rows: large edits
        model.model.layers[0].self_attn.v_proj.weight.mul_(30.0)  # values that move the logit
    folder = tmp_path_factory.mktemp("atp") / "linear_llama"
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    pm = load_model(str(folder), attn_implementation="sdpa")
    pm.model.model.norm = torch.nn.Identity()
    return pm


@pytest.mark.parametrize("renormalise", [True, False])
def test_atp_is_exact_where_the_target_is_linear_in_the_weights(linear_llama, renormalise):
    pm = linear_llama
    examples = _examples(pm, "llama_gqa", kind_of_target="logit")
    est = attribution_patching(pm, examples, renormalise=renormalise)
    exact = edge_knockout(pm, examples, renormalise=renormalise, per_head=True)
    for i in range(len(examples)):
        assert exact.per_head.scores[i].nan_to_num().abs().max() > 1e-3  # real effects, not zeros
        assert_fp_close(est.per_head.scores[i], exact.per_head.scores[i], depth=model_depth(pm, backward=True),
                        scale=float(exact.per_head.scores[i].nan_to_num().abs().max()), msg=f"ex {i}")
        assert_fp_close(est.tokens.scores[i], exact.tokens.scores[i], depth=model_depth(pm, backward=True),
                        scale=float(exact.tokens.scores[i].nan_to_num().abs().max()), msg=f"tokens ex {i}")
    ablated = head_ablation_effects(pm, examples, stack=pm.task.target_stack(pm.contract))
    # a head's ablation zeroes every row of it; only the target row reaches the logit, so this is linear too
    assert_fp_close(est.heads.change, ablated.change.double(), depth=model_depth(pm, backward=True))


# ----------------------------------------------------------------------------- (c) registered, on a real model


def test_atp_is_a_registered_signed_method_run_by_name():
    from probe import registry

    entry = registry.method("atp")
    assert entry.family == "intervention" and entry.signed and entry.needs_gradients and not entry.engine
    assert entry.applies.by_name and registry.param_fields(entry)["batch_size"] == 8
    assert registry.params_problem("atp", {"query": "all"})[0] == "query"


def test_atp_through_probe_explain_on_smollm2_tracks_the_exact_knockout(builtin_cache):
    import probe

    pm = load_model("builtin:smollm2-135m", cache_dir=str(builtin_cache))
    texts = ["The capital of France is", "The cat sat on the"]
    layers = "20:22"
    ex = probe.explain(pm, texts, methods=["atp"], params={"atp": {"layers": layers, "per_head": True}})
    scores = ex["atp"]
    examples = prepare(pm, texts)
    exact = edge_knockout(pm, examples, layers=[20, 21], per_head=True)
    for i in range(len(texts)):
        per_head = scores.extras["per_head"][i]  # [layer, head, tokens]
        assert per_head.shape == exact.per_head.scores[i].shape
        inside = per_head[20:22].flatten().double()
        assert torch.isfinite(inside).all() and torch.isfinite(scores.extras["heads"][i]).all()
        truth = exact.per_head.scores[i][20:22].flatten().double()
        ranks = torch.stack([inside.argsort().argsort(), truth.argsort().argsort()]).double()
        assert float(torch.corrcoef(ranks)[0, 1]) > 0.5, i  # Spearman
