"""How a claim is decided: one number per example, a bootstrap CI of their mean, a threshold.

Every claim kind reduces to a per-example *effect* (higher = more in favour of the claim) and a
*threshold* T. With ``[lo, hi]`` the seeded percentile-bootstrap CI of the mean effect (level 0.95
by default, :func:`probe.metrics.statistics.bootstrap_ci`; non-finite effects are dropped first).
The shipped kinds at a glance (each kind's module in :mod:`probe.claims.kinds` defines its rule):

==================  =========================================  =============  ============  ============
kind                per-example effect                         T              supported     refuted
==================  =========================================  =============  ============  ============
token_importance    1 if the most-attended token is the most   0.5            lo > 0.5      hi < 0.5
                    important one (largest signed drop of the
                    reference), else 0
specific_tokens     |f(x) - f(x without the matched tokens)|   0              lo > 0        hi <= 0
                    - mean over random draws of |f(x) -
                    f(x without as many other tokens)|
head_role           |change| when the head is ablated - mean   0              lo > 0        hi <= 0
                    |change| of the other heads of its layer
faithfulness        rank correlation (Kendall tau-b or         threshold      lo >= T       hi < T
                    Spearman) of attention and the reference
counterfactual      median output TVD over permutations of     bound          lo > bound    hi < bound
                    the target row's attention
sink_head           the head's target-row share of attention   share          lo > T        hi < T
                    on sink keys
                    and (both must hold) |f(x) - f(x with the  max_effect     hi < T        lo > T
                    target row's edges to those sinks blocked
                    in the head)|
edge                |f(x) - f(x with the target row's edges    threshold      lo > T        hi < T
                    to the named tokens blocked in every
                    head of the layer window)|
==================  =========================================  =============  ============  ============

Anything else is ``inconclusive``: the CI straddles the threshold.

No claim is decided on little evidence. With fewer than ``MIN_EVIDENCE`` (10) examples that have an
effect, no CI is computed (a bootstrap over a handful of values is not an interval) and the claim is
``inconclusive (n = 2, at least 10 needed)``, whatever the effects. Below ``SMALL_N`` (30) examples a
percentile bootstrap CI is too narrow, so a decision also needs the one-sample sign-flip permutation
test of the effects against T (:func:`sign_flip_p`: exact over all 2^n sign patterns up to n = 20,
else 100,000 seeded draws) at the same tail, ``(1 - level) / 2``; where the two disagree the claim
is inconclusive and ``why`` says so. For 0/1 effects against 0.5 (token_importance) that test is the
exact sign test. Then ``n_needed = ceil((z * std / |mean - T|)^2)`` estimates how many examples would make
a CI of that width clear the threshold (z = the normal quantile of the level to two decimals, 1.96
at 0.95; std with ddof=1); ``None`` when mean == T or std is undefined. It is an estimate for
planning, not a promise: the bootstrap CI is not exactly the normal one.

A ``head_role`` claim with ``attends_to`` is a conjunction: its second measure (the head's share of
attention on the matching tokens minus their uniform share, per example, supported if lo > 0,
refuted if hi <= 0) is judged the same way; the claim is supported when both parts are, refuted
when either is, inconclusive otherwise. A ``sink_head`` claim is such a conjunction too, its second
part an upper bound (:attr:`Rule.below`: supported when the CI lies below the threshold; the
sign-flip test is then one-sided downwards).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the fewest examples with an effect on which a claim is supported or refuted (and a CI computed)
MIN_EVIDENCE = 10
#: below this many examples a decision also needs the sign-flip permutation test
SMALL_N = 30
#: up to this many examples the sign-flip test enumerates every sign pattern
SIGN_FLIP_EXACT_MAX_N = 20
SIGN_FLIP_DRAWS = 100_000
#: Half the largest Jensen-Shannon divergence (natural log): an adversarial attention this far from
#: the original is "very different" in the counterfactual evidence.
LN2_HALF = 0.5 * math.log(2.0)


@dataclass(frozen=True)
class Rule:
    """Supported when the CI's lower bound is above ``threshold`` (or equal, ``support_inclusive``);
    refuted when its upper bound is below it (or equal, ``refute_inclusive``). With ``below`` the
    claim is an upper bound and the sides swap: supported when the upper bound is below the
    threshold, refuted when the lower bound is above it."""

    threshold: float
    support_inclusive: bool = False
    refute_inclusive: bool = False
    below: bool = False

    def describe(self, name: str = "mean effect") -> str:
        t = f"{self.threshold:g}"
        if self.below:
            return (f"supported if the CI of the {name} lies {'at or ' if self.support_inclusive else ''}below {t} "
                    f"(upper bound {'<=' if self.support_inclusive else '<'} {t}); refuted if it lies "
                    f"{'at or ' if self.refute_inclusive else ''}above {t} (lower bound "
                    f"{'>=' if self.refute_inclusive else '>'} {t}); inconclusive otherwise")
        return (f"supported if the CI of the {name} lies {'at or ' if self.support_inclusive else ''}above {t} "
                f"(lower bound {'>=' if self.support_inclusive else '>'} {t}); refuted if it lies "
                f"{'at or ' if self.refute_inclusive else ''}below {t} (upper bound "
                f"{'<=' if self.refute_inclusive else '<'} {t}); inconclusive otherwise")


def at_least_rule(threshold: float) -> Rule:
    """A mean that must exceed ``threshold`` (edge claims, a sink head's share)."""
    return Rule(float(threshold))


def at_most_rule(threshold: float) -> Rule:
    """A mean that must stay under ``threshold`` (a sink head's knockout effect)."""
    return Rule(float(threshold), below=True)


def verdict(ci_low: float, ci_high: float, rule: Rule) -> str:
    """``supported``, ``refuted`` or ``inconclusive`` from a CI (NaN bounds: inconclusive)."""
    t = rule.threshold
    if rule.below:
        if math.isfinite(ci_high) and (ci_high <= t if rule.support_inclusive else ci_high < t):
            return "supported"
        if math.isfinite(ci_low) and (ci_low >= t if rule.refute_inclusive else ci_low > t):
            return "refuted"
        return "inconclusive"
    if math.isfinite(ci_low) and (ci_low >= t if rule.support_inclusive else ci_low > t):
        return "supported"
    if math.isfinite(ci_high) and (ci_high <= t if rule.refute_inclusive else ci_high < t):
        return "refuted"
    return "inconclusive"


def z_value(level: float) -> float:
    """The two-sided normal quantile of ``level`` to two decimals (1.96 at 0.95)."""
    from scipy.stats import norm

    return round(float(norm.ppf((1.0 + level) / 2.0)), 2)


def n_needed(mean: float, std: float, threshold: float, level: float = 0.95) -> int | None:
    """``ceil((z * std / |mean - threshold|)^2)``; None when mean == threshold or std is not finite."""
    if not (math.isfinite(mean) and math.isfinite(std)) or mean == threshold:
        return None
    return int(math.ceil((z_value(level) * std / abs(mean - threshold)) ** 2))


@dataclass(frozen=True)
class Judgement:
    verdict: str
    mean: float
    std: float
    ci: tuple[float, float]
    n: int
    threshold: float
    n_needed: int | None  # only when inconclusive
    why: str | None = None  # why inconclusive, where it is for want of evidence
    p_value: float | None = None  # the sign-flip test's one-sided p in the decided direction (n < SMALL_N)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "effect": self.mean, "std": self.std, "ci": list(self.ci), "n": self.n,
                "threshold": self.threshold, "n_needed": self.n_needed, "why": self.why, "p_value": self.p_value}


