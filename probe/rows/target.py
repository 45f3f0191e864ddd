"""Targets: the scalar an explanation explains, and the types that carry it: what to explain
(:class:`TargetSpec`), one text tokenised with its target resolved (:class:`PreparedExample`), a
padded batch of rows (:class:`RowBatch`), and the small helpers on them (their seeds, label indices,
special tokens).

A *row* is one sequence of token ids in the explained input (the classifier's text, the causal
LM's prompt, the seq2seq source), perturbed or not, paired with the example it belongs to. Texts
become examples in :mod:`probe.rows.prepare`; every method (capture, gradients, interventions)
evaluates its target through :func:`~probe.rows.forward.build_rows` and
:func:`~probe.rows.values.target_values`, so they all explain exactly the same number.

A *contrastive* target ("why this rather than that", Yin & Neubig 2022) explains a difference from the
same forward pass: a classifier's ``logit[label] - logit[contrast_label]`` (``TargetSpec.contrast_label``),
a language model's sum over the target positions j of ``log p(target_j | prefix, target_<j) -
log p(foil_j | prefix, target_<j)`` (``TargetSpec.contrast``, a foil text aligned token by token with
the target; kind ``logit``: the logits' difference). See :func:`~probe.rows.values.contrast_terms`.

A headless encoder (:mod:`probe.models.encoder`) has no class: its targets are ``similarity``
(cosine of the input's pooled embedding with the fixed embedding of ``TargetSpec.reference``) and
``dimension`` (component ``TargetSpec.dimension`` of the pooled embedding).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from probe.errors import InputError
from probe.spec.target import TARGET_FIELDS

if TYPE_CHECKING:
    from probe.models.core import ProbeModel




@dataclass(frozen=True)
class TargetSpec:
    """What to explain. ``label``: class index or name (default: the predicted class).
    ``continuation``: text whose log-prob a causal LM / seq2seq model explains (default: the
    greedy next token for a causal LM, the greedy output for seq2seq). Either may be a tuple
    with one value per text (:func:`prepare` checks the count).

    ``contrast_label`` (classifiers; index or name): explain ``logit[label] - logit[contrast_label]``
    (kind logit or logprob, the same number; the default kind becomes logit; prob is refused).
    ``contrast`` (language models): a foil text, tokenised as the continuation is, into as many tokens
    as the target or into one (then the foil at every target position); the target becomes the
    log-prob (kind logit: logit) of the target tokens minus that of the foil tokens at the same
    positions, after the same prefix (prob is refused). Both may be tuples, one per text."""

    kind: str | None = None  # default: prob for classifiers, logprob for language models
    label: int | str | tuple[int | str, ...] | None = None
    continuation: str | tuple[str, ...] | None = None
    reference: str | None = None  # kind similarity: the text whose pooled embedding is compared
    dimension: int | None = None  # kind dimension: which component of the pooled embedding
    #: language models: explain every output token on its own (one example per generated step:
    #: :attr:`PreparedExample.step`), the output being ``continuation`` or, without it, the greedy
    #: output of up to ``max_new_tokens`` tokens
    steps: bool = False
    max_new_tokens: int | None = None
    #: causal LMs, with ``steps``: score the output written before each token as well as the prompt
    #: (target-side attribution): each output token's example reads the prompt and the output before
    #: it as its input (:attr:`PreparedExample.written`)
    target_side: bool = False
    #: chat models: each text is the user's message, laid out by the tokenizer's chat template with
    #: the assistant's turn opened; the template's own tokens are kept in the input and marked
    #: special (never scored or perturbed), a message's content is plain text (``chat_encoding``)
    chat: bool = False
    contrast: str | tuple[str, ...] | None = None  # language models: the foil text
    contrast_label: int | str | tuple[int | str, ...] | None = None  # classifiers: the contrasted class

    def __post_init__(self) -> None:
        # made directly (probe.TargetSpec(...)), its fields get the checks the target keywords get (the
        # target's one table, probe.spec.target)
        for declared in TARGET_FIELDS:
            if declared.spec_field:
                declared.check_value(getattr(self, declared.name))


_TARGET_SPEC_INIT = TargetSpec.__init__


@functools.wraps(_TARGET_SPEC_INIT)  # its signature stays the fields' (help(), the API page)
def _target_spec_init(self: TargetSpec, *args: Any, **kwargs: Any) -> None:
    """The dataclass's own ``__init__``, with an unknown keyword refused in one line (not a TypeError)."""
    known = TargetSpec.__dataclass_fields__
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise InputError(f"unknown TargetSpec field {unknown[0]!r}; its fields: {', '.join(known)}")
    if len(args) > len(known):
        raise InputError(f"TargetSpec takes at most {len(known)} values ({', '.join(known)}), got {len(args)}")
    _TARGET_SPEC_INIT(self, *args, **kwargs)


