"""The numbers a report shows, computed from a :class:`~probe.report.results.StudyResult` with
pandas/numpy (group-bys, never a Python loop over table rows)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from probe.metrics.statistics import bootstrap_ci
from probe.names import describe_group, unit_name
from probe.names import method_family as family
from probe.plots import Band
from probe.report.lines import (
    finite_or_none,
    ordered_explainers,
    select_rows,
    summary_bands,
    summary_best_gradient,
    summary_layer_lines,
)
from probe.report.results import StudyResult


def redundant_units(r: StudyResult) -> dict[str, list[str]]:
    """Unit name -> the units of its group (the verdict's ``redundant``: identical rankings on
    >= 95% of the examples), for units in a group of two or more; {} when none or no verdict."""
    out: dict[str, list[str]] = {}
    for group in (r.verdict.data.get("redundant") if r.verdict is not None else None) or []:
        units = [str(u) for u in group.get("units") or []]
        for unit in units:
            out[unit] = units
    return out


# --------------------------------------------------------------------------- agreement


def summary_rows(r: StudyResult, *, role: str | None = None, reference: str | None = None,
                 measure: str | None = None) -> pd.DataFrame:
    return select_rows(r.summary, role=role, reference=reference, measure=measure)


def agreement_by_layer(r: StudyResult) -> pd.DataFrame:
    """Explainers' token- and layer-level units against every reference, every measure (CSV)."""
    s = summary_rows(r, role="explainer")
    s = s[s["head"] < 0]
    cols = ["explainer", "layer", "reference", "measure", "n", "mean", "std", "ci_low", "ci_high", "sig_frac",
            "sig_pos_frac"]
    out = s.reindex(columns=cols)
    order = {name: i for i, name in enumerate(ordered_explainers(out["explainer"]))}
    refs = {name: i for i, name in enumerate(r.references)}
    out = out.assign(_e=out["explainer"].map(order), _r=out["reference"].map(refs).fillna(99))
    out = out.sort_values(["measure", "_r", "_e", "layer"]).drop(columns=["_e", "_r"])
    if r.paired is not None and len(r.paired):
        keep = [c for c in ("explainer", "layer", "p_family", "tracks") if c in r.paired.columns]
        tracks = r.paired[r.paired["head"] < 0][keep]
        tracks = tracks.assign(reference=r.reference, measure=r.measure)
        out = out.merge(tracks, on=["explainer", "layer", "reference", "measure"], how="left")
    groups = redundant_units(r)
    if groups:
        names = [unit_name(e, int(l_), -1) for e, l_ in zip(out["explainer"], out["layer"])]
        out["same_ranking_as"] = [describe_group(groups[n]) if n in groups else "" for n in names]
    return out.reset_index(drop=True)


def agreement_wide(r: StudyResult) -> pd.DataFrame:
    """Rows: explainer (at a layer); columns: the study's measure against each reference, mean [CI]."""
    s = agreement_by_layer(r)
    s = s[s["measure"] == r.measure]
    if not len(s):
        return pd.DataFrame()
    s = s.assign(unit=[unit_name(e, int(l_), -1) for e, l_ in zip(s["explainer"], s["layer"])],
                 cell=[mean_ci(m, lo, hi) for m, lo, hi in zip(s["mean"], s["ci_low"], s["ci_high"])])
    # a redundant group is one row: its first unit's numbers, named by the whole group
    groups = redundant_units(r)
    if groups:
        s = s[[u not in groups or groups[u][0] == u for u in s["unit"]]]
        s = s.assign(unit=[f"{describe_group(groups[u])} (one ranking)" if u in groups else u for u in s["unit"]])
    units = list(dict.fromkeys(s["unit"]))
    refs = [ref for ref in r.references if ref in set(s["reference"])]
    wide = s.pivot_table(index="unit", columns="reference", values="cell", aggfunc="first").reindex(index=units,
                                                                                                    columns=refs)
    wide = wide.fillna("")
    wide.columns = [f"vs {ref}" + (" (verdict)" if ref == r.reference else "") for ref in refs]
    if "tracks" in s.columns:
        t = s[s["reference"] == r.reference].set_index("unit")["tracks"].dropna()
        wide["tracks"] = [("yes" if bool(t[u]) else "no") if u in t.index else "" for u in units]
    n = s.groupby("unit", sort=False)["n"].max()
    wide.insert(0, "n", n.reindex(units).astype(int).to_numpy())
    wide.index.name = "explainer"
    return wide.reset_index()


