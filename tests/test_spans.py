"""Spans as units (issue 27, item 3): token groups given by the text (a regular expression or
character offsets), every method's scores folded over them, and leave-one-out of whole spans
checked against one forward per perturbed sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from probe.errors import InputError

TEXTS = ["the movie was good and the plot was bad", "bad plot"]


def _value(pm, example, ids):
    from probe.rows.target import evaluate

    return float(evaluate(pm, [(list(ids), example)])[0])


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_span_scores_fold_the_token_scores_and_span_loo_deletes_the_whole_span(loaded, kind):
    pm = loaded(kind)
    ex = probe.explain(pm, TEXTS, ["attention_mean", "saliency", "loo_delete"], spans=r"the \w+|bad")
    table = ex.to_pandas(level="span")
    first = ex.examples[0]
    spans = ex.spans[0]
    assert [s.text for s in spans] == ["the movie", "the plot", "bad"]
    for s in spans:
        for method in ("saliency", "loo_delete"):
            row = table[(table.example == 0) & (table.span == s.text) & (table.method == method)]
            expected = np.nansum(ex[method].scores[0][list(s.positions)].double().numpy())
            assert row.score.item() == pytest.approx(expected, abs=1e-6)
        joined = pm.tokenizer.convert_tokens_to_string([first.tokens[p] for p in s.positions]).strip()
        assert joined.replace(" ", "") == s.text.replace(" ", "")
    loo = probe.span_loo(pm, TEXTS, r"the \w+|bad")
    for _, row in loo[loo.example == 0].iterrows():
        s = spans[row.span_index]
        shorter = [t for p, t in enumerate(first.input_ids) if p not in set(s.positions)]
        assert row.score == pytest.approx(_value(pm, first, first.input_ids) - _value(pm, first, shorter), abs=1e-5)
    assert set(loo.example) == {0, 1} and (loo.n_tokens >= 1).all()


def test_span_loo_by_replacement_and_offsets(loaded):
    pm = loaded("bert")
    text = TEXTS[0]
    start = text.index("good")
    loo = probe.span_loo(pm, text, [(start, start + 4), (0, 9)], mode="mask")
    example = probe.prepare(pm, text)[0]
    assert list(loo.span) == ["good", "the movie"]
    spans = probe.find_spans(pm, example, [(start, start + 4), (0, 9)])
    masked = [pm.tokenizer.mask_token_id if p in set(spans[1].positions) else t for p, t in enumerate(example.input_ids)]
    assert loo.score.iloc[1] == pytest.approx(_value(pm, example, example.input_ids) - _value(pm, example, masked),
                                              abs=1e-5)


def test_span_refusals_are_one_line(loaded):
    pm = loaded("bert")
    with pytest.raises(InputError, match="covers no scored token"):
        probe.span_loo(pm, TEXTS, r"zebra")
    with pytest.raises(InputError, match="not a regular expression"):
        probe.explain(pm, TEXTS, ["attention_mean"], spans="(")
    with pytest.raises(InputError, match="not a pair of character offsets"):
        probe.span_loo(pm, TEXTS, [(5, 2)])
    with pytest.raises(InputError, match="mode"):
        probe.span_loo(pm, TEXTS, "bad", mode="random")
    with pytest.raises(InputError, match="spans="):
        probe.explain(pm, TEXTS, ["attention_mean"]).to_pandas(level="span")


def test_spans_of_generated_output_steps(loaded):
    """A step-by-step explanation folds each output token's row over the prompt's spans."""
    pm = loaded("gpt2")
    ex = probe.explain(pm, TEXTS[:1], ["loo_delete"], generate=2, spans=r"the \w+")
    table = ex.to_pandas(level="span")
    assert set(table.example) == set(range(len(ex.examples)))
    row = table[(table.example == 1) & (table.span_index == 0)]
    expected = np.nansum(ex["loo_delete"].scores[1][list(ex.spans[1][0].positions)].double().numpy())
    assert row.score.item() == pytest.approx(expected, abs=1e-6)
    assert torch.isfinite(ex["loo_delete"].scores[1][list(ex.spans[1][0].positions)]).all()
