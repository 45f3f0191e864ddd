"""Rule 1 of the verdict from a study's stored tables: is a unit's agreement with the reference above
what random rankings of the same examples give? (:mod:`probe.metrics.nulls` says how.)

The tables are the ones the agreement was computed from: ``scores`` (every method's token scores,
the reference's included), ``tokens`` (which positions are scored) and ``examples`` (for a study of
generated text, the dataset example each output token belongs to). Each (example, explainer) pair
the agreement table holds is rebuilt exactly as :func:`probe.study.tables.agreement_rows` built it
(the same scored tokens, the same magnitudes), so the observed statistic of the null is the
summary's mean, and the permutations are of the reference's values over those same tokens.

Monte Carlo error (issue 61). A permutation p-value is an estimate; where a decision ``p <= alpha``
rests on it, :meth:`ChanceFamily.test` (given ``alpha``) makes it stable by a truncated sequential
Monte Carlo test in the spirit of Gandy (2009, "Sequential implementation of Monte Carlo tests with
uniformly bounded resampling risk", JASA 104): stage-wise doubling of the random rankings with a
Clopper-Pearson interval of the p-value at every look (Davidson & MacKinnon's 2000 pretest idea),
the interval's level Bonferroni-split over the looks. After each stage, every unit's deciding
p-value (``p_family``; for the ``ceiling`` family ``p_chance``) gets its interval at level
``1 - MC_RISK / looks``; while alpha lies inside one, the whole family (its max-T couples its units)
draws as many new rankings again, at a seed derived from the statistics seed and the stage, and is
re-tested on all of them together, until no interval holds alpha or the cap
(:data:`MC_MAX_PERMUTATIONS`, or ``max_permutations``) is reached. A decision the procedure stops on
differs from the one infinitely many rankings would give with probability at most ``MC_RISK`` (the
union bound over the looks); a unit whose interval still holds alpha at the cap is ``near_alpha``:
its decision is within Monte Carlo error of alpha and says so. A family no unit of which is near
alpha after the first stage draws nothing more, and the first stage is the test without the rule.
The max-T standardisation is the exact null mean and standard deviation
(:func:`probe.metrics.nulls.null_moments`), seed-free, so the binomial interval is the p-value's whole
Monte Carlo error; where no closed form applies (a top-k reference tied across its k-th place) it is
the mean and sd of :data:`MOMENT_PERMUTATIONS` rankings drawn once at a seed of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.metrics.nulls import (
    NullBlock,
    exact_top_k,
    max_t_test,
    mc_interval,
    measure_k,
    null_moments,
    permutation_means,
    permutation_means_many,
)
from probe.study.steps import is_stepwise

if TYPE_CHECKING:
    from probe.spec.study import Study

__all__ = ["CHANCE_COLUMNS", "MC_MAX_PERMUTATIONS", "MC_RISK", "MOMENT_PERMUTATIONS", "ChanceFamily",
           "chance_families", "stage_seed", "test_families"]

#: rule 1's table, one row per unit: its observed mean measure, the mean and the 95th percentile of its
#: permutation null (``chance_mean``, ``chance_high``), its one-sided permutation p-value ``p_chance``
#: and ``p_family``, adjusted (max-T) over the units of its family; ``null`` says where the first three
#: came from (``exact`` for a top-k measure where the closed form of
#: :func:`probe.metrics.nulls.exact_top_k` applies, else ``permutation``); ``permutations``: the random
#: rankings per example the family's p-values rest on (the same for all its units; where ``null`` is
#: ``exact``, ``p_chance`` and the null's mean and percentile rest on none, and ``p_family`` on them
#: only where it is above the exact ``p_chance``); ``p_mc_se``: the Monte Carlo standard error of
#: ``p_family``, ``sqrt(p (1 - p) / permutations)``, 0 where it is exact; ``near_alpha``: with an
#: alpha given, alpha still inside the Monte Carlo interval of the deciding p-value at the cap
#: (module docstring): the decision is not stable (always False without alpha)
CHANCE_COLUMNS = ["family", "explainer", "reference", "layer", "head", "n", "observed", "chance_mean", "chance_high",
                  "p_chance", "p_family", "null", "permutations", "p_mc_se", "near_alpha"]
UNIT_KEYS = ["explainer", "layer", "head"]

#: the bound on the chance that a decision of the sequential rule differs from the one with infinitely
#: many rankings (the Clopper-Pearson intervals' total level, split over the looks)
MC_RISK = 1e-3
#: the default cap of the sequential rule: the most random rankings per example a family draws
#: (16 x the default 1,000: four doublings); a study asking for more permutations draws those and no more
MC_MAX_PERMUTATIONS = 16_000
#: the largest cap a caller may set (rule 20: work has a stated bound)
MC_CAP_BOUND = 1_000_000
#: rankings drawn once per family, at a seed of their own, for the max-T standardisation of units
#: without a closed-form null mean and sd
MOMENT_PERMUTATIONS = 4000


def _derived_seed(*parts) -> int:
    text = repr(parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def stage_seed(seed: int, stage: int) -> int:
    """The seed of the sequential rule's ``stage`` (0: ``seed`` itself), derived from ``seed`` alone."""
    return int(seed) if stage == 0 else _derived_seed("mc-stage", int(seed), int(stage))


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

    @cached_property
    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mean [U], sd [U])``: the seed-free standardisation of max-T (module docstring)."""
        mean, sd = null_moments(self.blocks, len(self.units), self.measure)
        missing = ~(np.isfinite(mean) & np.isfinite(sd))
        if missing.any():
            _, null = permutation_means(self.blocks, len(self.units), self.measure, permutations=MOMENT_PERMUTATIONS,
                                        seed=_derived_seed("mc-moments"))
            with np.errstate(invalid="ignore"):
                mean = np.where(missing, null.mean(axis=1), mean)
                sd = np.where(missing, null.std(axis=1), sd)
        return mean, sd

    def _rows(self, observed: np.ndarray, null: np.ndarray, alpha: float | None) -> tuple[pd.DataFrame, np.ndarray]:
        """The rows at these draws, and per unit the Monte Carlo part of its deciding p-value (NaN where
        the decision is exact or there is none)."""
        center, scale = self.moments
        test = max_t_test(observed, null, center=center, scale=scale)
        kind = np.full(len(self.units), "permutation", dtype=object)
        drawn = test["p_family"].copy()
        exact = self.exact
        se_zero = np.zeros(len(self.units), dtype=bool)
        if exact is not None:  # top-k overlap: the closed form where it applies
            use = exact["exact"] & np.isfinite(observed)
            for ours, theirs in (("p_raw", "p_raw"), ("null_mean", "null_mean"), ("null_high", "null_high")):
                test[ours] = np.where(use, exact[theirs], test[ours])
            se_zero = use & (test["p_raw"] >= test["p_family"])
            test["p_family"] = np.where(use, np.maximum(test["p_family"], test["p_raw"]), test["p_family"])
            kind[use] = "exact"
            if alpha is not None:  # an exact p-value above alpha fails the unit whatever the draws say
                drawn = np.where(use & (test["p_raw"] > alpha), np.nan, drawn)
        b = null.shape[1]
        p = test["p_family"]
        se = np.where(se_zero, 0.0, np.sqrt(p * (1 - p) / b))
        deciding = np.where(kind == "exact", np.nan, test["p_raw"]) if self.family == "ceiling" else drawn
        frame = pd.DataFrame({
            "family": self.family, "explainer": self.units.explainer.to_numpy(), "reference": self.reference,
            "layer": self.units.layer.to_numpy(int), "head": self.units["head"].to_numpy(int), "n": list(self.n),
            "observed": observed, "chance_mean": test["null_mean"], "chance_high": test["null_high"],
            "p_chance": test["p_raw"], "p_family": p, "null": kind, "permutations": b, "p_mc_se": se,
            "near_alpha": False}, columns=CHANCE_COLUMNS)
        return frame, deciding

    def test(self, *, permutations: int, seed: int, alpha: float | None = None,
             max_permutations: int | None = None) -> pd.DataFrame:
        """The family's rows of :data:`CHANCE_COLUMNS` at this seed; with ``alpha``, by the sequential
        rule of the module docstring (``max_permutations``: its cap, default
        ``max(permutations, MC_MAX_PERMUTATIONS)``)."""
        return test_families([self], permutations=permutations, seed=seed, alpha=alpha,
                             max_permutations=max_permutations)[0]


def test_families(families: Sequence[ChanceFamily], *, permutations: int, seed: int, alpha: float | None = None,
                  max_permutations: int | None = None) -> list[pd.DataFrame]:
    """:meth:`ChanceFamily.test` of every family, the same rows, the permutations they share drawn
    and compared once (:func:`probe.metrics.nulls.permutation_means_many`): the families of one
    measure at each stage together, a family leaving the stages once no unit of it is near alpha."""
    cap = max(permutations, MC_MAX_PERMUTATIONS) if max_permutations is None else int(max_permutations)
    if alpha is not None and not permutations <= cap <= MC_CAP_BOUND:
        raise ValueError(f"max_permutations must be between permutations ({permutations}) and {MC_CAP_BOUND:,}, "
                         f"got {cap}")
    first = _draw(families, permutations, seed)
    observed = [o for o, _ in first]
    nulls = [n for _, n in first]
    tested = [f._rows(o, n, alpha) for f, o, n in zip(families, observed, nulls)]
    rows = [t[0] for t in tested]
    if alpha is None:
        return rows
    totals = [permutations]
    while totals[-1] < cap:
        totals.append(min(cap, 2 * totals[-1]))
    risk = MC_RISK / len(totals)  # Bonferroni over the looks
    going = list(range(len(families)))
    for stage in range(len(totals)):
        still = []
        for i in going:
            low, high = mc_interval(tested[i][1], nulls[i].shape[1], risk)
            near = np.isfinite(tested[i][1]) & (low <= alpha) & (alpha <= high)
            if not near.any() or stage == len(totals) - 1:
                rows[i]["near_alpha"] = near
            else:
                still.append(i)
        going = still
        if not going:
            break
        more = totals[stage + 1] - totals[stage]
        for i, (_, extra) in zip(going, _draw([families[i] for i in going], more, stage_seed(seed, stage + 1))):
            nulls[i] = np.concatenate([nulls[i], extra], axis=1)
            tested[i] = families[i]._rows(observed[i], nulls[i], alpha)
            rows[i] = tested[i][0]
    return rows


def _draw(families: Sequence[ChanceFamily], permutations: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(observed, null)`` of each family at ``permutations`` draws of ``seed``, the families of one
    measure drawn together."""
    out: list = [None] * len(families)
    by_measure: dict[str, list[int]] = {}
    for i, family in enumerate(families):
        by_measure.setdefault(family.measure, []).append(i)
    for measure, members in by_measure.items():
        drawn = permutation_means_many([(families[i].blocks, len(families[i].units)) for i in members], measure,
                                       permutations=permutations, seed=seed)
        for i, result in zip(members, drawn):
            out[i] = result
    return out


def chance_families(tables: dict, agreement: pd.DataFrame, study: Study, measure: str, units: pd.DataFrame, *,
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