def baselines_and_ceilings(r: StudyResult) -> pd.DataFrame:
    s = r.summary
    if s is None or not len(s):
        return pd.DataFrame()
    s = s[s["role"].isin(["baseline", "ceiling"])]
    cols = ["role", "explainer", "reference", "measure", "n", "mean", "std", "ci_low", "ci_high", "sig_frac"]
    return s.reindex(columns=cols).sort_values(["measure", "role", "reference", "explainer"]).reset_index(drop=True)


def mean_ci(mean: float | None, low: float | None, high: float | None) -> str:
    if mean is None or not np.isfinite(mean):
        return ""
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return f"{mean:+.3f}"
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def head_grid(r: StudyResult, explainer: str, reference: str) -> np.ndarray | None:
    """``[layer, head]`` mean of the study's measure for a per-head explainer against a reference."""
    s = summary_rows(r, role="explainer", reference=reference, measure=r.measure)
    s = s[(s["explainer"] == explainer) & (s["head"] >= 0)]
    if not len(s):
        return None
    grid = np.full((int(s["layer"].max()) + 1, int(s["head"].max()) + 1), np.nan)
    grid[s["layer"].to_numpy(), s["head"].to_numpy()] = s["mean"].to_numpy()
    return grid


def per_head_explainers(r: StudyResult) -> list[str]:
    s = summary_rows(r, role="explainer")
    return ordered_explainers(s.loc[s["head"] >= 0, "explainer"])


def per_layer_explainers(r: StudyResult) -> list[str]:
    s = summary_rows(r, role="explainer")
    return ordered_explainers(s.loc[(s["head"] < 0) & (s["layer"] >= 0), "explainer"])


def reference_bands(r: StudyResult, reference: str) -> dict[str, Band]:
    """Random, uniform and position baselines and the ceiling, against ``reference`` (study measure)."""
    return summary_bands(r.summary, reference, r.measure)


def distribution_units(r: StudyResult) -> list[dict]:
    """One unit per explainer for the distribution plot, against the verdict reference: token-level
    methods as they are, per-layer methods at their best layer, per-head methods at their best head.
    ``same_as``: the units that rank tokens as this one does (the verdict's redundant groups), or None."""
    ref, measure = r.reference, r.measure
    s = summary_rows(r, role="explainer", reference=ref, measure=measure)
    a = r.table("agreement")
    if not len(s) or a is None:
        return []
    a = a[(a["role"] == "explainer") & (a["reference"] == ref)]
    units = []
    for explainer in ordered_explainers(s["explainer"]):
        rows = s[s["explainer"] == explainer]
        kind = "token"
        if (rows["head"] < 0).any():
            rows = rows[rows["head"] < 0]
            kind = "layer" if (rows["layer"] >= 0).any() else "token"
        else:
            kind = "head"
        best = rows.sort_values("mean", ascending=False).iloc[0]
        layer, head = int(best["layer"]), int(best["head"])
        sel = a[(a["explainer"] == explainer) & (a["layer"] == layer) & (a["head"] == head)][measure]
        values = sel.to_numpy(dtype=float)
        name = unit_name(explainer, layer, head)
        label = name + (f" (best {kind})" if kind != "token" else "")
        mates = [u for u in redundant_units(r).get(name, []) if u != name]
        units.append({"label": label, "unit": name, "same_as": describe_group(mates) if mates else None,
                      "explainer": explainer, "family": family(explainer), "values": values[np.isfinite(values)],
                      "mean": float(best["mean"]), "ci": (finite_or_none(best["ci_low"]), finite_or_none(best["ci_high"]))})
    return units


