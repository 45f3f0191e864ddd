"""Planted recipes of hand-wired BERT classifiers (no training): attention-is-importance (attention
and deletion effect rank the words identically), position-heads and one-head (72 positional heads, one
of them wired onto the trigger in one-head), sink-head and edge-head (one head whose attended edge does
not, or does, carry the decision).

Every weight is set by hand (seeded where random), every truth measured with plain forwards; the table
that names them is in :mod:`probe.models.planted`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from probe.data.planted_texts import FILLER, SECOND_TRIGGER, TRIGGER, WORDS, PlantedText, study_texts
from probe.models.planted_parts import (
    MAX_POSITIONS,
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

# ------------------------------------------------------------------------- attention-is-importance

#: a word's salience in [0, 1] sets its [CLS] attention score to SCORE_SCALE * salience
SCORE_SCALE = 3.0
SPECIAL_SALIENCE = 0.75  # [CLS], [SEP], [PAD], [MASK]: attended like a word of salience 0.75, value 0
MASS_GAIN = 1.0  # the attention output adds MASS_GAIN * (attention mass on words) to the [CLS] stream
LOGIT_GAIN = 6.0


def build_attention_is_importance() -> _Built:
    """One layer, one head, hidden 8. Every embedding is ``[z, -z]`` with ``|z|^2 = 4`` (mean 0, variance 1),
    so the embedding LayerNorm is the identity. z = [is CLS, salience, is word, filler]. The [CLS] query
    reads "is CLS", keys read the salience, values read "is word": the attention output is the attention
    mass A on words times a unit vector; deleting word t lowers A by more the larger its weight. The
    residual LayerNorm keeps A in a component that rises with A; the FFN writes nothing; the pooler and
    classifier are monotone in that component, with a bias that keeps class 1 predicted for every A >= 0.
    """
    import random

    import torch
    from transformers import BertForSequenceClassification

    tokenizer = word_tokenizer("bert")
    vocab = tokenizer.get_vocab()
    torch.manual_seed(SEED)
    settings = ClassifierTraining(hidden=8, heads=1, layers=1)
    config = bert_config(settings, len(tokenizer))
    config.intermediate_size = 4
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    model = BertForSequenceClassification(config)

    words = ["[UNK]", *WORDS]  # attended and valued like words: an unknown word is scored as a word
    saliences = [i / (len(words) - 1) for i in range(len(words))]
    random.Random(SEED).shuffle(saliences)
    _wire_attention_is_importance(model, _salience_embeddings(vocab, len(tokenizer), words, saliences))
    model.eval()
    facts = _attention_is_importance_facts(model, tokenizer)
    return model, tokenizer, {"training": None, "construction": build_attention_is_importance.__doc__.strip(),
                              "saliences": dict(zip(words, saliences)), "facts": facts}


def _salience_embeddings(vocab: dict[str, int], size: int, words: list[str], saliences: list[float]):
    """``[vocab, 4]``: each token's z = [is CLS, salience, is word, filler] (attention-is-importance)."""
    import torch

    z = torch.zeros(size, 4)  # [vocab, 4]
    for token, index in vocab.items():
        if token in words:
            s = saliences[words.index(token)]
            z[index] = torch.tensor([0.0, s, 1.0, math.sqrt(3.0 - s * s)])
        elif token == "[CLS]":
            z[index] = torch.tensor([1.0, SPECIAL_SALIENCE, 0.0, math.sqrt(3.0 - SPECIAL_SALIENCE ** 2)])
        else:
            z[index] = torch.tensor([0.0, SPECIAL_SALIENCE, 0.0, math.sqrt(4.0 - SPECIAL_SALIENCE ** 2)])
    return z


