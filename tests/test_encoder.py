"""No random head passes silently; a headless encoder explains a target that fits it.

Weights ``from_pretrained`` leaves at random initialisation are listed in the contract and the
provenance, and refused unless allowed explicitly. A headless (sentence-transformers) encoder is
loaded bare and explains the cosine similarity of its pooled embedding to a reference text, or one
embedding dimension; the oracles are plain transformers with pooling written out by hand.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from probe.errors import InputError, ModelLoadError
from probe.methods import run_methods
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tolerances import assert_fp_close, gradient_term_scales, model_depth

TEXTS = ["a gripping, funny and warm film", "dull", "the plot drags but the acting is superb"]
REFERENCE = "a great movie"


def _cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not line.startswith("Loading")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def headless(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """Tiny models saved without their heads: BERT (bare BertModel) and Llama (no lm_head; untied)."""
    import transformers

    root = tmp_path_factory.mktemp("headless")
    folders = {}
    for kind in ("bert", "llama_gqa"):
        folder = root / kind
        transformers.AutoModel.from_pretrained(tiny_dirs[kind]).save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(tiny_dirs[kind]).save_pretrained(folder)
        folders[kind] = folder
    return folders


@pytest.fixture(scope="module")
def encoder(pretrained_minilm_folder):
    return load_model(pretrained_minilm_folder)


# ------------------------------------------------------------------------------------------ refusal


def test_base_minilm_as_a_classifier_is_refused_naming_its_head(pretrained_minilm_folder):
    with pytest.raises(ModelLoadError) as caught:
        load_model(pretrained_minilm_folder, task="classification")
    message = str(caught.value)
    assert "\n" not in message
    assert "classifier.weight" in message and "classifier.bias" in message
    assert "--allow-random-weights" in message


@pytest.mark.parametrize("kind, task, missing", [("bert", "classification", {"classifier.weight", "classifier.bias"}),
                                                 ("llama_gqa", None, {"lm_head.weight"})])
def test_a_tiny_model_saved_without_its_head_is_refused(headless, kind, task, missing):
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(headless[kind]), task=task)
    assert all(name in str(caught.value) for name in missing), str(caught.value)
    pm = load_model(str(headless[kind]), task=task, allow_random_weights=True)
    assert set(pm.random_weights) == missing and pm.allow_random_weights
    info = pm.contract.to_dict()
    assert set(info["random_weights"]) == missing and info["random_weights_allowed"] is True


def test_trained_models_have_no_random_weights(loaded, tiny_dirs, builtin_cache):
    for kind in tiny_dirs:
        assert loaded(kind).random_weights == (), kind
    for name in ("builtin:minilm-rt", "builtin:smollm2-135m"):
        pm = load_model(name, cache_dir=str(builtin_cache))
        assert pm.random_weights == () and pm.contract.to_dict()["random_weights"] == [], name
        assert pm.task.name in ("classification", "causal_lm")


def test_cli_contract_lists_random_weights_and_explain_refuses_them(pretrained_minilm_folder):
    result = _cli("contract", pretrained_minilm_folder, "--task", "classification", "--json")
    assert result.returncode in (0, 1), result.stderr  # the contract is printed, not refused
    contract = json.loads(result.stdout)["contract"]
    assert contract["task"] == "classification"
    assert contract["random_weights"] == ["classifier.bias", "classifier.weight"]
    line = _one_line_error(_cli("explain", pretrained_minilm_folder, "a fine film", "--task", "classification",
                                "--methods", "attention_mean"))
    assert "classifier.weight" in line and "classifier.bias" in line
    allowed = _cli("explain", pretrained_minilm_folder, "a fine film", "--task", "classification", "--methods",
                   "attention_mean", "--allow-random-weights", "--json")
    assert allowed.returncode == 0, allowed.stderr
    data = json.loads(allowed.stdout)
    assert data["random_weights"] == ["classifier.bias", "classifier.weight"] and data["allow_random_weights"]


def test_the_option_is_recorded_in_provenance_and_shown_in_the_report(headless, tmp_path):
    from probe.api import run_study  # the user's front door: it writes the report too
    from probe.spec.study import study_from_dict

    data = tmp_path / "data.csv"
    pd.DataFrame({"text": ["good film", "bad plot , slow", "funny and warm"], "label": [1, 0, 1]}).to_csv(data,
                                                                                                       index=False)
    study = {"name": "random_head", "model": {"id": str(headless["bert"]), "task": "classification"},
             "dataset": {"name": str(data)}, "explainers": ["attention_mean"], "references": ["loo_delete"],
             "statistics": {"bootstrap": 100}, "output": str(tmp_path / "out")}
    with pytest.raises(ModelLoadError, match="classifier.weight"):
        run_study(study_from_dict(study), progress=False, log=lambda _: None)
    study["model"]["allow_random_weights"] = True
    run_study(study_from_dict(study), progress=False, log=lambda _: None)
    provenance = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert provenance["model"]["random_weights"] == ["classifier.bias", "classifier.weight"]
    assert provenance["model"]["allow_random_weights"] is True
    assert provenance["model"]["contract"]["random_weights"] == ["classifier.bias", "classifier.weight"]
    markdown = next((tmp_path / "out").rglob("*.md")).read_text()
    assert "weights left random" in markdown and "classifier.weight" in markdown


def test_studies_without_the_new_keys_keep_their_fingerprint():
    from probe.spec.study import study_from_dict

    base = {"name": "f", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:rotten_tomatoes"},
            "explainers": ["attention_mean"], "references": ["loo_delete"]}
    study = study_from_dict(base)
    payload = study.model_dump(mode="json", exclude={"output", "description"})
    assert "allow_random_weights" in payload["model"]  # the key exists ...
    allowed = study_from_dict({**base, "model": {"id": "builtin:minilm-rt", "allow_random_weights": True}})
    assert allowed.fingerprint() != study.fingerprint()  # ... and counts once set


# ------------------------------------------------------------------------------------------ headless encoders


def _hand_embeddings(folder: str, texts: list[str]) -> torch.Tensor:
    """Plain transformers: BertModel's last hidden state, mean over non-padding tokens -> [n, hidden] float64."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()  # [n, seq, hidden]
    mask = batch["attention_mask"].double()[..., None]
    return (hidden * mask).sum(1) / mask.sum(1)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def test_the_base_minilm_loads_as_an_encoder_with_its_own_pooling(encoder):
    assert encoder.task.name == "encoder" and encoder.random_weights == ()
    assert encoder.pooling.mode == "mean" and encoder.pooling.normalize  # modules.json lists Normalize
    assert encoder.contract.to_dict()["pooling"]["source"].endswith("config.json")
    from probe.models.checks import run_checks

    assert all(check.passed for check in run_checks(encoder))


