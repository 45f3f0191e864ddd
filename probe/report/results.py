"""Read a study's result folder as it is on disk: finished, or half-way through its batches.

Nothing here imports torch or transformers, or loads a model: a report is rendered from the
stored tables alone (method names come from the torch-free :mod:`probe.names`; the study is read
from study.json into the typed :class:`~probe.spec.study.Study`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.errors import InputError
from probe.names import FORMAT_VERSION, TABLES, measure_columns
from probe.spec.study import StatisticsSpec, Study
from probe.study.steps import is_stepwise, per_source, per_source_rows
from probe.study.verdict import Verdict

if TYPE_CHECKING:
    from probe.plots import Figure


@dataclass(frozen=True, repr=False)
class StudyResult:
    """One study's result folder, read: what :func:`probe.run_study` and :func:`probe.load_results`
    return, and what a report is rendered from.

    ``root``: the folder. ``tables``: the stored tables by name (examples, tokens, scores,
    agreement, erasure, counterfactual, heads, ...: those the study computes) plus ``summary`` and,
    once complete, ``paired``. ``verdict``: the typed :class:`~probe.study.verdict.Verdict` (its
    ``data`` / ``to_dict()`` is the whole ``verdict.json``), None until every batch is done.
    ``computed``: the batches the call that returned this computed (empty when read from disk).

    ``complete`` is False for a run whose batches are not all done: its tables then hold the
    finished batches only, and it has no verdict, paired tests or provenance (``summary`` is
    computed from the parts)."""

    root: Path
    spec: Study
    fingerprint: str | None
    tables: Mapping[str, pd.DataFrame]
    verdict: Verdict | None
    provenance: dict | None
    complete: bool
    batches_done: int
    batches_total: int | None
    batch_infos: list[dict] = field(default_factory=list)
    computed: tuple[int, ...] = ()

    def __repr__(self) -> str:
        from probe.display import clip

        state = "complete" if self.complete else f"partial: {self.batches_done}/{self.batches_total or '?'} batches"
        answer = f", verdict {self.verdict.answer!r}" if self.verdict is not None else ""
        return clip(f"<StudyResult {self.name} ({self.model_id}): {self.n_examples} examples, {state}{answer}; "
                    f"{self.root}", 280) + ">"

    def _repr_html_(self) -> str:
        from probe.display import MAX_ROWS, block_html, frame_html

        parts = [block_html(repr(self), "")]
        if self.verdict is not None:
            parts.append(self.verdict._repr_html_())
        summary = self.summary
        if summary is not None and len(summary):
            top = summary[(summary["role"] == "explainer") & (summary["reference"] == self.reference)
                          & (summary["measure"] == self.measure)] if "role" in summary else summary
            top = top.sort_values("mean", ascending=False) if "mean" in top else top
            shown = [c for c in ("explainer", "layer", "head", "n", "mean", "ci_low", "ci_high", "sig_frac") if c in top]
            parts.append(block_html(f"summary: highest mean {self.measure} with {self.reference}",
                                    frame_html(top[shown] if shown else top, max_rows=MAX_ROWS),
                                    "layer/head -1: none; every row: run.to_pandas()"))
        return "<div>" + "".join(parts) + "</div>"

    def plot(self, references: str | list[str] | None = None) -> Figure:
        """Mean agreement per layer (with its CI band) of each per-layer explainer against each of
        ``references`` (default: every reference), beside the random, uniform and position
        baselines, the ceiling and the best gradient: the report's per-layer figure, from the
        summary table. An explainer it cannot draw (a token-level one such as ``saliency`` has no
        layer axis; the best gradient is its dashed line) is named in a note under the figure.
        Returns a :class:`matplotlib.figure.Figure`."""
        from probe.plots import layer_lines_figure
        from probe.report.lines import summary_bands, summary_best_gradient, summary_layer_lines, summary_left_out

        refs = self.references if references is None else [references] if isinstance(references, str) else list(references)
        unknown = [r for r in refs if r not in self.references]
        if unknown:
            raise InputError(f"reference {unknown[0]!r} is not one of this study's ({', '.join(self.references)})")
        lines = {r: summary_layer_lines(self.summary, r, self.measure) for r in refs}
        lines = {r: v for r, v in lines.items() if v}
        unreliable = tuple((self.verdict.data.get("unreliable") or {}) if self.verdict is not None else ())
        if not lines:
            raise InputError(f"the study {self.name!r} has no per-layer explainer to plot (its explainers: "
                             f"{', '.join(self.explainers)})")
        gradients = {r: summary_best_gradient(self.summary, r, self.measure, unreliable) for r in lines}
        left_out = {e: None for r in lines for e in summary_left_out(
            self.summary, r, self.measure, [*lines[r], *([gradients[r]["explainer"]] if gradients[r] else [])])}
        note = (f"not drawn (no layer axis, or no layer-level rows): {', '.join(left_out)}; run.to_pandas() has them"
                if left_out else "")
        return layer_lines_figure(lines, {r: summary_bands(self.summary, r, self.measure) for r in lines}, gradients,
                                  self.measure, title=f"{self.name} ({self.model_id})", note=note)

    def to_pandas(self) -> pd.DataFrame:
        """The summary table (a copy): one row per (role, explainer, reference, layer, head,
        measure) with ``n``, ``mean``, ``std``, the bootstrap CI ``ci_low`` / ``ci_high`` and
        ``sig_frac``: each unit's agreement with each reference, what one reads first. The
        per-example rows behind it are ``tables["agreement"]``."""
        summary = self.summary
        return pd.DataFrame() if summary is None else summary.copy()

    @property
    def summary(self) -> pd.DataFrame | None:
        return self.tables.get("summary")

    @property
    def paired(self) -> pd.DataFrame | None:
        """The per-unit paired tests of the verdict (``paired.parquet``); None before it."""
        return self.tables.get("paired")

    @property
    def heads_causal(self) -> pd.DataFrame | None:
        """The per-head causal test, one row per tested head (``heads_causal.parquet``,
        ``probe.study.heads_causal``); None before the verdict or where the study did not ask for it."""
        return self.tables.get("heads_causal")

    # ---------------------------------------------------------------- the study's settings

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def explainers(self) -> list[str]:
        return list(self.spec.explainers)

    @property
    def references(self) -> list[str]:
        return list(self.spec.references)

    @property
    def reference(self) -> str:
        """The verdict reference: the verdict's, else ``statistics.reference`` or the first reference."""
        if self.verdict is not None and self.verdict.reference:
            return self.verdict.reference
        return self.spec.verdict_reference

    @property
    def measure(self) -> str:
        if self.verdict is not None and self.verdict.measure:
            return self.verdict.measure
        # before the verdict (a partial run) auto has not chosen yet: the rank correlation it starts from
        measure = self.spec.statistics.measure
        return "kendall_tau" if measure == "auto" else measure

    @property
    def absolute(self) -> set[str]:
        return set(self.spec.metrics.absolute)

    @property
    def model_id(self) -> str:
        return self.spec.model.id

    @property
    def stepwise(self) -> bool:
        """A study of a language model's output token by token: its examples table holds one row per
        output token (unit), the statistics one value per dataset example (``probe.study.steps``)."""
        return is_stepwise(self.tables.get("examples"))

    @property
    def n_examples(self) -> int:
        """Dataset examples explained (in a step study: the prompts, not their output tokens)."""
        examples = self.tables.get("examples")
        if examples is None:
            return 0
        return int(examples["source"].nunique()) if self.stepwise else int(len(examples))

    @property
    def n_units(self) -> int:
        """Rows of the examples table: the dataset examples, or in a step study their output tokens."""
        examples = self.tables.get("examples")
        return 0 if examples is None else int(len(examples))

    def table(self, name: str) -> pd.DataFrame | None:
        frame = self.tables.get(name)
        return frame if frame is not None and len(frame) else None

    @property
    def contract(self) -> dict | None:
        return ((self.provenance or {}).get("model") or {}).get("contract")


