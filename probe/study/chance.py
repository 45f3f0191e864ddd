"""Rule 1 of the verdict from a study's stored tables: is a unit's agreement with the reference above
what random rankings of the same examples give? (:mod:`probe.metrics.nulls` says how.)

The tables are the ones the agreement was computed from: ``scores`` (every method's token scores,
the reference's included), ``tokens`` (which positions are scored) and ``examples`` (for a study of
generated text, the dataset example each output token belongs to). Each (example, explainer) pair
the agreement table holds is rebuilt exactly as :func:`probe.study.tables.agreement_rows` built it
(the same scored tokens, the same magnitudes), so the observed statistic of the null is the
summary's mean, and the permutations are of the reference's values over those same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from probe.metrics.nulls import NullBlock, exact_top_k, max_t_test, measure_k, permutation_means
from probe.study.steps import is_stepwise

__all__ = ["CHANCE_COLUMNS", "ChanceFamily", "chance_families"]

#: rule 1's table, one row per unit: its observed mean measure, the mean and the 95th percentile of its
#: permutation null (``chance_mean``, ``chance_high``), its one-sided permutation p-value ``p_chance``
#: and ``p_family``, adjusted (max-T) over the units of its family; ``null`` says where the first three
#: came from (``exact`` for a top-k measure where the closed form of
#: :func:`probe.metrics.nulls.exact_top_k` applies, else ``permutation``)
CHANCE_COLUMNS = ["family", "explainer", "reference", "layer", "head", "n", "observed", "chance_mean", "chance_high",
                  "p_chance", "p_family", "null"]
UNIT_KEYS = ["explainer", "layer", "head"]


class _Scores:
    """The stored token scores of some methods, as ``[rows, tokens]`` matrices per (example, method)."""

    def __init__(self, scores: pd.DataFrame, methods: list[str]):
        sel = scores[scores["method"].isin(methods)]
        sel = sel.sort_values(["example", "method", "layer", "head", "position"], kind="stable")
        self.frame = sel.reset_index(drop=True)
        self.groups = self.frame.groupby(["example", "method"], sort=False).indices

    def get(self, example: int, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(values [R, n], layer [R], head [R])`` or None when the method has no rows there."""
        where = self.groups.get((example, method))
        if where is None:
            return None
        part = self.frame.iloc[where]
        n = int(part["position"].max()) + 1
        values = part["score"].to_numpy(np.float64)
        if values.size % n:
            return None
        rows = values.size // n
        return (values.reshape(rows, n), part["layer"].to_numpy()[::n].astype(np.int64),
                part["head"].to_numpy()[::n].astype(np.int64))


def _reference_row(values: np.ndarray, layer: np.ndarray, head: np.ndarray) -> np.ndarray:
    """A reference as one ``[tokens]`` row: a per-layer (per-head) reference's last layer (head mean),
    as :func:`probe.study.tables.agreement_rows` reads it."""
    if values.shape[0] == 1:
        return values[0]
    last = layer == layer.max()
    return values[last].mean(axis=0) if (head >= 0).any() else values[last][-1]


def _blocks(tables: dict, present: pd.DataFrame, reference: str, units: dict[tuple, int], absolute: set,
            owners: dict[int, int]) -> Iterator[NullBlock]:
    explainers = sorted({key[0] for key in units})
    store = _Scores(tables["scores"], [*explainers, reference])
    tokens = tables["tokens"].sort_values(["example", "position"], kind="stable")
    scored = {int(e): part["scored"].to_numpy(bool) for e, part in tokens.groupby("example", sort=False)}
    for (example, explainer), rows in present.groupby(["example", "explainer"], sort=True):
        example = int(example)
        ref = store.get(example, reference)
        got = store.get(example, explainer)
        if ref is None or got is None or example not in scored:
            continue
        y = _reference_row(*ref)
        x, layer, head = got
        if reference in absolute:
            y = np.abs(y)
        if explainer in absolute:
            x = np.abs(x)
        keep = scored[example][: y.size] & np.isfinite(y) & np.isfinite(x).all(axis=0)
        if keep.sum() < 2:
            continue
        wanted = set(zip(rows["layer"].astype(int), rows["head"].astype(int)))
        pick = [r for r in range(x.shape[0]) if (int(layer[r]), int(head[r])) in wanted]
        index = [units.get((explainer, int(layer[r]), int(head[r]))) for r in pick]
        pick = [r for r, i in zip(pick, index) if i is not None]
        if not pick:
            continue
        yield NullBlock(owner=owners.get(example, example), key=example,
                        units=np.array([units[(explainer, int(layer[r]), int(head[r]))] for r in pick]),
                        x=x[pick][:, keep], y=y[keep], positions=np.flatnonzero(keep))


