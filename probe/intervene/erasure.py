"""Erasure curves (ERASER, DeYoung et al. 2020) and decision flips (Serrano & Smith 2019).

For a ranking of an example's scorable (non-special) tokens, most important first:

* comprehensiveness(k) = f(x) - f(x without its top-k tokens)
* sufficiency(k)       = f(x) - f(only its top-k tokens, special tokens kept, order kept)
* AOPC                 = the mean of a curve over the bins (here: the plain mean over the given
                         bins, as the brief defines it; ERASER's code also averages over bins only)
* flip                 = for classifiers, the fraction of scorable tokens removed, in ranking order
                         one at a time, when the predicted class first differs from the prediction on
                         x; None when it never changes (even with every scorable token removed).

Tokens are *removed* (their ids deleted, the sequence gets shorter), not masked, as in ERASER.

Bin sizes: ``k = max(1, floor(frac * n_scorable + 0.5))`` tokens, capped at ``n_scorable``; that
is, rounding half up (Python's ``round`` would round half to even: 2.5 -> 2) and at least one
token, so the 1% bin of a 20-token sentence removes one token rather than none.

A ranking is a :class:`TokenScores` (``[tokens]`` per example, higher = more important) or a list
of such tensors. Ties are broken by position (earlier first); NaN scores on scorable tokens rank
last. Every call also evaluates a seeded random ranking (``random_ranking``), the baseline a
ranking must beat. All rows of all rankings go through the engine in one call, so identical rows
(e.g. the same top-1 token under two rankings) are run once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.intervene.rowcache import Row
from probe.intervene.tokens import scorable_positions
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, example_seed

ERASURE_BINS = (0.01, 0.05, 0.1, 0.2, 0.5)
RANDOM_RANKING = "random"

Ranking = TokenScores | Sequence[torch.Tensor]


def bin_size(frac: float, n_scorable: int) -> int:
    """Tokens in the ``frac`` bin: at least one, rounded half up, at most ``n_scorable``."""
    if n_scorable <= 0:
        return 0
    return min(n_scorable, max(1, int(math.floor(frac * n_scorable + 0.5))))


def random_ranking(examples: Sequence[PreparedExample], seed: int = 0) -> TokenScores:
    """A seeded random ranking: a random permutation of each example's scorable tokens.

    Scores are ``[tokens]`` with NaN on special tokens; the draw depends on ``seed`` and the
    example's ids only, so it is the same alone, in a batch, and across runs.
    """
    scores = []
    for example in examples:
        positions = scorable_positions(example)
        rng = np.random.default_rng(example_seed(seed, example))
        score = torch.full((len(example.input_ids),), float("nan"), dtype=torch.float64)
        score[positions] = torch.from_numpy(rng.permutation(len(positions)).astype(np.float64))
        scores.append(score)
    return TokenScores(method=RANDOM_RANKING, scores=scores, params={"seed": int(seed)})


def ranked_positions(example: PreparedExample, score: torch.Tensor) -> list[int]:
    """Scorable positions of ``example``, most important first (ties: earlier first; NaN last)."""
    if score.dim() != 1 or score.numel() != len(example.input_ids):
        raise InputError(
            f"an erasure ranking needs one score per token ([tokens] = [{len(example.input_ids)}]), got shape "
            f"{tuple(score.shape)}: select one layer/head of a per-head method first")
    values = score.detach().double().cpu().numpy()
    positions = scorable_positions(example)
    return sorted(positions, key=lambda t: (math.isnan(values[t]), -values[t] if not math.isnan(values[t]) else 0.0, t))


def _as_rankings(rankings) -> dict[str, list[torch.Tensor]]:
    if isinstance(rankings, TokenScores) or (isinstance(rankings, Sequence) and not isinstance(rankings, str)
                                              and all(isinstance(s, torch.Tensor) for s in rankings)):
        rankings = {getattr(rankings, "method", "ranking"): rankings}
    if not isinstance(rankings, Mapping):
        raise InputError("rankings must be a TokenScores, a list of [tokens] tensors, or a dict name -> either")
    out = {}
    for name, ranking in rankings.items():
        if name == RANDOM_RANKING:
            raise InputError(f"ranking name {RANDOM_RANKING!r} is reserved for the seeded random baseline: rename it")
        out[str(name)] = list(ranking.scores if isinstance(ranking, TokenScores) else ranking)
    return out


def erasure(engine: Engine, examples: Sequence[PreparedExample], rankings: Ranking | Mapping[str, Ranking], *,
            bins: Sequence[float] = ERASURE_BINS, seed: int = 0, flips: bool = True) -> pd.DataFrame:
    """Erasure curves of each ranking, and of a seeded random ranking, on ``examples``.

    Returns one row per (example, ranking, bin): ``example`` (index into ``examples``),
    ``ranking``, ``bin`` (fraction), ``k`` (tokens removed/kept), ``n_scorable``,
    ``comprehensiveness``, ``sufficiency``; and per (example, ranking), repeated on its rows:
    ``aopc`` (mean comprehensiveness over the bins), ``aopc_sufficiency`` (mean sufficiency),
    ``flip`` (fraction removed at the first decision flip; None when none, or not a classifier).
    Examples without scorable tokens get NaN rows.
    """
    if isinstance(bins, (str, bytes)) or not isinstance(bins, Iterable):
        raise InputError(f"erasure bins={bins!r} is not a list of fractions: give e.g. bins=[0.1, 0.5] for 10% and 50%")
    try:
        bins = tuple(float(b) for b in bins)
    except (TypeError, ValueError):
        raise InputError(f"erasure bins {list(bins)!r} are not all numbers: give fractions, e.g. 0.1 for 10%") from None
    above = [b for b in bins if b > 1.0]
    if above:
        raise InputError(f"erasure bins are fractions of the scorable tokens in (0, 1], got {above[0]:g}: give "
                         f"fractions, e.g. 0.1 for 10% (study files give percentages)")
    if not bins or any(not 0.0 < b <= 1.0 for b in bins):
        raise InputError(f"erasure bins must be fractions in (0, 1], got {bins!r}: give fractions, e.g. 0.1 for 10%")
    named = _as_rankings(rankings)
    for name, scores in named.items():
        if len(scores) != len(examples):
            raise InputError(f"ranking {name!r} has scores for {len(scores)} examples, expected {len(examples)}")
    named[RANDOM_RANKING] = random_ranking(examples, seed).scores
    do_flips = flips and engine.pm.task.labels

    rows, originals, plan = _erasure_rows(examples, named, bins, do_flips)
    values = engine.values(rows, reuse_prefix=engine.pm.task.next_token).double()  # [rows]
    labels = engine.predicted_labels(rows) if do_flips else None  # [rows], from the same passes

    records = []
    for i, example in enumerate(examples):
        n = len(scorable_positions(example))
        predicted = int(labels[originals[i]]) if do_flips and n else None
        for name in named:
            records += _curve_records(i, name, n, bins, plan[(i, name)], values, values[originals[i]], labels, predicted)
    frame = pd.DataFrame.from_records(records, columns=[
        "example", "ranking", "bin", "k", "n_scorable", "comprehensiveness", "sufficiency",
        "aopc", "aopc_sufficiency", "flip"])
    frame.attrs["params"] = {"bins": list(bins), "seed": int(seed), "removal": "delete ids",
                             "bin_rounding": "max(1, floor(frac * n + 0.5))"}
    return frame


def _erasure_rows(examples: Sequence[PreparedExample], named: dict[str, list[torch.Tensor]], bins: tuple[float, ...],
                  do_flips: bool) -> tuple[list[Row], list[int], dict[tuple[int, str], dict[str, list[int]]]]:
    """Every row the curves need, each example's original row (index into the rows), and per
    (example, ranking) the rows of its curves: ``{"comp": [row per bin], "suff": [...],
    "flip": [row per j = 1..n]}`` (no flip rows when ``do_flips`` is false)."""
    rows: list[Row] = []
    originals = []
    plan: dict[tuple[int, str], dict[str, list[int]]] = {}

    def add(ids: tuple[int, ...], example: PreparedExample) -> int:
        rows.append((ids, example))
        return len(rows) - 1

    for i, example in enumerate(examples):
        ids = tuple(int(x) for x in example.input_ids)
        originals.append(add(ids, example))
        n = len(scorable_positions(example))
        for name, scores in named.items():
            order = ranked_positions(example, scores[i])
            entry: dict[str, list[int]] = {"comp": [], "suff": [], "flip": []}
            for frac in bins:
                top = set(order[:bin_size(frac, n)])
                entry["comp"].append(add(tuple(x for t, x in enumerate(ids) if t not in top), example))
                entry["suff"].append(add(tuple(x for t, x in enumerate(ids) if t in top or example.special[t]), example))
            if do_flips:
                removed: set[int] = set()
                for t in order:
                    removed.add(t)
                    entry["flip"].append(add(tuple(x for s, x in enumerate(ids) if s not in removed), example))
            plan[(i, name)] = entry
    return rows, originals, plan


def _curve_records(i: int, name: str, n: int, bins: tuple[float, ...], entry: dict[str, list[int]],
                   values: torch.Tensor, base: torch.Tensor, labels: torch.Tensor | None,
                   predicted: int | None) -> list[dict]:
    """The frame rows of one (example, ranking): its curves from the rows' ``values`` ``[rows]``
    against the original's value ``base``, and its first flip against the original's
    ``predicted`` class (None: no flips)."""
    comp = [float(base - values[r]) if n else float("nan") for r in entry["comp"]]
    suff = [float(base - values[r]) if n else float("nan") for r in entry["suff"]]
    flip = None
    if predicted is not None:
        for j, r in enumerate(entry["flip"], start=1):
            if int(labels[r]) not in (predicted, -1):
                flip = j / n
                break
    aopc = float(np.mean(comp)) if n else float("nan")
    aopc_suff = float(np.mean(suff)) if n else float("nan")
    return [{"example": i, "ranking": name, "bin": frac, "k": bin_size(frac, n), "n_scorable": n,
             "comprehensiveness": comp[b], "sufficiency": suff[b],
             "aopc": aopc, "aopc_sufficiency": aopc_suff, "flip": flip}
            for b, frac in enumerate(bins)]
