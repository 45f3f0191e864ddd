"""Statistics over a dataset of per-example agreement values.

Non-finite values (NaN, e.g. the Kendall tau of a constant row, or +-inf) are dropped before
anything is computed. Bootstrap confidence intervals are percentile intervals of the mean, drawn
as one ``[n_boot, n]`` index matrix from ``np.random.default_rng(seed)``; the values are sorted
first, so a result depends only on the multiset of values and the seed, never on row order.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from collections.abc import Hashable

    from numpy.typing import ArrayLike

__all__ = [
    "bootstrap_ci",
    "group_seed",
    "holm",
    "paired_bootstrap_ci",
    "paired_t_p",
    "paired_test",
    "summarize",
    "summarize_groups",
    "wilcoxon_method",
    "wilcoxon_p",
]

# bootstrap rows whose gathered values are averaged at once (bounds the temporary memory)
_BOOT_BLOCK_ELEMENTS = 1 << 22


def _vector(values: ArrayLike, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim > 1:
        raise ValueError(f"{name} must be a 1-D array of per-example values, got shape {v.shape}")
    return v.reshape(-1)


def _check_boot(n_boot: int, level: float) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _percentile_ci(v: np.ndarray, n_boot: int, level: float, seed: int) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of the finite, sorted 1-D array ``v``."""
    return _percentile_cis(v, n_boot, (level,), seed)[0]