def _wire_attention_is_importance(model, z) -> None:
    """Set every weight of the attention-is-importance model by hand (the rest zero)."""
    import torch

    head_dim = 8
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.bert.embeddings
        emb.word_embeddings.weight.copy_(torch.cat([z, -z], dim=1))  # position and type embeddings stay 0
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        layer = model.bert.encoder.layer[0]
        attention = layer.attention.self
        attention.query.weight[0, 0] = SCORE_SCALE * math.sqrt(head_dim)  # query: "is CLS", scaled
        attention.key.weight[0, 1] = 1.0  # key: the salience
        attention.value.weight[0, 2] = 1.0  # value: "is word"
        dense = layer.attention.output.dense
        dense.weight[1, 0], dense.weight[5, 0] = MASS_GAIN, -MASS_GAIN  # zero-mean write of the mass A
        pooler = model.bert.pooler.dense
        pooler.weight[0, 1] = 1.0
        floor = _mass_component(0.0)  # the component at A = 0: class 1 stays predicted above it
        model.classifier.weight[1, 0] = LOGIT_GAIN
        model.classifier.bias[1] = 0.1 - LOGIT_GAIN * math.tanh(floor)


def _attention_is_importance_facts(model, tokenizer) -> dict:
    """The attention-is-importance model's measured facts, each required of it."""
    m = measure_classifier(model, tokenizer, study_texts("attention-is-importance"))
    taus = [_kendall_tau(cls_word_attention(m, i).tolist(), m.loo[i]) for i in range(len(m.texts))]
    target = m.probs.max(-1).values
    facts = {
        "study_examples": len(m.texts),
        "tau_attention_loo": [round(t, 6) for t in taus],
        "tau_attention_loo_min": min(taus),
        "predicted_class_1_share": true_share([c == 1 for c in m.predicted]),
        "target_prob_min": float(target.min()),
        "target_prob_max": float(target.max()),
        "loo_min": min(v for row in m.loo for v in row),
        "loo_min_gap_between_words": min(
            (b - a for row in m.loo for a, b in zip(sorted(row), sorted(row)[1:])), default=None),
        "max_abs_loo": max(abs(v) for row in m.loo for v in row),
    }
    require_fact(facts["tau_attention_loo_min"] == 1.0, "attention-is-importance",
                 f"Kendall tau between attention and deletion effect is {facts['tau_attention_loo_min']} on some text")
    require_fact(facts["predicted_class_1_share"] == 1.0, "attention-is-importance", "class 0 predicted somewhere")
    return facts


def _mass_component(mass: float) -> float:
    """The pooled-in component of the [CLS] stream after the residual LayerNorm, for attention mass ``mass``."""
    y = SPECIAL_SALIENCE + MASS_GAIN * mass
    rest = 1.0 + 3.0 - SPECIAL_SALIENCE ** 2  # the other components of z for [CLS], squared
    return y / math.sqrt((rest + y * y) / 4.0)


def _layer_norms(model):
    import torch

    return [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]


def _kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties handled; 1.0 for identical rankings)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denominator if denominator else float("nan")


# ---------------------------------------------------------------------- position-heads, one-head

#: 6 layers x 12 heads (72 heads), as the verdict's calibration needs many units
MANY_LAYERS, MANY_HEADS, MANY_HEAD_DIM = 6, 12, 4
#: z = [signal, trigger, is CLS, 6 word dims, word filler | 13 position dims, position filler]
_Z_WORD, _Z_POSITION = 10, 14
_WORD_NORM2, _POSITION_NORM2 = 4.0, 20.0  # |word part|^2 + |position part|^2 = 24 = hidden / 2
POSITION_SCORE_STD = 2.0  # the spread of a position head's [CLS] scores over the keys
#: one-head: the planted layer's other heads share one pattern, sharper, so their mean has a clear positional
#: peak that the planted head's 1/12 share on zz does not outweigh: the layer mean stays positional
LAST_LAYER_SHARPNESS, LAST_LAYER_SPREAD = 2.0, 0.3
PLANTED_HEAD = (MANY_LAYERS - 1, 7)  # one-head: the head whose key reads the trigger
PLANTED_HEAD_SCORE = 8.0  # its [CLS] score on zz (0 elsewhere): about all of its attention
SIGNAL_GAIN, POOL_GAIN, POSITION_LOGIT_GAIN, POSITION_LOGIT_BIAS = 1.0, 1.0, 4.0, 0.1


def build_position_heads() -> _Built:
    return _many_heads(planted_head=False)


