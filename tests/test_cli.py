"""`probe explain`: every method side by side, its JSON, and its one-line errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from probe.errors import InputError
from probe.methods import applicable_methods, parse_methods, run_methods
from probe.models.loading import load_model
from probe.names import ALL_METHODS
from probe.rows.prepare import prepare


def _cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_parse_methods():
    assert parse_methods("saliency, loo_mask") == ["saliency", "loo_mask"]
    assert parse_methods("all") == list(ALL_METHODS)
    with pytest.raises(InputError, match="valid methods are attention"):
        parse_methods("saliency,telepathy")


def test_every_applicable_method_on_a_tiny_classifier(tiny_dirs):
    pm = load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the movie was good", "bad film , not fun"])
    methods, skipped = applicable_methods(pm, examples)
    assert "loo_lm" in skipped and "loo_mask" in methods
    results = run_methods(pm, examples, methods, params={"integrated_gradients": {"steps": 8}})
    for name, scores in results.items():
        for example, values in zip(examples, scores.scores):
            assert values.shape[-1] == len(example.input_ids), name
            if scores.per_head:
                assert values.shape[:2] == (pm.contract.n_layers, pm.contract.n_heads), name
            if name.startswith("loo"):
                assert all(math.isnan(float(values[i])) == example.special[i] for i in range(len(values))), name


@pytest.mark.parametrize("kind, extra", [("bert", []), ("gpt2", ["--continuation", "good movie"])])
def test_explain_json(tiny_dirs, kind, extra):
    result = _cli("explain", str(tiny_dirs[kind]), "the movie was good", "--json", "--steps", "4", *extra)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= {"model_path", "tokens", "token_ids", "target", "scores"}
    assert set(data["target"]) == {"label", "kind", "value"}
    n = len(data["tokens"])
    pm = load_model(data["model_path"])
    special = [t in pm.tokenizer.all_special_tokens for t in data["tokens"]]
    assert "saliency" in data["scores"] and "loo_delete" in data["scores"]
    assert len(data["scores"]["attention"]) == pm.contract.n_layers
    assert len(data["scores"]["attention"][0]) == pm.contract.n_heads
    assert len(data["scores"]["attention"][0][0]) == n
    for name in ("saliency", "loo_delete", "integrated_gradients"):
        values = data["scores"][name]
        assert len(values) == n
        assert [v is None for v in values] == special, name
    if kind == "gpt2":
        assert data["target"]["label"] == "good movie" and data["target"]["kind"] == "logprob"
        assert "loo_lm" in data["scores"]


@pytest.mark.parametrize("args, message", [
    (["--methods", "attention,oracle"], "unknown method 'oracle': valid methods are"),
    (["--label", "7"], "label 7 is out of range"),
    (["--label", "happy"], "unknown label 'happy'"),
    (["--methods", "loo_lm"], "loo_lm needs"),
    (["--target", "odds"], "unknown target kind"),
])
def test_explain_errors_on_classifier(tiny_dirs, args, message):
    result = _cli("explain", str(tiny_dirs["bert"]), "the movie was good", *args)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize("args, message", [
    (["--methods", "loo_mask"], "needs a mask token"),
    (["--continuation", " "], "tokenises to nothing"),
])
def test_explain_errors_on_causal_lm(tiny_dirs, args, message):
    result = _cli("explain", str(tiny_dirs["gpt2"]), "the movie was good", *args)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_explain_on_the_builtin_classifier(builtin_cache):
    result = _cli("explain", "builtin:minilm-rt", "a gripping , funny and quietly moving film", "--json",
                  "--methods", "attention,rollout,saliency,integrated_gradients,loo_delete,loo_mask", "--steps", "20")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["target"]["label"] == "positive" and data["target"]["value"] > 0.8
    assert data["tokens"][0] == "[CLS]" and data["scores"]["loo_mask"][0] is None
    scored = [v for v in data["scores"]["loo_mask"] if v is not None]
    assert len(scored) == len(data["tokens"]) - 2


def test_explain_table_names_the_settings_and_blanks_the_specials_json_leaves_null(tiny_dirs):
    """The table's headers name what differs from captum (saliency's L2 norm, IG's baseline at the
    special tokens too); a special token's cell is ``-`` exactly where ``--json`` gives null."""
    args = ["explain", str(tiny_dirs["bert"]), "the movie was good", "--methods",
            "attention_mean,saliency,integrated_gradients", "--steps", "4"]
    env = {"COLUMNS": "200"}
    table = subprocess.run([sys.executable, "-m", "probe.cli", *args], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "saliency (L2)" in out and "integrated gradients (baseline pad, specials replaced)" in out
    data = json.loads(_cli(*args, "--json").stdout)
    assert data["labels"]["saliency"] == "saliency (L2)"
    rows = [[c.strip() for c in line.split("\u2502")[1:-1]] for line in out.splitlines() if line.startswith("\u2502")]
    gradient = [cells for cells in rows if len(cells) == 3]  # the gradient table's: token, saliency, IG
    assert len(gradient) == len(data["tokens"])
    for i, (token, *cells) in enumerate(gradient):
        assert token.startswith(data["tokens"][i])
        for name, cell in zip(("saliency", "integrated_gradients"), cells):
            assert (cell == "-") == (data["scores"][name][i] is None), (token, name, cell)
    assert any(v is None for v in data["scores"]["saliency"])  # [CLS] and [SEP]


@pytest.mark.slow
def test_explain_words_shows_a_row_per_word_its_tokens_summed(tiny_dirs, builtin_cache):
    """``--words``: the table and the JSON at word level, each word's scores the sum of its tokens' (as
    ``to_pandas("word")`` folds them); refused with --generate."""
    text = "a gripping and unwatchable film"  # "unwatchable": several word pieces of MiniLM's
    args = ["explain", "builtin:minilm-rt", text, "--methods", "attention_mean,saliency,loo_delete", "--json"]
    tokens, words = json.loads(_cli(*args).stdout), json.loads(_cli(*args, "--words").stdout)
    assert tokens["level"] == "token" and words["level"] == "word"
    from probe.api import explain

    ex = explain(load_model(tokens["model_path"]), [text], methods=["attention_mean", "saliency", "loo_delete"])
    groups = ex.word_groups(0)
    assert words["tokens"] == [w for w, _ in groups] and len(words["tokens"]) < len(tokens["tokens"])
    assert words["token_ids"] == [[tokens["token_ids"][i] for i in g] for _, g in groups]
    for name in ("saliency", "loo_delete"):
        for value, (_, group) in zip(words["scores"][name], groups):
            parts = [tokens["scores"][name][i] for i in group if tokens["scores"][name][i] is not None]
            assert (value is None) == (not parts) and (value is None or value == pytest.approx(sum(parts), abs=1e-5))
    table = _cli(*args[:-1], "--words")
    assert table.returncode == 0 and words["tokens"][1] in table.stdout
    refused = _cli("explain", str(tiny_dirs["gpt2"]), "the movie", "--generate", "2", "--words")
    assert refused.returncode == 2 and "--words" in refused.stderr and "Traceback" not in refused.stderr


def test_explain_help_keeps_its_square_brackets():
    """rich read ``[prompt token x output token]`` and ``logit[label]`` as markup and dropped them."""
    result = subprocess.run([sys.executable, "-m", "probe.cli", "explain", "--help"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    text = " ".join(line.strip(" │") for line in result.stdout.splitlines())
    assert "[prompt token x output token] table" in text
    assert "logit[label] - logit[contrast label]" in text
