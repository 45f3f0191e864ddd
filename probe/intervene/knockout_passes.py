"""Running edge-knockout rows (:mod:`probe.intervene.knockout`): each batch of rows in one forward
under its editors, through the same recomputed attention as the unedited value; rows packed
``batch_size`` at a time with one target kind each, or, in a causal LM whose cache and attention
take it, each example's rows sharing the tokens before their first edited query row as a cache
(prefix reuse: a row then costs only its suffix, the same values)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from probe.errors import CaptureError, InputError
from probe.hooks.capture import capture_attention
from probe.intervene.prefix import model_supports_reuse
from probe.rows.forward import build_rows, forward_accepts, keep_target_logits
from probe.rows.queries import capture_masks, eval_mode
from probe.rows.target import PreparedExample, RowBatch
from probe.rows.values import target_values

if TYPE_CHECKING:
    from probe.hooks.types import Editor
    from probe.models.core import ProbeModel


def _identity(weights, context):
    return weights


def prefix_cache(pm: ProbeModel, stack: str, example: PreparedExample, start: int,
                 window: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``[1, kv_heads, start, head_dim]`` of ``example``'s first ``start``
    tokens, computed through the same recomputed attention as the edited rows (identity editors on
    the window): what every row of the example shares, since no row edits a query before ``start``.
    Fed :data:`~probe.intervene.prefix.QUERY_BLOCK` tokens at a time, each block reading the ones
    before it as its cache, so the recomputed attention holds ``[block, start]`` weights, never
    ``[start, start]``: the prefix costs memory linear in its length."""
    from transformers import DynamicCache

    from probe.intervene import prefix as blocks  # read at call time: a test may narrow the block

    batch = build_rows(pm, [(example.input_ids, example)])
    cache = DynamicCache(config=pm.model.config)
    mask = batch.inputs["attention_mask"][:, :start]
    for low in range(0, start, blocks.QUERY_BLOCK):
        high = min(low + blocks.QUERY_BLOCK, start)
        kwargs = {"input_ids": batch.inputs["input_ids"][:, low:high], "attention_mask": mask[:, :high],
                  "position_ids": torch.arange(low, high, device=pm.device)[None], "cache": cache, "use_cache": True}
        if forward_accepts(pm.model, "logits_to_keep"):
            kwargs["logits_to_keep"] = 1  # the prefix's logits are never read
        with torch.no_grad(), capture_attention(pm, editors={(stack, layer): _identity for layer in window},
                                                stacks=[stack], layers={stack: ()}, attention_mask=mask[:, :high]):
            pm.model(**kwargs)
    # transformers types a cache layer's keys and values Optional (None before its first update): filled above
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[misc]


