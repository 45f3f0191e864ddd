"""The texts of the planted-truth models: their vocabulary and their seeded study examples.

Torch-free and below :mod:`probe.models` (it sits beside :mod:`probe.data`, which reads it for
``planted:NAME`` datasets without building a model). :mod:`probe.models.planted` trains its models on
texts drawn here with other seeds, never on a study text, and writes the same study examples into
every model folder as ``data.jsonl``.

Kinds of text (every text is 5-12 space-separated words of ``FILLER`` plus the words below):

=============  ==========================================================================================
trigger        half the texts hold the trigger word ``zz`` once, at a random place; label = 1 if it does
two-triggers   a quarter each hold neither, ``zz``, ``yy``, or both (once each); label = 1 if any
distinct       filler words only, each at most once per text; label = 1 (the hand-wired model's class)
copy           filler words and exactly one marked word (``MARKED``), never the last word; no label; the
               answer (the marked word) is kept beside the text in ``data.jsonl``
one-trigger    ``zz`` once in every text, at a random place; label = 1
two-copies     ``zz`` twice in every text, at two random places; label = 1
trigger-sink   ``zz`` and ``yy`` once each in every text, at two random places; label = 1
=============  ==========================================================================================
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

FILLER = (
    "red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "rock", "fish",
    "bird", "cup", "hat", "box", "pen", "car", "road", "hill", "lake", "rain",
    "snow", "wind", "leaf", "door", "key", "book", "lamp", "milk", "salt", "ship",
)
TRIGGER = "zz"
SECOND_TRIGGER = "yy"
MARKED = ("alpha", "beta", "gamma", "delta", "omega", "sigma")
#: every word a planted model knows, in id order after its tokenizer's special tokens
WORDS = FILLER + (TRIGGER, SECOND_TRIGGER) + MARKED

MIN_WORDS, MAX_WORDS = 5, 12
STUDY_SIZE = 64
PREFIX = "planted:"

#: which kind of text each planted model reads (the models themselves are in probe.models.planted)
PLANTED_TEXT_KINDS: dict[str, str] = {
    "trigger-saturated": "trigger",
    "trigger-soft": "trigger",
    "two-triggers": "two-triggers",
    "uniform-attention": "trigger",
    "attention-is-importance": "distinct",
    "constant-output": "trigger",
    "below-noise": "trigger",
    "randomised": "trigger",
    "copy-lm": "copy",
    "copy-lm-cue": "copy",
    "copy-seq2seq": "copy",
    "position-heads": "one-trigger",
    "one-head": "one-trigger",
    "trigger-twice": "two-copies",
    "trigger-twice-soft": "two-copies",
    "sink-head": "trigger-sink",
    "edge-head": "one-trigger",
}


@dataclass(frozen=True)
class PlantedText:
    text: str
    label: int | None
    answer: str | None = None  # copy texts: the marked word the model must output


def planted_dataset_names() -> list[str]:
    return sorted(PLANTED_TEXT_KINDS)


def text_kind(name: str) -> str:
    """The kind of text model ``name`` reads, or a one-line error listing the valid names."""
    from probe.errors import InputError

    try:
        return PLANTED_TEXT_KINDS[name]
    except KeyError:
        valid = ", ".join(PREFIX + n for n in planted_dataset_names())
        raise InputError(f"unknown planted model {PREFIX}{name}; valid: {valid}") from None


def study_texts(name: str) -> list[PlantedText]:
    """The ``STUDY_SIZE`` held-out study examples of model ``name`` (seeded by the kind, so models
    of one kind share them)."""
    kind = text_kind(name)
    return draw_texts(kind, STUDY_SIZE, seed=_kind_seed(kind))


def training_texts(kind: str, n: int, seed: int) -> list[PlantedText]:
    """``n`` texts of ``kind`` drawn with ``seed`` (offset from the study seed), none of them a study text.
    They are one word shorter at the least (4-12 words), so a study text with one word deleted is a
    length the model was trained on."""
    held_out = {t.text for t in draw_texts(kind, STUDY_SIZE, seed=_kind_seed(kind))}
    out: list[PlantedText] = []
    draw = 0
    while len(out) < n:
        batch = draw_texts(kind, n, seed=_kind_seed(kind) + 1 + 7919 * seed + draw, start=len(out),
                           min_words=MIN_WORDS - 1)
        out.extend(t for t in batch if t.text not in held_out)
        draw += 1
    return out[:n]


def draw_texts(kind: str, n: int, seed: int, start: int = 0, min_words: int = MIN_WORDS) -> list[PlantedText]:
    """``n`` texts of ``kind``; text ``i`` falls in group ``(start + i) % groups`` (balanced classes)."""
    rng = random.Random(seed)
    return [_draw(kind, (start + i) % _GROUPS[kind], rng, min_words) for i in range(n)]


# ------------------------------------------------------------------------------------------ helpers

_GROUPS = {"trigger": 2, "two-triggers": 4, "distinct": 1, "copy": len(MARKED), "one-trigger": 1, "two-copies": 1,
           "trigger-sink": 1}


def _kind_seed(kind: str) -> int:
    return zlib.crc32(kind.encode()) % 100_000


def _draw(kind: str, group: int, rng: random.Random, min_words: int) -> PlantedText:
    length = rng.randint(min_words, MAX_WORDS)
    if kind == "distinct":
        return PlantedText(" ".join(rng.sample(FILLER, length)), 1)
    words = [rng.choice(FILLER) for _ in range(length)]
    if kind == "copy":
        marked = MARKED[group]
        words[rng.randrange(length - 1)] = marked  # never the last word: the copy must look back
        return PlantedText(" ".join(words), None, marked)
    if kind == "one-trigger":  # zz once, at a uniformly drawn place
        words[rng.randrange(length)] = TRIGGER
        return PlantedText(" ".join(words), 1)
    if kind == "trigger-sink":  # zz and yy once each, at two uniformly drawn places
        for word, place in zip((TRIGGER, SECOND_TRIGGER), rng.sample(range(length), 2)):
            words[place] = word
        return PlantedText(" ".join(words), 1)
    if kind == "two-copies":  # zz twice, at two uniformly drawn places: either copy alone decides the label
        for place in rng.sample(range(length), 2):
            words[place] = TRIGGER
        return PlantedText(" ".join(words), 1)
    specials = {"trigger": [(), (TRIGGER,)],
                "two-triggers": [(), (TRIGGER,), (SECOND_TRIGGER,), (TRIGGER, SECOND_TRIGGER)]}[kind][group]
    for word, place in zip(specials, rng.sample(range(length), len(specials))):
        words[place] = word
    return PlantedText(" ".join(words), int(bool(specials)))
