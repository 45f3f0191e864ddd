"""Joint deletion of token pairs: where single-token deletion misjudges tokens that interact.

Leave-one-out's effect of a token is ``f(x) - f(x without it)``. For two tokens ``i`` and ``j``
the joint effect is ``f(x) - f(x without both)``, and the interaction is the joint effect minus the
two single effects. Additive tokens have an interaction near 0. Two kinds are not:

============  ===================================================================================
substitutes   together they do more than their single effects add up to (``|joint| > |sum|``):
              each stands in for the other (two copies of a trigger), so deleting either alone
              shows almost nothing and leave-one-out ranks both low
complements   together they do less than the sum (``|joint| < |sum|``): each needs the other
              (deleting either already removes their shared effect), so leave-one-out counts
              that effect twice
============  ===================================================================================

The rule, and where its boundary sits. A pair is flagged (named substitutes or complements) when its
interaction is at least :data:`FLAG_SHARE` (one half) of the example's largest single effect and at
least :data:`RELATIVE_FLOOR` of the target's own size (so a flag never comes from float rounding on an
example where nothing matters); otherwise it is additive. The half is the midpoint between the two
textbook cases: an additive pair has interaction 0, and a pure AND (the target needs both tokens:
each single effect is the whole effect, the joint effect too, so interaction = -single) or a pure OR
(either token suffices: singles 0, interaction = joint) has ``|interaction|`` equal to the largest
single effect, exactly where a rule "at least the largest single effect" would put its boundary (a
trained AND pair sat at ratios 0.994-1.001 there, and 1e-4 of rounding decided its label). At the
midpoint, only a change of half the effect scale moves a textbook pair across it. The kind of a
flagged pair is then ``|joint| > |sum of singles|`` (substitutes) or not (complements); for a
textbook pair that comparison is far from equality (AND: joint = half the sum; OR: sum 0). A
flagged pair is ``misranked`` when single deletion ranks some other
token above the weaker of the two by more than that floor (or ranks nothing at all): then the reference's ranking, not only its
sizes, is wrong about them, and the verdict warns (two triggers that each keep a clear effect of their
own are flagged but not misranked).

The pairs looked at: each example's top tokens by the reference's scores and by an explainer's
(``top`` each, by magnitude), every pair among them. The pair rows (both tokens deleted, or both
replaced) go to the shared engine with the single rows, which are cache hits where the leave-one-out
of the same mode already ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from probe.intervene.tokens import replacement_token_id, scorable_positions

if TYPE_CHECKING:
    from probe.intervene.engine import Engine
    from probe.rows.target import PreparedExample

__all__ = ["FLAG_SHARE", "INTERACTION_COLUMNS", "pair_interactions", "top_positions"]

INTERACTION_COLUMNS = ["example", "position_a", "position_b", "token_a", "token_b", "single_a", "single_b", "joint",
                       "interaction", "largest_single", "original_value", "kind", "misranked"]
#: a pair is named where |interaction| >= FLAG_SHARE x the example's largest single effect: halfway between
#: additive (0) and a textbook AND or OR (1), so rounding never decides a textbook pair's label
FLAG_SHARE = 0.5
#: the smallest interaction named, as a share of |f(x)| (and never below ABSOLUTE_FLOOR)
RELATIVE_FLOOR = 1e-3
ABSOLUTE_FLOOR = 1e-6
#: the tokens taken from each ranking
TOP = 3


def top_positions(scores: torch.Tensor, example: PreparedExample, top: int = TOP) -> list[int]:
    """The ``top`` scorable positions of ``scores`` ``[tokens]`` by magnitude (NaN never)."""
    scorable = scorable_positions(example)
    values = scores.detach().double().cpu().numpy()
    ranked = sorted((t for t in scorable if np.isfinite(values[t])), key=lambda t: -abs(values[t]))
    return ranked[:top]


def _kind(interaction: float, joint: float, total: float, largest: float, original: float) -> str:
    floor = max(RELATIVE_FLOOR * abs(original), ABSOLUTE_FLOOR)
    if not np.isfinite(interaction) or abs(interaction) < max(FLAG_SHARE * largest, floor):
        return "additive"
    return "substitutes" if abs(joint) > abs(total) else "complements"


def pair_interactions(engine: Engine, examples: Sequence[PreparedExample], candidates: Sequence[Sequence[int]],
                      mode: str = "delete", first_index: int = 0) -> pd.DataFrame:
    """One row per pair of each example's ``candidates`` (positions): the single and joint effects,
    the interaction, the example's largest single effect (over all its scorable tokens) and the
    pair's kind (module docstring). Single effects of every scorable token are evaluated (the
    leave-one-out rows of ``mode``), so the largest is the example's own."""
    replacement = None if mode == "delete" else replacement_token_id(engine.pm, mode)

    def without(ids: tuple[int, ...], gone: set[int]) -> tuple[int, ...]:
        if replacement is None:
            return tuple(x for t, x in enumerate(ids) if t not in gone)
        return tuple(replacement if t in gone else x for t, x in enumerate(ids))

    rows: list[tuple[tuple[int, ...], PreparedExample]] = []
    plan = []
    for example, chosen in zip(examples, candidates):
        ids = tuple(int(x) for x in example.input_ids)
        scorable = scorable_positions(example)
        pairs = [(a, b) for k, a in enumerate(sorted(set(chosen))) for b in sorted(set(chosen))[k + 1:]]
        start = len(rows)
        rows.append((ids, example))
        rows.extend((without(ids, {t}), example) for t in scorable)
        rows.extend((without(ids, {a, b}), example) for a, b in pairs)
        plan.append((start, scorable, pairs))
    if not rows:
        return pd.DataFrame(columns=INTERACTION_COLUMNS)
    values = engine.values(rows, reuse_prefix=engine.pm.task.next_token).double().numpy()  # [rows]
    records = []
    for i, (example, (start, scorable, pairs)) in enumerate(zip(examples, plan)):
        original = values[start]
        single = {t: original - values[start + 1 + k] for k, t in enumerate(scorable)}
        largest = max((abs(v) for v in single.values() if np.isfinite(v)), default=0.0)
        at = start + 1 + len(scorable)
        for k, (a, b) in enumerate(pairs):
            joint = original - values[at + k]
            interaction = joint - (single[a] + single[b])
            kind = _kind(interaction, joint, single[a] + single[b], largest, original)
            weaker = min(abs(single[a]), abs(single[b]))
            floor = max(RELATIVE_FLOOR * abs(original), ABSOLUTE_FLOOR)
            # the largest single effect of another token: above the weaker of the pair (past rounding)?
            above = max((abs(v) for t, v in single.items() if t not in (a, b) and np.isfinite(v)), default=0.0)
            records.append({"example": first_index + i, "position_a": a, "position_b": b,
                            "token_a": example.tokens[a], "token_b": example.tokens[b],
                            "single_a": single[a], "single_b": single[b], "joint": joint,
                            "interaction": interaction, "largest_single": largest, "original_value": original,
                            "kind": kind, "misranked": kind != "additive" and (above > weaker + floor or largest < floor)})
    frame = pd.DataFrame(records, columns=INTERACTION_COLUMNS)
    for column in ("example", "position_a", "position_b"):
        frame[column] = frame[column].astype("int64")
    return frame
