"""Study files: schema, defaults, one-line errors with line numbers, overrides, fingerprint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic
import pytest
import yaml

from probe.errors import InputError
from probe.names import ALL_METHODS
from probe.spec.study import (
    CounterfactualSpec,
    ErasureSpec,
    HeadsSpec,
    MetricsSpec,
    StatisticsSpec,
    Study,
    load_study,
    parse_ranking,
    study_from_dict,
)

QUICKSTART = """\
name: quickstart
description: MiniLM fine-tuned on rotten_tomatoes; does attention track leave-one-out?
model:
  id: builtin:minilm-rt
  device: cpu
  dtype: fp32
dataset:
  name: builtin:rotten_tomatoes
  split: test
  n: 200
  seed: 0
  max_length: 128
  filters: {min_words: 3}
target: {kind: prob}
explainers: [attention, attention_mean, rollout, flow, attn_norm, attn_grad, saliency, input_x_gradient, integrated_gradients, gradient_shap]
references: [loo_delete, loo_mask, loo_pad, loo_random]
params:
  integrated_gradients: {steps: 50}
metrics:
  top_k: [1, 3, 5]
  erasure: {rankings: [attention_mean@last, rollout, saliency, loo_mask], bins: [1, 5, 10, 20, 50]}
  counterfactual: {layers: [last], permutations: 10, adversarial: true}
  heads: {ablation: true, importance: true}
statistics: {bootstrap: 2000, level: 0.95, alpha: 0.05, seed: 0, reference: loo_delete}
engine: {batch_size: 20, token_budget: 8192}
output: results/quickstart
"""

# line 1..6 of every small study below; tests append lines 7+
MINIMAL = """\
name: small
model:
  id: builtin:minilm-rt
dataset:
  name: builtin:rotten_tomatoes