def build_one_head() -> _Built:
    return _many_heads(planted_head=True)


def _many_heads(planted_head: bool):
    """6 layers x 12 heads, hidden 48, hand-wired (no training). Every embedding is ``[z, -z]`` (mean 0)
    with ``|z|^2 = 24`` (variance 1): the word embedding fills z's word part and the position embedding
    its position part, each to a fixed norm, so every LayerNorm is the identity on them. Every head's
    query and key read the position part only (random weights, seeded): its [CLS] row depends on the
    positions alone, never on which word stands where. Layers 0-4 write nothing (value, output and FFN
    weights zero), so every layer's input is the embeddings and every head's attention is exactly
    positional. In the last layer every head's value reads the trigger coordinate (1 for zz, 0 for any
    other token) and the output adds the summed attention on zz, s, to the [CLS] signal coordinate;
    the pooler and classifier rise with it, class 1 is predicted on every text (each holds zz once),
    and deleting zz removes s. With ``planted_head`` (one-head) the last layer's head 7 is the
    exception: its query reads "is CLS" and its key the trigger coordinate, so it puts almost all of
    its attention on zz, wherever zz stands; the layer's other 11 heads share one sharper positional
    pattern, so the layer's head mean peaks on a position, not on zz."""
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = word_tokenizer("bert")
    vocab = tokenizer.get_vocab()
    generator = torch.Generator().manual_seed(SEED + 11)
    settings = ClassifierTraining(hidden=2 * (_Z_WORD + _Z_POSITION), heads=MANY_HEADS, layers=MANY_LAYERS)
    config = bert_config(settings, len(tokenizer))
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    model = BertForSequenceClassification(config)
    word = _word_parts(vocab, len(tokenizer), generator)
    position = torch.stack([_filled(torch.cat([torch.randn(_Z_POSITION - 1, generator=generator), torch.zeros(1)]),
                                    _POSITION_NORM2) for _ in range(MAX_POSITIONS)])  # [position, position part]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        emb = model.bert.embeddings
        z_word = torch.cat([word, torch.zeros(len(tokenizer), _Z_POSITION)], dim=1)
        z_position = torch.cat([torch.zeros(MAX_POSITIONS, _Z_WORD), position], dim=1)
        emb.word_embeddings.weight.copy_(torch.cat([z_word, -z_word], dim=1))
        emb.position_embeddings.weight.copy_(torch.cat([z_position, -z_position], dim=1))
        _wire_position_heads(model, generator, planted_head)
        _wire_last_layer(model, planted_head)
    model.eval()

    name = "one-head" if planted_head else "position-heads"
    facts = _many_heads_facts(model, tokenizer, name, planted_head)
    return model, tokenizer, {"training": None, "construction": _many_heads.__doc__.strip(), "facts": facts}


def _filled(vector, norm2: float):
    """``vector`` scaled to at most 3/4 of ``norm2`` (its last entry aside), then its last entry set to
    top the squared norm up to ``norm2``."""
    vector = vector.clone()
    vector[-1] = 0.0
    vector[:-1] *= min(1.0, math.sqrt(0.75 * norm2) / max(float(vector[:-1].norm()), 1e-9))
    vector[-1] = math.sqrt(norm2 - float(vector[:-1].pow(2).sum()))
    return vector


def _word_parts(vocab: dict[str, int], size: int, generator):
    """``[vocab, word part]``: each token's word part (position-heads, one-head), the seeded draws taken
    in the order of the token ids. (Not ``vocab``'s own order: a fast tokenizer's ``get_vocab()`` is
    built from a hash map whose order changes from process to process, which made the weights differ
    between builds before recipe version 2.)"""
    import torch

    word = torch.zeros(size, _Z_WORD)  # [vocab, word part]
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        part = torch.zeros(_Z_WORD)
        part[3:9] = torch.randn(6, generator=generator) * 0.5
        part[1] = 1.0 if token == TRIGGER else 0.0
        part[2] = 1.0 if token == "[CLS]" else 0.0
        part[-1] = 0.0
        word[index] = _filled(part, _WORD_NORM2)
    return word


