"""The per-head causal test: is where a head looks what matters through that head?

A study that asks for it (``metrics: heads_causal:``, :class:`probe.spec.study.HeadsCausalSpec`)
stores, per example, tested head and token (the ``head_edges`` table,
:func:`probe.study.tables.head_edge_rows`):

* ``attention``: the head's weight on the token from the target query row, as the ``attention``
  explainer reads it;
* ``knockout``: the knockout effect of that one edge, ``f(x) - f(x with the edge blocked)``, blocked
  in that head of that layer alone (:func:`probe.intervene.knockout.edge_knockout` with ``per_head``),
  signed unless the study compares it by magnitude (``absolute``).

The rule (stored in ``verdict.json`` under ``heads_causal``):

    Each tested head H is a unit. Per example, H's agreement is the study's measure (the verdict's,
    chosen as the verdict chooses it) between H's attention row and the knockout effects of H's own
    edges (their magnitudes under ``absolute``), on the tokens both score, tied values sharing their
    places (top-k overlap counts a tie at the k-th place by its share of the places left); an example
    whose knockout effects through H are all at the numerical noise floor (nothing passes through H's
    edges there) is left out of H's mean. Where this head looks *is what matters through this head*
    when H's mean agreement is above chance, chance being what the same head would show if what its
    tokens carry were dealt to them at random: its permutation p-value under that null (below),
    adjusted over every tested head by the max-T method (family-wise error control, as every unit
    family of the verdict), is at most alpha; and the attention explainer failed no sanity check, on
    the whole method or on H. Otherwise it *is not*; and it *cannot be decided* where fewer than the
    stated minimum of examples show an effect through H's edges, or where H's attention failed a check.

The null keeps the knockout's mechanism. Blocking edge t of a head that puts weight a_t on token t
moves the head's output by a_t v_t (the blocked weight zeroed, ``renormalise: false``) or by
a_t / (1 - a_t) (v_t - o) (the row renormalised onto the other keys, o the head's output): to first
order the effect is ``m_t * c_t``, with the *mechanical weight* m_t = a_t or a_t / (1 - a_t)
(:func:`mechanical_weight`) times what the token carries, c_t = g.v_t (zeroed) or g.(v_t - o)
(renormalised), g the target's gradient at the head's output. The effect therefore grows with the
weight whatever the token carries, and ``|effect|`` (``absolute``) rises with the attention on a head
whose looked-at tokens carry exactly nothing: a null that permutes the effects themselves calls such
a head "matters" every time. The question is whether the head looks at the tokens that *carry*
something, so the null deals the carried values c_t = effect_t / m_t over the example's scored tokens
and rebuilds the effects with the same mechanical weights (:func:`null_effects`); the observed
arrangement is one of those deals. Renormalised and compared by magnitude, the head's output o moves
with the values dealt, which shifts every c by sum_s a_s (c_new,s - c_s): that shift is what makes
|effect| rise with the weight on tokens that carry nothing, so the null carries it. Signed, the shift
only moves every value along its weight by one amount per deal, and it is left out: on a saturated
target (planted:edge-head, p 0.99, whose 90% edge moves the target 100 times less per unit than its
light edges' slope predicts) the first-order shift would rebuild the heavy edge's effect wherever its
value is dealt. A token whose effect is at the noise floor says nothing of what it carries where its
weight is tiny, so only the tokens through which the example's largest carried value would show
(``m_t x max |c| > DEAL_MARGIN x floor``) are dealt; the others stay pinned to their stored effects
(dealing their unknown values as zeros would plant zeros where the head looks and lower the null).
Only the effects' sizes at arrangements not observed are first-order: a model whose target saturates
between them is judged on that approximation.

Examples are kept by their observed effects clearing the noise floor, which favours arrangements
where the carrying token sits where the head looks (a zeroed knockout of a weight of 1e-6 moves
nothing measurable). The null conditions on it too: a deal counts only if its rebuilt effects clear
the example's floor as well (candidates are drawn :data:`POOL` times over; a head short of deals
fills up with the observed one, which can only raise its p-value). Every head of an example sees the
same candidate deals (the order of the same random keys on its tokens), so the heads' nulls keep
their correlation, as max-T needs. Ties (the exact zeros of edges that carry nothing) are scored the
same way in the observed statistic and in every deal: Kendall's tau-b and Spearman's average ranks
are tie-aware, and top-k overlap (:func:`top_share_overlap`) gives tied tokens equal shares instead
of breaking ties by position.

Measured (tests/test_head_causal.py): on 30 hand-made data sets of 11 heads that look at positions
only, whose looked-at words carry nothing, and one head that looks at the deciding word, no
positional head "matters" on any data set under any of the four options (signed or absolute,
renormalised or zeroed; a null of permuted effects called every head "matters" by magnitude, and some
head on 90% of the data sets with zeroed knockouts), and the looking head matters on all 30; on
planted:one-head, L5.H7 matters and its layer's positional heads do not, under every option. The null
is conservative where its first-order rebuild errs: there the positional heads' chance mean sits
0.1-0.2 above their mean.

With ``screen`` (:mod:`probe.study.head_screen`) only the heads an AtP screen picks per example, and a
few drawn at random, run the exact knockout; the other (example, head) pairs are left out like pairs
at the noise floor, and the audit's misses and their bound are in the record (:func:`screen_record`).

There is no gradient bar (rule 2 of the token-level verdict): no gradient method scores a head's own
edges. The test is reported beside the token-level verdict and never changes it.

Torch-free: it reads the tables a study stored.

Size: the rule, its null (the deals, their conditions on the noise floor and on an AtP screen's
selection) and the screen's audit are read together when the test is checked; split, each part would
need the others' definitions to make sense.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.metrics.agreement import agreement
from probe.metrics.nulls import max_t_test, measure_k
from probe.metrics.statistics import summarize_groups
from probe.names import measure_columns, unit_name
from probe.study.decide import EPS, MIN_EXAMPLES, noise_floor
from probe.study.steps import is_stepwise, per_source

if TYPE_CHECKING:
    from probe.spec.study import HeadsCausalSpec, Study

__all__ = ["ANSWER_WORDS", "AUDIT", "EXPLAINER", "FAMILY", "KEPT", "RULE", "SCREENED", "SCREEN_RISK", "UNIT_COLUMNS",
           "Compared", "HeadsCausal", "edge_agreement", "heads_causal", "mechanical_weight", "null_effects",
           "screen_record", "screen_words", "top_share_overlap", "upper_bound"]

RULE = " ".join(__doc__.split("The rule (stored in ``verdict.json`` under ``heads_causal``):")[1]
                .split("The null keeps the knockout's mechanism.")[0].split())
#: the units' explainer and their family in the chance test
EXPLAINER = "attention"
FAMILY = "heads causal"
REFERENCE = "knockout (own edges)"
MATTERS, NOT, UNDECIDABLE = "matters", "does not matter", "undecidable"
ANSWER_WORDS = {MATTERS: "where this head looks is what matters through this head",
                NOT: "where this head looks is not what matters through this head",
                UNDECIDABLE: "cannot be decided"}
#: the columns of the per-head table (``heads_causal.parquet``)
UNIT_COLUMNS = ["unit", "layer", "head", "n", "mean", "std", "ci_low", "ci_high", "chance_mean", "chance_high",
                "p_chance", "p_family", "null", "above_chance", "reliable", "answer", "why"]
#: why an example is left out of a head's mean
AT_FLOOR = "knockout effects through the head at the noise floor"
TOO_FEW = "fewer than 2 tokens scored by both"
SCREENED_OUT = "screened out by AtP (not run exactly)"
#: the AtP screen's labels of an (example, head) pair (probe.study.head_screen), stored in ``head_edges.screen``
KEPT, AUDIT, SCREENED = "kept", "audit", "screened"
#: the risk of the one-sided bound on what the screen misses
SCREEN_RISK = 0.05


@dataclass(frozen=True)
class HeadsCausal:
    """The test's result: ``units`` one row per tested head (:data:`UNIT_COLUMNS`), ``agreement``
    one row per (example, head) (per dataset example in a study of generated text), ``left_out``
    the (example, head) pairs left out and why, and ``record`` what ``verdict.json`` keeps."""

    units: pd.DataFrame
    agreement: pd.DataFrame
    left_out: pd.DataFrame
    record: dict


def _wanted(measure: str, study: Study) -> bool:
    chosen = set(study.metrics.agreement)
    if measure.startswith("kendall"):
        return "kendall" in chosen
    if measure.startswith("spearman"):
        return "spearman" in chosen
    return "top_k" in chosen


def _scale(examples: pd.DataFrame) -> tuple[pd.Series, float]:
    values = examples.set_index("example")["target_value"].abs()
    scale = float(values.median()) if len(values) else 1.0
    return values, (scale if np.isfinite(scale) and scale > 0 else 1.0)


def edge_agreement(edges: pd.DataFrame, examples: pd.DataFrame, study: Study, dtype: str
                   ) -> tuple[pd.DataFrame, pd.DataFrame, list[Compared]]:
    """Per (example, head): the agreement of the head's attention row with its own edges' knockout
    effects (every measure the study computes), on the tokens both score.

    Returns ``(agreement, left_out, compared)``: ``agreement`` with ``example, explainer, reference,
    role, layer, head, n_tokens`` and the measures; ``left_out`` the pairs left out (``reason``);
    ``compared`` per kept pair a :class:`Compared` (what the chance test redraws). Top-k overlap
    here is :func:`top_share_overlap` (ties share the places), not the token-level tables' position
    tie-break."""
    spec = study.metrics.heads_causal
    eps = EPS.get(str(dtype), EPS["fp32"])
    targets, scale = _scale(examples)
    top_k = list(study.metrics.top_k)
    frame = edges.sort_values(["example", "layer", "head", "position"], kind="stable")
    records, left, compared = [], [], []
    for example, part in frame.groupby("example", sort=True):
        example = int(example)
        floor = noise_floor(max(float(targets.get(example, scale)), scale), eps)
        units = part[["layer", "head"]].drop_duplicates().to_numpy(np.int64)  # [unit, 2]
        n = len(part) // max(len(units), 1)
        if len(part) != n * len(units):
            continue
        x = part["attention"].to_numpy(np.float64).reshape(len(units), n)  # [unit, tokens]
        y = part["knockout"].to_numpy(np.float64).reshape(len(units), n)  # [unit, tokens]
        signed, y = y, (np.abs(y) if spec.absolute else y)
        keep = np.isfinite(x) & np.isfinite(y)  # [unit, tokens]
        screened, estimates, select = _screen_of(part, len(units), n)
        groups: dict[bytes, list[int]] = {}
        for u in range(len(units)):
            reason = _left_reason(bool(screened[u]), keep[u], y[u], floor)
            if reason:
                left.append((example, int(units[u, 0]), int(units[u, 1]), reason))
            else:
                groups.setdefault(keep[u].tobytes(), []).append(u)
        for members in groups.values():
            mask = keep[members[0]]
            values = agreement(x[members][:, mask], y[members][:, mask], k=top_k)
            for k in top_k:  # ties share the top k's places (as the null counts them), never broken by position
                values[f"top{int(k)}"] = np.array([float(top_share_overlap(x[u, mask], y[u, mask][None, :], int(k))[0])
                                                   for u in members])
            for j, u in enumerate(members):
                row: dict[str, int | float] = {"example": example, "layer": int(units[u, 0]), "head": int(units[u, 1]),
                       "n_tokens": int(mask.sum())}
                row.update({key: float(v[j]) for key, v in values.items() if _wanted(key, study)})
                records.append(row)
                compared.append(Compared(example, (row["layer"], row["head"]), x[u, mask], signed[u, mask],
                                         np.flatnonzero(mask), floor,
                                         *((estimates[u, mask], float(select[u])) if np.isfinite(select[u])
                                           else (None, None))))
    table = pd.DataFrame.from_records(records)
    if len(table):
        table.insert(1, "explainer", EXPLAINER)
        table.insert(2, "reference", REFERENCE)
        table.insert(3, "role", "heads_causal")
        table = table.sort_values(["example", "layer", "head"], kind="stable").reset_index(drop=True)
    left_out = pd.DataFrame(left, columns=["example", "layer", "head", "reason"])
    return table, left_out, compared


@dataclass(frozen=True)
class Compared:
    """One kept (example, head): ``attention [n]`` and signed ``knockout [n]`` on the ``n`` tokens both
    score, their ``positions`` in the example, and the example's noise ``floor``."""

    example: int
    unit: tuple[int, int]
    attention: np.ndarray  # [n]
    knockout: np.ndarray  # [n] signed, as stored
    positions: np.ndarray  # [n] int
    floor: float
    #: a pair an AtP screen kept (probe.study.head_screen): AtP's estimates [n] and the example's threshold on
    #: their largest |value|; the null counts a deal only where the head would have been kept under it
    atp: np.ndarray | None = None
    select: float | None = None


