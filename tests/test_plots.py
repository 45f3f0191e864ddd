"""Pictures that must not mislead: a score panel's scale set by the scored tokens (not by a special
token's bar), HTML shading that states its scale and never shades noise, attention maps without
their padding, CI bars that do not pile into one shaded area, a verdict picture of the best and
worst units across families, and a many-method figure of bounded height. Tiny random models only."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.display import matrix_table_html, token_table_html
from probe.explanation import Explanation
from probe.plots import DPI, MAX_SCORES_HEIGHT, layer_lines_figure, token_scores_figure
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample
from probe.study.verdict import Verdict

from figure_checks import texts_outside_canvas

TOKENS = ["[CLS]", "a", "fine", "film", "[SEP]"]
SPECIAL = [True, False, False, False, True]


# --------------------------------------------------------------------------- score panels


def test_a_special_tokens_bar_does_not_set_the_panels_scale():
    """Rollout's [CLS] at 0.66 flattened the real tokens' 0.02: the range is the scored tokens'."""
    rows = {"rollout (last layer)": np.array([0.66, 0.02, 0.01, -0.005, 0.3]),
            "loo_delete": np.array([np.nan, 0.003, -0.001, 0.002, np.nan])}
    fig = token_scores_figure(TOKENS, rows, SPECIAL)
    rollout, loo = fig.axes
    low, high = rollout.get_ylim()
    assert 0.02 <= high < 0.03 and -0.01 < low <= -0.005  # the scored tokens and a margin, not [CLS]'s 0.66
    marks = [line for line in rollout.get_lines() if line.get_marker() == "^"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [0, 4]  # both cut specials marked at the top
    assert np.allclose(marks[0].get_ydata(), high)
    assert 0.003 <= loo.get_ylim()[1] < 0.004
    assert texts_outside_canvas(fig) == []


def test_explanation_plot_of_a_tiny_model_scales_to_its_scored_tokens(loaded):
    from probe.explanation.views import method_rows

    pm = loaded("bert")
    ex = probe.explain(pm, ["a very good film", "bad"], methods=["rollout", "attention_mean", "loo_delete"])
    for example in range(2):
        fig = ex.plot(example)
        special = np.asarray(ex.examples[example].special, dtype=bool)
        rows = method_rows(ex, example)
        for ax, values in zip(fig.axes, rows.values()):
            scored = values[np.isfinite(values) & ~special]
            low, high = ax.get_ylim()
            top, bottom = max(scored.max(), 0.0), min(scored.min(), 0.0)
            assert low <= bottom and top <= high <= top + 0.1 * (top - bottom) + 1e-12, (ax.get_ylabel(), high)


def test_many_methods_keep_the_figure_height_bounded():
    """An 18-method plot was 2,566 px tall."""
    rng = np.random.default_rng(0)
    for n in (18, 45):
        rows = {f"method_{i} (last layer, head mean)": rng.normal(size=len(TOKENS)) for i in range(n)}
        fig = token_scores_figure(TOKENS, rows, SPECIAL, title="many methods")
        assert fig.get_figheight() * DPI <= MAX_SCORES_HEIGHT * DPI <= 1200
        assert len(fig.axes) == n and [ax.get_ylabel() for ax in fig.axes] == list(rows)
        assert texts_outside_canvas(fig) == []
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [ax.yaxis.label.get_window_extent(renderer) for ax in fig.axes]
        for a, b in zip(boxes, boxes[1:]):
            if abs(a.x1 - b.x1) < 1:  # same column: the method names do not overlap
                assert not a.overlaps(b)
        # each column's bottom panel names the tokens
        named = [ax for ax in fig.axes if [t.get_text() for t in ax.get_xticklabels() if t.get_visible()
                                           and ax.xaxis.get_tick_params()["labelbottom"]]]
        assert named and all(ax.get_xticklabels()[1].get_text() == "a" for ax in named)


# --------------------------------------------------------------------------- HTML shading


def _column_cells(html: str, column: int) -> list[str]:
    body = html.split("<tbody>")[1]
    return [re.findall(r"<td[^>]*>.*?</td>", row)[2 + column] for row in body.split("<tr>")[1:]]


def test_html_states_each_methods_scale_and_never_shades_a_faded_one():
    columns = {"integrated_gradients": np.array([0.5, 0.078, -0.02, 0.01, 0.4]),
               "loo_delete": np.array([np.nan, 0.0033, 0.001, -0.0002, np.nan]),
               "noise": np.array([np.nan, 1e-9, -2e-9, 5e-10, np.nan])}
    html = token_table_html(TOKENS, SPECIAL, columns, {"noise": "at the target's noise floor (1.9e-06)"})
    header = html.split("<tbody>")[0]
    assert "max |s| 0.078" in header and "max |s| 0.0033" in header  # the special token's 0.5 is not the scale
    assert "not shaded: at the target&#x27;s noise floor" in header or "not shaded: at the target's noise floor" in header
    assert all("background" not in cell for cell in _column_cells(html, 2))
    assert sum("background" in cell for cell in _column_cells(html, 0)) == 3  # scored tokens only
    assert sum("background" in cell for cell in _column_cells(html, 1)) == 3
    # the prompt x output matrix uses the same cells
    matrix = matrix_table_html(np.array([[np.nan, 0.2, -0.1, 0.05, np.nan]]), ["out"], TOKENS, SPECIAL, 0)
    assert matrix.count("background") == 3 and matrix.count("<td") == 5


def _example(value: float) -> PreparedExample:
    return PreparedExample(text="a fine film", input_ids=[1, 5, 6, 7, 2], special=list(SPECIAL), tokens=list(TOKENS),
                           kind="prob", label=1, original_value=value)


def test_an_explanation_leaves_an_intervention_at_the_noise_floor_unshaded():
    scores = {"integrated_gradients": TokenScores("integrated_gradients", [torch.tensor([0.5, 0.07, -0.02, 0.01, 0.4])]),
              "loo_delete": TokenScores("loo_delete", [torch.tensor([float("nan"), 2e-8, -1e-8, 1e-8, float("nan")])]),
              "loo_mask": TokenScores("loo_mask", [torch.tensor([float("nan"), 0.0033, 0.001, -0.0002, float("nan")])])}
    ex = Explanation(model="tiny", examples=(_example(0.5),), scores=scores, flags=())
    html = ex._repr_html_()
    table = html[html.index("<table"):]
    assert "max |s| 2e-08" in table and "not shaded: at the target" in table
    assert all("background" not in cell for cell in _column_cells(table, 1))
    assert sum("background" in cell for cell in _column_cells(table, 2)) == 3  # above the floor: shaded, scale stated
    assert "max |s| 0.0033" in table


# --------------------------------------------------------------------------- attention maps


def _padded_maps(pm, texts, *, left=False):
    batch = pm.encode(texts)
    if left:  # the same rows, padding moved to the front
        ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
        for r in range(ids.shape[0]):
            n = int(mask[r].sum())
            ids[r] = torch.cat([ids[r, n:], ids[r, :n]])
            mask[r] = torch.cat([mask[r, n:], mask[r, :n]])
        batch = {"input_ids": ids, "attention_mask": mask}
    with probe.capture(pm) as cap:
        pm.model(**batch)
    return cap.maps(), batch


def test_attention_maps_keep_their_tokens_and_mask_and_plot_without_padding(loaded):
    pm = loaded("bert")
    maps, batch = _padded_maps(pm, ["good", "a very good film indeed"])
    assert maps.attention_mask is not None and maps.tokens is not None
    assert torch.equal(maps.attention_mask, batch["attention_mask"].bool())
    assert list(maps.tokens[0]) == pm.tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    n = int(batch["attention_mask"][0].sum())
    assert n < maps.weights.shape[-1]
    fig = maps.plot(0, 0, example=0)
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (n, n)
    assert np.allclose(image, maps.weights[0, 0, 0, :n, :n].numpy())
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == list(maps.tokens[0][:n]) and pm.tokenizer.pad_token not in labels
    assert texts_outside_canvas(fig) == []


@pytest.mark.parametrize("left", [False, True])
def test_bertviz_gets_the_real_positions_only(loaded, left):
    pytest.importorskip("bertviz")
    pm = loaded("gpt2")
    maps, batch = _padded_maps(pm, ["hello", "hello world this is a test"], left=left)
    real = [k for k in range(batch["input_ids"].shape[1]) if batch["attention_mask"][0, k]]
    assert len(real) < maps.weights.shape[-1]
    html = maps.to_bertviz(0).data
    params = json.loads(re.search(r"const params = (\{.*?\});", html, re.DOTALL).group(1))
    shown = np.array(params["attention"][0]["attn"])  # [layer, head, query, key]
    index = torch.tensor(real)
    assert shown.shape[-1] == len(real)
    assert np.allclose(shown, maps.weights[0][:, :, index][:, :, :, index].numpy(), atol=1e-6)
    words = pm.tokenizer.convert_ids_to_tokens(batch["input_ids"][0, index].tolist())
    assert len(params["attention"][0]["left_text"]) == len(words)
    # the row's tokens given without their padding label the same positions
    again = maps.to_bertviz(0, words).data
    assert json.loads(re.search(r"const params = (\{.*?\});", again, re.DOTALL).group(1))["attention"][0][
        "left_text"] == params["attention"][0]["left_text"]


# --------------------------------------------------------------------------- study and verdict pictures


def _frame(shift: float) -> pd.DataFrame:
    mean = np.full(6, 0.1) + shift
    return pd.DataFrame({"layer": range(6), "mean": mean, "ci_low": mean - 0.08, "ci_high": mean + 0.08})


def test_study_plot_ci_bars_are_dodged_not_filled():
    """Overlapping CI bands of several explainers made one brown area."""
    from matplotlib.collections import LineCollection, PolyCollection

    names = ["attention_mean", "rollout", "flow", "alti"]
    fig = layer_lines_figure({"loo": {n: _frame(0.005 * i) for i, n in enumerate(names)}}, {}, {}, "kendall_tau")
    ax = fig.axes[0]
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]  # no filled band
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(bars) == len(names)
    at_layer_0 = [min(seg[0][0] for seg in c.get_segments() if abs(seg[0][0]) < 0.5) for c in bars]
    assert len(set(np.round(at_layer_0, 6))) == len(names) and max(map(abs, at_layer_0)) < 0.5
    lines = [line for line in ax.get_lines() if line.get_label() in names]
    assert all(list(line.get_xdata()) == list(range(6)) for line in lines)  # the means stay at the layers
    assert texts_outside_canvas(fig) == []


