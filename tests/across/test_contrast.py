"""Contrastive targets ("why this rather than that", Yin & Neubig 2022): a classifier's
logit[label] - logit[contrast_label], a language model's per-position log-prob of the target minus
that of a foil after the same prefix. Hand oracles, the identities a difference must satisfy
(leave-one-out and gradients of a difference are differences), batch invariance for every method,
the one-line refusals, the engine's cache, the CLI and a study."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from probe import registry
from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.intervene.rowcache import target_key
from probe.intervene.tokens import loo
from probe.methods import run_method
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec
from probe.rows.values import evaluate

from tolerances import assert_fp_close, gradient_term_scales, model_depth

TEXTS = ["a good film", "the plot was thin and the acting was worse than the plot", "bad", "it was fine , i think"]
#: per tiny model: a contrasted target and the same target without its contrast
CONTRASTS = {
    "bert": (TargetSpec(label=0, contrast_label=1), TargetSpec(label=0, kind="logit")),
    "gpt2": (TargetSpec(continuation="the movie", contrast="a film"), TargetSpec(continuation="the movie")),
    "t5": (TargetSpec(continuation="the movie", contrast="a film"), TargetSpec(continuation="the movie")),
}


@dataclasses.dataclass
class _Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def _cli(monkeypatch, capsys):
    """``probe ARGS`` in this process (no interpreter start-up or import per call): its exit code and output."""
    from probe import cli

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["probe", *map(str, args)])
        capsys.readouterr()
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return _Ran(code, captured.out, captured.err)

    return run


def _one_line(message: str) -> bool:
    return "\n" not in message.strip()


# ------------------------------------------------------------------------------------------ (a) oracles


def test_a_classifier_contrast_is_the_logit_difference(loaded):
    pm = loaded("bert")
    examples = prepare(pm, TEXTS, TargetSpec(label=0, contrast_label=1))
    as_logprob = prepare(pm, TEXTS, TargetSpec(label="NEGATIVE", contrast_label="POSITIVE", kind="logprob"))
    depth = model_depth(pm)
    for text, example, other in zip(TEXTS, examples, as_logprob):
        with torch.no_grad():
            logits = pm.model(**pm.tokenizer(text, return_tensors="pt")).logits[0].float()  # [classes]
        hand = float(logits[0] - logits[1])
        assert example.kind == "logit" and example.contrast_label == 1 and example.contrasted
        assert_fp_close(example.original_value, hand, depth=depth, scale=float(logits.abs().max()))
        assert_fp_close(other.original_value, hand, depth=depth, scale=float(logits.abs().max()))  # logprob: the same
    assert examples[0].label_name == "NEGATIVE vs POSITIVE"
    assert examples[0].describe() == {"label": "NEGATIVE vs POSITIVE", "kind": "logit",
                                      "value": examples[0].original_value, "contrast": "POSITIVE"}
    # the predicted label against a contrast: every text that is not predicted POSITIVE
    predicted = prepare(pm, TEXTS, TargetSpec())
    negatives = [t for t, e in zip(TEXTS, predicted) if e.label == 0]
    if negatives:
        assert prepare(pm, negatives, TargetSpec(contrast_label=1))[0].label == 0


def _lm_oracle(pm, example, kind: str) -> float:
    """Sum over j of score(target_j) - score(foil_j) at the position predicting target j, from plain logits."""
    target, foil = list(example.target_ids), list(example.foil_ids)
    if pm.task.encoder_decoder:
        start = pm.model.config.decoder_start_token_id
        with torch.no_grad():
            logits = pm.model(input_ids=torch.tensor([example.input_ids]),
                              decoder_input_ids=torch.tensor([[start] + target[:-1]])).logits[0].float()
        positions = list(range(len(target)))
    else:
        with torch.no_grad():
            logits = pm.model(input_ids=torch.tensor([list(example.input_ids) + target[:-1]])).logits[0].float()
        positions = [len(example.input_ids) - 1 + j for j in range(len(target))]
    scores = logits if kind == "logit" else torch.log_softmax(logits, dim=-1)  # [seq, vocab]
    return float(sum(scores[p, t] - scores[p, f] for p, t, f in zip(positions, target, foil)))


@pytest.mark.parametrize("model", ["gpt2", "t5"])
@pytest.mark.parametrize("kind", ["logprob", "logit"])
def test_a_language_model_contrast_is_the_per_position_difference(loaded, model, kind):
    pm = loaded(model)
    examples = prepare(pm, TEXTS, TargetSpec(continuation="the movie", contrast="a film", kind=kind))
    foil_ids = pm.tokenizer("a film", add_special_tokens=pm.task.encoder_decoder)["input_ids"]
    depth = model_depth(pm)
    for example in examples:
        assert example.foil_ids == foil_ids and len(example.foil_ids) == len(example.target_ids)
        assert_fp_close(example.original_value, _lm_oracle(pm, example, kind), depth=depth, scale=30.0)
    assert examples[0].label_name == "'the movie' vs 'a film'" and examples[0].describe()["contrast"] == "a film"


def test_a_one_token_foil_is_used_at_every_target_position(loaded):
    pm = loaded("gpt2")
    example, = prepare(pm, TEXTS[:1], TargetSpec(continuation="the movie was", contrast="bad"))
    bad = pm.tokenizer("bad", add_special_tokens=False)["input_ids"]
    assert len(bad) == 1 and example.foil_ids == bad * 3
    assert_fp_close(example.original_value, _lm_oracle(pm, example, "logprob"), depth=model_depth(pm), scale=30.0)


def test_the_greedy_target_takes_a_contrast(loaded):
    pm = loaded("gpt2")
    greedy, = prepare(pm, TEXTS[:1], TargetSpec())
    foil = "movie" if pm.tokenizer.decode(greedy.target_ids) != "movie" else "film"
    contrasted, = prepare(pm, TEXTS[:1], TargetSpec(contrast=foil))
    assert contrasted.target_ids == greedy.target_ids
    assert_fp_close(contrasted.original_value, _lm_oracle(pm, contrasted, "logprob"), depth=model_depth(pm), scale=30.0)


@pytest.mark.slow
def test_the_builtin_classifier_contrast_is_its_logit_difference(builtin_cache):
    import probe

    pm = probe.load_model("builtin:minilm-rt")
    texts = ["a gripping , funny and quietly moving film", "a dull , lifeless mess"]
    examples = probe.prepare(pm, texts, label="positive", contrast_label="negative")
    for text, example in zip(texts, examples):
        with torch.no_grad():
            logits = pm.model(**pm.tokenizer(text, return_tensors="pt")).logits[0].float()
        assert_fp_close(example.original_value, float(logits[1] - logits[0]), depth=model_depth(pm),
                        scale=float(logits.abs().max()))
    assert examples[0].original_value > 0 > examples[1].original_value
    assert examples[0].label_name == "positive vs negative"


# ------------------------------------------------------------------- (b) leave-one-out of a difference


@pytest.mark.parametrize("mode", ["delete", "unk"])
def test_loo_of_a_one_token_contrast_is_the_difference_of_the_loos(loaded, mode):
    """Single-token target and foil on a causal LM: the contrast is exactly value(good) - value(bad) on
    every row, so LOO of the contrast = LOO(good) - LOO(bad) (the prefix-reuse path included)."""
    pm = loaded("gpt2")
    contrast = prepare(pm, TEXTS, TargetSpec(continuation="good", contrast="bad"))
    good = prepare(pm, TEXTS, TargetSpec(continuation="good"))
    bad = prepare(pm, TEXTS, TargetSpec(continuation="bad"))
    got = loo(Engine(pm), contrast, mode)
    want_good, want_bad = loo(Engine(pm), good, mode), loo(Engine(pm), bad, mode)
    for i in range(len(TEXTS)):
        scale = abs(good[i].original_value) + abs(bad[i].original_value)
        assert_fp_close(got.scores[i], want_good.scores[i] - want_bad.scores[i], depth=model_depth(pm), scale=scale,
                        msg=f"example {i}")


@pytest.mark.parametrize("mode", ["delete", "mask"])
def test_loo_of_a_classifier_contrast_is_the_difference_of_the_loos(loaded, mode):
    pm = loaded("bert")
    contrast = prepare(pm, TEXTS, TargetSpec(label=0, contrast_label=1))
    first = prepare(pm, TEXTS, TargetSpec(label=0, kind="logit"))
    second = prepare(pm, TEXTS, TargetSpec(label=1, kind="logit"))
    got = loo(Engine(pm), contrast, mode)
    want_first, want_second = loo(Engine(pm), first, mode), loo(Engine(pm), second, mode)
    for i in range(len(TEXTS)):
        scale = abs(first[i].original_value) + abs(second[i].original_value)
        assert_fp_close(got.scores[i], want_first.scores[i] - want_second.scores[i], depth=model_depth(pm),
                        scale=scale, msg=f"example {i}")


# ------------------------------------------------------------------------ (c) gradients are linear


def _linear_cases(loaded):
    """(model, contrast examples, target-alone examples, foil-as-target examples)."""
    bert = loaded("bert")
    gpt2 = loaded("gpt2")
    return [
        (bert, prepare(bert, TEXTS, TargetSpec(label=0, contrast_label=1)),
         prepare(bert, TEXTS, TargetSpec(label=0, kind="logit")), prepare(bert, TEXTS, TargetSpec(label=1, kind="logit"))),
        (gpt2, prepare(gpt2, TEXTS, TargetSpec(continuation="good", contrast="bad")),
         prepare(gpt2, TEXTS, TargetSpec(continuation="good")), prepare(gpt2, TEXTS, TargetSpec(continuation="bad"))),
    ]


def test_gradients_of_a_contrast_are_the_difference_of_the_gradients(loaded):
    from probe.explainers import gradients as G

    for pm, contrast, target, foil in _linear_cases(loaded):
        depth = model_depth(pm, backward=True)
        raw = {name: G._gradients(pm, examples, times_input=False)[0]
               for name, examples in (("c", contrast), ("t", target), ("f", foil))}  # [rows, width, dim]
        scale = max(float(raw["t"].abs().max()), float(raw["f"].abs().max()))
        assert_fp_close(raw["c"], raw["t"] - raw["f"], depth=depth, scale=scale, msg=f"{pm.task} raw gradient")
        # saliency is the norm of that gradient; input x gradient and IG are linear in the target
        saliency = run_method(pm, contrast, "saliency")
        for i, values in enumerate(saliency.scores):
            n = len(contrast[i].input_ids)
            assert_fp_close(values, (raw["t"] - raw["f"])[i, :n].norm(dim=-1), depth=depth, scale=scale,
                            msg=f"{pm.task} saliency example {i}")
        for name, params in (("input_x_gradient", {}), ("saliency_sum", {}),
                             ("integrated_gradients", {"steps": 16, "internal_batch_size": None})):
            entry = registry.find(name)
            def run(ex, pm=pm, name=name, params=params, entry=entry):
                return run_method(pm, ex, name, params=params) if entry.listed else entry.load_scorer()(pm, ex, name)

            got, t, f = run(contrast), run(target), run(foil)
            scales = [max(a, b) for a, b in zip(gradient_term_scales(pm, target, name, **params),
                                                gradient_term_scales(pm, foil, name, **params))]
            for i in range(len(TEXTS)):
                assert_fp_close(got.scores[i], t.scores[i] - f.scores[i], depth=depth * (4 if "integrated" in name else 1),
                                scale=scales[i], msg=f"{pm.task} {name} example {i}")


# ---------------------------------------------------------------- (d) a batch of one = a batch of several


def _scale(pm, example, plain, entry) -> float | None:
    if entry.family == "gradient":
        return gradient_term_scales(pm, [example], entry.name)[0]
    if entry.family == "intervention":  # a difference of the target's and the contrast's values
        return abs(example.original_value) + abs(plain.original_value)
    return None


@pytest.mark.parametrize("kind", list(CONTRASTS))
@pytest.mark.parametrize("name", [m.name for m in registry.methods(listed=False)])
def test_every_method_explains_a_contrast_alike_alone_and_in_a_batch(loaded, kind, name):
    pm = loaded(kind)
    spec, plain_spec = CONTRASTS[kind]
    examples = prepare(pm, TEXTS, spec)
    reason = registry.skipped(pm, max(len(e.input_ids) for e in examples)).get(name)
    if reason is not None:
        pytest.skip(f"{name} does not apply to the tiny {kind}: {reason}")
    plain = prepare(pm, TEXTS, plain_spec)
    entry = registry.find(name)

    def run(items):
        return run_method(pm, items, name) if entry.listed else entry.load_scorer()(pm, items, name)

    together = run(examples)
    depth = model_depth(pm, backward=entry.needs_gradients) * (4 if name == "integrated_gradients" else 1)
    for i in (1, 2):
        alone = run(examples[i:i + 1])
        assert together.scores[i].shape == alone.scores[0].shape
        assert_fp_close(together.scores[i], alone.scores[0], depth=depth, scale=_scale(pm, examples[i], plain[i], entry),
                        msg=f"{kind} {name} example {i}")
    if entry.family == "intervention" and "original_values" in together.extras:
        assert together.extras["original_values"] == pytest.approx([e.original_value for e in examples], abs=1e-4)


# ------------------------------------------------------------------------------- (e) one-line refusals


@pytest.mark.parametrize("model, spec, message", [
    ("gpt2", TargetSpec(continuation="good", contrast="good"), "is the target of text #0 itself"),
    ("gpt2", TargetSpec(continuation="the movie", contrast="the movie"), "is the target of text #0 itself"),
    ("gpt2", TargetSpec(continuation="good", contrast=" "), "tokenises to nothing"),
    ("t5", TargetSpec(continuation="good", contrast=""), "tokenises to nothing"),
    ("gpt2", TargetSpec(continuation="the movie", contrast="a good film"), "tokenises to 3 tokens and the target"),
    ("t5", TargetSpec(continuation="the movie", contrast="a good film"), "tokenises to 4 tokens and the target"),
    ("gpt2", TargetSpec(continuation="good", contrast_label=1), "--contrast-label applies to classifiers"),
    ("t5", TargetSpec(contrast_label="POSITIVE"), "--contrast-label applies to classifiers"),
    ("bert", TargetSpec(contrast="bad"), "--contrast (a foil text) applies to language models"),
    ("gpt2", TargetSpec(continuation="good", contrast="bad", kind="prob"), "'prob' cannot be contrasted"),
    ("bert", TargetSpec(label=0, contrast_label=1, kind="prob"), "'prob' cannot be contrasted"),
    ("bert", TargetSpec(label=1, contrast_label="POSITIVE"), "is the explained (given) label of text #0"),
    ("bert", TargetSpec(contrast_label=7), "label 7 is out of range"),
    ("gpt2", TargetSpec(continuation="good", contrast=("bad",)), "contrast has 1 value(s) for 2 texts"),
])
def test_a_contrast_that_cannot_be_explained_is_refused_in_one_line(loaded, model, spec, message):
    with pytest.raises(InputError) as err:
        prepare(loaded(model), TEXTS[:2], spec)
    assert message in str(err.value) and _one_line(str(err.value)), str(err.value)


def test_a_contrasted_example_keeps_its_kind_through_the_shared_arithmetic(loaded):
    """A contrasted example switched to kind prob by hand is refused where the value is computed."""
    import dataclasses

    pm = loaded("gpt2")
    example, = prepare(pm, TEXTS[:1], TargetSpec(continuation="good", contrast="bad"))
    with pytest.raises(InputError, match="cannot be contrasted"):
        evaluate(pm, [(example.input_ids, dataclasses.replace(example, kind="prob"))])


def test_the_api_takes_contrasts_wherever_it_takes_targets(loaded):
    import probe

    pm = loaded("gpt2")
    examples = probe.prepare(pm, TEXTS[:2], continuation="the movie", contrast=["a film", "bad"])
    assert [e.contrast_name for e in examples] == ["a film", "bad"]
    scores = probe.loo(pm, TEXTS[:2], continuation="the movie", contrast=["a film", "bad"])
    assert scores.extras["original_values"] == pytest.approx([e.original_value for e in examples], abs=1e-5)
    explanation = probe.explain(pm, TEXTS[:2], "attention_mean,saliency", continuation="the movie", contrast="a film")
    assert explanation.examples[0].contrast_name == "a film" and "vs" in explanation._repr_html_()
    effects = probe.head_ablation(pm, TEXTS[:1], continuation="the movie", contrast="a film")
    assert float(effects.original[0]) == pytest.approx(probe.prepare(pm, TEXTS[:1], continuation="the movie",
                                                                     contrast="a film")[0].original_value, abs=1e-5)
    assert probe.head_importance(pm, TEXTS[:1], continuation="the movie", contrast="a film", ablation=False)
    assert probe.counterfactual_attention(pm, TEXTS[:1], continuation="the movie", contrast="a film")
    bert = loaded("bert")
    assert probe.loo(bert, TEXTS[:1], label=0, contrast_label=1).extras["original_values"][0] == pytest.approx(
        probe.prepare(bert, TEXTS[:1], label=0, contrast_label=1)[0].original_value, abs=1e-5)
    with pytest.raises(InputError, match="the contrasts, generate, steps and chat apply to texts"):
        probe.loo(pm, examples, contrast="bad")


def test_a_contrasted_explanation_saves_and_loads(loaded, tmp_path):
    import probe

    explanation = probe.explain(loaded("gpt2"), TEXTS[:1], "attention_mean", continuation="the movie", contrast="a "
                                                                                                                "film")
    again = probe.load_explanation(explanation.save(tmp_path / "x"))
    assert again.examples == explanation.examples and again.examples[0].foil_ids


# ------------------------------------------------------------------------------------ (f) engine cache


def test_the_engine_cache_keeps_two_foils_apart(loaded):
    """The same rows with two foils (and without one): three different numbers, each the one a fresh
    engine gives; a row key without the foil would hand the first foil's cached value to the second."""
    pm = loaded("gpt2")
    text = TEXTS[1]
    a, = prepare(pm, [text], TargetSpec(continuation="the movie", contrast="a film"))
    b, = prepare(pm, [text], TargetSpec(continuation="the movie", contrast="bad"))
    c, = prepare(pm, [text], TargetSpec(continuation="the movie"))
    assert len({target_key(a), target_key(b), target_key(c)}) == 3
    ids = list(a.input_ids)
    rows = [ids, ids[:3] + ids[4:], ids[:1] + ids[2:]]  # the original and two deletions
    for reuse in (False, True):
        engine = Engine(pm)
        shared = engine.values([(r, e) for e in (a, b, c) for r in rows], reuse_prefix=reuse).view(3, len(rows))
        for k, e in enumerate((a, b, c)):
            fresh = Engine(pm).values([(r, e) for r in rows], reuse_prefix=reuse)
            assert_fp_close(shared[k], fresh, depth=model_depth(pm), scale=30.0, msg=f"reuse={reuse} example {k}")
        assert bool((shared[0] - shared[1]).abs().min() > 1e-3) and bool((shared[0] - shared[2]).abs().min() > 1e-3)
        assert float(shared[0, 0]) == pytest.approx(a.original_value, abs=1e-4)
        assert (engine.stats.prefix_rows > 0) == reuse  # the prefix-reuse passes ran (and only there)
    bert = loaded("bert")
    d, = prepare(bert, [text], TargetSpec(label=0, contrast_label=1))
    e, = prepare(bert, [text], TargetSpec(label=0, kind="logit"))
    both = Engine(bert).values([(d.input_ids, d), (e.input_ids, e)])
    assert float(both[0]) == pytest.approx(d.original_value, abs=1e-5) and float(both[1]) == pytest.approx(
        e.original_value, abs=1e-5) and abs(float(both[0] - both[1])) > 1e-4