def test_similarity_target_equals_mean_pooled_cosine_by_hand(encoder, pretrained_minilm_folder):
    examples = prepare(encoder, TEXTS, TargetSpec(kind="similarity", reference=REFERENCE))
    hand = _hand_embeddings(pretrained_minilm_folder, TEXTS + [REFERENCE])
    expected = _cosine(hand[:-1], hand[-1:])
    got = torch.tensor([e.original_value for e in examples], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)  # cosines: bounded by 1, absolute
    assert len(set(round(v, 3) for v in got.tolist())) == len(TEXTS)  # not a constant


def test_dimension_target_equals_the_normalised_pooled_component(encoder, pretrained_minilm_folder):
    examples = prepare(encoder, TEXTS, TargetSpec(kind="dimension", dimension=7))
    hand = _hand_embeddings(pretrained_minilm_folder, TEXTS)
    expected = (hand / hand.norm(dim=-1, keepdim=True))[:, 7]
    got = torch.tensor([e.original_value for e in examples], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-5)  # components of a unit vector: bounded by 1, absolute


def test_loo_on_the_similarity_target_equals_a_hand_recomputation(encoder, pretrained_minilm_folder):
    import transformers

    example = prepare(encoder, [TEXTS[2]], TargetSpec(kind="similarity", reference=REFERENCE))[0]
    scores = run_methods(encoder, [example], ["loo_delete"])["loo_delete"].scores[0]
    position = 3  # a word token inside the sentence
    assert not example.special[position]
    model = transformers.AutoModel.from_pretrained(pretrained_minilm_folder).eval()

    def similarity(ids: list[int]) -> float:
        with torch.no_grad():
            text = model(input_ids=torch.tensor([ids])).last_hidden_state.double().mean(1)  # no padding: plain mean
        return float(_cosine(text, _hand_embeddings(pretrained_minilm_folder, [REFERENCE]))[0])

    kept = example.input_ids[:position] + example.input_ids[position + 1:]
    expected = similarity(example.input_ids) - similarity(kept)
    # a difference of two cosines (each bounded by 1): its rounding is at scale 1, absolute
    assert math.isclose(float(scores[position]), expected, abs_tol=1e-5), (float(scores[position]), expected)
    assert abs(expected) > 1e-4  # the token matters: the test could fail