def _wire_position_heads(model, generator, planted_head: bool) -> None:
    """Every head's query and key read the position part (seeded draws, layer by layer); with
    ``planted_head`` the last layer's heads share one sharper pattern. Inside ``torch.no_grad``."""
    import torch

    d = _Z_WORD + _Z_POSITION
    heads = MANY_HEADS * MANY_HEAD_DIM
    scale = POSITION_SCORE_STD * math.sqrt(math.sqrt(MANY_HEAD_DIM) / _POSITION_NORM2)  # score std ~ the target
    for index, layer in enumerate(model.bert.encoder.layer):
        attention = layer.attention.self
        for weight in (attention.query.weight, attention.key.weight):
            draw = torch.randn(heads, _Z_POSITION, generator=generator)
            if planted_head and index == MANY_LAYERS - 1:  # the other heads share one sharp positional pattern
                common = torch.randn(MANY_HEAD_DIM, _Z_POSITION, generator=generator).repeat(MANY_HEADS, 1)
                draw = LAST_LAYER_SHARPNESS * (common + LAST_LAYER_SPREAD * draw)
            weight[:, _Z_WORD:d] = draw * scale / math.sqrt(_Z_POSITION)


def _wire_last_layer(model, planted_head: bool) -> None:
    """The last layer's values, output and the head on top (position-heads, one-head); with
    ``planted_head`` its head 7 wired onto the trigger. Inside ``torch.no_grad``."""
    d = _Z_WORD + _Z_POSITION
    last = model.bert.encoder.layer[-1]
    for h in range(MANY_HEADS):
        last.attention.self.value.weight[h * MANY_HEAD_DIM, 1] = 1.0  # every head's value: the trigger coordinate
        last.attention.output.dense.weight[0, h * MANY_HEAD_DIM] = SIGNAL_GAIN  # zero-mean write of s
        last.attention.output.dense.weight[d, h * MANY_HEAD_DIM] = -SIGNAL_GAIN
    if planted_head:
        _, h = PLANTED_HEAD
        rows = slice(h * MANY_HEAD_DIM, (h + 1) * MANY_HEAD_DIM)
        last.attention.self.query.weight[rows] = 0.0
        last.attention.self.key.weight[rows] = 0.0
        last.attention.self.query.weight[h * MANY_HEAD_DIM, 2] = PLANTED_HEAD_SCORE * math.sqrt(MANY_HEAD_DIM)
        last.attention.self.key.weight[h * MANY_HEAD_DIM, 1] = 1.0
    model.bert.pooler.dense.weight[0, 0] = POOL_GAIN
    model.classifier.weight[1, 0] = POSITION_LOGIT_GAIN
    model.classifier.bias[1] = POSITION_LOGIT_BIAS


def _many_heads_facts(model, tokenizer, name: str, planted_head: bool) -> dict:
    """The position-heads or one-head model's measured facts, each required of it."""
    m = measure_classifier(model, tokenizer, study_texts(name))
    facts = classifier_facts(m)
    swaps = _trigger_swap_change(model, tokenizer, m.texts)
    facts.update({"predicted_class_1_share": true_share([c == 1 for c in m.predicted]), **swaps})
    if planted_head:
        layer, h = PLANTED_HEAD
        on_trigger = [float(m.attention[i][layer, h, 0, 1:-1][w.index(TRIGGER)]) for i, w in enumerate(m.words)]
        facts["planted_head_attention_on_trigger_min"] = min(on_trigger)
        require_fact(min(on_trigger) > 0.9, name, f"the planted head puts only {min(on_trigger):.3f} on zz somewhere")
    else:
        require_fact(swaps["position_heads_max_change_when_zz_moves"] < 1e-5, name,
                     f"moving zz changes a head's attention by {swaps['position_heads_max_change_when_zz_moves']:.1e}")
    require_fact(facts["top_loo_is_trigger"] == 1.0, name, f"deleting zz is the largest effect on "
                                                           f"{facts['top_loo_is_trigger']}")
    require_fact(facts["predicted_class_1_share"] == 1.0, name, "class 0 predicted somewhere")
    return facts


