"""Abnar & Zuidema's importance (max over every query row) against HF eager attentions."""

from __future__ import annotations

import pytest
import torch

from probe.errors import InputError
from probe.explainers.attention import attention_scores
from probe.explainers.rollout import rollout_matrices
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun"]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_max_over_queries_equals_eager_oracle(loaded, kind):
    pm = loaded(kind, implementation="eager")
    examples = prepare(pm, TEXTS, TargetSpec())
    raw = attention_scores(pm, examples, "attention_mean", query="max")
    roll = attention_scores(pm, examples, "rollout", query="max")
    assert raw.params["query"] == "max"
    for i, example in enumerate(examples):
        ids = torch.tensor([example.input_ids])
        with torch.no_grad():
            out = pm.model(input_ids=ids, output_attentions=True)
        maps = [a[0].float() for a in out.attentions]  # per layer [head, T, T]
        expected_raw = torch.stack([m.mean(0).amax(0) for m in maps])  # [layer, T]
        expected_roll = rollout_matrices(maps).amax(1)  # [layer, T]
        # attention weights and rollout rows: entries in [0, 1], absolute tolerances
        torch.testing.assert_close(raw.scores[i], expected_raw, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(roll.scores[i], expected_roll, atol=1e-5, rtol=1e-4)
        alone = attention_scores(pm, [example], "rollout", query="max")
        torch.testing.assert_close(alone.scores[0], roll.scores[i], atol=1e-6, rtol=1e-5)


def test_query_max_bad_input(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    with pytest.raises(InputError, match="unknown query 'all'.*target, max"):
        attention_scores(pm, examples, "rollout", query="all")
    with pytest.raises(InputError, match="query: max applies to attention_mean, rollout, flow"):
        attention_scores(pm, examples, "attn_norm", query="max")
