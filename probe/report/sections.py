"""The sections of a study report, each built from the stored results alone: the verdict, the
agreement with the references, counterfactual attention, heads, example token views and the
limitations (the set-up and provenance section is :mod:`probe.report.setup_section`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from probe.document import Bullets, KeyValues, Para, Section, Table, TokenView
from probe.plots import bands_caption, measure_label
from probe.report import analysis as an
from probe.report import figures as fg
from probe.report.output import Writer
from probe.report.results import StudyResult
from probe.report.tokens import token_examples
from probe.study.headline import passing_units


def stat_text(d: dict | None) -> str:
    """A stored statistic (``{"mean", "ci"}``) as ``+0.123 [+0.100, +0.150]``; the mean alone when
    the CI is missing or not finite; ``n/a`` when there is none."""
    if not d:
        return "n/a"
    ci = d.get("ci") or [None, None]
    if ci[0] is None or ci[1] is None or not all(np.isfinite(ci)):
        return f"{d['mean']:+.3f}"
    return f"{d['mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def not_part(what: str) -> Para:
    """The note for a part the study file did not ask for (``what``: "Erasure curves are")."""
    return Para(f"{what} not part of this study.", "note")


def _kv_map(r: StudyResult) -> list[int] | None:
    """The query -> key/value head map when heads are grouped (GQA/MQA), else None."""
    c = r.contract or {}
    kv, n_heads, n_kv = c.get("kv_head_of_query"), c.get("n_heads"), c.get("n_kv_heads")
    return list(kv) if kv and n_heads and n_kv and n_kv < n_heads else None


def verdict_section(r: StudyResult, w: Writer | None = None) -> Section:
    """The verdict: its answer and headline, the numbers it rests on, the best and worst units (with
    every unit's rule tests as CSV where ``w`` writes files) and the notes beside it."""
    v = r.verdict.data if r.verdict is not None else {}
    blocks = [Para(str(v.get("answer", "?")), "answer"), Para(str(v.get("headline", "")), "lead"),
              KeyValues(_verdict_numbers(r, v))]
    rows = []
    for key, title in (("best_layers", "best layer-level"), ("worst_layers", "worst layer-level"),
                       ("best_heads", "best heads"), ("worst_heads", "worst heads")):
        for unit in v.get(key) or []:
            ci = unit.get("ci") or [np.nan, np.nan]
            rows.append({"group": title, "unit": unit.get("unit"), "mean": unit.get("mean"), "ci_low": ci[0],
                         "ci_high": ci[1], "p_family": unit.get("p_family"), "tracks": bool(unit.get("tracks"))})
    if rows:
        blocks.append(Table(pd.DataFrame(rows), caption="best and worst units against the verdict reference "
                                                        "(p_family: rule 1's permutation p-value, family-wise)"))
    if w is not None and r.paired is not None and len(r.paired):
        columns = [c for c in ("family", "unit", "n", "mean", "ci_low", "ci_high", "chance_mean", "chance_high",
                               "p_chance", "p_family", "permutations", "p_mc_se", "near_alpha", "null", "above_chance",
                               "diff_vs_gradient", "diff_ci_low", "diff_ci_high", "rule2", "n_needed", "wilcoxon_p",
                               "below_gradient", "reliable", "tracks", "undecided") if c in r.paired.columns]
        csv = w.csv("verdict_units", r.paired[columns])
        blocks.append(Para(f"Every attention unit's rule tests (raw and family-wise permutation p-values, the mean and "
                           f"95th percentile of its chance distribution, the paired test against the gradient bar, "
                           f"its checks): {csv}.", "note"))
    notes = _verdict_notes(v)
    if notes:
        blocks.append(Bullets(notes))
    blocks += [Para("The rule", "h3"), Para(str(v.get("rule", "")), "quote")]
    return Section("verdict", "Verdict", blocks)


def _verdict_numbers(r: StudyResult, v: dict) -> list[tuple[str, str]]:
    """The verdict's numbers as key-value rows: the reference and measure, the units that track, each
    family's answer, the reference's effects, chance, the random ranking, the gradient bar, the ceiling
    and the baselines."""
    layer_units, head_units = v.get("layer_units") or {}, v.get("head_units") or {}
    level = v.get("level", 0.95)
    sign = v.get("reference_sign")
    numbers = [
        ("verdict reference", str(v.get("reference", r.reference)) + (f" ({sign})" if sign else "")),
        ("measure", f"{v.get('measure', r.measure)} (alpha {v.get('alpha', '?')}, {100 * float(level):.0f}% bootstrap "
                    f"CIs, {v.get('bootstrap', '?')} resamples)"
                    + (f"; {v['measure_why']}" if v.get("measure_why") and v.get("measure_requested") == "auto" else "")),
    ]
    if v.get("n"):
        numbers.append(("scored examples (n)", str(v["n"]) + (f"; about {v['n_needed']} would decide rule 2"
                                                              if v.get("n_needed") else "")))
    if v.get("undecidable"):
        numbers.append(("why undecidable", str(v["undecidable"])))
    numbers += [
        ("layer-level units that track", f"{layer_units.get('tracking', 0)} of {layer_units.get('total', 0)}"
                                         + (f" ({v['headline_family']})" if v.get("headline_family") else "")),
        ("single heads that track", f"{head_units.get('tracking', 0)} of {head_units.get('total', 0)}"),
    ]
    numbers += _family_numbers(v)
    noise = v.get("reference_profile") or {}
    if noise:
        numbers.append(("reference's effects", _profile_text(noise)))
    if v.get("chance_test"):
        numbers.append(("rule 1 (above chance)", str(v["chance_test"])))
    numbers += [
        ("random ranking (mean [CI]; one draw, shown, not deciding)", stat_text(v.get("random"))),
        ("best gradient", (f"{v['best_gradient']['explainer']}: {stat_text(v['best_gradient'])}" if v.get("best_gradient")
                           else "no gradient explainer in the study (rule 2 not applied)")),
        ("ceiling", (f"{' vs '.join(v['ceiling']['pair'])}: {stat_text(v['ceiling'])}" if v.get("ceiling")
                     else "no ceiling pair in the study")),
    ]
    if (v.get("gradient_bar") or {}).get("text"):
        numbers.append(("gradient bar", v["gradient_bar"]["text"]))
    for name, stat in (v.get("baselines") or {}).items():
        if name != "random":
            numbers.append((f"{name} baseline", stat_text(stat)))
    return numbers


def _family_numbers(v: dict) -> list[tuple[str, str]]:
    """One row per verdict family: its methods, answer and units that track."""
    numbers = []
    for name, info in (v.get("families") or {}).items():
        lu, hu = ({"tracking": 0, "total": 0, **(info.get(key) or {})} for key in ("layer_units", "head_units"))
        numbers.append((f"{name} ({', '.join(info.get('methods') or [])})",
                        f"{str(info.get('answer', '?')).upper()}: {passing_units(lu, hu, short=True)}"
                        + (f"; {info['why']}" if info.get("why") else "")))
    return numbers


def _profile_text(noise: dict) -> str:
    """The verdict reference's effects: the largest, the noise and effect floors, the concentration."""
    return (f"largest |effect| {noise.get('max_abs', float('nan')):.2g}, noise floor "
            f"{noise.get('noise_floor', float('nan')):.1e} ({noise.get('at_floor', 0)} of "
            f"{noise.get('examples', 0)} examples at it), effect floor "
            f"{noise.get('effect_floor', 0.0):.2g} "
            f"({noise.get('below_effect_floor', 0)} examples below it: no token matters there)"
            + (f"; {100 * noise['top2_share']:.0f}% of |effect| on each example's top two tokens"
               if noise.get("top2_share") is not None else ""))


def _verdict_notes(v: dict) -> list[str]:
    """The notes beside the verdict: failed checks (methods and units), warnings, units above the
    ceiling, identical rankings and best units computed on fewer examples."""
    notes = []
    for method, checks in (v.get("unreliable") or {}).items():
        notes.append(f"{method} failed its sanity checks ({', '.join(checks)}): its units never track, and it is "
                     "neither the gradient bar nor part of a ceiling.")
    failed_units = list(v.get("unreliable_units") or {})
    if failed_units:
        notes.append(f"{len(failed_units)} unit(s) failed their own randomisation check (their ranking stayed once the "
                     f"weights they are computed from were re-initialised) and never track: "
                     f"{', '.join(failed_units[:10])}"
                     + (f" and {len(failed_units) - 10} more" if len(failed_units) > 10 else "") + ".")
    for warning in v.get("warnings") or []:
        notes.append(f"warning: {warning}.")
    for unit in v.get("above_ceiling") or []:
        notes.append(f"{unit['unit']} ({unit['mean']:+.3f}) is above the ceiling: the references agree with each "
                     "other less than this explainer agrees with the verdict reference.")
    for group in v.get("redundant") or []:
        notes.append(f"identical rankings on this model: {group['description']}.")
    for key in ("best_layers", "best_heads"):
        for unit in v.get(key) or []:
            if unit.get("fewer_examples"):
                notes.append(f"{unit['unit']} is computed on fewer examples than the others "
                             f"({unit['fewer_examples']}).")
    return notes


def agreement_section(r: StudyResult, w: Writer) -> Section:
    measure = r.measure
    by_layer = an.agreement_by_layer(r)
    csv = w.csv("agreement_by_layer", by_layer)
    base = an.baselines_and_ceilings(r)
    csv_base = w.csv("baselines_and_ceiling", base)
    mlabel = measure_label(measure)
    blocks = [Para(f"Mean {mlabel} over examples between each explainer's token ranking and each reference's, "
                   f"with {100 * r.spec.statistics.level:.0f}% bootstrap CIs. Agreement is computed "
                   "on scored tokens only.")]
    if not r.complete:
        blocks.append(Para("Single heads show means only until the run completes; token- and layer-level units "
                           "have CIs from the finished batches.", "note"))
    blocks += _agreement_figures(r, w)
    wide = an.agreement_wide(r)
    if len(wide):
        blocks.append(Table(wide, caption=f"mean {mlabel} [CI] by explainer and layer against each reference "
                                          "(tracks: passes the verdict rule)", csv=csv, max_rows=400))
    if len(base):
        shown = base[base["measure"] == measure].drop(columns=["measure"])
        blocks.append(Table(shown, caption=f"baselines and ceiling ({mlabel})", csv=csv_base))
    blocks += _published_blocks(r, w)
    blocks += _left_out_blocks(r, w)
    return Section("agreement", "Agreement with the references", blocks)


def _agreement_figures(r: StudyResult, w: Writer) -> list:
    """A layer x head heatmap per per-head explainer, the per-layer lines and the per-example
    distribution against the verdict reference."""
    blocks = []
    ref, measure = r.reference, r.measure
    mlabel = measure_label(measure)
    for explainer in an.per_head_explainers(r):
        grids = {ref_: g for ref_ in r.references if (g := an.head_grid(r, explainer, ref_)) is not None}
        if grids:
            png = fg.heatmap_grid(grids, f"{explainer}: mean {mlabel} per layer x head", measure, _kv_map(r))
            blocks.append(w.figure(f"heads_{explainer}", png,
                                   f"{explainer}, every layer x head: mean {mlabel} with each reference "
                                   "(red: agrees, blue: ranks the other way)"
                                   + ("; each panel has its own colour scale, centred on 0 (its colour bar): "
                                      "compare colours within a panel, and across panels by the numbers"
                                      if len(grids) > 1 else "")
                                   + ("; black lines separate query heads sharing a key/value head."
                                      if fg.kv_lines_drawn(_kv_map(r), next(iter(grids.values())).shape[1]) else ".")))
    lines = {ref_: an.layer_lines(r, ref_) for ref_ in r.references}
    lines = {k: v for k, v in lines.items() if v}
    if lines:
        bands = {ref_: an.reference_bands(r, ref_) for ref_ in lines}
        grads = {ref_: an.best_gradient(r, ref_) for ref_ in lines}
        notes = an.layer_line_notes(r)
        drawn = bands_caption(list(bands.values()), gradient=any(g is not None for g in grads.values()))
        blocks.append(w.figure("layers", fg.layer_lines(lines, bands, grads, measure, notes),
                               f"Per-layer explainers: mean {mlabel} per layer with its CI, against each reference"
                               + (f", beside {drawn}." if drawn else ".")
                               + (" Units that rank tokens identically on >= 95% of the examples are named in the "
                                  "legend as one ranking: their points are one measurement, not several."
                                  if notes else "")))
    units = an.distribution_units(r)
    if units:
        ref_bands = an.reference_bands(r, ref)
        drawn = bands_caption([ref_bands])
        blocks.append(w.figure("distribution", fg.distribution(units, ref_bands, ref, measure),
                               f"Per-example {mlabel} with {ref} (the verdict reference): a box per explainer unit "
                               "(per-layer methods at their best layer, per-head ones at their best head: chosen "
                               "after looking, so optimistic; box: quartiles and median, whiskers: 1.5 times the "
                               "interquartile range, dots: the examples), its mean and CI (black diamond)"
                               + (f", and {drawn} as horizontal lines and bands" if drawn else "")
                               + (". A unit marked [n] ranks tokens as the units named under the axis do: one "
                                  "measurement, not several." if any(u.get("same_as") for u in units) else ".")))
    return blocks


def _published_blocks(r: StudyResult, w: Writer) -> list:
    """The paper's numbers (the study's ``metrics.published``) beside ours."""
    published = r.spec.metrics.published
    if not published or r.summary is None:
        return []
    rows = []
    for item in published:
        layer = -1 if item.layer is None else item.layer
        ours = r.summary[(r.summary.explainer == item.explainer) & (r.summary.reference == item.reference)
                         & (r.summary.layer == layer) & (r.summary["head"] == -1)
                         & (r.summary.measure == item.measure) & (r.summary.role == "explainer")]
        rows.append({"explainer": item.explainer, "reference": item.reference,
                     "layer": "" if layer < 0 else layer, "measure": item.measure,
                     "paper": item.value,
                     "ours (mean [CI])": (f"{ours['mean'].iloc[0]:+.3f} [{ours.ci_low.iloc[0]:+.3f}, "
                                          f"{ours.ci_high.iloc[0]:+.3f}]") if len(ours) else "not computed",
                     "n": int(ours.n.iloc[0]) if len(ours) else 0, "source": item.source})
    frame = pd.DataFrame(rows)
    return [Table(frame, caption="the paper's numbers beside ours (their model and data differ: context, "
                                 "not a target)", csv=w.csv("published", frame))]


def _left_out_blocks(r: StudyResult, w: Writer) -> list:
    """The examples left out of each unit's n, and why (or a note that none was)."""
    s = r.summary
    if s is None or "left_out" not in s.columns:
        return []
    left = s[(s.left_out > 0) & (s.measure == r.measure)]
    if not len(left):
        return [Para(f"No example was left out: every unit's n is the {r.n_examples} examples.", "note")]
    left = left[["role", "explainer", "reference", "layer", "head", "n", "left_out", "left_out_reasons"]]
    return [Table(left.reset_index(drop=True), caption="examples left out of n, per unit, and why",
                  csv=w.csv("left_out", left), max_rows=200)]


def _sites_display(sites: pd.DataFrame) -> pd.DataFrame:
    names = {"site": "site", "n": "n", "max_attention_mean": "max attention (mean)",
             "perm_median_output_tvd_median": "perm. output TVD (median)",
             "perm_median_output_tvd_mean": "perm. output TVD (mean)",
             "perm_median_abs_target_change_mean": "perm. |target change| (mean)",
             "perm_median_attention_jsd_mean": "perm. attention JSD (mean)",
             "adv_max_attention_jsd_mean": "adv. max JSD (mean)", "adv_max_attention_jsd_median": "adv. max JSD "
                                                                                                  "(median)",
             "adv_feasible_frac_mean": "adv. feasible", "adv_bound": "adv. TVD bound"}
    return sites[[c for c in names if c in sites.columns]].rename(columns=names)


def counterfactual_section(r: StudyResult, w: Writer) -> Section:
    c = r.table("counterfactual")
    if c is None:
        return Section("counterfactual", "Counterfactual attention", [not_part("Counterfactual attention is")])
    sites = an.counterfactual_sites(r)
    csv = w.csv("counterfactual", sites)
    blocks = [Para("Permuted attention: the target query's attention weights at a site are shuffled and the "
                   "output distribution compared (total variation distance, TVD). Where attention is peaked "
                   "(high maximum) yet permuting it barely moves the output, the weights are not what the "
                   "prediction depends on."),
              w.figure("permutation", fg.permutation_scatter(c),
                       "Maximum attention vs median output TVD over the permutations, one point per example "
                       "and site (as Jain & Wallace plot it).")]
    if "adv_max_attention_jsd" in c.columns:
        blocks.append(w.figure("adversarial", fg.adversarial_histogram(c),
                               "Adversarial attention: the largest Jensen-Shannon divergence from the original "
                               "attention found while the output stays within the bound; ln 2 is the largest "
                               "possible. Near ln 2: very different attention, same prediction."))
    else:
        blocks.append(Para("Adversarial attention is not part of this study.", "note"))
    blocks.append(Table(_sites_display(sites), caption="per site (a layer, or a single head)", csv=csv))
    return Section("counterfactual", "Counterfactual attention", blocks)


def heads_section(r: StudyResult, w: Writer) -> Section:
    table = an.head_table(r)
    if r.table("heads") is None and not len(table):
        return Section("heads", "Heads", [not_part("Head ablation is")])
    blocks = []
    if r.table("heads") is None:
        blocks.append(not_part("Head ablation is"))
    if len(table):
        csv = w.csv("heads", table)
        n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
        maps, labels = {}, {}
        for col, title, label in (("mean_abs_ablation_change", "mean |change| when the head is ablated",
                                   "mean |change of the target|"),
                                  ("mean_importance", "mean head importance (Michel et al.)", "mean importance"),
                                  ("top3_attention", f"attention on {r.reference}'s top-3 tokens",
                                   "attention weight on the top-3 tokens (sum)")):
            if col in table.columns and table[col].notna().any():
                grid = np.full((n_layers, n_heads), np.nan)
                grid[table["layer"].to_numpy(), table["head"].to_numpy()] = table[col].to_numpy(dtype=float)
                maps[title], labels[title] = grid, label
        if maps:
            kv = _kv_map(r)
            blocks.append(w.figure("heads", fg.head_maps(maps, kv, labels),
                                   "Per layer x head: " + "; ".join(maps)
                                   + (", each on its own colour scale (its colour bar)." if len(maps) > 1 else ".")
                                   + (" Attention on the top-3 tokens is the weight the head puts on the verdict "
                                      "reference's three most important tokens, summed per example and averaged."
                                      if "top3_attention" in table.columns and table["top3_attention"].notna().any()
                                      else "")
                                   + (" Black lines separate query heads that share a key/value head."
                                      if fg.kv_lines_drawn(kv, n_heads) else "")))
        if "top3_attention" not in table.columns:
            blocks.append(Para("Attention on the reference's top-3 tokens needs the per-head `attention` explainer, "
                               "which is not part of this study.", "note"))
        if {"mean_abs_ablation_change", "top3_attention"} <= set(table.columns):
            both = table[["mean_abs_ablation_change", "top3_attention"]].dropna()
            if len(both) >= 3:
                rho = both.rank().corr().iloc[0, 1]
                blocks.append(Para(f"Across heads, Spearman correlation between ablation effect and attention on "
                                   f"the reference's top-3 tokens: {rho:+.3f} ({len(both)} heads)."))
        key = next(c for c in ("mean_abs_ablation_change", "mean_importance", "top3_attention") if c in table.columns)
        blocks.append(Table(table.sort_values(key, ascending=False, kind="stable"),
                            caption=f"per head, largest {key.replace('_', ' ')} first", csv=csv, max_rows=30))
    return Section("heads", "Heads", blocks)


def heads_causal_section(r: StudyResult, w: Writer) -> Section | None:
    """The per-head causal test beside the verdict (:mod:`probe.study.heads_causal`): per head, where
    it looks against what matters through its own edges; None where the study did not ask for it."""
    v = r.verdict.data if r.verdict is not None else {}
    record = v.get("heads_causal")
    if not record:
        return None
    counts = record.get("counts") or {}
    blocks = [Para(str(record.get("headline", "")), "lead")]
    blocks.append(KeyValues([
        ("units", "each head's attention row from the target query (the attention explainer's) against the knockout "
                  "effect of that head's own edges (the edge to each token blocked in that head of that layer "
                  f"alone; {'|effect|' if record.get('absolute') else 'signed'}, "
                  f"{'the row renormalised' if record.get('renormalise') else 'the blocked weight zeroed'})"),
        ("measure", f"{record.get('measure')} (the verdict's; alpha {record.get('alpha')}, "
                    f"{100 * float(record.get('level', 0.95)):.0f}% bootstrap CIs)"),
        ("above chance", str(record.get("chance_test", ""))),
        ("heads", f"{counts.get('matters', 0)} of {counts.get('total', 0)}: where the head looks is what matters "
                  f"through it; {counts.get('does_not_matter', 0)}: it is not; {counts.get('undecidable', 0)}: "
                  "cannot be decided"),
        ("token-level verdict", str(record.get("token_level_answer") or v.get("answer", "?"))),
        *([("AtP screen", str(record["screen"].get("words", "")))] if record.get("screen") else []),
    ]))
    table = r.heads_causal
    if table is not None and len(table):
        from probe.study.heads_causal import ANSWER_WORDS

        shown = table.sort_values(["mean", "layer", "head"], ascending=[False, True, True], kind="stable",
                                  na_position="last")
        display = pd.DataFrame({
            "head": shown["unit"], "n": shown["n"],
            "mean [CI]": [stat_text({"mean": m, "ci": [lo, hi]}) if np.isfinite(m) else "n/a"
                          for m, lo, hi in zip(shown["mean"], shown["ci_low"], shown["ci_high"])],
            "chance (mean / 95th pct)": [f"{m:+.3f} / {h:+.3f}" if np.isfinite(m) and np.isfinite(h) else "n/a"
                                         for m, h in zip(shown["chance_mean"], shown["chance_high"])],
            "p_family": shown["p_family"],
            "answer": [ANSWER_WORDS.get(a, a) + (f" ({why})" if why and a != "matters" else "")
                       for a, why in zip(shown["answer"], shown["why"])]})
        csv = w.csv("heads_causal", table)
        blocks.append(Table(display, caption="per head, highest mean agreement first: is where this head looks what "
                                             "matters through this head?", csv=csv, max_rows=40))
    blocks += [Para("The rule", "h3"), Para(str(record.get("rule", "")), "quote")]
    return Section("heads-causal", "Per-head causal test", blocks)


def tokens_section(r: StudyResult) -> Section:
    unit, examples = token_examples(r)
    if not examples:
        return Section("tokens", "Example token views", [Para("No attention unit with per-example agreement and "
                                                              "stored scores to show.", "note")])
    blocks = [Para(f"The examples where {unit['unit']} (the best layer-level attention unit against "
                   f"{r.reference}, mean {unit['mean']:+.3f}) agrees most and least with the reference, each "
                   "shown as that unit's scores, a gradient explainer's and the reference's."),
              TokenView(examples, r.measure, unit["unit"])]
    return Section("tokens", "Example token views", blocks)


def limitations_section(r: StudyResult) -> Section:
    ex = r.table("examples")
    median = float(ex["n_scored"].median()) if ex is not None and "n_scored" in ex else float("nan")
    items = [
        f"Agreement with {r.reference} is agreement with one intervention: a method that ranks tokens as "
        "leave-one-out does is faithful to that intervention, not faithful in every sense (other perturbations, "
        "other targets and other notions of importance can disagree).",
        "Leave-one-out removes one token at a time: it misses interactions and redundancy (two tokens that each "
        "suffice look unimportant alone), so a low agreement can be the reference's blind spot.",
        "Attention here is one layer's or one head's weights at the target query; it is not the value-weighted "
        "contribution of a token to the output (attn_norm and rollout/flow approximate that, each in its own way), "
        "and later layers mix tokens again.",
        f"Rank correlation over few tokens is noisy (median {median:.0f} scored tokens per example here): single "
        "examples say little, means over examples with their CIs say more.",
        f"The verdict rule's thresholds are conventions: {100 * r.spec.statistics.level:.0f}% CIs, "
        f"alpha {r.spec.statistics.alpha} family-wise for the test against chance, uncorrected paired tests "
        "against the best gradient as the bar; other "
        "choices move units across the line.",
        f"The results are for this model ({r.model_id}), this data, this target and this tokenisation only.",
    ]
    if not r.complete:
        items.append("This report covers the finished batches only; numbers will change as the run completes.")
    return Section("limitations", "Limitations", [Para("What this study can and cannot show:"), Bullets(items)])
