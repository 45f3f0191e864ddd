"""Statistics over a finished study, the verdict and the provenance.

The verdict rule (stored with every result in ``verdict.json``):

    An attention explanation unit U (a head, a layer, or a token-level attention method such as
    rollout at a layer) *tracks causal importance* with respect to the study's verdict reference R
    (an intervention, leave-one-out by default, signed unless the study compares it by magnitude)
    when all three hold, on the study's measure (chosen by the reference's concentration with
    measure auto: top-1 agreement when one token carries the effect, else Kendall tau-b), over
    the examples:

    1. better than chance: U's mean agreement is above what random rankings of the same examples
       give: its permutation p-value (the reference's values permuted over each example's scored
       tokens, ``statistics.permutations`` times, the same permutations for every unit), adjusted
       across the units of U's family by the max-T method (family-wise error control), is at most
       alpha. The seeded random ranking is shown beside it and decides nothing;
    2. shown not worse than gradients: U's agreement is shown to be at most a margin m below
       that of the best gradient explainer G* that passed its sanity checks (the bar), m being a
       share (``statistics.margin``, 0.2) of G*'s lead over the random ranking (U must keep 80% of
       what gradients gain over chance): the lower bound of the paired bootstrap interval of U - G* over the
       same examples at 1 - 2 alpha (each bound a one-sided test at alpha) lies above -m
       (non-inferiority). Its upper bound below -m shows U worse; an interval that holds -m leaves U
       undecided. Where the study has gradient explainers and all
       failed a check, nothing was compared and U is undecided; a study without any applies rules 1
       and 3 alone and says so;
    3. reliable: U's method failed none of its sanity checks (constant scores, degeneracy,
       randomisation, sign).

    Units are judged per family: the attention weights (attention, attention_mean), attention-derived
    (rollout, flow), context mixing (attn_norm, value zeroing, ALTI, GlobEnc) and attention x
    gradient. A family's answer is "yes" when at least one of its layer-level units tracks,
    "undecidable" when none does and one is undecided (it passes rules 1 and 3 and rule 2 cannot
    tell, or its rule-1 p-value stays within Monte Carlo error of alpha), "heads only" when only
    single heads track, "undecidable" when no unit tracks and a head is undecided, "no" otherwise.
    The study's answer is the attention weights' (the first family the study has), or "undecidable"
    when nothing can be decided: the output does not depend on the input, R's effects are at the
    numerical noise floor, too few examples were scored, the references do not agree with each other
    above chance (the ceiling's own permutation test), or the pair check finds top tokens that stand
    in for each other, which R (single-token deletion) cannot rank, in more than half of the examples
    it looked at.

Why this rule: rule 1 asks that attention carry real information about which tokens matter, against
the whole distribution chance gives (one random ranking is a single draw: where it happens to score
0 on every example its interval is [0, 0] and half the heads would clear it), with the family's
hundreds of heads tested together so that a model whose heads carry nothing passes none of them in
more than alpha of statistics seeds (reports/planted shows that calibration); rule 2 asks that it do so about as well as
the cheap, standard alternative, since an explanation clearly worse than plain gradients is not one
an auditor should rely on, and asks it on evidence (non-inferiority): "not shown worse" would pass
any unit of a study too small to see a difference; rule 3 keeps a unit whose own assumption failed
on this model from carrying the answer. Families are answered separately because
"attention" in a claim means the attention weights; the others are named beside it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from probe.errors import InputError
from probe.metrics.statistics import holm, paired_test, summarize_groups
from probe.names import measure_columns as measures
from probe.names import method_family as family
from probe.names import unit_name
from probe.study import decide
from probe.study.checks import redundancy, sanity_table, with_left_out
from probe.study.headline import verdict_headline
from probe.study.power import margin_of
from probe.study.provenance import provenance
from probe.study.steps import is_stepwise, per_source
from probe.study.store import ResultStore, write_json, write_table
from probe.study.units import describe_units, family_answers, paired_tests, verdict_family, where_rows
from probe.study.verdict import Verdict

if TYPE_CHECKING:
    from probe.models.core import AttentionContract, ProbeModel
    from probe.spec.study import Study
    from probe.study.sanity import Check

RULE = __doc__.split("The verdict rule (stored with every result in ``verdict.json``):")[1].split("Why this rule:")[0]
RULE = " ".join(RULE.split())
GROUP = ["role", "explainer", "reference", "layer", "head"]


def summary_table(agreement: pd.DataFrame, study: Study, only: str | None = None) -> pd.DataFrame:
    """One row per (role, explainer, reference, layer, head, measure): n, mean, std, CI, Sig. Frac.
    ``only``: that measure alone."""
    st = study.statistics
    frames = []
    for measure, p_col in measures(agreement):
        if only is not None and measure != only:
            continue
        frame = summarize_groups(agreement, GROUP, measure, p_col, alpha=st.alpha, n_boot=st.bootstrap,
                                 level=st.level, seed=st.seed)
        frame.insert(len(GROUP), "measure", measure)
        frames.append(frame)
    if not len(agreement) or not frames:  # nothing compared (every pair left out): the columns, no rows
        return pd.DataFrame(columns=[*GROUP, "measure", "n", "mean", "std", "ci_low", "ci_high", "sig_frac",
                                     "sig_pos_frac"])
    return pd.concat(frames, ignore_index=True)


def _unit_name(row) -> str:
    return unit_name(str(row["explainer"]), int(row["layer"]), int(row["head"]))


def verdict(agreement: pd.DataFrame, summary: pd.DataFrame, study: Study, model_name: str,
            unreliable: dict | None = None, *, profile: decide.ReferenceProfile | None = None,
            measure: str | None = None, measure_why: str = "set by the study", sanity: Sequence[Check] = (),
            redundant: Sequence[dict] = (), mixing: str = "attention",
            chance: pd.DataFrame | None = None, unreliable_units: dict | None = None,
            interactions: pd.DataFrame | None = None) -> tuple[dict, pd.DataFrame]:
    """Apply the rule (module docstring); returns the whole verdict (what ``verdict.json`` holds)
    and the per-unit paired tests.

    ``unreliable``: methods that failed a sanity check (method -> checks): their units never track,
    and they are used neither as the gradient bar nor in a ceiling. A ceiling is an agreement
    between references: two interventions, or a reliable gradient method and an intervention.
    ``profile``: the verdict reference's :class:`probe.study.decide.ReferenceProfile` (noise floor,
    concentration); ``measure``: the measure the verdict uses (default the study's).
    ``sanity``: the study's checks (the verdict's ``sanity``); ``redundant``: the groups of units
    with identical rankings (:func:`probe.study.checks.redundancy`), named in the headline.
    ``mixing``: what the headline calls the maps (``"attention"``, or a token mixer's matrix).
    ``chance``: rule 1's permutation tests (:func:`chance_frame` of a :func:`chance_plan`) of every
    attention unit, and of the ceiling pairs (family ``ceiling``). ``unreliable_units``: units that
    failed a check of their own (``(method, layer, head)`` -> checks): they never track.
    ``interactions``: the pair check's rows (:func:`probe.intervene.pairs.pair_interactions`): pairs of top
    tokens that single deletion misjudges are named in a warning."""
    if chance is None:
        raise ValueError("the verdict needs rule 1's chance tests (probe.study.summary.chance_frame)")
    unreliable = unreliable or {}
    unreliable_units = unreliable_units or {}
    st = study.statistics
    ref = study.verdict_reference
    measure = measure or (st.measure if st.measure != "auto" else "kendall_tau")
    s = summary[(summary.reference == ref) & (summary.measure == measure)]
    explainers = s[s.role == "explainer"]
    all_grads, grads, best_grad, margin = _the_bar(s, unreliable, st.margin)
    paired = paired_tests(agreement, explainers, chance, best_grad, ref, measure, study, unreliable, unreliable_units,
                           compared=bool(len(all_grads)), margin=margin)
    ordered = paired.sort_values("mean", ascending=False) if len(paired) else paired
    ceiling = _ceiling(summary, ref, measure, unreliable)
    numbers = _numbers(s, best_grad, ceiling, chance)
    excluded = {e: unreliable[e] for e in dict.fromkeys(all_grads.explainer) if e in unreliable}
    bar = _gradient_bar(best_grad, excluded, bool(len(all_grads)), margin, st.margin)
    above = _above_ceiling(ceiling, ordered, grads)
    n_scored = int(agreement[(agreement.reference == ref) & (agreement.role == "explainer")].example.nunique()) \
        if len(agreement) else 0
    found_pairs = decide.interaction_summary(interactions, getattr(profile, "effect_floor", 0.0) or 0.0)
    reason = decide.undecidable_reason(profile, n_scored, numbers["ceiling"], st.alpha, found_pairs)
    families = family_answers(paired, reason)
    warnings = [w for w in [decide.concentration_warning(measure, profile),
                            _reversed_warning(mixing, ordered, numbers["random"]),
                            decide.interaction_warning(found_pairs, ref)] if w]
    fields = {**_answer_fields(study, measure, measure_why, reason, families, n_scored), **_unit_lists(paired, ordered, families),
              **numbers, "gradient_bar": bar, "above_ceiling": above, "warnings": warnings, "interactions": found_pairs,
              "reference_profile": profile.to_dict() if profile is not None else None,
              "token_level": [e for e in study.explainers if e not in set(paired.explainer)] if len(paired)
              else list(study.explainers),
              "unreliable_excluded": {m: c for m, c in unreliable.items() if m in study.methods}}
    text = verdict_headline(model_name, fields, study, mixing, unreliable=unreliable,
                            unreliable_units=unreliable_units, redundant=redundant)
    result = {**fields, "headline": text, "sanity": [c.to_dict() for c in sanity],
              "unreliable": unreliable, "unreliable_units": {unit_name(*u): c for u, c in unreliable_units.items()},
              "redundant": list(redundant)}
    return result, paired


def _the_bar(s: pd.DataFrame, unreliable: dict, share: float) -> tuple:
    """Rule 2's bar on the verdict's summary rows ``s``: the gradient explainers, those that passed
    their checks, the best of them (None without one) and the margin (:func:`probe.study.power.margin_of`)."""
    explainers = s[s.role == "explainer"]
    all_grads = where_rows(explainers, (family(e) == "gradient" for e in explainers.explainer))
    grads = where_rows(all_grads, (e not in unreliable for e in all_grads.explainer))
    best_grad = grads.sort_values("mean", ascending=False).iloc[0] if len(grads) else None
    random = s[(s.role == "baseline") & (s.explainer == "random")]
    margin = (margin_of(float(best_grad["mean"]), float(random["mean"].iloc[0]) if len(random) else 0.0, share)
              if best_grad is not None else None)
    return all_grads, grads, best_grad, margin


def _numbers(s: pd.DataFrame, best_grad: pd.Series | None, ceiling: pd.Series | None, chance: pd.DataFrame) -> dict:
    """The verdict's reference points on its measure: the random ranking, the best gradient, the
    ceiling (with its chance test) and every baseline."""
    random = s[(s.role == "baseline") & (s.explainer == "random")]
    return {
        "random": _stat(random.iloc[0]) if len(random) else None,
        "best_gradient": ({"explainer": best_grad.explainer, **_stat(best_grad)} if best_grad is not None else None),
        "ceiling": ({"pair": [ceiling.explainer, ceiling.reference], **_stat(ceiling),
                     "p_chance": ceiling_p(chance, ceiling.explainer, ceiling.reference)}
                    if ceiling is not None else None),
        "baselines": {r.explainer: _stat(r) for _, r in s[s.role == "baseline"].iterrows()},
    }


def _answer_fields(study: Study, measure: str, measure_why: str, reason: str | None, families: dict,
                   n_scored: int = 0) -> dict:
    """The verdict's answer (the headline family's, or undecidable), the rule and how it was applied,
    with ``n`` (the scored examples) and, where units are undecided, ``n_needed`` (about how many
    would decide rule 2)."""
    from probe.study.chance import MC_MAX_PERMUTATIONS

    st = study.statistics
    ref = study.verdict_reference
    headline_family = next(iter(families), None)
    chosen = families.get(headline_family) if headline_family else None
    reason = reason or (chosen or {}).get("undecided")
    return {
        "answer": "undecidable" if reason else (chosen["answer"] if chosen else "no"), "rule": RULE,
        "n": int(n_scored), "n_needed": (chosen or {}).get("n_needed"), "margin_share": st.margin,
        "reference": ref, "reference_sign": "absolute" if ref in set(study.metrics.absolute) else "signed",
        "measure": measure, "measure_requested": st.measure, "measure_why": measure_why,
        "alpha": st.alpha, "level": st.level, "bootstrap": st.bootstrap, "permutations": st.permutations,
        "chance_test": (f"max-T permutation test per family: {st.permutations} random rankings of each example, "
                        f"more (up to {MC_MAX_PERMUTATIONS:,}) where a p-value lies within Monte Carlo error of "
                        f"alpha, family-wise alpha {st.alpha}"),
        "undecidable": reason, "headline_family": headline_family, "families": families,
        "layer_units": chosen["layer_units"] if chosen else {"tracking": 0, "total": 0},
        "head_units": chosen["head_units"] if chosen else {"tracking": 0, "total": 0},
    }


def _unit_lists(paired: pd.DataFrame, ordered: pd.DataFrame, families: dict) -> dict:
    """The best and worst three units overall, and the headline family's best and worst layer-level
    units and heads."""
    n_most = int(paired.n.max()) if len(paired) else 0
    headline_family = next(iter(families), None)

    def top(rows: pd.DataFrame, ascending: bool) -> list[dict]:
        return describe_units(rows.sort_values("mean", ascending=ascending).head(3), n_most) if len(rows) else []

    own = where_rows(paired, (verdict_family(e) == headline_family for e in paired.explainer)) if len(paired) else paired
    layer_units = own[own["head"] < 0] if len(own) else own
    head_units = own[own["head"] >= 0] if len(own) else own
    return {"best": describe_units(ordered.head(3), n_most) if len(ordered) else [],
            "worst": describe_units(ordered.tail(3).iloc[::-1], n_most) if len(ordered) else [],
            "best_layers": top(layer_units, False), "worst_layers": top(layer_units, True),
            "best_heads": top(head_units, False), "worst_heads": top(head_units, True)}


def _gradient_bar(best_grad: pd.Series | None, excluded: dict, any_gradient: bool, margin: float | None,
                  share: float) -> dict:
    """Which gradient explainer rule 2 measured against, its margin, and why the others were not."""
    if best_grad is not None and not margin and share > 0:  # the bar does not lead the random ranking
        text = (f"rule 2's bar: {best_grad.explainer} {best_grad['mean']:+.3f}, the best gradient that passed its checks, "
                "is not above the random ranking: no margin, a unit must be shown above it, which adds little to "
                "rule 1")
    elif best_grad is not None:
        text = (f"rule 2's bar: {best_grad.explainer} {best_grad['mean']:+.3f}, the best gradient that passed its checks; "
                f"a unit must be shown at most {margin:.3f} below it ({share:g} of its lead over the random ranking)")
    elif any_gradient:
        text = ("rule 2 not compared: no gradient explainer passed its sanity checks, so a unit above chance is "
                "undecided")
    else:
        text = "rule 2 not applied: no gradient explainer in the study"
    if excluded:
        text += "; excluded: " + ", ".join(f"{m} ({', '.join(c)})" for m, c in excluded.items())
    return {"explainer": best_grad.explainer if best_grad is not None else None, "excluded": excluded, "text": text,
            "margin": margin, "margin_share": share}


def ceiling_p(chance: pd.DataFrame, a: str, b: str) -> float | None:
    """The raw permutation p-value of the ceiling pair ``a`` vs ``b`` (do the references agree above
    chance), or None where it was not tested."""
    if not len(chance):
        return None
    row = chance[(chance.family == "ceiling") & (chance.explainer == a) & (chance.reference == b)]
    return float(row.p_chance.iloc[0]) if len(row) and np.isfinite(row.p_chance.iloc[0]) else None


def _reversed_warning(mixing: str, ordered: pd.DataFrame, random: dict | None) -> str | None:
    """A token mixer's signed matrix may rank tokens in reverse: its sign is relative to the value
    path's direction downstream, which the matrix does not carry. Units whose agreement lies
    entirely below the random ranking are named (they are never counted as tracking)."""
    if mixing == "attention" or random is None or not len(ordered):
        return None
    maps = ordered[pd.Series([verdict_family(e) is not None for e in ordered.explainer], index=ordered.index, dtype=bool)]
    below = maps[maps.ci_high < random["ci"][0]]
    if not len(below):
        return None
    worst = below.sort_values("mean").iloc[0]
    return (f"{len(below)} unit(s) of the signed mixing matrix agree below the random ranking, most "
            f"{worst.unit} {worst['mean']:+.3f} [{worst.ci_low:+.3f}, {worst.ci_high:+.3f}]: a signed matrix can rank "
            f"tokens in reverse (its sign is relative to the value path's direction, which it does not carry); "
            f"such units carry a ranking but are not counted as tracking")


def _ceiling(summary: pd.DataFrame, ref: str, measure: str, unreliable: dict) -> pd.Series | None:
    """The highest agreement between references, preferring pairs that involve the verdict reference."""
    all_ceilings = summary[(summary.role == "ceiling") & (summary.measure == measure)]
    # a boolean Series, not a list: an empty list would select no columns instead of no rows
    all_ceilings = all_ceilings[pd.Series([_is_reference_agreement(a, b, unreliable) for a, b in
                                           zip(all_ceilings.explainer, all_ceilings.reference)],
                                          index=all_ceilings.index, dtype=bool)]
    involving = all_ceilings[(all_ceilings.explainer == ref) | (all_ceilings.reference == ref)]
    ceilings = (involving if len(involving) else all_ceilings).sort_values("mean", ascending=False)
    return ceilings.iloc[0] if len(ceilings) else None


def _above_ceiling(ceiling: pd.Series | None, ordered: pd.DataFrame, grads: pd.DataFrame) -> list[dict]:
    """Attention units and gradient methods whose mean agreement exceeds the ceiling's."""
    above = []
    if ceiling is not None:
        for _, r in ordered.iterrows():
            if r["mean"] > float(ceiling["mean"]):
                above.append({"unit": r.unit, "mean": float(r["mean"])})
        for _, r in grads.iterrows():
            if r["mean"] > float(ceiling["mean"]):
                above.append({"unit": _unit_name(r), "mean": float(r["mean"])})
    return above