def _read_json(path: Path, folder: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{path} is unreadable ({err}); the result folder {folder} is damaged: rerun the study") from err


def _read_parquet(path: Path, folder: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as err:  # pyarrow raises several kinds for a damaged file
        raise InputError(f"{path} is unreadable ({type(err).__name__}); the result folder {folder} is damaged: "
                         "rerun the study") from err


def _done_batches(root: Path) -> list[int]:
    folder = root / "done"
    if not folder.is_dir():
        return []
    return sorted(int(p.stem[1:]) for p in folder.glob("b*.json") if p.stem[1:].isdigit())


def _tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """Plain int64 layer/head/example columns (parts and merged tables store some as int16)."""
    for col in ("example", "layer", "head", "position"):
        if col in frame.columns and frame[col].dtype != np.int64:
            frame[col] = frame[col].astype(np.int64)
    return frame


def load_result(path: str | Path) -> StudyResult:
    """Read a result folder written by ``probe run``; a one-line :class:`InputError` when it is not one."""
    root = Path(path)
    if not root.exists():
        raise InputError(f"{root} does not exist: expected a study result folder written by `probe run` "
                         "(one holding study.json)")
    if not root.is_dir():
        raise InputError(f"{root} is a file: expected a study result folder written by `probe run` "
                         "(one holding study.json)")
    if not (root / "study.json").is_file():
        raise InputError(f"{root} is not a study result: expected study.json in it (a folder written by `probe run`)")
    record = _read_json(root / "study.json", root)
    version = record.get("format_version") if isinstance(record, dict) else None
    if version != FORMAT_VERSION:
        raise InputError(f"{root} was made by another probe version (result format {version!r}, this probe reads "
                         f"{FORMAT_VERSION}); rerun the study with this probe")
    if not isinstance(record.get("study"), dict):
        raise InputError(f"{root / 'study.json'} holds no study; rerun the study")
    study = Study.from_record(record["study"], source=str(root / "study.json"))
    done = _done_batches(root)
    infos = []
    for b in done:
        info = _read_json(root / "done" / f"b{b:05d}.json", root)
        infos.append({"batch": b, **info})
    merged = {name: root / f"{name}.parquet" for name in TABLES}
    complete = ((root / "verdict.json").is_file() and (root / "summary.parquet").is_file()
                and merged["examples"].is_file() and merged["agreement"].is_file())
    total = _batches_total(study, done)
    if complete:
        tables = _per_source({name: _tidy(_read_parquet(p, root)) for name, p in merged.items() if p.is_file()})
        tables["summary"] = _tidy(_read_parquet(root / "summary.parquet", root))
        for name in ("paired", "heads_causal"):  # the verdict's unit tests; the per-head causal test when asked
            path = root / f"{name}.parquet"
            if path.is_file():
                tables[name] = _tidy(_read_parquet(path, root))
        verdict = Verdict.from_dict(_read_json(root / "verdict.json", root), source=str(root / "verdict.json"))
        prov_path = root / "provenance.json"
        provenance = _read_json(prov_path, root) if prov_path.is_file() else None
        n_batches = int((provenance or {}).get("batches") or len(done) or 1)
        return StudyResult(root=root, spec=study, fingerprint=record.get("fingerprint"),
                           tables=MappingProxyType(tables), verdict=verdict, provenance=provenance, complete=True,
                           batches_done=n_batches, batches_total=n_batches, batch_infos=infos)
    if not done:
        raise InputError(f"{root} holds the study {study.name!r} but no finished batch yet: "
                         "run it with `probe run` and report once a batch is done")
    tables = {}
    for name in TABLES:
        frames = [_read_parquet(p, root) for p in (root / "parts" / name / f"b{b:05d}.parquet" for b in done)
                  if p.is_file()]
        frames = [f for f in frames if len(f)]
        if frames:
            tables[name] = _tidy(pd.concat(frames, ignore_index=True))
    if "examples" not in tables or "agreement" not in tables:
        raise InputError(f"{root} has done markers but no examples/agreement parts under parts/; "
                         "the folder is damaged: rerun the study")
    tables = _per_source(tables)
    tables["summary"] = partial_summary(tables["agreement"], study.statistics)
    return StudyResult(root=root, spec=study, fingerprint=record.get("fingerprint"), tables=MappingProxyType(tables),
                       verdict=None, provenance=None, complete=False, batches_done=len(done),
                       batches_total=total, batch_infos=infos)


def _per_source(tables: dict) -> dict:
    """A step study's tables as the report reads them: ``agreement``, ``erasure``, ``heads`` and
    ``counterfactual`` one row per dataset example (the mean over its output tokens, as the
    statistics were computed), the units' own rows kept as ``unit_agreement`` and so on; other
    studies' tables unchanged."""
    examples = tables.get("examples")
    if not is_stepwise(examples):
        return tables
    if "agreement" in tables:
        tables["unit_agreement"] = tables["agreement"]
        tables["agreement"] = per_source(tables["agreement"], examples)
    for name in ("erasure", "heads", "counterfactual"):
        if name in tables:
            tables[f"unit_{name}"] = tables[name]
            tables[name] = per_source_rows(tables[name], examples)
    return tables


def _batches_total(study: Study, done: list[int]) -> int | None:
    """The number of batches of the study, when its size is known before it runs (``dataset.n``)."""
    n, size = study.dataset.n, study.engine.batch_size
    total = math.ceil(n / size) if n is not None else None
    if total is not None and done:
        total = max(total, done[-1] + 1)
    return total


GROUP = ["role", "explainer", "reference", "layer", "head"]


def partial_summary(agreement: pd.DataFrame, statistics: StatisticsSpec) -> pd.DataFrame:
    """The summary table of a run that has not finished (same columns as ``summary.parquet``).

    Token- and layer-level units get bootstrap CIs as the finished run computes them; single heads
    (hundreds of them in a large model) get the mean, std and n only, which is what the heatmaps need.
    """
    from probe.metrics.statistics import summarize_groups

    alpha = float(statistics.alpha)
    kw = {"alpha": alpha, "n_boot": statistics.bootstrap, "level": float(statistics.level), "seed": statistics.seed}
    frames = []
    units = agreement[agreement["head"] < 0]
    heads = agreement[agreement["head"] >= 0]
    for measure, p_col in measure_columns(agreement):
        if len(units):
            frame = summarize_groups(units, GROUP, measure, p_col, **kw)
            frame.insert(len(GROUP), "measure", measure)
            frames.append(frame)
        if len(heads):
            values = heads[GROUP + [measure]].copy()
            values[measure] = values[measure].where(np.isfinite(values[measure]))
            g = values.groupby(GROUP, sort=True)[measure]
            frame = pd.DataFrame({"n": g.count(), "mean": g.mean(), "std": g.std(ddof=1)}).reset_index()
            frame.insert(len(GROUP), "measure", measure)
            frame["ci_low"] = np.nan
            frame["ci_high"] = np.nan
            if p_col is not None:
                sig = heads[p_col] <= alpha
                ok = np.isfinite(heads[measure]) & np.isfinite(heads[p_col])
                flags = pd.DataFrame({**{c: heads[c] for c in GROUP}, "ok": ok, "sig": sig & ok,
                                      "pos": sig & ok & (heads[measure] > 0)})
                agg = flags.groupby(GROUP, sort=True)[["ok", "sig", "pos"]].sum().reset_index()
                frame["sig_frac"] = (agg["sig"] / agg["ok"].where(agg["ok"] > 0)).to_numpy()
                frame["sig_pos_frac"] = (agg["pos"] / agg["ok"].where(agg["ok"] > 0)).to_numpy()
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=GROUP + ["measure", "n", "mean", "std", "ci_low", "ci_high"])
    out = pd.concat(frames, ignore_index=True)
    return _tidy(out)