TargetSpec.__init__ = _target_spec_init  # type: ignore[method-assign]


class TargetKeywords(TypedDict, total=False):
    """The target as keywords: every function of ``probe.api`` that prepares, explains or perturbs
    texts takes them beside ``target=`` (a :class:`TargetSpec`), and :func:`target_from` folds them into
    one. ``label``, ``continuation`` and the contrasts are one value for every text or a list with one
    per text; ``generate=N`` is ``steps`` over the greedy output of up to N tokens (``max_new_tokens``);
    every other keyword is the :class:`TargetSpec` field of its name (``reference`` and ``dimension``:
    a headless encoder's targets)."""

    label: int | str | Sequence[int | str] | None
    continuation: str | Sequence[str] | None
    kind: str | None
    generate: int | None
    steps: bool
    chat: bool
    contrast: str | Sequence[str] | None
    contrast_label: int | str | Sequence[int | str] | None
    target_side: bool
    reference: str | None
    dimension: int | None


#: the target keywords, in the order the functions list them (the target's table; :class:`TargetKeywords`
#: is their typed declaration)
TARGET_KEYWORDS = tuple(f.name for f in TARGET_FIELDS if f.keyword)
#: the keywords that take one value for every text or a list with one per text
PER_TEXT = tuple(f.name for f in TARGET_FIELDS if f.per_text)


def target_from(target: TargetSpec | None = None, /, **keywords: Any) -> TargetSpec:
    """The one :class:`TargetSpec` of ``target`` and the target keywords (:class:`TargetKeywords`): the
    keywords folded into a new one, or ``target`` as it is. A keyword beside ``target`` must say what
    the target says (one left at its default, None or False, says nothing); one that disagrees is
    refused in one line."""
    unknown = [k for k in keywords if k not in TARGET_KEYWORDS]
    if unknown:
        raise InputError(f"unknown target keyword {unknown[0]!r}; the target keywords: {', '.join(TARGET_KEYWORDS)}")
    if target is not None and not isinstance(target, TargetSpec):
        raise InputError(f"target={target!r} is not a TargetSpec: give probe.TargetSpec(...) or the target keywords "
                         f"({', '.join(TARGET_KEYWORDS)})")
    fields = _keyword_fields(keywords)
    if target is None:
        target = TargetSpec(**{f: v for name in fields for f, v in fields[name].items()})
    for name, values in fields.items():
        for field_name, value in values.items():
            if getattr(target, field_name) != value:
                raise InputError(f"target= and {name}={keywords[name]!r} disagree (the target's {field_name} is "
                                 f"{getattr(target, field_name)!r}): give the target once, as target= or as keywords")
    if target.target_side and not target.steps:
        raise InputError("target_side=True scores the output written before each output token: give generate=N "
                         "(or steps=True with a continuation)")
    return target


