"""Which examples a study (or an audit) explains, and how each becomes a prepared example.

Shared by :mod:`probe.study.runner` and :mod:`probe.claims.run`: an audit picks its examples as a
study with the same data would, and prepares them with the same target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from probe.data import Example, is_user_file, scan_dataset
from probe.errors import InputError
from probe.patterns import user_pattern
from probe.rows.prepare import prepare
from probe.rows.target import TARGET_KEYWORDS, PreparedExample, TargetSpec, sources, target_from
from probe.rows.values import evaluate
from probe.spec.parts import DatasetSpec, DataSpec, ExampleDraw, Filters, TargetConfig

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

__all__ = ["check_contrast", "check_spans", "model_text", "passes_filters", "prepare_examples", "select_examples", "sources", "study_target"]


def passes_filters(example: Example, filters: Filters) -> bool:
    words = len(example.text.split())
    if filters.min_words is not None and words < filters.min_words:
        return False
    if filters.max_words is not None and words > filters.max_words:
        return False
    if filters.labels is not None and example.label not in filters.labels:
        return False
    if filters.contains is not None and not user_pattern(filters.contains, "dataset.filters.contains").search(example.text):
        return False
    return True


def check_spans(pattern: str, target: TargetConfig, data: Sequence[Example], name: str) -> None:
    """Refuse, before any batch runs, a span pattern that matches no text the study's examples give the
    model, or none twice (one span cannot be ranked); an example without spans to rank is left out
    (and counted) batch by batch, whatever its batch."""
    found = user_pattern(pattern, "spans.pattern")
    most = 0
    for e in data:
        most = max(most, sum(1 for start, end in found.ranges(model_text(target, e.text)) if end > start))
        if most >= 2:
            return
    if most == 0:
        raise InputError(f"spans.pattern {pattern!r} matches none of the {len(data)} selected examples of {name}: "
                         "check it against the texts (a span is a match of the pattern in an example's text)")
    raise InputError(f"spans.pattern {pattern!r} matches at most once in each of the {len(data)} selected examples "
                     f"of {name}, and agreement ranks an example's spans, so some example needs two: give a pattern "
                     "with more matches (e.g. '\\w+' for words)")


def model_text(target: TargetConfig, text: str) -> str:
    """The text the model reads: ``target.prompt`` with the example in place of ``{text}``, or the text."""
    prompt = target.prompt
    return prompt.replace("{text}", text) if prompt else text


#: no token of a vocabulary covers more characters of a text than its own spelling has, within this
#: factor (normalisation may contract a text: a combining sequence read as one character)
SPELLING_SLACK = 2


def _length_check(pm: ProbeModel, target: TargetConfig, limit: int):
    """``fit(examples) -> [bool]``: whether each example's model text fits ``limit`` tokens, tokenised
    together; a text with more characters (whitespace aside) than any ``limit`` tokens could spell
    (the vocabulary's longest token, :data:`SPELLING_SLACK` times over) is too long without tokenising
    it (a 10 MB cell costs nothing). A normaliser that drops characters wholesale (a text of nothing
    but combining accents, for an accent-stripping tokenizer) could make such a text short: it is
    left out as too long all the same."""
    try:
        longest = max((len(token) for token in pm.tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        longest = 0
    most_chars = SPELLING_SLACK * longest * limit if longest else None

    def fit(examples: list[Example]) -> list[bool]:
        texts = [model_text(target, e.text) for e in examples]
        short = [most_chars is None or len(t) <= most_chars or sum(map(len, t.split())) <= most_chars for t in texts]
        measured = [t for t, ok in zip(texts, short) if ok]
        # a tokenizer refuses an empty batch
        lengths = iter([len(ids) for ids in pm.tokenizer(measured)["input_ids"]] if measured else [])
        return [ok and next(lengths) <= limit for ok in short]

    return fit


def select_examples(pm: ProbeModel, data: ExampleDraw, target: TargetConfig) -> tuple[list[Example], dict]:
    """The examples, in order, and counts of what was left out and why (``filters``, ``too_long``).

    A study's ``dataset`` and a claim file's ``data`` are read alike: the whole split, the examples
    that pass the filters (a study's; a claim file has none), those whose model text fits the
    model's window and ``max_length``, then ``n`` of them after a shuffle with ``seed``. A claim
    file's ``texts`` are taken as written (the first ``n``). The study refuses an ``n`` larger than
    what is left in its own words; the audit leaves that to :func:`probe.data.take`.
    """
    if isinstance(data, DataSpec) and data.texts is not None:  # a claim file's texts (its source is None)
        items = [Example(f"text-{i}", text, None) for i, text in enumerate(data.texts)]
        return (items[: data.n] if data.n is not None else items), {}
    name = data.source
    filters = data.filters if isinstance(data, DatasetSpec) else None
    limit = min(data.max_length or pm.contract.max_positions, pm.contract.max_positions)
    dropped = {"filters": 0, "too_long": 0}

    fit = _length_check(pm, target, limit)

    def fits(chunk: list[Example]) -> list[bool]:
        """Which examples of a chunk pass the filters and fit ``limit`` (tokenised a chunk at a time)."""
        passing = [filters is None or passes_filters(e, filters) for e in chunk]
        lengths_ok = iter(fit([e for e, p in zip(chunk, passing) if p]))
        kept = [p and next(lengths_ok) for p in passing]
        dropped["filters"] += passing.count(False)
        dropped["too_long"] += sum(p and not k for p, k in zip(passing, kept))
        return kept

    if data.n is not None and is_user_file(name):
        # a user file: one pass keeps the positions of the examples that pass the filters (no tokeniser),
        # and the draw checks the length of the examples it draws only (a file of 10^6 rows: seconds)
        scan = scan_dataset(name, split=data.split, text_column=data.text_column, label_column=data.label_column,
                            keep=None if filters is None else (lambda chunk: [passes_filters(e, filters)
                                                                                for e in chunk]))
        dropped["filters"] = scan.total - scan.count
        if not scan.count:
            raise InputError(f"no example of {name} is left after the filters; loosen them")
        chosen, dropped["too_long"] = scan.take_fitting(data.n, data.seed, fit)
        return chosen, dropped
    # data in memory (built-in, planted) or every example: the lengths of all, as every shipped study drew
    scan = scan_dataset(name, split=data.split, text_column=data.text_column, label_column=data.label_column,
                        keep=fits, hold=data.n is None)
    if not scan.count and filters is None:
        raise InputError(f"no example of {name} fits in {limit} tokens; raise data.max_length")
    if not scan.count:
        raise InputError(f"no example of {name} is left after the filters and max_length={limit}; loosen them")
    if filters is not None and data.n is not None and data.n > scan.count:
        raise InputError(f"n={data.n} is larger than the {scan.count} examples of {name} left after the filters "
                         f"and the length limit; give n <= {scan.count}")
    return scan.take(data.n, data.seed), dropped


def _template_positions(pm: ProbeModel, target: TargetConfig, text: str, ids: list[int]) -> list[bool]:
    """True where a prompt token lies outside the inserted text (the template is not explained)."""
    prompt = target.prompt
    if not prompt:
        return [False] * len(ids)
    start = prompt.index("{text}")
    span = (start, start + len(text))
    enc = pm.tokenizer(model_text(target, text), return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        return [False] * len(ids)
    return [not (b > span[0] and a < span[1]) for a, b in enc["offset_mapping"]]


def prepare_examples(pm: ProbeModel, target: TargetConfig, texts: Sequence[str],
                     gold: Sequence[int | None] | None = None) -> list[PreparedExample]:
    """Tokenise and resolve each example's target as ``target`` says.

    ``target.choices`` (causal LMs): the explained continuation is the choice with the highest
    log-prob; ``example.label`` then holds its index, so choices are listed in label order.
    ``target.label: gold`` (classifiers): each example's dataset label (``gold``), as Abnar &
    Zuidema's "correct class". ``target.prompt``: the template's own tokens are marked special (kept
    in the input, never scored or perturbed). ``target.contrast`` / ``target.contrast_label``: the
    target is a difference, the continuation (or label) rather than the foil (or the other label).
    ``target.generate`` / ``target.steps``: one prepared example (a unit) per output token, the
    units of a text in step order (:func:`sources` maps them back to their texts).
    """
    t = target
    inputs = [model_text(t, text) for text in texts]
    if t.choices:
        per_choice = [prepare(pm, inputs, TargetSpec(kind=t.kind, continuation=c), strict_length=True) for c in t.choices]
        values = torch.tensor([[e.original_value for e in group] for group in per_choice])  # [choice, example]
        best = values.argmax(dim=0).tolist()
        examples = [dataclasses.replace(per_choice[c][i], label=c) for i, c in enumerate(best)]
    elif t.label == "gold":
        examples = _gold_examples(pm, t, inputs, gold)
    else:
        examples = prepare(pm, inputs, study_target(t), strict_length=True)
    marked = []
    owners = sources(examples) if t.stepwise else range(len(examples))
    for owner, example in zip(owners, examples):
        template = _template_positions(pm, t, texts[owner], example.input_ids)
        marked.append(dataclasses.replace(example, special=[s or m for s, m in zip(example.special, template)]))
    return marked


def study_target(target: TargetConfig) -> TargetSpec:
    """The study file's target section as the :class:`~probe.rows.target.TargetSpec` it names, folded
    by :func:`~probe.rows.target.target_from` from the keys it shares with the Python keywords (the
    rest, ``prompt``, ``choices`` and ``label: gold``, the study reads itself)."""
    keys = TargetConfig.model_fields.keys() & set(TARGET_KEYWORDS)
    return target_from(**{key: getattr(target, key) for key in sorted(keys)})


def check_contrast(pm: ProbeModel, target: TargetConfig, where: str = "") -> None:
    """Refuse, before anything runs, a contrast for the wrong kind of model: ``target.contrast`` (a foil
    text) needs a language model, ``target.contrast_label`` a classifier (and a label it has)."""
    from probe.rows.target import label_index

    if target.contrast is not None and not pm.task.continuations:
        instead = "target.contrast_label: LABEL" if pm.task.labels else "no contrast"
        raise InputError(f"{where}target.contrast (a foil text) applies to language models; {pm.name} is a "
                         f"{pm.task.head}: use {instead}")
    if target.contrast_label is not None:
        if not pm.task.labels:
            instead = "target.contrast: FOIL TEXT" if pm.task.continuations else "no contrast"
            raise InputError(f"{where}target.contrast_label applies to classifiers; {pm.name} is a {pm.task.head}: "
                             f"use {instead}")
        try:
            label_index(pm, target.contrast_label)
        except InputError as err:
            raise InputError(f"{where}target.contrast_label: {err}") from None


def _gold_examples(pm: ProbeModel, target: TargetConfig, inputs: list[str],
                   gold: Sequence[int | None] | None) -> list[PreparedExample]:
    """``target.label: gold``: each example explains its dataset label, valued again for that label."""
    examples = prepare(pm, inputs, TargetSpec(kind=target.kind), strict_length=True)
    if gold is None or any(g is None for g in gold):
        raise InputError("target.label: gold explains each example's dataset label, and some examples have none; "
                         "give a label column or leave target.label out (the predicted class)")
    names = pm.model.config.id2label or {}
    examples = [dataclasses.replace(e, label=int(g), label_name=str(names.get(int(g), g)))
                for e, g in zip(examples, gold)]
    values = evaluate(pm, [(e.input_ids, e) for e in examples])
    return [dataclasses.replace(e, original_value=value) for e, value in zip(examples, values.tolist())]
