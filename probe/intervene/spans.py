"""Interventions on whole spans (:mod:`probe.rows.spans`): leave-one-out, f(x) - f(x with every token
of the span deleted, or each replaced by the mask, unk or pad token), each perturbed row once through
the engine; and edge knockout, f(x) - f(x with the edges from the target rows to every token of the
span blocked at once in the window's heads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.errors import InputError
from probe.intervene.tokens import replacement_token_id
from probe.registry import SPAN_MODES
from probe.registry import method as method_entry
from probe.rows.spans import SPAN_COLUMNS, Span

if TYPE_CHECKING:
    from probe.intervene.engine import Engine
    from probe.rows.target import PreparedExample

__all__ = ["span_knockout", "span_loo", "span_reference", "span_vectors"]


def span_loo(engine: Engine, examples: Sequence[PreparedExample], found: Sequence[Sequence[Span]],
             mode: str = "delete") -> pd.DataFrame:
    """Leave-one-out of whole spans: per (example, span), ``score`` = f(x) - f(x with the span's
    tokens deleted, or each replaced by the mask, unk or pad token), beside ``original_value``
    f(x). Every perturbed row goes through ``engine`` (one pass over all of them, identical rows once)."""
    if mode not in SPAN_MODES:
        raise InputError(f"span leave-one-out mode {mode!r}: use one of {', '.join(SPAN_MODES)}")
    replacement = None if mode == "delete" else replacement_token_id(engine.pm, mode)
    rows = []
    for example, spans in zip(examples, found):
        ids = list(example.input_ids)
        rows.append((ids, example))
        for span in spans:
            inside = set(span.positions)
            if replacement is None:
                row = [t for p, t in enumerate(ids) if p not in inside]
            else:
                row = [replacement if p in inside else t for p, t in enumerate(ids)]
            rows.append((row, example))
    values = engine.values(rows, reuse_prefix=True).double().numpy()
    at = 0
    records = []
    for i, spans in enumerate(found):
        for j, span in enumerate(spans):
            records.append({"example": i, "span_index": j, "span": span.text, "start": span.start, "end": span.end,
                            "n_tokens": len(span.positions), "role": span.role, "mode": mode,
                            "score": float(values[at] - values[at + 1 + j]), "original_value": float(values[at])})
        at += 1 + len(spans)
    roles = any(span.role is not None for spans in found for span in spans)  # chat messages: their role
    return pd.DataFrame(records, columns=[*SPAN_COLUMNS, *(["role"] if roles else []), "mode", "score",
                                          "original_value"])


def span_vectors(frame: pd.DataFrame, n_examples: int) -> list[np.ndarray]:
    """A :func:`span_loo` frame as one float64 vector of scores per example, in span order."""
    return [frame[frame["example"] == i].sort_values("span_index")["score"].to_numpy(np.float64)
            for i in range(n_examples)]


def span_reference(engine: Engine, examples: Sequence[PreparedExample], found: Sequence[Sequence[Span]], method: str,
                   params: dict | None = None) -> list[np.ndarray] | None:
    """``method`` with each example's spans as its units, one float64 vector per example in span order:
    a leave-one-out with a span form on whole spans (:func:`span_loo`), Shapley values with the spans
    as the players (the method's ``span_scorer``, with ``params``); None where it has no span form."""
    entry = method_entry(method)
    if entry.span_mode is not None:
        return span_vectors(span_loo(engine, examples, found, entry.span_mode), len(examples))
    if entry.span_scorer is not None:
        return entry.load_span_scorer()(engine, examples, found, **{**dict(entry.preset), **(params or {})})
    return None


def span_knockout(engine: Engine, examples: Sequence[PreparedExample], found: Sequence[Sequence[Span]], *,
                  layers: int | str | Sequence[int] | None = None, heads: int | str | Sequence[int] | None = None,
                  query: str = "target", query_from: int | None = None, renormalise: bool = True,
                  per_head: bool = False, keep_special: bool = False, batch_size: int = 32) -> list[np.ndarray]:
    """``knockout`` with each example's spans as its units (the registry's span form of ``knockout``): per
    span, f(x) - f(x with the edges from the target query rows to every token of the span blocked at
    once in every chosen head of the layer window), one float64 vector per example in span order. A
    span of one token scores what ``knockout`` gives that token. The causal prefix before the target
    rows runs once per example (:func:`probe.intervene.knockout.block_edges`). ``per_head`` and
    ``keep_special`` are the token-level run's and are not read here; ``query: from`` has no span form."""
    from probe.intervene.knockout import EdgeSet, block_edges, knockout_window

    if query != "target" or query_from is not None:
        raise InputError("knockout with spans blocks the edges from the target query rows: query: from has no span "
                         "form; use query: target, or token units")
    pm = engine.pm
    info = pm.contract.stacks[pm.task.target_stack(pm.contract)]
    window, chosen = knockout_window(layers, heads, info.n_layers, info.n_heads)
    sites = tuple((layer, head) for layer in window for head in chosen)
    sets = [EdgeSet(i, tuple(span.positions), sites) for i, spans in enumerate(found) for span in spans]
    if not sets:
        return [np.zeros(0) for _ in examples]
    original, blocked = block_edges(pm, examples, sets, renormalise=renormalise, batch_size=batch_size)
    out, at = [], 0
    for i, spans in enumerate(found):
        out.append((original[i] - blocked[at:at + len(spans)]).double().numpy())
        at += len(spans)
    return out
