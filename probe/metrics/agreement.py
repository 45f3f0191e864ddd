"""Rank agreement between an explainer's token scores and a reference's token scores.

Every function takes ``x`` as ``[M, T]`` (M score rows over the same T tokens, e.g. one row per
layer x head) or ``[T]``, and ``y`` (the reference) as ``[T]`` (compared with every row of ``x``)
or with the same shape as ``x`` (row against row). Results are float64 arrays of shape ``[M]``
(``[1]`` for a ``[T]`` input). Higher score = more important everywhere.

Kendall's tau-b and Spearman's rho reproduce ``scipy.stats.kendalltau`` (variant 'b', method
'auto', two-sided) and ``scipy.stats.spearmanr`` row by row, p-values included, but vectorised
over rows so that a study's ~10^6 comparisons stay cheap. A row where ``x`` or ``y`` is constant
(or T < 2) gets NaN statistic and p-value, as scipy gives.

Positions where ``x`` or ``y`` is NaN are refused (``ValueError``): the caller removes unscored
positions (padding, special tokens) before calling. Infinite scores are ranked like any value.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from scipy import special

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["agreement", "kendall_tau_b", "spearman", "top_k_overlap"]

# scipy's method='auto' uses the exact null distribution (no ties only) up to this many samples
_EXACT_MAX_N = 33
# upper bound on the elements of one [rows, pairs] sign block (float32), i.e. 16 MiB
_BLOCK_ELEMENTS = 1 << 22


class _Ranks(NamedTuple):
    """Per-row rank information of a [R, T] array (R = 1 for a shared reference)."""

    dense: np.ndarray  # [R, T] float64 dense ranks 1..k (equal values share a rank)
    average: np.ndarray  # [R, T] float64 average ranks (scipy.stats.rankdata 'average')
    tie_pairs: np.ndarray  # [R] int64 number of tied pairs, sum over groups of c(c-1)/2
    tie_v0: np.ndarray  # [R] int64 sum over groups of c(c-1)(c-2)
    tie_v1: np.ndarray  # [R] int64 sum over groups of c(c-1)(2c+5)


def _check(a: np.ndarray, name: str) -> None:
    bad = np.isnan(a)
    if bad.any():
        where = np.argwhere(bad)[0]
        at = f"position {where[-1]}" + (f" of row {where[0]}" if a.ndim == 2 else "")
        raise ValueError(
            f"{name} has {int(bad.sum())} NaN score(s) (first at {at}); remove unscored positions "
            "(padding, special tokens) before computing agreement"
        )


def _prepare(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """x as float64 [M, T]; y as float64 [1, T] (shared reference) or [M, T]."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"x must be [T] or [M, T] scores, got shape {x.shape}")
    if y.ndim not in (1, 2):
        raise ValueError(f"y must be [T] or [M, T] scores, got shape {y.shape}")
    if y.shape[-1] != x.shape[1]:
        raise ValueError(f"x and y cover different token counts: x {x.shape}, y {y.shape}")
    if y.ndim == 2 and y.shape != x.shape:
        raise ValueError(f"a 2-D y must have x's shape: x {x.shape}, y {y.shape}")
    _check(x, "x")
    _check(y, "y")
    return x, (y[None, :] if y.ndim == 1 else y)


def _ranks(a: np.ndarray) -> _Ranks:
    """Dense and average ranks of each row of a [R, T] array, and its tie-group statistics."""
    rows, t = a.shape
    order = np.argsort(a, axis=1, kind="stable")
    s = np.take_along_axis(a, order, axis=1)
    starts = np.ones((rows, t), dtype=bool)  # sorted position opens a group of equal values
    starts[:, 1:] = s[:, 1:] != s[:, :-1]
    ends = np.ones((rows, t), dtype=bool)  # sorted position closes a group
    ends[:, :-1] = starts[:, 1:]
    pos = np.arange(t)
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
    last = np.minimum.accumulate(np.where(ends, pos, t - 1)[:, ::-1], axis=1)[:, ::-1]
    size = (last - first + 1).astype(np.int64)  # size of the group each sorted position is in

    dense = np.empty((rows, t))
    average = np.empty((rows, t))
    np.put_along_axis(dense, order, np.cumsum(starts, axis=1), axis=1)
    np.put_along_axis(average, order, (first + last) / 2.0 + 1.0, axis=1)
    # a group of c equal values appears c times, so summing f(c)/c over positions sums f(c)
    c1 = size - 1
    tie_pairs = c1.sum(axis=1) // 2
    tie_v0 = (c1 * (size - 2)).sum(axis=1)
    tie_v1 = (c1 * (2 * size + 5)).sum(axis=1)
    return _Ranks(dense, average, tie_pairs, tie_v0, tie_v1)


