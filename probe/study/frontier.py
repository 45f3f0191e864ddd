"""The cost frontier: which method comes closest to the study's verdict reference, and at what price.

Every study that runs an exact (or sampled) causal reference pays for it: leave-one-out one forward per
token, Shapley values thousands of coalitions, per-head knockout a row per head and token. Each
explainer beside it is a cheaper stand-in, and a user who cannot afford the reference on the next
model wants the cheapest one that is as close to it as the references are to each other. This
module places every method of a finished study as one point:

* its agreement with the verdict reference under the verdict's measure: for a method with layers or
  heads, its best unit (the unit a user of that method would pick, as the verdict's ``best`` does);
  for another reference, the ceiling row that pairs it with the verdict reference; with the
  bootstrap CI the summary holds;
* its cost: the seconds per example of the study steps that computed it (``provenance.json``'s
  ``step_seconds``; a step shared by several methods, ``saliency+input_x_gradient``, counts whole for
  each, since each alone would cost about what the shared step did), over the examples scored.

The *ceiling* is the verdict's own: the best agreement between two of the study's references, with its
CI (:func:`probe.study.summary.verdict`). Two references that agree to +0.5 leave no room to ask a
cheap method for more than +0.5: a method whose mean agreement reaches the ceiling's lower CI bound is
*within the ceiling*. The reference that makes the ceiling with the verdict reference is drawn but not
judged against it (its agreement *is* the ceiling). The frontier names the cheapest method within the
ceiling (``cheapest``), and says why it names none: no ceiling (one reference), or no method reaches
it. A method that failed a sanity check is drawn but never named. The points, the reference's own cost
and the choice are ``verdict.json``'s ``frontier``; the report draws them (agreement against seconds
per example, log scale, the ceiling as a band). Torch-free: it reads stored tables only, so an
older result folder gets its frontier from its tables when its report is rendered again. The seconds
are this run's, on its machine and at its batch sizes: compare points within one study, not across
machines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from probe.names import unit_name

__all__ = ["cost_frontier", "frontier_points", "method_seconds", "verdict_frontier"]


def method_seconds(step_seconds: Mapping[str, float], method: str) -> float | None:
    """Seconds of the steps that computed ``method`` (a step named ``a+b`` computed both), or None
    where no step names it."""
    found = [float(s) for step, s in step_seconds.items() if method in str(step).split("+")]
    return sum(found) if found else None


def _best_rows(summary: pd.DataFrame, reference: str, measure: str) -> pd.DataFrame:
    """Each explainer's best unit against ``reference`` (highest mean), one row per explainer."""
    s = summary[(summary["role"] == "explainer") & (summary["reference"] == reference)
                & (summary["measure"] == measure)].dropna(subset=["mean"])
    if not len(s):
        return s
    return s.sort_values(["mean", "layer", "head"], ascending=[False, True, True]).groupby(
        "explainer", sort=False).head(1)


def _reference_rows(summary: pd.DataFrame, reference: str, measure: str) -> pd.DataFrame:
    """The other references' agreement with ``reference`` (the ceiling rows that pair them)."""
    s = summary[(summary["role"] == "ceiling") & (summary["measure"] == measure)
                & ((summary["reference"] == reference) | (summary["explainer"] == reference))]
    return s.dropna(subset=["mean"])


def _point(method: str, unit: str, row: Mapping, seconds: float | None, n: int, kind: str) -> dict[str, Any]:
    per = seconds / n if seconds is not None and n > 0 else None
    return {"method": method, "unit": unit, "kind": kind, "mean": float(row["mean"]),
            "ci": [float(row["ci_low"]), float(row["ci_high"])], "n": int(row["n"]),
            "seconds_per_example": per}


def frontier_points(summary: pd.DataFrame, *, reference: str, measure: str, step_seconds: Mapping[str, float],
                    n_examples: int) -> list[dict[str, Any]]:
    """One point per method: its best unit's agreement with ``reference`` and its seconds per
    example (module docstring), cheapest first (methods without a recorded cost last)."""
    points = []
    for _, row in _best_rows(summary, reference, measure).iterrows():
        method = str(row["explainer"])
        points.append(_point(method, unit_name(method, int(row["layer"]), int(row["head"])), row,
                             method_seconds(step_seconds, method), n_examples, "explainer"))
    for _, row in _reference_rows(summary, reference, measure).iterrows():
        other = str(row["reference"] if row["explainer"] == reference else row["explainer"])
        points.append(_point(other, other, row, method_seconds(step_seconds, other), n_examples, "reference"))
    return sorted(points, key=lambda p: (p["seconds_per_example"] is None, p["seconds_per_example"] or 0.0,
                                         -p["mean"], p["method"]))


