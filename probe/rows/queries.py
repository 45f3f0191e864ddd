"""Where the target query is, and running the explained rows unperturbed: shared by the
explainers (:mod:`probe.explainers`) and the interventions (:mod:`probe.intervene`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.rows.forward import build_rows
from probe.rows.target import PreparedExample, RowBatch, same_row_groups

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


# ---------------------------------------------------------------------------
# where the target query is, and running the explained rows
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetQueries:
    """The attention rows that explain the target, for one batch of rows."""

    stack: str  # the stack whose attention is read: encoder | decoder | cross
    rows: torch.Tensor  # [batch, rows] long query positions in that stack
    valid: torch.Tensor  # [batch, rows] bool; False only for seq2seq outputs shorter than the longest
    lengths: torch.Tensor  # [batch] number of explained tokens (= keys that are scored)

    def mean_over_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Average ``values`` [batch, ..., rows, key] over the valid target rows -> [batch, ..., key]."""
        weight = self.valid.to(values.dtype)
        weight = weight / weight.sum(dim=1, keepdim=True).clamp(min=1)
        shape = (weight.shape[0],) + (1,) * (values.dim() - 3) + (weight.shape[1], 1)
        return (values * weight.view(shape)).sum(dim=-2)


def target_queries(pm: ProbeModel, batch: RowBatch) -> TargetQueries:
    """Where the target query row(s) of every row of ``batch`` are (see the module docstring)."""
    lengths = batch.input_lengths
    n_rows = lengths.shape[0]
    steps = [e.step for e in batch.examples]
    if pm.task.encoder_decoder:
        valid = batch.target_valid  # [batch, n_target]
        positions = torch.arange(valid.shape[1], device=valid.device).expand(n_rows, -1)
        if any(s is not None for s in steps):  # a step's own decoder row alone
            at = torch.tensor([-1 if s is None else s for s in steps], device=valid.device)
            valid = valid & ((positions == at[:, None]) | (at[:, None] < 0))
        # Padded output positions point at 0 (always a real decoder position) and are masked by `valid`.
        rows = torch.where(valid, positions, torch.zeros_like(positions))
        return TargetQueries("cross", rows, valid, lengths)
    stack = pm.contract.primary_stack
    bidirectional = pm.contract.stacks[stack].mask_kind == "bidirectional"
    if pm.task.embeds and pm.pooling.mode != "cls":
        # the pooled embedding reads every explained position: all their rows, averaged
        width = int(lengths.max())
        positions = torch.arange(width, device=lengths.device).expand(n_rows, -1)  # [batch, width]
        valid = positions < lengths[:, None]
        return TargetQueries(stack, torch.where(valid, positions, torch.zeros_like(positions)), valid, lengths)
    if pm.task.pooled and bidirectional:
        rows = torch.zeros((n_rows, 1), dtype=torch.long, device=lengths.device)
    else:  # causal: the position whose logits predict the target (output token `step`: step places later)
        offset = torch.tensor([0 if s is None else s for s in steps], device=lengths.device)
        rows = (lengths - 1 + offset).view(n_rows, 1)
    return TargetQueries(stack, rows, torch.ones_like(rows, dtype=torch.bool), lengths)


def mixing_widths(tq: TargetQueries) -> list[int]:
    """Per row, how many positions a token-mixing product must span to reach its target query: the
    explained tokens, and for a causal LM's output token (``step``) the output before it too (its
    query row sits after the input). The scores are then cropped to the explained tokens."""
    if tq.stack == "cross":
        return [int(n) for n in tq.lengths.tolist()]
    last = torch.where(tq.valid, tq.rows, torch.zeros_like(tq.rows)).max(dim=1).values + 1
    return [max(int(n), int(q)) for n, q in zip(tq.lengths.tolist(), last.tolist())]


def capture_masks(batch: RowBatch) -> dict:
    """The padding masks capture_attention wants, from a row batch."""
    return {"attention_mask": batch.inputs["attention_mask"],
            "decoder_attention_mask": batch.inputs.get("decoder_attention_mask")}


