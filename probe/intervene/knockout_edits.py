"""The attention edits of edge knockout (:mod:`probe.intervene.knockout`): editors for
:func:`probe.hooks.capture.capture_attention` that block, per batch row, the edges from chosen query
rows to one key or to a set of keys in chosen heads (the row renormalised as a -inf logit would, or
the blocked weight zeroed), and the query rows each batch row blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from probe.hooks.types import Editor
    from probe.rows.queries import TargetQueries
    from probe.rows.target import RowBatch


def knockout_editor(key: torch.Tensor, heads_on: torch.Tensor, rows_on: torch.Tensor, *, renormalise: bool,
                     sinks: bool) -> Editor:
    """Editor blocking, in batch row ``b``, the edges from the query rows ``rows_on[b]`` to key
    ``key[b]`` in the heads ``heads_on[b]``.

    key      [batch] long, -1 where the row blocks nothing in this layer
    heads_on [batch, head] bool
    rows_on  [batch, query] bool (over the layer's query positions; longer maps: rows beyond are off)
    """

    def edit(weights, context):  # weights [batch, head, query, key] fp32, full rows
        batch, n_heads, q_len, k_len = weights.shape
        rows = rows_on[:, :q_len]
        if rows.shape[1] < q_len:
            rows = torch.nn.functional.pad(rows, (0, q_len - rows.shape[1]))
        index = key.clamp(min=0)[:, None, None, None].expand(batch, n_heads, q_len, 1)  # [batch, head, query, 1]
        blocked = weights.gather(-1, index)  # [batch, head, query, 1] the weight of each blocked edge
        hit = (heads_on[:, :, None, None] & rows[:, None, :, None] & (key >= 0)[:, None, None, None]
               & (blocked > 0))  # [batch, head, query, 1]: rows where something is removed
        if not bool(hit.any()):
            return weights
        kept = weights.scatter(-1, index, torch.where(hit, torch.zeros_like(blocked), blocked))
        if not renormalise:
            return kept
        remaining = kept.sum(dim=-1, keepdim=True)  # [batch, head, query, 1] the row's other keys
        if sinks:
            # the sink's mass is what the row's weights leave of 1; its logit stays in the softmax
            remaining = remaining + (1.0 - weights.sum(dim=-1, keepdim=True)).clamp(min=0.0)
        scale = torch.where(remaining > 0, 1.0 / remaining.clamp(min=torch.finfo(remaining.dtype).tiny),
                            torch.zeros_like(remaining))
        return torch.where(hit, kept * scale, weights)

    return edit


def key_set_editor(keys_on: torch.Tensor, heads_on: torch.Tensor, rows_on: torch.Tensor, *, renormalise: bool,
                   sinks: bool) -> Editor:
    """Editor blocking, in batch row ``b``, the edges from the query rows ``rows_on[b]`` to every key
    of ``keys_on[b]`` in the heads ``heads_on[b]`` (renormalised as :func:`knockout_editor` does).

    keys_on  [batch, key] bool (over the explained positions; longer maps: keys beyond are off)
    heads_on [batch, head] bool
    rows_on  [batch, query] bool
    """

    def edit(weights, context):  # weights [batch, head, query, key] fp32, full rows
        _, _, q_len, k_len = weights.shape
        rows = torch.nn.functional.pad(rows_on[:, :q_len], (0, max(0, q_len - rows_on.shape[1])))
        keys = torch.nn.functional.pad(keys_on[:, :k_len], (0, max(0, k_len - keys_on.shape[1])))
        blocked = heads_on[:, :, None, None] & rows[:, None, :, None] & keys[:, None, None, :]  # [batch, head, q, k]
        hit = (blocked & (weights > 0)).any(dim=-1, keepdim=True)  # [batch, head, query, 1]
        if not bool(hit.any()):
            return weights
        kept = weights.masked_fill(blocked, 0.0)
        if not renormalise:
            return torch.where(hit, kept, weights)
        remaining = kept.sum(dim=-1, keepdim=True)
        if sinks:  # a learned sink's mass stays in the denominator, as its logit stays in the softmax
            remaining = remaining + (1.0 - weights.sum(dim=-1, keepdim=True)).clamp(min=0.0)
        scale = torch.where(remaining > 0, 1.0 / remaining.clamp(min=torch.finfo(remaining.dtype).tiny),
                            torch.zeros_like(remaining))
        return torch.where(hit, kept * scale, weights)

    return edit


def blocked_query_rows(batch: RowBatch, tq: TargetQueries, keys: torch.Tensor, query: str, query_from: int | None,
                       width: int) -> torch.Tensor:
    """[rows, width] bool: the query rows each batch row blocks."""
    positions = torch.arange(width, device=keys.device)
    if query == "target":
        on = torch.zeros((keys.shape[0], width), dtype=torch.bool, device=keys.device)
        batch_index, column = tq.valid.nonzero(as_tuple=True)
        on[batch_index, tq.rows[batch_index, column].to(keys.device)] = True
        return on
    lengths = batch.input_lengths.to(keys.device)
    if query_from is None:
        first = keys + 1
    elif query_from < 0:
        first = (lengths + query_from).clamp(min=0)
    else:
        first = torch.full_like(keys, query_from)
    return positions[None, :] >= first[:, None]
