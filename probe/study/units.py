"""Each attention unit under the verdict's three rules, and each family's answer from its units.

:func:`paired_tests` applies rule 2 (non-inferiority against the gradient bar, :mod:`probe.study.power`)
and rule 3 (the unit's and its method's checks) to every attention unit of a study; :func:`with_chance`
adds rule 1 (the chance tests, :mod:`probe.study.chance`) and decides whether each unit tracks or is
undecided; :func:`family_answers` answers for each verdict family (:data:`probe.registry.VERDICT_FAMILIES`).
The verdict (:func:`probe.study.summary.verdict`) applies them once, the calibration over statistics
seeds (:mod:`probe.study.calibration`) again at every seed. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.metrics.statistics import paired_test
from probe.names import method_family as family
from probe.names import unit_name
from probe.registry import VERDICT_FAMILIES, find
from probe.study.power import NOT_WORSE, UNDECIDED, WORSE, family_state, n_needed, rule2_state

if TYPE_CHECKING:
    from collections.abc import Iterable

    from probe.spec.study import Study

__all__ = ["CHANCE_FIELDS", "MC_FIELDS", "describe_units", "family_answer", "family_answers", "paired_tests",
           "verdict_family", "where_rows", "with_chance"]


def where_rows(frame: pd.DataFrame, keep: Iterable[bool]) -> pd.DataFrame:
    """The rows of ``frame`` where ``keep`` (one bool per row) holds; an empty frame keeps its columns
    (a plain empty list would select no columns instead of no rows)."""
    return frame.loc[np.asarray(list(keep), dtype=bool)] if len(frame) else frame


def verdict_family(method: str) -> str | None:
    """The verdict family of an attention-family method (:data:`probe.registry.VERDICT_FAMILIES`)."""
    entry = find(method)
    return entry.verdict_family if entry is not None else None


def family_answer(fam: str, rows: pd.DataFrame, n_most: int, reason: str | None) -> dict:
    layers, heads = rows[rows["head"] < 0], rows[rows["head"] >= 0]
    k_layers, k_heads = int(layers.tracks.sum()), int(heads.tracks.sum())
    answer, undecided, need = family_state(rows)
    methods = list(dict.fromkeys(rows.explainer))
    unreliable = sorted({e for e, ok in zip(rows.explainer, rows.reliable) if not ok})
    why = undecided
    if answer == "no" and len(rows) and not rows.reliable.astype(bool).any():
        why = "every method of this family failed a sanity check: " + ", ".join(unreliable)
    best = rows.sort_values("mean", ascending=False)
    return {"answer": "undecidable" if reason else answer, "methods": methods,
            "layer_units": {"tracking": k_layers, "total": int(len(layers)),
                            "undecided": int(layers.undecided.sum()) if "undecided" in layers else 0},
            "head_units": {"tracking": k_heads, "total": int(len(heads)),
                           "undecided": int(heads.undecided.sum()) if "undecided" in heads else 0},
            "best_layer": next(iter(describe_units(best[best["head"] < 0].head(1), n_most)), None),
            "best_head": next(iter(describe_units(best[best["head"] >= 0].head(1), n_most)), None),
            "unreliable": unreliable, "why": why, "undecided": undecided, "n_needed": need}


def paired_tests(agreement: pd.DataFrame, explainers: pd.DataFrame, chance: pd.DataFrame, best_grad: pd.Series | None,
                 ref: str, measure: str, study: Study, unreliable: dict, unreliable_units: dict, *,
                 compared: bool = True, margin: float | None = None) -> pd.DataFrame:
    """One row per attention unit: its mean and CI, rule 1 (its chance test: raw and family-wise
    p-values, the mean and 95th percentile of its null), rule 2 (the paired non-inferiority test
    against the best gradient, :mod:`probe.study.power`: ``rule2`` is ``not worse``, ``worse``,
    ``undecided`` with ``n_needed``, ``not compared`` where every gradient explainer of the study
    failed a check, ``not applied`` where the study has none; ``compared``: whether it has one;
    ``margin``: rule 2's margin on the measure, :func:`probe.study.power.margin_of`), rule 3 (its
    method reliable), and whether it tracks or is undecided."""
    st = study.statistics
    attn = where_rows(explainers, (family(e) == "attention" for e in explainers.explainer)).copy()
    wide = agreement[(agreement.reference == ref)]
    # every unit's per-example values at once (one groupby, not a filter per unit)
    units = {key: part.set_index("example")[measure]
             for key, part in wide.groupby(["explainer", "layer", "head"], sort=False)} if len(wide) else {}
    empty = pd.Series(dtype=float)
    grad_values = (units.get((best_grad.explainer, int(best_grad.layer), int(best_grad["head"])), empty)
                   if best_grad is not None else None)
    tests = []
    for _, row in attn.iterrows():
        unit = units.get((row.explainer, int(row.layer), int(row["head"])), empty)
        test = {"explainer": row.explainer, "family": verdict_family(row.explainer), "layer": int(row.layer),
                "head": int(row["head"]), "unit": unit_name(str(row["explainer"]), int(row["layer"]), int(row["head"])),
                "mean": float(row["mean"]), "ci_low": float(row.ci_low), "ci_high": float(row.ci_high),
                "n": int(row.n)}
        if grad_values is not None:
            a, b = unit.align(grad_values, join="inner")
            pt = paired_test(a.to_numpy(), b.to_numpy(), n_boot=st.bootstrap, level=st.level, seed=st.seed,
                             one_sided_alpha=st.alpha)
            low, high = pt["one_sided_low"], pt["one_sided_high"]
            state = rule2_state(low, high, margin)
            test.update({"vs_gradient": best_grad.explainer, "diff_vs_gradient": pt["mean_diff"],
                         "diff_ci_low": pt["ci_low"], "diff_ci_high": pt["ci_high"], "wilcoxon_p": pt["wilcoxon_p"],
                         "rule2_low": low, "rule2_high": high, "rule2": state,
                         "margin": margin,
                         "n_needed": n_needed((a - b).to_numpy(), margin, st.alpha) if state == UNDECIDED else 0})
        else:
            test.update({"rule2": "not compared" if compared else "not applied", "n_needed": 0})
        test["below_gradient"] = test["rule2"] == WORSE
        test["reliable"] = (row.explainer not in unreliable
                            and (str(row.explainer), int(row.layer), int(row["head"])) not in unreliable_units)
        tests.append(test)
    return with_chance(pd.DataFrame(tests), chance[chance.reference == ref] if len(chance) else chance, st.alpha)


#: rule 1's columns of the per-unit tests, placed after ``n``
CHANCE_FIELDS = ["chance_mean", "chance_high", "p_chance", "p_family", "null", "above_chance"]
#: rule 1's Monte Carlo columns, where the chance tests carry them (the random rankings drawn, the Monte
#: Carlo standard error of p_family, and whether alpha still lies within it at the cap)
MC_FIELDS = ["permutations", "p_mc_se", "near_alpha"]


def with_chance(paired: pd.DataFrame, chance: pd.DataFrame, alpha: float) -> pd.DataFrame:
    """``paired`` (rules 2 and 3 per unit, :func:`paired_tests`) with rule 1 from ``chance`` (its
    p-values, the mean and 95th percentile of the unit's null; ``null``: ``exact`` or ``permutation``,
    where they came from; the Monte Carlo columns where present; ``above_chance``: ``p_family <= alpha``
    and not ``near_alpha``), ``tracks`` (all three rules pass) and ``undecided`` (rule 3 passes and
    neither rule 1 nor rule 2 failed, but one is not shown either way). The verdict applies it once;
    :mod:`probe.study.calibration` again at every seed."""
    if not len(paired):
        return paired
    keys = ["explainer", "layer", "head"]
    # "null": tables from before it lack it
    taken = [c for c in [*CHANCE_FIELDS[:5], *MC_FIELDS] if c in chance.columns]
    fresh = chance[chance.family != "ceiling"][keys + taken].drop_duplicates(keys)
    base = paired.drop(columns=[c for c in [*CHANCE_FIELDS, *MC_FIELDS, "tracks", "undecided"] if c in paired.columns])
    out = base.merge(fresh, on=keys, how="left")
    p = out.p_family.to_numpy(float)
    near = out.near_alpha.fillna(False).astype(bool) if "near_alpha" in out.columns else False
    out["above_chance"] = np.isfinite(p) & (p <= alpha) & ~near
    if "null" not in out.columns:
        out["null"] = "permutation"
    passes2 = out.rule2.isin([NOT_WORSE, "not applied"]).to_numpy()
    open2 = out.rule2.isin([UNDECIDED, "not compared"]).to_numpy()
    reliable = out.reliable.astype(bool).to_numpy()
    out["tracks"] = out.above_chance.to_numpy() & passes2 & reliable
    out["undecided"] = reliable & ((out.above_chance.to_numpy() & open2) | (np.asarray(near) & (passes2 | open2)))
    at = list(base.columns).index("n") + 1
    extra = [c for c in MC_FIELDS if c in out.columns]
    return out[[*base.columns[:at], *CHANCE_FIELDS, *extra, *base.columns[at:], "tracks", "undecided"]]


def family_answers(paired: pd.DataFrame, reason: str | None) -> dict[str, dict]:
    """Each verdict family's answer (:func:`family_answer`) from the per-unit tests, in
    :data:`probe.registry.VERDICT_FAMILIES` order (the headline family first)."""
    n_most = int(paired.n.max()) if len(paired) else 0
    families = {}
    for fam in VERDICT_FAMILIES:
        rows = where_rows(paired, (verdict_family(e) == fam for e in paired.explainer)) if len(paired) else paired
        if len(rows):
            families[fam] = family_answer(fam, rows, n_most, reason)
    return families


def describe_units(rows: pd.DataFrame, n_most: int) -> list[dict]:
    return [{"unit": r.unit, "mean": r["mean"], "ci": [r.ci_low, r.ci_high], "tracks": bool(r.tracks),
             "n": int(r.n), **({"p_family": float(r.p_family)} if pd.notna(r.get("p_family")) else {}),
             **({} if r.get("reliable", True) else {"unreliable": True}),
             **({"undecided": True} if bool(r.get("undecided", False)) else {}),
             **({"rule2": str(r.rule2)} if isinstance(r.get("rule2"), str) else {}),
             **({"fewer_examples": f"n = {int(r.n)} of {n_most}"} if int(r.n) < n_most else {})}
            for _, r in rows.iterrows()]
