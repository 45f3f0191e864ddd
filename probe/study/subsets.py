"""The verdict at small n: a finished study's answer re-judged on random subsets of its examples.

A rule that passes on the absence of evidence says "yes" in a small study where the large one says
"no". This module asks the question directly: draw subsets of n examples (without replacement, seeded)
from a finished study's stored tables, judge each subset with the verdict's own rule
(:func:`probe.study.summary.judge_tables`: nothing recomputed but the statistics; the sanity checks are
the whole study's), and count the answers per n. On a study whose full answer is "no" a "yes" or "heads
only" in more than alpha of the draws would be a false positive the rule does not state; on a planted
positive a "yes" in nearly every draw shows that the rule has not simply become "undecidable whenever n
is small". ``probe planted`` writes this table into ``reports/planted/``.

Torch-free: it reads the tables a study stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.errors import InputError
from probe.study.steps import is_stepwise
from probe.study.verdict import ANSWERS

if TYPE_CHECKING:
    from probe.spec.study import Study
    from probe.study.sanity import Check

__all__ = ["SUBSET_COLUMNS", "restrict", "scored_examples", "subset_answers", "subset_summary"]

#: one row per draw: the subset's size, the draw's index, the answer, the examples scored in it
SUBSET_COLUMNS = ["n", "draw", "answer", "n_scored", "n_needed"]


def restrict(tables: dict, examples: Iterable[int]) -> dict:
    """``tables`` (a study's merged tables) on the dataset examples ``examples`` alone: every table with
    an ``example`` column keeps those rows (for a study of generated text, whose examples are output
    tokens, the tokens of those dataset examples, ``source``); the others are kept whole."""
    keep = set(int(e) for e in examples)
    frame = tables["examples"]
    if is_stepwise(frame):
        keep = set(int(e) for e in frame.loc[frame["source"].isin(keep), "example"])
    out = {}
    for name, table in tables.items():
        if isinstance(table, pd.DataFrame) and "example" in table.columns:
            out[name] = table[table["example"].isin(keep)].reset_index(drop=True)
        else:
            out[name] = table
    return out


def _dataset_examples(tables: dict) -> np.ndarray:
    frame = tables["examples"]
    column = "source" if is_stepwise(frame) else "example"
    return np.unique(frame[column].to_numpy(np.int64))


def scored_examples(tables: dict, study: Study, *, dtype: str) -> np.ndarray:
    """The dataset examples the verdict compares with its reference: those left after the noise and
    effect floors (:func:`probe.study.decide.without_noise`). On a study where only some texts hold
    what matters (a planted trigger), drawing from these draws n scored examples exactly."""
    from probe.study import decide

    found = decide.profiles(tables, study, dtype)
    agreement, _ = decide.without_noise(tables["agreement"], found)
    ref = study.verdict_reference
    examples = agreement.loc[(agreement.reference == ref) & (agreement.role == "explainer"), "example"].unique()
    frame = tables["examples"]
    if is_stepwise(frame):
        examples = frame.loc[frame["example"].isin(examples), "source"].unique()
    return np.unique(np.asarray(examples, dtype=np.int64))


def subset_answers(tables: dict, study: Study, *, dtype: str, sanity: Sequence[Check] = (),
                   sizes: Sequence[int] = (10, 12, 20, 40), draws: int = 100, seed: int = 0,
                   pool: Sequence[int] | np.ndarray | None = None) -> pd.DataFrame:
    """The verdict's answer on ``draws`` random subsets of each size in ``sizes`` (:data:`SUBSET_COLUMNS`),
    drawn from the study's examples (or from ``pool``, e.g. :func:`scored_examples`). Sizes above the
    pool are refused."""
    from probe.study.summary import judge_tables

    pool = _dataset_examples(tables) if pool is None else np.unique(np.asarray(pool, dtype=np.int64))
    too_big = [n for n in sizes if n > len(pool)]
    if too_big:
        raise InputError(f"subset sizes {too_big} exceed the study's {len(pool)} examples; give smaller sizes")
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        for draw in range(draws):
            chosen = rng.choice(pool, size=int(n), replace=False)
            part = restrict(tables, chosen)
            if not len(part.get("agreement", ())):
                rows.append({"n": int(n), "draw": draw, "answer": "undecidable", "n_scored": 0, "n_needed": None})
                continue
            v = judge_tables(part, study, dtype=dtype, sanity=sanity, answer_only=True)["verdict"]
            rows.append({"n": int(n), "draw": draw, "answer": v["answer"], "n_scored": int(v.get("n") or 0),
                         "n_needed": v.get("n_needed")})
    return pd.DataFrame(rows, columns=SUBSET_COLUMNS)


def subset_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per subset size: draws, the median scored examples, and the share of each answer, with
    ``positive`` the share answering yes or heads only."""
    rows = []
    for n, part in frame.groupby("n", sort=True):
        shares = {answer: float((part.answer == answer).mean()) for answer in ANSWERS}
        rows.append({"n": int(n), "draws": int(len(part)), "median_scored": float(part.n_scored.median()), **shares,
                     "positive": shares["yes"] + shares["heads only"]})
    return pd.DataFrame(rows)
