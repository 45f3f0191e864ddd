"""``token_importance``: the most-attended token is the most important one.

Per example, over the scored tokens (special and prompt-template tokens excluded): does the argmax
of the attention ranking equal the argmax of the *signed* reference (leave-one-out by default:
f(x) - f(x without the token), so the most important token is the one whose removal lowers the
explained output most)? Ties go to the earlier token. The effect is 1 or 0; supported when the CI of
the match rate lies above 0.5, refuted when below. Evidence: the chance rate (mean of 1/n tokens),
Kendall tau-b and the top-k overlap with their CIs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from probe.claims.agreements import agreements, column
from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result, summary
from probe.claims.rules import Rule
from probe.claims.spec import ClaimSpec
from probe.spec.claim_values import AttentionRanking, parse_attention
from probe.spec.validation import Int

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["KIND", "TokenImportanceClaim"]


class TokenImportanceClaim(ClaimSpec):
    """The most-attended token is the most important one (by the reference, signed: largest drop)."""

    kind: Literal["token_importance"]
    #: the attention read: METHOD, METHOD@LAYER or METHOD@LAYER.HEAD (layer: an index, first or last)
    attention: str = "attention_mean@last"
    #: what importance is: an intervention (loo_delete, ...) or a gradient method
    reference: str = "loo_delete"
    #: the k of the top-k overlap given as evidence
    k: Annotated[Int, Field(ge=1)] = 3

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)


def rule(claim: TokenImportanceClaim | None = None) -> Rule:
    """A match rate above one half."""
    return Rule(0.5)


def check(ctx: AuditContext, claim: TokenImportanceClaim, index: int) -> None:
    ctx.check_ranking(claim.ranking, index)


def run(ctx: AuditContext, claim: TokenImportanceClaim, index: int) -> ClaimResult:
    rows, details = agreements(ctx, claim, index, claim.k)
    top1 = column(rows, "top1")
    j = ctx.judge(top1, rule(claim))
    tau = column(rows, "kendall_tau")
    evidence = {
        "top1_match_rate": j.mean,
        "chance_rate": float(np.nanmean(column(rows, "chance"))) if j.n else None,
        "kendall_tau": summary(ctx, tau),
        f"top{claim.k}_overlap": summary(ctx, column(rows, f"top{claim.k}")),
        "n_excluded": ctx.n_examples - j.n,
        **evidence_examples(ctx, top1, details, secondary=tau),
    }
    return result(claim, j, measure=f"share of examples whose most-attended token ({claim.attention}) is the most "
                                    f"important one by {claim.reference} (signed: largest drop)",
                  rule=rule(claim), intervention=f"{claim.reference} (reference)", evidence=evidence)


KIND = ClaimKind("token_importance", TokenImportanceClaim, rule=rule, check=check, run=run)