@contextmanager
def eval_mode(model: torch.nn.Module, *, grad: bool | None = None, inputs_only: bool = False) -> Iterator[None]:
    """Every module of ``model`` in eval mode for the duration (dropout off: a result taken with
    dropout on differs from call to call, as Jain & Wallace's permutations did; attention edits are
    refused in training mode), and each module's own mode restored after (a model the user put in
    training mode, or one with a submodule left in training mode, comes back as it was).

    ``grad``: autograd for the duration: None leaves it as the caller has it (captures, attention
    edits); False turns it off (the interventions' forwards: no graph is kept); True turns it on,
    even under a caller's ``torch.no_grad()`` (the gradient attributions).

    ``inputs_only`` (with ``grad=True``): the pass differentiates only a tensor it feeds in (the
    attributed embeddings), so the parameters are set not to require gradients for its duration
    (their flags are restored after). Autograd then keeps no activations for weight gradients that
    nobody reads; the input gradients are the same.
    """
    if inputs_only and grad is not True:
        raise ValueError("inputs_only needs grad=True")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    frozen = [p for p in model.parameters() if p.requires_grad] if inputs_only else []
    try:
        for parameter in frozen:
            parameter.requires_grad_(False)
        with nullcontext() if grad is None else torch.set_grad_enabled(grad):
            yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
        for module, training in modes:
            module.training = training


def _check_batching(examples: Sequence[PreparedExample], batch_size) -> None:
    if not examples:
        raise InputError("no examples to explain: give at least one prepared example")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")


def row_batches(pm: ProbeModel, examples: Sequence[PreparedExample], batch_size: int) -> Iterator[tuple[RowBatch, TargetQueries]]:
    """Unperturbed rows of ``examples`` in chunks of ``batch_size``, with their target queries."""
    _check_batching(examples, batch_size)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        batch = build_rows(pm, [(e.input_ids, e) for e in chunk])
        yield batch, target_queries(pm, batch)


def shared_row_batches(pm: ProbeModel, examples: Sequence[PreparedExample],
                       batch_size: int) -> Iterator[tuple[RowBatch, TargetQueries, list[list[tuple[int, int | None]]]]]:
    """:func:`row_batches` with the output tokens of one text sharing one row: examples that feed
    the model the same row (:func:`~probe.rows.target.same_row_groups`) are run once, their target
    queries the query row of each, so a text's T output tokens cost one forward, not T.

    Yields ``(batch, tq, picks)``: ``picks[r]`` lists ``(example index, query column)`` read from
    row ``r`` of ``batch``; the column is None for an example that is a row of its own (read it
    with :meth:`TargetQueries.mean_over_rows`, as :func:`row_batches`' rows are).
    """
    _check_batching(examples, batch_size)
    groups = same_row_groups(examples)
    for start in range(0, len(groups), batch_size):
        chunk = groups[start: start + batch_size]
        batch = build_rows(pm, [(examples[g[0]].input_ids, examples[g[0]]) for g in chunk])
        if all(len(g) == 1 for g in chunk):
            yield batch, target_queries(pm, batch), [[(g[0], None)] for g in chunk]
            continue
        # every member's own query row, found without a forward: build_rows only lays out tensors
        members = [i for g in chunk for i in g]
        own = target_queries(pm, build_rows(pm, [(examples[i].input_ids, examples[i]) for i in members]))
        if not bool((own.valid.sum(1) == 1).all()):  # a member reading several rows: one row each
            for i in members:
                one = build_rows(pm, [(examples[i].input_ids, examples[i])])
                yield one, target_queries(pm, one), [[(i, None)]]
            continue
        at = own.rows.gather(1, own.valid.long().argmax(1, keepdim=True))[:, 0].tolist()  # [members]
        width = max(len(g) for g in chunk)
        rows = torch.zeros((len(chunk), width), dtype=torch.long, device=own.rows.device)
        valid = torch.zeros((len(chunk), width), dtype=torch.bool, device=own.rows.device)
        picks: list[list[tuple[int, int | None]]] = []
        n = 0
        for r, g in enumerate(chunk):
            rows[r, : len(g)] = torch.tensor(at[n: n + len(g)], device=rows.device)
            valid[r, : len(g)] = True
            picks.append([(i, j) for j, i in enumerate(g)])
            n += len(g)
        yield batch, TargetQueries(own.stack, rows, valid, batch.input_lengths), picks


def crop(values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """[batch, ..., key] -> one [..., tokens] tensor per row, padding keys cut off."""
    return [values[i, ..., : int(n)] for i, n in enumerate(lengths.tolist())]