def cost_frontier(summary: pd.DataFrame, *, reference: str, measure: str, ceiling: Mapping[str, Any] | None,
                  step_seconds: Mapping[str, float], n_examples: int,
                  unreliable: Iterable[str] = ()) -> dict[str, Any] | None:
    """The study's frontier (module docstring) as ``verdict.json`` keeps it: ``points``, the
    reference's ``reference_seconds_per_example``, the ``ceiling`` it is judged against, the
    ``cheapest`` method within it (its point and ``speedup``, the reference's seconds over its own;
    None where no method qualifies) and ``why`` in words. None where the study recorded no step
    seconds or scored no example."""
    if not step_seconds or n_examples <= 0 or summary is None or not len(summary):
        return None
    points = frontier_points(summary, reference=reference, measure=measure, step_seconds=step_seconds,
                             n_examples=n_examples)
    own = method_seconds(step_seconds, reference)
    own_per = own / n_examples if own is not None else None
    bad = set(unreliable)
    low = None
    if ceiling and ceiling.get("ci") and ceiling["ci"][0] is not None and math.isfinite(float(ceiling["ci"][0])):
        low = float(ceiling["ci"][0])
    pair = set((ceiling or {}).get("pair") or ()) - {reference}
    for p in points:
        p["defines_ceiling"] = p["method"] in pair
        p["failed_checks"] = p["method"] in bad
        p["within_ceiling"] = bool(low is not None and p["mean"] >= low and not p["failed_checks"]
                                   and not p["defines_ceiling"])
    chosen = next((p for p in points if p["within_ceiling"] and p["seconds_per_example"] is not None), None)
    cheapest = None
    if chosen is not None:
        speed = own_per / chosen["seconds_per_example"] if own_per and chosen["seconds_per_example"] else None
        cheapest = {**chosen, "speedup": speed}
    why = _why(cheapest, low, reference, own_per) + "".join(
        f"; {p['method']} defines the ceiling (it is one of its pair) and is not judged against it"
        for p in points if p["defines_ceiling"])
    return {"reference": reference, "measure": measure, "reference_seconds_per_example": own_per,
            "ceiling": ({"pair": list(ceiling.get("pair") or []), "mean": ceiling.get("mean"),
                         "ci": list(ceiling.get("ci") or [])} if ceiling else None),
            "points": points, "cheapest": cheapest, "why": why}


def _why(cheapest: Mapping[str, Any] | None, low: float | None, reference: str, own_per: float | None) -> str:
    if low is None:
        return (f"no ceiling: the study has one reference, so nothing says how close to {reference} a stand-in "
                "can be expected to come; add a second reference to get one")
    if cheapest is None:
        return (f"no method reaches the ceiling's lower bound {low:+.3f}: none stands in for {reference} "
                "in this study")
    cost = f"{cheapest['seconds_per_example']:.3g} s per example"
    if own_per:
        cost += f" against {reference}'s {own_per:.3g} s"
    return (f"{cheapest['unit']} is the cheapest method whose agreement with {reference} "
            f"({cheapest['mean']:+.3f}) reaches the ceiling's lower bound {low:+.3f}: {cost}")


def verdict_frontier(verdict: Mapping[str, Any], summary: pd.DataFrame,
                     record: Mapping[str, Any]) -> dict[str, Any] | None:
    """:func:`cost_frontier` for a verdict as ``verdict.json`` holds it (its reference, measure, ceiling
    and failed methods), its summary table and ``record``, provenance.json's dict (the step seconds and
    the examples the steps ran on)."""
    n = record.get("examples") or verdict.get("n") or 0
    return cost_frontier(summary, reference=str(verdict.get("reference")), measure=str(verdict.get("measure")),
                         ceiling=verdict.get("ceiling"), step_seconds=record.get("step_seconds") or {},
                         n_examples=int(n), unreliable=verdict.get("unreliable") or {})