def sign_flip_p(differences: Sequence[float] | np.ndarray, *, greater: bool = True, seed: int = 0) -> float:
    """One-sided p-value of the one-sample sign-flip permutation test that the mean of
    ``differences`` (effect - threshold) is above 0 (``greater``) or below it: the share of sign
    patterns whose mean is at least as extreme as the observed one, the observed pattern included.
    Exact up to ``SIGN_FLIP_EXACT_MAX_N`` values, else ``SIGN_FLIP_DRAWS`` seeded patterns plus the
    observed. NaN without values."""
    d = np.asarray(differences, dtype=np.float64)
    d = d[np.isfinite(d)]
    n = d.size
    if not n:
        return float("nan")
    d = d if greater else -d
    observed = d.sum()
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))
    if n <= SIGN_FLIP_EXACT_MAX_N:
        patterns = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1) * 2 - 1  # [2^n, n]
        sums = patterns @ d
        return float((sums >= observed - tol).mean())
    rng = np.random.default_rng(seed)
    sums = (rng.integers(0, 2, size=(SIGN_FLIP_DRAWS, n)) * 2 - 1) @ d
    return float((1 + (sums >= observed - tol).sum()) / (SIGN_FLIP_DRAWS + 1))


def judge(values: Sequence[float] | np.ndarray, rule: Rule, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> Judgement:
    """Decide a claim from its per-example effects (non-finite ones are dropped; module docstring)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    n = int(v.size)
    mean = float(v.mean()) if n else float("nan")
    std = float(v.std(ddof=1)) if n >= 2 else float("nan")
    if n < MIN_EVIDENCE:
        needed = n_needed(mean, std, rule.threshold, level)
        return Judgement("inconclusive", mean, std, (float("nan"), float("nan")), n, rule.threshold,
                         max(MIN_EVIDENCE, needed) if needed is not None else None,
                         why=f"n = {n}, at least {MIN_EVIDENCE} needed")
    from probe.metrics.statistics import summarize  # pandas and scipy: not needed to read a claim file

    s = summarize(v, n_boot=n_boot, level=level, seed=seed)
    decided = verdict(s["ci_low"], s["ci_high"], rule)
    why = p_value = None
    if decided != "inconclusive" and n < SMALL_N:
        p_value = sign_flip_p(v - rule.threshold, greater=(decided == "supported") != rule.below, seed=seed)
        if not p_value <= (1.0 - level) / 2.0:
            why = (f"the CI says {decided} but the sign-flip test does not (one-sided p = {p_value:.3f} > "
                   f"{(1.0 - level) / 2.0:g}, n = {n})")
            decided = "inconclusive"
    needed = n_needed(s["mean"], s["std"], rule.threshold, level) if decided == "inconclusive" else None
    return Judgement(decided, s["mean"], s["std"], (s["ci_low"], s["ci_high"]), s["n"], rule.threshold, needed,
                     why=why, p_value=p_value)


def conjunction(*verdicts: str) -> str:
    """Supported when every part is, refuted when any part is, inconclusive otherwise."""
    if any(v == "refuted" for v in verdicts):
        return "refuted"
    if all(v == "supported" for v in verdicts):
        return "supported"
    return "inconclusive"


__all__ = ["Judgement", "LN2_HALF", "MIN_EVIDENCE", "Rule", "SMALL_N", "at_least_rule", "at_most_rule", "conjunction",
           "judge", "n_needed", "sign_flip_p", "verdict", "z_value"]
