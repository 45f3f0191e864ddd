"""``head_role``: head L.H matters for the prediction, more than the other heads of its layer.

The head is ablated (its attention weights zeroed, :func:`probe.intervene.heads.ablate_heads`), then
each other head of its layer alone; effect = |f(x) - f(x, head ablated)| - mean over the other heads
of the same; supported when its CI lies above 0, refuted when at or below. Heads are those of the
attention that reads the target (cross-attention for seq2seq models). With ``attends_to`` a second
part, judged alike: the head's raw attention at the target query, its share on the matching scored
tokens minus their uniform share; the claim is then supported when both parts are, refuted when
either is, inconclusive otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from probe.claims.kind import ClaimKind, ClaimResult, evidence_examples, result
from probe.claims.rules import Judgement, Rule, conjunction
from probe.claims.spec import HeadClaimSpec
from probe.errors import InputError
from probe.patterns import UserPattern, user_pattern

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["HeadRoleClaim", "KIND"]


class HeadRoleClaim(HeadClaimSpec):
    """Head L.H matters for the prediction (more than the other heads of its layer), and with
    ``attends_to`` also: it puts more than a uniform share of its attention on matching tokens."""

    kind: Literal["head_role"]
    #: a regular expression: the head also puts more than a uniform share of its attention on the
    #: tokens it matches
    attends_to: str | None = None

    def matcher(self) -> UserPattern | None:
        return None if self.attends_to is None else user_pattern(self.attends_to, "attends_to", ignore_case=True)


def rule(claim: HeadRoleClaim | None = None) -> Rule:
    """An effect above 0 (refuted at or below it); the ``attends_to`` part alike."""
    return Rule(0.0, refute_inclusive=True)


def check(ctx: AuditContext, claim: HeadRoleClaim, index: int) -> None:
    layer, head = claim.site
    ctx.layer(layer, index, "head")
    ctx.head(head, index, "head")


def run(ctx: AuditContext, claim: HeadRoleClaim, index: int) -> ClaimResult:
    layer_value, head = claim.site
    layer = ctx.layer(layer_value, index, "head")
    ctx.head(head, index, "head")
    if ctx.n_heads < 2:
        raise InputError(f"{ctx.file.where(index, 'head')}: the model has one head per layer; a head's role is "
                         "judged against the other heads of its layer")
    matcher = claim.matcher()
    if matcher is not None:
        found = [ctx.matches(i, matcher) for i in range(len(ctx.examples))]
        if not any(m.any() for m in found):
            raise InputError(f"{ctx.file.where(index, 'attends_to')}: attends_to {claim.attends_to!r} matches no "
                             f"token in any of the {len(ctx.examples)} examples searched; check the pattern")
    values = ctx.layer_ablation(layer)  # [example, 1 + heads]
    change = np.abs(values[:, :1] - values[:, 1:])  # [example, heads]
    others = np.delete(change, head, axis=1).mean(axis=1)
    effects = change[:, head] - others
    j = ctx.judge(effects, rule(claim))
    mean_change = change.mean(axis=0)
    rank = int((mean_change > mean_change[head]).sum()) + 1
    details = [{"abs_change_head": float(change[i, head]), "abs_change_other_heads": float(others[i])}
               for i in range(len(ctx.examples))]
    evidence: dict = {
        "mean_abs_change_per_head": {f"{layer}.{h}": float(c) for h, c in enumerate(mean_change)},
        "rank_in_layer": rank,
        "heads_in_layer": ctx.n_heads,
    }
    verdict, needed = j.verdict, None
    measure = (f"|change| when head {layer}.{head} is ablated minus the mean |change| of the other heads of layer "
               f"{layer}")
    if matcher is not None:
        second = _attends_to(ctx, claim, layer, head, found, details)
        evidence["ablation_verdict"] = j.verdict
        evidence["attends_to"] = _attends_to_evidence(claim, second, details)
        verdict = conjunction(j.verdict, second.verdict)
        if verdict == "inconclusive":
            parts = [p.n_needed for p in (j, second) if p.verdict == "inconclusive" and p.n_needed is not None]
            needed = max(parts) if parts else None
        measure += f"; and it attends to {claim.attends_to!r} more than uniformly (both must hold)"
    evidence.update(evidence_examples(ctx, effects, details))
    rule_text = rule(claim).describe()
    if matcher is not None:
        rule_text = (f"both parts judged alike ({rule_text}); supported if both are supported, refuted if either "
                     "is refuted, inconclusive otherwise")
    return result(claim, j, measure=measure, rule=rule(claim), rule_text=rule_text,
                  intervention=f"ablate head {layer}.{head} (attention weights zeroed) vs each other head of layer "
                               f"{layer} alone", evidence=evidence, verdict=verdict, n_needed=needed)


def _attends_to(ctx: AuditContext, claim: HeadRoleClaim, layer: int, head: int, found: list[np.ndarray],
                details: list[dict]) -> Judgement:
    """The head's raw attention share on the matching scored tokens minus their uniform share, judged
    per example; each example's shares go into ``details``."""
    raw = ctx.scores("attention").scores
    excess = np.full(len(ctx.examples), np.nan)
    for i, m in enumerate(found):
        scorable = ctx.scorable(i)
        if not m.any() or m.sum() == scorable.sum():
            continue
        a = raw[i][layer, head].double().numpy()
        total = float(a[scorable].sum())
        if total > 0:
            share = float(a[m].sum()) / total
            uniform = int(m.sum()) / int(scorable.sum())
            excess[i] = share - uniform
            details[i].update({"attention_share_matched": share, "uniform_share_matched": uniform})
    return ctx.judge(excess, rule(claim))


def _attends_to_evidence(claim: HeadRoleClaim, second: Judgement, details: list[dict]) -> dict:
    shares = [d["attention_share_matched"] for d in details if "attention_share_matched" in d]
    uniforms = [d["uniform_share_matched"] for d in details if "uniform_share_matched" in d]
    return {"pattern": claim.attends_to, "measure": "the head's attention share on matching "
            "tokens minus their uniform share", **second.to_dict(),
            "attention_share": float(np.mean(shares)) if shares else None,
            "uniform_share": float(np.mean(uniforms)) if uniforms else None}


KIND = ClaimKind("head_role", HeadRoleClaim, rule=rule, check=check, run=run)