explainers: [attention, rollout]
references: [loo_delete, loo_mask]
"""


def write(tmp_path: Path, text: str, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path, **overrides) -> str:
    with pytest.raises(InputError) as info:
        load_study(path, **overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def minimal_dict(**changes) -> dict:
    data = {
        "name": "small",
        "model": {"id": "builtin:minilm-rt"},
        "dataset": {"name": "builtin:rotten_tomatoes"},
        "explainers": ["attention", "rollout"],
        "references": ["loo_delete", "loo_mask"],
    }
    data.update(changes)
    return data


# ----------------------------------------------------------------------------------------- valid studies


def test_quickstart_validates(tmp_path):
    study = load_study(write(tmp_path, QUICKSTART))
    assert study.name == "quickstart"
    assert study.model.id == "builtin:minilm-rt" and study.model.dtype == "fp32" and study.model.device == "cpu"
    assert study.dataset.n == 200 and study.dataset.max_length == 128 and study.dataset.filters.min_words == 3
    assert study.target.kind == "prob"
    assert study.explainers[0] == "attention" and len(study.explainers) == 10
    assert study.references == ["loo_delete", "loo_mask", "loo_pad", "loo_random"]
    assert study.params == {"integrated_gradients": {"steps": 50}}
    assert study.metrics.erasure.rankings == ["attention_mean@last", "rollout", "saliency", "loo_mask"]
    assert study.metrics.erasure.bins == [1.0, 5.0, 10.0, 20.0, 50.0]
    assert study.metrics.counterfactual.layers == ["last"] and study.metrics.counterfactual.heads == "layer"
    assert study.statistics.reference == "loo_delete" and study.verdict_reference == "loo_delete"
    assert study.engine.batch_size == 20
    assert study.output == "results/quickstart"
    assert study.methods == study.explainers + study.references


def test_round_trip(tmp_path):
    study = load_study(write(tmp_path, QUICKSTART))
    data = study.to_dict()
    assert isinstance(data["metrics"]["erasure"]["bins"], list)
    again = study_from_dict(data)
    assert again == study
    assert again.fingerprint() == study.fingerprint()
    # the plain dict survives JSON
    assert study_from_dict(json.loads(json.dumps(data))) == study


def test_defaults(tmp_path):
    study = load_study(write(tmp_path, MINIMAL))
    assert study.description == "" and study.output is None
    assert study.model.device == "cpu" and study.model.dtype == "fp32" and study.model.task is None
    assert study.dataset.split == "test" and study.dataset.n is None and study.dataset.seed == 0
    assert study.dataset.text_column == "text" and study.dataset.label_column == "label"
    assert study.target.kind is None and study.target.choices is None
    assert study.params == {}
    assert study.metrics == MetricsSpec()
    assert study.metrics.agreement == ["kendall", "spearman", "top_k"]
    assert study.metrics.baselines == ["random", "uniform", "position"]
    assert study.metrics.top_k == [1, 3, 5] and study.metrics.ceilings is None
    assert study.metrics.erasure == ErasureSpec(rankings=[], bins=[1, 5, 10, 20, 50], mode="delete")
    assert study.metrics.counterfactual == CounterfactualSpec(layers=["last"], heads="layer", permutations=10,
                                                              adversarial=False, max_output_tvd=0.01)
    assert study.metrics.heads == HeadsSpec(ablation=True, importance=True)
    assert study.statistics == StatisticsSpec(bootstrap=2000, level=0.95, alpha=0.05, seed=0,
                                              include_special=False, reference=None, measure="auto")
    assert study.verdict_reference == "loo_delete"  # the first reference
    assert study.engine.batch_size == 16 and study.engine.token_budget == 8192


def test_null_turns_parts_off(tmp_path):
    text = MINIMAL + "metrics:\n  erasure:\n  counterfactual: null\n  heads: ~\n"
    metrics = load_study(write(tmp_path, text)).metrics
    assert metrics.erasure is None and metrics.counterfactual is None and metrics.heads is None
    # an empty mapping keeps the defaults
    metrics = load_study(write(tmp_path, MINIMAL + "metrics: {erasure: {}}\n")).metrics
    assert metrics.erasure == ErasureSpec()


def test_all_expands_and_duplicates_go():
    study = study_from_dict(minimal_dict(explainers=["all"], references=["loo_mask", "loo_delete", "loo_mask"]))
    assert study.explainers == list(ALL_METHODS)
    assert study.references == ["loo_mask", "loo_delete"]
    study = study_from_dict(minimal_dict(explainers="all"))
    assert study.explainers == list(ALL_METHODS)
    study = study_from_dict(minimal_dict(explainers="rollout, attention,rollout"))
    assert study.explainers == ["rollout", "attention"]


def test_target_for_causal_lm():
    target = {"kind": "logprob", "prompt": "Review: {text}\nSentiment:", "choices": [" positive", " negative"]}
    study = study_from_dict(minimal_dict(target=target))
    assert study.target.choices == [" positive", " negative"] and study.target.label is None
    assert study_from_dict(minimal_dict(target={"label": "positive"})).target.label == "positive"
    assert study_from_dict(minimal_dict(target={"label": 1})).target.label == 1


def test_counterfactual_and_ceilings_forms():
    metrics = {
        "counterfactual": {"layers": "all", "heads": [0, 3]},
        "ceilings": [["loo_delete", "loo_mask"]],
    }
    study = study_from_dict(minimal_dict(metrics=metrics))
    assert study.metrics.counterfactual.layers == "all" and study.metrics.counterfactual.heads == [0, 3]
    assert study.metrics.ceilings == [("loo_delete", "loo_mask")]
    study = study_from_dict(minimal_dict(metrics={"counterfactual": {"layers": [0, "first", "last"], "heads": "all"}}))
    assert study.metrics.counterfactual.layers == [0, "first", "last"]
    assert study.metrics.counterfactual.heads == "all"
    assert study_from_dict(study.to_dict()) == study


def test_parse_ranking():
    assert parse_ranking("rollout") == ("rollout", None)
    assert parse_ranking("attention_mean@last") == ("attention_mean", "last")
    assert parse_ranking("attention@first") == ("attention", "first")
    assert parse_ranking("attn_norm@3") == ("attn_norm", 3)
    for bad in ("attention@", "attention@top", "attention@-1", "saliency@1", "nope", "attention@1@2", ""):
        with pytest.raises(ValueError):
            parse_ranking(bad)


# ------------------------------------------------------------------------------------ errors with lines


@pytest.mark.parametrize("extra, line, pattern", [
    # unknown keys point at the key
    ("explainer: [attention]\n", 8, r"unknown key 'explainer' in study \(valid keys: name, description, model, "
                                    r"dataset, .*\); did you mean 'explainers'\?"),
    ("metrics:\n  erasure:\n    binz: [1]\n", 10, r"unknown key 'binz' in metrics\.erasure \(valid keys: "
                                                  r"rankings, bins, mode, flips\); did you mean 'bins'\?"),
    ("engine: {batchsize: 3}\n", 8, r"unknown key 'batchsize' in engine .*did you mean 'batch_size'"),
    # literal values
    ("metrics:\n  agreement: [kendall, pearson]\n", 9,
     r"metrics\.agreement\[1\]: 'pearson' is not one of kendall, spearman, top_k"),
    ("statistics:\n  measure: tau\n", 9, r"statistics\.measure: 'tau' is not a measure: use auto, kendall_tau, spearman or topK"),
    ("metrics: {erasure: {mode: zero}}\n", 8, r"metrics\.erasure\.mode: 'zero' is not one of delete"),
    # ranges and types
    ("engine:\n  batch_size: 0\n", 9, r"engine\.batch_size: 0 is out of range; give a value >= 1"),
    ("engine:\n  token_budget: 32\n", 9, r"engine\.token_budget: 32 is out of range; give a value >= 64"),
    ("statistics:\n  bootstrap: 10\n", 9, r"statistics\.bootstrap: 10 is out of range"),
    ("statistics:\n  level: 1.5\n", 9, r"statistics\.level: 1\.5 is out of range; give a value < 1"),
    ("statistics:\n  alpha: 0.5\n", 9, r"statistics\.alpha: 0\.5 is out of range"),
    ("statistics:\n  seed: abc\n", 9, r"statistics\.seed: 'abc' is not a whole number"),
    ("metrics:\n  top_k: [1, 0]\n", 9, r"metrics\.top_k\[1\]: 0 is out of range; give a value >= 1"),
    ("metrics:\n  erasure:\n    bins:\n      - 5\n      - 150\n", 12, r"metrics\.erasure\.bins\[1\]: 150 is out of range"),
    ("metrics:\n  counterfactual: {permutations: 0}\n", 9, r"metrics\.counterfactual\.permutations: 0"),
    ("metrics:\n  counterfactual:\n    layers: [last, -1]\n", 10, r"layer -1 is negative.* last"),
    ("metrics:\n  counterfactual:\n    layers: [top]\n", 10, r"metrics\.counterfactual\.layers: layer 'top'"),
    ("metrics:\n  counterfactual:\n    heads: some\n", 10, r"metrics\.counterfactual\.heads: 'some' is not layer, all"),
    ("metrics:\n  heads: {ablation: maybe}\n", 9, r"metrics\.heads\.ablation: 'maybe' is not true or false"),
    ("target: {kind: probability}\n", 8, r"target\.kind: 'probability' is not one of prob, logit, logprob"),
    ("target:\n  label: 1.5\n", 9, r"target\.label: 1\.5 is not a label"),
    ("target:\n  prompt: 'Review: {text} {text}'\n", 9, r"target\.prompt: .* must contain \{text\} exactly once"),
    ("target:\n  prompt: 'Review:'\n", 9, r"target\.prompt: .* exactly once \(it has 0\)"),
    ("target:\n  choices: [' yes']\n", 9, r"target\.choices: .* fewer than 2 choices"),
    ("target:\n  choices:\n    - ' yes'\n    - ' yes'\n", 11, r"target\.choices: ' yes' is listed twice"),
    ("target:\n  continuation: ' good'\n  choices: [' a', ' b']\n", 10,
     r"target\.choices: choices and continuation exclude each other"),
    ("target:\n  label: 1\n  continuation: ' good'\n", 9, r"target\.label: label cannot be combined with continuation"),
    ("target:\n  label: 1\n  choices: [' a', ' b']\n", 9, r"target\.label: label cannot be combined with choices"),
    ("output: ''\n", 8, r"output: is empty"),
    # methods
    ("params:\n  saliency: {abs: true}\n", 9,
     r"params\.saliency: parameters for 'saliency', which is not among the study's explainers and references: "
     r"attention, rollout, loo_delete, loo_mask; add saliency to explainers or references"),
    ("params:\n  salency: {}\n", 9, r"params\.salency: unknown method 'salency' .*did you mean 'saliency'"),
    ("params:\n  rollout: 3\n", 9, r"params\.rollout: 3 is not a mapping"),
    ("statistics:\n  reference: loo_unk\n", 9,
     r"statistics\.reference: 'loo_unk' is not one of the references \(loo_delete, loo_mask\)"),
    ("metrics:\n  ceilings: [[loo_delete, loo_pad]]\n", 9, r"metrics\.ceilings: loo_pad is not among the study's"),
    ("metrics:\n  ceilings: [[loo_delete]]\n", 9, r"metrics\.ceilings: \['loo_delete'\] is not a pair of methods"),
    ("metrics:\n  ceilings: [[loo_delete, loo_delete]]\n", 9, r"pairs a method with itself"),
    # erasure ranking syntax
    ("metrics:\n  erasure:\n    rankings:\n      - rollout\n      - attention@top\n", 12,
     r"metrics\.erasure\.rankings: 'attention@top': layer 'top' is not a layer index \(0, 1, \.\.\.\), first or last"),
    ("metrics:\n  erasure: {rankings: [saliency@last]}\n", 9,
     r"'saliency@last': only attention methods take @LAYER"),
    ("metrics:\n  erasure: {rankings: [rolout]}\n", 9,
     r"metrics\.erasure\.rankings: unknown method 'rolout' .*did you mean 'rollout'"),
    ("metrics:\n  erasure: {rankings: ['attention mean']}\n", 9, r"'attention mean' is not METHOD or METHOD@LAYER"),
    ("metrics:\n  erasure: {rankings: [loo_pad]}\n", 9,
     r"metrics\.erasure\.rankings: 'loo_pad': loo_pad is not among the study's explainers and references"),
    ("metrics:\n  erasure: {bins: []}\n", 9, r"metrics\.erasure\.bins: is empty"),
])
def test_errors_name_line_and_key(tmp_path, extra, line, pattern):
    message = error_of(write(tmp_path, MINIMAL + extra))
    assert message.startswith(f"{tmp_path / 'study.yaml'} line {line}: "), message
    assert re.search(pattern, message), message


@pytest.mark.parametrize("text, line, pattern", [
    (MINIMAL.replace("  id: builtin:minilm-rt\n", "  id: builtin:minilm-rt\n  dtype: fp64\n"), 4,
     r"model\.dtype: 'fp64' is not one of fp32, bf16, fp16"),
    (MINIMAL.replace("[attention, rollout]", "[attention, atention]"), 6,
     r"explainers: unknown method 'atention' \(valid: attention, attention_mean, .*\); did you mean 'attention'\?"),
    (MINIMAL.replace("[attention, rollout]", "\n  - attention\n  - atention"), 8, r"explainers: unknown method"),
    (MINIMAL.replace("[attention, rollout]", "[]"), 6, r"explainers: no method given"),
    (MINIMAL.replace("[attention, rollout]", ""), 6, r"explainers: null is not a list of methods"),
    (MINIMAL.replace("[loo_delete, loo_mask]", "[loo_delete, 3]"), 7, r"references: 3 is not a method name"),
    (MINIMAL.replace("name: small", "name: my study"), 1,
     r"name: 'my study' may use only letters, digits, '-', '_' and '\.'; e\.g\. 'my-study'"),
    (MINIMAL.replace("name: small", "name: 2024"), 1, r"name: 2024 is not text"),
    (MINIMAL.replace("  id: builtin:minilm-rt\n", "  device: cpu\n"), 2, r"model: missing required key 'id'"),
    (MINIMAL.replace("  id: builtin:minilm-rt\n", ""), 2, r"model: null is not a mapping; .*id, device, dtype"),
    (MINIMAL.replace("model:\n  id: builtin:minilm-rt\n", "model: builtin:minilm-rt\n"), 2, r"model: .* not a mapping"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten"), 5,
     r"dataset\.name: unknown built-in dataset 'builtin:rotten' \(valid: builtin:imdb, builtin:rotten_tomatoes\)"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "data.txt"), 5, r"dataset\.name: 'data\.txt' is neither builtin:NAME"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  split: dev"), 6,
     r"dataset\.split: 'dev' is not a split of builtin:rotten_tomatoes \(valid: test, train\)"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  n: 0"), 6, r"dataset\.n: 0 is out of range"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  n: true"), 6,
     r"dataset\.n: true is not a whole number"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  max_length: 1"), 6,
     r"dataset\.max_length: 1 is out of range; give a value >= 2"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  filters: {contains: '(oops'}"), 6,
     r"dataset\.filters\.contains: '\(oops' is not a valid regular expression"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  filters:\n    min_words: 9\n"
                                                "    max_words: 3"), 7,
     r"dataset\.filters\.min_words: min_words 9 is above max_words 3"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  filters: {labels: []}"), 6,
     r"dataset\.filters\.labels: is empty"),
    (MINIMAL.replace("builtin:rotten_tomatoes", "builtin:rotten_tomatoes\n  filters: {min_word: 3}"), 6,
     r"unknown key 'min_word' in dataset\.filters .*did you mean 'min_words'"),
    (MINIMAL + "1: x\n", 8, r"unknown key 1 in study"),
    # the first problem in the file is the one reported
    (MINIMAL.replace("name: small", "name: a b") + "engine: {batch_size: 0}\n", 1, r"^\S+ line 1: name:"),
])
def test_more_errors(tmp_path, text, line, pattern):
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'study.yaml'} line {line}: "), message
    assert re.search(pattern, message), message


@pytest.mark.parametrize("key", ["name", "model", "dataset", "explainers", "references"])
def test_missing_top_level_key(tmp_path, key):
    data = {k: v for k, v in minimal_dict().items() if k != key}
    message = error_of(write(tmp_path, yaml.safe_dump(data)))
    assert message.startswith(f"{tmp_path / 'study.yaml'}: missing required key {key!r}"), message


def test_file_level_errors(tmp_path):
    path = tmp_path / "studies" / "x.yaml"
    assert error_of(path) == f"study file not found: {path}"
    path.parent.mkdir()
    assert re.fullmatch(rf"{re.escape(str(path.parent))} is a directory, not a study file; .*", error_of(path.parent))
    path.write_text("")
    assert re.match(rf"{re.escape(str(path))} is empty; ", error_of(path))
    path.write_text("# only a comment\n")
    assert re.match(rf"{re.escape(str(path))} is empty; ", error_of(path))
    path.write_text("- name: x\n- model: y\n")
    assert error_of(path).startswith(f"{path} line 1: the study is a list, not a mapping")
    path.write_text("just words\n")
    assert error_of(path).startswith(f"{path} line 1: the study is the value 'just words', not a mapping")
    path.write_bytes(b"name: \xff\xfe\n")
    assert "is not UTF-8" in error_of(path)


@pytest.mark.parametrize("text, line, problem", [
    (MINIMAL.replace("[attention, rollout]", "[attention, rollout"), 7, "expected ',' or ']'"),
    (MINIMAL + "metrics:\n  top_k: [1\n  baselines: x\n", 10, ""),
    (MINIMAL.replace("rotten_tomatoes\n", "rotten_tomatoes\n split: test\n"), 6, ""),
    ("name: a\n\tmodel: x\n", 2, "found character '\\t'"),
    (MINIMAL + "---\nname: second\n", 8, "expected a single document"),
])
def test_malformed_yaml(tmp_path, text, line, problem):
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'study.yaml'} line {line}: not valid YAML: "), message
    assert problem in message


def test_duplicate_key(tmp_path):
    text = MINIMAL.replace("  id: builtin:minilm-rt\n", "  id: builtin:minilm-rt\n  id: other\n")
    message = error_of(write(tmp_path, text))
    assert message == f"{tmp_path / 'study.yaml'} line 4: duplicate key 'id' in model; keep only one of them"


def test_study_from_dict_errors_have_no_line():
    with pytest.raises(InputError, match=r"^<dict>: model\.dtype: 'fp64' is not one of fp32, bf16, fp16"):
        study_from_dict(minimal_dict(model={"id": "m", "dtype": "fp64"}))
    with pytest.raises(InputError, match=r"^mine: unknown key 'explainer' in study"):
        study_from_dict(minimal_dict(explainer=["attention"]), source="mine")
    with pytest.raises(InputError, match=r"^<dict>: missing required key 'references'"):
        study_from_dict({k: v for k, v in minimal_dict().items() if k != "references"})
    with pytest.raises(InputError, match=r"^<dict>: the study is \['a'\], not a mapping"):
        study_from_dict(["a"])


def test_params_for_used_methods_pass_through():
    params = {"rollout": {"query": "max"}, "loo_mask": {"k": 4}}
    study = study_from_dict(minimal_dict(params=params))
    assert study.params == params


def test_params_are_checked_against_the_registry():  # issue 25: an unknown key was a TypeError after the load
    with pytest.raises(InputError, match=r"params.rollout.discard: unknown parameter 'discard' of rollout"):
        study_from_dict(minimal_dict(params={"rollout": {"discard": 0.1}}))
    with pytest.raises(InputError, match=r"params.loo_mask.mode: unknown parameter 'mode' of loo_mask"):
        study_from_dict(minimal_dict(params={"loo_mask": {"mode": "pad"}}))  # fixed by the name


# ------------------------------------------------------------------------------------------ dataset paths


def test_dataset_path_relative_to_study_file(tmp_path, monkeypatch):
    folder = tmp_path / "studies"
    folder.mkdir()
    (folder / "data.csv").write_text("text,label\nhello there,1\n")
    path = write(folder, MINIMAL.replace("builtin:rotten_tomatoes", "data.csv"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    study = load_study(path)
    assert Path(study.dataset.name) == folder / "data.csv"
    assert Path(study.dataset.name).is_file()
    # a relative study path gives a path relative to the same current directory
    monkeypatch.chdir(tmp_path)
    study = load_study("studies/study.yaml")
    assert Path(study.dataset.name) == Path("studies/data.csv")
    assert Path(study.dataset.name).is_file()


def test_dataset_path_not_next_to_study_is_kept(tmp_path):
    path = write(tmp_path, MINIMAL.replace("builtin:rotten_tomatoes", "sub/missing.jsonl"))
    assert load_study(path).dataset.name == "sub/missing.jsonl"
    absolute = str(tmp_path / "abs.csv")
    path = write(tmp_path, MINIMAL.replace("builtin:rotten_tomatoes", absolute))
    assert load_study(path).dataset.name == absolute
    # no study file, no resolution
    assert study_from_dict(minimal_dict(dataset={"name": "data.csv"})).dataset.name == "data.csv"


# ---------------------------------------------------------------------------------------------- overrides


def test_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, QUICKSTART)
    base = load_study(path)
    study = load_study(path, n=7, device="cuda:0", dtype="bf16", out="elsewhere/out")
    assert study.dataset.n == 7 and study.model.device == "cuda:0" and study.model.dtype == "bf16"
    assert study.output == "elsewhere/out"
    assert study.dataset.name == base.dataset.name and study.explainers == base.explainers

    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.jsonl").write_text('{"text": "hi there", "label": 0}\n')
    monkeypatch.chdir(work)
    train = write(tmp_path, QUICKSTART.replace("split: test", "split: train"), name="train.yaml")
    study = load_study(train, dataset="mine.jsonl")
    assert study.dataset.name == "mine.jsonl" and study.dataset.split == "test"
    assert study.dataset.n == 200  # other dataset settings are kept
    assert load_study(train, dataset="builtin:imdb").dataset.name == "builtin:imdb"


def test_override_errors(tmp_path, monkeypatch):
    path = write(tmp_path, QUICKSTART)
    monkeypatch.chdir(tmp_path)
    message = error_of(path, dataset="nope.csv")
    assert message.startswith("dataset file nope.csv not found"), message
    message = error_of(path, dtype="fp64")
    assert message == (f"{path} with the override dtype='fp64': model.dtype: 'fp64' is not one of fp32, bf16, fp16; "
                       "did you mean 'fp16'?")
    message = error_of(path, n=0)
    assert message.startswith(f"{path} with the override n=0: dataset.n: 0 is out of range"), message
    (tmp_path / "notes.txt").write_text("x")
    message = error_of(path, dataset="notes.txt")
    assert "override dataset='notes.txt'" in message and "is neither builtin:NAME" in message
    message = error_of(path, dataset="builtin:nope")
    assert "unknown built-in dataset 'builtin:nope'" in message
    message = error_of(path, device="")
    assert "override device=''" in message and "model.device: is empty" in message


# -------------------------------------------------------------------------------------------- fingerprint


def test_fingerprint(tmp_path):
    study = load_study(write(tmp_path, QUICKSTART))
    fp = study.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    data = study.to_dict()

    def changed(**edits) -> str:
        new = study.to_dict()
        for dotted, value in edits.items():
            section = new
            *parents, last = dotted.split("__")
            for key in parents:
                section = section[key]
            section[last] = value
        return study_from_dict(new).fingerprint()

    assert changed(output="other/place") == fp
    assert changed(description="something else") == fp
    assert changed(output=None, description="") == fp
    assert changed(dataset__n=100) != fp
    assert changed(model__id="distilbert-base-uncased") != fp
    assert changed(explainers=study.explainers[:-1]) != fp  # without gradient_shap
    assert changed(references=["loo_delete", "loo_mask"]) != fp
    assert changed(statistics__seed=1) != fp
    assert changed(engine__batch_size=8) != fp
    assert changed(metrics__erasure__flips=False) != fp  # flips: true (the default) is left out of it
    assert changed(metrics__erasure__flips=True) == fp
    assert changed(metrics__interactions=True, metrics__sinks=True) == fp  # on (the default): left out of it
    assert changed(metrics__interactions=None) == changed(metrics__interactions=False) != fp
    assert changed(metrics__sinks=False) != fp
    assert load_study(write(tmp_path, QUICKSTART), n=100).fingerprint() != fp
    assert load_study(write(tmp_path, QUICKSTART), out="x").fingerprint() == fp
    assert study_from_dict(data).fingerprint() == fp


def test_frozen(tmp_path):
    study = load_study(write(tmp_path, MINIMAL))
    with pytest.raises(pydantic.ValidationError):
        study.name = "other"
    assert isinstance(study, Study)


def test_validating_study_and_claim_files_imports_no_torch():
    """The CLI validates a file before its slow imports: reading and validating a study file (its old
    import path) and a claim file (:mod:`probe.spec`), errors included, loads neither torch nor transformers."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys\n"
        "from probe.errors import InputError\n"
        "from probe.spec.study import load_study\n"
        "from probe.claims.file import load_claims\n"
        "from probe.spec.study import study_from_dict\n"
        "study = load_study('studies/quickstart.yaml')\n"
        "claims = load_claims('data/claims/minilm_rt.yaml')\n"
        "try:\n"
        "    study_from_dict({**study.to_dict(), 'explainers': ['atention']})\n"
        "except InputError as err:\n"
        "    print('error:', err)\n"
        "print(study.name, len(claims.claims), sorted(m for m in ('torch', 'transformers', 'captum') if m in "
        "sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert "did you mean 'attention'" in out
    assert out.strip().endswith("quickstart 11 []"), out


def test_a_stored_study_record_loads_as_the_typed_study(tmp_path):
    """study.json keeps what ``to_dict`` wrote; a record from before later keys (random weights, encoder
    targets, sanity, published numbers) loads with their defaults and keeps its fingerprint."""
    study = load_study(write(tmp_path, QUICKSTART))
    old = json.loads(json.dumps(study.to_dict()))
    for section, key in (("model", "allow_random_weights"), ("target", "reference"), ("target", "dimension"),
                         ("metrics", "sanity"), ("metrics", "published")):
        del old[section][key]
    loaded = Study.from_record(old)
    assert loaded == study and loaded.fingerprint() == study.fingerprint()
    with pytest.raises(InputError, match=r"^x/study\.json: explainers: unknown method 'atention' .*did you mean"):
        Study.from_record({**old, "explainers": ["atention"]}, source="x/study.json")
