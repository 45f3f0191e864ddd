"""The edges a ``sink_head`` or ``edge`` claim blocks (:mod:`probe.claims.kinds`): which keys an edge
claim names, the seeded control draws it is compared with, the blocked changes, and the words for them."""

from __future__ import annotations

import math

import numpy as np

from probe.claims.context import AuditContext
from probe.errors import InputError
from probe.spec.claims import EdgeClaim

__all__ = ["CONTROL_DRAWS", "blocked_changes", "control_keys", "control_warning", "edge_details", "edge_keys",
           "renormalised", "set_changes", "window_words"]

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


def edge_keys(ctx: AuditContext, claim: EdgeClaim, index: int) -> list[tuple[int, ...]]:
    """Per example, the positions the claim's edges go to (empty: the example has none)."""
    if claim.to_position is not None:
        out = []
        for example in ctx.examples:
            n = len(example.input_ids)
            p = claim.to_position if claim.to_position >= 0 else n + claim.to_position
            out.append((p,) if 0 <= p < n else ())
        if not any(out):
            raise InputError(f"{ctx.file.where(index, 'to_position')}: position {claim.to_position} lies outside "
                             f"every one of the {len(ctx.examples)} examples (the longest has "
                             f"{max(len(e.input_ids) for e in ctx.examples)} tokens)")
        return out
    matcher = claim.matcher()
    out = [tuple(int(p) for p in np.flatnonzero(ctx.matches(i, matcher))) for i in range(len(ctx.examples))]
    if not any(out):
        raise InputError(f"{ctx.file.where(index, 'to' if claim.to is not None else 'to_words')}: {claim.to_what} "
                         f"match no token in any of the {len(ctx.examples)} examples searched (token texts are "
                         "matched whole, case-insensitive, word-piece markers stripped); check the pattern or use "
                         "more data")
    return out


def control_keys(ctx: AuditContext, keys: list[tuple[int, ...]], sites) -> list[list[tuple[int, ...]]]:
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


def control_warning(claim: EdgeClaim, verdict: str, control_mean: float, above: float | None, where: str) -> str | None:
    """One line where a supported edge claim's effect is not specific to its tokens (None otherwise)."""
    if verdict != "supported" or above is None:
        return None
    reasons = []
    if math.isfinite(control_mean) and control_mean >= claim.threshold:
        reasons.append(f"blocking the target row's edges to as many random other tokens in {where} moves the target "
                       f"by {control_mean:.3g} (>= threshold {claim.threshold:g})")
    if above <= 0.5:
        reasons.append(f"the named edges move the target more than random ones in only {above:.0%} of the examples")
    if not reasons:
        return None
    return "; ".join(reasons) + f": the effect is not specific to {claim.to_what}"


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
