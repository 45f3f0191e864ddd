"""``probe report`` and ``probe compare``: a study's stored results as HTML, Markdown and CSV.

Rendered from the result folder alone: nothing here imports torch or transformers or loads a
model, so a report can be made anywhere the folder is copied to.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from probe.errors import InputError
from probe.report import analysis as an
from probe.report import figures as fg
from probe.report.document import (Bullets, Document, Figure, KeyValues, Para, Section, Table, TokenView, fmt, md_escape,
                                   render_html, render_markdown)
from probe.report.results import StudyResult, load_result


@dataclass
class ReportFiles:
    """What a report wrote: ``html`` (self-contained), ``markdown``, ``figures`` (PNG files next to
    the Markdown), ``tables`` (CSV), and the ids of the sections it holds, in order."""

    out_dir: Path
    html: Path
    markdown: Path
    figures: list[Path] = field(default_factory=list)
    tables: list[Path] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)
    partial: bool = False


# --------------------------------------------------------------------------- helpers


def _ci(d: dict | None) -> str:
    if not d:
        return "n/a"
    ci = d.get("ci") or [None, None]
    if ci[0] is None or ci[1] is None or not all(np.isfinite(ci)):
        return f"{d['mean']:+.3f}"
    return f"{d['mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _bytes(n) -> str:
    if n is None or n < 0:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _seconds(s) -> str:
    if s is None:
        return "n/a"
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min ({s:.0f} s)"


def _list(values) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _not_part(what: str) -> Para:
    return Para(f"{what} not part of this study.", "note")


class _Writer:
    """Collects figures and tables while sections are built."""

    def __init__(self, out: Path):
        self.out = out
        self.figures: dict[str, bytes] = {}
        self.tables: list[Path] = []

    def figure(self, name: str, png: bytes, caption: str) -> Figure:
        self.figures[name] = png
        return Figure(name=name, png=png, caption=caption)

    def csv(self, name: str, frame: pd.DataFrame) -> str:
        path = self.out / "tables" / f"{name}.csv"
        _atomic_text(path, frame.to_csv(index=False, float_format="%.6g"))
        self.tables.append(path)
        return f"tables/{name}.csv"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def _atomic_text(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_REPORT_ENTRIES = {"report.html", "report.md", "figures", "tables"}


def _prepare_out(out: Path, title: str) -> None:
    """Create ``out``, or accept it when it is empty or holds a report with this ``title`` (this
    study's report, written before); anything else is refused, so no other report or file is
    overwritten."""
    if out.exists() and not out.is_dir():
        raise InputError(f"the report folder {out} is a file; give a folder as --out")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if entries:
            first = ""
            if (out / "report.md").is_file():
                with open(out / "report.md", encoding="utf-8", errors="replace") as f:
                    first = f.readline().rstrip("\n")
            if not set(entries) <= _REPORT_ENTRIES or first != f"# {md_escape(title)}":
                what = (f"the report {first[2:]!r}" if first.startswith("# ") and set(entries) <= _REPORT_ENTRIES
                        else f"other files ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''})")
                raise InputError(f"the report folder {out} holds {what}; give an empty or new --out (or this "
                                 "study's own report folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot create the report folder {out}: {err.strerror}; give a writable --out") from err
    if not os.access(out, os.W_OK):
        raise InputError(f"the report folder {out} is not writable; give a writable --out")


# --------------------------------------------------------------------------- sections


def _verdict_section(r: StudyResult) -> Section:
    v = r.verdict or {}
    blocks = [Para(str(v.get("answer", "?")), "answer"), Para(str(v.get("headline", "")), "lead")]
    layer_units, head_units = v.get("layer_units") or {}, v.get("head_units") or {}
    level = v.get("level", 0.95)
    numbers = [
        ("verdict reference", str(v.get("reference", r.reference))),
        ("measure", f"{v.get('measure', r.measure)} (alpha {v.get('alpha', '?')}, {100 * float(level):.0f}% bootstrap "
                    f"CIs, {v.get('bootstrap', '?')} resamples)"),
        ("layer-level units that track", f"{layer_units.get('tracking', 0)} of {layer_units.get('total', 0)}"),
        ("single heads that track", f"{head_units.get('tracking', 0)} of {head_units.get('total', 0)}"),
        ("random ranking (mean [CI])", _ci(v.get("random"))),
        ("best gradient", (f"{v['best_gradient']['explainer']}: {_ci(v['best_gradient'])}" if v.get("best_gradient")
                           else "no gradient explainer in the study (rule 2 not applied)")),
        ("ceiling", (f"{' vs '.join(v['ceiling']['pair'])}: {_ci(v['ceiling'])}" if v.get("ceiling")
                     else "no ceiling pair in the study")),
    ]
    for name, stat in (v.get("baselines") or {}).items():
        if name != "random":
            numbers.append((f"{name} baseline", _ci(stat)))
    blocks.append(KeyValues(numbers))
    rows = []
    for key, title in (("best_layers", "best layer-level"), ("worst_layers", "worst layer-level"),
                       ("best_heads", "best heads"), ("worst_heads", "worst heads")):
        for unit in v.get(key) or []:
            ci = unit.get("ci") or [np.nan, np.nan]
            rows.append({"group": title, "unit": unit.get("unit"), "mean": unit.get("mean"), "ci_low": ci[0],
                         "ci_high": ci[1], "tracks": bool(unit.get("tracks"))})
    if rows:
        blocks.append(Table(pd.DataFrame(rows), caption="best and worst units against the verdict reference"))
    notes = []
    for method, checks in (v.get("unreliable") or {}).items():
        notes.append(f"{method} failed its sanity checks ({', '.join(checks)}): it is neither the best gradient "
                     "nor part of a ceiling.")
    for unit in v.get("above_ceiling") or []:
        notes.append(f"{unit['unit']} ({unit['mean']:+.3f}) is above the ceiling: the references agree with each "
                     "other less than this explainer agrees with the verdict reference.")
    for group in v.get("redundant") or []:
        notes.append(f"identical rankings on this model: {group['description']}.")
    for key in ("best_layers", "best_heads"):
        for unit in v.get(key) or []:
            if unit.get("fewer_examples"):
                notes.append(f"{unit['unit']} is computed on fewer examples than the others ({unit['fewer_examples']}).")
    if notes:
        blocks.append(Bullets(notes))
    blocks += [Para("The rule", "h3"), Para(str(v.get("rule", "")), "quote")]
    return Section("verdict", "Verdict", blocks)


def _sanity_blocks(r: StudyResult, w: _Writer) -> list:
    """The sanity checks (verdict.json's ``sanity``): a table, and the randomisation curves."""
    checks = (r.verdict or {}).get("sanity")
    if checks is None:
        return [Para("Sanity checks", "h3"), Para("This result has no sanity checks (run before they existed, or "
                                                  "not complete).", "note")]
    blocks = [Para("Sanity checks", "h3")]
    if not checks:
        return blocks + [Para("No explainer in this study has a check that applies.", "note")]
    frame = pd.DataFrame([{k: c.get(k) for k in ("method", "check", "status", "value", "detail")} for c in checks])
    blocks.append(Table(frame, caption="sanity checks of each method (fail: unreliable for this study; not run: why)",
                        csv=w.csv("sanity", frame)))
    curves = {c["method"]: c["curve"] for c in checks if c.get("check") == "randomisation" and c.get("curve")}
    if curves:
        blocks.append(w.figure("randomisation", fg.randomisation_curves(curves),
                               "Cascading model-parameter randomisation (Adebayo et al. 2018): each explainer's mean "
                               "Spearman with its trained-model scores as layers are re-initialised from the top. "
                               "One still at or above 0.5 (dashed) once the top half is random does not depend on "
                               "the model."))
    convergence = an.ig_convergence(r)
    if len(convergence):
        shown = convergence.assign(**{c: [f"{v:.1e}" for v in convergence[c]]
                                      for c in ("median_relative_delta", "max_relative_delta")})
        blocks.append(Table(shown, caption="integrated gradients' completeness by the number of Gauss-Legendre "
                                                 "points: examples tried, examples whose scores come from that try, "
                                                 "median and largest |delta| / |f(x) - f(baseline)|",
                            csv=w.csv("ig_convergence", convergence)))
        blocks.append(w.figure("ig_convergence", fg.convergence_curves(r.table("convergence")),
                               "Integrated gradients: the completeness delta relative to f(x) - f(baseline) against "
                               "the points used, per example (thin) and its median (black). With steps: auto each "
                               "example's line ends where it met the tolerance."))
    return blocks


def _contract_rows(contract: dict) -> list[tuple[str, str]]:
    rows = [("model type / task", f"{contract.get('model_type', '?')} / {contract.get('task', '?')}")]
    stacks = contract.get("stacks") or {}
    if not stacks:
        stacks = {"model": contract}
    for name, st in stacks.items():
        n_heads, n_kv = st.get("n_heads"), st.get("n_kv_heads")
        prefix = f"{name} stack: " if len(stacks) > 1 or name != "model" else ""
        kind = "MHA: one key/value head per query head" if n_heads == n_kv else (
            "MQA: one key/value head" if n_kv == 1 else "GQA: query heads share key/value heads")
        rows.append((f"{prefix}layers x query heads", f"{st.get('n_layers')} x {n_heads}"))
        rows.append((f"{prefix}key/value heads", f"{n_kv} ({kind})"))
        kv = st.get("kv_head_of_query")
        if kv and n_heads != n_kv:
            rows.append((f"{prefix}query -> kv head", ", ".join(f"q{h}->kv{g}" for h, g in enumerate(kv))))
        rows.append((f"{prefix}head dim", str(st.get("head_dim"))))
        rows.append((f"{prefix}mask kind", str(st.get("mask_kind"))))
        if st.get("module_class"):
            rows.append((f"{prefix}attention module", str(st.get("module_class"))))
    for key in ("implementation", "dtype", "device", "max_positions", "padding_side"):
        if key in contract:
            rows.append((key.replace("_", " "), str(contract[key])))
    return rows


def _random_weights_row(prov_model: dict, study_model: dict) -> str:
    """The set-up line on weights the checkpoint did not hold (left at random initialisation)."""
    names = prov_model.get("random_weights")
    allowed = prov_model.get("allow_random_weights", study_model.get("allow_random_weights", False))
    if names:
        return (f"{len(names)}, allowed explicitly (model.allow_random_weights: true); the explained model is "
                f"partly random: {', '.join(names)}")
    if names is None:
        return ("recorded in provenance.json when the run completes"
                + ("; model.allow_random_weights: true" if allowed else ""))
    return "none: every weight was loaded from the checkpoint"


def _setup_section(r: StudyResult, w: _Writer) -> Section:
    s = r.study
    blocks = []
    if s.get("description"):
        blocks.append(Para(" ".join(str(s["description"]).split())))
    contract = r.contract
    blocks.append(Para("Model and attention contract", "h3"))
    model = s.get("model") or {}
    model_rows = [("model", str(model.get("id", "?")))]
    prov = r.provenance or {}
    pm = prov.get("model") or {}
    if pm.get("path"):
        model_rows.append(("model path", str(pm["path"])))
    if pm.get("revision"):
        model_rows.append(("revision", str(pm["revision"])))
    model_rows.append(("weights sha256", str(pm.get("weights_sha256") or "n/a")))
    model_rows.append(("weights left random", _random_weights_row(pm, model)))
    if (contract or {}).get("pooling"):
        pooling = contract["pooling"]
        model_rows.append(("pooled embedding", f"{pooling.get('mode')} pooling"
                           f"{', normalised' if pooling.get('normalize') else ''} (from {pooling.get('source')})"))
    if contract:
        model_rows += _contract_rows(contract)
    else:
        model_rows += [("requested device / dtype", f"{model.get('device', '?')} / {model.get('dtype', '?')}"),
                       ("attention contract", "recorded in provenance.json when the run completes")]
    blocks.append(KeyValues(model_rows))

    blocks.append(Para("Study set-up", "h3"))
    ds = s.get("dataset") or {}
    target = s.get("target") or {}
    st = s.get("statistics") or {}
    metrics = s.get("metrics") or {}
    filters = {k: v for k, v in (ds.get("filters") or {}).items() if v is not None}
    target_text = f"{target.get('kind') or 'default'} of " + (
        f"the pooled embedding with that of {target['reference']!r} (cosine)" if target.get("reference") else
        f"the pooled embedding, dimension {target['dimension']}" if target.get("dimension") is not None else
        f"the preferred answer among {target['choices']}" if target.get("choices") else
        "the dataset label (gold)" if target.get("label") == "gold" else
        f"label {target['label']}" if target.get("label") is not None else
        f"the continuation {target['continuation']!r}" if target.get("continuation") else "the predicted class / greedy output")
    rows = [("study", str(s.get("name", "?"))),
            ("dataset", f"{ds.get('name', '?')} (split {ds.get('split', '?')}, text column {ds.get('text_column')}, "
                        f"label column {ds.get('label_column')})"),
            ("examples", f"{r.n_examples} reported" + (f" of n = {ds.get('n')}" if ds.get("n") is not None else "")
             + f", seed {ds.get('seed')}, max length {ds.get('max_length') or 'the model window'}"),
            ("filters", ", ".join(f"{k}={v}" for k, v in filters.items()) or "none"),
            ("target", target_text),
            ("explainers", _list(s.get("explainers"))),
            ("references", _list(s.get("references"))),
            ("verdict reference / measure", f"{r.reference} / {r.measure}"),
            ("agreement measures", _list(metrics.get("agreement"))),
            ("baselines", _list(metrics.get("baselines"))),
            ("statistics", f"bootstrap {st.get('bootstrap')}, level {st.get('level')}, alpha {st.get('alpha')}, "
                           f"seed {st.get('seed')}, special tokens scored: {st.get('include_special')}"),
            ("parts run", ", ".join(f"{k}: {'yes' if metrics.get(k) is not None else 'no'}"
                                    for k in ("erasure", "counterfactual", "heads")))]
    if target.get("prompt"):
        rows.insert(5, ("prompt template", str(target["prompt"])))
    if metrics.get("absolute"):
        rows.append(("compared by magnitude", _list(metrics["absolute"])))
    if s.get("params"):
        rows.append(("method parameters", "; ".join(f"{m}: {p}" for m, p in s["params"].items())))
    blocks.append(KeyValues(rows))

    blocks.append(Para("Provenance", "h3"))
    p = prov if r.complete else an.partial_provenance(r)
    if not r.complete:
        blocks.append(Para(f"From the {r.batches_done} finished batches' markers; the full provenance "
                           "(versions, weight hash, contract) is written when the run completes.", "note"))
    seq = p.get("sequence_length") or {}
    prow = [("examples / batches", f"{p.get('examples', r.n_examples)} / {p.get('batches', r.batches_done)}")]
    if p.get("left_out"):
        prow.append(("left out", ", ".join(f"{k}: {v}" for k, v in p["left_out"].items())))
    if p.get("accuracy") is not None:
        prow.append(("accuracy of the explained label", f"{p['accuracy']:.3f}"))
    if seq:
        prow.append(("sequence length (tokens)", f"mean {seq.get('mean', 0):.1f}, median {seq.get('median', 0):.1f}, "
                                                 f"min {seq.get('min')}, max {seq.get('max')}"))
    prow += [("wall time (batches)", _seconds(p.get("wall_seconds")))]
    if p.get("model_load_seconds") is not None:
        prow.append(("model load", _seconds(p.get("model_load_seconds"))))
    prow += [("peak memory", _bytes(p.get("peak_memory_bytes"))),
             ("forward passes per example", fmt(p.get("forward_passes_per_example"))),
             ("forward rows per example", fmt(p.get("forward_rows_per_example")))]
    for key, label in (("device", "device"), ("dtype", "dtype"), ("attn_implementation", "attention implementation"),
                       ("devices_used", "devices used"), ("torch_threads", "torch threads"), ("seed", "seed"),
                       ("host", "host"), ("finished_at", "finished at"), ("fingerprint", "study fingerprint")):
        if p.get(key) is not None:
            value = p[key]
            prow.append((label, _list(value) if isinstance(value, list) else str(value)))
    if p.get("versions"):
        prow.append(("versions", ", ".join(f"{k} {v}" for k, v in p["versions"].items())))
    blocks.append(KeyValues(prow))
    steps = p.get("step_seconds") or {}
    if steps:
        total = sum(steps.values()) or 1.0
        frame = pd.DataFrame({"step": list(steps), "seconds": list(steps.values())}).sort_values("seconds",
                                                                                                 ascending=False)
        frame["share"] = frame["seconds"] / total
        frame["seconds_per_example"] = frame["seconds"] / max(r.n_examples, 1)
        blocks.append(Table(frame, caption="time per step, over all batches"))
    blocks += _sanity_blocks(r, w)
    return Section("setup", "Model, set-up and provenance", blocks)


def _kv_map(r: StudyResult) -> list[int] | None:
    """The query -> key/value head map when heads are grouped (GQA/MQA), else None."""
    c = r.contract or {}
    kv, n_heads, n_kv = c.get("kv_head_of_query"), c.get("n_heads"), c.get("n_kv_heads")
    return list(kv) if kv and n_heads and n_kv and n_kv < n_heads else None


def _agreement_section(r: StudyResult, w: _Writer) -> Section:
    blocks = []
    ref, measure = r.reference, r.measure
    by_layer = an.agreement_by_layer(r)
    csv = w.csv("agreement_by_layer", by_layer)
    base = an.baselines_and_ceilings(r)
    csv_base = w.csv("baselines_and_ceiling", base)
    mlabel = fg.measure_label(measure)
    blocks.append(Para(f"Mean {mlabel} over examples between each explainer's token ranking and each reference's, "
                       f"with {100 * float(r.statistics.get('level', 0.95)):.0f}% bootstrap CIs. Agreement is computed "
                       "on scored tokens only."))
    if not r.complete:
        blocks.append(Para("Single heads show means only until the run completes; token- and layer-level units "
                           "have CIs from the finished batches.", "note"))

    # heatmaps for per-head explainers
    for explainer in an.per_head_explainers(r):
        grids = {ref_: g for ref_ in r.references if (g := an.head_grid(r, explainer, ref_)) is not None}
        if grids:
            png = fg.heatmap_grid(grids, f"{explainer}: mean {mlabel} per layer x head", measure, _kv_map(r))
            blocks.append(w.figure(f"heads_{explainer}", png,
                                   f"{explainer}, every layer x head: mean {mlabel} with each reference "
                                   "(red: agrees, blue: ranks the other way)"
                                   + ("; black lines separate query heads sharing a key/value head." if _kv_map(r)
                                      else ".")))
    # per-layer lines
    lines = {ref_: an.layer_lines(r, ref_) for ref_ in r.references}
    lines = {k: v for k, v in lines.items() if v}
    if lines:
        bands = {ref_: an.reference_bands(r, ref_) for ref_ in lines}
        grads = {ref_: an.best_gradient(r, ref_) for ref_ in lines}
        notes = an.layer_line_notes(r)
        blocks.append(w.figure("layers", fg.layer_lines(lines, bands, grads, measure, notes),
                               f"Per-layer explainers: mean {mlabel} per layer with its CI, against each reference, "
                               "beside the random (grey), uniform (dotted) and position (orange) baselines, the "
                               "ceiling (green) and the best gradient (purple)."
                               + (" Units that rank tokens identically on >= 95% of the examples are named in the "
                                  "legend as one ranking: their points are one measurement, not several."
                                  if notes else "")))
    units = an.distribution_units(r)
    if units:
        bands = an.reference_bands(r, ref)
        blocks.append(w.figure("distribution", fg.distribution(units, bands, ref, measure),
                               f"Per-example {mlabel} with {ref} (the verdict reference): a box per explainer unit "
                               "(per-layer methods at their best layer, per-head ones at their best head: chosen "
                               "after looking, so optimistic), its mean and CI (black), and the baselines and the "
                               "ceiling as horizontal bands."))
    wide = an.agreement_wide(r)
    if len(wide):
        blocks.append(Table(wide, caption=f"mean {mlabel} [CI] by explainer and layer against each reference "
                                          "(tracks: passes the verdict rule)", csv=csv, max_rows=400))
    if len(base):
        shown = base[base["measure"] == measure].drop(columns=["measure"])
        blocks.append(Table(shown, caption=f"baselines and ceiling ({mlabel})", csv=csv_base))
    published = r.metrics.get("published") or []
    if published and r.summary is not None:
        rows = []
        for item in published:
            layer = -1 if item.get("layer") is None else int(item["layer"])
            ours = r.summary[(r.summary.explainer == item["explainer"]) & (r.summary.reference == item["reference"])
                             & (r.summary.layer == layer) & (r.summary["head"] == -1)
                             & (r.summary.measure == item.get("measure", "spearman")) & (r.summary.role == "explainer")]
            rows.append({"explainer": item["explainer"], "reference": item["reference"],
                         "layer": "" if layer < 0 else layer, "measure": item.get("measure", "spearman"),
                         "paper": item["value"],
                         "ours (mean [CI])": (f"{ours['mean'].iloc[0]:+.3f} [{ours.ci_low.iloc[0]:+.3f}, "
                                              f"{ours.ci_high.iloc[0]:+.3f}]") if len(ours) else "not computed",
                         "n": int(ours.n.iloc[0]) if len(ours) else 0, "source": item.get("source", "")})
        frame = pd.DataFrame(rows)
        blocks.append(Table(frame, caption="the paper's numbers beside ours (their model and data differ: context, "
                                           "not a target)", csv=w.csv("published", frame)))
    s = r.summary
    if s is not None and "left_out" in s.columns:
        left = s[(s.left_out > 0) & (s.measure == measure)]
        if len(left):
            left = left[["role", "explainer", "reference", "layer", "head", "n", "left_out", "left_out_reasons"]]
            blocks.append(Table(left.reset_index(drop=True), caption="examples left out of n, per unit, and why",
                                csv=w.csv("left_out", left), max_rows=200))
        else:
            blocks.append(Para(f"No example was left out: every unit's n is the {r.n_examples} examples.", "note"))
    return Section("agreement", "Agreement with the references", blocks)


def _erasure_section(r: StudyResult, w: _Writer) -> Section:
    if r.table("erasure") is None:
        return Section("erasure", "Erasure curves", [_not_part("Erasure curves are")])
    curves, aopc = an.erasure_curves(r), an.erasure_aopc(r)
    csv = w.csv("erasure_aopc", aopc)
    w.csv("erasure_curves", curves)
    blocks = [Para("Tokens removed (comprehensiveness) or kept (sufficiency) in each ranking's order, most "
                   "important first; every ranking beside a seeded random one. AOPC is the mean of a curve over "
                   "the bins."),
              w.figure("erasure", fg.erasure_curves(curves, aopc),
                       "Mean comprehensiveness and sufficiency per bin (shaded: +-1.96 standard errors); AOPC in "
                       "the legend."),
              Table(_aopc_display(aopc, _is_classifier(r)), caption="AOPC per ranking" + (
                  " (flipped: share of examples whose predicted class changed as tokens were removed; removed until "
                  "flip: mean share of scored tokens removed by then)" if _is_classifier(r) else ""), csv=csv)]
    return Section("erasure", "Erasure curves", blocks)


def _ci_text(frame: pd.DataFrame, col: str) -> list[str]:
    return [an._mean_ci(m, lo, hi) for m, lo, hi in zip(frame[col], frame[f"{col}_ci_low"], frame[f"{col}_ci_high"])]


def _is_classifier(r: StudyResult) -> bool:
    contract = r.contract
    if contract and contract.get("task"):
        return contract["task"] == "classification"
    target = r.spec.target
    return not (target.choices or target.continuation or target.prompt or target.kind == "logprob")


def _aopc_display(aopc: pd.DataFrame, classifier: bool) -> pd.DataFrame:
    out = pd.DataFrame({"ranking": aopc["ranking"], "n": aopc["n"],
                        "AOPC comprehensiveness [CI]": _ci_text(aopc, "aopc"),
                        "AOPC sufficiency [CI]": _ci_text(aopc, "aopc_sufficiency")})
    if classifier:
        out["flipped"] = aopc["flipped_frac"]
        out["removed until flip"] = aopc["flip_removed_frac"]
    return out


def _sites_display(sites: pd.DataFrame) -> pd.DataFrame:
    names = {"site": "site", "n": "n", "max_attention_mean": "max attention (mean)",
             "perm_median_output_tvd_median": "perm. output TVD (median)",
             "perm_median_output_tvd_mean": "perm. output TVD (mean)",
             "perm_median_abs_target_change_mean": "perm. |target change| (mean)",
             "perm_median_attention_jsd_mean": "perm. attention JSD (mean)",
             "adv_max_attention_jsd_mean": "adv. max JSD (mean)", "adv_max_attention_jsd_median": "adv. max JSD (median)",
             "adv_feasible_frac_mean": "adv. feasible", "adv_bound": "adv. TVD bound"}
    return sites[[c for c in names if c in sites.columns]].rename(columns=names)


def _counterfactual_section(r: StudyResult, w: _Writer) -> Section:
    c = r.table("counterfactual")
    if c is None:
        return Section("counterfactual", "Counterfactual attention", [_not_part("Counterfactual attention is")])
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


def _heads_section(r: StudyResult, w: _Writer) -> Section:
    table = an.head_table(r)
    if r.table("heads") is None and not len(table):
        return Section("heads", "Heads", [_not_part("Head ablation is")])
    blocks = []
    if r.table("heads") is None:
        blocks.append(_not_part("Head ablation is"))
    if len(table):
        csv = w.csv("heads", table)
        n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
        maps = {}
        for col, title in (("mean_abs_ablation_change", "mean |change| when the head is ablated"),
                           ("mean_importance", "mean head importance (Michel et al.)"),
                           ("top3_attention", f"attention on {r.reference}'s top-3 tokens")):
            if col in table.columns and table[col].notna().any():
                grid = np.full((n_layers, n_heads), np.nan)
                grid[table["layer"].to_numpy(), table["head"].to_numpy()] = table[col].to_numpy(dtype=float)
                maps[title] = grid
        if maps:
            blocks.append(w.figure("heads", fg.head_maps(maps, _kv_map(r)),
                                   "Per layer x head: " + "; ".join(maps) + ". Attention on the top-3 tokens is the "
                                   "weight the head puts on the verdict reference's three most important tokens, "
                                   "summed per example and averaged."))
        if "top3_attention" not in table.columns:
            blocks.append(Para("Attention on the reference's top-3 tokens needs the per-head `attention` explainer, "
                               "which is not part of this study.", "note"))
        if {"mean_abs_ablation_change", "top3_attention"} <= set(table.columns):
            both = table[["mean_abs_ablation_change", "top3_attention"]].dropna()
            if len(both) >= 3:
                rho = both.rank().corr().iloc[0, 1]
                blocks.append(Para(f"Across heads, Spearman correlation between ablation effect and attention on "
                                   f"the reference's top-3 tokens: {rho:+.3f} ({len(both)} heads)."))
        key = next((c for c in ("mean_abs_ablation_change", "mean_importance", "top3_attention") if c in table.columns))
        blocks.append(Table(table.sort_values(key, ascending=False, kind="stable"),
                            caption=f"per head, largest {key.replace('_', ' ')} first", csv=csv, max_rows=30))
    return Section("heads", "Heads", blocks)


def _tokens_section(r: StudyResult) -> Section:
    unit, examples = an.token_examples(r)
    if not examples:
        return Section("tokens", "Example token views", [Para("No attention unit with per-example agreement and "
                                                              "stored scores to show.", "note")])
    blocks = [Para(f"The examples where {unit['unit']} (the best layer-level attention unit against "
                   f"{r.reference}, mean {unit['mean']:+.3f}) agrees most and least with the reference, each "
                   "shown as that unit's scores, a gradient explainer's and the reference's."),
              TokenView(examples, r.measure, unit["unit"])]
    return Section("tokens", "Example token views", blocks)


def _limitations_section(r: StudyResult) -> Section:
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
        f"The verdict rule's thresholds are conventions: {100 * float(r.statistics.get('level', 0.95)):.0f}% CIs, "
        f"alpha {r.statistics.get('alpha', 0.05)}, uncorrected paired tests, the best gradient as the bar; other "
        "choices move units across the line.",
        f"The results are for this model ({r.model_id}), this data, this target and this tokenisation only.",
    ]
    if not r.complete:
        items.append("This report covers the finished batches only; numbers will change as the run completes.")
    return Section("limitations", "Limitations", [Para("What this study can and cannot show:"), Bullets(items)])


# --------------------------------------------------------------------------- the report


def _write(doc: Document, w: _Writer, out: Path, partial: bool) -> ReportFiles:
    fig_dir = out / "figures"
    figure_paths, written = {}, []
    for name, png in w.figures.items():
        path = fig_dir / f"{name}.png"
        _atomic_text(path, png)
        figure_paths[name] = f"figures/{name}.png"
        written.append(path)
    html_path, md_path = out / "report.html", out / "report.md"
    _atomic_text(html_path, render_html(doc))
    _atomic_text(md_path, render_markdown(doc, figure_paths))
    return ReportFiles(out_dir=out, html=html_path, markdown=md_path, figures=written, tables=list(w.tables),
                       sections=[s.id for s in doc.sections], partial=partial)


def build_report(result_dir: str | Path, out_dir: str | Path | None = None) -> ReportFiles:
    """Render the study in ``result_dir`` into ``out_dir`` (default ``result_dir/report``):
    ``report.html`` (one self-contained file), ``report.md`` with ``figures/*.png``, and
    ``tables/*.csv``. A run that has not finished gets a PARTIAL banner and no verdict."""
    r = load_result(result_dir)
    out = Path(out_dir) if out_dir is not None else r.root / "report"
    _prepare_out(out, f"probe study report: {r.name}")
    w = _Writer(out)
    banner = None
    if not r.complete:
        total = r.batches_total if r.batches_total is not None else "?"
        banner = (f"PARTIAL: {r.batches_done} of {total} batches done ({r.n_examples} examples). "
                  "The verdict comes when the run completes; everything below covers the finished batches only.")
    sections = []
    if r.complete:
        sections.append(_verdict_section(r))
    sections += [_setup_section(r, w), _agreement_section(r, w), _erasure_section(r, w), _counterfactual_section(r, w),
                 _heads_section(r, w), _tokens_section(r), _limitations_section(r)]
    subtitle = f"{r.model_id} \u00b7 {r.n_examples} examples \u00b7 result folder {r.root}"
    doc = Document(title=f"probe study report: {r.name}", subtitle=subtitle, banner=banner, sections=sections)
    return _write(doc, w, out, partial=not r.complete)


# --------------------------------------------------------------------------- comparison


def _study_row(r: StudyResult) -> dict:
    v = r.verdict or {}
    lu, hu = v.get("layer_units") or {}, v.get("head_units") or {}
    best_layer = (v.get("best_layers") or [None])[0]
    best_head = (v.get("best_heads") or [None])[0]
    status = "complete" if r.complete else f"partial {r.batches_done}/{r.batches_total or '?'}"
    return {
        "study": r.name, "model": r.model_id, "dataset": r.spec.dataset.name,
        "n": r.n_examples, "status": status, "reference": r.reference, "measure": r.measure,
        "answer": v.get("answer", "(pending)"),
        "layer units tracking": f"{lu.get('tracking')}/{lu.get('total')}" if lu else "",
        "heads tracking": f"{hu.get('tracking')}/{hu.get('total')}" if hu else "",
        "best layer unit": f"{best_layer['unit']} {_ci(best_layer)}" if best_layer else "",
        "best head": f"{best_head['unit']} {_ci(best_head)}" if best_head else "",
        "random": _ci(v.get("random")) if v.get("random") else "",
        "best gradient": (f"{v['best_gradient']['explainer']} {_ci(v['best_gradient'])}" if v.get("best_gradient")
                          else ""),
        "ceiling": (f"{' vs '.join(v['ceiling']['pair'])} {_ci(v['ceiling'])}" if v.get("ceiling") else ""),
    }


def build_comparison(dirs, out_dir: str | Path | None = None) -> ReportFiles:
    """Several studies side by side: each one's verdict and headline numbers, and the per-layer
    agreement of the explainers they share. Default ``out_dir``: ``./comparison``."""
    dirs = list(dirs)
    if len(dirs) < 2:
        raise InputError(f"compare needs two or more result folders; got {len(dirs)} ({', '.join(map(str, dirs)) or 'none'})")
    results = [load_result(d) for d in dirs]
    roots = [r.root.resolve() for r in results]
    if len(set(roots)) < 2:
        raise InputError(f"compare needs two or more different result folders; got {', '.join(map(str, dirs))}")
    out = Path(out_dir) if out_dir is not None else Path("comparison")
    _prepare_out(out, "probe study comparison")
    w = _Writer(out)
    labels = _unique_labels(results)
    table = pd.DataFrame([_study_row(r) for r in results])
    table["study"] = labels
    table.insert(1, "folder", [str(r.root) for r in results])
    csv = w.csv("studies", table)
    side_by_side = table.set_index("study").T
    side_by_side.index.name = ""
    sections = [Section("studies", "Studies", [
        Para("Each study's verdict against its own verdict reference and measure (these may differ between "
             "studies: compare numbers only where they match)."),
        Table(side_by_side.reset_index(), caption="verdicts and headline numbers, one column per study", csv=csv)])]
    for label, r in zip(labels, results):
        if r.verdict:
            sections[0].blocks.append(Para(f"{label}: {r.verdict.get('headline', '')}"))
        elif not r.complete:
            sections[0].blocks.append(Para(f"{label}: PARTIAL ({r.batches_done} of {r.batches_total or '?'} batches); "
                                           "no verdict yet.", "note"))

    per_layer = [set(an.per_layer_explainers(r)) | set(an.per_head_explainers(r)) for r in results]
    shared = [e for e in an._ordered_explainers(set.union(*per_layer)) if all(e in s for s in per_layer)]
    n_layers = {int(r.summary["layer"].max()) + 1 for r in results if r.summary is not None and len(r.summary)}
    relative = len(n_layers) > 1
    rows, panels = [], {}
    for explainer in shared:
        panel = {}
        for label, r in zip(labels, results):
            s = an.summary_rows(r, role="explainer", reference=r.reference, measure=r.measure)
            s = s[(s["explainer"] == explainer) & (s["layer"] >= 0)]
            per = s[s["head"] < 0] if (s["head"] < 0).any() else s  # per-head explainers: mean over heads
            by = per.groupby("layer", sort=True)["mean"].mean()
            if not len(by):
                continue
            x = by.index.to_numpy(dtype=float)
            last = max(int(r.summary["layer"].max()), 1)
            panel[label] = (x / last if relative else x, by.to_numpy(), f"{label} ({r.measure} vs {r.reference})")
            rows += [{"explainer": explainer, "study": label, "layer": int(layer), "reference": r.reference,
                      "measure": r.measure, "mean": float(m)} for layer, m in by.items()]
        if panel:
            panels[explainer] = panel
    if panels:
        w.csv("per_layer", pd.DataFrame(rows))
        sections.append(Section("layers", "Per-layer agreement of shared explainers", [
            w.figure("per_layer", fg.comparison_lines(panels, relative),
                     "Mean agreement with each study's verdict reference per layer, one line per study (per-head "
                     "explainers: the mean over heads)" + ("; x is the relative depth since the models differ in "
                                                           "depth." if relative else "."))]))
    else:
        sections.append(Section("layers", "Per-layer agreement of shared explainers",
                                [Para("The studies share no per-layer or per-head explainer.", "note")]))
    doc = Document(title="probe study comparison", subtitle=" \u00b7 ".join(labels), sections=sections)
    return _write(doc, w, out, partial=any(not r.complete for r in results))


def _unique_labels(results: list[StudyResult]) -> list[str]:
    names = [r.name for r in results]
    out = []
    for i, r in enumerate(results):
        label = r.name if names.count(r.name) == 1 else f"{r.name} ({r.root.name or r.root})"
        while label in out:
            label = f"{label} #{i}"
        out.append(label)
    return out