def _keyword_fields(keywords: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target keyword given (not None or False), the :class:`TargetSpec` fields it sets, checked."""
    flags = {f.name for f in TARGET_FIELDS if f.keyword and not f.nullable}  # True or False, never None
    for declared in TARGET_FIELDS:
        if declared.keyword:
            declared.check_value(keywords.get(declared.name, False if declared.name in flags else None))
    fields = {}
    for name, value in keywords.items():
        if value is None or (name in flags and value is False):  # a keyword left at its default
            continue
        if name == "generate":
            fields[name] = {"steps": True, "max_new_tokens": value}
        else:
            fields[name] = {name: one_or_each(value) if name in PER_TEXT else value}
    return fields


def one_or_each(value: Any) -> Any:
    """A list of per-text targets as a tuple (a TargetSpec is frozen); one value as it is."""
    import numpy as np
    import pandas as pd

    if isinstance(value, (list, tuple, np.ndarray, pd.Series, pd.Index)):
        return tuple(value.tolist() if hasattr(value, "tolist") else value)
    return value


@dataclass(frozen=True)
class PreparedExample:
    """One text tokenised with its target resolved. Frozen: a changed target is a new example
    (``dataclasses.replace``), so nothing cached by an example's content goes stale."""

    text: str
    input_ids: list[int]  # the explained tokens, special tokens included
    special: list[bool]  # True where input_ids holds a special token (not scored by default)
    tokens: list[str]
    kind: str  # prob | logit | logprob
    label: int | None = None  # classification
    target_ids: list[int] = field(default_factory=list)  # causal continuation or seq2seq output
    label_name: str | None = None
    original_value: float | None = None  # the target on the unperturbed input
    reference_embedding: torch.Tensor | None = None  # [hidden] kind similarity: the reference's pooled embedding
    #: a language model's output explained token by token: the target is the log-prob (or logit,
    #: prob) of ``target_ids[step]`` alone, given the input and ``target_ids[:step]`` (teacher
    #: forced); None: the whole output's summed log-prob
    step: int | None = None
    #: a target-side step (``TargetSpec.target_side``): the output token's index in its text's output;
    #: ``input_ids`` then holds the prompt and the ``written`` output tokens before it, the target the
    #: next token alone (``step`` None), so every method scores the earlier output as it scores the prompt
    written: int | None = None
    foil_ids: list[int] = field(default_factory=list)  # LM contrast: the foil's id at each target position
    contrast_label: int | None = None  # classifier contrast: the class subtracted
    contrast_name: str | None = None  # what is contrasted (the foil text, the contrast label's name)
    #: a chat prompt (``TargetSpec.chat``): each message's content in ``text``, ``(start, end, role)``
    messages: tuple[tuple[int, int, str], ...] = ()
    #: a chat prompt: each input token's character offsets in ``text`` ((0, 0): a token the tokenizer
    #: adds). Its messages are read as plain text (``chat_encoding``), so where one holds a control
    #: token's text (``<|im_end|>``) re-encoding ``text`` does not give ``input_ids``; empty otherwise
    offsets: tuple[tuple[int, int], ...] = ()

    @property
    def output_index(self) -> int | None:
        """The output token this example explains, by its index in the text's output (a step or a
        target-side step), or None for a whole target."""
        return self.step if self.step is not None else self.written

    @property
    def contrasted(self) -> bool:
        """The target is a difference: this example's label or continuation rather than its contrast."""
        return bool(self.foil_ids) or self.contrast_label is not None

    def describe(self) -> dict:
        described = {"label": self.label_name, "kind": self.kind, "value": self.original_value}
        if self.contrasted:
            described["contrast"] = self.contrast_name
        if self.step is not None:
            described["step"] = self.step
        return described


def sources(examples: Sequence[PreparedExample]) -> list[int]:
    """For step units in order (each text's output tokens, step 0 first), the index of the text each
    came from; for other examples, their own index."""
    owners, current = [], -1
    for example in examples:
        current += example.output_index is None or example.output_index == 0
        owners.append(current)
    return owners


def same_row_groups(examples: Sequence[PreparedExample]) -> list[list[int]]:
    """Indices of ``examples`` in groups that feed the model the same row: the output tokens of one
    text (:attr:`PreparedExample.step` set; one input, output, foil and target kind), each reading
    its own output position of that row. Every other example is a group of its own."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        key = ((tuple(e.input_ids), tuple(e.special), tuple(e.target_ids), tuple(e.foil_ids), e.kind)
               if e.step is not None else ("example", i))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@dataclass
class RowBatch:
    """Padded model inputs for a list of rows, and where each row's target lives."""

    inputs: dict  # kwargs for the model (without input_ids when embeddings are given)
    examples: list[PreparedExample]
    input_lengths: torch.Tensor  # [rows] length of the explained part
    target_positions: torch.Tensor | None  # [rows, n_target] logit positions of target tokens (LMs)
    target_tokens: torch.Tensor | None  # [rows, n_target] ids scored at those positions
    target_valid: torch.Tensor | None  # [rows, n_target] bool (continuations differ in length)
    foil_tokens: torch.Tensor | None = None  # [rows, n_target] contrast foil ids at those positions, -1: none


def label_index(pm: ProbeModel, label: int | str) -> int:
    n_labels = int(getattr(pm.model.config, "num_labels", 0) or 0)
    if isinstance(label, str) and not label.lstrip("-").isdigit():
        mapping = {str(v): int(k) for k, v in (pm.model.config.id2label or {}).items()}
        if label not in mapping:
            raise InputError(f"unknown label {label!r}: this model's labels are {', '.join(mapping)}")
        return mapping[label]
    if isinstance(label, bool) or type(label).__name__ == "bool_":  # True would silently be class 1
        raise InputError(f"label={label!r} is a boolean, not a class: give the class index (e.g. label=1) or its name")
    if isinstance(label, float) or type(label).__name__.startswith("float"):
        if not float(label).is_integer():
            raise InputError(f"label={label!r} is not a class index: give a whole number or the class name")
    elif not isinstance(label, str) and not hasattr(label, "__index__"):
        raise InputError(f"label={label!r} is a {type(label).__name__}, not a class: give the class index or its name")
    index = int(label)
    if not 0 <= index < n_labels:
        raise InputError(f"label {index} is out of range: this model has labels 0..{n_labels - 1}")
    return index


def example_seed(seed: int, example: PreparedExample) -> list[int]:
    """A seed sequence (``numpy.random.default_rng``'s, ``SeedSequence``'s entropy) that depends on
    ``seed`` and the example's input tokens only, never on its place in a batch, so that a seeded
    method gives the same result for an example alone and in any batch (:func:`example_generator`
    for torch). Examples with the same input tokens draw the same (whatever their target): one text
    explained for several targets, steps or contrasts is perturbed alike."""
    import zlib

    import numpy as np

    return [int(seed), zlib.crc32(np.asarray(example.input_ids, dtype=np.int64).tobytes())]


def example_generator(seed: int, example: PreparedExample) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`example_seed` (the input tokens only)."""
    import numpy as np

    return torch.Generator().manual_seed(int(np.random.SeedSequence(example_seed(seed, example)).generate_state(1)[0]))


def target_generator(seed: int, example: PreparedExample) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by ``seed`` and the example's whole content: its input
    tokens, its target's tokens and its label, so one text explained for another target draws
    anew (GradientSHAP's baselines and noise, counterfactual attention's permutations and starting
    points). Never its place in a batch. Kept apart from :func:`example_generator` so that the
    shipped reports these methods made stay reproducible draw for draw."""
    import zlib

    key = repr((int(seed), list(example.input_ids), list(example.target_ids), example.label)).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def special_mask(pm: ProbeModel, ids: list[int]) -> list[bool]:
    special_ids = set(getattr(pm.tokenizer, "all_special_ids", []) or [])
    return [i in special_ids for i in ids]
