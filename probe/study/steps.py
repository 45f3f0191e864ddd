"""A study of a language model's output token by token (``target.generate`` / ``target.steps``).

Every output token of every dataset example is a *unit*: it is explained, perturbed and compared on
its own, exactly as an example of any other study, and every table holds one row (or block of rows)
per unit. The units of one batch are numbered from ``first example * STEP_STRIDE`` on, so numbers
stay unique across batches, shards and resumes; the ``examples`` table maps each unit to its dataset
example (``source``) and its ``step``.

The statistics are over dataset examples, not over units: the output tokens of one prompt share that
prompt, so they are not independent draws. :func:`per_source` averages each agreement measure over
an example's units before anything is summarised, so every bootstrap, paired test and verdict rule
reads one value per dataset example, as in every other study (the rules unchanged in meaning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.names import measure_columns

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["STEP_STRIDE", "is_stepwise", "per_example_means", "per_source", "per_source_rows", "step_agreement",
           "unit_number"]

#: the most output tokens of one example a study explains (``target.generate`` is at most this)
STEP_STRIDE = 1024


def unit_number(example: int, offset: int) -> int:
    """The number of a batch's unit ``offset`` when the batch starts at dataset example ``example``."""
    return int(example) * STEP_STRIDE + int(offset)


def is_stepwise(examples: pd.DataFrame | None) -> bool:
    """The study's ``examples`` table is one of units (it has ``source`` and ``step``)."""
    return examples is not None and "source" in examples.columns and "step" in examples.columns


def by_source(frame: pd.DataFrame, examples: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (a per-unit table) with its ``example`` column turned into the dataset example each
    unit came from (the examples table's ``source``)."""
    owner = examples.set_index("example")["source"]
    return frame.assign(example=owner.reindex(frame["example"]).to_numpy())


def per_source(agreement: pd.DataFrame, examples: pd.DataFrame) -> pd.DataFrame:
    """The agreement table with one row per dataset example and unit of comparison: each measure the
    mean over the example's output tokens (those where it is finite), ``example`` the dataset
    example's index, ``n_steps`` how many output tokens were averaged. A mean of rank correlations
    has no per-example p-value, so the p-value columns are NaN (a significant fraction is not
    reported for a step study)."""
    if not len(agreement):
        return agreement
    frame = by_source(agreement, examples)
    keys = [c for c in ("example", "explainer", "reference", "role", "layer", "head") if c in frame.columns]
    values = [m for m, _ in measure_columns(frame)]
    pvalues = [p for _, p in measure_columns(frame) if p is not None]
    grouped = frame.groupby(keys, sort=True, dropna=False)
    out = grouped[values + ["n_tokens"]].mean()
    out["n_steps"] = grouped.size()
    out = out.reset_index()
    out["n_tokens"] = out["n_tokens"].round().astype(np.int64)
    for p in pvalues:
        out[p] = np.nan
    return out[[*keys, "n_tokens", "n_steps", *values, *pvalues]]


def step_agreement(agreement: pd.DataFrame, examples: pd.DataFrame, measure: str) -> pd.DataFrame:
    """Mean ``measure`` per (explainer, reference, role, layer, head, step) over the dataset examples
    that reached that step, with ``n`` examples: agreement against the output token's index."""
    step = examples.set_index("example")["step"]
    frame = agreement.assign(step=step.reindex(agreement["example"]).to_numpy())
    keys = ["explainer", "reference", "role", "layer", "head", "step"]
    grouped = frame[np.isfinite(frame[measure])].groupby(keys, sort=True)[measure]
    return grouped.agg(mean="mean", n="size").reset_index()


#: columns of float dtype that are keys, not values, of a unit table (erasure's bin)
FLOAT_KEYS = ("bin",)


def per_source_rows(frame: pd.DataFrame, examples: pd.DataFrame) -> pd.DataFrame:
    """A per-unit table (erasure, heads, counterfactual) with one row per dataset example and key:
    its float columns averaged over the example's output tokens, every other column a key
    (``example`` becomes the dataset example's index)."""
    if frame is None or not len(frame) or "example" not in frame.columns:
        return frame
    frame = by_source(frame, examples)
    values = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c]) and c not in FLOAT_KEYS]
    keys = [c for c in frame.columns if c not in values]
    return frame.groupby(keys, sort=True, dropna=False)[values].mean().reset_index()[list(frame.columns)]


def per_example_means(values: ArrayLike, owners: ArrayLike) -> np.ndarray:
    """``values`` (one per unit) averaged per owner (``owners[i]``: unit i's dataset example, 0..n-1 in
    order), over the finite values; NaN for an example with none."""
    values = np.asarray(values, dtype=np.float64)
    owners = np.asarray(owners, dtype=np.int64)
    n = int(owners.max()) + 1 if owners.size else 0
    finite = np.isfinite(values)
    sums = np.bincount(owners[finite], weights=values[finite], minlength=n)
    counts = np.bincount(owners[finite], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
