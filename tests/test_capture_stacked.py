"""The stacked maps are the only copy (probe.hooks.stacked): each layer is written into its slot of
one [batch, layer, head, query, key] tensor as it runs, and Capture.maps hands that tensor out."""

from __future__ import annotations

import pytest
import torch

from probe.hooks.capture import capture_attention
from probe.models.core import encode_texts
from probe.models.text import forward_inputs

from tiny_models import TINY_KINDS

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]


def _capture(pm, texts=TEXTS, **kwargs):
    batch = encode_texts(pm, texts)
    inputs = forward_inputs(pm, batch)
    cap_context = capture_attention(pm, attention_mask=batch["attention_mask"],
                                    decoder_attention_mask=inputs.get("decoder_attention_mask"), **kwargs)
    with torch.no_grad(), cap_context as cap:
        pm.model(**inputs)
    return cap


@pytest.mark.parametrize("implementation", ("eager", "sdpa"))
@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("queries", (None, "last"))
def test_the_stacked_maps_are_the_layers_own_storage_and_equal_them_bit_for_bit(loaded, kind, implementation,
                                                                                 queries):
    pm = loaded(kind, implementation)
    cap = _capture(pm, queries=queries)
    for stack in pm.contract.stacks:
        stacked = cap.maps(stack).weights  # [batch, layer, head, query, key]
        per_layer = cap.layer_maps(stack)
        assert torch.equal(stacked, torch.stack([m.weights[:, 0] for _, m in sorted(per_layer.items())], dim=1))
        # one allocation: every layer's record is a view of the stacked tensor, never a copy beside it
        storage = stacked.untyped_storage().data_ptr()
        assert all(m.weights.untyped_storage().data_ptr() == storage for m in per_layer.values())
        assert cap.maps(stack).weights.data_ptr() == stacked.data_ptr()  # read twice: the same tensor, no copy


def test_maps_handed_out_are_never_written_by_the_next_forward(loaded):
    pm = loaded("llama_gqa")
    batch = encode_texts(pm, TEXTS)
    other = encode_texts(pm, ["bad film , not fun", "the cast was great", "good"])
    with torch.no_grad(), capture_attention(pm) as cap:
        pm.model(**batch)
        first = cap.maps().weights
        kept = first.clone()
        pm.model(**other)
        second = cap.maps().weights
    assert torch.equal(first, kept)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(second, _capture(pm, ["bad film , not fun", "the cast was great", "good"]).maps().weights)


def test_a_forward_of_another_length_gets_its_own_stacked_tensor(loaded):
    pm = loaded("gpt2")
    with torch.no_grad(), capture_attention(pm) as cap:
        pm.model(**encode_texts(pm, TEXTS))
        pm.model(**encode_texts(pm, ["bad film"]))
        maps = cap.maps().weights
    assert torch.equal(maps, _capture(pm, ["bad film"]).maps().weights)


def test_layers_and_heads_chosen_are_stacked_in_place_too(loaded):
    pm = loaded("llama_gqa")
    whole = _capture(pm).maps().weights
    some = _capture(pm, layers=[1, 0], heads=[3, 1], queries=[0, 2]).maps()
    assert some.layers == (0, 1)
    # rows recomputed on their own (sdpa) round unlike the full map's: attention weights, absolute
    assert torch.allclose(some.weights, whole[:, :, [3, 1]][:, :, :, [0, 2]], atol=1e-6)


def test_maps_that_keep_their_graph_are_not_copied_and_carry_the_gradient(loaded):
    pm = loaded("llama_gqa")
    batch = encode_texts(pm, TEXTS)
    with torch.enable_grad(), capture_attention(pm, keep_grad=True, attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
        weights = cap.maps().weights
    assert weights.requires_grad
    (grad,) = torch.autograd.grad(weights.sum(), [next(p for p in pm.model.parameters() if p.requires_grad)],
                                  allow_unused=True)
    assert grad is not None
