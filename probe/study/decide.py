"""What the verdict needs to know about its reference before it compares anything with it.

A verdict can only be as good as the causal measurement it is judged against. Three questions are
asked of the verdict reference R (an intervention such as leave-one-out) from the stored scores
alone, per example, on the scored tokens:

    noise floor     is R's largest |effect| above the numerical noise of the target? The floor of
                    an example is ``NOISE_ULPS`` machine epsilons of the model's dtype times the
                    target's scale (its |value|, at least the study's median |value|): two forward
                    passes that differ only in padding or batch composition differ by about that
                    much. Pairs whose reference is at the floor on an example are left out of the
                    statistics (reason ``reference at the noise floor``); when every example is,
                    nothing can be decided.
    effect size     an example whose largest |effect| is below ``EFFECT_SHARE`` of the study's
                    typical large effect (the 90th percentile over examples of each one's largest
                    |effect|) has nothing to rank: whatever order its near-zero effects take, no
                    token matters there. Its pairs are left out too (reason ``reference below the
                    effect floor``), so that "the token that matters" is judged where one does.
    dependence      did any perturbation change the target at all? If R is exactly 0 on every
                    token of every example, the output does not depend on the input.
    concentration   how much of R's total |effect| sits on each example's top 1 and top 2 tokens
                    (pooled over examples: sum of top-k |effect| / sum of all |effect|). When most
                    of it does, a rank correlation over all tokens is decided by the many
                    near-zero effects (their noise), not by the tokens that matter; top-k
                    agreement asks the right question. ``statistics.measure: auto`` chooses by
                    this: top-1 when the top token carries at least ``CONCENTRATED`` of the
                    effect, the smallest computed top-k with k >= 2 when the top two do, else
                    Kendall's tau.

Torch-free: it reads the tables a study stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np
import pandas as pd

from probe.display import shown_token
from probe.names import method_family

if TYPE_CHECKING:
    from probe.spec.study import Study

NOISE_ULPS = 16  # the noise floor in machine epsilons of the target's scale
CONCENTRATED = 0.8  # share of the reference's |effect| on the top 1 (or 2) tokens that makes it sparse
EFFECT_SHARE = 0.01  # an example's largest |effect| below this share of the study's 90th percentile: no effect
MIN_EXAMPLES = 10  # fewer scored examples than this and no answer rests on them (DESIGN rule 16; claims: MIN_EVIDENCE)
MISJUDGED = 0.5  # substitutes in more than this share of the examples the pair check looked at: the reference cannot judge

EPS = {"fp32": float(np.finfo(np.float32).eps), "float32": float(np.finfo(np.float32).eps),
       "bf16": 2.0 ** -7, "bfloat16": 2.0 ** -7, "fp16": float(np.finfo(np.float16).eps),
       "float16": float(np.finfo(np.float16).eps)}


@overload
def noise_floor(scale: float, eps: float = ...) -> float: ...


@overload
def noise_floor(scale: np.ndarray, eps: float = ...) -> np.ndarray: ...


def noise_floor(scale: float | np.ndarray, eps: float = EPS["fp32"]) -> float | np.ndarray:
    """The noise floor of an effect on a target of magnitude ``scale`` (a float or an array):
    :data:`NOISE_ULPS` machine epsilons ``eps`` of it."""
    return NOISE_ULPS * eps * scale


@dataclass(frozen=True)
class ReferenceProfile:
    """One reference over a study's examples (module docstring)."""

    method: str
    n_examples: int  # examples with at least one scored token for this reference
    max_abs: float  # the largest |effect| over every example and token
    eps: float
    scale: float  # the study's median |target value|
    at_floor: tuple[int, ...]  # examples whose largest |effect| is at or below their noise floor
    all_zero: bool  # every effect on every example is exactly 0
    top1_share: float  # pooled share of |effect| on each example's top token (NaN without effect)
    top2_share: float
    effect_floor: float = 0.0  # EFFECT_SHARE x the 90th percentile of the examples' largest |effect|
    small: tuple[int, ...] = ()  # examples above the noise floor whose largest |effect| is below effect_floor

    @property
    def floor(self) -> float:
        """The noise floor at the study's median target scale."""
        return noise_floor(self.scale, self.eps)

    def floor_text(self) -> str:
        return f"{NOISE_ULPS} x eps {self.eps:.1e} x the target's scale {self.scale:.3g} = {self.floor:.1e}"

    def to_dict(self) -> dict:
        return {"method": self.method, "examples": self.n_examples, "max_abs": self.max_abs, "eps": self.eps,
                "scale": self.scale, "noise_floor": self.floor, "noise_ulps": NOISE_ULPS,
                "at_floor": len(self.at_floor), "all_zero": self.all_zero, "effect_floor": self.effect_floor,
                "effect_share": EFFECT_SHARE, "below_effect_floor": len(self.small),
                "top1_share": _none_if_nan(self.top1_share), "top2_share": _none_if_nan(self.top2_share)}


