"""Rule 2 of the verdict on evidence: is an attention unit shown not worse than the gradient bar?

Rule 2 asks whether a unit U ranks tokens about as well as the best gradient explainer G* that
passed its checks. "Not significantly below G*" would pass whenever the study is too small to see a
difference, so that a 12-sentence study says "yes" where the 200-sentence one says "no". The rule is
a non-inferiority test instead (the one-sided halves of an equivalence test, TOST, Schuirmann 1987;
Walker & Nowacki 2011 for the non-inferiority reading): on the per-example paired differences
d = U - G* over the same examples, with the paired bootstrap interval [low, high] at 1 - 2 alpha
(90% at alpha 0.05: each bound is a one-sided test at alpha, the TOST convention; the intervals the
report shows are at ``statistics.level``) and the margin m, a share s of the bar's lead over
chance (``statistics.margin``, s = 0.2: m = s x (mean(G*) - mean(random ranking)), so a unit must keep
80% of what gradients gain over chance; the FDA's non-inferiority guidance of 2016 calls this kind of
margin a preserved fraction of the active control's effect). A share rather than a fixed amount,
because the bar's scale differs by measure and model: Kendall's tau of 0.13 against 0.37, top-1 of
0.83:

    not worse   low > -m: U is shown to be at most m below G* (it may be better); rule 2 passes;
    worse       high < -m: U is shown to be more than m below G*; rule 2 fails;
    undecided   otherwise: the interval holds -m, so the study cannot tell. U carries no answer
                either way, and a study whose deciding units are undecided answers "undecidable"
                with the number of examples that would decide (:func:`n_needed`).

Without a gradient explainer that passed its checks rule 2 cannot be applied. Where the study had
gradient explainers and all failed a check, nothing is compared and a unit that passes rules 1
and 3 is undecided too ("not compared with gradients"); a study without any gradient explainer
asked for no comparison, and its answer says that it rests on rules 1 and 3 alone.

Torch-free: it reads the per-example agreement a study stored.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from numpy.typing import ArrayLike

__all__ = ["NOT_WORSE", "N_NEEDED_CAP", "POWER", "UNDECIDED", "WORSE", "family_state", "margin_of", "n_needed",
           "n_needed_text", "rule2_state", "undecided_why"]

NOT_WORSE, WORSE, UNDECIDED = "not worse", "worse", "undecided"
POWER = 0.8  # the power at which n_needed expects a unit's interval to clear the margin
N_NEEDED_CAP = 100_000  # beyond this n_needed says "more than" (a difference at the margin is never decided)


def margin_of(bar: float, chance: float, share: float) -> float:
    """Rule 2's margin on the measure: ``share`` of the gradient bar's mean ``bar`` above the random
    ranking's ``chance`` (0 where the bar is not above chance: then only a unit shown better passes)."""
    lead = bar - chance
    return float(share * lead) if math.isfinite(lead) and lead > 0 else 0.0


def rule2_state(ci_low: float, ci_high: float, margin: float) -> str:
    """:data:`NOT_WORSE`, :data:`WORSE` or :data:`UNDECIDED` for a paired interval [ci_low, ci_high]
    of unit - bar against the margin (module docstring). A NaN bound (fewer than two pairs) is
    undecided."""
    if not (math.isfinite(ci_low) and math.isfinite(ci_high)):
        return UNDECIDED
    if ci_low > -margin:
        return NOT_WORSE
    if ci_high < -margin:
        return WORSE
    return UNDECIDED


