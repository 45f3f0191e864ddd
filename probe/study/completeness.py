"""The completeness check's search for the points that would do (:func:`probe.study.sanity.completeness`),
run on as few of the sample's examples as decide each try.

Where a path method's completeness fails at the study's points, the check doubles the points and
reruns the method on the sample until the median over the sample of ``|delta| / |f(x) - f(baseline)|``
is within the tolerance, up to a maximum. A failing try is often decided before every example has
run: with the values known so far and the others anywhere in ``[0, inf)``, the median is at least
the one with the others 0, and once that is above the tolerance the try fails whatever the others
give. (A try passes only on every example: one not run could be NaN, and a NaN median fails.) So a
try runs the fewest examples that could decide it (:func:`decisive_count`), those furthest off at
the try before first (they decide a failing try soonest), then more only while it is undecided:
the whole sample's answer, since an example's delta does not depend on the examples run beside it
(house rule 7), for about half the points where the method is far from converging (SmolLM2 from
its pad embedding: 27 times the tolerance at 16 points and still above it at 256, so every try fails).

:func:`search_rows` is the same rule on given values, for the plan's prediction
(:mod:`probe.study.cost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from probe.rows.scores import TokenScores

#: |f(x) - f(baseline)| at or below which an example's relative delta is undefined (left out of the median)
GAP_FLOOR = 1e-9


def relative_deltas(result: TokenScores) -> list[float | None]:
    """Per example ``|delta| / |f(x) - f(baseline)|`` of a path method's result, None where the gap is
    at most :data:`GAP_FLOOR` (the example is left out of the median)."""
    extras = result.extras
    out: list[float | None] = []
    for delta, target, base in zip(extras["convergence_delta"], extras["target_value"], extras["baseline_value"]):
        gap = abs(float(target) - float(base))
        out.append(abs(float(delta)) / gap if gap > GAP_FLOOR else None)
    return out


def decided(known: Sequence[float], unknown: int, tolerance: float) -> bool | None:
    """Whether the median of ``known`` and ``unknown`` more values (each >= 0, or NaN) is within
    ``tolerance`` whatever those are: False (it is not: the median is above it even with every unknown
    0, or it is NaN, or there are no values), True (it is, and no value is unknown: an unknown one
    could be NaN, whose median fails), None (the unknown values decide)."""
    values = np.asarray(list(known), dtype=float)
    if np.isnan(values).any() or (not len(values) and not unknown):
        return False  # a NaN median, or none, fails as the whole sample's would
    if float(np.median(np.concatenate([values, np.zeros(unknown)]))) > tolerance:
        return False
    return None if unknown else True


def decisive_count(known: Sequence[float], unknown: int, tolerance: float) -> int:
    """The fewest of the ``unknown`` values that could decide the median (all of them far off: a
    failing try; a passing one needs every value), at least one."""
    for m in range(1, unknown):
        if decided([*known, *[math.inf] * m], unknown - m, tolerance) is False:
            return m
    return max(unknown, 1)


def _order(pending: Sequence[int], latest: Sequence[float | None]) -> list[int]:
    """The examples furthest off first (NaN first: it decides at once), ties in the sample's order."""
    def key(i: int) -> tuple[float, int]:
        value = latest[i]
        return (-math.inf if value is None or math.isnan(value) else -value, i)
    return sorted(pending, key=key)


def examples_to_decide(relatives: Sequence[float], tolerance: float) -> int:
    """How many of the examples with these relative deltas one try of the search runs before its
    median is decided (the rule of :func:`search_steps`)."""
    pending = _order(range(len(relatives)), list(relatives))
    known: list[float] = []
    while pending:
        m = decisive_count(known, len(pending), tolerance)
        known += [relatives[i] for i in pending[:m]]
        pending = pending[m:]
        if decided(known, len(pending), tolerance) is not None:
            break
    return len(known)


def search_rows(relatives: Sequence[float], steps: int, *, tolerance: float, max_steps: int,
                forwards: int = 0) -> int:
    """The model rows the search runs from ``steps`` where the sample's relative deltas are
    ``relatives`` at every try: none where their median is within ``tolerance`` (the check passes
    without a search), else every try up to ``max_steps`` (the search where the method does not
    converge), each on :func:`examples_to_decide` examples, an example's run being its points (a
    forward and a backward each) and ``forwards`` rows without gradients."""
    if not relatives or decided(relatives, 0, tolerance):
        return 0
    run = examples_to_decide(relatives, tolerance)
    total, trial = 0, steps
    while trial * 2 <= max_steps:
        trial *= 2
        total += (trial + forwards) * run
    return total


def table_relatives(frame: pd.DataFrame) -> dict[str, tuple[int, list[float | None]]]:
    """Per path method of a ``convergence`` table (:func:`probe.study.tables.convergence_rows`): its
    points (the most of its final tries) and each example's relative delta at its final try (None
    where the gap is undefined)."""
    final = frame[frame["final"]]
    return {str(method): (int(rows["steps"].max()),
                          [abs(float(d)) / abs(float(g)) if abs(float(g)) > GAP_FLOOR else None
                           for d, g in zip(rows["delta"], rows["gap"])])
            for method, rows in final.groupby("method", sort=False)}


def search_steps(run: Callable[[list[int], int], TokenScores], result: TokenScores, steps: int, *,
                 tolerance: float, max_steps: int) -> tuple[int | None, int]:
    """``(the fewest points, doubling from steps, whose median relative delta is within tolerance, or
    None; the last points tried)``. ``run(indices, points)``: the method on those examples of the
    sample at ``points``; ``result``: its run at ``steps`` on the whole sample (the examples whose
    gap is undefined there are left out)."""
    latest = relative_deltas(result)
    counted = [i for i, value in enumerate(latest) if value is not None]
    trial = steps
    while trial * 2 <= max_steps:
        trial *= 2
        if _try(run, counted, latest, trial, tolerance):
            return trial, trial
    return None, trial


def _try(run: Callable[[list[int], int], TokenScores], counted: Sequence[int], latest: list[float | None],
         trial: int, tolerance: float) -> bool:
    """One try of the search at ``trial`` points, its examples run a few at a time until the median
    is decided; ``latest`` gets each run example's relative delta."""
    pending = _order(counted, latest)
    known: list[float] = []
    while pending:
        m = decisive_count(known, len(pending), tolerance)
        batch, pending = pending[:m], pending[m:]
        for i, value in zip(batch, relative_deltas(run(batch, trial))):
            latest[i] = value
            if value is not None:  # an undefined gap leaves the median, as it would the whole sample's
                known.append(value)
        answer = decided(known, len(pending), tolerance)
        if answer is not None:
            return answer
    return False