def _trigger_swap_change(model, tokenizer, texts: Sequence[PlantedText]) -> dict[str, float]:
    """The largest change of any position head's [CLS] row when zz trades places with another word
    (a plain eager forward of both texts): 0 up to rounding where attention depends on positions only."""
    import torch

    worst = 0.0
    for text in texts[:16]:
        words = text.text.split()
        t = words.index(TRIGGER)
        other = (t + 1) % len(words)
        swapped = list(words)
        swapped[t], swapped[other] = swapped[other], swapped[t]
        rows = [token_ids(tokenizer, " ".join(w)) for w in (words, swapped)]
        ids, mask = pad_rows(rows)
        with torch.no_grad():
            attentions = torch.stack(model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions, 1)
        cls = attentions[:, :, :, 0, :]  # [2, layer, head, key]
        keep = torch.ones(MANY_LAYERS, MANY_HEADS, dtype=torch.bool)
        keep[PLANTED_HEAD] = False
        worst = max(worst, float((cls[0] - cls[1]).abs()[keep].max()))
    return {"position_heads_max_change_when_zz_moves": worst}


# ---------------------------------------------------------------------------- sink-head, edge-head

#: z = [is CLS, trigger (zz), sink (yy), salience, signal (0 in every embedding), filler]: |z|^2 = 6 = hidden / 2
_Z_HEAD = 6
SINK_SCORE = 4.0  # sink-head: the [CLS] score on yy; zz scores 0, a filler word its salience
SALIENCE_MAX = 1.5  # sink-head: the filler words' saliences, distinct, in (0, SALIENCE_MAX]
EDGE_SCORE = 6.0  # edge-head: the [CLS] score on zz (every other key scores 0): about all of the head's attention
#: the attention output adds GAIN x (the head's attention on zz) to the [CLS] signal coordinate
SINK_SIGNAL_GAIN, EDGE_SIGNAL_GAIN = 30.0, 2.0
HEAD_LOGIT_GAIN, HEAD_LOGIT_BIAS = 6.0, 0.1


def build_sink_head() -> _Built:
    return _one_head_edges(sink=True)


def build_edge_head() -> _Built:
    return _one_head_edges(sink=False)


def _one_head_edges(sink: bool):
    """One layer, one head, hidden 12, hand-wired (no training). Every embedding is ``[z, -z]`` with
    ``|z|^2 = 6`` (mean 0, variance 1; position and type embeddings zero), so every LayerNorm is the
    identity on it; z = [is CLS, trigger, sink, salience, signal, filler]. The [CLS] query reads
    "is CLS"; the head's value reads the trigger coordinate only (1 for zz, 0 for every other token:
    the value path of every other token is zeroed); the attention output adds the gain times the
    [CLS] row's weight on zz to the [CLS] signal coordinate (zero-mean), the FFN writes nothing, and
    the pooler and classifier rise with that coordinate (class 1 predicted on every text).

    sink-head (texts holding zz and yy once each): the key reads the sink coordinate (yy scores
    SINK_SCORE: about three quarters of the row) and each filler word's salience (distinct, below
    yy's); zz scores 0, the least of all. Where the head looks (yy, then the fillers by salience) is
    the reverse of what matters through it: blocking the edge to yy removes nothing the head writes
    (its value is zero; with the row renormalised the freed mass moves onto zz and the target
    rises), blocking the edge to zz removes the decision.

    edge-head (texts holding zz once): the key reads the trigger coordinate (zz scores EDGE_SCORE,
    every other key 0, so the fillers tie): the head puts over 90% of its row on zz, and that edge
    carries the decision (blocking it, as deleting zz, takes the signal away)."""
    import torch
    from transformers import BertForSequenceClassification

    name = "sink-head" if sink else "edge-head"
    tokenizer = word_tokenizer("bert")
    vocab = tokenizer.get_vocab()
    settings = ClassifierTraining(hidden=2 * _Z_HEAD, heads=1, layers=1)
    config = bert_config(settings, len(tokenizer))
    config.intermediate_size = 4
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(config)
    _wire_one_head(model, _head_embeddings(vocab, len(tokenizer)), sink)
    model.eval()
    facts = _one_head_facts(model, tokenizer, name, sink)
    return model, tokenizer, {"training": None, "construction": _one_head_edges.__doc__.strip(), "facts": facts}


