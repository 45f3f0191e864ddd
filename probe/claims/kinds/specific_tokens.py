"""``specific_tokens``: removing the tokens matching a pattern changes the output more than removing
as many other tokens at random.

Tokens match when their text (decoded alone, word-piece markers "##", "Ġ", "▁" and surrounding spaces
stripped) fully matches ``pattern``, case-insensitive (``words``: any of the words). Examples with at
least one match and at least as many non-matching scored tokens take part. The matched tokens are
removed together (``intervention``: deleted, or replaced by [MASK], [UNK] or the pad id); so are as
many other tokens drawn at random (``repeats`` seeded draws, the effect of each averaged) and the as
many most-attended other tokens. Effect = |f(x) - f(x - matched)| - mean |f(x) - f(x - random)|;
supported when its CI lies above 0, refuted when at or below. Evidence: the same against the
attention-chosen tokens, and the attention share of the matched tokens (their attention / the
attention on all scored tokens) against their uniform share (matched / scored tokens).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result, summary
from probe.claims.rules import Rule
from probe.claims.spec import ClaimSpec
from probe.errors import InputError
from probe.patterns import UserPattern, user_pattern
from probe.spec.claim_values import AttentionRanking, check_words, parse_attention
from probe.spec.validation import Int, fail

if TYPE_CHECKING:
    from probe.claims.context import AuditContext
    from probe.models.core import ProbeModel

__all__ = ["KIND", "SpecificTokensClaim", "replacement_token"]


class SpecificTokensClaim(ClaimSpec):
    """Removing the tokens matching ``pattern`` (or ``words``) changes the output more than removing
    as many other tokens at random."""

    kind: Literal["specific_tokens"]
    #: a regular expression a token's text matches whole (case-insensitive)
    pattern: str | None = None
    #: instead of pattern: the words whose tokens match
    words: list[str] | None = None
    #: how tokens are removed: deleted, or replaced by the mask, unk or pad token
    intervention: Literal["delete", "mask", "unk", "pad"] = "delete"
    #: seeded draws of as many random other tokens, removed for comparison
    repeats: Annotated[Int, Field(ge=1)] = 10
    #: the attention whose most-attended other tokens are removed for comparison (evidence)
    attention: str = "attention_mean@last"

    @field_validator("words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        return check_words(value, "the claim is about", "not, never")

    @model_validator(mode="after")
    def _one_matcher(self) -> SpecificTokensClaim:
        if (self.pattern is None) == (self.words is None):
            fail("give exactly one of pattern (a regular expression) or words (a list); "
                  f"{'both were' if self.pattern is not None else 'neither was'} given", at=["pattern"])
        return self

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)

    def matcher(self) -> UserPattern:
        """The compiled, case-insensitive full-match pattern for a token's text (bounded in time)."""
        if self.words is not None:
            return user_pattern("|".join(re.escape(w.strip()) for w in self.words), "words", ignore_case=True)
        return user_pattern(self.pattern, "pattern", ignore_case=True)

    @property
    def matches_what(self) -> str:
        return f"pattern {self.pattern!r}" if self.words is None else f"words {', '.join(self.words)}"


def rule(claim: SpecificTokensClaim | None = None) -> Rule:
    """An effect above 0 (refuted at or below it)."""
    return Rule(0.0, refute_inclusive=True)


def check(ctx: AuditContext, claim: SpecificTokensClaim, index: int) -> None:
    ctx.check_ranking(claim.ranking, index)
    replacement_token(ctx.pm, claim.intervention)


def _removed(ids: tuple[int, ...], positions, replacement: int | None) -> tuple[int, ...]:
    drop = set(int(p) for p in positions)
    if replacement is None:
        return tuple(t for p, t in enumerate(ids) if p not in drop)
    return tuple(replacement if p in drop else t for p, t in enumerate(ids))


def replacement_token(pm: ProbeModel, mode: str) -> int | None:
    if mode == "delete":
        return None
    from probe.intervene.tokens import replacement_token_id

    return replacement_token_id(pm, mode)


