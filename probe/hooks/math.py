"""Attention probabilities recomputed from the tensors a model hands its attention function.

Shapes (HF's attention-interface convention):
    query           [batch, head, query, dim]
    key, value      [batch, kv_head, key, dim]     kv_head divides head (MHA, GQA, MQA)
    attention_mask  None, bool [batch|1, 1|head, query, key] (True = may attend),
                    or additive float of the same shape
    position_bias   None or float [batch|1, head, query, key]   (T5's relative bias)
    rows            None (every query) or long [batch, rows]    query positions to keep
"""

from __future__ import annotations

import torch


def repeat_kv(states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, kv_head, key, dim] -> [batch, kv_head * n_rep, key, dim]; query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return states
    batch, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, n_rep, length, dim).reshape(batch, kv_heads * n_rep, length, dim)


def gather_rows(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Pick query rows (dim 2) per example: [B|1, H|1, Q, K] -> [B, H|1, R, K]; rows is [B, R]."""
    if rows is None:
        return tensor
    batch = rows.shape[0]
    if tensor.shape[0] == 1 and batch > 1:
        tensor = tensor.expand(batch, *tensor.shape[1:])
    if tensor.shape[2] == 1:  # one row for every query (a [B, 1, 1, K] padding mask): the same for each
        return tensor.expand(batch, tensor.shape[1], rows.shape[1], tensor.shape[-1])
    index = rows[:, None, :, None].expand(batch, tensor.shape[1], rows.shape[1], tensor.shape[-1])
    return torch.gather(tensor, 2, index)


def allowed_keys(
    attention_mask: torch.Tensor | None,
    *,
    batch: int,
    q_len: int,
    k_len: int,
    is_causal: bool,
    rows: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean [B|1, 1|H, R, K] of keys each kept row may attend to, or None when all may.

    A float mask counts a key as blocked where it holds a large negative value (HF fills with
    the dtype's minimum). With no mask, ``is_causal`` means SDPA's upper-left causal rule, which is
    what HF's SDPA path uses then.
    """
    if attention_mask is not None:
        mask = attention_mask[..., :k_len]
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        return gather_rows(mask, rows)
    if is_causal and q_len > 1:
        query_pos = torch.arange(q_len, device=device)
        if rows is None:
            rows_pos = query_pos[None, :].expand(batch, q_len)
        else:
            rows_pos = rows
        keys = torch.arange(k_len, device=device)
        return (keys[None, None, :] <= rows_pos[:, :, None])[:, None]  # [B, 1, R, K]
    return None


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float | None,
    rows: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Pre-softmax scores in fp32: [batch, head, rows, key]."""
    n_rep = query.shape[1] // key.shape[1]
    keys = repeat_kv(key, n_rep).float()
    picked = gather_rows(query, rows).float()
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(picked, keys.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + gather_rows(position_bias[..., : key.shape[2]], rows).float()
    return scores


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None, *,
                   inplace: bool = False, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the key axis with blocked keys at exactly 0.

    Returns (weights [B, H, R, K] fp32, row_has_keys [B, H|1, R] bool). A row with no allowed key
    gets all-zero weights (never NaN); ``row_has_keys`` says which rows those were.
    ``inplace``: ``scores`` may be overwritten and the weights are zeroed in place (fewer [R, K]
    temporaries; not for tensors autograd needs).
    ``sinks``: one logit per head [head] for an attention sink, a key every row sees that mixes no
    value (gpt-oss), or one per head and query row [B, H, R, 1] (inkling2's per-token sinks, rows
    already picked): it joins the softmax and is dropped after, so rows sum to 1 minus its mass.
    """
    if sinks is not None:
        if sinks.dim() == 4:
            sink = sinks.float().expand(scores.shape[0], scores.shape[1], scores.shape[2], 1)  # [B, H, R, 1]
        else:
            sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)  # [B, H, R, 1]
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(torch.cat([scores, sink.to(scores.dtype)], dim=-1), dim=-1)[..., :-1]
        if allowed is None:
            return weights, torch.ones(scores.shape[:-1], dtype=torch.bool, device=scores.device)
        row_has_keys = allowed.any(dim=-1)
        return torch.where(row_has_keys[..., None], weights, torch.zeros((), dtype=weights.dtype, device=weights.device)), row_has_keys
    if allowed is None:
        weights = torch.softmax(scores, dim=-1)
        return weights, torch.ones(scores.shape[:-1], dtype=torch.bool, device=scores.device)
    # The dtype's minimum rather than -inf: a fully blocked row stays finite (then zeroed), so
    # gradients through it are zero rather than NaN.
    blocked = torch.finfo(scores.dtype).min
    masked = scores.masked_fill_(~allowed, blocked) if inplace else scores.masked_fill(~allowed, blocked)
    weights = torch.softmax(masked, dim=-1)
    row_has_keys = allowed.any(dim=-1)
    if inplace:
        return weights.masked_fill_(~row_has_keys[..., None], 0.0), row_has_keys
    weights = torch.where(row_has_keys[..., None], weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    return weights, row_has_keys


def head_mean_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scaling: float | None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over query heads of the full attention weights: [batch, query, key] fp32.

    Equal to ``masked_softmax(attention_scores(...), allowed)[0].mean(dim=1)``, but computed one
    query head at a time (reading its key/value head under GQA), so one head's map exists at
    once instead of every head's.
    """
    n_heads, n_kv = query.shape[1], key.shape[1]
    group = n_heads // n_kv
    total = None
    for h in range(n_heads):
        bias = position_bias[:, h:h + 1] if position_bias is not None and position_bias.shape[1] > 1 else position_bias
        mask = allowed[:, h:h + 1] if allowed is not None and allowed.shape[1] > 1 else allowed
        scores = attention_scores(query[:, h:h + 1], key[:, h // group:h // group + 1], scaling=scaling,
                                  position_bias=bias, softcap=softcap)  # [batch, 1, query, key]
        head_sinks = None if sinks is None else (sinks[:, h:h + 1] if sinks.dim() == 4 else sinks[h:h + 1])
        part = masked_softmax(scores, mask, inplace=True, sinks=head_sinks)[0][:, 0]  # [batch, query, key]
        del scores
        total = part if total is None else total.add_(part)
    assert total is not None  # at least one query head
    return total / n_heads


def attention_output(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Mix values with (possibly edited) full weights: [B, H, Q, K] x [B, KV, K, D] -> [B, Q, H, D] (HF's layout)."""
    values = repeat_kv(value, weights.shape[1] // value.shape[1])
    return torch.matmul(weights.to(values.dtype), values).transpose(1, 2).contiguous()