def comparisons(agreement: pd.DataFrame, study: Study, measure: str | None = None) -> pd.DataFrame:
    """Paired tests between every two explainers, on the study's measure against its verdict
    reference: token-level methods, and per-layer methods at each layer (single heads are
    compared with the best gradient in ``paired.parquet`` only). Holm-adjusted over the table."""
    st = study.statistics
    ref = study.verdict_reference
    measure = measure or (st.measure if st.measure != "auto" else "kendall_tau")
    rows = agreement[(agreement.reference == ref) & (agreement.role == "explainer") & (agreement["head"] < 0)]
    units = {key: frame.set_index("example")[measure] for key, frame in rows.groupby(["explainer", "layer"], sort=True)}
    keys = list(units)
    records = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            x, y = units[a].align(units[b], join="inner")
            test = paired_test(x.to_numpy(), y.to_numpy(), n_boot=st.bootstrap, level=st.level, seed=st.seed)
            records.append({"a": a[0], "a_layer": int(a[1]), "b": b[0], "b_layer": int(b[1]), "reference": ref,
                            "measure": measure, **test})
    frame = pd.DataFrame.from_records(records)
    if len(frame):
        frame["wilcoxon_p_holm"] = holm(frame["wilcoxon_p"].to_numpy())
    return frame


