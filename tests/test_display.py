"""How results show themselves in a notebook: short reprs, self-contained HTML, matplotlib figures
with nothing outside the canvas, and word-level tables whose numbers are the token-level ones summed."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.display import clean_token, shown_token
from probe.errors import InputError
from probe.explanation import Explanation
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample
from probe.study.verdict import Verdict

from figure_checks import texts_outside_canvas

HTML_TEXT = "a gripping <b>& unwatchable film"
TEXTS = [HTML_TEXT, "the plot is not good and the acting is worse"]
METHODS = ["attention_mean", "integrated_gradients", "loo_delete"]
TAG = re.compile(r"<[^>]*>")


@pytest.fixture(scope="module")
def pm():
    return probe.load_model("builtin:minilm-rt")


@pytest.fixture(scope="module")
def ex(pm):
    return probe.explain(pm, TEXTS, methods=METHODS, params={"integrated_gradients": {"steps": 8}})


# --------------------------------------------------------------------------- reprs


def test_explanation_and_model_reprs_are_short_and_say_what_they_hold(ex, pm):
    text = repr(ex)
    assert text == ("<Explanation builtin:minilm-rt: 2 texts x 3 methods (attention_mean, integrated_gradients "
                    "(baseline pad, specials replaced), loo_delete)>")
    assert str(ex) == text
    for value in (pm, pm.contract, ex["integrated_gradients"], ex["attention_mean"]):
        shown = repr(value)
        assert len(shown) < 300 and shown.count("\n") <= 2, shown
    assert repr(pm).startswith("<ProbeModel builtin:minilm-rt: bert classification, 6 layers x 12 heads (MHA)")
    assert "encoder 6 layers x 12 heads" in repr(pm.contract)
    assert repr(ex["attention_mean"]).startswith("<TokenScores attention_mean: 2 examples, [layer, token] (6x")
    assert "steps=8" in repr(ex["integrated_gradients"])
    assert repr(ex["integrated_gradients"]).startswith("<TokenScores integrated_gradients (baseline pad, specials "
                                                       "replaced): 2 examples")


def test_every_view_names_the_settings_that_differ_from_captum(pm, ex):
    """IG's baseline at [CLS]/[SEP] too and saliency's L2 norm are named in the HTML, the params and the
    tables' attrs; the method column keeps the names."""
    label = "integrated_gradients (baseline pad, specials replaced)"
    assert ex["integrated_gradients"].label == ex["integrated_gradients"].params["label"] == label
    assert label in TAG.sub("", ex._repr_html_())
    for level in ("token", "word"):
        frame = ex.to_pandas(level)
        assert frame.attrs["labels"] == {"attention_mean": "attention_mean", "integrated_gradients": label,
                                         "loo_delete": "loo_delete"}
        assert set(frame["method"]) == set(METHODS)
    assert ex["integrated_gradients"].to_pandas().attrs["label"] == label
    kept = probe.explain(pm, TEXTS[:1], methods=["saliency", "integrated_gradients"],
                         params={"integrated_gradients": {"steps": 4, "keep_special": True, "baseline": "zero"}})
    assert [s.label for s in kept.scores.values()] == ["saliency (L2)",
                                                       "integrated_gradients (baseline zero, specials kept)"]