def _head_embeddings(vocab: dict[str, int], size: int):
    """``[vocab, z]``: each token's z = [is CLS, trigger, sink, salience, signal, filler] (sink-head,
    edge-head)."""
    import torch

    saliences = {word: SALIENCE_MAX * (i + 1) / len(FILLER) for i, word in enumerate(FILLER)}
    z = torch.zeros(size, _Z_HEAD)  # [vocab, z]
    for token, index in vocab.items():
        part = torch.zeros(_Z_HEAD)
        part[0] = 1.0 if token == "[CLS]" else 0.0
        part[1] = 1.0 if token == TRIGGER else 0.0
        part[2] = 1.0 if token == SECOND_TRIGGER else 0.0
        part[3] = saliences.get(token, 0.0)
        part[5] = math.sqrt(_Z_HEAD - float(part[:5].pow(2).sum()))
        z[index] = part
    return z


def _wire_one_head(model, z, sink: bool) -> None:
    """Set every weight of the sink-head or edge-head model by hand (the rest zero)."""
    import torch

    head_dim = 2 * _Z_HEAD
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        model.bert.embeddings.word_embeddings.weight.copy_(torch.cat([z, -z], dim=1))
        layer = model.bert.encoder.layer[0]
        attention = layer.attention.self
        attention.query.weight[0, 0] = math.sqrt(head_dim)  # "is CLS", so the [CLS] scores are the key's value
        if sink:
            attention.key.weight[0, 2] = SINK_SCORE
            attention.key.weight[0, 3] = 1.0  # the filler's salience
        else:
            attention.key.weight[0, 1] = EDGE_SCORE
        attention.value.weight[0, 1] = 1.0  # the trigger coordinate: every other token's value is zero
        gain = SINK_SIGNAL_GAIN if sink else EDGE_SIGNAL_GAIN
        dense = layer.attention.output.dense
        dense.weight[4, 0], dense.weight[_Z_HEAD + 4, 0] = gain, -gain
        model.bert.pooler.dense.weight[0, 4] = 1.0
        model.classifier.weight[1, 0] = HEAD_LOGIT_GAIN
        model.classifier.bias[1] = HEAD_LOGIT_BIAS


def _one_head_facts(model, tokenizer, name: str, sink: bool) -> dict:
    """The sink-head or edge-head model's measured facts, each required of it."""
    texts = study_texts(name)
    m = measure_classifier(model, tokenizer, texts)
    knocked = _cls_edge_knockout(model, tokenizer, texts)  # [example][word]: renormalised, by -inf before the softmax
    zeroed = _cls_edge_knockout(model, tokenizer, texts, renormalise=False)
    rows = [m.attention[i][0, 0, 0, 1:-1] for i in range(len(texts))]  # [example] -> [word] the [CLS] row
    trigger = [w.index(TRIGGER) for w in m.words]
    top_knockout = [max(range(len(k)), key=k.__getitem__) == t for k, t in zip(knocked, trigger)]
    facts = {
        "study_examples": len(texts),
        "predicted_class_1_share": true_share([c == 1 for c in m.predicted]),
        "target_prob_min": float(m.probs.max(-1).values.min()),
        "top_knockout_is_trigger": true_share(top_knockout),
        "top_loo_is_trigger": true_share([max(range(len(r)), key=r.__getitem__) == t for r, t in zip(m.loo, trigger)]),
        "trigger_knockout_min": min(k[t] for k, t in zip(knocked, trigger)),
    }
    if sink:
        facts.update(_sink_facts(m, rows, knocked, zeroed, trigger, name))
    else:
        # the fillers tie in attention (each scores 0); their knockout effects differ by float rounding only
        facts["trigger_attention_min"] = min(float(r[t]) for r, t in zip(rows, trigger))
        facts["top_attended_is_trigger"] = true_share([int(r.argmax()) == t for r, t in zip(rows, trigger)])
        facts["other_knockout_max_abs"] = max(abs(v) for k, t in zip(knocked, trigger)
                                              for j, v in enumerate(k) if j != t)
        require_fact(facts["trigger_attention_min"] > 0.9, name,
                     f"the head puts only {facts['trigger_attention_min']:.3f} on zz")
    require_fact(facts["top_knockout_is_trigger"] == 1.0, name, "blocking the edge to zz is not the largest effect")
    require_fact(facts["top_loo_is_trigger"] == 1.0, name, "deleting zz is not the largest effect")
    require_fact(facts["predicted_class_1_share"] == 1.0, name, "class 0 predicted somewhere")
    return facts


