"""The per-layer agreement lines, their baseline bands and the best gradient, read from a study's
summary table alone: what the report's per-layer figure and :meth:`StudyResult.plot
<probe.report.results.StudyResult.plot>` draw (this module does not know the result type, so the
result can use it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from probe.names import method_family as family
from probe.plots import Band

FAMILY_ORDER = {"attention": 0, "gradient": 1, "intervention": 2, None: 3}
SUMMARY_COLUMNS = ["role", "explainer", "reference", "layer", "head", "measure", "n", "mean", "std", "ci_low",
                   "ci_high"]


def ordered_explainers(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (FAMILY_ORDER[family(n)], names.index(n)))


def finite_or_none(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def select_rows(summary: pd.DataFrame | None, *, role: str | None = None, reference: str | None = None,
                measure: str | None = None) -> pd.DataFrame:
    """The summary's rows of ``role``, ``reference`` and ``measure`` (None: any)."""
    if summary is None or not len(summary):
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    keep = np.ones(len(summary), dtype=bool)
    if role is not None:
        keep &= (summary["role"] == role).to_numpy()
    if reference is not None:
        keep &= (summary["reference"] == reference).to_numpy()
    if measure is not None:
        keep &= (summary["measure"] == measure).to_numpy()
    return summary[keep]


def summary_bands(summary: pd.DataFrame | None, reference: str, measure: str) -> dict[str, Band]:
    """Random, uniform and position baselines and the ceiling, against ``reference``."""
    s = select_rows(summary, measure=measure)
    out = {}
    base = s[(s["role"] == "baseline") & (s["reference"] == reference)]
    for _, row in base.iterrows():  # at most three rows
        out[str(row["explainer"])] = Band(str(row["explainer"]), float(row["mean"]), finite_or_none(row["ci_low"]),
                                          finite_or_none(row["ci_high"]))
    ceil = s[s["role"] == "ceiling"]
    involving = ceil[(ceil["explainer"] == reference) | (ceil["reference"] == reference)]
    ceil = (involving if len(involving) else ceil).sort_values("mean", ascending=False)
    if len(ceil):
        row = ceil.iloc[0]
        out["ceiling"] = Band(f"ceiling ({row['explainer']} vs {row['reference']})", float(row["mean"]),
                              finite_or_none(row["ci_low"]), finite_or_none(row["ci_high"]))
    return out


def summary_layer_lines(summary: pd.DataFrame | None, reference: str, measure: str) -> dict[str, pd.DataFrame]:
    """Per-layer explainers: layer, mean, ci_low, ci_high against ``reference``."""
    s = select_rows(summary, role="explainer", reference=reference, measure=measure)
    s = s[(s["head"] < 0) & (s["layer"] >= 0)]
    return {e: s[s["explainer"] == e].sort_values("layer")[["layer", "mean", "ci_low", "ci_high"]]
            for e in ordered_explainers(s["explainer"])}


def summary_left_out(summary: pd.DataFrame | None, reference: str, measure: str, drawn: Iterable[str]) -> list[str]:
    """The explainers with rows against ``reference`` that a per-layer figure does not draw: neither a
    line (``drawn``) nor the best gradient's level (token-level methods such as ``saliency`` have no
    layer axis), in the summary's order."""
    s = select_rows(summary, role="explainer", reference=reference, measure=measure)
    return [e for e in ordered_explainers(s["explainer"]) if e not in set(drawn)]


def summary_best_gradient(summary: pd.DataFrame | None, reference: str, measure: str,
                          unreliable: Iterable[str] = ()) -> dict | None:
    """The gradient explainer with the highest mean agreement with ``reference`` (token level),
    among those that passed their sanity checks (``unreliable``: the verdict's failed methods, left
    out, as rule 2's bar leaves them out)."""
    s = select_rows(summary, role="explainer", reference=reference, measure=measure)
    s = s[(s["head"] < 0) & (s["layer"] < 0)]
    s = s[[family(e) == "gradient" and e not in set(unreliable) for e in s["explainer"]]]
    if not len(s):
        return None
    row = s.sort_values("mean", ascending=False).iloc[0]
    return {"explainer": str(row["explainer"]), "mean": float(row["mean"]),
            "ci": (finite_or_none(row["ci_low"]), finite_or_none(row["ci_high"]))}
