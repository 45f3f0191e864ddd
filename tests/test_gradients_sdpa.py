"""Gradient methods run through the model's own attention kernel: under sdpa no [T, T] map is formed
(forward or backward), and the scores equal the eager run's to float rounding (issue 64)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe.explainers import gradients as G
from probe.explainers import integrated_gradients as IG
from probe.rows.prepare import prepare

from tolerances import assert_fp_close, model_depth

#: one text of 17 tokens: a [.., 17, 17] tensor can only be an attention map or its mask (the model
#: is 32 wide with 4 heads of 8)
TEXT = "the movie was good and the cast was great but not fun at all , really"
METHODS = {
    "saliency": lambda pm, examples: G.saliency(pm, examples),
    "input_x_gradient": lambda pm, examples: G.input_x_gradient(pm, examples),
    "integrated_gradients": lambda pm, examples: IG.integrated_gradients(pm, examples, steps=4),
}


class SquareMaps(TorchDispatchMode):
    """Every aten op's floating output whose last two dims are ``n`` x ``n`` for ``n`` in ``lengths``
    (the widths a row may be fed at), and the ops run."""

    def __init__(self, lengths: set[int]) -> None:
        super().__init__()
        self.lengths = lengths
        self.square: list[tuple[str, tuple[int, ...]]] = []
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_floating_point() \
                    and t.shape[-1] == t.shape[-2] and t.shape[-1] in self.lengths:
                self.square.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("method", sorted(METHODS))
def test_sdpa_gradients_form_no_square_map_and_equal_eager(loaded, method):
    runs = {}
    for implementation in ("eager", "sdpa"):
        pm = loaded("llama_gqa", implementation)
        examples = prepare(pm, [TEXT])
        # the row fed: the text, then the continuation but (a causal LM) its last token
        width = len(examples[0].input_ids) + len(examples[0].target_ids)
        watch = SquareMaps({width - 1, width})
        with watch:
            runs[implementation] = METHODS[method](pm, examples)
        kernel = runs[implementation].params["attention_kernel"]
        assert kernel.startswith(implementation)
        if implementation == "eager":
            assert watch.square, "the eager run forms its maps: the watch must see them"
            assert "quadratic" in kernel
        else:
            assert not watch.square, f"sdpa formed [T, T] maps: {watch.square[:3]}"
            assert any("scaled_dot_product" in op and "backward" in op for op in watch.ops)
            assert "linear" in kernel
    pm = loaded("llama_gqa", "sdpa")
    assert_fp_close(runs["sdpa"].scores[0], runs["eager"].scores[0], depth=model_depth(pm, backward=True))