def _is_reference_agreement(a: str, b: str, unreliable: dict) -> bool:
    """Two interventions, or a gradient method that passed its checks against an intervention."""
    kinds = sorted([family(a), family(b)])  # type: ignore[type-var]  # a study's methods are listed: never None
    if kinds == ["intervention", "intervention"]:
        return True
    if kinds == ["gradient", "intervention"]:
        return (a if family(a) == "gradient" else b) not in unreliable
    return False


def _stat(row) -> dict:
    return {"mean": float(row["mean"]), "ci": [float(row.ci_low), float(row.ci_high)], "n": int(row.n),
            "sig_frac": float(row["sig_frac"]) if "sig_frac" in row and pd.notna(row["sig_frac"]) else None}


def mixing_words(contract: AttentionContract) -> str:
    """What a verdict calls a model's maps: attention, or (every stack a token mixer read as its
    implicit matrix) the mixing matrix."""
    kinds = {stack.maps for stack in contract.stacks.values()}
    return "its mixing matrix (implicit attention)" if kinds and all(s.implicit for s in contract.stacks.values()) else "attention"


def _chance_units(summary: pd.DataFrame, ref: str, measure: str) -> pd.DataFrame:
    """The units rule 1 tests: every attention-family unit compared with ``ref`` on ``measure``,
    with its verdict family (the family its max-T test runs over)."""
    rows = summary[(summary.role == "explainer") & (summary.reference == ref) & (summary.measure == measure)]
    rows = where_rows(rows, (verdict_family(e) is not None for e in rows.explainer))
    return pd.DataFrame({"explainer": rows.explainer.astype(str), "layer": rows.layer.astype(int),
                         "head": rows["head"].astype(int), "family": [verdict_family(e) for e in rows.explainer]})