# ----------------------------------------------------------------------------------- (g) CLI and study


@pytest.mark.slow
def test_the_cli_prints_the_contrast(builtin_cache, _cli):
    result = _cli("explain", "builtin:smollm2-135m", "The movie was great. Sentiment:", "--continuation", " positive",
                  "--contrast", " negative", "--methods", "attention_mean,saliency,loo_delete")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert "logprob difference ' positive' vs ' negative' = " in first, result.stdout[:400]


@pytest.mark.parametrize("model, args, message", [
    ("gpt2", ["--continuation", "good", "--contrast-label", "1"], "--contrast-label applies to classifiers"),
    ("bert", ["--contrast", "bad"], "--contrast (a foil text) applies to language models"),
    ("gpt2", ["--continuation", "good", "--contrast", "good"], "is the target of text #0 itself"),
    ("gpt2", ["--continuation", "good", "--contrast", "bad", "--target", "prob"], "'prob' cannot be contrasted"),
])
def test_the_cli_refuses_a_wrong_contrast_in_one_line(tiny_dirs, model, args, message, _cli):
    result = _cli("explain", str(tiny_dirs[model]), "the movie was good", "--methods", "attention_mean", *args)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_the_cli_json_carries_the_contrast(tiny_dirs, _cli):
    result = _cli("explain", str(tiny_dirs["bert"]), "the movie was good", "--json", "--methods", "loo_delete",
                  "--label", "NEGATIVE", "--contrast-label", "POSITIVE")
    assert result.returncode == 0, result.stderr
    target = json.loads(result.stdout)["target"]
    assert target["label"] == "NEGATIVE vs POSITIVE" and target["contrast"] == "POSITIVE" and target["kind"] == "logit"


