"""Chance as a distribution: permutation nulls of mean agreement, and many units tested together.

A *unit* (a head, a layer's head mean, a token-level method) is compared with a reference on many
examples; its statistic is its mean agreement over them (Kendall tau-b, Spearman's rho or top-k
overlap, as :mod:`probe.metrics.agreement` computes them). Under the null hypothesis the unit's
ranking carries no information about the reference's, so every assignment of the reference's
values to the example's scored tokens is equally likely. The null distribution of the unit's mean
is drawn by permuting the reference's values over each example's tokens, ``B`` times, independently
per example, and recomputing the unit's agreement on every permuted example (vectorised: one
matrix product per example and measure). The first column of every result is the identity
permutation, i.e. the observed statistic, computed by the same arithmetic as the null draws.

Every unit of a family sees the *same* permutations of an example (the draw of example ``e`` and
permutation ``b`` depends on the seed and ``e`` only; on a subset of its tokens it is the order of
the same random keys), so the units' null draws keep the correlation the units have with each
other. That is what the family-wise test needs:

- ``p_raw``: ``(1 + #{b: null_b >= observed}) / (B + 1)``, one-sided (agreement above chance);
- ``p_family``: the single-step max-T adjustment (Westfall & Young 1993): each unit's statistic is
  standardised by its own null mean and standard deviation (exact where given: :func:`null_moments`,
  so that the standardisation does not move with the seed), the largest standardised null value
  over the family's units is taken per permutation, and ``p_family = (1 + #{b: max_t_b >= t}) /
  (B + 1)``. It controls the family-wise error rate (the chance that any unit of the family passes
  when none carries information) at the level it is compared with, and is less conservative than
  Holm where units are correlated (heads of one layer, a layer's mean and its heads). It is never
  below ``p_raw``. A unit whose null has no spread (nothing to permute) gets ``p = 1``.

The smallest p-value is ``1 / (B + 1)``: with ``B = 1000`` a family-wise test at alpha 0.05 is
resolved well.

Top-k overlap has a closed form (:func:`exact_top_k`): under the null the reference's top k of an
example's ``n`` tokens is a uniformly random k-subset, so the unit's hits there are hypergeometric
(``n`` tokens, ``k`` marked by the unit, ``k`` drawn), independently per example; the null of the
mean over examples is the convolution of those laws. Where it applies (one comparison per averaged
value, no tie in the reference across its k-th place), ``p_raw``, the null mean and its 95th
percentile are exact; ``p_family`` still comes from the permutations (the joint law of correlated
units has no closed form) and is never below the exact ``p_raw``. Ties between a null draw and the observed statistic count against the unit
(``>=``), so a discrete measure such as top-1 is tested conservatively.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["NullBlock", "agreement_values", "exact_top_k", "max_t_test", "mc_interval", "measure_k", "null_moments",
           "permutation_means", "permutation_means_many"]

# upper bound on the elements of one [permutations, pairs] sign block (float32: 16 MiB)
_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class NullBlock:
    """One example's comparison of some units with the reference, on the tokens both score.

    ``owner``: the index (0..O-1) of the value the example's agreement is averaged into (the
    example itself; in a study of generated text the dataset example its output token came from);
    ``key``: what the example's permutations are drawn from (the same key, the same permutations);
    ``units``: ``[U_b]`` indices of the units compared here; ``x``: ``[U_b, n]`` their scores on
    the ``n`` kept tokens; ``y``: ``[n]`` the reference's; ``positions``: ``[n]`` the kept tokens'
    positions in the example (the permutation of a subset is the order of the same keys)."""

    owner: int
    key: int
    units: np.ndarray  # [U_b] int
    x: np.ndarray  # [U_b, n] float64
    y: np.ndarray  # [n] float64
    positions: np.ndarray  # [n] int


def measure_k(measure: str) -> int | None:
    """k of a ``topK`` measure; None for a rank correlation; ValueError for anything else."""
    if measure in ("kendall_tau", "spearman"):
        return None
    if measure.startswith("top") and measure[3:].isdigit() and int(measure[3:]) >= 1:
        return int(measure[3:])
    raise ValueError(f"{measure!r} is not a measure: kendall_tau, spearman or topK")


def _key_seed(seed: int, key: int) -> int:
    text = repr(("null", int(seed), int(key))).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _permutations(seed: int, key: int, positions: np.ndarray, n_perm: int) -> np.ndarray:
    """``[n_perm + 1, n]``: row 0 the identity, then ``n_perm`` uniform permutations of ``0..n-1``,
    each the order of random keys drawn for every position up to the largest one."""
    size = int(positions.max()) + 1 if positions.size else 0
    keys = np.random.default_rng(_key_seed(seed, key)).random((n_perm, size))[:, positions]  # [B, n]
    order = np.argsort(keys, axis=1, kind="stable")
    return np.concatenate([np.arange(positions.size)[None, :], order], axis=0)


def _pair_signs(values: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """sign(v_j - v_i) over the pairs (i < j) of each row, float32 (exact)."""
    return np.sign(values[:, j] - values[:, i]).astype(np.float32)


def _permuted_pair_signs(y_perm: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """:func:`_pair_signs` of rows that all hold one multiset of finite values (permutations of one
    vector), transposed: ``[pairs, rows]``, float32. From their ranks in it as small integers (equal
    values equal ranks), a pair's sign is that of the ranks' difference, computed a row position at a
    time over all rows at once (contiguous, no gather per pair: the null's largest share, issue 63).
    Other rows go the general way."""
    n = y_perm.shape[1]
    top = int(y_perm.max()) if np.issubdtype(y_perm.dtype, np.integer) and y_perm.min() >= 0 else 2 ** 15
    if top >= 2 ** 15:  # values (or large integers): ranked here, or the general way
        first = np.sort(y_perm[0])
        if n >= 2 ** 15 or not np.isfinite(first).all():
            return _pair_signs(y_perm, i, j).T
        y_perm, top = np.searchsorted(first, y_perm), n - 1  # equal values: equal ranks, below the row's length
    kind = np.int8 if top < 128 else np.int16  # ranks in [0, 2^15): their differences fit
    ranks = np.ascontiguousarray(y_perm.T.astype(kind))  # [n, rows]
    out = np.empty((i.size, y_perm.shape[0]), dtype=np.float32)
    k = 0
    for a in range(n - 1):  # the pairs (a, a+1), ..., (a, n-1): np.triu_indices' order
        np.sign(ranks[a + 1:] - ranks[a], out=out[k:k + n - 1 - a], casting="unsafe")
        k += n - 1 - a
    return out


def dense_ranks(y: np.ndarray) -> np.ndarray:
    """``y``'s values as their ranks among its distinct values (0, 1, ...; equal values equal), as
    small integers, where all are finite and fewer than 2^15; ``y`` itself otherwise. Permuted, they
    give every pair the sign the values give, without a search per permuted row."""
    y = np.asarray(y)
    if y.ndim != 1 or y.size >= 2 ** 15 or not np.isfinite(y).all():
        return y
    return np.unique(y, return_inverse=True)[1].reshape(-1).astype(np.int16)


def _kendall(x: np.ndarray, y_perm: np.ndarray) -> np.ndarray:
    """Kendall's tau-b of every row of x [U, n] with every row of y_perm [P, n]: [U, P]; NaN where
    either side is constant. The same formula as :func:`probe.metrics.agreement.kendall_tau_b`."""
    u, n = x.shape
    p = y_perm.shape[0]
    out = np.full((u, p), np.nan)
    if n < 2:
        return out
    i, j = np.triu_indices(n, 1)
    tot = i.size
    sx = _pair_signs(x, i, j)  # [U, pairs]
    xtie = (sx == 0).sum(axis=1).astype(np.int64)
    ytie = int((_pair_signs(y_perm[:1], i, j) == 0).sum())  # a permutation keeps the ties
    ok = xtie != tot
    if ytie == tot or not ok.any():
        return out
    step = max(1, _BLOCK_ELEMENTS // tot)
    cmd = np.empty((u, p), dtype=np.int64)
    for lo in range(0, p, step):
        sy = _permuted_pair_signs(y_perm[lo:lo + step], i, j)  # [pairs, p_blk]
        cmd[:, lo:lo + step] = np.rint(sx @ sy).astype(np.int64)  # exact below 2**24 pairs
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = cmd / np.sqrt(tot - xtie)[:, None] / np.sqrt(tot - ytie)
    out[ok] = np.clip(tau[ok], -1.0, 1.0)
    return out


def _spearman(x: np.ndarray, y_perm: np.ndarray) -> np.ndarray:
    """Spearman's rho (Pearson of average ranks) of every row of x with every row of y_perm: [U, P]."""
    from scipy.stats import rankdata

    u, n = x.shape
    out = np.full((u, y_perm.shape[0]), np.nan)
    if n < 2:
        return out
    cx = rankdata(x, axis=1)
    cx -= cx.mean(axis=1, keepdims=True)
    cy = rankdata(y_perm, axis=1)
    cy -= cy.mean(axis=1, keepdims=True)
    sxx = np.einsum("ut,ut->u", cx, cx)
    syy = float(np.einsum("t,t->", cy[0], cy[0]))  # the same multiset of ranks in every row
    ok = sxx > 0
    if syy <= 0 or not ok.any():
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = (cx @ cy.T) / np.sqrt(sxx)[:, None] / np.sqrt(syy)
    out[ok] = np.clip(rho[ok], -1.0, 1.0)
    return out


def _top_mask(a: np.ndarray, k: int) -> np.ndarray:
    """[R, n] float32: 1 on each row's k highest scores (ties: the earlier position, as
    :func:`probe.metrics.agreement.top_k_overlap`)."""
    top = np.argsort(-a, axis=1, kind="stable")[:, :k]
    out = np.zeros(a.shape, dtype=np.float32)
    np.put_along_axis(out, top, 1.0, axis=1)
    return out


def _top_k(x: np.ndarray, y_perm: np.ndarray, k: int) -> np.ndarray:
    """|top-k of x ∩ top-k of y| / k for every row of x [U, n] and y_perm [P, n]: [U, P], gathered
    (the k positions each y row puts on top pick columns of x's top-k mask)."""
    n = x.shape[1]
    if n == 0:
        return np.full((x.shape[0], y_perm.shape[0]), np.nan)
    k = min(k, n)
    top_y = np.argsort(-y_perm, axis=1, kind="stable")[:, :k]  # [P, k]
    hits = _top_mask(x, k)[:, top_y].sum(axis=2)  # [U, P]
    return hits.astype(np.float64) / k


def agreement_values(measure: str, x: np.ndarray, y_perm: np.ndarray) -> np.ndarray:
    k = measure_k(measure)
    if k is not None:
        return _top_k(x, y_perm, k)
    return _kendall(x, y_perm) if measure == "kendall_tau" else _spearman(x, y_perm)


def permutation_means(blocks: Iterable[NullBlock], n_units: int, measure: str, *, permutations: int = 1000,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(observed [U], null [U, B])``: each unit's mean agreement over the owners it has a finite
    value on (an owner's value the mean over its blocks, as a study of generated text averages its
    output tokens), on the data and under ``B = permutations`` permutations of the reference per
    example. A unit with no finite value is NaN throughout. Memory: ``U x (B + 1)`` floats per
    owner being summed, whatever the number of examples."""
    return permutation_means_many([(list(blocks), n_units)], measure, permutations=permutations, seed=seed)[0]


def permutation_means_many(families: Sequence[tuple[Sequence[NullBlock], int]], measure: str, *,
                           permutations: int = 1000, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`permutation_means` of several families (each its blocks and its number of units) at
    one seed, the same numbers bit for bit, with the work they share done once: blocks of one
    example that compare with the same reference values on the same tokens (the explainers of a
    family, and every family of a study) share that example's permutations, and for a rank or
    top-k measure one computation of the permuted reference's pairs or top tokens, their units'
    rows stacked (a study's families drew and ranked them once per family: issue 63)."""
    if isinstance(permutations, bool) or not isinstance(permutations, (int, np.integer)) or permutations < 1:
        raise ValueError(f"permutations must be a positive integer, got {permutations!r}")
    measure_k(measure)
    by_owner: dict[int, list[tuple[int, NullBlock]]] = {}
    for f, (blocks, _) in enumerate(families):
        for block in blocks:
            by_owner.setdefault(int(block.owner), []).append((f, block))  # each family's blocks in its order
    columns = permutations + 1
    totals = [np.zeros((n_units, columns)) for _, n_units in families]
    counts = [np.zeros(n_units, dtype=np.int64) for _, n_units in families]
    for owner in sorted(by_owner):
        entries = [(f, block) for f, block in by_owner[owner] if block.x.shape[1] >= 2]
        values = _shared_values([block for _, block in entries], measure, permutations, seed)
        local = {f: np.zeros((families[f][1], columns)) for f, _ in entries}
        count = {f: np.zeros(families[f][1], dtype=np.int64) for f, _ in entries}
        for (f, block), value in zip(entries, values):
            finite = np.isfinite(value[:, 0])  # [U_b]; finiteness does not depend on the permutation
            units = np.asarray(block.units)[finite]
            local[f][units] += value[finite]  # a block names each unit once
            count[f][units] += 1
        for f in local:
            seen = count[f] > 0
            totals[f][seen] += local[f][seen] / count[f][seen, None]
            counts[f] += seen
    out = []
    for total, n in zip(totals, counts):
        with np.errstate(invalid="ignore", divide="ignore"):
            means = total / n[:, None]
        means[n == 0] = np.nan
        out.append((means[:, 0], means[:, 1:]))
    return out


def _shared_values(blocks: Sequence[NullBlock], measure: str, permutations: int, seed: int) -> list[np.ndarray]:
    """Each block's ``[U_b, permutations + 1]`` agreement values, blocks with the same key, tokens and
    reference values drawn together: one permutation of the reference for them all, and for Kendall's
    tau and top-k one computation over their stacked rows (exact integer arithmetic per row, so the
    same numbers as alone); Spearman's rho per block (a float product whose rounding could move with
    the stacking)."""
    groups: dict[tuple, list[int]] = {}
    for index, block in enumerate(blocks):
        y = np.asarray(block.y)
        positions = np.asarray(block.positions)
        groups.setdefault((int(block.key), positions.tobytes(), y.dtype.str, y.tobytes()), []).append(index)
    out: list[np.ndarray] = [np.empty(0)] * len(blocks)
    for members in groups.values():
        first = blocks[members[0]]
        order = _permutations(seed, first.key, np.asarray(first.positions), permutations)  # [B + 1, n]
        y = np.asarray(first.y)
        if measure == "kendall_tau":
            y = dense_ranks(y)  # the same taus: Kendall's reads y's order only
        y_perm = y[order]
        xs = [np.asarray(blocks[m].x, dtype=np.float64) for m in members]
        if measure == "spearman":
            for m, x in zip(members, xs):
                out[m] = agreement_values(measure, x, y_perm)
            continue
        stacked = agreement_values(measure, np.concatenate(xs, axis=0), y_perm)
        bounds = np.cumsum([0] + [x.shape[0] for x in xs])
        for m, lo, hi in zip(members, bounds[:-1], bounds[1:]):
            out[m] = stacked[lo:hi]
    return out


def max_t_test(observed: np.ndarray, null: np.ndarray, *, quantile: float = 0.95, center: np.ndarray | None = None,
               scale: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per unit: ``p_raw``, ``p_family`` (max-T over every unit given, module docstring),
    ``null_mean``, ``null_sd`` and ``null_high`` (the ``quantile`` of the unit's null: the line a
    unit's mean must clear to pass alone at ``1 - quantile``). NaN where the observed value is NaN.

    ``center`` and ``scale`` ``[U]``: the standardisation of max-T where it is known without the
    draws (:func:`null_moments`); NaN entries, or None, fall back to the mean and standard deviation
    of the draws given. Estimated from the same draws, the standardisation moves with the seed, and
    for a discrete measure it moves other units' null values across a unit's statistic: the seed's
    spread of ``p_family`` is then several times its binomial Monte Carlo error (issue 61)."""
    observed = np.asarray(observed, dtype=np.float64)
    null = np.asarray(null, dtype=np.float64)
    if null.ndim != 2 or null.shape[0] != observed.shape[0]:
        raise ValueError(f"null must be [units, permutations] for {observed.shape[0]} units, got {null.shape}")
    b = null.shape[1]
    tol = 1e-9 * np.maximum(1.0, np.abs(observed))
    with np.errstate(invalid="ignore"):
        mean = null.mean(axis=1)
        sd = null.std(axis=1)
        high = np.quantile(null, quantile, axis=1) if b else np.full(observed.shape, np.nan)
        mid = mean if center is None else np.where(np.isfinite(center), center, mean)
        width = sd if scale is None else np.where(np.isfinite(scale), scale, sd)
        spread = np.isfinite(observed) & (sd > 0) & (width > 0)
        p_raw = (1.0 + (null >= (observed - tol)[:, None]).sum(axis=1)) / (b + 1.0)
        t_obs = (observed - mid) / width
        t_null = (null - mid[:, None]) / width[:, None]
    p_family = np.ones(observed.shape)
    if spread.any() and b:
        top = t_null[spread].max(axis=0)  # [B] the largest standardised null value of the family
        t_tol = 1e-9 * np.maximum(1.0, np.abs(t_obs[spread]))
        p_family[spread] = (1.0 + (top[None, :] >= (t_obs[spread] - t_tol)[:, None]).sum(axis=1)) / (b + 1.0)
    p_raw = np.where(spread, p_raw, 1.0)
    p_family = np.maximum(p_family, p_raw)
    missing = ~np.isfinite(observed)
    for arr in (p_raw, p_family):
        arr[missing] = np.nan
    return {"p_raw": p_raw, "p_family": p_family, "null_mean": mean, "null_sd": sd, "null_high": high}


@lru_cache(maxsize=4096)
def _hits_law(n: int, k: int) -> np.ndarray:
    """``[k + 1]``: P(h hits) when a uniformly random k-subset of ``n`` tokens meets a fixed k-subset."""
    from scipy.stats import hypergeom

    return hypergeom.pmf(np.arange(k + 1), n, k, k)


@lru_cache(maxsize=256)
def _mean_law(draws: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, int]:
    """The law of the summed overlap of independent examples ``(n, k)``, on the lattice ``1 / L``
    (``L`` the lcm of the k): ``(pmf over 0..L * len(draws), L)``."""
    lattice = math.lcm(*(k for _, k in draws)) if draws else 1
    law = np.ones(1)
    for n, k in draws:
        step = lattice // k
        spread = np.zeros(k * step + 1)
        spread[::step] = _hits_law(n, k)
        law = np.convolve(law, spread)
    return law, lattice


def exact_top_k(blocks: Iterable[NullBlock], n_units: int, k: int, *, quantile: float = 0.95) -> dict[str, np.ndarray]:
    """The exact null of each unit's mean top-``k`` overlap (module docstring): per unit ``p_raw``
    (one-sided, ties counted against the unit, as the permutations count them), ``null_mean``,
    ``null_high`` (the null's ``quantile``: the smallest mean the null stays at or below with at
    least that probability, so a mean strictly above it passes alone at ``1 - quantile``) and ``exact`` (bool: where the closed
    form applies; elsewhere the other three are NaN and the permutation null stands). It does not
    apply to a unit with more than one comparison averaged into one value (a study of generated text,
    whose output tokens are averaged per example) or with a tie in the reference across its k-th
    place on some example (the top k of a permuted reference with ties is then not a uniform k-subset).
    Examples with fewer than 2 scored tokens are left out, as :func:`permutation_means` leaves them."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    draws: list[list[tuple[int, int]]] = [[] for _ in range(n_units)]
    hits: list[list[tuple[int, int]]] = [[] for _ in range(n_units)]
    owners: list[set[int]] = [set() for _ in range(n_units)]
    exact = np.ones(n_units, dtype=bool)
    for block in blocks:
        x = np.asarray(block.x, dtype=np.float64)
        n = x.shape[1]
        if n < 2:
            continue
        kk = min(int(k), n)
        y = np.asarray(block.y, dtype=np.float64)
        ordered = np.sort(y)[::-1]
        tied = kk < n and ordered[kk - 1] == ordered[kk]
        got = np.rint(_top_k(x, y[None, :], kk)[:, 0] * kk).astype(np.int64)  # [U_b] observed hits
        for unit, h in zip(np.asarray(block.units, dtype=np.int64), got):
            unit = int(unit)
            if tied or int(block.owner) in owners[unit]:
                exact[unit] = False
            owners[unit].add(int(block.owner))
            draws[unit].append((n, kk))
            hits[unit].append((int(h), kk))
    p_raw = np.full(n_units, np.nan)
    mean = np.full(n_units, np.nan)
    high = np.full(n_units, np.nan)
    for unit in range(n_units):
        if not draws[unit]:
            exact[unit] = False
        if not exact[unit]:
            continue
        law, lattice = _mean_law(tuple(sorted(draws[unit])))
        count = len(draws[unit])
        observed = sum(h * (lattice // kk) for h, kk in hits[unit])
        tail = np.cumsum(law[::-1])[::-1]  # tail[s] = P(sum >= s)
        p_raw[unit] = min(1.0, float(tail[observed]))
        mean[unit] = float(np.mean([kk / n for n, kk in draws[unit]]))
        below = np.cumsum(law)  # below[s] = P(sum <= s)
        line = int(np.searchsorted(below, quantile - 1e-12))  # the discrete quantile
        high[unit] = min(line, law.size - 1) / (lattice * count)
    return {"p_raw": p_raw, "null_mean": mean, "null_high": high, "exact": exact}


def _tie_sums(values: np.ndarray) -> tuple[float, float, float, float]:
    """Over the groups of equal values of one row: sums of t(t-1), t(t-1)(t-2), t(t-1)(2t+5), and
    the tied pairs."""
    _, t = np.unique(values, return_counts=True)
    t = t.astype(np.float64)
    return (float((t * (t - 1)).sum()), float((t * (t - 1) * (t - 2)).sum()), float((t * (t - 1) * (2 * t + 5)).sum()),
            float((t * (t - 1) / 2).sum()))


def _block_moments(measure: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mean [U_b], variance [U_b])`` of each row's agreement with ``y`` under uniform permutations
    of ``y``; NaN where no closed form applies (a top-k reference tied across its k-th place)."""
    u, n = x.shape
    k = measure_k(measure)
    if k is not None:
        kk = min(k, n)
        ordered = np.sort(y)[::-1]
        if kk < n and ordered[kk - 1] == ordered[kk]:
            return np.full(u, np.nan), np.full(u, np.nan)
        f = kk / n  # the hits are hypergeometric: n tokens, kk marked, kk drawn
        var_hits = kk * f * (1 - f) * (n - kk) / (n - 1) if n > 1 else 0.0
        return np.full(u, f), np.full(u, var_hits / kk ** 2)
    if measure == "spearman":  # Pearson's r under permutations: mean 0, variance 1/(n-1), ties or not
        return np.zeros(u), np.full(u, 1.0 / (n - 1))
    # Kendall's S under permutations with ties on both sides (Kendall 1948), over tau-b's fixed denominator
    pairs = n * (n - 1) / 2
    ya, yb, yc, ytied = _tie_sums(y)
    var = np.empty(u)
    for r in range(u):
        xa, xb, xc, xtied = _tie_sums(x[r])
        var_s = ((n * (n - 1) * (2 * n + 5) - xc - yc) / 18 + xb * yb / (9 * n * (n - 1) * (n - 2) if n > 2 else np.inf)
                 + xa * ya / (2 * n * (n - 1)))
        var[r] = var_s / ((pairs - xtied) * (pairs - ytied))
    return np.zeros(u), var


def null_moments(blocks: Iterable[NullBlock], n_units: int, measure: str) -> tuple[np.ndarray, np.ndarray]:
    """``(mean [U], sd [U])``: the exact mean and standard deviation of each unit's mean agreement
    (as :func:`permutation_means` averages it) under the permutation null, from the closed forms of
    the measure per example (Kendall's S with ties, Pearson's r of ranks, the hypergeometric hits of
    top-k); the examples are independent under the null (each has its own permutations). NaN for a
    unit where some example has no closed form (a top-k reference tied across its k-th place) or
    where it has no finite value. They do not depend on the seed: :func:`max_t_test` standardises by
    them, so ``p_family`` varies over seeds by its binomial Monte Carlo error only."""
    measure_k(measure)
    by_owner: dict[int, list[NullBlock]] = {}
    for block in blocks:
        by_owner.setdefault(int(block.owner), []).append(block)
    mean_sum = np.zeros(n_units)
    var_sum = np.zeros(n_units)
    n = np.zeros(n_units, dtype=np.int64)
    for owner in sorted(by_owner):
        local_mean = np.zeros(n_units)
        local_var = np.zeros(n_units)
        count = np.zeros(n_units, dtype=np.int64)
        for block in by_owner[owner]:
            x = np.asarray(block.x, dtype=np.float64)
            y = np.asarray(block.y, dtype=np.float64)
            if x.shape[1] < 2:
                continue
            finite = np.isfinite(agreement_values(measure, x, y[None, :])[:, 0])  # as permutation_means keeps them
            if not finite.any():
                continue
            mean, var = _block_moments(measure, x[finite], y)
            units = np.asarray(block.units)[finite]
            local_mean[units] += mean
            local_var[units] += var
            count[units] += 1
        seen = count > 0
        mean_sum[seen] += local_mean[seen] / count[seen]
        var_sum[seen] += local_var[seen] / count[seen] ** 2
        n += seen
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = mean_sum / n
        sd = np.sqrt(var_sum) / n
    mean[n == 0] = np.nan
    sd[n == 0] = np.nan
    return mean, sd


def mc_interval(p: np.ndarray, draws: int, risk: float) -> tuple[np.ndarray, np.ndarray]:
    """The two-sided Clopper-Pearson interval, at level ``1 - risk``, of the p-value a permutation
    test estimates as ``p = (1 + k) / (draws + 1)`` (``k`` of ``draws`` random rankings at least as
    extreme): ``(low [U], high [U])``, NaN where ``p`` is NaN."""
    from scipy.special import betaincinv  # the beta distribution's quantile, without importing scipy.stats

    p = np.asarray(p, dtype=np.float64)
    k = np.clip(np.rint(p * (draws + 1)) - 1, 0, draws)
    with np.errstate(invalid="ignore", divide="ignore"):
        low = np.where(k > 0, betaincinv(np.maximum(k, 1), draws - k + 1, risk / 2), 0.0)
        high = np.where(k < draws, betaincinv(k + 1, np.maximum(draws - k, 1), 1 - risk / 2), 1.0)
    bad = ~np.isfinite(p)
    low[bad] = np.nan
    high[bad] = np.nan
    return low, high
