"""The per-head causal test's AtP screen (``metrics.heads_causal.screen``): which heads run the exact knockout.

The per-head causal test (:mod:`probe.study.heads_causal`) runs one forward row per tested
(layer, head, token): 270 heads x 12 tokens is 3,240 rows for one SmolLM2 sentence. Attribution
patching (:mod:`probe.intervene.atp`) estimates every one of those edge effects from one forward and
one backward. The screen uses the estimates to choose, per example, which heads run exactly (AtP*'s
recipe, Kramar et al. 2024: a first-order pass to rank, exact runs to verify):

* per example and tested head H, AtP's edge estimates e_t give what each token carries to first order,
  ``c_t = e_t / m_t`` (``m_t`` the mechanical weight,
  :func:`~probe.study.heads_causal.mechanical_weight`), and the head's *bound*
  ``B_H = max_t m_t x max_t |c_t|``: the largest edge effect any arrangement of those carried values
  over H's tokens could show;
* the ``heads`` heads with the largest bounds run exactly (``kept``), and ``audit`` more drawn at
  random from the rest (``audit``, seeded by the study's seed and the example); the rest are
  ``screened``: their pairs (example, head) are left out of the test, as pairs at the noise floor are.

Why the bound and not the estimated effects: the test's null deals a head's carried values over its
tokens and keeps its weights, and ``B_H`` is the same under every deal (the largest weight and the
largest carried value do not move). Choosing heads by it does not favour a head whose observed
arrangement is unusual, so the chance test stays valid for the pairs chosen, its family (max-T) being
the heads tested. Choosing by the estimated effects would pick exactly the arrangements the test asks
about: a head whose heavy weight happens to sit on the carrying token. The audited pairs are drawn at
random, so they enter the test like the kept ones.

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

from probe.study.heads_causal import AUDIT, KEPT, SCREENED, mechanical_weight

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study



def head_bounds(attention: np.ndarray, estimates: np.ndarray, renormalise: bool) -> np.ndarray:
    """``[unit]``: each head's bound ``max_t m_t x max_t |c_t|`` (module docstring) from its attention
    weights and AtP edge estimates ``[unit, tokens]`` (NaN where a token is not scored)."""
    scored = np.isfinite(attention) & np.isfinite(estimates)  # [unit, tokens]
    m = np.where(scored, mechanical_weight(np.nan_to_num(attention, nan=0.0), renormalise), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        carried = np.where(scored & (m > 0), np.abs(np.nan_to_num(estimates, nan=0.0)) / m, 0.0)
    if not m.shape[1]:
        return np.zeros(m.shape[0])
    return m.max(axis=1) * carried.max(axis=1)


def choose_heads(bounds: np.ndarray, keep: int, audit: int, rng: np.random.Generator) -> np.ndarray:
    """``[unit]`` labels: the ``keep`` largest bounds :data:`KEPT` (ties to the earlier unit), ``audit``
    of the rest drawn by ``rng`` :data:`AUDIT`, the others :data:`SCREENED`."""
    bounds = np.nan_to_num(np.asarray(bounds, dtype=np.float64), nan=0.0)
    order = np.lexsort((np.arange(len(bounds)), -bounds))
    labels = np.full(len(bounds), SCREENED, dtype=object)
    labels[order[:keep]] = KEPT
    rest = order[keep:]
    if audit and len(rest):
        labels[rng.choice(rest, size=min(audit, len(rest)), replace=False)] = AUDIT
    return labels


def _rng(seed: int, example: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(example), 0x5C12EE])


def screen_units(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int,
                 attention: Sequence[np.ndarray], grid: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The screen on a batch: per example, AtP's edge estimates ``[unit, tokens]`` for the tested heads
    ``grid`` ``[unit, 2]`` (layer, head) and their labels ``[unit]`` (:func:`choose_heads`), from the
    heads' attention weights ``attention`` (per example ``[unit, tokens]``). ``first_index``: the
    study's index of the first example (the audit's seed)."""
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
        bounds = head_bounds(np.asarray(attention[i], dtype=np.float64), est, spec.renormalise)
        estimates.append(est)
        labels.append(choose_heads(bounds, screen.heads, screen.audit, _rng(study.statistics.seed, first_index + i)))
    return estimates, labels


__all__ = ["choose_heads", "head_bounds", "screen_units"]