def _none_if_nan(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


def reference_profile(tables: dict, method: str, dtype: str) -> ReferenceProfile:
    """The profile of ``method``'s token-level scores (``scores`` table, layer and head -1) on the
    scored tokens of every example (``tokens`` table)."""
    eps = EPS.get(str(dtype), EPS["fp32"])
    examples = tables["examples"]
    values = examples.set_index("example")["target_value"].abs()
    scale = float(values.median()) if len(values) else 1.0
    scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    scores = tables["scores"]
    sel = scores[(scores.method == method) & (scores.layer < 0) & (scores["head"] < 0)]
    scored = tables["tokens"][tables["tokens"].scored][["example", "position"]]
    sel = sel.merge(scored, on=["example", "position"])
    sel = sel[np.isfinite(sel.score)]
    mag = sel.assign(a=sel.score.abs().astype(np.float64))
    if not len(mag):
        return ReferenceProfile(method, 0, 0.0, eps, scale, (), True, float("nan"), float("nan"))
    grouped = mag.groupby("example")["a"]
    peak = grouped.max()
    total = grouped.sum()
    ordered = mag.sort_values(["example", "a"], ascending=[True, False])
    rank = ordered.groupby("example").cumcount()
    top1 = ordered[rank < 1].groupby("example")["a"].sum()
    top2 = ordered[rank < 2].groupby("example")["a"].sum()
    floors = noise_floor(np.maximum(values.reindex(peak.index).fillna(scale).to_numpy(), scale), eps)
    at_floor = tuple(int(e) for e, p, f in zip(peak.index, peak.to_numpy(), floors) if p <= f)
    above = peak[[int(e) not in set(at_floor) for e in peak.index]]
    effect_floor = EFFECT_SHARE * float(np.quantile(above.to_numpy(), 0.9)) if len(above) else 0.0
    small = tuple(int(e) for e, p in above.items() if p < effect_floor)
    live = [e for e in above.index if int(e) not in set(small)]
    denominator = float(total.reindex(live).sum())
    share = (lambda s: float(s.reindex(live).sum()) / denominator) if denominator > 0 else (lambda s: float("nan"))
    return ReferenceProfile(method, int(len(peak)), float(peak.max()), eps, scale, at_floor,
                            bool(float(peak.max()) == 0.0), share(top1), share(top2), effect_floor, small)


def profiles(tables: dict, study: Study, dtype: str) -> dict[str, ReferenceProfile]:
    """A profile per intervention reference of the study."""
    if "scores" not in tables or "tokens" not in tables:
        return {}
    return {ref: reference_profile(tables, ref, dtype) for ref in study.references
            if method_family(ref) == "intervention"}


def without_noise(agreement: pd.DataFrame, found: dict[str, ReferenceProfile]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``agreement`` less the rows compared with a reference at its noise floor, or below its effect
    floor, on that example (a ceiling row when either side is), and those left out as ``left_out`` rows."""
    drop = np.zeros(len(agreement), dtype=bool)
    reasons = np.full(len(agreement), "", dtype=object)
    for ref, profile in found.items():
        side = ((agreement.reference == ref) | ((agreement.role == "ceiling") & (agreement.explainer == ref))).to_numpy()
        for examples, reason in ((profile.small, "reference below the effect floor"),
                                 (profile.at_floor, "reference at the noise floor")):
            if examples:
                hit = side & agreement.example.isin(examples).to_numpy()
                drop |= hit
                reasons[hit] = reason
    left = agreement.loc[drop, ["example", "explainer", "reference", "role"]].assign(reason=reasons[drop])
    return agreement.loc[~drop].reset_index(drop=True), left.drop_duplicates().reset_index(drop=True)


def choose_measure(requested: str, profile: ReferenceProfile | None, computed: list[str]) -> tuple[str, str]:
    """(the measure the verdict uses, why). ``auto`` chooses by concentration (module docstring);
    an explicit measure is kept."""
    if requested != "auto":
        return requested, "set by the study"
    if profile is None or not np.isfinite(profile.top2_share):
        return "kendall_tau", "auto: no intervention reference to profile, Kendall's tau"
    tops = sorted(int(c[3:]) for c in computed if c.startswith("top") and c[3:].isdigit())
    share1, share2 = profile.top1_share, profile.top2_share
    if share1 >= CONCENTRATED and 1 in tops:
        return "top1", (f"auto: {100 * share1:.0f}% of {profile.method}'s |effect| sits on each example's top token "
                        f"(>= {100 * CONCENTRATED:.0f}%), so top-1 agreement")
    wider = [k for k in tops if k >= 2]
    if share2 >= CONCENTRATED and wider:
        return f"top{wider[0]}", (f"auto: {100 * share2:.0f}% of {profile.method}'s |effect| sits on each "
                                  f"example's top two tokens (>= {100 * CONCENTRATED:.0f}%), so top-{wider[0]} "
                                  f"agreement")
    return "kendall_tau", (f"auto: {profile.method}'s |effect| is spread ({100 * share2:.0f}% on the top two tokens), "
                           "so Kendall's tau")


def concentration_warning(measure: str, profile: ReferenceProfile | None) -> str | None:
    """A warning when a rank correlation over all tokens judges a reference whose effect sits on one
    or two tokens."""
    if profile is None or measure not in ("kendall_tau", "spearman") or not np.isfinite(profile.top2_share):
        return None
    if profile.top2_share < CONCENTRATED:
        return None
    return (f"{100 * profile.top2_share:.0f}% of {profile.method}'s |effect| sits on each example's top two tokens: "
            f"{measure} over all tokens then mostly ranks the rest's near-zero effects; statistics.measure: top1 "
            "(or auto) asks whether the tokens that matter agree")


def interaction_summary(interactions: pd.DataFrame | None, floor: float = 0.0) -> dict | None:
    """What the pair check (:func:`probe.intervene.pairs.pair_interactions`) found: the number of pairs
    and of examples looked at, and the examples with a misranked pair of each kind (single deletion
    ranks another token above one of them), with the strongest such pair. Interactions below ``floor``
    (the reference's effect floor: what the study counts as no effect) are not named."""
    if interactions is None or not len(interactions):
        return None
    floor = float(floor) if np.isfinite(floor) else 0.0
    out: dict = {"pairs": int(len(interactions)), "examples": int(interactions["example"].nunique())}
    for kind in ("substitutes", "complements"):
        misranked = interactions["misranked"].astype(bool) if "misranked" in interactions else True
        flagged = interactions[(interactions["kind"] == kind) & misranked & (interactions["interaction"].abs() >= floor)]
        strongest = None
        if len(flagged):
            r = flagged.loc[flagged["interaction"].abs().idxmax()]
            strongest = {"example": int(r["example"]), "tokens": [str(r["token_a"]), str(r["token_b"])],
                         "joint": float(r["joint"]), "singles": [float(r["single_a"]), float(r["single_b"])]}
        out[kind] = {"examples": sorted(int(e) for e in flagged["example"].unique()), "strongest": strongest}
    return out


def interaction_warning(found: dict | None, reference: str) -> str | None:
    """A warning when single-token deletion (the verdict reference ``reference``, a leave-one-out)
    misjudges pairs of tokens that stand in for each other or need each other; None when the
    reference is a Shapley value (it shares joint effects) or nothing was flagged."""
    if found is None or reference == "shapley":
        return None
    parts = []
    for kind, words in (("substitutes", "stand in for each other (deleting one shows little, both a lot)"),
                        ("complements", "need each other (each deletion removes their shared effect: counted twice)")):
        flagged = found[kind]["examples"]
        if not flagged:
            continue
        s = found[kind]["strongest"]
        shown = ", ".join(f"#{e}" for e in flagged[:5]) + (f" and {len(flagged) - 5} more" if len(flagged) > 5 else "")
        parts.append(f"in {len(flagged)} of {found['examples']} examples ({shown}) two top tokens {words}, e.g. "
                     f"#{s['example']} {_pair(s['tokens'])}: joint {s['joint']:+.3g}, singles "
                     f"{s['singles'][0]:+.3g} and {s['singles'][1]:+.3g}")
    if not parts:
        return None
    return (f"single-token deletion ({reference}) misjudges interacting tokens: " + "; ".join(parts)
            + "; a Shapley reference shares joint effects (references: [..., shapley], statistics.reference: shapley)")


def _pair(tokens) -> str:
    """Two tokens as the tables and plots show them (``'Ġmac'`` reads ``'mac'``), quoted."""
    return f"{shown_token(tokens[0])!r} + {shown_token(tokens[1])!r}"


def undecidable_reason(profile: ReferenceProfile | None, n_scored: int, ceiling: dict | None,
                       alpha: float = 0.05, interactions: dict | None = None) -> str | None:
    """Why nothing can be decided about the verdict reference, or None. ``ceiling``: the verdict's
    ceiling (``{"pair", "mean", "ci", "p_chance"}``): references whose best agreement is not above
    chance (its permutation p-value above ``alpha``) give no ranking to track. ``interactions``: the
    pair check (:func:`interaction_summary`): where no single perturbation changed the target but a
    pair did, the reason says so rather than that the output ignores the input."""
    if profile is not None:
        if profile.n_examples == 0 or profile.all_zero:
            pair = (interactions or {}).get("substitutes", {}).get("strongest")
            if pair is not None:
                return (f"no single perturbation ({profile.method}) changed the target on any example, while deleting "
                        f"two tokens together did (#{pair['example']} {_pair(pair['tokens'])}: "
                        f"{pair['joint']:+.3g}): the tokens stand in for each other, which single deletion cannot "
                        "rank; judge against shapley (statistics.reference: shapley)")
            return (f"the output does not depend on the input: no perturbation ({profile.method}) changed the target "
                    "on any example")
        if len(profile.at_floor) == profile.n_examples:
            return (f"the reference's effects are at the numerical noise floor: the largest |{profile.method}| is "
                    f"{profile.max_abs:.1e}, the floor {profile.floor_text()}")
    if n_scored < MIN_EXAMPLES:
        return f"too few scored examples: {n_scored} compared with the reference, at least {MIN_EXAMPLES} needed"
    if ceiling is not None and ceiling.get("p_chance") is not None and ceiling["p_chance"] > alpha:
        a, b = ceiling["pair"]
        return (f"the references do not agree with each other above chance: the best ceiling ({a} vs {b}) is "
                f"{ceiling['mean']:+.3f} [{ceiling['ci'][0]:+.3f}, {ceiling['ci'][1]:+.3f}], permutation p = "
                f"{ceiling['p_chance']:.3f} > alpha {alpha}: there is no causal ranking stable enough to track")
    return misjudged_reason(interactions, profile.method if profile is not None else None)


def misjudged_reason(found: dict | None, reference: str | None) -> str | None:
    """Why the verdict cannot judge against a single-deletion reference whose own pair check
    (:func:`interaction_summary`) finds, in more than :data:`MISJUDGED` of the examples it looked at,
    top tokens that stand in for each other and that single deletion misranks, or None (a Shapley
    reference shares joint effects: never). Substitutes are the blind spot of design rule 17: deleting
    one shows nothing, so single deletion cannot rank them at all. Complements (each deletion removes
    their shared effect, counted twice) are named in the verdict's warning, and decide nothing: single
    deletion still sees each of them move the target."""
    if not found or reference is None or reference == "shapley" or not found.get("examples"):
        return None
    flagged = found["substitutes"]["examples"]
    if len(flagged) <= MISJUDGED * found["examples"]:
        return None
    return (f"the reference cannot judge: single-token deletion ({reference}) cannot rank top tokens that stand in "
            f"for each other (deleting one shows little, both a lot) in {len(flagged)} of the {found['examples']} "
            f"examples the pair check looked at, more than {100 * MISJUDGED:.0f}%; judge against Shapley values, "
            "which share joint effects (references: [..., shapley], statistics.reference: shapley)")
