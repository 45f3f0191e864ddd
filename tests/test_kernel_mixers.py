"""YOSO's expected-collision attention read as the matrix it applies (probe.hooks.kernel_mixers):
M = E * masks / ||E V|| per head rebuilds the layer's context (fp32, 1e-5); one entry equals
(1 - arccos(q.k)/pi)^tau over the row norm by hand; the model is read through the implicit path,
bidirectional; and the padding HF's YOSO lets in (its mask conversion keeps every position) is
what probe reads and what its padding checks report."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import probe
from probe.errors import CaptureError
from probe.hooks import implicit, kernel_mixers
from probe.models.checks import run_checks

from tiny_models import mixer_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_architectures as sweep  # noqa: E402

TEXTS = ["the movie was great and the acting was good", "not funny"]


@pytest.fixture(scope="module")
def yoso():
    torch.manual_seed(0)
    model = sweep.build("yoso", "classification", "eager")
    return probe.wrap(model, sweep.tokenizer())


def _calls(model, inputs):
    """[(module, hidden, mask, its context)] of every YOSO self-attention in one forward."""
    return [(module, hidden, mask, output[0]) for module, hidden, mask, output in mixer_inputs(model, inputs).values()]


def test_matrices_rebuild_the_context_and_one_entry_is_its_formula(yoso):
    batch = dict(yoso.tokenizer(TEXTS, return_tensors="pt", padding=True))
    calls = _calls(yoso.model, batch)
    assert len(calls) == 2
    for module, hidden, mask, context in calls:
        assert mask is not None and mask.shape == batch["attention_mask"].shape  # the layer's own mask
        with torch.no_grad():
            terms = kernel_mixers.yoso_terms(module, hidden, mask)
            rebuilt = implicit.mixer_output(module, terms)
        assert float(context.abs().max()) > 0.1
        assert float((rebuilt - context).abs().max()) < 1e-5
        assert bool((terms.weights >= 0).all()) and float(terms.weights.triu(1).abs().max()) > 1e-3  # bidirectional
    module, hidden, mask, _ = calls[0]
    with torch.no_grad():
        terms = kernel_mixers.yoso_terms(module, hidden, mask)
        heads, width = module.num_attention_heads, module.attention_head_size
        q = torch.nn.functional.normalize(module.query(hidden).view(2, -1, heads, width)[1, :, 2].double(), dim=-1)
        k = torch.nn.functional.normalize(module.key(hidden).view(2, -1, heads, width)[1, :, 2].double(), dim=-1)
        v = module.value(hidden).view(2, -1, heads, width)[1, :, 2].double()
    e = (1 - torch.acos((q @ k.T).clamp(-1, 1)) / math.pi) ** module.hash_code_len  # every key: padding too
    t, s = 1, 4
    expected = e[t, s] / (e[t] @ v).norm()
    assert float(terms.weights[1, 2, t, s]) == pytest.approx(float(expected), rel=1e-5)


def test_yoso_is_read_bidirectionally_and_its_padding_leak_is_reported(yoso):
    stack = yoso.contract.stacks["encoder"]
    assert stack.maps == "implicit" and stack.mask_kind == "bidirectional" and not stack.can_edit
    results = {r.name: r for r in run_checks(yoso)}
    assert results["implicit_matrices_rebuild_mixer_outputs"].passed
    # HF's YOSO turns the 0/1 mask into int(1 + mask / 10000) = 1 everywhere: padding is attended,
    # and changing a padded token changes the real outputs; probe's checks say so
    assert not results["padded_keys_get_zero"].passed
    assert not results["padding_tokens_change_nothing"].passed
    ex = probe.explain(yoso, TEXTS, ["attention_mean", "loo_delete", "integrated_gradients"])
    for i, e in enumerate(ex.examples):
        assert torch.isfinite(ex["attention_mean"].scores[i]).all()
        assert ex["attention_mean"].scores[i].shape[-1] == len(e.input_ids)


def test_the_lsh_sampling_path_is_refused_in_one_line(yoso):
    module, hidden, mask, _ = _calls(yoso.model, dict(yoso.tokenizer(TEXTS[:1], return_tensors="pt")))[0]
    module.use_expectation = False
    try:
        with pytest.raises(CaptureError, match="use_expectation=True") as info:
            kernel_mixers.yoso_terms(module, hidden, mask)
        assert "\n" not in str(info.value)
    finally:
        module.use_expectation = True
