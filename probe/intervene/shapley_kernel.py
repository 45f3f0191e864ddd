"""Shapley values by regression (KernelSHAP with paired sampling and the efficiency constraint).

The Shapley values of ``n`` players solve a weighted least-squares problem: among all additive
games ``u(S) = v(empty) + sum of beta_i over i in S`` whose total ``sum(beta)`` equals
``v(N) - v(empty)``, they are the one closest to ``v`` when each coalition ``S`` (neither empty nor
full) is weighted by the Shapley kernel ``(n - 1) / (C(n, |S|) |S| (n - |S|))``. Written with the
presence vector ``z`` of ``S`` and ``y(S) = v(S) - v(empty)``, the normal equations of that problem
are ``A beta + nu 1 = b`` with ``A = E[z z^T]``, ``b = E[z y(z)]`` (``E`` over the kernel's
distribution) and ``1^T beta = v(N) - v(empty)``.

This module estimates ``A`` and ``b`` from a budget of coalitions and solves that constrained
system exactly, so the estimate meets efficiency (its values sum to ``v(N) - v(empty)``) to float
rounding whatever the budget. How the coalitions are chosen:

* **Sizes by the kernel.** The kernel's mass of size ``s`` is proportional to ``1 / (s (n - s))``:
  most of it sits on the smallest and the largest coalitions, which are also the fewest.
* **Enumerated where the budget covers a size.** Sizes come in classes ``{s, n - s}``, taken from the
  outside in (``s = 1, 2, ...``). While the share of the remaining budget that the class's mass would
  draw is at least the class's number of coalitions, every coalition of the class is a row and
  enters ``A`` and ``b`` with its exact kernel weight (no sampling noise from it). With the budget of
  all ``2^n`` coalitions every class is enumerated and the values are exact.
* **Sampled in complementary pairs** from the classes left (Covert & Lee 2021, "Improving
  KernelSHAP"): a size from the kernel, a uniform coalition of that size, and its complement. A
  pair's terms ``(z z^T + z' z'^T) / 2`` and ``(z y(z) + z' y(z')) / 2`` are averaged over pairs and
  scaled by the classes' mass. Complements cancel much of the noise that a player's presence and
  absence carry in opposite directions. The draws are prefix-consistent: a larger budget with the
  same generator draws the same pairs first (a pilot's rows are then reused from the engine's cache).

**Standard errors** are the linearisation (delta method) of the solution in the sampled terms: with
``M`` the block of the inverse of the constrained system that maps ``b`` to ``beta``, an error
``delta g = delta b - delta A beta`` in the averaged terms moves the solution by ``M delta g``. Each
pair gives ``g_k = m (b_k - A_k beta_hat)`` (``m`` the sampled classes' mass); the covariance of
``beta_hat`` is ``M Cov(g_k) M^T / pairs``, the square root of its diagonal the standard error. This
is the variance estimate Covert & Lee use for the paired estimator, with the estimated rather than
the exact ``A``; enumerated classes contribute no variance, and with every class enumerated the
standard errors are 0. ``tests/test_shapley_kernel.py`` checks them against the spread over seeds.

Pure numpy; the rows are run by :mod:`probe.intervene.shapley` through the shared engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

__all__ = ["KernelPlan", "kernel_plan", "kernel_values", "size_mass"]


@dataclass(frozen=True)
class KernelPlan:
    """One example's regression coalitions: ``coalitions`` ``[distinct, n]`` bool; ``empty`` and
    ``full`` their indices; ``enumerated`` ``[k]`` indices of the coalitions of the enumerated classes
    with ``weights`` ``[k]`` their kernel probabilities; ``pairs`` ``[pairs, 2]`` indices of each
    sampled coalition and its complement, ``strata`` ``[pairs]`` the class it was drawn from and
    ``carried`` ``[pairs]`` the kernel probability it stands for (its class's over the class's pairs)."""

    coalitions: np.ndarray
    empty: int
    full: int
    enumerated: np.ndarray
    weights: np.ndarray
    pairs: np.ndarray
    strata: np.ndarray
    carried: np.ndarray

    @property
    def sampled_mass(self) -> float:
        """The kernel probability of the sampled classes (0 when every class is enumerated)."""
        return float(self.carried.sum())


def size_mass(n: int) -> np.ndarray:
    """``[n + 1]`` the kernel's probability of a coalition size: 0 for the empty and the full one,
    else proportional to ``1 / (s (n - s))``."""
    mass = np.zeros(n + 1)
    if n >= 2:
        s = np.arange(1, n)
        mass[1:n] = 1.0 / (s * (n - s))
        mass /= mass.sum()
    return mass


def _classes(n: int) -> list[tuple[int, ...]]:
    """The size classes ``{s, n - s}``, from the outside in."""
    return [(s,) if 2 * s == n else (s, n - s) for s in range(1, n // 2 + 1)]


def _enumerated_classes(n: int, budget: int, mass: np.ndarray) -> int:
    """How many classes (from the outside in) the budget covers in full."""
    left, left_mass, taken = budget, 1.0, 0
    for sizes in _classes(n):
        count = sum(math.comb(n, s) for s in sizes)
        share = float(sum(mass[s] for s in sizes))
        if left_mass <= 0 or left * share / left_mass < count:
            break
        left, left_mass, taken = left - count, left_mass - share, taken + 1
    return taken


def _class_pairs(n: int, sizes: tuple[int, ...], pairs: int, rng: np.random.Generator) -> np.ndarray:
    """``[pairs, n]`` bool: distinct coalitions of size ``sizes[0]`` drawn uniformly without
    replacement (a coalition and its complement are one pair; for ``n = 2 s`` either names it). One
    generator call per chunk of ``n`` numbers a draw, so fewer pairs are a prefix of more."""
    s = sizes[0]
    kept: list[np.ndarray] = []
    seen: set[bytes] = set()
    while len(kept) < pairs:
        raw = rng.random((max(16, 2 * (pairs - len(kept))), n))  # [draws, n]
        for row in np.argsort(raw, axis=1)[:, :s]:
            chosen = np.zeros(n, dtype=bool)
            chosen[row] = True
            key = min(chosen.tobytes(), (~chosen).tobytes()) if len(sizes) == 1 else chosen.tobytes()
            if key not in seen:
                seen.add(key)
                kept.append(chosen)
                if len(kept) == pairs:
                    break
    return np.array(kept, dtype=bool).reshape(-1, n)


def _stratified_pairs(n: int, left: int, taken: int, mass: np.ndarray, seeds: list[int]
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``([pairs, n] coalitions, [pairs] class of each, [pairs] kernel probability each pair carries)``
    for the classes after the first ``taken``: each class one pair, the rest of the ``left // 2``
    pairs shared in proportion to the classes' mass (rounded down: a larger budget never gives a class
    fewer pairs), each class from its own generator."""
    classes = _classes(n)[taken:]
    shares = np.array([float(sum(mass[s] for s in sizes)) for sizes in classes])
    spare = max(0, left // 2 - len(classes))
    drawn, strata, carried = [], [], []
    for c, (sizes, share) in enumerate(zip(classes, shares)):
        possible = math.comb(n, sizes[0]) // (2 if len(sizes) == 1 else 1)
        count = min(possible, 1 + int(spare * share / shares.sum()))
        drawn.append(_class_pairs(n, sizes, count, np.random.default_rng([*seeds, 2, taken + c])))
        strata.extend([c] * count)
        carried.extend([share / count] * count)
    if not drawn:
        return np.zeros((0, n), dtype=bool), np.zeros(0, dtype=np.int64), np.zeros(0)
    return np.concatenate(drawn), np.array(strata), np.array(carried)


def kernel_plan(n: int, rows: int, seeds: list[int]) -> KernelPlan:
    """The coalitions of a budget of ``rows`` (the empty and the full one included): the classes the
    budget covers enumerated, the rest sampled in complementary pairs, stratified by class (each
    class's draws from a generator seeded by ``seeds`` and the class)."""
    mass = size_mass(n)
    budget = max(0, rows - 2)
    taken = _enumerated_classes(n, budget, mass)
    enumerated: list[np.ndarray] = []
    weights: list[float] = []
    for sizes in _classes(n)[:taken]:
        for s in sizes:
            for members in combinations(range(n), s):
                row = np.zeros(n, dtype=bool)
                row[list(members)] = True
                enumerated.append(row)
                weights.append(mass[s] / math.comb(n, s))
    drawn, strata, carried = _stratified_pairs(n, budget - len(enumerated), taken, mass, seeds)
    every = np.concatenate([np.zeros((1, n), bool), np.ones((1, n), bool),
                            np.array(enumerated, dtype=bool).reshape(-1, n), drawn, ~drawn])  # [asked, n]
    width = max(1, (n + 7) // 8)
    packed = np.packbits(every, axis=1) if n else np.zeros((len(every), 1), np.uint8)  # [asked, bytes]
    keys = np.ascontiguousarray(packed).view(np.dtype((np.void, width)))[:, 0]
    _, first_seen, inverse = np.unique(keys, return_index=True, return_inverse=True)
    k, m = len(enumerated), len(drawn)
    return KernelPlan(every[first_seen], int(inverse[0]), int(inverse[1]), inverse[2:2 + k], np.asarray(weights),
                      np.stack([inverse[2 + k:2 + k + m], inverse[2 + k + m:]], axis=1), strata, carried)


def kernel_values(values: np.ndarray, plan: KernelPlan) -> tuple[np.ndarray, np.ndarray]:
    """``([n] values, [n] standard errors)`` from ``values`` ``[distinct]`` = v of each of the plan's
    coalitions: the constrained least-squares solution and its linearised standard errors (see the
    module docstring). Standard errors are NaN when fewer than two pairs were sampled from a class
    that is not enumerated."""
    z = plan.coalitions.astype(np.float64)  # [distinct, n]
    n = z.shape[1]
    empty, total = values[plan.empty], values[plan.full] - values[plan.empty]
    if n <= 1:
        return np.full(n, total), np.zeros(n)
    y = values - empty  # [distinct]
    zs, ys = z[plan.enumerated], y[plan.enumerated]  # [k, n], [k]
    a = (zs * plan.weights[:, None]).T @ zs  # [n, n]
    b = zs.T @ (plan.weights * ys)  # [n]
    first, second = z[plan.pairs[:, 0]], z[plan.pairs[:, 1]]  # [pairs, n]
    half = 0.5 * plan.carried  # [pairs]
    a += (first * half[:, None]).T @ first + (second * half[:, None]).T @ second
    b += first.T @ (half * y[plan.pairs[:, 0]]) + second.T @ (half * y[plan.pairs[:, 1]])
    system = np.zeros((n + 1, n + 1))  # [beta, nu] x [beta, nu]: the normal equations and the constraint
    system[:n, :n], system[:n, n], system[n, :n] = a, 1.0, 1.0
    inverse = np.linalg.pinv(system)
    beta = inverse[:n, :n] @ b + inverse[:n, n] * total
    if len(plan.pairs) == 0:
        return beta, np.zeros(n)
    # g_k = carried_k (b_k - A_k beta): summed over pairs it is the error of the system's terms
    g = half[:, None] * (first * (y[plan.pairs[:, 0]] - first @ beta)[:, None]
                         + second * (y[plan.pairs[:, 1]] - second @ beta)[:, None])  # [pairs, n]
    spread = _within_class(g, plan.strata) @ inverse[:n, :n].T  # [rows, n]
    if not len(spread):
        return beta, np.full(n, np.nan)
    return beta, np.sqrt((spread ** 2).sum(axis=0))


def _within_class(g: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """Rows whose outer products sum to the estimated covariance of ``g.sum(0)`` under sampling
    within classes: each class's deviations from its mean, scaled by ``sqrt(m / (m - 1))``. Classes of
    a single pair have no spread of their own: they are pooled into one class (an approximation)."""
    counts = np.bincount(strata)
    groups = np.where(counts[strata] > 1, strata, -1)  # single-pair classes pooled as -1
    rows = []
    for group in np.unique(groups):
        member = g[groups == group]  # [m, n]
        if len(member) < 2:
            continue
        rows.append((member - member.mean(axis=0)) * math.sqrt(len(member) / (len(member) - 1)))
    return np.concatenate(rows) if rows else np.zeros((0, g.shape[1]))
