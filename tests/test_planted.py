"""Planted-truth models: each builds, loads as ``planted:NAME`` with its data, and its truth holds
when measured again here, with plain Hugging Face forwards (eager ``output_attentions``, deletion by
re-running the model), never with probe's own methods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from probe.data import load_dataset
from probe.data.planted_texts import planted_dataset_names
from probe.errors import InputError, ModelLoadError, ProbeError
from probe.models import planted, planted_classifiers
from probe.models.loading import load_model
from probe.models.planted import (
    ANSWERS,
    PLANTED_MODELS,
    build_planted,
    planted_model_names,
)

AUTO = {"classification": transformers.AutoModelForSequenceClassification,
        "causal_lm": transformers.AutoModelForCausalLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("planted-cache")


@pytest.fixture(scope="module")
def loaded(cache):
    """``name -> (ProbeModel, eager HF model, tokenizer, study examples, metadata)``, built once."""
    torch.set_num_threads(1)
    out = {}
    for name in planted_model_names():
        pm = load_model(f"planted:{name}", cache_dir=cache)
        task = PLANTED_MODELS[name].task
        eager = AUTO[task].from_pretrained(pm.path, attn_implementation="eager").eval()
        out[name] = (pm, eager, pm.tokenizer, load_dataset(f"planted:{name}"), pm.metadata)
    return out


def _data_file(pm) -> list[dict]:
    return [json.loads(line) for line in (Path(pm.path) / "data.jsonl").read_text().splitlines()]


def _ids(tok, text):
    return tok(text)["input_ids"]


def _pad(rows, pad_id):
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])  # [row, seq]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [row, seq]
    return ids, mask


def _classify(model, tok, texts):
    """(probs [text, 2], CLS attention rows (last layer, head mean) on the words, deletion effects on
    the predicted class's probability [text][word]) by direct forwards."""
    rows = [_ids(tok, t) for t in texts]
    deleted = [r[:t] + r[t + 1:] for r in rows for t in range(1, len(r) - 1)]
    ids, mask = _pad(rows + deleted, tok.pad_token_id)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    probs = out.logits.double().softmax(-1)
    n, first, attention, loo = len(rows), len(rows), [], []
    for i, r in enumerate(rows):
        c = int(probs[i].argmax())
        attention.append(out.attentions[-1][i].mean(0)[0, 1:len(r) - 1])
        loo.append(probs[i, c] - probs[first:first + len(r) - 2, c])
        first += len(r) - 2
    return probs[:n], attention, loo, out


def test_every_recipe_is_documented_and_has_data():
    assert planted_model_names() == planted_dataset_names()
    for name, recipe in PLANTED_MODELS.items():
        assert recipe.expected and set(recipe.expected) <= set(ANSWERS), name
        assert recipe.truth and recipe.why
        assert name in planted.__doc__


def test_each_model_loads_with_its_metadata_and_data(loaded):
    for name, (pm, _, _, examples, meta) in loaded.items():
        recipe = PLANTED_MODELS[name]
        assert pm.task.name == recipe.task, name
        assert not pm.random_weights, name  # a full checkpoint, randomised included
        assert meta["name"] == name and meta["expected"] == list(recipe.expected) and meta["facts"]
        assert len(examples) == 64
        stored = _data_file(pm)
        assert [(s["text"], s.get("label")) for s in stored] == [(e.text, e.label) for e in examples], name
        vocab = pm.tokenizer.get_vocab()
        assert all(w in vocab for e in examples for w in e.text.split()), name  # no unknown words


@pytest.mark.parametrize("name, saturated", [("trigger-saturated", True), ("trigger-soft", False)])
def test_trigger_models(loaded, name, saturated):
    _, model, tok, examples, meta = loaded[name]
    probs, attention, loo, _ = _classify(model, tok, [e.text for e in examples])
    assert (probs.argmax(-1) == torch.tensor([e.label for e in examples])).all()
    target = probs.max(-1).values
    assert (target > 0.99).all() if saturated else (target < 0.97).all()
    first_by_attention = first_by_loo = 0
    others = []
    for e, a, effect in zip(examples, attention, loo):
        words = e.text.split()
        if "zz" in words:
            first_by_attention += int(a.argmax()) == words.index("zz")
            first_by_loo += int(effect.argmax()) == words.index("zz")
            others += [abs(float(v)) for j, v in enumerate(effect) if j != words.index("zz")]
    with_trigger = sum(e.label for e in examples)
    assert first_by_loo == with_trigger
    assert first_by_attention >= 0.95 * with_trigger
    assert meta["facts"]["top_attended_is_trigger"] == pytest.approx(first_by_attention / with_trigger)
    if not saturated:
        assert 1e-6 < max(others) < 1e-2  # tiny but nonzero


def test_two_triggers_each_have_their_own_effect(loaded):
    _, model, tok, examples, _ = loaded["two-triggers"]
    probs, attention, loo, _ = _classify(model, tok, [e.text for e in examples])
    assert (probs.argmax(-1) == torch.tensor([e.label for e in examples])).all()
    both = 0
    for e, a, effect in zip(examples, attention, loo):
        words = e.text.split()
        places = {words.index(w) for w in ("zz", "yy") if w in words}
        if places:
            assert set(a.argsort(descending=True)[:len(places)].tolist()) == places, e.text
            assert min(float(effect[p]) for p in places) > 0.05, e.text
            both += len(places) == 2
    assert both >= 8


def test_uniform_attention_is_exactly_uniform(loaded):
    _, model, tok, examples, _ = loaded["uniform-attention"]
    probs, _, loo, out = _classify(model, tok, [e.text for e in examples])
    assert (probs.argmax(-1) == torch.tensor([e.label for e in examples])).all()
    mask = _pad([_ids(tok, e.text) for e in examples], tok.pad_token_id)[1]
    for layer in out.attentions:  # [row, head, query, key]
        for i, m in enumerate(mask):
            n = int(m.sum())
            assert torch.equal(layer[i, :, :n, :n], torch.full_like(layer[i, :, :n, :n], 1.0 / n))
    for e, effect in zip(examples, loo):
        if "zz" in e.text.split():
            assert int(effect.argmax()) == e.text.split().index("zz")


def _kendall_is_one(a, b) -> bool:
    """Every pair of words is ordered the same way by ``a`` and by ``b`` (no ties in either)."""
    return all((a[i] - a[j]) * (b[i] - b[j]) > 0 for i in range(len(a)) for j in range(i + 1, len(a)))


def test_attention_is_importance_ranks_identically(loaded):
    _, model, tok, examples, meta = loaded["attention-is-importance"]
    probs, attention, loo, _ = _classify(model, tok, [e.text for e in examples])
    assert (probs.argmax(-1) == 1).all()
    for e, a, effect in zip(examples, attention, loo):
        assert _kendall_is_one(a.tolist(), effect.tolist()), e.text
    assert meta["facts"]["tau_attention_loo_min"] == 1.0
    assert meta["facts"]["tau_attention_loo"] == [1.0] * 64


def test_constant_output_is_exactly_constant(loaded):
    _, model, tok, examples, _ = loaded["constant-output"]
    probs, _, loo, _ = _classify(model, tok, [e.text for e in examples] + ["zz", "red"])
    assert torch.equal(probs, probs[:1].expand_as(probs))
    assert all(torch.equal(effect, torch.zeros_like(effect)) for effect in loo)


def test_below_noise_effects_are_at_the_float32_floor(loaded):
    _, model, tok, examples, meta = loaded["below-noise"]
    _, _, loo, _ = _classify(model, tok, [e.text for e in examples])
    largest = max(float(effect.abs().max()) for effect in loo)
    assert largest <= 1e-7
    assert meta["facts"]["max_abs_loo"] <= 1e-7
    assert meta["facts"]["max_abs_loo_before_scaling"] > 0.9  # the same model, unscaled, is decisive


def test_randomised_is_untrained(loaded):
    pm, model, tok, examples, _ = loaded["randomised"]
    trained = loaded["trigger-saturated"][1]
    assert pm.metadata["training"] is None
    assert not torch.equal(model.classifier.weight, trained.classifier.weight)
    probs, _, _, _ = _classify(model, tok, [e.text for e in examples])
    assert (probs.max(-1).values < 0.6).all()  # default init: the output barely moves


def test_copy_lm_copies_the_marked_word(loaded):
    _, model, tok, examples, meta = loaded["copy-lm"]
    answers = [record["answer"] for record in _data_file(loaded["copy-lm"][0])]
    rows = [_ids(tok, e.text) for e in examples]
    ids, mask = _pad(rows, tok.eos_token_id)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    last = mask.sum(-1) - 1
    greedy = out.logits[torch.arange(len(rows)), last].argmax(-1)
    assert tok.convert_ids_to_tokens(greedy.tolist()) == answers
    for i, (e, answer) in enumerate(zip(examples, answers)):
        row = out.attentions[-1][i, :, last[i], :len(rows[i])].mean(0)  # [key] head mean
        assert int(row.argmax()) == e.text.split().index(answer)
    assert meta["facts"]["greedy_accuracy"] == 1.0


def test_copy_seq2seq_copies_the_marked_word(loaded):
    pm, model, tok, examples, meta = loaded["copy-seq2seq"]
    answers = [record["answer"] for record in _data_file(pm)]
    ids, mask = _pad([_ids(tok, e.text) for e in examples], tok.pad_token_id)
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for row, answer in zip(generated.tolist(), answers):
        assert tok.convert_ids_to_tokens(row[1:3]) == [answer, "</s>"]
    decoder = generated[:, :2]  # start, answer: the positions that predict answer, </s>
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_attentions=True)
    cross = out.cross_attentions[-1].mean(1).mean(1)  # [row, key] head mean, averaged over output positions
    for i, (e, answer) in enumerate(zip(examples, answers)):
        words = e.text.split()
        assert int(cross[i, :len(words)].argmax()) == words.index(answer)
    assert meta["facts"]["greedy_accuracy"] == 1.0