def chance_plan(tables: dict, unit_agreement: pd.DataFrame, summary: pd.DataFrame, study: Study, measure: str) -> list:
    """What rule 1 tests (:func:`probe.study.chance.chance_families`), seed-free: every attention unit
    by family, and every ceiling pair on its own (family ``ceiling``)."""
    from probe.study.chance import chance_families

    ref = study.verdict_reference
    plan = []
    units = _chance_units(summary, ref, measure)
    if len(units):
        plan += chance_families(tables, unit_agreement, study, measure, units)
    ceilings = summary[(summary.role == "ceiling") & (summary.measure == measure)]
    for a, b in dict.fromkeys(zip(ceilings.explainer, ceilings.reference)):
        pair = pd.DataFrame({"explainer": [a], "layer": [-1], "head": [-1], "family": ["ceiling"]})
        plan += chance_families(tables, unit_agreement, study, measure, pair, role="ceiling", reference=b)
    return plan


def chance_frame(plan: Sequence, *, permutations: int, seed: int, alpha: float | None = None,
                 max_permutations: int | None = None) -> pd.DataFrame:
    """Rule 1's tests of a :func:`chance_plan` at one seed (:data:`probe.study.chance.CHANCE_COLUMNS`);
    with ``alpha``, a family with a unit within Monte Carlo error of it draws more rankings, up to
    ``max_permutations`` (the sequential rule of :mod:`probe.study.chance`)."""
    from probe.study.chance import CHANCE_COLUMNS, test_families

    frames = test_families(plan, permutations=permutations, seed=seed, alpha=alpha, max_permutations=max_permutations)
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CHANCE_COLUMNS)