def n_needed(diffs: ArrayLike, margin: float, alpha: float, power: float = POWER) -> int:
    """About how many examples would decide rule 2 for paired differences like ``diffs`` (the unit's
    per-example unit - bar): the n at which a one-sided test at ``alpha`` has ``power`` to place the
    interval on one side of -margin, for the observed mean and standard deviation,
    n = ((z_{1-alpha} + z_power) sd / |mean + margin|)^2 (the normal approximation of a paired
    t-test's sample size), at least the current n + 1, at most :data:`N_NEEDED_CAP` + 1 (read: more
    than the cap)."""
    from scipy.special import ndtri  # norm.ppf's own function, without scipy.stats' start-up

    d = np.asarray(diffs, dtype=np.float64)
    d = d[np.isfinite(d)]
    n = int(d.size)
    distance = abs(float(d.mean()) + margin) if n else 0.0
    sd = float(d.std(ddof=1)) if n >= 2 else float("nan")
    if not math.isfinite(sd) or distance <= 0:
        return N_NEEDED_CAP + 1
    if sd == 0:
        return n + 1
    z = float(ndtri(1 - alpha)) + float(ndtri(power))
    need = math.ceil((z * sd / distance) ** 2)
    return int(min(max(need, n + 1), N_NEEDED_CAP + 1))


def n_needed_text(n: int) -> str:
    """``about 40`` or ``more than 100,000``."""
    return f"more than {N_NEEDED_CAP:,}" if n > N_NEEDED_CAP else f"about {n:,}"


def family_state(rows: pd.DataFrame) -> tuple[str, str | None, int | None]:
    """A verdict family's answer from its per-unit tests (``rows``: ``head``, ``tracks``,
    ``undecided`` and rule 2's columns), why when it is undecidable, and about how many examples
    would decide rule 2 for the deciding units (None where rule 2 is not what is open). Yes when a
    layer-level unit tracks; else undecidable when one is undecided (it might track); else heads
    only when a head tracks; else undecidable when a head is undecided; else no."""
    is_layer = (rows["head"] < 0).to_numpy()
    tracks = rows.tracks.astype(bool).to_numpy()
    undecided = rows.undecided.astype(bool).to_numpy()
    if tracks[is_layer].any():
        return "yes", None, None
    if undecided[is_layer].any():
        return _undecidable(rows[undecided & is_layer], "layer-level units")
    if tracks[~is_layer].any():
        return "heads only", None, None
    if undecided[~is_layer].any():
        return _undecidable(rows[undecided & ~is_layer], "heads")
    return "no", None, None


def _undecidable(open_: pd.DataFrame, what: str) -> tuple[str, str, int | None]:
    need = None
    if "rule2" in open_.columns and (open_.rule2 == UNDECIDED).any():
        need = int(open_[open_.rule2 == UNDECIDED].n_needed.max())
    return "undecidable", undecided_why(open_, what), need


def undecided_why(rows: pd.DataFrame, what: str) -> str:
    """Why units that might track carry no answer: rule 2 cannot tell (with the n that would
    decide), gradients were not compared, or rule 1 stays within Monte Carlo error of alpha."""
    n = int(rows.n.max())
    rule2 = rows.rule2 if "rule2" in rows.columns else None
    if rule2 is not None and (rule2 == UNDECIDED).any():
        open_ = rows[rule2 == UNDECIDED]
        top = open_.sort_values("mean", ascending=False).iloc[0]
        need = int(open_.n_needed.max())
        return (f"too few examples to compare with gradients: n = {n}; {n_needed_text(need)} would be needed "
                f"({len(open_)} {what} above chance, e.g. {top.unit} - {top.vs_gradient} "
                f"{top.diff_vs_gradient:+.3f} [{top.rule2_low:+.3f}, {top.rule2_high:+.3f}] (one-sided bounds), are "
                "neither shown within the margin of the gradient bar nor shown further below it)")
    if rule2 is not None and (rule2 == "not compared").any():
        k = int((rule2 == "not compared").sum())
        return (f"not compared with gradients: every gradient explainer of the study failed a sanity check, so "
                f"whether the {k} {what} above chance do as well as gradients is not known (n = {n})")
    k = len(rows)
    drawn = f" after {int(rows.permutations.max()):,} random rankings" if "permutations" in rows.columns else ""
    return (f"{k} {what}' chance p-values stay within Monte Carlo error of alpha{drawn}: whether they are above "
            f"chance cannot be told at this precision (n = {n})")