def test_a_build_is_deterministic(loaded, tmp_path):
    planted_classifiers._trained_classifier_state.cache_clear()  # train again, not reuse this process's training
    again = build_planted("trigger-soft", tmp_path / "again")
    assert again["weights_sha256"] == loaded["trigger-soft"][4]["weights_sha256"]
    assert again["weights_sha256"] == planted.weights_sha256(loaded["trigger-soft"][1])


def test_hand_wired_weights_are_the_same_in_every_process():
    """position-heads draws a random word part per token: in token-id order, not in the fast tokenizer's
    get_vocab() order, which comes from a hash map and changes from process to process."""
    code = ("import torch; torch.set_num_threads(1); from probe.models import planted_wired as w; "
            "from probe.models.planted import weights_sha256; print(weights_sha256(w.build_position_heads()[0]))")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
               for _ in range(3)}
    assert len(digests) == 1 and len(next(iter(digests))) == 64


def test_a_second_materialize_reuses_the_folder(loaded, cache):
    folder = planted.materialize_planted("attention-is-importance", cache_dir=cache)
    assert str(folder) == loaded["attention-is-importance"][0].path
    assert folder.name == "attention-is-importance-v1" and folder.parent.name == "planted"
    assert not list(folder.parent.glob(".*.building-*"))


def test_unknown_names_are_one_line_errors():
    with pytest.raises(ModelLoadError) as model_error:
        load_model("planted:nope")
    with pytest.raises(InputError) as data_error:
        load_dataset("planted:nope")
    for error in (model_error, data_error):
        message = str(error.value)
        assert isinstance(error.value, ProbeError) and "\n" not in message
        assert "planted:nope" in message or "'nope'" in message
        assert "planted:trigger-saturated" in message and "planted:copy-seq2seq" in message