def _dataset(path: Path) -> Path:
    words = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting"]
    texts = [" ".join(words[(i * 5 + j) % len(words)] for j in range(4 + i % 3)) for i in range(6)]
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(6)]}).to_csv(path, index=False)
    return path


def _study(model, data, out, target) -> dict:
    return {"name": "contrast", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": 4, "seed": 0},
            "target": target, "explainers": ["attention_mean", "saliency"], "references": ["loo_delete"],
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False, "examples": 2}},
            "statistics": {"bootstrap": 100}, "engine": {"batch_size": 2}, "output": str(out)}


def test_a_study_explains_a_contrast(tiny_dirs, tmp_path):
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    data = _dataset(tmp_path / "data.csv")
    target = {"continuation": "good", "contrast": "bad"}
    study = study_from_dict(_study(tiny_dirs["gpt2"], data, tmp_path / "out", target))
    assert study.fingerprint() != study_from_dict(_study(tiny_dirs["gpt2"], data, tmp_path / "out",
                                                         {"continuation": "good"})).fingerprint()
    result = run_study(study, progress=False, log=lambda _: None)
    assert result.complete
    examples = pd.read_parquet(tmp_path / "out" / "examples.parquet")
    assert set(examples["target_name"]) == {"'good' vs 'bad'"}
    pm = __import__("probe").load_model(str(tiny_dirs["gpt2"]))
    texts = pd.read_csv(data)["text"].tolist()
    by_hand = {t: e.original_value for t, e in zip(texts, prepare(pm, texts, TargetSpec(continuation="good",
                                                                                         contrast="bad")))}
    for text, value in zip(examples["text"], examples["target_value"]):
        assert value == pytest.approx(by_hand[text], abs=1e-5)