def _unit(name: str, mean: float) -> dict:
    return {"unit": name, "mean": mean, "ci": [mean - 0.05, mean + 0.05], "tracks": mean > 0.2, "n": 10}


def test_verdict_plot_shows_the_best_and_worst_units_across_families():
    """It drew all six layers of one method (the headline family's best three and worst three)."""
    own = [_unit(f"attention_mean L{i}", 0.1 + 0.02 * i) for i in range(6)]
    data = {
        "answer": "yes", "headline": "h", "reference": "loo_delete", "measure": "kendall_tau",
        "layer_units": {"tracking": 1, "total": 6}, "head_units": {"tracking": 0, "total": 12},
        "best": [_unit("rollout L2", 0.5), _unit("attention_mean L5", 0.2), _unit("attention_mean L3.H1", 0.19)],
        "worst": [_unit("alti L0", -0.3), _unit("attention_mean L0.H2", -0.1), _unit("rollout L0", -0.05)],
        "best_layers": own[::-1][:3], "worst_layers": own[:3],
        "families": {"attention weights": {"methods": ["attention_mean"], "best_layer": _unit("attention_mean L5", 0.2),
                                           "best_head": _unit("attention_mean L3.H1", 0.19)},
                     "attention-derived": {"methods": ["rollout"], "best_layer": _unit("rollout L2", 0.5)},
                     "context mixing": {"methods": ["alti"], "best_layer": _unit("alti L4", 0.1)}},
        "random": {"mean": 0.0, "ci": [-0.02, 0.02]},
    }
    fig = Verdict.from_dict(data).plot()
    ax = fig.axes[0]
    labels = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    units = [label.split(" (")[0] for label in labels]
    assert units == ["rollout L2", "attention_mean L5", "attention_mean L3.H1", "alti L0", "attention_mean L0.H2",
                     "rollout L0", "alti L4"]
    assert "attention_mean L1" not in units  # not every layer of the headline family's method
    assert any("worst" in label for label in labels) and any("context mixing: best" in label for label in labels)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"attention weights", "attention-derived", "context mixing"} <= set(legend)
    assert any(t.startswith("random ") for t in legend)
    assert sum(len(c.lines[0].get_xdata()) for c in ax.containers) == len(units)
    assert "across methods and families" in fig.get_suptitle()
    assert texts_outside_canvas(fig) == []


