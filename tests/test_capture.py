"""Attention capture on tiny random models of every test architecture, eager and sdpa."""

from __future__ import annotations

import pytest
import torch

from probe.errors import CaptureError
from probe.hooks.attention_functions import installed_wrappers
from probe.hooks.capture import capture_attention
from probe.models.checks import run_checks
from probe.models.core import encode_texts
from probe.models.text import forward_inputs

from tiny_models import TINY_KINDS
from tolerances import assert_fp_close, model_depth

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]
IMPLEMENTATIONS = ("eager", "sdpa")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_contract_check_passes(loaded, kind, implementation):
    pm = loaded(kind, implementation)
    results = run_checks(pm, TEXTS)
    failed = [r for r in results if not r.passed]
    assert not failed, failed
    names = {r.name for r in results}
    assert "capture_equals_eager_output_attentions" in names
    assert ("causal_future_changes_nothing_earlier" in names) == (pm.task.name == "causal_lm")


def _full_and_rows(pm, queries):
    batch = encode_texts(pm, TEXTS)
    inputs = forward_inputs(pm, batch)
    with torch.no_grad():
        with capture_attention(pm, attention_mask=batch["attention_mask"],
                               decoder_attention_mask=inputs.get("decoder_attention_mask")) as full:
            pm.model(**inputs)
        with capture_attention(pm, queries=queries, attention_mask=batch["attention_mask"],
                               decoder_attention_mask=inputs.get("decoder_attention_mask")) as rows:
            pm.model(**inputs)
    return batch, inputs, full, rows


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_row_capture_equals_rows_of_full_capture(loaded, kind):
    pm = loaded(kind)
    batch, inputs, full, rows = _full_and_rows(pm, "last")
    for stack in pm.contract.stacks:
        whole, picked = full.maps(stack), rows.maps(stack)
        assert picked.weights.shape[3] == 1  # only the asked row is held
        mask = inputs["decoder_attention_mask"] if pm.task.name == "seq2seq" and stack != "encoder" else batch["attention_mask"]
        last = mask.sum(1) - 1
        assert torch.equal(picked.query_index[:, 0], last)
        expected = whole.weights[torch.arange(len(TEXTS)), :, :, last]
        assert torch.allclose(picked.weights[:, :, :, 0], expected, atol=1e-6)  # attention weights: bounded, absolute


def test_explicit_positions_layers_and_heads(loaded):
    pm = loaded("llama_gqa")
    batch = encode_texts(pm, TEXTS)
    with torch.no_grad():
        with capture_attention(pm, attention_mask=batch["attention_mask"]) as full:
            pm.model(**batch)
        with capture_attention(pm, queries=[0, 2], layers=[1], heads=[3, 1]) as some:
            pm.model(**batch)
    whole, picked = full.maps(), some.maps()
    assert picked.layers == (1,) and picked.heads == (3, 1)
    assert picked.shape == {"batch": 3, "layer": 1, "head": 2, "query": 2, "key": whole.shape["key"]}
    # attention weights (bounded by 1): absolute
    assert torch.allclose(picked.weights[:, 0], whole.weights[:, 1][:, [3, 1]][:, :, [0, 2]], atol=1e-6)


def test_gqa_heads_read_their_kv_head(loaded):
    pm = loaded("llama_gqa")
    stack = pm.contract.stacks["decoder"]
    assert (stack.n_heads, stack.n_kv_heads) == (4, 2)
    assert stack.kv_head_of_query == (0, 0, 1, 1)


def test_no_wrapper_survives_an_exception(loaded):
    pm = loaded("bert")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    batch = encode_texts(pm, TEXTS)
    with torch.no_grad():
        plain = pm.model(**batch).logits
        with pytest.raises(RuntimeError, match="boom"):
            with capture_attention(pm):
                assert installed_wrappers() == ["sdpa"]
                pm.model(**batch)
                raise RuntimeError("boom")
        assert installed_wrappers() == []
        assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == before
        assert torch.equal(pm.model(**batch).logits, plain)


def test_exception_inside_the_forward_pass_also_cleans_up(loaded):
    pm = loaded("gpt2")

    def broken(weights, context):
        raise ValueError("editor failed")

    batch = encode_texts(pm, TEXTS)
    with pytest.raises(ValueError, match="editor failed"):
        with torch.no_grad(), capture_attention(pm, editors={("decoder", 0): broken}):
            pm.model(**batch)
    assert installed_wrappers() == []


def test_other_models_pass_through_untouched(loaded):
    captured, other = loaded("bert"), loaded("bert", "eager")
    batch = encode_texts(other, TEXTS)
    with torch.no_grad():
        plain = other.model(**batch).logits
        with capture_attention(captured) as cap:
            during = other.model(**batch).logits
    assert torch.equal(plain, during)
    assert cap.calls == {}


