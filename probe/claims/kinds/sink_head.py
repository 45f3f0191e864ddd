"""``sink_head``: head L.H is a sink head, much attention with little effect.

Per example, the sinks of the head (keys whose mean received attention over the query rows exceeds
``threshold``, :func:`probe.explainers.sinks.attention_sinks`) and the target row's share of
attention on them; then the target row's edges to all of them are blocked in this head alone
(:func:`probe.intervene.knockout.block_edges`) and the effect is |f(x) - f(x, edges blocked)| (0
where the head has no sink). Two parts, judged alike and both needed: the share's CI above
``share``, the effect's below ``max_effect``. (The blocked changes: :mod:`probe.claims.edges`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from probe.claims.edges import blocked_changes, renormalised
from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result
from probe.claims.rules import Rule, at_least_rule, at_most_rule, conjunction
from probe.claims.spec import HeadClaimSpec
from probe.spec.validation import Bool, Float

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["KIND", "SinkHeadClaim"]


class SinkHeadClaim(HeadClaimSpec):
    """Head L.H is a sink head: its target row puts more than ``share`` of its attention on sink
    keys (keys whose mean received attention over the query rows exceeds ``threshold``, found per
    example), while blocking the target row's edges to those keys in this head alone changes the
    target by less than ``max_effect``: much attention, little effect. Both parts must hold."""

    kind: Literal["sink_head"]
    #: the mean share of the target row's attention on sink keys the claim needs
    share: Annotated[Float, Field(gt=0, lt=1)] = 0.5
    #: the mean |change of the target| (its units: a probability, a log-prob, ...) when the target
    #: row's edges to the sinks are blocked in the head, which the claim must stay under
    max_effect: Annotated[Float, Field(gt=0)] = 0.05
    #: a key is a sink of the head when its mean received attention over the query rows exceeds this
    threshold: Annotated[Float, Field(ge=0, lt=1)] = 0.3
    #: the blocked edges are only zeroed (the default: what the sinks carry through their values is
    #: removed), or the row is renormalised over the other keys (= -inf before the softmax: the
    #: sinks' mass moves onto the other keys, which measures losing the sink, not what it carries)
    renormalise: Bool = False


def rule(claim: SinkHeadClaim) -> Rule:
    """The share part: a mean share above the claim's ``share`` (the knockout part: an effect under
    ``max_effect``, :func:`~probe.claims.rules.at_most_rule`)."""
    return at_least_rule(claim.share)


def check(ctx: AuditContext, claim: SinkHeadClaim, index: int) -> None:
    layer, head = claim.site
    ctx.layer(layer, index, "head")
    ctx.head(head, index, "head")


def run(ctx: AuditContext, claim: SinkHeadClaim, index: int) -> ClaimResult:
    from probe.intervene.knockout import EdgeSet

    layer_value, head = claim.site
    layer = ctx.layer(layer_value, index, "head")
    head = ctx.head(head, index, "head")
    found = ctx.sinks(claim.threshold)
    shares = np.full(len(ctx.examples), np.nan)
    sets, details = [], []
    for i, example in enumerate(found.examples):
        shares[i] = float(example.share[layer, head])
        keys = tuple(int(k) for k in np.flatnonzero(example.sinks[layer, head].numpy()))
        texts = ctx.texts(i)
        details.append({"sink_share": shares[i],
                        "sinks": [f"{texts[k] or ctx.examples[i].tokens[k]}@{k}" for k in keys]})
        if keys:
            sets.append(EdgeSet(i, keys, ((layer, head),)))
    changes = blocked_changes(ctx, sets, claim.renormalise)
    effects = np.array([abs(changes[i]) if i in changes else (0.0 if np.isfinite(shares[i]) else np.nan)
                        for i in range(len(ctx.examples))])
    for i, d in enumerate(details):
        d["knockout_abs_change"] = float(effects[i])
    j = ctx.judge(shares, rule(claim))
    second = ctx.judge(effects, at_most_rule(claim.max_effect))
    verdict = conjunction(j.verdict, second.verdict)
    needed = None
    if verdict == "inconclusive":
        parts = [p.n_needed for p in (j, second) if p.verdict == "inconclusive" and p.n_needed is not None]
        needed = max(parts) if parts else None
    first_token = [bool(e.sinks[layer, head, 0]) for e in found.examples if e.sinks.shape[-1]]
    evidence = {"share_verdict": j.verdict,
                "knockout": {"measure": "|f(x) - f(x with the target row's edges to the head's sinks blocked)|",
                             **second.to_dict()},
                "sink_threshold": claim.threshold,
                "examples_with_a_sink": len(sets),
                "first_token_a_sink": float(np.mean(first_token)) if first_token else None,
                **evidence_examples(ctx, shares, details, secondary=-effects)}
    rule_text = (f"both parts judged alike: the share {at_least_rule(claim.share).describe('mean share')}; the "
                 f"knockout effect {at_most_rule(claim.max_effect).describe('mean |change|')}; supported if both are "
                 "supported, refuted if either is refuted, inconclusive otherwise")
    return result(claim, j, measure=f"the target row's share of attention on the sink keys of head {layer}.{head} "
                                    f"(mean received attention > {claim.threshold:g}); and |change| when its edges "
                                    f"to them are blocked in that head stays under {claim.max_effect:g} (both must "
                                    "hold)",
                  rule=at_least_rule(claim.share), rule_text=rule_text,
                  intervention=f"edge knockout: the target row's edges to head {layer}.{head}'s sinks blocked in "
                               f"that head alone, {renormalised(claim.renormalise)}",
                  evidence=evidence, verdict=verdict, n_needed=needed)


KIND = ClaimKind("sink_head", SinkHeadClaim, rule=rule, check=check, run=run)