def test_a_plot_names_the_explainers_it_cannot_draw():
    """run.plot() and verdict.plot() dropped a token-level explainer (saliency: no layer axis) without a word."""
    from probe.report.lines import summary_left_out

    rows = [("explainer", "attention_mean", layer, -1) for layer in range(3)]
    rows += [("explainer", "saliency", -1, -1), ("explainer", "input_x_gradient", -1, -1), ("baseline", "random", -1, -1)]
    summary = pd.DataFrame([{"role": role, "explainer": e, "reference": "loo_delete", "measure": "kendall_tau",
                             "layer": layer, "head": head, "n": 10, "mean": 0.1, "std": 0.1, "ci_low": 0.0,
                             "ci_high": 0.2, "sig_frac": 0.0} for role, e, layer, head in rows])
    assert summary_left_out(summary, "loo_delete", "kendall_tau", ["attention_mean", "input_x_gradient"]) == ["saliency"]
    note = "not drawn (no layer axis, or no layer-level rows): saliency; run.to_pandas() has them"
    fig = layer_lines_figure({"loo_delete": {"attention_mean": _frame(0.0)}}, {}, {}, "kendall_tau", note=note)
    assert [t.get_text().replace("\n", " ") for t in fig.texts] == [note]
    assert texts_outside_canvas(fig) == []
    data = {"answer": "no", "headline": "h", "reference": "loo_delete", "measure": "kendall_tau",
            "layer_units": {"tracking": 0, "total": 2}, "head_units": {"tracking": 0, "total": 0},
            "best": [_unit("attention_mean L1", 0.1)], "worst": [_unit("attention_mean L0", -0.1)], "families": {},
            "best_gradient": {"explainer": "integrated_gradients", "mean": 0.3, "ci": [0.2, 0.4]},
            "gradient_bar": {"excluded": {"input_x_gradient": ["sign"]}}}
    fig = Verdict.from_dict(data).plot()
    said = " ".join(t.get_text().replace("\n", " ") for t in fig.texts)
    assert "token-level explainers (no layer axis) other than the best gradient, integrated_gradients" in said
    assert "input_x_gradient (sign)" in said and texts_outside_canvas(fig) == []
    data["token_level"] = ["saliency", "integrated_gradients", "input_x_gradient"]  # as verdict.json records them
    said = " ".join(t.get_text().replace("\n", " ") for t in Verdict.from_dict(data).plot().texts)
    assert "token-level explainers (no layer axis): saliency (integrated_gradients, the best gradient, is the dashed" in said
    assert "input_x_gradient (sign)" in said and "saliency, " not in said
    data.update(token_level=["integrated_gradients"], gradient_bar={"excluded": {}})
    assert not [t for t in Verdict.from_dict(data).plot().texts if "not drawn" in t.get_text()]  # nothing left out
