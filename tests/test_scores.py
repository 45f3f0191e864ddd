"""TokenScores: frozen, with named axes and a tidy table (no model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from probe.rows.scores import TokenScores


def _per_head() -> TokenScores:
    # example 0: [layer 2, head 3, tokens 4]; example 1: 3 tokens
    return TokenScores("attention", [torch.arange(24, dtype=torch.float64).view(2, 3, 4),
                                     -torch.arange(18, dtype=torch.float64).view(2, 3, 3)],
                       params={"stack": "encoder"}, per_head=True, extras={"note": [1, 2]})


def test_token_scores_are_frozen_cpu_fp32_with_read_only_params():
    source = [torch.tensor([1.0, 2.0], requires_grad=True)]
    params, extras = {"k": 1}, {"delta": [0.5]}
    scores = TokenScores("loo_delete", source, params=params, extras=extras)
    assert isinstance(scores.scores, tuple) and scores.scores[0].dtype == torch.float32
    assert not scores.scores[0].requires_grad and scores.scores[0].device.type == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        scores.method = "other"
    with pytest.raises(TypeError):
        scores.params["k"] = 2
    with pytest.raises(TypeError):
        scores.extras["delta"] = []
    params["k"], extras["new"] = 5, 1  # the caller's dicts were copied
    assert scores.params == {"k": 1} and "new" not in scores.extras
    assert dict(dataclasses.replace(scores, method="x").params) == {"k": 1}  # a changed result is a new one


def test_axes_name_each_examples_tensor():
    tokens = TokenScores("saliency", [torch.zeros(3)])
    layers = TokenScores("rollout", [torch.zeros(2, 3)], per_layer=True)
    assert tokens.axes == ("token",) and layers.axes == ("layer", "token") and _per_head().axes == ("layer", "head", "token")
    for result in (tokens, layers, _per_head()):
        assert result.scores[0].ndim == len(result.axes)


def test_to_pandas_rows_are_example_layer_head_position():
    frame = _per_head().to_pandas()
    assert list(frame.columns) == ["example", "layer", "head", "position", "score"]
    assert frame.dtypes.to_dict() == {"example": np.int64, "layer": np.int64, "head": np.int64, "position": np.int64,
                                      "score": np.float64}
    assert len(frame) == 2 * 3 * 4 + 2 * 3 * 3
    # example 0, layer 1, head 2, position 3 is the last cell of arange(24).view(2, 3, 4)
    cell = frame[(frame.example == 0) & (frame.layer == 1) & (frame["head"] == 2) & (frame.position == 3)]
    assert cell.score.tolist() == [23.0]
    cell = frame[(frame.example == 1) & (frame.layer == 0) & (frame["head"] == 1) & (frame.position == 2)]
    assert cell.score.tolist() == [-5.0]  # [0, 1, 2] of -arange(18).view(2, 3, 3)
    layers = TokenScores("rollout", [torch.tensor([[0.1, 0.2], [0.3, 0.4]])], per_layer=True).to_pandas()
    assert layers["head"].eq(-1).all() and layers.layer.tolist() == [0, 0, 1, 1]
    tokens = TokenScores("loo_delete", [torch.tensor([float("nan"), 2.0])]).to_pandas()
    assert tokens[["layer", "head"]].eq(-1).all().all() and np.isnan(tokens.score[0]) and tokens.score[1] == 2.0
    empty = TokenScores("x", []).to_pandas()
    assert list(empty.columns) == ["example", "layer", "head", "position", "score"] and not len(empty)


def test_explanation_to_pandas_adds_the_tokens_to_the_scores_table():
    from types import SimpleNamespace

    from probe.explanation import Explanation

    examples = (SimpleNamespace(tokens=["[CLS]", "a", "b", "[SEP]"], special=[True, False, False, True]),
                SimpleNamespace(tokens=["[CLS]", "c", "[SEP]"], special=[True, False, True]))
    ex = Explanation(model="m", examples=examples, scores={"attention": _per_head()})
    frame = ex.to_pandas()
    assert list(frame.columns) == ["example", "position", "token", "clean_token", "special", "method", "layer", "head",
                                    "score"]
    pd.testing.assert_frame_equal(frame[["example", "layer", "head", "position", "score"]],
                                  _per_head().to_pandas()[["example", "layer", "head", "position", "score"]])
    second = frame[frame.example == 1]
    assert second.token.tolist()[:3] == ["[CLS]", "c", "[SEP]"] and second.special.tolist()[:3] == [True, False, True]
    with pytest.raises(ValueError, match="scores 4 tokens of example #1, which has 3"):
        Explanation(model="m", examples=examples, scores={"x": TokenScores("x", [torch.zeros(4)] * 2)}).to_pandas()