def _pair_signs(dense: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """sign(r_j - r_i) over the pairs (i, j), i < j, as float32 (ranks and signs are exact)."""
    d = dense.astype(np.float32)
    return np.sign(d[:, j] - d[:, i])


def _concordance(rx: _Ranks, ry: _Ranks) -> np.ndarray:
    """Concordant minus discordant pairs per row, int64 [M]."""
    m, t = rx.dense.shape
    out = np.zeros(m, dtype=np.int64)
    if t < 2:
        return out
    i, j = np.triu_indices(t, 1)
    shared = ry.dense.shape[0] == 1
    sy = _pair_signs(ry.dense, i, j)[0] if shared else None
    step = max(1, _BLOCK_ELEMENTS // i.size)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        sx = _pair_signs(rx.dense[lo:hi], i, j)
        if shared:
            s = sx @ sy  # float32 sums of +-1 are exact below 2**24 pairs (T < 5793)
        else:
            s = np.einsum("rp,rp->r", sx, _pair_signs(ry.dense[lo:hi], i, j))
        out[lo:hi] = np.rint(s).astype(np.int64)
    return out


@functools.cache
def _exact_p_table(n: int) -> np.ndarray:
    """Two-sided exact p-value of Kendall's tau (no ties) for c = min(con, dis) = 0..tot // 2.

    Mirrors scipy.stats._mstats_basic._kendall_p_exact branch by branch (including its float
    recurrence for the number of permutations with c inversions), so values agree to rounding.
    """
    tot = n * (n - 1) // 2
    cmax = tot // 2
    out = np.empty(cmax + 1)
    if n <= 2:
        out[:] = 1.0
        return out
    # counts[c] = number of permutations of n items with c inversions (Mahonian numbers),
    # built with the same cumulative-sum recurrence as scipy (prefixes are bit-identical)
    counts = np.zeros(cmax + 1)
    counts[0:2] = 1.0
    for k in range(3, n + 1):
        counts = np.cumsum(counts)
        if k <= cmax:
            counts[k:] -= counts[: cmax + 1 - k]
    fact = math.factorial(n)
    for c in range(cmax + 1):
        if c == 0:
            out[c] = 2.0 / fact
        elif c == 1:
            out[c] = 2.0 / math.factorial(n - 1)
        elif 4 * c == n * (n - 1):
            out[c] = 1.0
        else:
            out[c] = 2.0 * np.sum(counts[: c + 1]) / fact
    return np.clip(out, 0.0, 1.0)


def _exact_p(n: int, c: np.ndarray) -> np.ndarray:
    """Exact two-sided p for rows with c = min(con, dis) (c <= 1 whenever n > 33)."""
    if n <= _EXACT_MAX_N:
        return _exact_p_table(n)[c]
    p0 = 2.0 / math.factorial(n) if n < 171 else 0.0
    p1 = 2.0 / math.factorial(n - 1) if n < 172 else 0.0
    return np.where(c == 0, p0, p1)


def _kendall(rx: _Ranks, ry: _Ranks) -> tuple[np.ndarray, np.ndarray]:
    m, n = rx.dense.shape
    tau = np.full(m, np.nan)
    p = np.full(m, np.nan)
    if n < 2:
        return tau, p
    tot = n * (n - 1) // 2
    xtie = rx.tie_pairs
    ytie = np.broadcast_to(ry.tie_pairs, (m,))
    ok = (xtie != tot) & (ytie != tot)  # neither side constant
    if not ok.any():
        return tau, p
    cmd = _concordance(rx, ry)  # concordant - discordant

    with np.errstate(divide="ignore", invalid="ignore"):
        t = cmd / np.sqrt(tot - xtie) / np.sqrt(tot - ytie)
    tau[ok] = np.clip(t[ok], -1.0, 1.0)

    # scipy 'auto': exact null distribution when there are no ties and either n <= 33 or the
    # smaller of (concordant, discordant) is at most 1; otherwise the tie-corrected normal
    # approximation of con - dis
    no_ties = (xtie == 0) & (ytie == 0) & ok
    con = (tot + cmd) // 2  # valid only without ties
    c = np.minimum(con, tot - con)
    exact = no_ties & ((n <= _EXACT_MAX_N) | (c <= 1))
    if exact.any():
        p[exact] = _exact_p(n, c[exact])
    asym = ok & ~exact
    if asym.any():
        x0 = rx.tie_v0[asym].astype(np.float64)
        x1 = rx.tie_v1[asym].astype(np.float64)
        y0 = np.broadcast_to(ry.tie_v0, (m,))[asym].astype(np.float64)
        y1 = np.broadcast_to(ry.tie_v1, (m,))[asym].astype(np.float64)
        xt = xtie[asym].astype(np.float64)
        yt = ytie[asym].astype(np.float64)
        mm = n * (n - 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            var = (mm * (2 * n + 5) - x1 - y1) / 18 + (2 * xt * yt) / mm + x0 * y0 / (9 * mm * (n - 2))
            z = cmd[asym] / np.sqrt(var)
        p[asym] = 2 * special.ndtr(-np.abs(z))
    return tau, p


def _spearman(rx: _Ranks, ry: _Ranks) -> tuple[np.ndarray, np.ndarray]:
    m, n = rx.dense.shape
    rho = np.full(m, np.nan)
    p = np.full(m, np.nan)
    if n < 2:
        return rho, p
    tot = n * (n - 1) // 2
    ok = (rx.tie_pairs != tot) & (np.broadcast_to(ry.tie_pairs, (m,)) != tot)
    if not ok.any():
        return rho, p
    cx = rx.average - rx.average.mean(axis=1, keepdims=True)
    cy = ry.average - ry.average.mean(axis=1, keepdims=True)
    # Centred average ranks are multiples of 1/2, so these sums are exact in any order; the
    # scaling and divisions then follow np.corrcoef's order (which scipy uses) step by step,
    # because near |rho| = 1 with few tokens the p-value amplifies a last-bit difference.
    f = np.true_divide(1, n - 1)
    sxy = np.einsum("rt,rt->r", cx, np.broadcast_to(cy, cx.shape)) * f
    sxx = np.einsum("rt,rt->r", cx, cx) * f
    syy = np.einsum("rt,rt->r", cy, cy) * f
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.clip(sxy / np.sqrt(syy) / np.sqrt(sxx), -1.0, 1.0)
        # as scipy: t statistic with n - 2 degrees of freedom (n = 2 gives a NaN p-value)
        dof = n - 2
        t = r * np.sqrt(np.clip(dof / ((r + 1.0) * (1.0 - r)), 0, None))
        pv = 2 * special.stdtr(dof, -np.abs(t))
    rho[ok] = r[ok]
    p[ok] = pv[ok]
    return rho, p


def _top_k(x: np.ndarray, y: np.ndarray, k: int) -> np.ndarray:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    m, t = x.shape
    if t == 0:
        return np.full(m, np.nan)
    k = min(int(k), t)

    def mask(a: np.ndarray) -> np.ndarray:
        # descending by score; the stable sort keeps equal scores in position order
        top = np.argsort(-a, axis=1, kind="stable")[:, :k]
        out = np.zeros(a.shape, dtype=bool)
        np.put_along_axis(out, top, True, axis=1)
        return out

    return (mask(x) & mask(y)).sum(axis=1) / k


def kendall_tau_b(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Kendall's tau-b and its two-sided p-value per row of ``x`` against ``y``.

    x: [M, T] or [T]; y: [T] or x's shape. Returns ``(tau_b [M], p_value [M])``, equal to
    ``scipy.stats.kendalltau(x[m], y)`` (variant 'b', method 'auto'): the exact p-value when
    neither side has ties and T <= 33 (or at most one pair disagrees / agrees), otherwise the
    normal approximation with scipy's tie-corrected variance. NaN for a constant row or T < 2.
    Memory is O(M T^2) in blocks of rows, fine for T up to a few hundred.
    """
    x, y = _prepare(x, y)
    return _kendall(_ranks(x), _ranks(y))


def spearman(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Spearman's rho and its two-sided p-value per row of ``x`` against ``y``.

    Same shapes as :func:`kendall_tau_b`; equals ``scipy.stats.spearmanr(x[m], y)``: Pearson
    correlation of average ranks, p-value from Student's t with T - 2 degrees of freedom (NaN
    for T = 2, as scipy). NaN for a constant row or T < 2.
    """
    x, y = _prepare(x, y)
    return _spearman(_ranks(x), _ranks(y))


def top_k_overlap(x: ArrayLike, y: ArrayLike, k: int) -> np.ndarray:
    """|top-k of x ∩ top-k of y| / k per row (higher score = more important).

    k is clipped to T (and the overlap divided by the clipped k); NaN when T = 0. Equal scores
    are broken by position: the lower position ranks first (stable and deterministic), so e.g.
    with scores [1, 3, 3, 0] the top-2 is positions {1, 2} and the top-1 is position {1}.
    """
    x, y = _prepare(x, y)
    return _top_k(x, y, k)


def agreement(x: ArrayLike, y: ArrayLike, *, k: int | Iterable[int] = (1, 3, 5)) -> dict[str, np.ndarray]:
    """All agreement measures of ``x`` ([M, T] or [T]) against ``y`` ([T] or x's shape).

    Returns ``{"kendall_tau", "kendall_p", "spearman", "spearman_p", "top{k}" for each k}``,
    each a float64 array of shape [M] ([1] for a [T] input). Ranks are computed once and shared.
    """
    ks = [k] if isinstance(k, (int, np.integer)) else list(k)
    x, y = _prepare(x, y)
    rx, ry = _ranks(x), _ranks(y)
    tau, tau_p = _kendall(rx, ry)
    rho, rho_p = _spearman(rx, ry)
    out = {"kendall_tau": tau, "kendall_p": tau_p, "spearman": rho, "spearman_p": rho_p}
    for kk in ks:
        out[f"top{int(kk)}"] = _top_k(x, y, kk)
    return out
