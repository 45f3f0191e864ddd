"""Planted recipes of trained BERT classifiers: the trigger task (saturated, soft, held twice), two
additive triggers, uniform attention, and the models derived from the saturated one (constant output,
below noise) or from its architecture (randomised).

Each recipe trains (seeded, one thread) or derives its model, measures its truth with
:func:`probe.models.planted_parts.measure_classifier` and fails unless the truth holds; the table that
names them is in :mod:`probe.models.planted`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from probe.data.planted_texts import SECOND_TRIGGER, TRIGGER, study_texts, training_texts
from probe.models.planted_parts import (
    SEED,
    ClassifierTraining,
    bert_config,
    classifier_facts,
    cls_word_attention,
    measure_classifier,
    pad_rows,
    require_fact,
    token_ids,
    true_share,
    word_tokenizer,
)

if TYPE_CHECKING:  # imported for annotations only
    from transformers import BertForSequenceClassification, PreTrainedTokenizerFast

    #: what a recipe returns: the model, its tokenizer and its metadata (the facts its truth rests on)
    _Built = tuple[BertForSequenceClassification, PreTrainedTokenizerFast, dict[str, Any]]

SATURATED = ClassifierTraining()
SOFT = ClassifierTraining(label_smoothing=0.2)
#: two-triggers: with 4 heads or 300 steps, training often stops where one head serves both triggers
#: (one trigger or two give the same output); 8 heads and 600 steps reached the sum on seeds 0, 1, 2
TWO_TRIGGERS = ClassifierTraining(soft_targets=True, heads=8, steps=600)
UNIFORM = ClassifierTraining(freeze_query_key=True, steps=300)
#: classifier scale of below-noise (its truth says 1e-8; the build checks the effects it gives)
BELOW_NOISE_SCALE = 1e-8


def _query_key_parameters(model):
    return [p for n, p in model.named_parameters() if ".attention.self.query." in n or ".attention.self.key." in n]


@functools.lru_cache(maxsize=4)
def _trained_classifier_state(settings: ClassifierTraining) -> tuple[dict, float]:
    """(state dict, train seconds) of a BERT trained on the trigger texts with ``settings``; cached in
    the process, so the recipes that start from the same training (constant-output, below-noise) share it."""
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = word_tokenizer("bert")
    torch.manual_seed(settings.seed)
    model = BertForSequenceClassification(bert_config(settings, len(tokenizer)))
    if settings.freeze_query_key:
        with torch.no_grad():
            for p in _query_key_parameters(model):
                p.zero_()
                p.requires_grad_(False)
    kind = "two-triggers" if settings.soft_targets else "trigger"
    train = training_texts(kind, settings.n_train, seed=settings.seed)
    ids, mask = pad_rows([token_ids(tokenizer, t.text) for t in train])  # [example, seq]
    if settings.soft_targets:
        n_triggers = torch.tensor([t.text.split().count(TRIGGER) + t.text.split().count(SECOND_TRIGGER)
                                   for t in train], dtype=torch.float32)
        p1 = torch.sigmoid(-3.0 + 4.0 * n_triggers)  # [example]
        targets = torch.stack([1 - p1, p1], dim=-1)  # [example, 2]
    else:
        targets = torch.tensor([t.label for t in train])  # [example]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    started = time.perf_counter()
    model.train()
    for _step in range(settings.steps):
        rows = torch.randint(0, len(train), (settings.batch_size,), generator=generator)  # [batch]
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits  # [batch, 2]
        loss = torch.nn.functional.cross_entropy(logits, targets[rows], label_smoothing=settings.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return {k: v.clone() for k, v in model.state_dict().items()}, time.perf_counter() - started


def _trained_classifier(settings: ClassifierTraining):
    from transformers import BertForSequenceClassification

    tokenizer = word_tokenizer("bert")
    state, seconds = _trained_classifier_state(settings)
    model = BertForSequenceClassification(bert_config(settings, len(tokenizer)))
    model.load_state_dict(state)
    model.eval()
    training = {**asdict(settings), "train_texts": settings.n_train, "train_seconds": round(seconds, 2)}
    return model, tokenizer, training


def build_trigger_saturated() -> _Built:
    model, tokenizer, training = _trained_classifier(SATURATED)
    facts = classifier_facts(measure_classifier(model, tokenizer, study_texts("trigger-saturated")))
    require_fact(facts["accuracy"] == 1.0, "trigger-saturated", f"held-out accuracy {facts['accuracy']}")
    require_fact(facts["target_prob_min"] > 0.99, "trigger-saturated",
                 f"min target prob {facts['target_prob_min']:.4f}")
    require_fact(facts["top_attended_is_trigger"] >= 0.95, "trigger-saturated",
                 f"attention puts zz first on {facts['top_attended_is_trigger']} of the texts holding it")
    return model, tokenizer, {"training": training, "facts": facts}


def build_twice(settings: ClassifierTraining, name: str) -> _Built:
    """A trigger model (``settings``) measured on texts holding zz twice: the copies substitute for each
    other (deleting one barely moves the prediction, deleting both flips it)."""
    model, tokenizer, training = _trained_classifier(settings)
    m = measure_classifier(model, tokenizer, study_texts(name))
    facts = classifier_facts(m)
    copies = [[k for k, w in enumerate(words) if w == TRIGGER] for words in m.words]
    facts["copy_loo_max"] = max(abs(m.loo[i][k]) for i, ks in enumerate(copies) for k in ks)
    facts["copies_top2_attended"] = true_share([
        set(cls_word_attention(m, i).argsort(descending=True)[:2].tolist()) == set(ks)
        for i, ks in enumerate(copies)])
    require_fact(all(len(ks) == 2 for ks in copies), name, "a text without two copies of zz")
    require_fact(facts["accuracy"] == 1.0, name, f"held-out accuracy {facts['accuracy']}")
    require_fact(facts["copy_loo_max"] < 0.05, name, f"deleting one copy moves the prediction by "
                                                     f"{facts['copy_loo_max']:.3f}")
    require_fact(facts["copies_top2_attended"] >= 0.9, name,
                 f"attention ranks both copies on top on only {facts['copies_top2_attended']} of the texts")
    return model, tokenizer, {"training": training, "facts": facts}


def build_trigger_soft() -> _Built:
    model, tokenizer, training = _trained_classifier(SOFT)
    facts = classifier_facts(measure_classifier(model, tokenizer, study_texts("trigger-soft")))
    require_fact(facts["accuracy"] == 1.0, "trigger-soft", f"held-out accuracy {facts['accuracy']}")
    require_fact(facts["target_prob_min"] < 0.97, "trigger-soft", f"min target prob {facts['target_prob_min']:.4f}")
    require_fact(facts["other_abs_loo_max"] > 1e-6, "trigger-soft", "the other words have no effect at all")
    require_fact(facts["top_attended_is_trigger"] >= 0.95 and facts["top_loo_is_trigger"] == 1.0, "trigger-soft",
                 f"zz first by attention on {facts['top_attended_is_trigger']}, by deletion on "
                 f"{facts['top_loo_is_trigger']}")
    return model, tokenizer, {"training": training, "facts": facts}


def build_two_triggers() -> _Built:
    model, tokenizer, training = _trained_classifier(TWO_TRIGGERS)
    m = measure_classifier(model, tokenizer, study_texts("two-triggers"))
    facts = classifier_facts(m, triggers=(TRIGGER, SECOND_TRIGGER))
    by_count: dict[int, list[float]] = {}
    for i, w in enumerate(m.words):
        by_count.setdefault(w.count(TRIGGER) + w.count(SECOND_TRIGGER), []).append(float(m.probs[i, 1]))
    facts["p1_mean_by_triggers"] = {str(k): round(sum(v) / len(v), 4) for k, v in sorted(by_count.items())}
    both = [i for i, w in enumerate(m.words) if TRIGGER in w and SECOND_TRIGGER in w]
    facts["examples_with_both"] = len(both)
    facts["each_trigger_loo_min_when_both"] = min(
        m.loo[i][m.words[i].index(x)] for i in both for x in (TRIGGER, SECOND_TRIGGER))
    facts["both_triggers_top2_attended"] = true_share([
        set(cls_word_attention(m, i).argsort(descending=True)[:2].tolist())
        == {m.words[i].index(TRIGGER), m.words[i].index(SECOND_TRIGGER)} for i in both])
    require_fact(facts["accuracy"] == 1.0, "two-triggers", f"held-out accuracy {facts['accuracy']}")
    require_fact(facts["each_trigger_loo_min_when_both"] > 0.05, "two-triggers",
                 f"a trigger's effect beside the other is only {facts['each_trigger_loo_min_when_both']:.4f}")
    require_fact(facts["top_attended_is_trigger"] >= 0.95, "two-triggers",
                 f"attention ranks the triggers on top on {facts['top_attended_is_trigger']} of the texts")
    return model, tokenizer, {"training": training, "facts": facts}


def build_uniform_attention() -> _Built:
    model, tokenizer, training = _trained_classifier(UNIFORM)
    m = measure_classifier(model, tokenizer, study_texts("uniform-attention"))
    facts = classifier_facts(m)
    deviation = 0.0
    for a in m.attention:  # [layer, head, query, key], unpadded
        deviation = max(deviation, float((a - 1.0 / a.shape[-1]).abs().max()))
    facts["attention_max_deviation_from_uniform"] = deviation
    facts["query_key_abs_max"] = max(float(p.detach().abs().max()) for p in _query_key_parameters(model))
    require_fact(facts["accuracy"] == 1.0, "uniform-attention", f"held-out accuracy {facts['accuracy']}")
    require_fact(facts["query_key_abs_max"] == 0.0, "uniform-attention", "query/key weights moved in training")
    require_fact(deviation < 1e-6, "uniform-attention", f"attention deviates from uniform by {deviation}")
    require_fact(facts["top_loo_is_trigger"] == 1.0, "uniform-attention", "zz is not the most important word")
    return model, tokenizer, {"training": training, "facts": facts}


def build_constant_output() -> _Built:
    import torch

    model, tokenizer, training = _trained_classifier(SATURATED)
    with torch.no_grad():
        model.classifier.weight.zero_()
    m = measure_classifier(model, tokenizer, study_texts("constant-output"))
    facts = classifier_facts(m)
    facts["target_prob_range"] = float(m.probs.max(-1).values.max() - m.probs.max(-1).values.min())
    require_fact(facts["max_abs_loo"] == 0.0 and facts["target_prob_range"] == 0.0, "constant-output",
                 f"the output varies (max |LOO| {facts['max_abs_loo']})")
    return model, tokenizer, {"training": training, "derived_from": "trigger-saturated, classifier.weight = 0",
                              "facts": facts}


def build_below_noise() -> _Built:
    import torch

    model, tokenizer, training = _trained_classifier(SATURATED)
    reference = classifier_facts(measure_classifier(model, tokenizer, study_texts("below-noise")))
    with torch.no_grad():
        model.classifier.weight.mul_(BELOW_NOISE_SCALE)
        model.classifier.bias.mul_(BELOW_NOISE_SCALE)
    m = measure_classifier(model, tokenizer, study_texts("below-noise"))
    facts = classifier_facts(m)
    facts["scale"] = BELOW_NOISE_SCALE
    facts["max_abs_loo_before_scaling"] = reference["max_abs_loo"]
    facts["float32_step_at_0.5"] = float(torch.finfo(torch.float32).eps / 2)
    require_fact(0 < facts["max_abs_loo"] <= 3e-7, "below-noise", f"max |LOO| is {facts['max_abs_loo']:.3g}")
    return model, tokenizer, {"training": training, "derived_from": f"trigger-saturated, classifier x "
                                                                    f"{BELOW_NOISE_SCALE}",
                              "facts": facts}


def build_randomised() -> _Built:
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = word_tokenizer("bert")
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(bert_config(SATURATED, len(tokenizer)))
    model.eval()
    facts = classifier_facts(measure_classifier(model, tokenizer, study_texts("randomised")))
    return model, tokenizer, {"training": None, "init": "transformers' default initialisation, seed 0", "facts": facts}