METHODS = ["attention", "attention_mean", "rollout", "flow", "attn_norm", "attn_grad", "saliency", "input_x_gradient",
           "integrated_gradients", "gradient_shap", "loo_delete", "loo_mask"]


def test_batch_of_one_equals_batch_of_n_on_the_encoder(encoder):
    examples = prepare(encoder, TEXTS, TargetSpec(kind="similarity", reference=REFERENCE))
    params = {"integrated_gradients": {"steps": 8}, "gradient_shap": {"seed": 0}}
    together = run_methods(encoder, examples, METHODS, params=params)
    # attention rows and LOO on a cosine (differences of values bounded by 1) stay absolute; norms and
    # gradients are unbounded: fp32 rounding at their scale, signed sums at that of their per-dim terms
    bounded = {"attention", "attention_mean", "rollout", "flow", "loo_delete", "loo_mask"}
    signed = ("input_x_gradient", "integrated_gradients", "gradient_shap")
    terms = {name: gradient_term_scales(encoder, examples, name, **params.get(name, {})) for name in signed}
    for i, example in enumerate(examples):
        alone = run_methods(encoder, [example], METHODS, params=params)
        for name in METHODS:
            a, b = alone[name].scores[0], together[name].scores[i]
            assert a.shape == b.shape, name
            if name in bounded:
                assert torch.allclose(a, b, atol=2e-5, equal_nan=True), (name, (a - b).abs().nan_to_num().max())
            else:
                backward = name != "attn_norm"
                assert_fp_close(a, b, depth=model_depth(encoder, backward=backward), scale=terms.get(name, [0.0] * 3)[i],
                                msg=name)


def test_encoder_attention_reads_every_pooled_row(headless):
    """Mean pooling reads every position: attention_mean is HF's eager attention averaged over heads
    and over the query rows of the real tokens."""
    import transformers

    pm = load_model(str(headless["bert"]))
    assert pm.task.name == "encoder" and pm.pooling.mode == "mean" and not pm.pooling.normalize
    examples = prepare(pm, ["the movie was good", "bad"], TargetSpec(kind="dimension", dimension=0))
    scores = run_methods(pm, examples, ["attention_mean"])["attention_mean"]
    model = transformers.AutoModel.from_pretrained(headless["bert"], attn_implementation="eager").eval()
    for example, got in zip(examples, scores.scores):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([example.input_ids]), output_attentions=True)
        maps = torch.stack(out.attentions)[:, 0]  # [layer, head, query, key]
        expected = maps.mean(dim=1).mean(dim=1)  # [layer, key]: head mean, then mean over query rows
        assert torch.allclose(got, expected, atol=1e-6)  # attention weights: bounded by 1, absolute


def test_encoder_targets_are_checked(encoder, loaded):
    with pytest.raises(InputError, match="--target similarity --reference TEXT"):
        prepare(encoder, TEXTS[:1])  # no target kind: an encoder has no class
    with pytest.raises(InputError, match="needs a reference text"):
        prepare(encoder, TEXTS[:1], TargetSpec(kind="similarity"))
    with pytest.raises(InputError, match="0..383"):
        prepare(encoder, TEXTS[:1], TargetSpec(kind="dimension", dimension=384))
    with pytest.raises(InputError, match="headless encoder"):
        prepare(loaded("bert"), TEXTS[:1], TargetSpec(kind="similarity", reference=REFERENCE))


