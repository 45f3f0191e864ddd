"""The report's cost frontier: every method of the study as a point, its agreement with the verdict
reference against its seconds per example, the ceiling drawn as a band, and the cheapest method
within it named (:mod:`probe.study.frontier`). A result folder whose ``verdict.json`` predates the
frontier gets it from its stored summary and step seconds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from probe.document import Para, Section, Table
from probe.report.figures import frontier_figure
from probe.report.output import Writer
from probe.report.results import StudyResult
from probe.study.frontier import verdict_frontier

__all__ = ["frontier_of", "frontier_section"]

TITLE = "Cost against agreement"


def frontier_of(r: StudyResult) -> dict[str, Any] | None:
    """The study's frontier: ``verdict.json``'s, or computed from the stored tables where the verdict
    was written before frontiers were (None for an unfinished study or one without step seconds)."""
    if r.verdict is None or r.summary is None:
        return None
    v = r.verdict.data
    if "frontier" in v:
        return v["frontier"]
    return verdict_frontier(v, r.summary, r.provenance or {})


def _table(frontier: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for p in frontier["points"]:
        per = p.get("seconds_per_example")
        rows.append({"method": p["method"], "unit": p["unit"], "kind": p["kind"], "n": p["n"],
                     "mean": p["mean"], "ci_low": p["ci"][0], "ci_high": p["ci"][1],
                     "seconds_per_example": per if per is not None else np.nan,
                     "within_ceiling": p.get("within_ceiling"), "defines_ceiling": p.get("defines_ceiling"),
                     "failed_checks": p.get("failed_checks")})
    return pd.DataFrame(rows)


def frontier_section(r: StudyResult, w: Writer) -> Section | None:
    """The section (module docstring), or None where the study has no frontier."""
    frontier = frontier_of(r)
    if not frontier or not frontier.get("points"):
        return None
    table = _table(frontier)
    csv = w.csv("frontier", table)
    own = frontier.get("reference_seconds_per_example")
    lead = (f"Each method's agreement with {frontier['reference']} (its best unit; another reference: their "
            f"agreement) against what it cost per example in this run"
            + (f"; {frontier['reference']} itself cost {own:.3g} s per example" if own else "")
            + ". A method within the ceiling agrees with the reference as well as the references agree with each "
              "other (its mean reaches the ceiling's lower CI bound).")
    return Section("frontier", TITLE, [
        Para(lead), Para(f"Cheapest stand-in: {frontier['why']}.", "lead"),
        w.figure("frontier", frontier_figure(frontier),
                 "Agreement (mean and CI) against seconds per example, log scale; the ceiling (green band), the "
                 "reference's own cost (dotted), the cheapest method within the ceiling ringed."),
        Table(table, caption="the frontier's points, cheapest first", csv=csv)])
