"""The edges a ``sink_head`` or ``edge`` claim blocks (:mod:`probe.claims.kinds.sink_head`,
:mod:`probe.claims.kinds.edge`): the seeded control draws an edge claim is compared with, the
blocked changes, and the words for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from probe.claims.context import AuditContext

__all__ = ["CONTROL_DRAWS", "blocked_changes", "control_keys", "edge_details", "renormalised", "set_changes",
           "window_words"]

#: Seeded random key sets per example that an edge claim's named edges are compared with.
CONTROL_DRAWS = 8


def set_changes(ctx: AuditContext, sets: list, renormalise: bool) -> np.ndarray:
    """[set] f(x) - f(x with the set's edges blocked) (signed), every set in one
    :func:`probe.intervene.knockout.block_edges` call."""
    from probe.intervene.knockout import block_edges

    if not sets:
        return np.array([], dtype=np.float64)
    original, blocked = block_edges(ctx.pm, ctx.examples, sets, renormalise=renormalise)
    examples = [s.example for s in sets]
    return (original[examples] - blocked).double().numpy()


def blocked_changes(ctx: AuditContext, sets: list, renormalise: bool) -> dict[int, float]:
    """Per example with an edge set: f(x) - f(x with its edges blocked) (signed)."""
    return {s.example: float(c) for s, c in zip(sets, set_changes(ctx, sets, renormalise))}


def renormalised(renormalise: bool) -> str:
    return ("the row renormalised over its other keys (-inf before the softmax)" if renormalise
            else "the blocked weights zeroed, the row not renormalised")


def control_keys(ctx: AuditContext, keys: list[tuple[int, ...]],
                 sites: Sequence[tuple[int, int]]) -> list[list[tuple[int, ...]]]:
    """Per example with named keys: ``CONTROL_DRAWS`` seeded draws of as many of its other scored
    tokens (sorted positions; all of them, once, where no more are left; none where none are). A key
    that is an attention sink in at least half of the claim's heads (``sites``; :func:`probe.explainers.
    sinks.attention_sinks` at its default threshold: the first token of most decoder LMs) is never
    drawn: blocking a sink's edges moves a row's mass far more than an ordinary token's, and would
    make every claim look unspecific."""
    from probe.explainers.sinks import SINK_THRESHOLD
    from probe.rows.target import example_seed

    found = ctx.sinks(SINK_THRESHOLD).examples
    out: list[list[tuple[int, ...]]] = []
    for i, k in enumerate(keys):
        if not k:
            out.append([])
            continue
        others = ctx.scorable(i).copy()
        sink = found[i].sinks  # [layer, head, keys] bool
        if sink.shape[-1]:
            votes = sum(sink[layer, head].numpy().astype(np.int64) for layer, head in sites)  # [keys]
            n = min(len(others), len(votes))
            others[:n] &= 2 * votes[:n] < len(sites)
        others[list(k)] = False
        others = np.flatnonzero(others)
        if len(others) <= len(k):
            out.append([tuple(int(p) for p in others)] if len(others) else [])
            continue
        rng = np.random.default_rng(example_seed(ctx.seed, ctx.examples[i]))
        out.append([tuple(int(p) for p in np.sort(rng.choice(others, size=len(k), replace=False)))
                    for _ in range(CONTROL_DRAWS)])
    return out


def window_words(window: list[int]) -> str:
    """The layer window in words: ``layer 3``, ``layers 2-4`` or ``layers 1, 3``."""
    if len(window) == 1:
        return f"layer {window[0]}"
    if window == list(range(window[0], window[-1] + 1)):
        return f"layers {window[0]}-{window[-1]}"
    return f"layers {', '.join(map(str, window))}"


def edge_details(ctx: AuditContext, keys: list[tuple[int, ...]], window: list[int], heads: list[int],
                  signed: np.ndarray, control: np.ndarray, controls: list) -> tuple[np.ndarray, list[dict]]:
    """Per example: the target row's raw attention share on the named keys in the window's heads (NaN
    where it has none), and its details."""
    raw = ctx.scores("attention").scores
    shares = np.full(len(ctx.examples), np.nan)
    details: list[dict] = []
    for i, k in enumerate(keys):
        if not k:
            details.append({})
            continue
        rows = raw[i][window][:, heads].double()  # [window, heads, tokens]
        shares[i] = float(rows[..., list(k)].sum(dim=-1).nanmean())
        texts = ctx.texts(i)
        details.append({"tokens": [f"{texts[p] or ctx.examples[i].tokens[p]}@{p}" for p in k],
                        "attention_share": shares[i], "signed_change": float(signed[i]),
                        "control_abs_change": float(control[i]), "control_tokens": [list(c) for c in controls[i]]})
    return shares, details