def layer_line_notes(r: StudyResult) -> dict[str, str]:
    """Per-layer explainer -> a legend note naming its layers that rank tokens identically (to each
    other or to another unit), e.g. ``flow: L0-L4 one ranking``."""
    notes: dict[str, list[str]] = {}
    seen = set()
    for group in redundant_units(r).values():
        key = tuple(group)
        if key in seen:
            continue
        seen.add(key)
        methods = list(dict.fromkeys(u.partition(" L")[0] for u in group))
        text = describe_group(group)
        for explainer in methods:
            own = text.removeprefix(f"{explainer} ") if len(methods) == 1 else text
            notes.setdefault(explainer, []).append(f"{own}: one ranking")
    return {e: "; ".join(v) for e, v in notes.items()}


def layer_lines(r: StudyResult, reference: str) -> dict[str, pd.DataFrame]:
    """Per-layer explainers: layer, mean, ci_low, ci_high against ``reference`` (study measure)."""
    return summary_layer_lines(r.summary, reference, r.measure)


def best_gradient(r: StudyResult, reference: str) -> dict | None:
    """The gradient explainer with the highest mean agreement with ``reference`` (token level) among
    those that passed their sanity checks (the verdict's bar; before a verdict, all of them)."""
    return summary_best_gradient(r.summary, reference, r.measure, unreliable_methods(r))


def unreliable_methods(r: StudyResult) -> tuple[str, ...]:
    """The methods the verdict marks unreliable (a failed sanity check); () before a verdict."""
    return tuple((r.verdict.data.get("unreliable") or {}) if r.verdict is not None else ())


# --------------------------------------------------------------------------- erasure


def erasure_curves(r: StudyResult) -> pd.DataFrame:
    e = r.table("erasure")
    if e is None:
        return pd.DataFrame()
    g = e.groupby(["ranking", "bin"], sort=True)
    out = pd.DataFrame({"n": g["comprehensiveness"].count(),
                        "comprehensiveness": g["comprehensiveness"].mean(),
                        "comprehensiveness_sem": g["comprehensiveness"].sem(),
                        "sufficiency": g["sufficiency"].mean(),
                        "sufficiency_sem": g["sufficiency"].sem()}).reset_index()
    out.insert(2, "percent", out["bin"] * 100)
    return out


def erasure_aopc(r: StudyResult) -> pd.DataFrame:
    """AOPC (comprehensiveness and sufficiency) per ranking with bootstrap CIs, and decision flips."""
    e = r.table("erasure")
    if e is None:
        return pd.DataFrame()
    st = r.spec.statistics
    kw = {"n_boot": st.bootstrap, "level": st.level, "seed": st.seed}
    per_example = e.drop_duplicates(["example", "ranking"])
    rows = []
    for ranking, frame in per_example.groupby("ranking", sort=False):  # a handful of rankings
        row = {"ranking": ranking, "n": int(frame["aopc"].notna().sum())}
        for col in ("aopc", "aopc_sufficiency"):
            v = frame[col].to_numpy(dtype=float)
            low, high = bootstrap_ci(v, **kw)
            row.update({col: float(np.nanmean(v)) if np.isfinite(v).any() else np.nan,
                        f"{col}_ci_low": low, f"{col}_ci_high": high})
        flips = frame["flip"].to_numpy(dtype=float) if "flip" in frame else np.array([])
        row["flipped_frac"] = float(np.isfinite(flips).mean()) if flips.size else np.nan
        row["flip_removed_frac"] = float(np.nanmean(flips)) if np.isfinite(flips).any() else np.nan
        rows.append(row)
    out = pd.DataFrame(rows)
    order = sorted(out["ranking"], key=lambda name: (name == "random", list(out["ranking"]).index(name)))
    return out.set_index("ranking").loc[order].reset_index()