def _percentile_cis(v: np.ndarray, n_boot: int, levels, seed: int) -> list[tuple[float, float]]:
    """:func:`_percentile_ci` at each of ``levels``, from one set of resamples."""
    n = v.size
    if n < 2:
        return [(float("nan"), float("nan")) for _ in levels]
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    means = np.empty(n_boot)
    step = max(1, _BOOT_BLOCK_ELEMENTS // n)
    for lo in range(0, n_boot, step):
        means[lo : lo + step] = np.take(v, idx[lo : lo + step]).mean(axis=1)
    tails = [(1.0 - level) / 2.0 for level in levels]
    bounds = np.quantile(means, [q for tail in tails for q in (tail, 1.0 - tail)])
    return [(float(bounds[2 * i]), float(bounds[2 * i + 1])) for i in range(len(tails))]


def bootstrap_ci(values: ArrayLike, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of a 1-D array.

    Non-finite values are dropped first; ``(nan, nan)`` when fewer than 2 remain. The
    resamples are one ``rng.integers(0, n, size=(n_boot, n))`` draw with
    ``rng = np.random.default_rng(seed)`` over the sorted values; the bounds are the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (linear interpolation) of the
    ``n_boot`` resample means.
    """
    _check_boot(n_boot, level)
    v = _vector(values, "values")
    return _percentile_ci(np.sort(v[np.isfinite(v)]), n_boot, level, seed)


def _pairs(a: ArrayLike, b: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """a and b restricted to the pairs where both are finite."""
    a = _vector(a, "a")
    b = _vector(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must be paired (same length), got {a.shape} and {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    return a[ok], b[ok]


def paired_bootstrap_ci(
    a: ArrayLike, b: ArrayLike, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap CI of mean(a - b) over the pairs where both a and b are finite.

    Same resampling as :func:`bootstrap_ci` applied to the differences.
    """
    _check_boot(n_boot, level)
    a, b = _pairs(a, b)
    return _percentile_ci(np.sort(a - b), n_boot, level, seed)


def paired_test(a: ArrayLike, b: ArrayLike, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                one_sided_alpha: float | None = None) -> dict:
    """Compare paired per-example values a and b (e.g. two explainers on the same examples).

    On the pairs where both are finite: ``n``, ``mean_diff`` (mean of a - b), ``ci_low`` /
    ``ci_high`` (:func:`paired_bootstrap_ci`), ``wilcoxon_p`` (two-sided
    signed-rank test, :func:`wilcoxon_p`: exact or normal with the tie correction as
    :func:`wilcoxon_method` chooses; 1.0 when every difference is zero) and ``t_p`` (the paired t-test,
    :func:`paired_t_p`). The two p-values are scipy.stats' ``wilcoxon`` and ``ttest_rel``, computed here
    from scipy.special (``tests/test_statistics.py`` holds them to scipy.stats): importing scipy.stats
    costs half a second a study would pay for two numbers (issue 63).
    Both p-values are NaN when n < 2. With ``one_sided_alpha``, also ``one_sided_low`` /
    ``one_sided_high``: the bounds of the interval at 1 - 2 alpha from the same resamples (each a
    one-sided test at alpha; :func:`paired_bootstrap_ci` at that level gives the same).
    """
    _check_boot(n_boot, level)
    a, b = _pairs(a, b)
    d = a - b
    n = int(d.size)
    d_sorted = np.sort(d)
    levels = (level,) if one_sided_alpha is None else (level, 1.0 - 2.0 * one_sided_alpha)
    intervals = _percentile_cis(d_sorted, n_boot, levels, seed)
    low, high = intervals[0]
    wil = t_p = float("nan")
    if n >= 2:
        wil = 1.0 if not d.any() else wilcoxon_p(d, wilcoxon_method(d))
        t_p = paired_t_p(d)
    out = {
        "n": n,
        "mean_diff": float(d_sorted.mean()) if n else float("nan"),
        "ci_low": low,
        "ci_high": high,
        "wilcoxon_p": wil,
        "t_p": t_p,
    }
    if one_sided_alpha is not None:
        out["one_sided_low"], out["one_sided_high"] = intervals[1]
    return out


def wilcoxon_p(d: ArrayLike, method: str) -> float:
    """The two-sided Wilcoxon signed-rank p-value of the paired differences ``d`` (zeros dropped,
    Wilcoxon's convention; no continuity correction), as ``scipy.stats.wilcoxon(d, method=...)``
    gives it: ``"exact"`` the exact null of the signed ranks (no zero, no tied magnitude),
    ``"approx"`` the normal approximation with the tie correction of its variance."""
    from scipy import special

    d = np.asarray(d, dtype=np.float64)
    d = d[d != 0]
    count = float(d.size)
    _, inverse, ties = np.unique(np.abs(d), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(ties) - (ties - 1) / 2.0)[inverse.reshape(-1)]  # average ranks, 1-based
    r_plus = float(np.sum((d > 0) * ranks))
    mean = count * (count + 1.0) * 0.25
    if method == "exact":
        pmf = _signed_rank_pmf(d.size)
        low, high = int(np.ceil(r_plus)), int(np.floor(r_plus))
        cdf = pmf[:low + 1].sum() if low <= mean else 1 - pmf[low + 1:].sum()
        sf = pmf[high:].sum() if high <= mean else 1 - pmf[:high].sum()
        return float(np.clip(2 * min(sf, cdf), 0, 1))
    variance = count * (count + 1.0) * (2.0 * count + 1.0)
    se = np.sqrt((variance - float(np.sum(ties.astype(np.float64) ** 3 - ties)) / 2) / 24)
    return float(2 * special.ndtr(-abs((r_plus - mean) / se)))


def _signed_rank_pmf(n: int) -> np.ndarray:
    """The null distribution of the sum of the positive ranks of n signed ranks: P(W = 0..n(n+1)/2)."""
    pmf = np.ones(1, dtype=np.float64)
    for k in range(1, n + 1):
        before = pmf
        pmf = np.zeros(k * (k + 1) // 2 + 1, dtype=np.float64)
        pmf[:before.size] = before * 0.5
        pmf[-before.size:] += before * 0.5
    return pmf


def paired_t_p(d: ArrayLike) -> float:
    """The two-sided paired t-test's p-value for the differences ``d``, as ``scipy.stats.ttest_rel``
    gives it: NaN when every difference is zero, 0 when they are equal and not zero."""
    from scipy import special

    d = np.asarray(d, dtype=np.float64)
    n = d.size
    mean = d.mean()
    variance = np.mean((d - mean) ** 2) * (n / (n - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = mean / np.sqrt(variance / n)
    return float(2 * special.stdtr(n - 1, -abs(t)))


#: the largest n for which the Wilcoxon signed-rank p-value is exact (scipy's own limit for 'auto')
WILCOXON_EXACT_MAX_N = 50


def wilcoxon_method(d: ArrayLike) -> str:
    """The ``method`` :func:`paired_test` hands ``scipy.stats.wilcoxon`` for the differences ``d``:
    ``"exact"`` when no difference is zero, no two magnitudes tie and n <= 50 (the exact null of the
    signed ranks, a table lookup); otherwise ``"approx"``, the normal approximation whose variance
    scipy corrects for tied ranks (zeros dropped, Wilcoxon's convention). With ties or zeros scipy's
    default enumerates every sign pattern instead (seconds at n = 13, growing as 2^n), for a p-value
    the approximation gives to a few percent."""
    d = np.asarray(d, dtype=np.float64)
    magnitudes = np.abs(d[d != 0])
    ties = magnitudes.size != np.unique(magnitudes).size
    return "exact" if magnitudes.size == d.size and not ties and d.size <= WILCOXON_EXACT_MAX_N else "approx"


def summarize(
    values: ArrayLike,
    p_values: ArrayLike | None = None,
    *,
    alpha: float = 0.05,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """Summary of per-example values (e.g. one Kendall tau per example).

    ``n`` (number of finite values), ``mean``, ``std`` (ddof=1; NaN when n < 2), ``ci_low`` /
    ``ci_high`` (:func:`bootstrap_ci`). With ``p_values`` (one per value): ``sig_frac``, the
    fraction of examples with p <= alpha (Jain & Wallace's "Sig. Frac."), and ``sig_pos_frac``,
    the fraction with p <= alpha and value > 0; both over the examples whose value and p-value
    are finite (NaN when there are none).
    """
    _check_boot(n_boot, level)
    v = _vector(values, "values")
    fin = np.isfinite(v)
    vs = np.sort(v[fin])
    n = int(vs.size)
    low, high = _percentile_ci(vs, n_boot, level, seed)
    out = {
        "n": n,
        "mean": float(vs.mean()) if n else float("nan"),
        "std": float(vs.std(ddof=1)) if n >= 2 else float("nan"),
        "ci_low": low,
        "ci_high": high,
    }
    if p_values is not None:
        p = _vector(p_values, "p_values")
        if p.shape != v.shape:
            raise ValueError(f"p_values must match values, got {p.shape} and {v.shape}")
        ok = fin & np.isfinite(p)
        sig = p[ok] <= alpha
        m = int(ok.sum())
        out["sig_frac"] = float(sig.sum() / m) if m else float("nan")
        out["sig_pos_frac"] = float((sig & (v[ok] > 0)).sum() / m) if m else float("nan")
    return out


def _canonical(value):
    """A group-key element as a plain Python value, so its repr is stable across dtypes."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def group_seed(key: Hashable, seed: int = 0) -> int:
    """The bootstrap seed :func:`summarize_groups` uses for the group ``key`` (a tuple of values).

    A stable hash (BLAKE2b) of ``seed`` and the key's values, so it does not depend on the
    group's position in the frame, the Python process, or which other groups are present.
    """
    if not isinstance(key, tuple):
        key = (key,)
    text = repr((int(seed), tuple(_canonical(k) for k in key)))
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def summarize_groups(
    df: pd.DataFrame,
    by: list[str],
    value: str,
    p_value: str | None = None,
    **kw: float,
) -> pd.DataFrame:
    """One :func:`summarize` row per group of ``df`` grouped by the ``by`` columns.

    Returns the ``by`` columns plus summarize()'s keys, groups in sorted key order. ``kw`` goes to
    summarize (``alpha``, ``n_boot``, ``level``, ``seed``); each group is bootstrapped with
    ``group_seed(key, seed)``, so a group's numbers do not depend on the other groups or on row
    order: summarizing a subset of the groups gives the same rows.
    """
    by = [by] if isinstance(by, str) else list(by)
    seed = kw.pop("seed", 0)
    unknown = set(kw) - {"alpha", "n_boot", "level"}
    if unknown:
        raise TypeError(f"summarize_groups got unexpected keyword(s): {sorted(unknown)}")
    missing = [c for c in [*by, value] + ([p_value] if p_value else []) if c not in df.columns]
    if missing:
        raise ValueError(f"columns not in the frame: {missing}")
    v = df[value].to_numpy(dtype=np.float64)
    p = df[p_value].to_numpy(dtype=np.float64) if p_value else None

    gb = df.groupby(by, sort=True, dropna=False, observed=True)
    codes = gb.ngroup().to_numpy()
    sizes = gb.size()
    index = sizes.index
    keys = list(index) if isinstance(index, pd.MultiIndex) else [(k,) for k in index]
    order = np.argsort(codes, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(sizes.to_numpy())])

    rows = []
    for g, key in enumerate(keys):
        pos = order[bounds[g] : bounds[g + 1]]
        res = summarize(v[pos], None if p is None else p[pos], seed=group_seed(key, seed), **kw)
        rows.append({**dict(zip(by, key)), **res})
    columns = [*by, "n", "mean", "std", "ci_low", "ci_high"]
    if p_value:
        columns += ["sig_frac", "sig_pos_frac"]
    return pd.DataFrame(rows, columns=columns)


def holm(p_values: ArrayLike) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values, same shape as the input; NaN stays NaN.

    With the m non-NaN p-values sorted ascending, p_(1) <= ... <= p_(m), the adjusted value of
    p_(i) is max over j <= i of min(1, (m - j + 1) p_(j)).
    """
    p = np.asarray(p_values, dtype=np.float64)
    flat = p.reshape(-1)
    keep = ~np.isnan(flat)
    if ((flat[keep] < 0) | (flat[keep] > 1)).any():
        raise ValueError("p-values must lie in [0, 1]")
    out = np.full(flat.shape, np.nan)
    where = np.flatnonzero(keep)
    ps = flat[where]
    m = ps.size
    if m:
        order = np.argsort(ps, kind="stable")
        adj = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ps[order]))
        out[where[order]] = adj
    return out.reshape(p.shape)