def test_intervention_and_capture_reprs(pm, ex):
    heads = probe.head_ablation(pm, ex)
    importance = probe.head_importance(pm, ex, ablation=False)
    uniform = probe.counterfactual_attention(pm, ex, "uniform", layer=-1)
    batch = pm.encode(TEXTS)
    with probe.capture(pm, queries="first", attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    maps = cap.maps()
    for value in (heads, importance, uniform, maps):
        shown = repr(value)
        assert len(shown) < 300 and shown.count("\n") <= 2, shown
    mean = heads.mean_abs_change
    layer, head = divmod(int(mean.argmax()), mean.shape[1])
    assert repr(heads).startswith("<HeadEffects encoder: 2 examples x 6 layers x 12 heads")
    assert f"L{layer}.H{head}" in repr(heads)
    assert "with single-head ablation" not in repr(importance)
    assert repr(uniform).startswith("<CounterfactualResult uniform at encoder L5 heads 0-11: 2 examples x 1 samples")
    assert repr(maps).startswith("<AttentionMaps encoder: batch 2 x layer 6 x head 12 x query 1 x key ")


def test_a_hundred_heads_and_long_params_stay_short():
    scores = TokenScores("x", [torch.zeros(40, 100, 7)] * 50, params={"note": "y" * 400}, per_head=True)
    assert len(repr(scores)) < 300
    assert repr(scores).endswith(">")


# --------------------------------------------------------------------------- HTML


def test_explanation_html_escapes_tokens_and_shades_by_score(ex):
    html = ex._repr_html_()
    assert "<script" not in html and "src=" not in html and "href=" not in html
    assert "&lt;b&gt;&amp; unwatchable" in html  # the text, escaped
    assert "<b>& unwatchable" not in html
    text_of_cells = TAG.sub("|", html)
    for token in ("&lt;", "&amp;", "gripping", "un", "watch"):
        assert f"|{token}|" in text_of_cells or token in text_of_cells
    # one block per example, word pieces keep their "##" (issue 43: recognisable), special tokens greyed
    assert html.count("example 0:") == 1 and html.count("example 1:") == 1
    assert "|##watch|" in TAG.sub("|", html)
    assert re.search(r'<td style="color:#9a9a9a;font-style:italic" title="\[CLS\]">\[CLS\]</td>', html)
    # shading follows the scores: the loo_delete column of example 0, the cells' alpha ranks as the scores do
    block = html.split("example 0:")[1].split("example 1:")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", block)[1:]  # the header row first
    column = 1 + 1 + METHODS.index("loo_delete")
    values, alphas = [], []
    for row in rows:
        cells = re.findall(r"<td([^>]*)>(.*?)</td>", row)
        style, number = cells[column]
        if "background" in style:
            values.append(float(number))
            alphas.append(float(re.search(r"rgba\([^)]*, ([0-9.]+)\)", style).group(1))
                          * (1 if "214, 69, 65" in style else -1))
    scores = ex["loo_delete"].scores[0].numpy()
    assert len(values) == int(np.isfinite(scores).sum())
    assert np.all(np.diff(np.array(alphas)[np.argsort(values, kind="stable")]) >= -1e-9)
    assert max(abs(a) for a in alphas) == pytest.approx(0.85)


def test_explanation_html_shows_five_examples_and_counts_the_rest():
    examples = tuple(PreparedExample(text=f"text {i}", input_ids=[1, 2, 3], special=[True, False, True],
                                     tokens=["[CLS]", "##x", "[SEP]"], kind="prob", label=0) for i in range(8))
    ex = Explanation(model="m", examples=examples, scores={"s": TokenScores("s", [torch.tensor([0.0, 1.0, 2.0])] * 8)})
    html = ex._repr_html_()
    assert html.count("<table") == 5 and "and 3 more examples" in html
    assert "example 5:" not in html


def test_verdict_study_and_audit_html(study_result, pm):
    verdict = study_result.verdict
    html = verdict._repr_html_()
    assert verdict.answer in html and TAG.sub("", html).count(verdict.headline.split(":")[0].replace("'", "&#x27;")) >= 1
    table = verdict.to_pandas()
    for family in table["family"]:
        assert family in html
    assert f"{table['best_layer_mean'].iloc[0]:.3f}" in html
    assert len(repr(verdict)) < 300 and repr(verdict).startswith(f"<Verdict {verdict.answer}")
    study_html = study_result._repr_html_()
    assert html in study_html and "summary: highest mean" in study_html
    assert len(repr(study_result)) < 300 and repr(study_result).startswith("<StudyResult tiny-display")

    audit = probe.audit({"model": {"id": "builtin:minilm-rt"}, "data": {"texts": TEXTS * 2},
                         "claims": [{"claim": "Head 5.9 <matters>", "kind": "head_role", "head": "5.9"}]}, model=pm)
    shown = audit._repr_html_()
    claim = audit.claims[0]
    assert "Head 5.9 &lt;matters&gt;" in shown and "<matters>" not in shown
    assert claim.verdict in shown and f"{claim.effect:.3f}" in shown
    first, *reasons = repr(audit).splitlines()
    assert first == f"<AuditResult builtin:minilm-rt: 1 claim (1 {claim.verdict})>"
    # 4 texts: too few to decide, and the repr and the table say so
    assert claim.verdict == "inconclusive" and len(reasons) == 1
    assert reasons[0].startswith("# claim 1 inconclusive: n = 4, at least 10 needed")
    assert "n = 4, at least 10 needed" in shown


def test_attention_maps_html_gives_the_shapes(pm):
    batch = pm.encode(TEXTS)
    with probe.capture(pm, attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    maps = cap.maps()
    html = maps._repr_html_()
    assert " x ".join(map(str, maps.weights.shape)) in html and "[batch, layer, head, query, key]" in html


def test_attention_maps_go_to_bertviz_without_padding(pm):
    """bertviz's head view gets every captured layer of the row's own tokens: the numbers it embeds
    are the captured weights of the unpadded block."""
    import json

    pytest.importorskip("bertviz")
    batch = pm.encode(["a fine film", TEXTS[1]])
    with probe.capture(pm, attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    maps = cap.maps()
    row = int(batch["attention_mask"].sum(1).argmin())
    n = int(batch["attention_mask"][row].sum())
    assert n < maps.weights.shape[-1]  # the shorter row is padded
    tokens = pm.tokenizer.convert_ids_to_tokens(batch["input_ids"][row, :n].tolist())
    html = maps.to_bertviz(row, tokens).data
    params = json.loads(re.search(r"const params = (\{.*?\});", html, re.DOTALL).group(1))
    shown = np.array(params["attention"][0]["attn"])  # [layer, head, query, key]
    assert shown.shape == (len(maps.layers), len(maps.heads), n, n)
    assert np.allclose(shown, maps.weights[row, :, :, :n, :n].numpy(), atol=1e-6)
    assert params["attention"][0]["left_text"] == [clean_token(t) for t in tokens]
    assert "bertviz" in maps.to_bertviz(1 - row, view="model").data
    with probe.capture(pm, queries="first", attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    with pytest.raises(InputError, match="queries=None"):
        cap.maps().to_bertviz(0)
    with pytest.raises(InputError, match="view='head'"):
        maps.to_bertviz(0, view="neuron")


# --------------------------------------------------------------------------- plots


def test_explanation_plot_has_a_panel_per_method_and_the_tokens(ex):
    fig = ex.plot(0)
    assert len(fig.axes) == len(METHODS)
    labels = [t.get_text() for t in fig.axes[-1].get_xticklabels()]
    assert labels == [shown_token(t) for t in ex.examples[0].tokens]
    assert "##watch" in labels and "<" in labels
    assert fig.axes[0].get_ylabel() == "attention_mean (last layer)"
    assert texts_outside_canvas(fig) == []
    fig = ex.plot(1, methods=["loo_delete"])
    assert len(fig.axes) == 1 and texts_outside_canvas(fig) == []
    with pytest.raises(InputError, match="example=7"):
        ex.plot(7)


def test_explanation_plot_at_word_level_folds_the_tokens_as_the_table_does(ex):
    fig = ex.plot(0, methods=["loo_delete"], level="word")
    words = ex.word_groups(0)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [text for text, _ in words]
    assert "##watch" not in [t.get_text() for t in fig.axes[0].get_xticklabels()]  # joined into its word
    table = ex.to_pandas("word")
    table = table[(table.example == 0) & (table.method == "loo_delete")]
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    assert len(heights) == len(words) == len(table)
    np.testing.assert_allclose(np.nan_to_num(heights), np.nan_to_num(table.score.to_numpy()), atol=1e-6)
    assert texts_outside_canvas(fig) == []
    with pytest.raises(InputError, match="level='span'"):
        ex.plot(0, level="span")


def test_top_tokens_at_word_level_ranks_the_words_as_the_table_folds_them(ex):
    top = ex.top_tokens(3, method="loo_delete", example=0, level="word")
    table = ex.to_pandas("word")
    table = table[(table.example == 0) & (table.method == "loo_delete")].dropna(subset=["score"])
    words = ex.word_groups(0)
    assert [w for _, w, _ in top] == [words[i][0] for i, _, _ in top]  # the index is the word's place
    expected = table.sort_values("score", ascending=False, kind="stable").head(3)
    np.testing.assert_allclose([s for _, _, s in top], expected.score.to_numpy(), atol=1e-6)
    assert "##watch" not in [w for _, w, _ in ex.top_tokens(20, method="loo_delete", example=0, level="word")]
    with pytest.raises(InputError, match="level='span'"):
        ex.top_tokens(3, method="loo_delete", level="span")


def test_the_notebook_table_at_word_level_has_a_row_per_word(ex):
    table = ex.word_table()
    html = table._repr_html_()
    words = ex.word_groups(0)
    assert "unwatchable" in html and "##watch" not in html  # the word, not its pieces
    assert html.count("<tr") >= sum(len(ex.word_groups(i)) for i in range(len(ex.examples)))
    assert "folded by sum" in html and "word table" in repr(table)
    label = ex["loo_delete"].label
    folded = table.tables[0][3][next(k for k in table.tables[0][3] if k.startswith(label))]
    frame = ex.to_pandas("word")
    frame = frame[(frame.example == 0) & (frame.method == "loo_delete")]
    np.testing.assert_allclose(np.nan_to_num(folded), np.nan_to_num(frame.score.to_numpy()), atol=1e-6)
    assert len(folded) == len(words)


def test_attention_maps_plot_is_a_query_key_heatmap(pm):
    batch = pm.encode(TEXTS)
    with probe.capture(pm, attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    maps = cap.maps()
    tokens = pm.tokenizer.convert_ids_to_tokens(batch["input_ids"][1].tolist())
    fig = maps.plot(layer=2, head=3, example=1, tokens=tokens)
    image = fig.axes[0].get_images()[0]
    assert np.allclose(image.get_array(), maps.weights[1, 2, 3].numpy())
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [clean_token(t) for t in tokens]
    assert len(fig.axes) == 2  # the map and its colour bar
    assert texts_outside_canvas(fig) == []
    assert texts_outside_canvas(maps.plot(0, 0)) == []
    with pytest.raises(InputError, match="layer 9"):
        maps.plot(9, 0)


def test_gpt2_maps_and_scores_plot_inside_the_canvas(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, ["hello world, this is a test"], methods=["attention_mean", "saliency"])
    assert texts_outside_canvas(ex.plot()) == [] and len(ex.plot().axes) == 2
    batch = pm.encode(["hello world"])
    with probe.capture(pm, queries="last", attention_mask=batch["attention_mask"]) as cap:
        pm.model(**batch)
    fig = cap.maps().plot(0, 0, tokens=pm.tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist()))
    assert texts_outside_canvas(fig) == []


@pytest.fixture(scope="module")
def study_result(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("display")
    texts = ["good movie", "bad film", "great story", "terrible acting", "fun plot", "boring ending",
             "very funny film", "awful slow movie"]
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(8)]}).to_csv(root / "d.csv", index=False)
    study = probe.study_from_dict({
        "name": "tiny-display", "model": {"id": str(tiny_dirs["bert"])},
        "dataset": {"name": str(root / "d.csv"), "n": 8, "seed": 0},
        "explainers": ["attention_mean", "rollout", "saliency"], "references": ["loo_delete"],
        "metrics": {"erasure": None, "counterfactual": None, "heads": None}, "statistics": {"bootstrap": 100},
    })
    return probe.run_study(study, out=root / "out", report=False)


def test_study_and_verdict_plots_draw_the_layers_and_the_random_baseline(study_result):
    fig = study_result.plot()
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    labels = ax.get_legend().get_texts()
    names = [t.get_text() for t in labels]
    assert any(n.startswith("attention_mean") for n in names) and any(n.startswith("rollout") for n in names)
    assert any(n.startswith("random ") for n in names) and any("best gradient (saliency)" in n for n in names)
    n_layers = study_result.contract["n_layers"]
    line = next(line for line in ax.get_lines() if line.get_label() == "attention_mean")
    assert list(line.get_xdata()) == list(range(n_layers))
    assert texts_outside_canvas(fig) == []

    verdict = study_result.verdict
    fig = verdict.plot()
    names = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(n.startswith("random ") for n in names)
    recorded = {u["unit"] for u in (*verdict.best, *verdict.worst)}
    drawn = sum(len(c.lines[0].get_xdata()) for c in fig.axes[0].containers)  # one errorbar per family
    assert drawn >= len(recorded) >= 1  # the best and worst, and each family's best layer and head
    assert texts_outside_canvas(fig) == []
    # its one token-level explainer is the best gradient, drawn as the dashed line: nothing is left out
    assert verdict.data["token_level"] == ["saliency"] and verdict.best_gradient["explainer"] == "saliency"
    assert not [t for t in fig.texts if "not drawn" in t.get_text()]
    with pytest.raises(InputError, match="loo_mask"):
        study_result.plot("loo_mask")


def test_a_verdict_without_layer_units_says_so():
    verdict = Verdict.from_dict({"answer": "undecidable", "headline": "h", "reference": "loo_delete",
                                 "measure": "kendall_tau", "layer_units": {}, "head_units": {}})
    with pytest.raises(InputError, match="no layer-level unit"):
        verdict.plot()
    assert "undecidable" in verdict._repr_html_()


# --------------------------------------------------------------------------- word level


def test_word_level_sums_the_tokens_of_each_word(ex, pm):
    tokens = ex.to_pandas()
    assert list(tokens.columns) == ["example", "position", "token", "clean_token", "special", "method", "layer",
                                    "head", "score"]
    assert (tokens["clean_token"] == [clean_token(t) for t in tokens["token"]]).all()
    words = ex.to_pandas(level="word")
    assert list(words.columns) == ["example", "word_index", "word", "first_position", "n_tokens", "special", "method",
                                   "layer", "head", "score"]
    first = ex.examples[0].tokens
    assert any(t.startswith("##") for t in first), first  # the text has a word of several pieces
    assert "unwatchable" in set(words[words.example == 0]["word"])
    # every (example, method, layer, head) total is the same at both levels (NaN-aware sums)
    keys = ["example", "method", "layer", "head"]
    t = tokens.groupby(keys)["score"].sum(min_count=1)
    w = words.groupby(keys)["score"].sum(min_count=1)
    pd.testing.assert_series_equal(t, w, check_exact=False, rtol=1e-5, atol=1e-6)
    # and word by word: the word's tokens' scores summed
    for (_, row) in words[(words.method == "integrated_gradients")].iterrows():
        span = tokens[(tokens.method == "integrated_gradients") & (tokens.example == row.example)
                      & (tokens.position >= row.first_position) & (tokens.position < row.first_position + row.n_tokens)]
        assert row.score == pytest.approx(span.score.sum(), abs=1e-6)
    # special tokens are words of their own; a word whose tokens are all NaN is NaN
    loo = words[words.method == "loo_delete"]
    assert loo[loo.special]["word"].isin(["[CLS]", "[SEP]"]).all() and loo[loo.special]["score"].isna().all()
    assert loo[~loo.special]["score"].notna().all()
    maxed = ex.to_pandas(level="word", agg="max")
    row = maxed[(maxed.method == "integrated_gradients") & (maxed.word == "unwatchable")].iloc[0]
    span = tokens[(tokens.method == "integrated_gradients") & (tokens.example == 0)
                  & (tokens.position >= row.first_position) & (tokens.position < row.first_position + row.n_tokens)]
    assert row.score == pytest.approx(span.score.max())
    with pytest.raises(InputError, match="level="):
        ex.to_pandas(level="sentence")
    with pytest.raises(InputError, match="agg="):
        ex.to_pandas(level="word", agg="median")


def test_word_level_without_the_tokenizer_splits_at_the_markers():
    example = PreparedExample(text="un bel ievable x", input_ids=[1, 2, 3, 4, 5, 6], special=[True] + [False] * 4 + [True],
                              tokens=["[CLS]", "un", "##bel", "##ievable", "x", "[SEP]"], kind="prob", label=0)
    scores = TokenScores("s", [torch.tensor([float("nan"), 1.0, float("nan"), 2.0, 5.0, 0.5])])
    words = Explanation(model="m", examples=(example,), scores={"s": scores}).to_pandas(level="word")
    assert list(words["word"]) == ["[CLS]", "unbelievable", "x", "[SEP]"]
    assert list(words["n_tokens"]) == [1, 3, 1, 1]
    assert math.isnan(words["score"].iloc[0]) and list(words["score"].iloc[1:]) == [3.0, 5.0, 0.5]
    assert list(words["special"]) == [True, False, False, True]


def test_gpt2_words_from_the_tokenizer(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, ["hello wonderful world"], methods=["saliency"])
    words = ex.to_pandas(level="word")
    tokens = ex.to_pandas()
    assert words["score"].sum() == pytest.approx(tokens["score"].sum(), rel=1e-5)
    assert "Ġ" not in "".join(words["word"]) and "Ġ" not in "".join(tokens["clean_token"])