# --------------------------------------------------------------------------- counterfactual


def counterfactual_sites(r: StudyResult) -> pd.DataFrame:
    c = r.table("counterfactual")
    if c is None:
        return pd.DataFrame()
    g = c.groupby(["layer", "head"], sort=True)
    out = pd.DataFrame({"n": g["example"].count(), "max_attention_mean": g["max_attention"].mean(),
                        "perm_median_output_tvd_median": g["perm_median_output_tvd"].median(),
                        "perm_median_output_tvd_mean": g["perm_median_output_tvd"].mean(),
                        "perm_median_abs_target_change_mean": g["perm_median_abs_target_change"].mean(),
                        "perm_max_output_tvd_mean": g["perm_max_output_tvd"].mean(),
                        "perm_median_attention_jsd_mean": g["perm_median_attention_jsd"].mean()})
    if "adv_max_attention_jsd" in c.columns:
        out["adv_max_attention_jsd_mean"] = g["adv_max_attention_jsd"].mean()
        out["adv_max_attention_jsd_median"] = g["adv_max_attention_jsd"].median()
        out["adv_feasible_frac_mean"] = g["adv_feasible_frac"].mean()
        out["adv_bound"] = g["adv_bound"].first()
    out = out.reset_index()
    out.insert(0, "site", [f"L{l_}" if h < 0 else f"L{l_}.H{h}" for l_, h in zip(out["layer"], out["head"])])
    return out


# --------------------------------------------------------------------------- heads


def reference_top_positions(r: StudyResult, k: int = 3, examples: Iterable[int] | None = None) -> pd.DataFrame | None:
    """``example, position`` of each example's top-k scored tokens under the verdict reference."""
    scores, tokens = r.table("scores"), r.table("tokens")
    if scores is None or tokens is None:
        return None
    ref = scores[scores["method"] == r.reference]
    if examples is not None:
        ref = ref[ref["example"].isin(examples)]
    if not len(ref):
        return None
    if (ref["layer"] >= 0).any():  # a per-layer reference: its last layer, head mean (as agreement does)
        ref = ref[ref["layer"] == ref["layer"].max()]
    ref = ref.groupby(["example", "position"], sort=False)["score"].mean().reset_index()
    scored = tokens.loc[tokens["scored"].astype(bool), ["example", "position"]]
    ref = ref.merge(scored, on=["example", "position"], how="inner")
    ref = ref[np.isfinite(ref["score"])]
    if r.reference in r.absolute:
        ref = ref.assign(score=ref["score"].abs())
    ref = ref.sort_values(["example", "score", "position"], ascending=[True, False, True], kind="stable")
    return ref.groupby("example", sort=True).head(k)[["example", "position"]]


def head_table(r: StudyResult) -> pd.DataFrame:
    """Per head: mean |ablation change|, mean change, mean importance, and the mean attention mass
    the head puts on the verdict reference's top-3 tokens."""
    h = r.table("heads")
    frames = []
    if h is not None:
        g = h.groupby(["layer", "head"], sort=True)
        cols = {"n": g["example"].count()}
        if "ablation_change" in h.columns:
            cols["mean_abs_ablation_change"] = h["ablation_change"].abs().groupby([h["layer"], h["head"]]).mean()
            cols["mean_ablation_change"] = g["ablation_change"].mean()
        if "importance" in h.columns:
            cols["mean_importance"] = g["importance"].mean()
        frames.append(pd.DataFrame(cols))
    mass = top3_attention(r)
    if mass is not None:
        frames.append(mass.to_frame())
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, axis=1).reset_index()
    return out.rename(columns={"level_0": "layer", "level_1": "head"})


