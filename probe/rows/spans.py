"""Spans: groups of an example's tokens that a person reads as one unit, and scores per span.

A span is given by the text, not by the tokens: a regular expression (each match is a span) or
character offsets ``(start, end)`` into each example's text. A token belongs to a span when its
characters overlap the span's; special tokens (and a prompt's or chat template's own tokens,
which are marked special) never do. Words are the simplest spans (:mod:`probe.explainers.words`).

Two uses, for every method and every model:

- :func:`span_table`: each method's token scores folded over each span (sum, max or mean,
  NaN-aware), as a tidy table;
- :func:`probe.intervene.spans.span_loo`: leave-one-out of whole spans, f(x) - f(x with every
  token of the span deleted or replaced), each perturbed row once through the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError
from probe.patterns import UserPattern, user_pattern

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample

SpanSpec = str | Sequence[tuple[int, int]]

#: the span spec that reads a chat prompt's messages (``prepare(..., chat=True)``): each message's
#: content is one span, named by its role
ROLE_SPANS = "@roles"

#: how a span's token scores are folded (as words' are: probe.explainers.words)
SPAN_AGGREGATIONS = ("sum", "max", "mean")

#: the columns every span table starts with
SPAN_COLUMNS = ["example", "span_index", "span", "start", "end", "n_tokens"]


@dataclass(frozen=True)
class Span:
    """One span of one example: its text, character offsets and token positions (and, for a chat
    message, its role)."""

    text: str
    start: int
    end: int
    positions: tuple[int, ...]
    role: str | None = None


def with_roles(frame: pd.DataFrame, spans: Sequence[Span], at: np.ndarray) -> pd.DataFrame:
    """``frame`` with a ``role`` column (each row's span's role, rows pointing at ``spans`` by
    ``at``) when any span is a chat message; unchanged otherwise."""
    if any(s.role is not None for s in spans):
        frame["role"] = np.array([s.role for s in spans], dtype=object)[at]
    return frame


def token_offsets(pm: ProbeModel, example: PreparedExample) -> list[tuple[int, int]]:
    """Each token's character offsets in ``example.text`` (special tokens: (0, 0)), from the fast
    tokenizer re-encoding the text; refused in one line when that does not give the example's ids."""
    if not getattr(pm.tokenizer, "is_fast", False):
        raise InputError(f"spans need character offsets, which {pm.name}'s slow tokenizer does not give: load the "
                         "model with its fast tokenizer")
    if len(example.offsets) == len(example.input_ids):  # a chat prompt's, its messages read as plain text
        return [(int(start), int(end)) for start, end in example.offsets]
    for add_special in (True, False):
        encoding = pm.tokenizer(example.text, return_offsets_mapping=True, add_special_tokens=add_special)
        if list(encoding["input_ids"]) == list(example.input_ids):
            return [(int(start), int(end)) for start, end in encoding["offset_mapping"]]
    raise InputError("the example's tokens are not its text as the tokenizer encodes it (truncated, or made by hand): "
                     "spans need the text's own tokens; give shorter texts")


def span_spec(spans: SpanSpec | UserPattern | tuple) -> str | UserPattern | tuple[tuple[int, int], ...]:
    """``spans`` checked once, before any text is read: :data:`ROLE_SPANS`, a regular expression
    (compiled, bounded in time: :mod:`probe.patterns`) or the character offsets as a tuple of
    ``(start, end)`` pairs; anything else refused in one line."""
    if isinstance(spans, UserPattern):
        return spans
    if isinstance(spans, str):
        return spans if spans == ROLE_SPANS else user_pattern(spans, "spans")
    if not isinstance(spans, (list, tuple)):
        shown = repr(spans) if len(repr(spans)) <= 60 else repr(spans)[:60] + "..."
        raise InputError(f"spans={shown} is a {type(spans).__name__}: give a regular expression (e.g. r'\\w+'), "
                         f"character offsets [(start, end), ...] or {ROLE_SPANS!r} for a chat's messages")
    pairs = []
    for item in spans:
        if (not isinstance(item, (tuple, list)) or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
                or not 0 <= item[0] < item[1]):
            raise InputError(f"span {item!r} is not a pair of character offsets (start, end) with 0 <= start < end")
        pairs.append((int(item[0]), int(item[1])))
    return tuple(pairs)