@pytest.mark.parametrize("target, message", [
    ({"continuation": "good", "contrast": "bad", "kind": "prob"}, "kind prob cannot be contrasted"),
    ({"choices": ["good", "bad"], "contrast": "fun"}, "cannot be combined with choices"),
    ({"contrast": "bad", "contrast_label": 1}, "exclude each other"),
    ({"label": 1, "contrast_label": 1}, "is the label itself"),
    ({"label": "gold", "contrast_label": 1}, "cannot be combined with label: gold"),
    ({"contrast": "  "}, "is an empty foil"),
    ({"contrast_label": [1]}, "is not a label"),
])
def test_a_study_file_refuses_a_contrast_it_cannot_explain(tmp_path, target, message):
    from probe.spec.study import study_from_dict

    with pytest.raises(InputError) as err:
        study_from_dict(_study("builtin:minilm-rt", "builtin:rotten_tomatoes", tmp_path / "out", target))
    assert message in str(err.value) and _one_line(str(err.value)), str(err.value)


def test_a_study_refuses_a_contrast_for_the_wrong_model_before_it_writes(tiny_dirs, tmp_path):
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    data = _dataset(tmp_path / "data.csv")
    for model, target, message in (("gpt2", {"continuation": "good", "contrast_label": 1}, "target.contrast_label "
                                                                                           "applies"),
                                   ("bert", {"contrast": "bad"}, "target.contrast (a foil text) applies"),
                                   ("bert", {"contrast_label": "happy"}, "target.contrast_label: unknown label")):
        out = tmp_path / f"out-{model}"
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run_study(study_from_dict(_study(tiny_dirs[model], data, out, target)), progress=False, log=lambda _: None)
        assert not list(out.glob("*.parquet"))
