"""``edge``: the target row's attention to the named tokens matters in a window of layers.

Per example, the target row's edges to every token matching ``to`` (``to_words``, or the one at
``to_position``) are blocked at once in every chosen head of every layer of the window (Geva et
al. 2023's attention knockout); effect = |f(x) - f(x, edges blocked)|, supported when its CI lies
above ``threshold``, refuted when below. Examples without such a token are left out. Evidence: the
signed change, and the target row's raw attention on those tokens in the window.

Control (always computed, in the same forward batch): per example, ``CONTROL_DRAWS`` seeded draws
of as many other scored tokens (never a named or special token, nor a sink of at least half of the
claim's heads; all of them where fewer are left, none: no control) have the target row's edges to
them blocked alike; evidence ``control`` gives their mean |change| and the share of examples whose
named edges move the target more than their draws on average. The verdict is the threshold's alone,
but a supported claim whose control also reaches the threshold, or whose named edges beat the
control in at most half of the examples, carries ``control["warning"]``: the effect is not specific
to the tokens. (The keys, the control draws and the blocked changes: :mod:`probe.claims.edges`.)
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from probe.claims.edges import (
    CONTROL_DRAWS,
    control_keys,
    edge_details,
    renormalised,
    set_changes,
    window_words,
)
from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result, summary
from probe.claims.rules import Rule, at_least_rule
from probe.claims.spec import ClaimSpec
from probe.errors import InputError
from probe.patterns import UserPattern, user_pattern
from probe.spec.claim_values import check_regex, check_words, parse_layer_window
from probe.spec.validation import Bool, Float, Int, fail, show

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["EdgeClaim", "KIND"]


class EdgeClaim(ClaimSpec):
    """The target row's attention to the named tokens matters in a window of layers: blocking the
    edges from the target query row to every token matching ``to`` (or ``to_words``, or the one at
    ``to_position``) in every head of ``layers`` (or ``heads``), all at once (Geva et al. 2023's
    attention knockout), changes the target by more than ``threshold`` (mean |change| per example).
    Examples without such a token are left out."""

    kind: Literal["edge"]
    #: the layer window: an index, first, last, an inclusive range "A-B" ("10-14", "10-last") or a list
    layers: int | str | list[int]
    #: query heads whose edges are blocked: one index or a list (default: every head)
    heads: Int | list[Int] | None = None
    #: a regular expression a token's text matches whole (case-insensitive): the attended tokens
    to: str | None = None
    #: instead of to: the words whose tokens are the attended ones
    to_words: list[str] | None = None
    #: instead of to: one position of the explained tokens (0 the first; negative from the end)
    to_position: Int | None = None
    #: the mean |change of the target| (its units: a probability, a log-prob, ...) the claim needs
    threshold: Annotated[Float, Field(gt=0)] = 0.05
    #: blocked edges leave the row renormalised over the other keys (= -inf before the softmax), or
    #: only zeroed
    renormalise: Bool = True

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        try:
            parse_layer_window(value)
        except ValueError as exc:
            fail(str(exc))
        return value.strip() if isinstance(value, str) else value

    @field_validator("to")
    @classmethod
    def _to(cls, value: str | None) -> str | None:
        return check_regex(value)

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, value: Any) -> Any:
        # checked here, not by the union's branches, whose names (constrained-int) would reach the message
        if value is None:
            return value
        listed = isinstance(value, list)
        for i, head in enumerate(value if listed else [value]):
            if isinstance(head, bool) or not isinstance(head, int) or head < 0:
                fail(f"{show(head)} is not a head index; give an index >= 0 (0 the first head) or a list of them, "
                     "or leave heads out for every head", item=[i] if listed else [])
        return value

    @field_validator("to_words")
    @classmethod
    def _to_words(cls, value: list[str] | None) -> list[str] | None:
        return check_words(value, "the edges go to", "Paris")

    @model_validator(mode="after")
    def _one_target(self) -> EdgeClaim:
        given = [k for k in ("to", "to_words", "to_position") if getattr(self, k) is not None]
        if len(given) != 1:
            fail("give exactly one of to (a regular expression), to_words (a list) or to_position (an index); "
                 f"{'none was' if not given else ', '.join(given) + ' were'} given", at=["to"])
        return self

    @property
    def window(self) -> tuple[tuple[int | str, int | str] | None, tuple[int | str, ...]]:
        return parse_layer_window(self.layers)

    @property
    def head_list(self) -> tuple[int, ...] | None:
        return None if self.heads is None else tuple(self.heads) if isinstance(self.heads, list) else (self.heads,)

    def matcher(self) -> UserPattern | None:
        if self.to_words is not None:
            return user_pattern("|".join(re.escape(w.strip()) for w in self.to_words), "to_words", ignore_case=True)
        return None if self.to is None else user_pattern(self.to, "to", ignore_case=True)

    @property
    def to_what(self) -> str:
        if self.to_position is not None:
            return f"the token at position {self.to_position}"
        return (f"the tokens matching {self.to!r}" if self.to is not None
                else f"the tokens of the words {', '.join(self.to_words)}")


def rule(claim: EdgeClaim) -> Rule:
    """A mean |change| above the claim's threshold."""
    return at_least_rule(claim.threshold)


def check(ctx: AuditContext, claim: EdgeClaim, index: int) -> None:
    ctx.layer_window(claim.layers, index)
    for head in claim.head_list or ():
        ctx.head(head, index, "heads")