def top3_attention(r: StudyResult) -> pd.Series | None:
    """Per (layer, head): the head's attention weight on the reference's top-3 tokens, summed per
    example and averaged over examples (from the ``attention`` method's scores)."""
    scores = r.table("scores")
    if scores is None:
        return None
    att = scores[scores["method"] == "attention"]
    if not len(att) or not (att["head"] >= 0).any():
        return None
    top = reference_top_positions(r, 3)
    if top is None:
        return None
    hit = att[["example", "layer", "head", "position", "score"]].merge(top, on=["example", "position"], how="inner")
    per_example = hit.groupby(["example", "layer", "head"], sort=False)["score"].sum()
    mass = per_example.groupby(level=["layer", "head"], sort=True).mean()
    mass.name = "top3_attention"
    return mass


# --------------------------------------------------------------------------- the best attention unit


def best_attention_unit(r: StudyResult) -> dict | None:
    """The layer-level attention unit with the highest mean agreement with the verdict reference
    (a single head when the study has no layer-level attention unit)."""
    if r.paired is not None and len(r.paired):
        p = r.paired
    else:
        s = summary_rows(r, role="explainer", reference=r.reference, measure=r.measure)
        p = s[[family(e) == "attention" for e in s["explainer"]]]
    if not len(p):
        return None
    layer_units = p[p["head"] < 0]
    pool = layer_units if len(layer_units) else p
    row = pool.sort_values("mean", ascending=False).iloc[0]
    layer, head = int(row["layer"]), int(row["head"])
    return {"explainer": str(row["explainer"]), "layer": layer, "head": head,
            "unit": unit_name(str(row["explainer"]), layer, head), "mean": float(row["mean"])}


# --------------------------------------------------------------------------- provenance of a partial run


def partial_provenance(r: StudyResult) -> dict:
    """What the done markers and the example parts say about a run that has not finished."""
    infos = r.batch_infos
    steps: dict[str, float] = {}
    for info in infos:
        for step, seconds in (info.get("timings") or {}).items():
            steps[step] = steps.get(step, 0.0) + float(seconds)
    n = max(r.n_examples, 1)
    ex = r.table("examples")
    lengths = ex["n_tokens"] if ex is not None and "n_tokens" in ex else pd.Series(dtype=float)
    out = {
        "examples": r.n_examples, "batches": len(infos),
        "wall_seconds": float(sum(float(i.get("wall_s", 0.0)) for i in infos)),
        "step_seconds": steps,
        "peak_memory_bytes": int(max((int(i.get("peak_memory_bytes", -1)) for i in infos), default=-1)),
        "forward_passes_per_example": float(sum(int(i.get("forward_calls", 0)) for i in infos) / n),
        "forward_rows_per_example": float(sum(int(i.get("forward_rows", 0)) for i in infos) / n),
        "devices_used": sorted({str(i.get("device")) for i in infos}),
    }
    if len(lengths):
        out["sequence_length"] = {"mean": float(lengths.mean()), "median": float(lengths.median()),
                                  "min": int(lengths.min()), "max": int(lengths.max())}
    return out


# --------------------------------------------------------------------------- IG completeness


def ig_convergence(r: StudyResult) -> pd.DataFrame:
    """Integrated gradients' completeness per number of Gauss-Legendre points tried (``convergence``
    table): examples tried, examples whose scores come from that try, median and largest
    |delta| / |f(x) - f(baseline)|. Empty when the study has no IG."""
    c = r.table("convergence")
    if c is None or not len(c):
        return pd.DataFrame()
    relative = c["delta"].abs() / c["gap"].abs().clip(lower=1e-12)
    c = c.assign(relative=relative)
    out = c.groupby("steps").agg(tried=("example", "nunique"), final=("final", "sum"),
                                 median_relative_delta=("relative", "median"),
                                 max_relative_delta=("relative", "max")).reset_index()
    return out.astype({"final": int})