def judge_tables(tables: dict, study: Study, *, dtype: str, model_name: str | None = None, mixing: str = "attention",
                 sanity: Sequence[Check] = (), answer_only: bool = False) -> dict:
    """Everything the verdict is made of, from a study's merged tables alone (no model): the
    statistics, rule 1's chance tests and the verdict. Returns ``{"verdict"`` (verdict.json's dict),
    ``"summary"``, ``"paired"``, ``"chance"``, ``"comparisons"``, ``"agreement"`` (per dataset
    example, after the noise floor), ``"left_out"`` (None when unchanged), ``"heads_causal"`` (the
    per-head causal test's table, :mod:`probe.study.heads_causal`, when the study asks for it; its
    record is the verdict's ``heads_causal``; None otherwise)}``. A study whose
    ``statistics`` differ (another seed, another alpha) gives that study's verdict on the same tables.
    ``answer_only``: skip what does not make the answer (the comparisons between explainers, None;
    the per-head causal test), as the re-judging of many subsets does (:mod:`probe.study.subsets`)."""
    from probe.study.sanity import failed_methods, failed_units

    found = decide.profiles(tables, study, dtype)
    agreement, at_floor = decide.without_noise(tables["agreement"], found)
    left_out = None
    if len(at_floor):  # the pairs left out for a reference at its noise floor are left-out rows like any
        left_out = pd.concat([t for t in (tables.get("left_out"), at_floor) if t is not None and len(t)],
                             ignore_index=True)
    unit_agreement = agreement
    n_examples = len(tables["examples"])
    if is_stepwise(tables["examples"]):  # statistics over dataset examples, each the mean of its output tokens
        agreement = per_source(agreement, tables["examples"])
        n_examples = int(tables["examples"]["source"].nunique())
    profile = found.get(study.verdict_reference)
    measure, why = decide.choose_measure(study.statistics.measure, profile, list(agreement.columns))
    summary = summary_table(agreement, study, only=measure if answer_only else None)
    summary = with_left_out(summary, agreement, left_out if left_out is not None else tables.get("left_out"),
                            n_examples)
    checks = list(sanity or [])
    plan = chance_plan(tables, unit_agreement, summary, study, measure)
    chance = chance_frame(plan, permutations=study.statistics.permutations, seed=study.statistics.seed,
                          alpha=study.statistics.alpha)
    result, paired = verdict(agreement, summary, study, model_name or study.model.id, unreliable=failed_methods(checks),
                             unreliable_units=failed_units(checks),
                             profile=profile, measure=measure, measure_why=why, sanity=checks,
                             redundant=redundancy(tables, study), mixing=mixing, chance=chance,
                             interactions=tables.get("interactions"))
    heads = None
    if study.metrics.heads_causal is not None and not answer_only:  # beside the verdict, never changing it
        from probe.study.heads_causal import heads_causal

        heads = heads_causal(tables, study, measure=measure, dtype=dtype, unreliable=failed_methods(checks),
                             unreliable_units=failed_units(checks), token_answer=result["answer"])
        result["heads_causal"] = heads.record
    return {"verdict": result, "summary": summary, "paired": paired, "chance": chance, "plan": plan,
            "profile": profile, "comparisons": None if answer_only else comparisons(agreement, study, measure),
            "agreement": agreement,
            "left_out": left_out, "heads_causal": heads.units if heads is not None else None}


