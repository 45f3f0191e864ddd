"""The per-head causal test's AtP screen (``metrics.heads_causal.screen``): which heads run the exact knockout.

The per-head causal test (:mod:`probe.study.heads_causal`) runs one forward row per tested
(layer, head, token): 270 heads x 12 tokens is 3,240 rows for one SmolLM2 sentence. Attribution
patching (:mod:`probe.intervene.atp`) estimates every one of those edge effects from one forward and
one backward. The screen uses the estimates to choose, per example, which heads run exactly (AtP*'s
recipe, Kramar et al. 2024: a first-order pass to rank, exact runs to verify):

* per example, each tested head's *score* is AtP's largest estimated |edge effect|;
* the ``heads`` heads with the largest scores run exactly (``kept``), and ``audit`` more drawn at
  random from the rest (``audit``, seeded by the study's seed and the example); the rest are
  ``screened``: their pairs (example, head) are left out of the test, as pairs at the noise floor are.

Choosing by the estimated effects picks the arrangements the test asks about: a head is kept where
its heavy weights happen to sit on tokens that carry much, which is what "matters" means. Left as
it is, that selection would bias the test towards "matters". So the test's null is conditioned on
it, as it is already conditioned on clearing the noise floor: a deal of what the head's tokens carry
counts only where the screen would have kept the head under it (AtP's estimates dealt as the effects
are, their largest |value| at least the example's threshold, the smallest score it kept;
in :mod:`probe.study.heads_causal`). The audited pairs, drawn at random, enter the test
with no condition. The condition costs power where the selection all but fixes the arrangement: with
the blocked weight zeroed (``renormalise: false``) and one token carrying everything, only the deals
that leave it under the head's weight keep the head, and the conditioned null is the observation
itself (tests/test_head_causal.py: such a head is found on 8 of 30 hand-made data sets, on all 30 with
the row renormalised; positional heads matter on at most 5 under every option, and on 9-30 without
the condition). (A first version ranked by a score the deals leave unchanged, the largest weight
times the largest carried value; on SmolLM2 it was dominated by the sink's weight and kept heads no
better than chance: 94 of 128 audited pairs had larger exact effects than a kept one.)

What the screen may miss, and the bound on it: a screened pair is *missed* when its largest exact
|edge effect| reaches the smallest of the example's kept heads' (the exact effects would have kept it).
AtP errs where the target saturates or later layers respond non-linearly (:mod:`probe.intervene.atp`),
so this is measured, not assumed: among the ``k`` audited pairs, ``j`` are missed, and the one-sided
95% Clopper-Pearson bound ``U`` on the miss rate gives at most ``U x (screened pairs)`` missed pairs
(:func:`probe.study.heads_causal.screen_record`; ``verdict.json``'s ``heads_causal.screen``), with the
Spearman correlation of AtP's estimates with the exact effects on every edge run exactly.

The labels go into the stored ``head_edges`` table (``screen``, beside AtP's estimate ``atp``); the test
reads them from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from probe.study.heads_causal import AUDIT, KEPT, SCREENED

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study


def head_scores(estimates: np.ndarray) -> np.ndarray:
    """``[unit]``: each head's largest |AtP estimate| over its tokens, from ``estimates [unit, tokens]``
    (NaN where a token is not scored; 0 where none is)."""
    sizes = np.where(np.isfinite(estimates), np.abs(estimates), 0.0)
    return sizes.max(axis=1) if sizes.shape[1] else np.zeros(sizes.shape[0])


def choose_heads(scores: np.ndarray, keep: int, audit: int, rng: np.random.Generator) -> np.ndarray:
    """``[unit]`` labels: the ``keep`` largest scores :data:`KEPT` (ties to the earlier unit), ``audit``
    of the rest drawn by ``rng`` :data:`AUDIT`, the others :data:`SCREENED`."""
    scores = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0)
    order = np.lexsort((np.arange(len(scores)), -scores))
    labels = np.full(len(scores), SCREENED, dtype=object)
    labels[order[:keep]] = KEPT
    rest = order[keep:]
    if audit and len(rest):
        labels[rng.choice(rest, size=min(audit, len(rest)), replace=False)] = AUDIT
    return labels


def _rng(seed: int, example: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(example), 0x5C12EE])


def screen_units(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int,
                 grid: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The screen on a batch: per example, AtP's edge estimates ``[unit, tokens]`` for the tested heads
    ``grid`` ``[unit, 2]`` (layer, head) and their labels ``[unit]`` (:func:`choose_heads` on
    :func:`head_scores`). ``first_index``: the study's index of the first example (the audit's seed)."""
    from probe.intervene.atp import attribution_patching

    spec = study.metrics.heads_causal
    screen = spec.screen
    layers = sorted({int(v) for v in grid[:, 0]})
    heads = sorted({int(v) for v in grid[:, 1]})
    result = attribution_patching(pm, examples, layers=layers, heads=heads, renormalise=spec.renormalise,
                                  keep_special=study.statistics.include_special)
    estimates, labels = [], []
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        est = result.per_head.scores[i].double().numpy()[grid[:, 0], grid[:, 1], :n]  # [unit, tokens]
        estimates.append(est)
        rng = _rng(study.statistics.seed, first_index + i)
        labels.append(choose_heads(head_scores(est), screen.heads, screen.audit, rng))
    return estimates, labels


__all__ = ["choose_heads", "head_scores", "screen_units"]