@dataclass(frozen=True)
class ChanceFamily:
    """One family's units and the examples' blocks that compare them with the reference: what does
    not depend on the statistics seed, built once; :meth:`test` draws the permutations."""

    family: str
    reference: str
    measure: str
    units: pd.DataFrame  # explainer, layer, head
    blocks: tuple[NullBlock, ...]
    n: tuple[int, ...]  # per unit: the examples (dataset examples) it has a value on

    @cached_property
    def exact(self) -> dict[str, np.ndarray] | None:
        """The closed-form null of a top-k measure (:func:`probe.metrics.nulls.exact_top_k`), or None
        for a rank correlation: it does not depend on the seed, so it is computed once per family
        however many seeds :mod:`probe.study.calibration` tests."""
        k = measure_k(self.measure)
        return None if k is None else exact_top_k(self.blocks, len(self.units), k)

    def test(self, *, permutations: int, seed: int) -> pd.DataFrame:
        """The family's rows of :data:`CHANCE_COLUMNS` at this seed."""
        observed, null = permutation_means(self.blocks, len(self.units), self.measure, permutations=permutations,
                                           seed=seed)
        test = max_t_test(observed, null)
        kind = np.full(len(self.units), "permutation", dtype=object)
        exact = self.exact
        if exact is not None:  # top-k overlap: the closed form where it applies
            use = exact["exact"] & np.isfinite(observed)
            for ours, theirs in (("p_raw", "p_raw"), ("null_mean", "null_mean"), ("null_high", "null_high")):
                test[ours] = np.where(use, exact[theirs], test[ours])
            test["p_family"] = np.where(use, np.maximum(test["p_family"], test["p_raw"]), test["p_family"])
            kind[use] = "exact"
        return pd.DataFrame({
            "family": self.family, "explainer": self.units.explainer.to_numpy(), "reference": self.reference,
            "layer": self.units.layer.to_numpy(int), "head": self.units["head"].to_numpy(int), "n": list(self.n),
            "observed": observed, "chance_mean": test["null_mean"], "chance_high": test["null_high"],
            "p_chance": test["p_raw"], "p_family": test["p_family"], "null": kind}, columns=CHANCE_COLUMNS)


def chance_families(tables: dict, agreement: pd.DataFrame, study, measure: str, units: pd.DataFrame, *,
                    role: str = "explainer", reference: str | None = None) -> list[ChanceFamily]:
    """The :class:`ChanceFamily` of every family of ``units`` (columns ``explainer``, ``layer``,
    ``head`` and ``family``), compared with ``reference`` (default the verdict's) in the rows of
    ``agreement`` with ``role``. ``agreement``: the table per example (a study of generated text:
    per output token) after the noise-floor filter: the (example, unit) values it holds finite are
    the ones tested."""
    reference = reference or study.verdict_reference
    absolute = set(study.metrics.absolute)
    examples = tables.get("examples")
    owners = ({int(e): int(s) for e, s in zip(examples["example"], examples["source"])}
              if is_stepwise(examples) else {})
    out = []
    for family, members in units.groupby("family", sort=False):
        members = members.drop_duplicates(UNIT_KEYS).reset_index(drop=True)
        index = {(str(e), int(layer), int(h)): i for i, (e, layer, h) in
                 enumerate(zip(members.explainer, members.layer, members["head"]))}
        present = agreement[(agreement.reference == reference) & (agreement.role == role)
                            & agreement.explainer.isin(members.explainer.unique())]
        present = present[np.isfinite(present[measure].to_numpy(np.float64))] if measure in present else present.iloc[:0]
        counts = (present.assign(example=[owners.get(int(e), int(e)) for e in present.example])
                  .drop_duplicates(["example", *UNIT_KEYS]).groupby(UNIT_KEYS).size())
        n = tuple(int(counts.get(key, 0)) for key in zip(members.explainer, members.layer, members["head"]))
        blocks = tuple(_blocks(tables, present, reference, index, absolute, owners))
        out.append(ChanceFamily(str(family), reference, measure, members[UNIT_KEYS], blocks, n))
    return out