def _left_reason(screened: bool, keep: np.ndarray, y: np.ndarray, floor: float) -> str | None:
    """Why an (example, head) pair is left out of the test (None: it is compared): not run behind the
    AtP screen, fewer than 2 tokens scored by both, or every effect at the noise floor."""
    if screened:
        return SCREENED_OUT
    if keep.sum() < 2:
        return TOO_FEW
    return AT_FLOOR if float(np.abs(y[keep]).max()) <= floor else None


def _screen_of(part: pd.DataFrame, n_units: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An example's ``head_edges`` rows (units x tokens, in order) read for the AtP screen:
    ``(screened [unit], estimates [unit, tokens], select [unit])``: the pairs not run, AtP's estimates,
    and for a kept pair the example's threshold on the largest |estimate| (the smallest of its kept
    heads'; NaN for audited pairs, chosen at random, and without a screen)."""
    if "screen" not in part:
        return np.zeros(n_units, dtype=bool), np.full((n_units, n), np.nan), np.full(n_units, np.nan)
    labels = part["screen"].to_numpy().reshape(n_units, n)[:, 0]  # [unit]
    estimates = part["atp"].to_numpy(np.float64).reshape(n_units, n)  # [unit, tokens]
    largest = np.nanmax(np.where(np.isfinite(estimates), np.abs(estimates), -np.inf), axis=1)  # [unit]
    kept = labels == KEPT
    threshold = float(largest[kept].min()) if kept.any() else np.nan
    return labels == SCREENED, estimates, np.where(kept, threshold, np.nan)


def top_share_overlap(x: np.ndarray, ys: np.ndarray, k: int) -> np.ndarray:
    """Top-k overlap of ``x [n]`` with each row of ``ys [R, n]`` where tied values share the top k's
    places: a token strictly inside a row's top k counts 1, each of the ``g`` tokens tied at its k-th
    place ``(k - above) / g``; the overlap is ``sum(x's share * y's share) / k``, the mean overlap
    over every way of breaking the ties at random. It equals the plain overlap without ties, and
    gives a row the same value wherever its tied tokens stand, so an observed row and its null draws
    are scored alike (a tie broken by position is not: it favours whatever the head looks at first)."""
    n = x.shape[0]
    k = min(int(k), n)
    if n == 0:
        return np.full(ys.shape[0], np.nan)
    return (_top_share(x[None, :], k) * _top_share(ys, k)).sum(axis=1) / k


def _top_share(a: np.ndarray, k: int) -> np.ndarray:
    """``[R, n]``: each token's share of its row's top-k places (:func:`top_share_overlap`)."""
    kth = -np.sort(-a, axis=1)[:, k - 1:k]  # [R, 1] the k-th largest value
    above = (a > kth).sum(axis=1, keepdims=True)
    tied = a == kth
    return np.where(a > kth, 1.0, np.where(tied, (k - above) / np.maximum(tied.sum(axis=1, keepdims=True), 1), 0.0))


def _measure_rows(measure: str, x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """The measure of ``x [n]`` against every row of ``ys [R, n]``: ``[R]`` (Kendall tau-b, Spearman's rho
    of average ranks, or :func:`top_share_overlap`); NaN where a side is constant."""
    n = x.shape[0]
    k = measure_k(measure)
    if k is not None:
        return top_share_overlap(x, ys, k)
    out = np.full(ys.shape[0], np.nan)
    if n < 2:
        return out
    if measure == "kendall_tau":
        i, j = np.triu_indices(n, 1)
        sx = np.sign(x[j] - x[i])  # [pairs]
        sy = np.sign(ys[:, j] - ys[:, i])  # [R, pairs]
        nx, ny = float(np.count_nonzero(sx)), np.count_nonzero(sy, axis=1).astype(np.float64)
        ok = (ny > 0) & (nx > 0)
        out[ok] = np.clip((sy[ok] @ sx) / np.sqrt(nx * ny[ok]), -1.0, 1.0)
        return out
    from scipy.stats import rankdata

    rx = rankdata(x) - (n + 1) / 2.0
    ry = rankdata(ys, axis=1) - (n + 1) / 2.0  # [R, n]
    sxx, syy = float(rx @ rx), np.einsum("rt,rt->r", ry, ry)
    ok = (syy > 0) & (sxx > 0)
    out[ok] = np.clip((ry[ok] @ rx) / np.sqrt(sxx * syy[ok]), -1.0, 1.0)
    return out


def _draw_seed(seed: int, example: int) -> int:
    text = repr(("heads causal", int(seed), int(example))).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


#: candidate permutations drawn per null draw kept: a draw is kept only where the effects it rebuilds clear
#: the noise floor, as the example itself did; a head short of draws after that many fills up with the
#: observed arrangement (which clears it), so it can only lose significance
POOL = 4


def mechanical_weight(attention: np.ndarray, renormalise: bool) -> np.ndarray:
    """``[n]``: how blocking an edge scales what its token carries, by the head's weight on it alone: the
    weight ``a`` itself where the blocked weight is zeroed (the head's output loses ``a v``), ``a / (1 -
    a)`` where the row is renormalised (the output moves by ``a / (1 - a) (v - o)``)."""
    a = np.asarray(attention, dtype=np.float64)
    return a / np.maximum(1.0 - a, 1e-12) if renormalise else a


#: a token joins the deal where the largest carried value of its example (of an effect above the floor), dealt
#: to it, would move the target by more than this many noise floors through its weight; the others are pinned
DEAL_MARGIN = 1.0


def null_effects(item: Compared, keys: np.ndarray, *, renormalise: bool, shift: bool = True) -> np.ndarray:
    """``[R, n]``: the knockout effects the head would show if what its tokens carry were dealt to them
    in the order of the random ``keys [R, n]`` (over the tokens that join the deal; the others pinned),
    its attention row and the knockout's mechanism kept (module docstring). A row whose keys deal
    every token back to its place equals the stored effects."""
    m, carried, order = _deal(item, keys, renormalise)
    values = carried[order]  # [R, n]
    if renormalise and shift:  # the row's mean o moves with the values dealt: shift by the change of sum_s a_s c_s
        values = values - ((values - carried[None, :]) @ np.asarray(item.attention, dtype=np.float64))[:, None]
    return m[None, :] * values


def _deal(item: Compared, keys: np.ndarray, renormalise: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(m [n], carried [n], order [R, n])``: the mechanical weights, what each token carries, and per
    row of ``keys`` the token whose carried value each place receives (the pinned ones their own)."""
    m = mechanical_weight(item.attention, renormalise)  # [n]
    e = np.asarray(item.knockout, dtype=np.float64)
    carried = np.divide(e, m, out=np.zeros_like(e), where=m > 0)  # [n] per unit of mechanical weight
    seen = np.abs(e) > item.floor
    largest = float(np.abs(carried[seen]).max()) if seen.any() else 0.0
    dealt = np.flatnonzero(m * largest > DEAL_MARGIN * item.floor)  # [d]
    order = np.tile(np.arange(e.size), (keys.shape[0], 1))  # [R, n]
    order[:, dealt] = dealt[np.argsort(keys[:, dealt], axis=1, kind="stable")]
    return m, carried, order


def _selected(item: Compared, keys: np.ndarray, renormalise: bool, shift: bool) -> np.ndarray:
    """``[R]``: whether the AtP screen would have kept the head under each deal of ``keys``: AtP's
    estimates dealt as :func:`null_effects` deals the effects (what each token carries, by AtP; the same
    shift), their largest |value| at least the example's threshold. All true for a pair the screen did
    not choose by its estimates."""
    if item.select is None or item.atp is None:
        return np.ones(keys.shape[0], dtype=bool)
    m, _, order = _deal(item, keys, renormalise)
    estimates = np.nan_to_num(np.asarray(item.atp, dtype=np.float64), nan=0.0)
    carried = np.divide(estimates, m, out=np.zeros_like(estimates), where=m > 0)
    values = carried[order]  # [R, n]
    if renormalise and shift:
        values = values - ((values - carried[None, :]) @ np.asarray(item.attention, dtype=np.float64))[:, None]
    return np.abs(m[None, :] * values).max(axis=1) >= item.select * (1 - 1e-12)


def _null_rows(item: Compared, keys: np.ndarray, permutations: int, spec: HeadsCausalSpec) -> np.ndarray:
    """``[permutations + 1, n]``: row 0 the compared effects as stored, then the null draws kept from
    the candidate ``keys`` (those whose largest |effect| clears the example's noise floor and, for a pair
    an AtP screen chose, under which the screen would have chosen it: :func:`_selected`)."""
    effects = null_effects(item, keys, renormalise=spec.renormalise, shift=spec.absolute)  # [pool, n]
    counted = (np.abs(effects).max(axis=1) > item.floor) & _selected(item, keys, spec.renormalise, spec.absolute)
    kept = effects[counted][:permutations]
    observed = np.asarray(item.knockout, dtype=np.float64)[None, :]
    if len(kept) < permutations:
        kept = np.concatenate([kept, np.repeat(observed, permutations - len(kept), axis=0)])
    rows = np.concatenate([observed, kept])
    return np.abs(rows) if spec.absolute else rows


def _chance(compared: list[Compared], owners: Mapping[int, int], units: pd.DataFrame, measure: str,
            study: Study) -> pd.DataFrame:
    """Per tested head: ``chance_mean``, ``chance_high`` (the null's 95th percentile), ``p_chance`` and
    ``p_family`` (max-T over the heads) of its mean measure under the null of the module docstring."""
    spec, st = study.metrics.heads_causal, study.statistics
    index = {(int(layer), int(head)): i for i, (layer, head) in enumerate(zip(units.layer, units["head"]))}
    columns = st.permutations + 1
    total, count = np.zeros((len(index), columns)), np.zeros(len(index), dtype=np.int64)
    by_owner: dict[int, list[Compared]] = {}
    for item in compared:
        if item.unit in index and len(item.positions) >= 2:
            by_owner.setdefault(int(owners.get(item.example, item.example)), []).append(item)
    for owner in sorted(by_owner):
        local, seen = np.zeros((len(index), columns)), np.zeros(len(index), dtype=np.int64)
        for item in by_owner[owner]:
            size = int(item.positions.max()) + 1
            # every head of the example sees the same candidates (the order of the same random keys on its
            # tokens), so heads whose draws are all kept share their permutations, as max-T needs
            keys = np.random.default_rng(_draw_seed(st.seed, item.example)).random((POOL * st.permutations, size))
            values = _measure_rows(measure, np.asarray(item.attention, dtype=np.float64),
                                   _null_rows(item, keys[:, item.positions], st.permutations, spec))
            if not np.isfinite(values[0]):
                continue
            u = index[item.unit]
            local[u] += values
            seen[u] += 1
        has = seen > 0
        total[has] += local[has] / seen[has, None]
        count += has
    with np.errstate(invalid="ignore", divide="ignore"):
        means = total / count[:, None]
    means[count == 0] = np.nan
    test = max_t_test(means[:, 0], means[:, 1:])
    return pd.DataFrame({"layer": units.layer.to_numpy(int), "head": units["head"].to_numpy(int),
                         "chance_mean": test["null_mean"], "chance_high": test["null_high"],
                         "p_chance": test["p_raw"], "p_family": test["p_family"], "null": "permutation"})


def heads_causal(tables: Mapping[str, pd.DataFrame], study: Study, *, measure: str, dtype: str,
                 unreliable: Mapping[str, list] | None = None,
                 unreliable_units: Mapping[tuple, list] | None = None, token_answer: str | None = None) -> HeadsCausal:
    """The per-head causal test (module docstring) from a study's stored tables: ``head_edges`` and
    ``examples``. ``measure``: the verdict's measure; ``unreliable`` / ``unreliable_units``: the
    failed sanity checks (:func:`probe.study.sanity.failed_methods`, :func:`~probe.study.sanity.failed_units`);
    ``token_answer``: the token-level verdict's answer, named beside this one."""
    st = study.statistics
    examples = tables["examples"]
    edges = tables.get("head_edges")
    if edges is None:
        edges = pd.DataFrame(columns=["example", "layer", "head", "position", "attention", "knockout"])
    unit_rows, left_out, compared = edge_agreement(edges, examples, study, dtype)
    stepwise = is_stepwise(examples)
    owners = ({int(e): int(s) for e, s in zip(examples["example"], examples["source"])} if stepwise else {})
    per_example = per_source(unit_rows, examples) if stepwise and len(unit_rows) else unit_rows
    tested = edges[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"]).astype(np.int64)
    tested = tested.reset_index(drop=True)
    if measure not in per_example.columns:  # nothing compared: every head undecidable
        summary = pd.DataFrame(columns=["layer", "head", "n", "mean", "std", "ci_low", "ci_high"])
    else:
        p_col = dict(measure_columns(per_example)).get(measure)
        summary = summarize_groups(per_example, ["layer", "head"], measure, p_col, alpha=st.alpha,
                                   n_boot=st.bootstrap, level=st.level, seed=st.seed)
    units = tested.merge(summary[["layer", "head", "n", "mean", "std", "ci_low", "ci_high"]], on=["layer", "head"],
                         how="left")
    units["n"] = units["n"].fillna(0).astype(np.int64)
    chance = _chance(compared, owners, units[["layer", "head"]], measure, study)
    chance = chance[["layer", "head", "chance_mean", "chance_high", "p_chance", "p_family", "null"]]
    units = units.merge(chance, on=["layer", "head"], how="left")
    p = units.p_family.to_numpy(np.float64)
    units["above_chance"] = np.isfinite(p) & (p <= st.alpha)
    screened = (left_out[left_out["reason"] == SCREENED_OUT].groupby(["layer", "head"]).size().to_dict()
                if len(left_out) else {})
    units["reliable"], units["answer"], units["why"] = _answers(units, dict(unreliable or {}),
                                                                dict(unreliable_units or {}), st.alpha, screened)
    units.insert(0, "unit", [unit_name(EXPLAINER, int(layer), int(head)) for layer, head in zip(units.layer,
                                                                                                 units["head"])])
    units = units[UNIT_COLUMNS]
    record = _record(units, study, measure, token_answer, len(compared))
    screen = screen_record(edges, study)
    if screen is not None:
        record["screen"] = screen
        record["headline"] += " " + screen["words"]
    return HeadsCausal(units=units, agreement=per_example, left_out=left_out, record=record)


def _largest(part: pd.DataFrame) -> pd.DataFrame:
    """Per (example, layer, head) of ``head_edges`` rows: the label and the largest exact |effect|."""
    grouped = part.assign(size=part["knockout"].abs()).groupby(["example", "layer", "head"], sort=True)
    return grouped.agg(screen=("screen", "first"), largest=("size", "max")).reset_index()


def upper_bound(misses: int, audited: int, risk: float = SCREEN_RISK) -> float:
    """The one-sided ``1 - risk`` Clopper-Pearson upper bound on a rate seen ``misses`` times in
    ``audited`` draws (1 where nothing was audited)."""
    from scipy.special import betaincinv  # the beta quantile, without importing scipy.stats

    if audited <= 0 or misses >= audited:
        return 1.0
    return float(betaincinv(misses + 1, audited - misses, 1 - risk))


def screen_record(edges: pd.DataFrame, study: Study) -> dict | None:
    """What ``verdict.json`` says of the AtP screen (:mod:`probe.study.head_screen`): pairs run and
    screened, the audit's misses (an audited pair whose largest exact |effect| reaches the smallest of
    its example's kept heads') and the one-sided bound on the miss rate, and AtP's rank agreement with
    the exact effects; None where the study ran without a screen."""
    spec = study.metrics.heads_causal
    if spec is None or spec.screen is None or "screen" not in edges.columns or not len(edges):
        return None
    pairs = _largest(edges)
    counts = pairs["screen"].value_counts()
    misses = audited = 0
    for _, part in pairs.groupby("example", sort=True):
        kept = part.loc[part["screen"] == KEPT, "largest"].to_numpy(np.float64)
        checked = part.loc[part["screen"] == AUDIT, "largest"].to_numpy(np.float64)
        kept, checked = kept[np.isfinite(kept)], checked[np.isfinite(checked)]
        if len(kept) and len(checked):
            audited += len(checked)
            misses += int((checked >= kept.min()).sum())
    bound = upper_bound(misses, audited)
    screened = int(counts.get(SCREENED, 0))
    run = edges[edges["screen"] != SCREENED]
    ok = np.isfinite(run["knockout"].to_numpy(np.float64)) & np.isfinite(run["atp"].to_numpy(np.float64))
    rho = (float(pd.Series(run["atp"].to_numpy()[ok]).corr(pd.Series(run["knockout"].to_numpy()[ok]),
                                                          method="spearman")) if ok.sum() >= 3 else float("nan"))
    return {"by": spec.screen.by, "heads": spec.screen.heads, "audit": spec.screen.audit,
            "pairs_kept": int(counts.get(KEPT, 0)), "pairs_audited": int(counts.get(AUDIT, 0)),
            "pairs_screened": screened, "audit_compared": audited, "audit_missed": misses, "risk": SCREEN_RISK,
            "miss_rate_bound": bound, "missed_bound": bound * screened,
            "atp_spearman": None if not np.isfinite(rho) else rho,
            "words": screen_words(spec.screen.heads, spec.screen.audit, screened, misses, audited, bound, rho)}


def screen_words(heads: int, audit: int, screened: int, misses: int, audited: int, bound: float,
                 rho: float) -> str:
    """One sentence for the report and the headline: the screen, its audit and the bound."""
    text = (f"AtP screen: per example the {heads} heads with the largest AtP estimate ran the exact knockout, and "
            f"{audit} more drawn at random (the audit); {screened:,} (example, head) pairs were not run. ")
    if audited:
        text += (f"Of {audited} audited pairs, {misses} had exact effects that would have kept them: at most "
                 f"{bound:.0%} of the screened pairs (one-sided {1 - SCREEN_RISK:.0%} bound, about "
                 f"{bound * screened:,.0f} pairs) may be missed.")
    else:
        text += "No pair was audited: what the screen missed is not bounded."
    if np.isfinite(rho):
        text += f" AtP's estimates against the exact effects on the edges run: Spearman {rho:+.2f}."
    return text


def _answers(units: pd.DataFrame, unreliable: Mapping[str, list], unreliable_units: Mapping[tuple, list],
             alpha: float, screened: Mapping[tuple, int] | None = None) -> tuple[list[bool], list[str], list[str]]:
    """Per head (row of ``units``): (reliable, its answer, why): undecidable where its attention failed a
    sanity check or too few examples show an effect through its edges (``screened``: per (layer, head)
    the examples an AtP screen did not run it on, named in why), else it matters where its agreement is
    above chance (family-wise), and not otherwise."""
    screened = screened or {}
    answers, whys, reliable = [], [], []
    for r in units.itertuples():
        failed = list(unreliable.get(EXPLAINER, [])) + list(unreliable_units.get((EXPLAINER, int(r.layer),
                                                                                 int(r.head)), []))
        reliable.append(not failed)
        if failed:
            answers.append(UNDECIDABLE)
            whys.append(f"its attention failed a sanity check ({', '.join(dict.fromkeys(failed))})")
        elif r.n < MIN_EXAMPLES and screened.get((int(r.layer), int(r.head))):
            answers.append(UNDECIDABLE)
            whys.append(f"the AtP screen ran it exactly on too few examples ({r.n} compared, "
                        f"{screened[(int(r.layer), int(r.head))]} screened out; at least {MIN_EXAMPLES} needed)")
        elif r.n < MIN_EXAMPLES:
            answers.append(UNDECIDABLE)
            whys.append(("knocking out its edges moves the target by no more than the noise floor on every example: "
                         "nothing passes through its edges to rank") if r.n == 0 else
                        f"{r.n} examples show an effect through its edges, at least {MIN_EXAMPLES} needed")
        elif r.above_chance:
            answers.append(MATTERS)
            whys.append("")
        else:
            answers.append(NOT)
            whys.append(f"its agreement is not above chance (family-wise p = {r.p_family:.3g} > alpha {alpha})"
                        if np.isfinite(r.p_family) else "its agreement is undefined (a constant row)")
    return reliable, answers, whys


def _describe(rows: pd.DataFrame) -> list[dict]:
    return [{"unit": str(r.unit), "mean": float(r["mean"]), "ci": [float(r.ci_low), float(r.ci_high)],
             "n": int(r.n), "p_family": None if not np.isfinite(r.p_family) else float(r.p_family),
             "answer": str(r.answer)} for _, r in rows.iterrows()]


def _fmt(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


def _record(units: pd.DataFrame, study: Study, measure: str, token_answer: str | None, n_pairs: int) -> dict:
    spec = study.metrics.heads_causal
    st = study.statistics
    counts = {key: int((units.answer == key).sum()) for key in (MATTERS, NOT, UNDECIDABLE)}
    ranked = units[np.isfinite(units["mean"].to_numpy(np.float64))].sort_values("mean", ascending=False, kind="stable")
    best, worst = _describe(ranked.head(3)), _describe(ranked.tail(3).iloc[::-1])
    how = (f"{measure} of each head's attention row with the knockout of its own edges "
           f"({'|effect|' if spec.absolute else 'signed'}, "
           f"{'row renormalised' if spec.renormalise else 'blocked weight zeroed'})")
    total = len(units)
    parts = [f"Per head ({how}): where the head looks is what matters through it in {counts[MATTERS]} of {total} "
             f"heads, is not in {counts[NOT]}" + (f", cannot be decided in {counts[UNDECIDABLE]}"
                                                    if counts[UNDECIDABLE] else "") + "."]
    matters = units[units.answer == MATTERS].sort_values("mean", ascending=False, kind="stable")
    if len(matters):
        names = list(matters.unit)
        parts.append("Heads where it is: " + ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8
                                                                      else "") + ".")
    if best:
        parts.append(f"Best head: {best[0]['unit']} {_fmt(best[0])}.")
    if token_answer:
        parts.append(f"Beside the token-level verdict: {token_answer}.")
    return {
        "rule": RULE, "measure": measure, "reference": REFERENCE, "renormalise": spec.renormalise,
        "absolute": spec.absolute, "alpha": st.alpha, "level": st.level, "bootstrap": st.bootstrap,
        "permutations": st.permutations,
        "chance_test": (f"max-T permutation test over the {total} heads tested: {st.permutations} deals per example of "
                        f"what the head's tokens carry (knockout effect / mechanical weight "
                        f"{'a / (1 - a)' if spec.renormalise else 'a'}), the effects rebuilt with the head's own "
                        f"weights, kept where they clear the example's noise floor; family-wise alpha {st.alpha}"),
        "min_examples": MIN_EXAMPLES, "layers": sorted({int(v) for v in units.layer}),
        "heads_tested": sorted({int(v) for v in units["head"]}), "compared": n_pairs,
        "counts": {"matters": counts[MATTERS], "does_not_matter": counts[NOT], "undecidable": counts[UNDECIDABLE],
                   "total": total},
        "matters": list(matters.unit), "best": best, "worst": worst,
        "units": [{"unit": str(r.unit), "layer": int(r.layer), "head": int(r["head"]), "n": int(r.n),
                   "mean": None if not np.isfinite(r["mean"]) else float(r["mean"]),
                   "ci": [None if not np.isfinite(r.ci_low) else float(r.ci_low),
                          None if not np.isfinite(r.ci_high) else float(r.ci_high)],
                   "p_family": None if not np.isfinite(r.p_family) else float(r.p_family),
                   "answer": str(r.answer), **({"why": str(r.why)} if r.why else {})}
                  for _, r in units.iterrows()],
        "token_level_answer": token_answer, "headline": " ".join(parts),
    }
