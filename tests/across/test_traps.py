"""No silent traps, early plain errors, manners (issue 28): each trap a user fell into, on the
built-in models (and the tiny ones where no real model is needed), now either does the right
thing or is refused in one line that names the fix."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.display import shown_token
from probe.errors import InputError, ProbeError

CLASSIFIER_TEXTS = ["a gripping , funny and quietly moving film", "dull"]
PROMPTS = ["The capital of France is", "Hi"]


@pytest.fixture(scope="module")
def minilm():
    return probe.load_model("builtin:minilm-rt")


@pytest.fixture(scope="module")
def smollm():
    return probe.load_model("builtin:smollm2-135m")


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, ProbeError)
    return text


# ------------------------------------------------------------------ 1. capture(queries="last") and padding


def test_last_query_rows_come_from_the_mask_the_forward_is_handed(smollm):
    batch = smollm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    lengths = batch["attention_mask"].sum(1)
    assert lengths[0] != lengths[1]  # padded: the short prompt's last row would be padding
    with probe.capture(smollm, queries="last", layers=[0]) as cap:
        smollm.model(**batch)
    from_forward = cap.maps()
    with probe.capture(smollm, queries="last", layers=[0], attention_mask=batch["attention_mask"]) as cap:
        smollm.model(**batch)
    given = cap.maps()
    assert from_forward.query_index.tolist() == (lengths - 1).view(-1, 1).tolist()
    assert torch.equal(from_forward.weights, given.weights)
    assert not smollm.model._forward_pre_hooks  # the mask reader is gone with the block
    left = batch["attention_mask"].flip(1)  # a left-padded batch's mask: each row's last real token is the last
    with probe.capture(smollm, queries="last", layers=[0], attention_mask=left) as cap:
        smollm.model(input_ids=batch["input_ids"].flip(1), attention_mask=left)
    assert cap.maps().query_index.tolist() == [[batch["input_ids"].shape[1] - 1]] * 2


def test_last_query_without_any_mask_is_refused_for_a_batch_and_fine_for_one_row(smollm):
    batch = smollm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with pytest.raises(InputError) as err, probe.capture(smollm, queries="last", layers=[0]):
        smollm.model(input_ids=batch["input_ids"])
    assert "queries='last' needs attention_mask=" in _one_line(err)
    assert not smollm.model._forward_pre_hooks
    single = smollm.tokenizer(PROMPTS[:1], return_tensors="pt")
    with probe.capture(smollm, queries="last", layers=[0]) as cap:
        smollm.model(input_ids=single["input_ids"])
    assert cap.maps().query_index.tolist() == [[single["input_ids"].shape[1] - 1]]


# ------------------------------------------------------------------ 2. pandas texts


def test_a_series_and_a_text_column_are_read_and_other_frames_refused(minilm, loaded):
    frame = pd.DataFrame({"text": CLASSIFIER_TEXTS, "label": [1, 0]})
    assert [e.text for e in probe.prepare(minilm, frame)] == CLASSIFIER_TEXTS
    assert [e.text for e in probe.prepare(minilm, frame["text"])] == CLASSIFIER_TEXTS
    with pytest.raises(InputError) as err:
        probe.prepare(loaded("bert"), frame.rename(columns={"text": "review"}))
    assert "'review', 'label'" in _one_line(err) and "texts=df['review']" in str(err.value)


# ------------------------------------------------------------------ 3. top tokens, NaN and special tokens


def test_top_tokens_leave_out_special_tokens_and_nan(minilm):
    ex = probe.explain(minilm, CLASSIFIER_TEXTS[:1], methods=["loo_delete", "attention_mean"])
    scores = ex["loo_delete"].scores[0]
    assert bool(scores.isnan().any()) and ex.examples[0].special[int(scores.argmax())]  # the trap
    top = ex.top_tokens(3, "loo_delete")
    example = ex.examples[0]
    real = [(p, float(scores[p])) for p in range(len(scores)) if not example.special[p]]
    expected = sorted(real, key=lambda item: -item[1])[:3]
    assert [(p, s) for p, _, s in top] == expected
    assert [t for _, t, _ in top] == [shown_token(example.tokens[p]) for p, _ in expected]  # as the views show it
    # attention scores special tokens with numbers; they are still left out
    assert all(not example.special[p] for p, _, _ in ex.top_tokens(50, "attention_mean"))
    assert len(ex.top_tokens(50, "attention_mean")) == sum(not s for s in example.special)
    with pytest.raises(InputError, match="give method=NAME"):
        ex.top_tokens()
    assert "NaN" in probe.Explanation.__doc__ and "NaN" in probe.TokenScores.__doc__


# ------------------------------------------------------------------ 4. negative layer indices


def test_negative_layers_count_from_the_last_wherever_a_layer_is_an_argument(minilm):
    n_layers = minilm.contract.stacks[minilm.contract.primary_stack].n_layers
    batch = minilm.encode(CLASSIFIER_TEXTS)
    maps = {}
    for layers in ([-1], [n_layers - 1]):
        with probe.capture(minilm, queries="first", layers=layers, attention_mask=batch["attention_mask"]) as cap:
            minilm.model(**batch)
        maps[layers[0]] = cap.maps()
    assert maps[-1].layers == (n_layers - 1,) and torch.equal(maps[-1].weights, maps[n_layers - 1].weights)
    with pytest.raises(ProbeError) as err:
        probe.capture(minilm, layers=[-n_layers - 1]).__enter__()
    assert "(-1 is the last)" in _one_line(err)

    last = probe.counterfactual_attention(minilm, CLASSIFIER_TEXTS[:1], "uniform", layer=-1)
    named = probe.counterfactual_attention(minilm, CLASSIFIER_TEXTS[:1], "uniform", layer=n_layers - 1)
    assert torch.equal(last.output_tvd, named.output_tvd)
    with pytest.raises(InputError) as err:
        probe.counterfactual_attention(minilm, CLASSIFIER_TEXTS[:1], "uniform", layer=n_layers)
    assert "(-1 is the last)" in _one_line(err)

    from probe.intervene.heads import ablate_heads

    examples = probe.prepare(minilm, CLASSIFIER_TEXTS[:1])
    assert torch.equal(ablate_heads(minilm, examples, [[(-1, 0)]]), ablate_heads(minilm, examples, [[(n_layers - 1, 0)]]))


# ------------------------------------------------------------------ 5. erasure bins: fractions in Python, percent in files


def test_erasure_bins_in_percent_are_refused_in_python_and_files_say_their_unit(minilm, tmp_path):
    ex = probe.explain(minilm, CLASSIFIER_TEXTS[:1], methods=["loo_delete"])
    with pytest.raises(InputError) as err:
        probe.erasure(minilm, ex, bins=[10, 20])
    assert "give fractions, e.g. 0.1 for 10%" in _one_line(err)
    assert set(probe.erasure(minilm, ex, bins=[0.1, 0.5])["bin"]) == {0.1, 0.5}
    study = _study(metrics={"erasure": {"bins": [10, 150]}})
    with pytest.raises(InputError) as err:
        probe.study_from_dict(study)
    assert "bins[1]: 150 is out of range; erasure bins are percentages in (0, 100]" in _one_line(err)
    assert "e.g. 10 for 10%" in str(err.value)


def _study(**extra):
    return {"name": "traps", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:imdb"},
            "explainers": ["attention_mean"], "references": ["loo_delete"], **extra}


# ------------------------------------------------------------------ 6. false switches a metric off


@pytest.mark.parametrize("metric", ["erasure", "counterfactual", "heads"])
def test_false_switches_a_metric_off_as_null_does(metric):
    off = probe.study_from_dict(_study(metrics={metric: False}))
    null = probe.study_from_dict(_study(metrics={metric: None}))
    assert getattr(off.metrics, metric) is None and off == null and off.fingerprint() == null.fingerprint()


def test_false_ceilings_compute_none():
    assert probe.study_from_dict(_study(metrics={"ceilings": False})).metrics.ceilings == []
    assert probe.study_from_dict(_study()).metrics.ceilings is None  # null: every pair of references


# ------------------------------------------------------------------ 7. models in memory


def test_models_in_memory_point_to_wrap_and_a_pipeline_is_wrapped(minilm):
    with pytest.raises(InputError) as err:
        probe.explain(minilm.model, ["x"])
    assert "probe.wrap(model, tokenizer)" in _one_line(err)
    with pytest.raises(InputError) as err:
        probe.load_model(minilm.model)
    assert _one_line(err).startswith("load_model takes a name or folder") and "probe.wrap(model, tokenizer)" in str(err.value)
    from transformers import pipeline

    pipe = pipeline("text-classification", model=minilm.model, tokenizer=minilm.tokenizer, device="cpu")
    with pytest.raises(InputError) as err:
        probe.explain(pipe, ["x"])
    assert "probe.wrap(pipeline)" in _one_line(err)
    wrapped = probe.wrap(pipe)
    assert wrapped.contract.to_dict() == minilm.contract.to_dict()
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        probe.wrap(minilm.model)


# ------------------------------------------------------------------ 8. one target per text


def test_one_continuation_per_prompt_and_one_label_per_text(smollm, minilm):
    both = probe.prepare(smollm, ["The capital of France is", "The capital of Italy is"],
                         continuation=[" Paris", " Rome"])
    alone = [probe.prepare(smollm, [text], continuation=cont)[0]
             for text, cont in (("The capital of France is", " Paris"), ("The capital of Italy is", " Rome"))]
    assert [e.label_name for e in both] == [" Paris", " Rome"]
    assert [e.target_ids for e in both] == [e.target_ids for e in alone]
    assert np.allclose([e.original_value for e in both], [e.original_value for e in alone], atol=1e-5)
    labelled = probe.prepare(minilm, CLASSIFIER_TEXTS, label=[1, 0])
    assert [e.label for e in labelled] == [1, 0]
    alone_label = probe.prepare(minilm, CLASSIFIER_TEXTS[1:], label=0)[0]
    # the same example, its target value from a batch of one (equal to the padded batch's within float rounding)
    assert dataclasses.replace(labelled[1], original_value=None) == dataclasses.replace(alone_label, original_value=None)
    assert labelled[1].original_value == pytest.approx(alone_label.original_value, abs=1e-6)
    with pytest.raises(InputError) as err:
        probe.prepare(smollm, PROMPTS, continuation=[" Paris"])
    assert "continuation has 1 value(s) for 2 texts" in _one_line(err)
    with pytest.raises(InputError) as err:
        probe.explain(minilm, CLASSIFIER_TEXTS, methods=["attention_mean"], label=[0, 1, 1])
    assert "label has 3 value(s) for 2 texts" in _one_line(err)


# ------------------------------------------------------------------ 9. torch.inference_mode


def test_gradient_methods_are_refused_under_inference_mode_and_the_others_run(minilm):
    outside = probe.explain(minilm, CLASSIFIER_TEXTS[:1], methods=["attention_mean", "loo_delete"])
    with torch.inference_mode():
        with pytest.raises(InputError) as err:
            probe.explain(minilm, CLASSIFIER_TEXTS[:1], methods=["attention_mean", "saliency"])
        inside = probe.explain(minilm, CLASSIFIER_TEXTS[:1], methods=["attention_mean", "loo_delete"])
        with pytest.raises(InputError, match="outside the `with torch.inference_mode"):
            probe.head_importance(minilm, CLASSIFIER_TEXTS[:1])
    assert "saliency needs gradients" in _one_line(err) and "outside the `with torch.inference_mode():`" in str(err.value)
    for method in outside.methods:
        assert torch.allclose(inside[method].scores[0], outside[method].scores[0], equal_nan=True)


def test_every_method_that_runs_a_backward_pass_says_so_in_the_registry():
    from probe import registry

    assert {m.name for m in registry.REGISTRY if m.needs_gradients} >= {"saliency", "integrated_gradients", "attn_grad"}
    assert registry.counterfactual("adversarial").needs_gradients


# ------------------------------------------------------------------ 10. pickle, save and load


def test_results_pickle_deepcopy_and_save_round_trip(minilm, tmp_path):
    ex = probe.explain(minilm, CLASSIFIER_TEXTS, methods=["loo_delete", "attention", "rollout", "integrated_gradients"],
                       params={"integrated_gradients": {"steps": 4}})
    back = pickle.loads(pickle.dumps(ex))
    assert back == ex and copy.deepcopy(ex) == ex
    assert type(back.scores).__name__ == "mappingproxy" and type(back["attention"].params).__name__ == "mappingproxy"
    assert pickle.loads(pickle.dumps(ex.examples[0])) == ex.examples[0]
    scores = ex["integrated_gradients"]
    assert pickle.loads(pickle.dumps(scores)) == scores
    assert scores != dataclasses.replace(scores, scores=[s + 1 for s in scores.scores])

    loaded_back = probe.load_explanation(ex.save(tmp_path / "saved"))
    assert loaded_back == ex
    for method in ex.methods:
        for mine, theirs in zip(ex[method].scores, loaded_back[method].scores):
            assert mine.shape == theirs.shape and torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))
    pd.testing.assert_frame_equal(loaded_back.to_pandas(), ex.to_pandas())
    with pytest.raises(InputError, match="not a saved explanation"):
        probe.load_explanation(tmp_path)


def test_a_verdict_pickles_equal():
    from probe.study.verdict import Verdict

    verdict = Verdict.from_dict({
        "answer": "no", "headline": "attention does not track loo_delete", "reference": "loo_delete",
        "measure": "kendall_tau", "alpha": 0.05, "level": 0.95, "bootstrap": 2000,
        "layer_units": {"tracking": 0, "total": 6}, "head_units": {"tracking": 0, "total": 0},
        "best": [{"unit": "attention_mean L3", "mean": 0.1, "ci": [0.0, 0.2], "tracks": False}],
        "families": {"attention weights": {"answer": "no", "layer_units": {"tracking": 0, "total": 6}}},
    })
    back = pickle.loads(pickle.dumps(verdict))
    assert back == verdict and back.to_dict() == verdict.to_dict()
    assert type(back.best[0]).__name__ == "mappingproxy" and type(back.families["attention weights"]).__name__ == "mappingproxy"


# ------------------------------------------------------------------ 11. manners: HF's global settings


def test_load_model_leaves_transformers_log_level_and_progress_bars_as_they_were(capfd):
    import transformers
    from transformers.utils import logging as hf_logging

    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    try:
        for verbosity, bars in ((logging.INFO, True), (logging.WARNING, False)):
            transformers.logging.set_verbosity(verbosity)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # huggingface_hub's environment variable may refuse
                (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
            probe.load_model("builtin:minilm-rt")
            assert (transformers.logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == (verbosity, bars)
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        hf_logging.set_verbosity(before[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (hf_logging.enable_progress_bar if before[1] else hf_logging.disable_progress_bar)()


def test_long_calls_show_progress_only_when_asked(minilm, capfd):
    texts = ["a gripping , funny film", "the plot is not good"]
    probe.explain(minilm, texts, methods=["attention_mean", "loo_delete"])
    probe.loo(minilm, texts)
    assert capfd.readouterr().err == ""  # quiet by default (in a notebook too)
    ex = probe.explain(minilm, texts, methods=["attention_mean", "loo_delete"], progress=True)
    err = capfd.readouterr().err
    assert "explain" in err and "2/2" in err and "loo_delete" in err
    probe.loo(minilm, texts, progress=True)
    assert "engine" in capfd.readouterr().err
    probe.erasure(minilm, ex, progress=True)
    assert "engine" in capfd.readouterr().err
    with pytest.raises(InputError, match="progress='yes'"):
        probe.loo(minilm, texts, progress="yes")


# ------------------------------------------------------------------ 12. warnings point at the user's line


def test_a_truncation_warning_points_at_the_callers_line(minilm):
    from probe.models.core import TruncationWarning

    with pytest.warns(TruncationWarning) as record:
        probe.prepare(minilm, ["word " * 2000])
    assert record[0].filename == __file__


def test_warn_at_caller_skips_every_probe_frame():
    from probe.errors import warn_at_caller

    with pytest.warns(UserWarning, match="here") as record:
        warn_at_caller("here")
    assert record[0].filename == __file__
