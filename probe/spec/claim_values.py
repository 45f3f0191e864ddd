"""The values a claim's keys hold (:mod:`probe.claims.kinds`): an attention read as
``METHOD@LAYER.HEAD``, a head as ``LAYER.HEAD``, a layer window, and the checks of a claim's
patterns, references and word lists. A parser raises ``ValueError`` with the reason; a check fails
with :func:`~probe.spec.validation.fail` inside a validator."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from probe import registry
from probe.names import ALL_METHODS, ATTENTION_METHODS, method_family
from probe.patterns import pattern_problem
from probe.spec.validation import LAYER_WORDS, fail, show, suggest

__all__ = [
    "AttentionRanking", "PER_HEAD_METHODS", "check_head", "check_reference", "check_regex", "check_words",
    "parse_attention", "parse_head", "parse_layer_window",
]

#: Per-head attention methods ([layer, head, tokens]); the others are per layer ([layer, tokens]).
PER_HEAD_METHODS = registry.per_head_methods()
_ATTENTION_SPEC = re.compile(r"([A-Za-z_]+)(?:@(\d+|first|last)(?:\.(\d+))?)?")
_HEAD_SPEC = re.compile(r"(\d+|first|last)\.(\d+)")


# ------------------------------------------------------------------------------------- small parsers


def check_words(value: list[str] | None, what: str, example: str) -> list[str] | None:
    """A claim's list of words (None: not given): not empty, no empty entry."""
    if value is not None:
        if not value:
            fail(f"is empty; list the words whose tokens {what}, e.g. [{example}]")
        for i, word in enumerate(value):
            if not word.strip():
                fail("an empty word; every entry needs some text", item=[i])
    return value


@dataclass(frozen=True)
class AttentionRanking:
    """``METHOD[@LAYER[.HEAD]]``: an attention explainer read at one layer (and head).

    ``layer`` is an index, ``first`` or ``last`` (default last). Per-head methods (attention,
    attn_norm, attn_grad) are averaged over heads unless a head is given; per-layer methods
    (attention_mean, rollout, flow) take no head.
    """

    method: str
    layer: int | str = "last"
    head: int | None = None

    def __str__(self) -> str:
        head = "" if self.head is None else f".{self.head}"
        return f"{self.method}@{self.layer}{head}"


def parse_attention(text: Any) -> AttentionRanking:
    """``"rollout@last"``, ``"attention_mean@5"``, ``"attention@5.3"`` -> :class:`AttentionRanking`.

    Raises ``ValueError`` with the reason when ``text`` is not of that form.
    """
    match = _ATTENTION_SPEC.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{show(text)} is not METHOD, METHOD@LAYER or METHOD@LAYER.HEAD "
                         "(e.g. rollout@last, attention_mean@5, attention@5.3)")
    method, layer, head = match.groups()
    if method not in ATTENTION_METHODS:
        kind = f"a {method_family(method)} method" if method in ALL_METHODS else "not a method"
        raise ValueError(f"{method!r} is {kind}; a claim about attention reads one of {', '.join(ATTENTION_METHODS)}"
                         f"{suggest(method, ATTENTION_METHODS)}")
    if head is not None and method not in PER_HEAD_METHODS:
        raise ValueError(f"{text.strip()!r}: {method} has one score per layer, not per head; write {method}@{layer} "
                         f"or use a per-head method ({', '.join(PER_HEAD_METHODS)})")
    layer_value: int | str = "last" if layer is None else (layer if layer in LAYER_WORDS else int(layer))
    return AttentionRanking(method, layer_value, None if head is None else int(head))


def parse_head(text: Any) -> tuple[int | str, int]:
    """``"5.3"`` (layer 5, head 3; the layer may be first or last) -> ``(layer, head)``."""
    match = _HEAD_SPEC.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{show(text)} is not LAYER.HEAD (e.g. '5.3' = layer 5, head 3; or 'last.0')")
    layer, head = match.groups()
    return (layer if layer in LAYER_WORDS else int(layer)), int(head)


def check_regex(value: str | None) -> str | None:
    if value is not None:
        if not value.strip():
            fail("is empty; give a regular expression matched against each token's text")
        problem = pattern_problem(value)
        if problem is not None:
            fail(f"{value!r} {problem}")
    return value


def check_reference(value: str) -> str:
    if value not in ALL_METHODS:
        fail(f"unknown method {show(value)} (valid references: "
              f"{', '.join(m for m in ALL_METHODS if m not in ATTENTION_METHODS)}){suggest(value, ALL_METHODS)}")
    if value in ATTENTION_METHODS:
        fail(f"{value!r} is an attention method; the reference is what attention is checked against: "
              "an intervention (loo_delete, loo_mask, ...) or a gradient method")
    return value



def check_head(value: Any) -> Any:
    if isinstance(value, float):
        value = repr(value)  # from a dict; a YAML file keeps the text as written (see load_claims)
    try:
        parse_head(value)
    except ValueError as exc:
        fail(str(exc))
    return value.strip()



_LAYER_RANGE = re.compile(r"(\d+|first|last)\s*-\s*(\d+|first|last)")


def parse_layer_window(value: Any) -> tuple[tuple[int | str, int | str] | None, tuple[int | str, ...]]:
    """``layers`` of an edge claim -> ``(range, layers)``: ``"10-14"`` (inclusive; ends may be first
    or last) is the range ``(10, 14)``; an index, ``first``, ``last`` or a list of indices are the
    layers themselves. Raises ``ValueError`` with the reason."""
    if isinstance(value, bool):
        raise ValueError(f"{show(value)} is not a layer window")
    if isinstance(value, int) or value in LAYER_WORDS:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{value} is negative; give a layer index >= 0, first or last")
        return None, (value,)
    if isinstance(value, list):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise ValueError(f"{show(value)} is not a list of layer indices (ints >= 0, at least one)")
        return None, tuple(value)
    match = _LAYER_RANGE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{show(value)} is not a layer window: give an index, first, last, a range 'A-B' "
                         "(inclusive, e.g. '10-14' or '10-last') or a list of indices")
    first, last = (v if v in LAYER_WORDS else int(v) for v in match.groups())
    return (first, last), ()