def run(ctx: AuditContext, claim: SpecificTokensClaim, index: int) -> ClaimResult:
    matcher = claim.matcher()
    matched = [ctx.matches(i, matcher) for i in range(len(ctx.examples))]
    with_match = [i for i, m in enumerate(matched) if m.any()]
    if not with_match:
        raise InputError(f"{ctx.file.where(index, 'words' if claim.words is not None else 'pattern')}: "
                         f"{claim.matches_what} matches no token in any of the {len(ctx.examples)} examples searched "
                         "(token texts are matched whole, case-insensitive, word-piece markers stripped); "
                         "check the pattern or use more data")
    attention = ctx.attention_vectors(claim.ranking, index)
    plan, rows = _removal_rows(ctx, claim, matched, with_match, attention)
    values = ctx.engine.values(rows, reuse_prefix=ctx.pm.task.next_token).double().numpy() if rows else np.array([])
    effects, versus_attention, share, uniform, details = _removal_effects(ctx, claim, plan, values, attention)
    j = ctx.judge(effects, rule(claim))
    what = {"delete": "deleted", "mask": "replaced by the mask token", "unk": "replaced by the unknown token",
            "pad": "replaced by the pad id (attended)"}[claim.intervention]
    evidence = {
        "matched_minus_attention_chosen": summary(ctx, versus_attention),
        "abs_change_matched": _mean_of(details, "abs_change_matched") if plan else None,
        "abs_change_random": _mean_of(details, "abs_change_random") if plan else None,
        "attention_share_matched": summary(ctx, share),
        "uniform_share_matched": float(np.nanmean(uniform)) if plan else None,
        "n_searched": len(ctx.examples),
        "n_with_match": len(with_match),
        "n_without_room": len(with_match) - len(plan),
        **evidence_examples(ctx, effects, details),
    }
    return result(claim, j, measure=f"|change| when the tokens matching {claim.matches_what} are {what} minus the "
                                    f"mean |change| when as many random other tokens are ({claim.repeats} draws)",
                  rule=rule(claim),
                  intervention=f"{claim.intervention}: matched tokens vs {claim.repeats} seeded random draws of as "
                               f"many other tokens vs the most-attended other tokens ({claim.attention})",
                  evidence=evidence)


def _mean_of(details: list[dict], key: str) -> float:
    return float(np.nanmean([d.get(key, np.nan) for d in details]))


def _removal_rows(ctx: AuditContext, claim: SpecificTokensClaim, matched: list[np.ndarray], with_match: list[int],
                  attention: list[np.ndarray]) -> tuple[list[tuple], list]:
    """Per example with room for as many other tokens: its rows (original, matched removed, each random
    draw removed, the most-attended others removed), and the plan ``(example, first row, matched
    positions, draws, attention-chosen positions)`` to read their values back."""
    from probe.rows.target import example_seed

    replacement = replacement_token(ctx.pm, claim.intervention)
    plan = []
    rows: list = []
    for i in with_match:
        example = ctx.examples[i]
        ids = tuple(int(t) for t in example.input_ids)
        chosen = np.flatnonzero(matched[i])
        others = np.flatnonzero(ctx.scorable(i) & ~matched[i])
        if len(others) < len(chosen):
            continue
        rng = np.random.default_rng(example_seed(ctx.seed, example))
        draws = [np.sort(rng.choice(others, size=len(chosen), replace=False)) for _ in range(claim.repeats)]
        by_attention = others[np.argsort(-attention[i][others], kind="stable")[: len(chosen)]]
        variants = [ids, _removed(ids, chosen, replacement)] + [_removed(ids, d, replacement) for d in draws] \
            + [_removed(ids, by_attention, replacement)]
        plan.append((i, len(rows), chosen, draws, by_attention))
        rows.extend((v, example) for v in variants)
    return plan, rows


def _removal_effects(ctx: AuditContext, claim: SpecificTokensClaim, plan: list[tuple], values: np.ndarray,
                     attention: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
    """Per example (NaN where it took no part): the effect (matched minus random), matched minus
    attention-chosen, the attention share of the matched tokens, their uniform share; and the details."""
    n_all = len(ctx.examples)
    effects, versus_attention = np.full(n_all, np.nan), np.full(n_all, np.nan)
    share, uniform = np.full(n_all, np.nan), np.full(n_all, np.nan)
    details: list[dict] = [{} for _ in range(n_all)]
    for i, first, chosen, _draws, by_attention in plan:
        v = values[first: first + 3 + claim.repeats]
        base = v[0]
        d_matched = abs(base - v[1])
        d_random = float(np.mean(np.abs(base - v[2: 2 + claim.repeats])))
        d_attention = abs(base - v[-1])
        effects[i] = d_matched - d_random
        versus_attention[i] = d_matched - d_attention
        a, scorable = attention[i], ctx.scorable(i)
        total = float(a[scorable].sum())
        share[i] = float(a[chosen].sum()) / total if total > 0 else np.nan
        uniform[i] = len(chosen) / int(scorable.sum())
        texts = ctx.texts(i)
        details[i] = {"matched": [texts[p] for p in chosen], "abs_change_matched": d_matched,
                      "abs_change_random": d_random, "abs_change_attention_chosen": d_attention,
                      "attention_chosen": [texts[p] for p in by_attention],
                      "attention_share_matched": share[i], "uniform_share_matched": uniform[i]}
    return effects, versus_attention, share, uniform, details


KIND = ClaimKind("specific_tokens", SpecificTokensClaim, rule=rule, check=check, run=run)