def _sink_facts(m, rows: list, knocked: list[list[float]], zeroed: list[list[float]], trigger: list[int],
                name: str) -> dict:
    """The sink-head model's facts about yy, each required of it."""
    sinks = [w.index(SECOND_TRIGGER) for w in m.words]
    facts = {
        "sink_attention_min": min(float(r[s]) for r, s in zip(rows, sinks)),
        "top_attended_is_sink": true_share([int(r.argmax()) == s for r, s in zip(rows, sinks)]),
        "sink_knockout_renormalised_max": max(k[s] for k, s in zip(knocked, sinks)),
        "sink_knockout_zeroed_max_abs": max(abs(k[s]) for k, s in zip(zeroed, sinks)),
        "trigger_attention_max": max(float(r[t]) for r, t in zip(rows, trigger)),
        "tau_attention_knockout": [round(_kendall_tau(r.tolist(), k), 6) for r, k in zip(rows, knocked)],
    }
    require_fact(facts["sink_attention_min"] > 0.5, name,
                 f"the head puts only {facts['sink_attention_min']:.3f} on yy")
    # the yy value is exactly zero; the rows of one batch differ by float rounding only
    require_fact(facts["sink_knockout_zeroed_max_abs"] < 1e-6, name, "zeroing the edge to yy moves the target")
    require_fact(facts["sink_knockout_renormalised_max"] < 0.0, name, "blocking the edge to yy does not lower "
                                                                      "the target's support")
    require_fact(max(facts["tau_attention_knockout"]) < 0.0, name, "attention and knockout agree somewhere")
    return facts


def _cls_edge_knockout(model, tokenizer, texts: Sequence[PlantedText], renormalise: bool = True) -> list[list[float]]:
    """``[example][word]``: p(predicted | text) - the same with the [CLS] row's edge to the word blocked
    in the (one) layer's attention, by plain forwards: renormalised, the key's score set to -inf in the
    additive mask the eager attention adds before its softmax; not renormalised, the word's weighted
    value taken out of the [CLS] context (the other weights kept)."""
    import torch

    attention = model.bert.encoder.layer[0].attention.self
    out = []
    for text in texts:
        ids = token_ids(tokenizer, text.text)
        n = len(ids)
        rows = torch.tensor([ids] * (n - 1))  # row 0 the text, row r blocks the edge [CLS] -> word r
        mask = torch.zeros(n - 1, 1, n, n)  # [row, 1, query, key] additive
        for r in range(1, n - 1):
            mask[r, 0, 0, r] = float("-inf")
        def pre(module, args, kwargs, mask=mask):
            if renormalise:
                kwargs["attention_mask"] = mask
            return args, kwargs

        def post(module, args, kwargs, output, n=n):
            if renormalise:
                return output
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            values = module.value(hidden)  # [row, seq, hidden]: one head
            context, weights = output[0].clone(), output[1]  # [row, seq, hidden], [row, 1, query, key]
            for r in range(1, n - 1):
                context[r, 0] -= weights[r, 0, 0, r] * values[r, r]
            return (context, weights)

        handles = [attention.register_forward_pre_hook(pre, with_kwargs=True),
                   attention.register_forward_hook(post, with_kwargs=True)]
        try:
            with torch.no_grad():
                probs = model(input_ids=rows, output_attentions=True).logits.double().softmax(-1)  # [row, 2]
        finally:
            for handle in handles:
                handle.remove()
        c = int(probs[0].argmax())
        out.append((probs[0, c] - probs[1:, c]).tolist())
    return out