def find_spans(pm: ProbeModel, example: PreparedExample, spans: SpanSpec) -> list[Span]:
    """``example``'s spans: each match of the regular expression ``spans``, or each ``(start, end)``
    of the character offsets given (refused past the text's end), or with :data:`ROLE_SPANS` each
    chat message; spans without a scorable token are left out."""
    spans = span_spec(spans)
    ranges: list[tuple[int, int, str | None]]
    if isinstance(spans, str):  # span_spec's only text is ROLE_SPANS (a pattern comes back compiled)
        if not example.messages:
            raise InputError(f"spans={ROLE_SPANS!r} reads the messages of a chat prompt: prepare the texts with "
                             "chat=True (a conversation is a list of {'role': ..., 'content': ...})")
        ranges = list(example.messages)
    elif isinstance(spans, UserPattern):
        ranges = [(start, end, None) for start, end in spans.ranges(example.text) if end > start]
    else:
        length = len(example.text)
        beyond = [pair for pair in spans if pair[1] > length]
        if beyond:
            raise InputError(f"span {beyond[0]} ends past the end of the text, which has {length} characters "
                             f"({example.text[:40]!r}{'...' if length > 40 else ''}): give offsets within each text "
                             f"(end <= {length}), or a regular expression")
        ranges = [(start, end, None) for start, end in spans]
    offsets = token_offsets(pm, example)
    out = []
    for start, end, role in ranges:
        positions = tuple(p for p, (a, b) in enumerate(offsets)
                          if not example.special[p] and a < end and b > start)
        if positions:
            out.append(Span(example.text[start:end], start, end, positions, role))
    return out


def spans_per_example(pm: ProbeModel, examples: Sequence[PreparedExample], spans: SpanSpec, *,
                      require_any: bool = True) -> list[list[Span]]:
    """:func:`find_spans` of every example (an example without a span: an empty list); with
    ``require_any``, refused in one line when no example has a span (a study, which reads its
    examples batch by batch, checks that over all of them: :func:`probe.study.examples.check_spans`)."""
    checked = span_spec(spans)
    found = [find_spans(pm, e, checked) for e in examples]
    if require_any and not any(found):
        what = f"the pattern {spans!r}" if isinstance(spans, str) else f"the offsets {list(spans)!r}"
        raise InputError(f"{what} covers no scored token of any example: check it against the texts "
                         "(e.g. probe.prepare(pm, texts)[0].text)")
    return found


def fold(values: torch.Tensor, positions: Sequence[int], how: str) -> torch.Tensor:
    """``values[..., positions]`` folded over the last axis by ``how`` (sum, mean or max), NaN-aware:
    NaN entries are left out, and a group of NaN entries only is NaN (not 0)."""
    part = values[..., list(positions)].float()
    missing = torch.isnan(part)
    if how == "sum":
        value = torch.nansum(part, dim=-1)
    elif how == "mean":
        value = torch.nanmean(part, dim=-1)
    else:
        value = part.masked_fill(missing, float("-inf")).amax(dim=-1)
    return value.masked_fill(missing.all(dim=-1), float("nan"))


def span_table(scores: Mapping[str, TokenScores], found: Sequence[Sequence[Span]], how: str = "sum") -> pd.DataFrame:
    """One row per (example, span, method, layer, head): the method's token scores folded over the
    span by ``how`` (sum, max or mean; NaN tokens left out, a span of NaN tokens NaN)."""
    from probe.rows.scores import TokenScores as _Scores

    if how not in SPAN_AGGREGATIONS:
        raise InputError(f"agg={how!r} is not a span aggregation: use one of {', '.join(SPAN_AGGREGATIONS)}")
    frames = []
    for method, result in scores.items():
        for i, spans in enumerate(found):
            if not spans:
                continue
            folded = torch.stack([fold(result.scores[i], s.positions, how) for s in spans], dim=-1)
            frame = _Scores(method, [folded], per_head=result.per_head, per_layer=result.per_layer).to_pandas()
            at = frame["position"].to_numpy()
            frame = frame.rename(columns={"position": "span_index"})
            frame["example"] = i
            frame["span"] = np.array([s.text for s in spans], dtype=object)[at]
            frame["start"] = np.array([s.start for s in spans])[at]
            frame["end"] = np.array([s.end for s in spans])[at]
            frame["n_tokens"] = np.array([len(s.positions) for s in spans])[at]
            frame["method"] = method
            frame = with_roles(frame, spans, at)
            frames.append(frame[[*SPAN_COLUMNS, *(["role"] if "role" in frame else []), "method", "layer", "head",
                                 "score"]])
    columns = [*SPAN_COLUMNS, "method", "layer", "head", "score"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def folded_scores(result: TokenScores, found: Sequence[Sequence[Span]], how: str = "sum") -> TokenScores:
    """``result`` with each example's last axis folded over its spans (``[..., span]``, in the order
    found; an example without spans gets an empty axis), per layer and head where the method has
    them; ``params`` and ``extras`` kept (a span is a unit like a token: IG's completeness holds
    for the sum over spans as for the sum over tokens only when the spans cover every token)."""
    from probe.rows.scores import TokenScores as _Scores

    if how not in SPAN_AGGREGATIONS:
        raise InputError(f"aggregate {how!r} is not a span aggregation: use one of {', '.join(SPAN_AGGREGATIONS)}")
    tensors = []
    for values, spans in zip(result.scores, found):
        if spans:
            tensors.append(torch.stack([fold(values, s.positions, how) for s in spans], dim=-1))
        else:
            tensors.append(values[..., :0].float())
    return _Scores(result.method, tensors, params=result.params, per_head=result.per_head,
                   per_layer=result.per_layer, extras=result.extras)