def run(ctx: AuditContext, claim: EdgeClaim, index: int) -> ClaimResult:
    from probe.intervene.knockout import EdgeSet

    window = ctx.layer_window(claim.layers, index)
    heads = (list(range(ctx.n_heads)) if claim.head_list is None
             else sorted({ctx.head(h, index, "heads") for h in claim.head_list}))
    keys = _keys(ctx, claim, index)
    sites = tuple((layer, head) for layer in window for head in heads)
    controls = control_keys(ctx, keys, sites)
    sets = [EdgeSet(i, k, sites) for i, k in enumerate(keys) if k]
    control_sets = [EdgeSet(i, c, sites) for i, draws in enumerate(controls) for c in draws]
    all_changes = set_changes(ctx, sets + control_sets, claim.renormalise)  # one batched call: one shared f(x)
    changes = {s.example: float(c) for s, c in zip(sets, all_changes[: len(sets)])}
    n_all = len(ctx.examples)
    drawn: dict[int, list[float]] = {}
    for s, c in zip(control_sets, all_changes[len(sets):]):
        drawn.setdefault(s.example, []).append(abs(float(c)))
    control = np.array([float(np.mean(drawn[i])) if i in drawn else np.nan for i in range(n_all)])
    effects = np.array([abs(changes[i]) if i in changes else np.nan for i in range(n_all)])
    signed = np.array([changes.get(i, np.nan) for i in range(n_all)])
    shares, details = edge_details(ctx, keys, window, heads, signed, control, controls)
    j = ctx.judge(effects, rule(claim))
    span = window_words(window)
    which = "every head" if claim.head_list is None else f"heads {', '.join(map(str, heads))}"
    with_control = np.isfinite(control) & np.isfinite(effects)
    above = float(np.mean(effects[with_control] > control[with_control])) if with_control.any() else None
    control_summary = summary(ctx, control)
    control_evidence = {"measure": f"mean |change| over {CONTROL_DRAWS} seeded draws of as many other scored tokens "
                                   "(never a named or special token, nor a sink of half the claim's heads or more), "
                                   "their edges blocked alike",
                        "mean_abs_change": control_summary, "draws": CONTROL_DRAWS,
                        "share_named_above_control": above, "n_with_control": int(with_control.sum())}
    warning = _control_warning(claim, j.verdict, control_summary["mean"], above, f"{which} of {span}")
    if warning is not None:
        control_evidence["warning"] = warning
    evidence = {"signed_change": summary(ctx, signed),
                "attention_share": summary(ctx, shares),
                "control": control_evidence,
                "n_searched": len(ctx.examples), "n_with_target": len(sets), "layers": window,
                **evidence_examples(ctx, effects, details)}
    return result(claim, j, measure=f"|change| of the target when the target row's edges to {claim.to_what} are "
                                    f"blocked in {which} of {span}",
                  rule=rule(claim),
                  intervention=f"edge knockout: the target row's edges to {claim.to_what} blocked at once in {which} "
                               f"of {span}, {renormalised(claim.renormalise)}; control: {CONTROL_DRAWS} seeded draws "
                               "of as many other tokens blocked alike",
                  evidence=evidence)



def _keys(ctx: AuditContext, claim: EdgeClaim, index: int) -> list[tuple[int, ...]]:
    """Per example, the positions the claim's edges go to (empty: the example has none)."""
    if claim.to_position is not None:
        out: list[tuple[int, ...]] = []
        for example in ctx.examples:
            n = len(example.input_ids)
            p = claim.to_position if claim.to_position >= 0 else n + claim.to_position
            out.append((p,) if 0 <= p < n else ())
        if not any(out):
            raise InputError(f"{ctx.file.where(index, 'to_position')}: position {claim.to_position} lies outside "
                             f"every one of the {len(ctx.examples)} examples (the longest has "
                             f"{max(len(e.input_ids) for e in ctx.examples)} tokens)")
        return out
    matcher = claim.matcher()
    out = [tuple(int(p) for p in np.flatnonzero(ctx.matches(i, matcher))) for i in range(len(ctx.examples))]
    if not any(out):
        raise InputError(f"{ctx.file.where(index, 'to' if claim.to is not None else 'to_words')}: {claim.to_what} "
                         f"match no token in any of the {len(ctx.examples)} examples searched (token texts are "
                         "matched whole, case-insensitive, word-piece markers stripped); check the pattern or use "
                         "more data")
    return out


def _control_warning(claim: EdgeClaim, verdict: str, control_mean: float, above: float | None,
                     where: str) -> str | None:
    """One line where a supported edge claim's effect is not specific to its tokens (None otherwise)."""
    if verdict != "supported" or above is None:
        return None
    reasons = []
    if math.isfinite(control_mean) and control_mean >= claim.threshold:
        reasons.append(f"blocking the target row's edges to as many random other tokens in {where} moves the target "
                       f"by {control_mean:.3g} (>= threshold {claim.threshold:g})")
    if above <= 0.5:
        reasons.append(f"the named edges move the target more than random ones in only {above:.0%} of the examples")
    if not reasons:
        return None
    return "; ".join(reasons) + f": the effect is not specific to {claim.to_what}"


KIND = ClaimKind("edge", EdgeClaim, rule=rule, check=check, run=run)
