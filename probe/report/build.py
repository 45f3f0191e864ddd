"""``probe report`` and ``probe compare``: a study's stored results as HTML, Markdown and CSV.

Rendered from the result folder alone: nothing here imports torch or transformers or loads a
model, so a report can be made anywhere the folder is copied to. The sections are built in
:mod:`probe.report.sections` and :mod:`probe.report.setup_section`, written by
:mod:`probe.report.output` through the renderer in :mod:`probe.document`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from probe.document import Document, Para, Section, Table
from probe.errors import InputError
from probe.names import COMPLETE_FILE
from probe.report import analysis as an
from probe.report import figures as fg
from probe.report.frontier import frontier_of, frontier_section
from probe.report.output import (
    RECORDED_FILES,
    SOURCE_FILE,
    ReportFiles,
    Writer,
    prepare_out,
    read_inputs,
    write_report,
)
from probe.report.results import StudyResult, load_result
from probe.report.sections import (
    agreement_section,
    counterfactual_section,
    heads_causal_section,
    heads_section,
    limitations_section,
    not_part,
    stat_text,
    tokens_section,
    verdict_section,
)
from probe.report.setup_section import setup_section
from probe.report.steps import steps_section
from probe.tasks import task_named

__all__ = ["build_comparison", "build_report", "report_is_current"]


# --------------------------------------------------------------------------- sections


def _erasure_section(r: StudyResult, w: Writer) -> Section:
    if r.table("erasure") is None:
        return Section("erasure", "Erasure curves", [not_part("Erasure curves are")])
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
    return [an.mean_ci(m, lo, hi) for m, lo, hi in zip(frame[col], frame[f"{col}_ci_low"], frame[f"{col}_ci_high"])]


def _is_classifier(r: StudyResult) -> bool:
    contract = r.contract
    if contract and contract.get("task"):
        return task_named(contract["task"]).labels
    target = r.spec.target
    return not (target.choices or target.continuation or target.contrast or target.prompt or target.kind == "logprob")


def _aopc_display(aopc: pd.DataFrame, classifier: bool) -> pd.DataFrame:
    out = pd.DataFrame({"ranking": aopc["ranking"], "n": aopc["n"],
                        "AOPC comprehensiveness [CI]": _ci_text(aopc, "aopc"),
                        "AOPC sufficiency [CI]": _ci_text(aopc, "aopc_sufficiency")})
    if classifier:
        out["flipped"] = aopc["flipped_frac"]
        out["removed until flip"] = aopc["flip_removed_frac"]
    return out


# --------------------------------------------------------------------------- the report


def _inputs_stamp(root: Path) -> str | None:
    """The digest of a finished folder's completion record and of this probe's version, or None
    (a folder without one: not finished, or from before records)."""
    import hashlib
    from importlib import metadata

    try:
        record = (Path(root) / COMPLETE_FILE).read_bytes()
    except OSError:
        return None
    try:
        version = metadata.version("probe")
    except metadata.PackageNotFoundError:
        version = "?"
    return hashlib.sha256(record + b"\n" + version.encode()).hexdigest()


def report_is_current(result_dir: str | Path, out_dir: str | Path | None = None) -> bool:
    """Whether ``out_dir`` (default ``result_dir/report``) holds the report of exactly what the
    finished folder holds now, rendered by this probe version from this folder where it is now (a
    moved or copied folder's report names the folder it was rendered in: it is rendered again), with
    ``report.html`` and ``report.md`` as they were written (``probe report`` rebuilds it anyway).

    Like ``complete.json``, the digests this compares are kept in the folder they describe: they
    catch an accidental change (an edited or damaged report, a report of other results), not a
    forger who can write the folder and rewrites the digests with the files."""
    from probe.study.identity import file_digest

    root = Path(result_dir)
    out = Path(out_dir) if out_dir is not None else root / "report"
    stamp = _inputs_stamp(root)
    recorded, written = read_inputs(out)
    if stamp is None or recorded != stamp or set(written) != set(RECORDED_FILES):
        return False
    try:
        if (out / SOURCE_FILE).read_text(encoding="utf-8").strip() != str(root.resolve()):
            return False
        return all(file_digest(out / name) == digest for name, digest in written.items())
    except OSError:
        return False


def build_report(result_dir: str | Path, out_dir: str | Path | None = None) -> ReportFiles:
    """Render the study in ``result_dir`` into ``out_dir`` (default ``result_dir/report``):
    ``report.html`` (one self-contained file), ``report.md`` with ``figures/*.png``, and
    ``tables/*.csv``. A run that has not finished gets a PARTIAL banner and no verdict."""
    r = load_result(result_dir)
    out = Path(out_dir) if out_dir is not None else r.root / "report"
    inputs = _inputs_stamp(r.root) if r.complete else None
    prepare_out(out, f"probe study report: {r.name}", source=r.root, inputs=inputs)
    w = Writer(out, source=r.root)
    w.inputs = inputs
    banner = None
    if not r.complete:
        total = r.batches_total if r.batches_total is not None else "?"
        banner = (f"PARTIAL: {r.batches_done} of {total} batches done ({r.n_examples} examples). "
                  "The verdict comes when the run completes; everything below covers the finished batches only.")
    sections = []
    try:  # the sections write their tables into the staging folder already: a failure removes it
        if r.complete:
            sections.append(verdict_section(r, w))
            sections += [s for s in [heads_causal_section(r, w)] if s is not None]  # only where asked for
        sections += [setup_section(r, w), agreement_section(r, w)]
        sections += [s for s in [frontier_section(r, w) if r.complete else None, steps_section(r, w)] if s is not None]
        sections += [_erasure_section(r, w), counterfactual_section(r, w), heads_section(r, w), tokens_section(r),
                     limitations_section(r)]
    except BaseException:
        import shutil

        shutil.rmtree(w.staging, ignore_errors=True)
        raise
    subtitle = f"{r.model_id} \u00b7 {r.n_examples} examples \u00b7 result folder {r.root}"
    doc = Document(title=f"probe study report: {r.name}", subtitle=subtitle, banner=banner, sections=sections)
    return write_report(doc, w, out, partial=not r.complete)


# --------------------------------------------------------------------------- comparison


def _study_row(r: StudyResult) -> dict:
    v = r.verdict.data if r.verdict is not None else {}
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
        "best layer unit": f"{best_layer['unit']} {stat_text(best_layer)}" if best_layer else "",
        "best head": f"{best_head['unit']} {stat_text(best_head)}" if best_head else "",
        "random": stat_text(v.get("random")) if v.get("random") else "",
        "best gradient": (f"{v['best_gradient']['explainer']} {stat_text(v['best_gradient'])}" if v.get("best_gradient")
                          else ""),
        "ceiling": (f"{' vs '.join(v['ceiling']['pair'])} {stat_text(v['ceiling'])}" if v.get("ceiling") else ""),
        "cheapest within the ceiling": _cheapest_text(r),
    }


def _cheapest_text(r: StudyResult) -> str:
    """The frontier's choice in a few words: the unit, its seconds per example and speed-up."""
    frontier = frontier_of(r) if r.complete else None
    chosen = (frontier or {}).get("cheapest")
    if not chosen:
        return "none" if frontier else ""
    speed = f", {chosen['speedup']:.3g}x cheaper than {frontier['reference']}" if chosen.get("speedup") else ""
    return f"{chosen['unit']} {chosen['seconds_per_example']:.3g} s/example{speed}"


def build_comparison(dirs: Iterable[str | Path], out_dir: str | Path | None = None) -> ReportFiles:
    """Several studies side by side: each one's verdict and headline numbers, and the per-layer
    agreement of the explainers they share. Default ``out_dir``: ``./comparison``."""
    dirs = list(dirs)
    if len(dirs) < 2:
        raise InputError(f"compare needs two or more result folders; got {len(dirs)} "
                         f"({', '.join(map(str, dirs)) or 'none'})")
    results = [load_result(d) for d in dirs]
    roots = [r.root.resolve() for r in results]
    if len(set(roots)) < 2:
        raise InputError(f"compare needs two or more different result folders; got {', '.join(map(str, dirs))}")
    out = Path(out_dir) if out_dir is not None else Path("comparison")
    prepare_out(out, "probe study comparison")
    w = Writer(out)
    labels = _unique_labels(results)
    sections = [_studies_section(results, labels, w), _shared_layers_section(results, labels, w)]
    doc = Document(title="probe study comparison", subtitle=" \u00b7 ".join(labels), sections=sections)
    return write_report(doc, w, out, partial=any(not r.complete for r in results))


def _studies_section(results: list[StudyResult], labels: list[str], w: Writer) -> Section:
    """One column per study: its verdict and headline numbers; then each one's headline."""
    table = pd.DataFrame([_study_row(r) for r in results])
    table["study"] = labels
    table.insert(1, "folder", [str(r.root) for r in results])
    csv = w.csv("studies", table)
    side_by_side = table.set_index("study").T
    side_by_side.index.name = ""
    blocks = [Para("Each study's verdict against its own verdict reference and measure (these may differ between "
                   "studies: compare numbers only where they match)."),
              Table(side_by_side.reset_index(), caption="verdicts and headline numbers, one column per study", csv=csv)]
    for label, r in zip(labels, results):
        if r.verdict is not None:
            blocks.append(Para(f"{label}: {r.verdict.headline}"))
        elif not r.complete:
            blocks.append(Para(f"{label}: PARTIAL ({r.batches_done} of {r.batches_total or '?'} batches); "
                               "no verdict yet.", "note"))
    return Section("studies", "Studies", blocks)


def _layer_means(r: StudyResult, explainer: str) -> pd.Series:
    """Mean agreement of ``explainer`` with the study's verdict reference, per layer (per-head
    explainers: the mean over heads)."""
    s = an.summary_rows(r, role="explainer", reference=r.reference, measure=r.measure)
    s = s[(s["explainer"] == explainer) & (s["layer"] >= 0)]
    per = s[s["head"] < 0] if (s["head"] < 0).any() else s
    return per.groupby("layer", sort=True)["mean"].mean()


def _shared_layers_section(results: list[StudyResult], labels: list[str], w: Writer) -> Section:
    """The per-layer agreement of the explainers every study has, one line per study; against the
    relative depth when the models differ in depth."""
    # lists in the studies' own order, not sets: the section must not depend on PYTHONHASHSEED
    per_layer = [an.per_layer_explainers(r) + an.per_head_explainers(r) for r in results]
    shared = [e for e in an.ordered_explainers([e for names in per_layer for e in names])
              if all(e in names for names in per_layer)]
    n_layers = {int(r.summary["layer"].max()) + 1 for r in results if r.summary is not None and len(r.summary)}
    relative = len(n_layers) > 1
    rows, panels = [], {}
    for explainer in shared:
        panel = {}
        for label, r in zip(labels, results):
            by = _layer_means(r, explainer)
            if not len(by):
                continue
            x = by.index.to_numpy(dtype=float)
            last = max(int(r.summary["layer"].max()), 1)
            panel[label] = (x / last if relative else x, by.to_numpy(), f"{label} ({r.measure} vs {r.reference})")
            rows += [{"explainer": explainer, "study": label, "layer": int(layer), "reference": r.reference,
                      "measure": r.measure, "mean": float(m)} for layer, m in by.items()]
        if panel:
            panels[explainer] = panel
    title = "Per-layer agreement of shared explainers"
    if not panels:
        return Section("layers", title, [Para("The studies share no per-layer or per-head explainer.", "note")])
    w.csv("per_layer", pd.DataFrame(rows))
    return Section("layers", title, [
        w.figure("per_layer", fg.comparison_lines(panels, relative),
                 "Mean agreement with each study's verdict reference per layer, one line per study (per-head "
                 "explainers: the mean over heads)" + ("; x is the relative depth since the models differ in "
                                                       "depth." if relative else "."))])


def _unique_labels(results: list[StudyResult]) -> list[str]:
    names = [r.name for r in results]
    out = []
    for i, r in enumerate(results):
        label = r.name if names.count(r.name) == 1 else f"{r.name} ({r.root.name or r.root})"
        while label in out:
            label = f"{label} #{i}"
        out.append(label)
    return out