def test_study_spec_validates_encoder_targets():
    from probe.errors import ProbeError
    from probe.spec.study import study_from_dict

    base = {"name": "s", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:rotten_tomatoes"},
            "explainers": ["attention_mean"], "references": ["loo_delete"]}
    with pytest.raises(ProbeError, match="similarity needs a reference"):
        study_from_dict({**base, "target": {"kind": "similarity"}})
    with pytest.raises(ProbeError, match="reference applies to kind: similarity"):
        study_from_dict({**base, "target": {"reference": "x"}})
    study = study_from_dict({**base, "target": {"kind": "dimension", "dimension": 2}})
    assert study.target.dimension == 2


def test_cli_explains_the_encoder_similarity(pretrained_minilm_folder):
    result = _cli("explain", pretrained_minilm_folder, "a funny film", "--target", "similarity", "--reference",
                  REFERENCE, "--methods", "attention_mean,saliency,loo_delete", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    hand = _hand_embeddings(pretrained_minilm_folder, ["a funny film", REFERENCE])
    assert data["target"]["kind"] == "similarity" and data["target"]["label"] == REFERENCE
    assert math.isclose(data["target"]["value"], float(_cosine(hand[:1], hand[1:])[0]), abs_tol=1e-5)  # a cosine
    assert data["random_weights"] == []
    line = _one_line_error(_cli("explain", pretrained_minilm_folder, "a funny film", "--methods", "attention_mean"))
    assert "--target similarity --reference TEXT" in line


def test_a_study_on_the_encoder_runs(pretrained_minilm_folder, tmp_path):
    from probe.api import run_study  # the user's front door: it writes the report too
    from probe.spec.study import study_from_dict

    data = tmp_path / "data.csv"
    pd.DataFrame({"text": ["a good film", "the plot is slow and dull", "funny , warm and sharp"],
                  "label": [1, 0, 1]}).to_csv(data, index=False)
    study = {"name": "encoder", "model": {"id": pretrained_minilm_folder}, "dataset": {"name": str(data)},
             "target": {"kind": "similarity", "reference": REFERENCE},
             "explainers": ["attention_mean", "saliency"], "references": ["loo_delete"],
             "metrics": {"erasure": None, "counterfactual": None, "heads": None},  # agreement only: fast
             "statistics": {"bootstrap": 100}, "output": str(tmp_path / "out")}
    run_study(study_from_dict(study), progress=False, log=lambda _: None)
    provenance = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert provenance["model"]["contract"]["task"] == "encoder"
    assert provenance["model"]["random_weights"] == []
    markdown = next((tmp_path / "out").rglob("*.md")).read_text()
    assert "none: every weight was loaded from the checkpoint" in markdown
    assert REFERENCE in markdown and "mean pooling" in markdown


def test_python_reaches_the_encoder_targets_the_cli_takes(encoder, pretrained_minilm_folder):
    """``reference`` and ``dimension`` from Python (probe.prepare, probe.explain: keywords or a
    TargetSpec) give the command line's target and scores."""
    import probe

    methods = "attention_mean,loo_delete"
    by_keywords = probe.explain(encoder, "a funny film", methods, kind="similarity", reference=REFERENCE)
    by_spec = probe.explain(encoder, "a funny film", methods, target=TargetSpec(kind="similarity", reference=REFERENCE))
    pd.testing.assert_frame_equal(by_keywords.to_pandas(), by_spec.to_pandas())
    result = _cli("explain", pretrained_minilm_folder, "a funny film", "--target", "similarity", "--reference",
                  REFERENCE, "--methods", methods, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    example = by_keywords.examples[0]
    assert data["target"] == example.describe() and data["token_ids"] == example.input_ids
    for method in methods.split(","):
        python = by_keywords.scores[method].scores[0].double()
        if not by_keywords.scores[method].per_layer:  # the command line leaves special tokens out
            python[torch.tensor(example.special)] = float("nan")
        cli = torch.tensor(np.array(data["scores"][method], dtype=float))  # None: NaN
        # the same computation in another process: equal up to fp32 rounding of values bounded by 1
        torch.testing.assert_close(cli, python, rtol=0, atol=1e-6, equal_nan=True)
    dimension = probe.prepare(encoder, TEXTS, kind="dimension", dimension=7)
    assert dimension == prepare(encoder, TEXTS, TargetSpec(kind="dimension", dimension=7))
    assert dimension == probe.prepare(encoder, TEXTS, target=TargetSpec(kind="dimension", dimension=7))
