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
  enters ``A`` and ``b`` with its exact kernel weight (no sampling noise from it). The first class
  (the ``n`` singletons and the ``n`` leave-one-outs, the most mass) is enumerated earlier, as soon
  as the budget holds it and one pair of every other class. With the budget of all ``2^n``
  coalitions every class is enumerated and the values are exact.
* **Sampled in complementary pairs** from the classes left (Covert & Lee 2021, "Improving
  KernelSHAP"): a size from the kernel, a uniform coalition of that size, and its complement. A
  pair's terms ``(z z^T + z' z'^T) / 2`` and ``(z y(z) + z' y(z')) / 2`` are averaged over pairs and
  scaled by the classes' mass. Complements cancel much of the noise that a player's presence and
  absence carry in opposite directions. The draws are prefix-consistent: a larger budget with the
  same generator draws the same pairs first (a pilot's rows are then reused from the engine's cache).

**A size game as control variate.** The paired regression is exact for games of interactions of
order two at most, and what noise is left comes from higher orders. Much of those, in a classifier's
probability, is saturation: a token's effect shrinks or grows with how many others are present, and
with whether the decisive tokens are. The *size game*
``u(S) = sum over i in S of (a_i + b_i t + c_i t^2 + sum over leaders j in S, j != i, of d_ij t)``,
``t = |S| / n - 1/2``, with the :data:`LEADERS` players of the largest plain-regression values as the
leaders (5n terms), has exact Shapley values in closed form (:func:`size_game_map`). It is
fitted to the plan's coalitions by weighted least squares (kernel weights, every term but ``a``
lightly ridged) and the regression above then runs on what it leaves, ``v - u``: the estimate is
``phi(u) + regression(v - u)``, i.e. the regression of ``v`` corrected by the regression's own error
on ``u`` (a control variate). Efficiency still holds exactly (``phi(u)`` sums to ``u(N)``, the
regression of ``v - u`` to the rest), the values are still exact once every coalition is a row, and
an additive game is still recovered exactly (its other terms fit to 0). It is a bet on that
structure: on a game of random third-order interactions it does worse than the plain regression
(the fit's noise costs more than it takes out), and on a game of order two (where the plain
regression is exact) it is no longer exact. So both are computed (the numpy is cheap beside the
rows) and the one of the smaller mean squared standard error is kept: the plain regression's are 0
on a game of order two, and on MiniLM sentences of 8-12 tokens the size game is kept nine times in
ten, which cuts the mean error at a given budget by about a quarter, the rows to a mean error of 5%
of the value range from about 80 to about 60 per sentence (``benchmarks/bench_shapley.py --accuracy``).

**Standard errors** are the linearisation (delta method) of the solution in the sampled terms: with
``M`` the block of the inverse of the constrained system that maps ``b`` to ``beta``, an error
``delta g = delta b - delta A beta`` in the averaged terms moves the solution by ``M delta g``. Each
pair gives ``g_k = m (b_k - A_k beta_hat)`` (``m`` the sampled classes' mass); the covariance of
``beta_hat`` is ``M Cov(g_k) M^T / pairs``, the square root of its diagonal the standard error. This
is the variance estimate Covert & Lee use for the paired estimator, with the estimated rather than
the exact ``A``; enumerated classes contribute no variance, and with every class enumerated the
standard errors are 0. With the size game each pair's term has a second part, its pull on the
game's fit times what the regression misses of the game (:func:`_influence`). In both, the residuals
are scaled up for the fit's leverage at the pair (:data:`LEVERAGE_POWER`): so scaled, the two are
comparable, and both came within 0.75-1.1x of the spread over seeds at 4-12 order-equivalents on
MiniLM sentences (the unscaled plain ones: 0.72-1.02x). ``tests/test_shapley_kernel.py``
checks them against the spread over seeds.

Pure numpy; the rows are run by :mod:`probe.intervene.shapley` through the shared engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

__all__ = ["LEADERS", "LEVERAGE_POWER", "SIZE_RIDGE", "KernelPlan", "SizeGame", "kernel_plan", "kernel_values",
           "size_game_map", "size_mass", "size_terms"]

#: the size game's ridge (:class:`SizeGame`): the penalty on its size terms, as a share of the fit's
#: total weight. It keeps the fit defined at budgets below its 3n terms; 1e-3 was the best of
#: 3e-4 .. 3e-3 on MiniLM sentences of 8-12 tokens (``benchmarks/bench_shapley.py --accuracy``), and no value changes
#: the values once every coalition is a row.
SIZE_RIDGE = 1e-3
#: how many leaders the size game takes (:class:`SizeGame`): the players of the largest values in the
#: plain regression; 2 cut the error at a given budget by about a twelfth more than none on MiniLM
#: sentences, 3 no further
LEADERS = 2
#: how far the standard errors' residuals are scaled up for a fit's leverage at each pair:
#: ``(I - H_k)^-p r_k``. ``p = 1/2`` (HC2) is unbiased for a fixed fit and ran low with the size game
#: (half the spread over seeds at 4 order-equivalents, where 5n terms meet few pairs), ``p = 1`` (HC3,
#: the left-out residual) high (1.2-1.3x at 4-12); 3/4 came within 0.75-1.10x of the spread at 4, 6
#: and 12 on MiniLM sentences of 8-12 tokens, for the plain regression and the size game alike
LEVERAGE_POWER = 0.75


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
    """How many classes (from the outside in) the budget covers in full: a class while its share of
    the budget left holds all its coalitions; the first (the singletons and the leave-one-outs, the
    class of most mass) as soon as the budget holds it and one pair of every other class."""
    classes = _classes(n)
    left, left_mass, taken = budget, 1.0, 0
    for sizes in classes:
        count = sum(math.comb(n, s) for s in sizes)
        share = float(sum(mass[s] for s in sizes))
        first = taken == 0 and left >= count + 2 * (len(classes) - 1)
        if not first and (left_mass <= 0 or left * share / left_mass < count):
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
    coalitions: the constrained least-squares solution, or the size game's exact values plus that
    solution on what the size game leaves where its standard errors are the smaller, and the
    linearised standard errors (see the module docstring). Standard errors are NaN when fewer than
    two pairs were sampled from a class that is not enumerated (then the plain solution is kept)."""
    z = plan.coalitions.astype(np.float64)  # [distinct, n]
    n = z.shape[1]
    total = values[plan.full] - values[plan.empty]
    if n <= 1:
        return np.full(n, total), np.zeros(n)
    y = values - values[plan.empty]  # [distinct]
    weight = _row_weights(plan)  # [distinct]
    inverse = _constrained_inverse(z, weight)  # [n + 1, n + 1]
    plain = inverse[:n, :n] @ (z.T @ (weight * y)) + inverse[:n, n] * total  # [n]: the regression of v alone
    if n <= 2 or len(plan.pairs) == 0:  # every class enumerated (or too few players for a size game): exact
        return plain, np.zeros(n)
    plain_se = _standard_errors(_plain_influence(z, plan, weight, y - z @ plain, inverse[:n, :n]), plan.strata)
    game_values, game_se = _with_size_game(z, plan, weight, y, inverse, plain)
    if np.mean(game_se ** 2) < np.mean(plain_se ** 2):  # False where either is NaN
        return game_values, game_se
    return plain, plain_se


def _plain_influence(z: np.ndarray, plan: KernelPlan, weight: np.ndarray, residual: np.ndarray,
                     solve: np.ndarray) -> np.ndarray:
    """``[pairs, n]`` each sampled pair's influence on the plain regression: ``solve`` ``[n, n]`` times
    ``g_k = carried_k (z r(z) + z' r(z')) / 2``, the residuals ``r`` scaled for the regression's
    leverage at the pair (:func:`_scaled`; ``solve`` is also the regression's hat matrix's middle)."""
    out = np.zeros((len(plan.pairs), z.shape[1]))
    for part in _chunks(len(plan.pairs)):
        pairs = plan.pairs[part]  # [chunk, 2]
        rows = z[pairs]  # [chunk, 2, n]
        scaled = _scaled(rows, solve, weight[pairs], residual[pairs][:, :, None])[:, :, 0]  # [chunk, 2]
        out[part] = np.einsum("kr,krn->kn", 0.5 * plan.carried[part, None] * scaled, rows) @ solve.T
    return out


def _scaled(terms: np.ndarray, lever: np.ndarray, weight: np.ndarray, residuals: np.ndarray) -> np.ndarray:
    """``[pairs, 2, m]`` residuals at each pair's two rows scaled for a weighted least-squares fit's
    leverage there: ``(I - H_k)^-p r_k``, ``H_k`` the 2 x 2 block of the fit's hat matrix at the pair
    (``terms`` ``[pairs, 2, f]`` the rows' terms, ``lever`` ``[f, f]`` the fit's inverse normal matrix,
    ``weight`` ``[pairs, 2]`` the rows' weights), ``p`` = :data:`LEVERAGE_POWER`."""
    hat = (terms @ lever @ np.swapaxes(terms, 1, 2)) * weight[:, None, :]  # [pairs, 2, 2]
    hat = 0.5 * (hat + np.swapaxes(hat, 1, 2))  # a pair's two rows carry the same weight: symmetric
    scale, basis = np.linalg.eigh(np.eye(2) - hat)  # [pairs, 2], [pairs, 2, 2]
    root = (basis / (np.maximum(scale, 1e-6) ** LEVERAGE_POWER)[:, None, :]) @ np.swapaxes(basis, 1, 2)
    return root @ residuals


def _with_size_game(z: np.ndarray, plan: KernelPlan, weight: np.ndarray, y: np.ndarray, inverse: np.ndarray,
                    plain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([n] values, [n] standard errors)`` of the size game's exact values plus the regression of
    what it leaves (the leaders: the players of the largest ``plain`` values)."""
    n = z.shape[1]
    leaders = tuple(int(j) for j in np.argsort(-np.abs(plain), kind="stable")[:min(LEADERS, n - 2)])
    game = SizeGame.fit(z, weight, y, plan.full, leaders)
    left = y - game.at  # [distinct]: what the size game leaves
    beta = inverse[:n, :n] @ (z.T @ (weight * left)) + inverse[:n, n] * (y[plan.full] - game.at[plan.full])
    # the regression's values of each size term (a linear map of v), and what it misses of them
    weighted = sum((z[rows] * weight[rows, None]).T @ game.terms(z[rows]) for rows in _chunks(len(z)))  # [n, terms]
    regressed = inverse[:n, :n] @ weighted + np.outer(inverse[:n, n], game.terms(z[[plan.full]])[0])
    influence = _influence(z, plan, weight, (left - z @ beta, left), inverse[:n, :n], game,
                           game.exact_map - regressed)  # [pairs, n]
    return game.exact + beta, _standard_errors(influence, plan.strata)


def _standard_errors(influence: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """``[n]`` standard errors from each pair's influence ``[pairs, n]`` (their within-class spread);
    NaN where no class has two pairs."""
    spread = _within_class(influence, strata)  # [rows, n]
    if not len(spread):
        return np.full(influence.shape[1], np.nan)
    return np.sqrt((spread ** 2).sum(axis=0))


def _row_weights(plan: KernelPlan) -> np.ndarray:
    """``[distinct]`` the kernel probability each of the plan's coalitions stands for: an enumerated
    one its own, a sampled one half its pair's (the empty and the full one 0)."""
    weight = np.zeros(len(plan.coalitions))
    weight[plan.enumerated] += plan.weights
    np.add.at(weight, plan.pairs[:, 0], 0.5 * plan.carried)
    np.add.at(weight, plan.pairs[:, 1], 0.5 * plan.carried)
    return weight


def _constrained_inverse(z: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``[n + 1, n + 1]`` the (pseudo-)inverse of the normal equations ``A beta + nu 1 = b`` with the
    constraint ``1^T beta = total``, ``A = z^T diag(weight) z``: its block ``[:n, :n]`` maps ``b`` to
    ``beta``, its column ``[:n, n]`` the total."""
    n = z.shape[1]
    system = np.zeros((n + 1, n + 1))  # [beta, nu] x [beta, nu]
    system[:n, :n], system[:n, n], system[n, :n] = (z * weight[:, None]).T @ z, 1.0, 1.0
    return np.linalg.pinv(system)


def _chunks(count: int, size: int = 4096) -> list[slice]:
    """Slices of at most ``size`` rows: the size game's ``3n`` terms are built a chunk at a time."""
    return [slice(k, min(k + size, count)) for k in range(0, count, size)]


def size_terms(z: np.ndarray, leaders: tuple[int, ...] = ()) -> np.ndarray:
    """``[rows, (3 + len(leaders)) n]`` the size game's terms of coalitions ``z`` ``[rows, n]``: each
    player's presence times 1, ``t`` and ``t^2`` (``t = |S| / n - 1/2``), then for each leader ``j`` each
    other player's presence times ``j``'s times ``t`` (0 in ``j``'s own column)."""
    n = z.shape[1]
    t = z.sum(axis=1, keepdims=True) / n - 0.5  # [rows, 1]
    blocks = [z, z * t, z * t * t]
    for j in leaders:
        block = z * (z[:, j:j + 1] * t)  # [rows, n]
        block[:, j] = 0.0
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


@dataclass(frozen=True)
class SizeGame:
    """The size game ``u(S) = sum over i in S of (a_i + b_i t + c_i t^2 + sum over leaders j in S, j != i,
    of d_ij t)`` (:func:`size_terms`) fitted to a plan's coalitions (:meth:`fit`): ``leaders`` the players
    whose presence shifts the others' effects, ``coef`` ``[terms]``, ``at`` ``[distinct]`` u at each
    coalition, ``exact_map`` ``[n, terms]`` coefficients to exact Shapley values (:func:`size_game_map`),
    ``exact`` ``[n]`` u's values, ``lever`` ``[terms, terms]`` the fit's inverse normal matrix."""

    leaders: tuple[int, ...]
    coef: np.ndarray
    at: np.ndarray
    exact_map: np.ndarray
    exact: np.ndarray
    lever: np.ndarray

    def terms(self, z: np.ndarray) -> np.ndarray:
        """``[rows, terms]`` the game's terms of coalitions ``z`` ``[rows, n]``."""
        return size_terms(z, self.leaders)

    @classmethod
    def fit(cls, z: np.ndarray, weight: np.ndarray, y: np.ndarray, full: int, leaders: tuple[int, ...] = ()
            ) -> SizeGame:
        """Weighted least squares of ``y`` ``[distinct]`` on the size game's terms: each coalition at
        ``weight``, the full one at the kernel's whole mass (1), every term but ``a`` ridged by
        :data:`SIZE_RIDGE` x the total weight."""
        n = z.shape[1]
        width = (3 + len(leaders)) * n
        fitted = weight.copy()
        fitted[full] += 1.0
        normal, target = np.zeros((width, width)), np.zeros(width)
        for rows in _chunks(len(z)):
            terms = size_terms(z[rows], leaders)  # [chunk, terms]
            normal += (terms * fitted[rows, None]).T @ terms
            target += terms.T @ (fitted[rows] * y[rows])
        ridge = np.zeros(width)
        ridge[n:] = SIZE_RIDGE * fitted.sum()
        lever = np.linalg.pinv(normal + np.diag(ridge))  # [terms, terms]
        coef = lever @ target  # [terms]
        at = np.concatenate([size_terms(z[rows], leaders) @ coef for rows in _chunks(len(z))])  # [distinct]
        exact_map = size_game_map(n, leaders)
        return cls(leaders, coef, at, exact_map, exact_map @ coef, lever)


def size_game_map(n: int, leaders: tuple[int, ...] = ()) -> np.ndarray:
    """``[n, terms]`` the exact Shapley values of a size game as a linear map of its coefficients.

    A term ``z_i f(|S|)``: player i's mean marginal over the coalitions of size ``s`` without it is
    ``f(s + 1)``, another player's ``s / (n - 1) (f(s + 1) - f(s))`` (i is in such a coalition with
    probability ``s / (n - 1)``). A term ``z_i z_j t`` (``j`` a leader): i's and j's mean marginal is
    ``s / (n - 1) t(s + 1)``, a third player's ``s (s - 1) / ((n - 1) (n - 2)) / n`` (both in, and the
    step of ``t``). A Shapley value is the mean of those over ``s = 0 .. n - 1``: each power ``p`` of
    ``t`` enters with ``alpha_p - gamma_p`` for the player's own coefficient and ``gamma_p`` for every
    player's (``alpha_p`` the mean of ``t^p`` at ``s + 1``, ``gamma_p`` that of ``s / (n - 1)`` times
    its step), a leader's term with ``pair`` for its two players and ``third`` for every other."""
    s = np.arange(n)  # [n] the sizes 0..n-1 of the coalitions a player joins
    t = np.arange(n + 1) / n - 0.5  # [n + 1] the sizes 0..n, centred
    powers = np.stack([np.ones(n + 1), t, t * t], axis=1)  # [n + 1, 3]
    share = (s / max(1, n - 1))[:, None]  # [n, 1]
    alpha = powers[1:].mean(axis=0)  # [3]
    gamma = (share * (powers[1:] - powers[:-1])).mean(axis=0)  # [3]
    blocks = [(alpha[p] - gamma[p]) * np.eye(n) + gamma[p] for p in range(3)]
    pair = float(np.mean(share[:, 0] * t[1:]))
    third = float(np.mean(s * (s - 1) / max(1, (n - 1) * (n - 2)))) / n
    for j in leaders:
        block = np.full((n, n), third)  # [player, other]: the term z_other z_j t
        block[np.arange(n), np.arange(n)] = pair  # the other player itself
        block[j, :] = pair  # the leader
        block[:, j] = 0.0  # no term z_j z_j t (it is j's own b_j)
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


def _influence(z: np.ndarray, plan: KernelPlan, weight: np.ndarray, residuals: tuple[np.ndarray, np.ndarray],
               solve: np.ndarray, game: SizeGame, missed: np.ndarray) -> np.ndarray:
    """``[pairs, n]`` each sampled pair's influence on the estimate with the size game (the delta
    method's terms, summed over pairs the estimate's error): through the regression's terms, ``solve``
    ``[n, n]`` times ``carried_k (z r(z) + z' r(z')) / 2`` (``r`` = ``residuals[0]``, what both fits
    leave), and through the size game's fit, ``missed`` ``[n, terms]`` (what the regression misses of
    each size term) times the fit's inverse normal matrix times ``carried_k (f e(z) + f' e(z')) / 2``
    (``f`` the size terms, ``e`` = ``residuals[1]``, what the size game leaves). Both residuals are
    scaled for the size game's leverage at the pair (:func:`_scaled`)."""
    through_fit = missed @ game.lever  # [n, terms]
    out = np.zeros((len(plan.pairs), z.shape[1]))
    for part in _chunks(len(plan.pairs)):
        pairs = plan.pairs[part]  # [chunk, 2]
        terms = game.terms(z[pairs.reshape(-1)]).reshape(len(pairs), 2, -1)  # [chunk, 2, terms]
        both = _scaled(terms, game.lever, weight[pairs],
                       np.stack([residuals[0][pairs], residuals[1][pairs]], axis=2))  # [chunk, 2 rows, 2]
        both = both * (0.5 * plan.carried[part, None, None])
        g = np.einsum("kr,krn->kn", both[:, :, 0], z[pairs])  # [chunk, n]
        q = np.einsum("kr,krf->kf", both[:, :, 1], terms)  # [chunk, terms]
        out[part] = g @ solve.T + q @ through_fit.T
    return out


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
