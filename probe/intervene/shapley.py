"""Shapley values of tokens, words or spans: a causal reference that sees interactions.

Leave-one-out asks what one token does when every other token is present. Two tokens that stand in
for each other (two copies of a trigger) each do almost nothing alone, and deleting either leaves the
prediction where it was; the Shapley value shares their joint effect between them. For a set ``N`` of
``n`` players (an example's scorable tokens, its words, or given spans) and the value ``v(S)`` = the
target when only the players in ``S`` are present::

    phi_i = sum over S in N without i of  |S|! (n - |S| - 1)! / n!  (v(S + i) - v(S))

An absent player is perturbed as leave-one-out perturbs a token (``mode``): its tokens are deleted,
or each replaced by the mask, unk or pad id. Tokens that are no player (special tokens) are always
present. Scores are ``phi`` per token (signed, in the target's units: positive supports the target);
a word's or span's value is shared equally among its tokens, so the token scores still sum to it.
With spans as the players (:func:`span_shapley`, run where a study or audit takes ``spans`` as its
units) the values come back one per span, and a token in no span is always present.

Exact or sampled:

* ``n <= exact_max``: every one of the ``2^n`` coalitions is a row, and ``phi`` is the formula above.
* above it, sampled, by ``estimator``:

  - ``permutation`` (the default): ``permutations`` random orders of the players (seeded per example
    from its ids; at most ``SHAPLEY_ROW_LIMIT // (n + 1)`` of them, so that an example's rows stay
    within :data:`~probe.registry.params.SHAPLEY_ROW_LIMIT` = 2^16 however long it is), each with its
    reverse (antithetic pairs: a player early in one is late in the other, which cancels much of the
    order's noise). A player's value is its mean marginal contribution
    ``v(players before it + it) - v(players before it)``; its standard error is the standard
    deviation of the pair means over the number of pairs. Every order walks from no player to all of
    them, so the values of every order, and their mean, sum to ``v(N) - v(empty)`` exactly.
  - ``kernel``: the regression estimator of :mod:`probe.intervene.shapley_kernel` (KernelSHAP with
    the efficiency constraint solved exactly, the smallest and largest coalition sizes enumerated
    where the budget covers them, the rest drawn in complementary pairs stratified by size, a size
    game of known values as control variate where it lowers the standard errors; standard errors by
    linearisation). Its budget is expressed in orders too: ``permutations x (n + 1)``
    coalitions, the rows as many orders ask for before de-duplication (same cap).
  - ``auto``: a pilot of both at :data:`PILOT_ORDERS` (all examples' pilot rows in one engine call),
    then per example the one with the smaller distinct rows x mean squared standard error (the
    rows it needs for a given standard error, both falling as 1 / rows); ``extras["estimator"]``
    says which. Its pilot rows are the final run's first draws (each estimator draws a larger budget's
    rows as a prefix of a smaller one's), so only the other estimator's pilot rows are extra.

  ``target_se`` > 0 (any estimator): the pilot's standard errors project the budget at which the
  root-mean-square standard error over the players reaches ``target_se`` x the value range (max - min
  of the pilot's values), and the run stops there (``permutations`` stays the cap; never below the
  pilot). 0 (the default) runs the whole budget, as before.

  Which is cheaper: on MiniLM sentences of 8-12 tokens (``benchmarks/bench_shapley.py --accuracy``)
  the regression reaches a mean error of 5% of the value range with less than half the time of the
  orders (0.60 s against 1.44 s there), on a 40-token text with about a fifth less (6.2 s against
  7.8 s); on a tiny nearly additive model both are all but exact at the pilot. ``auto`` pays for
  its pilot (the other estimator's rows), and is worth it where the better one is not known.

Every coalition is a row of the shared engine (:mod:`probe.intervene.engine`): rows from all
examples go in one call, packed under the token budget; identical coalitions (orders share their
first and last prefixes, and often more) are de-duplicated, here and in the engine's cache; a causal
LM's rows reuse the unchanged prefix.

``extras`` per example: ``standard_error`` (a tensor over tokens, 0 where exact, NaN where unscored),
``estimator`` (``exact``, ``permutation`` or ``kernel``: the one that ran), ``exact``, ``permutations``
(the orders used; 0 where exact or kernel), ``rows_asked`` (coalitions asked for before de-duplication),
``players``, ``coalitions`` (distinct rows),
``full_value`` v(N), ``empty_value`` v(empty) and ``efficiency_delta`` = sum(phi) - (v(N) - v(empty)),
the efficiency axiom's check, as integrated gradients' completeness delta is its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe.errors import InputError
from probe.intervene.shapley_kernel import KernelPlan, kernel_plan, kernel_values
from probe.intervene.tokens import replacement_token_id, scorable_positions
from probe.registry.params import SHAPLEY_ROW_LIMIT, SHAPLEY_UNITS, ShapleyParams, check_params
from probe.rows.scores import TokenScores
from probe.rows.target import example_seed

if TYPE_CHECKING:
    from probe.intervene.engine import Engine
    from probe.models.core import ProbeModel
    from probe.rows.spans import Span
    from probe.rows.target import PreparedExample

__all__ = ["PILOT_ORDERS", "sampled_plan", "shapley", "shapley_players", "shapley_values", "span_shapley",
           "word_players"]

#: the most players computed exactly by default (2^10 = 1024 coalitions per example)
EXACT_MAX = ShapleyParams.exact_max


#: the orders (or, for the regression, order-equivalents: orders x (players + 1) coalitions) of
#: the pilot that ``estimator="auto"`` and ``target_se`` start from
PILOT_ORDERS = 4


@dataclass(frozen=True)
class _Plan:
    """One example's players and the coalitions (rows of presence bits) its values need."""

    players: tuple[tuple[int, ...], ...]  # each player's token positions
    estimator: str  # "exact", "permutation" or "kernel"
    coalitions: np.ndarray  # [coalitions, players] bool, distinct
    #: permutation: [orders, players + 1] index into ``coalitions`` of each order's prefix of length
    #: 0..n and the order itself [orders, players]; else None
    prefixes: np.ndarray | None = None
    orders: np.ndarray | None = None
    kernel: KernelPlan | None = None  # the regression's coalitions

    @property
    def exact(self) -> bool:
        return self.estimator == "exact"

    @property
    def rows_asked(self) -> int:
        """The coalitions the plan asked for before identical ones were merged."""
        if self.orders is not None:
            return len(self.orders) * (len(self.players) + 1)
        if self.kernel is not None:
            return 2 + len(self.kernel.enumerated) + 2 * len(self.kernel.pairs)
        return len(self.coalitions)

    @property
    def budget_orders(self) -> int:
        """The orders (permutation) or order-equivalents (kernel: rows asked / (players + 1)) of the plan."""
        return -(-self.rows_asked // (len(self.players) + 1))


def word_players(pm: ProbeModel, example: PreparedExample) -> tuple[tuple[int, ...], ...]:
    """The example's scorable tokens grouped into words: a token continues the word before it when it
    starts where that token ends and both characters there are letters or digits (``##ing``,
    ``Ġgo`` + ``ing``); punctuation is a word of its own."""
    from probe.rows.spans import token_offsets

    offsets = token_offsets(pm, example)
    text = example.text
    words: list[list[int]] = []
    previous_end = None
    for t in scorable_positions(example):
        start, end = offsets[t]
        joined = (previous_end is not None and start == previous_end and 0 < start < len(text)
                  and text[start].isalnum() and text[start - 1].isalnum() and words)
        if joined:
            words[-1].append(t)
        else:
            words.append([t])
        previous_end = end
    return tuple(tuple(w) for w in words)


def shapley_players(pm: ProbeModel, example: PreparedExample, units: str) -> tuple[tuple[int, ...], ...]:
    """An example's players: each scorable token (``units="token"``) or each word (``"word"``)."""
    if units == "token":
        return tuple((t,) for t in scorable_positions(example))
    if units == "word":
        return word_players(pm, example)
    raise InputError(f"unknown Shapley unit {units!r}: use one of {', '.join(SHAPLEY_UNITS)}")


def _exact_coalitions(n: int) -> np.ndarray:
    """``[2^n, n]`` bool: coalition ``c`` holds player ``j`` when bit ``j`` of ``c`` is set."""
    codes = np.arange(2 ** n, dtype=np.int64)
    return ((codes[:, None] >> np.arange(n, dtype=np.int64)[None, :]) & 1).astype(bool)


def sampled_plan(n: int, permutations: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``permutations // 2`` random orders, each followed by its reverse; the distinct prefixes of
    all of them as coalitions, and each order's prefix indices.

    The prefixes are walked one length at a time, each kept only as its packed bits (a key of
    ``ceil(n / 8)`` bytes): memory ``orders x (n + 1) x n / 8`` bytes for the keys, never the
    ``[orders, n + 1, n]`` booleans."""
    pairs = max(1, permutations // 2)
    first = np.stack([rng.permutation(n) for _ in range(pairs)])  # [pairs, n]
    orders = np.empty((2 * pairs, n), dtype=np.int64)  # [orders, n]: order, its reverse, ...
    orders[0::2] = first
    orders[1::2] = first[:, ::-1]
    width = (n + 7) // 8
    keys = np.empty((len(orders), n + 1, width), dtype=np.uint8)  # [orders, n + 1, bytes]: prefix k's bits
    present = np.zeros((len(orders), n), dtype=bool)  # [orders, n]: the prefix of the current length
    every = np.arange(len(orders))
    keys[:, 0] = np.packbits(present, axis=1)
    for k in range(n):
        present[every, orders[:, k]] = True
        keys[:, k + 1] = np.packbits(present, axis=1)
    flat = np.ascontiguousarray(keys.reshape(-1, width)).view(np.dtype((np.void, width)))[:, 0]  # [orders * (n + 1)]
    _, first_seen, inverse = np.unique(flat, return_index=True, return_inverse=True)
    coalitions = np.unpackbits(keys.reshape(-1, width)[first_seen], axis=1, count=n).view(bool)  # [distinct, n]
    return coalitions, inverse.reshape(len(orders), n + 1), orders


def _affordable(n: int) -> int:
    """The most orders (or order-equivalents) an example of ``n`` players may take: its rows stay within
    :data:`~probe.registry.params.SHAPLEY_ROW_LIMIT` whatever its length (its standard error grows)."""
    return max(2, SHAPLEY_ROW_LIMIT // (n + 1))


def _plan(players: tuple[tuple[int, ...], ...], exact_max: int, estimator: str, orders: int,
          seeds: list[int]) -> _Plan:
    """The plan of ``estimator`` at ``orders`` (kernel: ``orders x (n + 1)`` coalitions), seeded by
    ``seeds`` (each estimator its own stream, so that a larger budget draws a smaller one's rows first)."""
    n = len(players)
    if n <= exact_max:
        return _Plan(players, "exact", _exact_coalitions(n))
    orders = min(orders, _affordable(n))
    if estimator == "kernel":
        plan = kernel_plan(n, min(orders * (n + 1), SHAPLEY_ROW_LIMIT), seeds)
        return _Plan(players, "kernel", plan.coalitions, kernel=plan)
    coalitions, prefixes, ordering = sampled_plan(n, orders, np.random.default_rng(seeds))
    return _Plan(players, "permutation", coalitions, prefixes, ordering)


def _row(ids: tuple[int, ...], players: tuple[tuple[int, ...], ...], present: np.ndarray,
         replacement: int | None) -> tuple[int, ...]:
    """The example's ids with every absent player's tokens deleted (``replacement`` None) or replaced."""
    absent = {t for j, positions in enumerate(players) if not present[j] for t in positions}
    if not absent:
        return ids
    if replacement is None:
        return tuple(x for t, x in enumerate(ids) if t not in absent)
    return tuple(replacement if t in absent else x for t, x in enumerate(ids))


def _exact_values(values: np.ndarray, n: int) -> np.ndarray:
    """``[n]`` Shapley values from ``values[code]`` = v(coalition ``code``) over all ``2^n`` codes."""
    codes = np.arange(2 ** n, dtype=np.int64)
    sizes = np.array([bin(int(c)).count("1") for c in codes], dtype=np.int64)
    # weight of a coalition of size s not holding the player: s! (n - s - 1)! / n!
    weights = np.array([math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)])
    phi = np.empty(n, dtype=np.float64)
    for j in range(n):
        without = codes[(codes >> j) & 1 == 0]
        phi[j] = float(np.sum(weights[sizes[without]] * (values[without | (1 << j)] - values[without])))
    return phi


def _sampled_values(values: np.ndarray, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """``([n] values, [n] standard errors)`` from the orders' marginal contributions."""
    along = values[plan.prefixes]  # [orders, n + 1]: v of each order's prefixes
    steps = np.diff(along, axis=1)  # [orders, n]: the marginal of the order's k-th player
    marginal = np.empty_like(steps)
    marginal[np.arange(len(steps))[:, None], plan.orders] = steps  # [orders, players]
    pairs = 0.5 * (marginal[0::2] + marginal[1::2])  # [pairs, players]: antithetic pair means
    phi = pairs.mean(axis=0)
    se = pairs.std(axis=0, ddof=1) / math.sqrt(len(pairs)) if len(pairs) > 1 else np.full(len(phi), np.nan)
    return phi, se


def _estimate(own: np.ndarray, plan: _Plan) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``([n] values, [n] standard errors, v(N), v(empty))`` of a plan from its coalitions' values."""
    n = len(plan.players)
    if plan.kernel is not None:
        phi, se = kernel_values(own, plan.kernel)
        return phi, se, float(own[plan.kernel.full]), float(own[plan.kernel.empty])
    if plan.prefixes is not None:
        phi, se = _sampled_values(own, plan)
        return phi, se, float(own[plan.prefixes[0, -1]]), float(own[plan.prefixes[0, 0]])
    return _exact_values(own, n), np.zeros(n), float(own[-1]), float(own[0])


def _run(engine: Engine, examples: Sequence[PreparedExample], plans: Sequence[_Plan],
         replacement: int | None) -> list[np.ndarray]:
    """Each plan's ``[coalitions]`` values, every row of every example in one call of ``engine``."""
    rows: list[tuple[tuple[int, ...], PreparedExample]] = []
    starts = []
    for example, plan in zip(examples, plans):
        starts.append(len(rows))
        ids = tuple(int(x) for x in example.input_ids)
        rows.extend((_row(ids, plan.players, present, replacement), example) for present in plan.coalitions)
    values = engine.values(rows, reuse_prefix=engine.pm.task.next_token).double().numpy()  # [rows]
    return [values[start:start + len(plan.coalitions)] for start, plan in zip(starts, plans)]


def _decide(pilots: Sequence[tuple[str, _Plan, np.ndarray, np.ndarray]], pilot_orders: int, permutations: int,
            target_se: float) -> tuple[str, int]:
    """``(estimator, orders)`` of the final run from each candidate's pilot ``(estimator, plan, values,
    standard errors)``: the candidate with the smaller distinct rows x mean squared standard error
    (the rows it needs for any standard error, at the 1 / rows rate of a sampled mean), run to
    ``target_se`` x the value range (the first pilot's estimate) or, with ``target_se`` 0, to ``permutations``."""
    costs = []
    for _, plan, _, se in pilots:
        square = float(np.mean(se ** 2)) if len(se) else 0.0
        costs.append(len(plan.coalitions) * square if math.isfinite(square) else math.inf)
    best = int(np.argmin(costs))  # ties: the first (permutation)
    name, plan, _, se = pilots[best]
    goal = target_se * float(np.ptp(pilots[0][2])) if len(pilots[0][2]) else 0.0
    if target_se <= 0 or goal <= 0 or not math.isfinite(costs[best]):
        return name, permutations
    needed = math.ceil(plan.budget_orders * float(np.mean(se ** 2)) / goal ** 2)
    needed += needed % 2  # whole antithetic pairs
    return name, int(min(permutations, max(pilot_orders, needed)))


def _choose(engine: Engine, examples: Sequence[PreparedExample], players: Sequence[tuple[tuple[int, ...], ...]],
            seeds: Sequence[list[int]], replacement: int | None, exact_max: int, estimator: str, permutations: int,
            target_se: float) -> list[tuple[str, int]]:
    """Per example ``(estimator, orders)``: ``auto`` runs a pilot of both estimators (``target_se`` > 0
    a pilot of the one asked for) at :data:`PILOT_ORDERS`, all examples' rows in one call; the final
    run then finds the chosen pilot's rows in the engine's cache (its draws are a prefix of a larger
    budget's)."""
    candidates = ("permutation", "kernel") if estimator == "auto" else (estimator,)
    pilot_orders = min(PILOT_ORDERS, permutations)
    sampled = [j for j, own in enumerate(players) if len(own) > exact_max]
    plans = [(j, name, _plan(players[j], exact_max, name, pilot_orders, seeds[j])) for j in sampled
             for name in candidates]
    values = _run(engine, [examples[j] for j, _, _ in plans], [plan for _, _, plan in plans], replacement)
    found: dict[int, list[tuple[str, _Plan, np.ndarray, np.ndarray]]] = {}
    for (j, name, plan), own in zip(plans, values):
        phi, se, _, _ = _estimate(own, plan)
        found.setdefault(j, []).append((name, plan, phi, se))
    default = (candidates[0], permutations)
    return [_decide(found[j], pilot_orders, permutations, target_se) if j in found else default
            for j in range(len(players))]


def shapley_values(engine: Engine, examples: Sequence[PreparedExample],
                   players: Sequence[tuple[tuple[int, ...], ...]], *, mode: str = "delete",
                   exact_max: int = EXACT_MAX, permutations: int = 64, seed: int = 0,
                   estimator: str = "permutation", target_se: float = 0.0) -> list[dict]:
    """Per example ``{"values": [players], "standard_error": [players], "estimator", "exact",
    "permutations", "coalitions", "full_value", "empty_value", "efficiency_delta"}`` for the given
    players (each a tuple of token positions), every coalition of every example through ``engine`` in
    one call (``auto`` and ``target_se`` first a pilot call, :func:`_choose`)."""
    check_params(ShapleyParams, "shapley", mode=mode, exact_max=exact_max, permutations=permutations,
                 estimator=estimator, target_se=target_se)
    replacement = None if mode == "delete" else replacement_token_id(engine.pm, mode)
    for example, own in zip(examples, players):
        if mode == "delete" and own and len(example.input_ids) == sum(map(len, own)):
            raise InputError(
                f"shapley with mode delete removes every token of {example.text[:40]!r} in its empty coalition "
                f"(the tokenizer of {engine.pm.name!r} adds no special token that stays): use mode pad, unk or "
                "mask, whose empty coalition keeps the positions")
    seeds = [example_seed(seed, example) for example in examples]
    choices = [(estimator, int(permutations))] * len(examples)
    if estimator == "auto" or target_se > 0:
        choices = _choose(engine, examples, players, seeds, replacement, int(exact_max), estimator,
                          int(permutations), float(target_se))
    plans = [_plan(tuple(own), int(exact_max), name, orders, s) for own, (name, orders), s in
             zip(players, choices, seeds)]
    out = []
    for plan, own in zip(plans, _run(engine, examples, plans, replacement)):
        phi, se, full, empty = _estimate(own, plan)
        out.append({"values": phi, "standard_error": se, "estimator": plan.estimator, "exact": plan.exact,
                    "permutations": len(plan.orders) if plan.orders is not None else 0,
                    "coalitions": len(own), "rows_asked": plan.rows_asked, "full_value": full, "empty_value": empty,
                    "efficiency_delta": float(phi.sum() - (full - empty))})
    return out


def span_shapley(engine: Engine, examples: Sequence[PreparedExample], found: Sequence[Sequence[Span]],
                 mode: str = "delete", *, units: str = "token", exact_max: int = EXACT_MAX, permutations: int = 64,
                 seed: int = 0, estimator: str = "permutation", target_se: float = 0.0) -> list[np.ndarray]:
    """Shapley values with each example's spans (:func:`probe.rows.spans.find_spans`) as the players:
    one float64 vector per example in span order (the registry's span form of ``shapley``, run when a
    study or audit takes spans as its units). A token in no span is no player: always present. A token
    in two spans is absent when either span is. ``units`` is the token-level run's and is not read
    here (the spans are the players); the other parameters are :func:`shapley`'s."""
    players = [tuple(tuple(span.positions) for span in spans) for spans in found]
    values = shapley_values(engine, examples, players, mode=mode, exact_max=exact_max, permutations=permutations,
                            seed=seed, estimator=estimator, target_se=target_se)
    return [np.asarray(v["values"], dtype=np.float64) for v in values]


def shapley(engine: Engine, examples: Sequence[PreparedExample], mode: str = "delete", *, units: str = "token",
            exact_max: int = EXACT_MAX, permutations: int = 64, seed: int = 0, estimator: str = "permutation",
            target_se: float = 0.0) -> TokenScores:
    """Shapley values of each example's tokens (``units="token"``) or words (``"word"``, shared
    equally among a word's tokens) as token scores ``[tokens]``; special tokens NaN. See the module
    docstring for the exact and sampled computations and the ``extras``."""
    check_params(ShapleyParams, "shapley", units=units)
    players = [shapley_players(engine.pm, e, units) for e in examples]
    before = engine.stats.as_dict()
    found = shapley_values(engine, examples, players, mode=mode, exact_max=exact_max,
                           permutations=permutations, seed=seed, estimator=estimator, target_se=target_se)
    after = engine.stats.as_dict()
    scores, errors = [], []
    for example, own, result in zip(examples, players, found):
        score = torch.full((len(example.input_ids),), float("nan"), dtype=torch.float64)
        error = torch.full((len(example.input_ids),), float("nan"), dtype=torch.float64)
        for j, positions in enumerate(own):
            score[list(positions)] = float(result["values"][j]) / len(positions)
            error[list(positions)] = float(result["standard_error"][j]) / len(positions)
        scores.append(score)
        errors.append(error)
    params = {"mode": mode, "units": units, "exact_max": int(exact_max), "permutations": int(permutations),
              "seed": int(seed), "estimator": estimator, "target_se": float(target_se)}
    if mode != "delete":
        replacement = replacement_token_id(engine.pm, mode)
        params.update(replacement_id=replacement, replacement_token=engine.pm.tokenizer.convert_ids_to_tokens(replacement))
    extras = {
        "standard_error": errors,
        "estimator": [r["estimator"] for r in found],
        "exact": [r["exact"] for r in found],
        "permutations": [r["permutations"] for r in found],
        "players": [len(p) for p in players],
        "coalitions": [r["coalitions"] for r in found],
        "rows_asked": [r["rows_asked"] for r in found],
        "full_value": [r["full_value"] for r in found],
        "empty_value": [r["empty_value"] for r in found],
        "efficiency_delta": [r["efficiency_delta"] for r in found],
        "original_values": [r["full_value"] for r in found],
        "rows_evaluated": after["rows_evaluated"] - before["rows_evaluated"],
        "forward_passes": after["forward_passes"] - before["forward_passes"],
    }
    return TokenScores(method="shapley", scores=scores, params=params, extras=extras)