def test_identity_editor_reproduces_the_output(loaded):
    for kind in TINY_KINDS:
        pm = loaded(kind)
        batch = encode_texts(pm, TEXTS)
        inputs = forward_inputs(pm, batch)
        editors = {key: (lambda w, ctx: w) for key in pm.contract.module_paths}
        with torch.no_grad():
            plain = pm.model(**inputs).logits
            with capture_attention(pm, editors=editors, attention_mask=batch["attention_mask"]) as cap:
                edited = pm.model(**inputs).logits
        # logits (unbounded), the attention recomputed by capture: one forward in another order, at their scale
        assert_fp_close(edited, plain, depth=model_depth(pm), msg=kind)
        assert len(cap.calls) == len(pm.contract.module_paths)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_observers_see_the_head_mean_of_eager_attention_and_change_nothing(loaded, kind):
    """Observers (what rollout streams through) get each layer's head-mean map, equal to the mean
    of HF's own eager ``output_attentions`` on allowed positions, while the sdpa model's output is
    untouched."""
    eager, sdpa = loaded(kind, "eager"), loaded(kind, "sdpa")
    batch = encode_texts(eager, TEXTS)
    with torch.no_grad():
        reference = eager.model(**forward_inputs(eager, batch), output_attentions=True)
    seen = {}

    def observe(mean, context):
        seen[(context.stack, context.layer)] = mean.clone()

    observers = {key: observe for key in sdpa.contract.module_paths}
    inputs = forward_inputs(sdpa, batch)
    with torch.no_grad():
        plain = sdpa.model(**inputs).logits
        with capture_attention(sdpa, observers=observers, attention_mask=batch["attention_mask"]):
            observed = sdpa.model(**inputs).logits
    assert torch.equal(plain, observed)
    assert set(seen) == set(sdpa.contract.module_paths)
    stack = sdpa.contract.primary_stack
    names = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}
    maps = getattr(reference, "attentions", None) or getattr(reference, names[stack])
    mask = batch["attention_mask"].bool()
    for layer, weights in enumerate(maps):
        expected = weights.float().mean(dim=1)  # [batch, query, key]
        got = seen[(stack, layer)]
        assert got.shape == expected.shape
        valid = mask[:, :, None] & mask[:, None, :] if got.shape[1] == mask.shape[1] else mask[:, None, :]
        # head-mean attention weights (bounded by 1): absolute
        assert torch.allclose(got[valid.expand_as(got)], expected[valid.expand_as(expected)], atol=1e-5), (kind, layer)


def test_uniform_editor_changes_the_output(loaded):
    pm = loaded("bert")
    batch = encode_texts(pm, TEXTS)

    def uniform(weights, context):
        allowed = context.allowed.expand_as(weights).float()
        return allowed / allowed.sum(-1, keepdim=True)

    with torch.no_grad():
        plain = pm.model(**batch).logits
        with capture_attention(pm, editors={("encoder", 0): uniform, ("encoder", 1): uniform}, queries="first") as cap:
            edited = pm.model(**batch).logits
    assert not torch.allclose(plain, edited, atol=1e-4)
    row = cap.maps().weights[0, 0, 0, 0]
    n_real = int(batch["attention_mask"][0].sum())
    assert torch.allclose(row[:n_real], torch.full((n_real,), 1.0 / n_real))


def test_editing_in_training_mode_is_refused(loaded):
    pm = loaded("bert")
    batch = encode_texts(pm, TEXTS)
    pm.model.train()
    try:
        with pytest.raises(CaptureError, match="eval mode"):
            with capture_attention(pm, editors={("encoder", 0): lambda w, c: w}):
                pm.model(**batch)
    finally:
        pm.model.eval()


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": [7]}, "layer 7 does not exist"),
    ({"heads": [9]}, "head 9 does not exist"),
    ({"stacks": ["cross"]}, "has no 'cross' attention"),
    ({"editors": {("encoder", 5): lambda w, c: w}}, "cannot edit encoder layer 5"),
    ({"observers": {("encoder", 5): lambda m, c: None}}, "cannot observe encoder layer 5"),
    ({"readers": {("encoder", 5): lambda inputs: None}}, "cannot read encoder layer 5"),
])
def test_bad_selections_name_the_problem(loaded, kwargs, message):
    pm = loaded("bert")
    with pytest.raises(CaptureError, match=message):
        with capture_attention(pm, **kwargs):
            pass


def test_query_position_out_of_range(loaded):
    pm = loaded("bert")
    batch = encode_texts(pm, ["good"])
    with pytest.raises(CaptureError, match="out of range"):
        with torch.no_grad(), capture_attention(pm, queries=[40]):
            pm.model(**batch)


def test_all_masked_rows_are_zero_and_flagged(loaded):
    """Left padding in a causal model makes the pad query rows attend to nothing."""
    pm = loaded("gpt2", "eager")
    tok = pm.tokenizer
    tok.padding_side = "left"
    try:
        batch = tok(TEXTS, padding=True, return_tensors="pt")
    finally:
        tok.padding_side = "right"
    with torch.no_grad(), capture_attention(pm, attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    maps = cap.maps()
    assert torch.isfinite(maps.weights).all()
    short = int(batch["attention_mask"].sum(1).argmin())
    n_pad = int((batch["attention_mask"][short] == 0).sum())
    assert n_pad > 0
    assert not maps.row_has_keys[short, :, :n_pad].any()
    assert maps.weights[short, :, :, :n_pad].abs().max() == 0
    assert maps.row_has_keys[short, :, n_pad:].all()


def test_open_session_leaves_no_wrapper_and_no_session_when_its_block_raises():
    from probe.hooks import attention_functions

    class Session:
        where: dict = {}

    with pytest.raises(RuntimeError, match="inside"):
        with attention_functions.open_session(Session(), "sdpa"):
            assert installed_wrappers() == ["sdpa"]
            raise RuntimeError("inside")
    assert installed_wrappers() == [] and attention_functions._SESSIONS == []

