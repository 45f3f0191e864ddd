"""What a claim kind is: the object that registers it, and the result it returns.

A kind is one module of :mod:`probe.claims.kinds` holding, in one place, the keys a claim of that
kind has (a :class:`~probe.claims.spec.ClaimSpec` subclass, validated like a study file), its decision rule
(:class:`~probe.claims.rules.Rule`), the checks that run before anything slow (a layer or head the
model lacks, a replacement token its tokenizer lacks) and the measurement that turns the model and
the examples into a :class:`ClaimResult`; a :class:`ClaimKind` ties them together and
:data:`probe.claims.kinds.KINDS` lists it. The audit's report renders every kind alike, from the
shape of its evidence (:mod:`probe.claims.render`): a kind has no renderer of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from probe.claims.rules import Judgement, Rule
from probe.claims.spec import ClaimSpec

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["ClaimKind", "ClaimResult", "EVIDENCE_EXAMPLES", "clean_json", "evidence_examples", "result", "summary"]

#: Examples listed as evidence for and against a claim, each.
EVIDENCE_EXAMPLES = 3

# ------------------------------------------------------------------------------------------ the kind


@dataclass(frozen=True)
class ClaimKind:
    """One claim kind, registered in :data:`probe.claims.kinds.KINDS`.

    ``name`` is the ``kind:`` a claim file gives; ``spec`` the class its entries are validated into;
    ``rule(claim)`` the rule its effect is decided by (a conjunction's first part); ``check(ctx,
    claim, index)`` refuses, before any claim is measured, what the model cannot do (an error naming
    the claim file's line); ``run(ctx, claim, index)`` measures and decides it."""

    name: str
    spec: type[ClaimSpec]
    rule: Callable[[Any], Rule]
    check: Callable[[AuditContext, Any, int], None]
    run: Callable[[AuditContext, Any, int], ClaimResult]

    def __post_init__(self) -> None:
        declared = self.spec.model_fields["kind"].annotation
        if getattr(declared, "__args__", None) != (self.name,):
            raise TypeError(f"{self.spec.__name__}.kind must be Literal[{self.name!r}] for the kind {self.name!r}")


# ------------------------------------------------------------------------------------------ the result


@dataclass
class ClaimResult:
    """One claim's verdict. ``effect`` is the mean per-example effect, ``ci`` its bootstrap CI."""

    claim: str
    kind: str
    verdict: str
    effect: float
    ci: tuple[float, float]
    n: int
    threshold: float
    measure: str  # what the per-example effect is
    rule: str  # the decision rule in words
    intervention: str  # what was done to the model or the input
    evidence: dict
    settings: dict
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return clean_json({"claim": self.claim, "kind": self.kind, "verdict": self.verdict, "effect": self.effect,
                           "ci": list(self.ci), "n": self.n, "threshold": self.threshold, "measure": self.measure,
                           "rule": self.rule, "intervention": self.intervention, "evidence": self.evidence,
                           "settings": self.settings, "seconds": round(self.seconds, 3)})


def clean_json(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def evidence_examples(ctx: AuditContext, effects: np.ndarray, details: list[dict],
                      secondary: np.ndarray | None = None) -> dict:
    """The examples most for (highest effect) and most against (lowest) the claim."""
    finite = [i for i in range(len(effects)) if math.isfinite(effects[i])]
    if not finite:
        return {"for": [], "against": []}
    key2 = secondary if secondary is not None else np.zeros(len(effects))
    order = sorted(finite, key=lambda i: (effects[i], np.nan_to_num(key2[i], nan=-np.inf)))
    k = min(EVIDENCE_EXAMPLES, max(1, len(finite) // 2))

    def entry(i):
        return {**ctx.describe(i), "effect": float(effects[i]), **details[i]}

    return {"for": [entry(i) for i in reversed(order[-k:])], "against": [entry(i) for i in order[:k]]}


#: any rule serves :func:`summary`, which reads the mean and the CI alone
_ANY_RULE = Rule(0.0, refute_inclusive=True)


def summary(ctx: AuditContext, values: Sequence[float] | np.ndarray) -> dict:
    """The mean of per-example ``values`` with its CI and n (evidence, not decided)."""
    j = ctx.judge(values, _ANY_RULE)
    return {"mean": j.mean, "ci": list(j.ci), "n": j.n}


def result(claim: ClaimSpec, judgement: Judgement, *, measure: str, rule: Rule, intervention: str, evidence: dict,
           verdict: str | None = None, n_needed: int | None = None, rule_text: str | None = None) -> ClaimResult:
    """The claim's result from its judgement (``verdict``, ``n_needed`` and ``rule_text`` where a
    conjunction decides instead), the evidence given the judgement's std, n_needed and sign-flip p."""
    verdict = verdict or judgement.verdict
    evidence = dict(evidence)
    evidence["std"] = judgement.std
    if verdict == "inconclusive":
        evidence["n_needed"] = judgement.n_needed if n_needed is None else n_needed
        if judgement.why:
            evidence["why"] = judgement.why
    if judgement.p_value is not None:
        evidence["sign_flip_p"] = judgement.p_value
    settings = claim.model_dump(mode="json", exclude={"claim", "kind"})
    return ClaimResult(claim=claim.claim, kind=claim.kind, verdict=verdict, effect=judgement.mean, ci=judgement.ci,
                       n=judgement.n, threshold=judgement.threshold, measure=measure, rule=rule_text or rule.describe(),
                       intervention=intervention, evidence=evidence, settings=settings)

