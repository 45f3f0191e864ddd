"""``faithfulness``: attention ranks tokens like the reference does.

Per example, Kendall tau-b (or Spearman) of the attention ranking and the signed reference over the
scored tokens; supported when the CI of the mean lies at or above ``threshold``, refuted when below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from probe.claims.agreements import agreements, column
from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result, summary
from probe.claims.rules import Rule
from probe.claims.spec import ClaimSpec
from probe.spec.claim_values import AttentionRanking, parse_attention
from probe.spec.validation import Float

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["FaithfulnessClaim", "KIND"]


class FaithfulnessClaim(ClaimSpec):
    """Attention ranks tokens like the reference does: mean rank correlation >= threshold."""

    kind: Literal["faithfulness"]
    #: the attention read: METHOD, METHOD@LAYER or METHOD@LAYER.HEAD (layer: an index, first or last)
    attention: str = "attention_mean@last"
    #: what importance is: an intervention (loo_delete, ...) or a gradient method
    reference: str = "loo_delete"
    #: the mean rank correlation the claim needs
    threshold: Annotated[Float, Field(ge=-1, le=1)]
    #: the rank correlation: Kendall tau-b or Spearman
    measure: Literal["kendall_tau", "spearman"] = "kendall_tau"

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)


def rule(claim: FaithfulnessClaim) -> Rule:
    """A mean rank correlation at or above the claim's threshold."""
    return Rule(float(claim.threshold), support_inclusive=True)


def check(ctx: AuditContext, claim: FaithfulnessClaim, index: int) -> None:
    ctx.check_ranking(claim.ranking, index)


def run(ctx: AuditContext, claim: FaithfulnessClaim, index: int) -> ClaimResult:
    rows, details = agreements(ctx, claim, index, 3)
    values = column(rows, claim.measure)
    j = ctx.judge(values, rule(claim))
    evidence = {
        "top1_match_rate": summary(ctx, column(rows, "top1")),
        "random_ranking_expectation": 0.0,
        "n_excluded": ctx.n_examples - j.n,
        **evidence_examples(ctx, values, details),
    }
    return result(claim, j, measure=f"{claim.measure} of {claim.attention} with {claim.reference} per example",
                  rule=rule(claim), intervention=f"{claim.reference} (reference)", evidence=evidence)


KIND = ClaimKind("faithfulness", FaithfulnessClaim, rule=rule, check=check, run=run)