def _refuse_without_agreement(tables: dict) -> None:
    """Refuse in one line a study none of whose examples could be compared (every pair left out),
    naming why they were left out."""
    agreement = tables.get("agreement")
    if agreement is not None and len(agreement):
        return
    left = tables.get("left_out")
    n = len(tables["examples"])
    why = ""
    if left is not None and len(left):
        counts = left.groupby("reason")["example"].nunique().sort_values(ascending=False)
        why = " (" + "; ".join(f"{reason}: {count}" for reason, count in counts.items()) + ")"
    raise InputError(f"none of the {n} examples has 2 units to rank, so nothing could be compared{why}: give "
                     "longer texts, or with spans a pattern that matches at least twice in an example")


def with_frontier(verdict_dict: dict, summary: pd.DataFrame, record: Mapping[str, Any]) -> dict:
    """``verdict_dict`` with its ``frontier`` (:func:`probe.study.frontier.verdict_frontier`) from the
    summary and the run's step seconds (``record``: provenance.json's dict)."""
    from probe.study.frontier import verdict_frontier

    return {**verdict_dict, "frontier": verdict_frontier(verdict_dict, summary, record)}


def finalize(store: ResultStore, study: Study, pm: ProbeModel, *, n_batches: int, dropped: dict, load_seconds: float,
             sanity: Sequence[Check] | None = None, phases: Mapping[str, float] | None = None) -> Verdict:
    """Merge the parts, compute the statistics and the verdict (:func:`judge_tables`), write them;
    returns the verdict (frozen; ``verdict.json`` holds its :meth:`~probe.study.verdict.Verdict.to_dict`).
    ``sanity``: the study's :class:`probe.study.sanity.Check` list (``sanity.parquet``, and the
    verdict's ``sanity``, ``unreliable`` and ``redundant``). ``phases``: the seconds of what ran after
    the steps (the sanity checks), recorded in ``provenance.json``'s ``phase_seconds`` with the
    statistics' own."""
    tables = store.merge(n_batches)
    _refuse_without_agreement(tables)
    checks = list(sanity or [])
    started = time.perf_counter()
    judged = judge_tables(tables, study, dtype=pm.contract.dtype, mixing=mixing_words(pm.contract), sanity=checks)
    phases = {**(phases or {}), "statistics": time.perf_counter() - started}
    if judged["left_out"] is not None:
        tables["left_out"] = judged["left_out"]
        write_table(store.root / "left_out.parquet", judged["left_out"])
    record = provenance(store, study, pm, n_batches, tables, dropped, load_seconds, phases=phases)
    decided = Verdict.from_dict(with_frontier(judged["verdict"], judged["summary"], record))
    write_table(store.root / "summary.parquet", judged["summary"])
    write_table(store.root / "sanity.parquet", sanity_table(checks))
    write_table(store.root / "chance.parquet", judged["chance"])
    write_table(store.root / "paired.parquet", judged["paired"])
    write_table(store.root / "comparisons.parquet", judged["comparisons"])
    if judged["heads_causal"] is not None:
        write_table(store.root / "heads_causal.parquet", judged["heads_causal"])
    write_json(store.root / "provenance.json", record)
    write_json(store.root / "verdict.json", decided.to_dict())
    return decided