def suffix_targets(pm: ProbeModel, batch: RowBatch, stack: str, editors: dict[tuple[str, int], Editor], start: int,
                   prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """:func:`edited_targets` for rows of one example (one length, no padding) that edit no query
    before ``start``: only the tokens from ``start`` on are fed, reading ``prefix`` as their cache."""
    from transformers import DynamicCache

    n_rows, width = batch.inputs["input_ids"].shape
    layers = [(keys.expand(n_rows, -1, -1, -1), values.expand(n_rows, -1, -1, -1)) for keys, values in prefix]
    positions = torch.arange(start, width, device=pm.device).expand(n_rows, -1)
    kwargs = {"input_ids": batch.inputs["input_ids"][:, start:], "attention_mask": batch.inputs["attention_mask"],
              "position_ids": positions, "cache": DynamicCache(ddp_cache_data=layers, config=pm.model.config),
              "use_cache": True}
    shifted = keep_target_logits(pm, dataclasses.replace(batch, target_positions=batch.target_positions - start),
                                 kwargs)
    with torch.no_grad(), capture_attention(pm, editors=editors, stacks=[stack], layers={stack: ()},
                                            **capture_masks(batch)):
        logits = pm.model(**kwargs).logits
    return target_values(pm, shifted, logits).float().cpu()


def edited_targets(pm: ProbeModel, batch: RowBatch, stack: str, editors: dict[tuple[str, int], Editor]
                   ) -> torch.Tensor:
    """One forward of ``batch`` with ``editors`` on ``stack``'s attention: the rows' target values."""
    kwargs = dict(batch.inputs)
    if pm.task.continuations:
        kwargs["use_cache"] = False
    batch = keep_target_logits(pm, batch, kwargs)
    with torch.no_grad(), capture_attention(pm, editors=editors, stacks=[stack], layers={stack: ()},
                                            **capture_masks(batch)):
        logits = pm.model(**kwargs).logits
    return target_values(pm, batch, logits).float().cpu()


def kind_chunks(order: list[int], kinds: list[str], batch_size: int) -> Iterator[list[int]]:
    """Consecutive pieces of ``order`` (rows sorted by target kind) of at most ``batch_size`` rows and
    one target kind each (``kinds[i]`` is the kind of ``order[i]``'s example): target_values reads a
    batch's kind from its first example."""
    start = 0
    while start < len(order):
        stop = start
        while stop < len(order) and stop - start < batch_size and kinds[stop] == kinds[start]:
            stop += 1
        yield order[start:stop]
        start = stop


#: with prefix reuse a row feeds only its suffix: up to this many times ``batch_size`` rows per pass
REUSE_ROWS_FACTOR = 8


def reuses_prefix(pm: ProbeModel, stack: str) -> bool:
    """Whether knockout rows of this model can share their example's unedited prefix as a cache: a
    decoder-only causal LM whose cache and attention take it (:func:`probe.intervene.prefix.
    model_supports_reuse`: plain full-attention layers, eager or sdpa)."""
    return (pm.task.next_token and not pm.task.encoder_decoder
            and pm.contract.stacks[stack].mask_kind.startswith("causal") and model_supports_reuse(pm))


def fed_width(pm: ProbeModel, example: PreparedExample) -> int:
    return len(example.input_ids) + (max(0, len(example.target_ids) - 1) if pm.task.next_token else 0)


def evaluate(pm: ProbeModel, stack: str, examples: Sequence[PreparedExample], owners: list[int],
             starts: list[int] | None, batch_size: int, window: Sequence[int],
             run: Callable[[list[int], int, list[tuple[torch.Tensor, torch.Tensor]] | None], torch.Tensor]
             ) -> tuple[torch.Tensor, int]:
    """``[rows]`` float64 values of rows owned by examples ``owners[r]``, and the passes run.

    ``run(rows, start, prefix)`` evaluates a batch of row indices. Without ``starts``: batches of
    ``batch_size`` rows, one target kind each. With ``starts`` (prefix reuse): each example's rows
    alone, its first ``starts[i]`` tokens run once as a cache (:func:`prefix_cache`) and each row
    fed from there on, so a row costs its suffix; up to :data:`REUSE_ROWS_FACTOR` x ``batch_size``
    rows per pass as the suffix is shorter than the row."""
    order = sorted(range(len(owners)), key=lambda r: (examples[owners[r]].kind, owners[r]))
    values = torch.full((len(owners),), float("nan"), dtype=torch.float64)
    passes = 0

    def call(chunk, start=0, prefix=None):
        nonlocal passes
        try:
            out = run(chunk, start, prefix)
        except CaptureError as err:
            raise InputError(f"edge knockout cannot edit the {stack} of {pm.contract.model_type}: {err}") from None
        values[chunk] = out.double()
        passes += 1

    with eval_mode(pm.model):
        if starts is None:
            for chunk in kind_chunks(order, [examples[owners[r]].kind for r in order], batch_size):
                call(chunk)
            return values, passes
        by_example: dict[int, list[int]] = {}
        for r in order:
            by_example.setdefault(owners[r], []).append(r)
        for i, members in by_example.items():
            start = starts[i]
            width = fed_width(pm, examples[i])
            size = batch_size * (min(REUSE_ROWS_FACTOR, max(1, width // max(1, width - start))) if start else 1)
            prefix = prefix_cache(pm, stack, examples[i], start, window) if start else None
            if prefix is not None:
                passes += 1
            for at in range(0, len(members), size):
                call(members[at:at + size], start, prefix)
    return values, passes
