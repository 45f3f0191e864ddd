"""``counterfactual``: a different attention at a layer (or one head) would change the output.

The target row's attention at ``layer`` (one ``head`` or all) is replaced by ``permutations`` seeded
permutations of itself (special tokens stay in place); effect = the median output total variation
distance per example; supported when its CI lies above ``bound``, refuted when below. With
``adversarial``: Jain & Wallace's adversarial attention within ``bound``, max attention JSD per
example (evidence only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field, field_validator

from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result, summary
from probe.claims.rules import LN2_HALF, Rule
from probe.claims.spec import ClaimSpec
from probe.registry.params import AdversarialParams, PermutedParams, declared_limits
from probe.spec.validation import LAYER_WORDS, Bool, Float, Int, fail, show

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["CounterfactualClaim", "KIND"]


class CounterfactualClaim(ClaimSpec):
    """A different attention at ``layer`` (``head``) would change the output: permuting the target
    row moves the output distribution by more than ``bound`` (total variation)."""

    kind: Literal["counterfactual"]
    #: the layer whose target-row attention is replaced: an index, first or last
    layer: int | Literal["first", "last"] = "last"
    #: one head of that layer (default: every head)
    head: Annotated[Int, Field(ge=0)] | None = None
    #: seeded permutations of the attention row per example
    permutations: Annotated[Int, Field(ge=1, le=declared_limits(PermutedParams, "n")[1])] = 20
    #: the output change (total variation) the permutations must exceed; the adversarial search's bound
    bound: Annotated[Float, Field(gt=0, le=1)] = 0.01
    #: also run Jain & Wallace's adversarial search (evidence only)
    adversarial: Bool = True
    #: adversarial search: attention candidates per example
    candidates: Annotated[Int, Field(ge=1, le=declared_limits(AdversarialParams, "candidates")[1])] \
        = AdversarialParams.candidates  # the registry's defaults and limits
    #: adversarial search: Adam steps
    steps: Annotated[Int, Field(ge=1, le=declared_limits(AdversarialParams, "steps")[1])] = AdversarialParams.steps

    @field_validator("layer", mode="before")
    @classmethod
    def _layer(cls, value: Any) -> Any:
        if isinstance(value, bool) or not (isinstance(value, int) or value in LAYER_WORDS):
            fail(f"{show(value)} is not a layer; give a layer index (0, 1, ...), first or last")
        if isinstance(value, int) and value < 0:
            fail(f"{value} is negative; give a layer index >= 0, or last")
        return value


def rule(claim: CounterfactualClaim) -> Rule:
    """A median output change above the claim's bound."""
    return Rule(float(claim.bound))


def check(ctx: AuditContext, claim: CounterfactualClaim, index: int) -> None:
    ctx.layer(claim.layer, index, "layer")
    ctx.head(claim.head, index, "head")


def run(ctx: AuditContext, claim: CounterfactualClaim, index: int) -> ClaimResult:
    from probe.intervene.counterfactual import adversarial_attention, permuted_attention

    layer = ctx.layer(claim.layer, index, "layer")
    head = ctx.head(claim.head, index, "head")
    perm = permuted_attention(ctx.pm, ctx.examples, layer=layer, head=head, n=claim.permutations, seed=ctx.seed)
    permuted = perm.summary()
    effects = permuted["median_output_tvd"].double().numpy()
    j = ctx.judge(effects, rule(claim))
    details = [{"median_output_tvd": float(effects[i]), "max_attention": float(permuted["max_attention"][i])}
               for i in range(len(ctx.examples))]
    site = f"layer {layer}" + (f" head {head}" if head is not None else " (all heads)")
    evidence: dict = {"max_output_tvd": float(perm.output_tvd.nan_to_num(-1).max())}
    intervention = f"{claim.permutations} seeded permutations of the target row's attention at {site}"
    if claim.adversarial:
        adv = adversarial_attention(ctx.pm, ctx.examples, layer=layer, head=head, candidates=claim.candidates,
                                    steps=claim.steps, bound=claim.bound, seed=ctx.seed)
        jsd = adv.summary()["max_attention_jsd"].double().numpy()
        evidence["adversarial"] = {"max_attention_jsd": summary(ctx, jsd),
                                   "share_above_half_ln2": float(np.mean(jsd > LN2_HALF)),
                                   "feasible_share": float(adv.feasible.double().mean()),
                                   "candidates": claim.candidates, "steps": claim.steps, "bound": claim.bound}
        for i in range(len(ctx.examples)):
            details[i]["adversarial_attention_jsd"] = float(jsd[i])
        intervention += (f"; adversarial attention ({claim.candidates} candidates, {claim.steps} steps, output TVD "
                         f"<= {claim.bound:g})")
    evidence.update(evidence_examples(ctx, effects, details))
    return result(claim, j, measure=f"median output total variation distance over {claim.permutations} permutations "
                                    f"of the attention at {site}", rule=rule(claim), intervention=intervention,
                  evidence=evidence)


KIND = ClaimKind("counterfactual", CounterfactualClaim, rule=rule, check=check, run=run)
