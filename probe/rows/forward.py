"""Rows into one model batch, and the forward's keyword plumbing: the rows padded into a
:class:`~probe.rows.target.RowBatch` (:func:`build_rows`) with the foil ids a contrast reads, and
what the model class's forward takes (position ids, a plain key/value cache, ``logits_to_keep``).

Layouts (right padding everywhere):
    classification  [input][pad]                        value from logits[row, label]
    causal_lm       [input][continuation][pad]          sum of log p(continuation token | prefix)
    seq2seq         encoder [input][pad], decoder [start][output[:-1]][pad]   sum of log p(output)
    encoder         [input][pad]                        from the pooled embedding [row, hidden]: its cosine
                                                        similarity to a reference text's, or one dimension
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING

import torch

from probe.rows.target import PreparedExample, RowBatch

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def build_rows(pm: ProbeModel, rows: list[tuple[list[int], PreparedExample]], *,
               device: torch.device | str | None = None) -> RowBatch:
    """Pad rows into one model batch. Rows may come from different examples and have different lengths."""
    device = device or pm.device
    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    examples = [example for _, example in rows]
    input_lengths = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long)
    if pm.task.next_token:
        # the last continuation token is never fed: no target reads the logits after it
        sequences = [list(ids) + list(example.target_ids[:-1]) for ids, example in rows]
    else:
        sequences = [list(ids) for ids, _ in rows]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, seq in enumerate(sequences):
        input_ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[r, : len(seq)] = 1
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    positions = tokens = valid = None
    if pm.task.continuations:
        n_target = max(len(example.target_ids) for example in examples)
        positions = torch.zeros((len(rows), n_target), dtype=torch.long)
        tokens = torch.zeros((len(rows), n_target), dtype=torch.long)
        valid = torch.zeros((len(rows), n_target), dtype=torch.bool)
        for r, (ids, example) in enumerate(rows):
            n = len(example.target_ids)
            tokens[r, :n] = torch.tensor(example.target_ids)
            valid[r, :n] = True
            # causal: the token at position len+j is predicted by the logits at len+j-1
            offset = len(ids) - 1 if pm.task.next_token else 0
            positions[r, :n] = torch.arange(n) + offset
        if pm.task.encoder_decoder:
            from probe.models.text import decoder_start_id

            start = decoder_start_id(pm)
            decoder = torch.full((len(rows), n_target), pad, dtype=torch.long)
            decoder_mask = torch.zeros((len(rows), n_target), dtype=torch.long)
            for r, (_, example) in enumerate(rows):
                seq = [start] + list(example.target_ids[:-1])
                decoder[r, : len(seq)] = torch.tensor(seq)
                decoder_mask[r, : len(seq)] = 1
            inputs["decoder_input_ids"] = decoder.to(device)
            inputs["decoder_attention_mask"] = decoder_mask.to(device)
        positions, tokens, valid = positions.to(device), tokens.to(device), valid.to(device)
    return RowBatch(inputs=inputs, examples=examples, input_lengths=input_lengths.to(device),
                    target_positions=positions, target_tokens=tokens, target_valid=valid,
                    foil_tokens=foil_tokens(examples, tokens.shape[1], device) if tokens is not None else None)


def foil_tokens(examples: list[PreparedExample], n_target: int,
                device: torch.device | str | None = None) -> torch.Tensor | None:
    """``[rows, n_target]`` long: each row's contrast foil id at each of its target positions (aligned
    as ``RowBatch.target_tokens`` is), -1 where a row has no foil or no target token; None when no
    row is contrasted. Every builder of a language-model ``RowBatch`` fills ``foil_tokens`` with it."""
    if not any(e.foil_ids for e in examples):
        return None
    foil = torch.full((len(examples), n_target), -1, dtype=torch.long)
    for r, example in enumerate(examples):
        if example.foil_ids:
            foil[r, : len(example.foil_ids)] = torch.tensor(example.foil_ids)
    return foil.to(device) if device is not None else foil


@functools.cache
def _class_accepts(model_class: type[torch.nn.Module], name: str) -> bool:
    try:
        return name in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the model class's forward takes ``name`` (the class, not the instance: a wrapped
    instance method would hide the signature)."""
    return _class_accepts(type(model), name)


def plain_kv_cache(pm: ProbeModel) -> bool:
    """Whether the model takes a ``cache`` and its ``DynamicCache`` holds plain full-attention
    layers (``DynamicLayer``: every key and value kept, appended in order). Sliding-window,
    chunked, linear-attention or shared-KV layers keep another state, and an unusual config
    counts as not plain."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = getattr(DynamicCache(config=pm.model.config), "layers", [])
        plain = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    except Exception:  # an unusual config: not plain
        plain = False
    return plain and forward_accepts(pm.model, "cache")


@functools.cache
def _class_slices_logits_to_keep(model_class: type[torch.nn.Module]) -> bool:
    try:
        return "slice_logits_to_keep(" in inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False


def slices_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model class's forward slices ``logits_to_keep`` with transformers' helper, which
    also takes a boolean ``[batch, positions]`` mask and returns the kept positions flattened, and
    an integer ``[batch, n]`` tensor row by row (transformers 5.17's forwards index
    ``hidden_states[:, logits_to_keep]`` instead: one 1-D list of positions for every row)."""
    return _class_slices_logits_to_keep(type(model))


def keep_target_logits(pm: ProbeModel, batch: RowBatch, kwargs: dict) -> RowBatch:
    """Causal LMs whose forward takes ``logits_to_keep``: project only the positions the target
    reads onto the vocabulary (far less memory; the values are those of the full projection, the
    same rows of the same matmul).

    A forward that slices through transformers' ``slice_logits_to_keep`` (newer 5.x releases) takes
    the ``[rows, n_target]`` target positions: the logits come back as ``[rows, n_target, vocab]``
    and the returned batch's target positions are ``0..n_target-1``. An older forward indexes
    ``hidden_states[:, logits_to_keep]``, which takes one list of positions for every row: it gets
    the sorted positions any row reads, and the returned batch's target positions index that list.
    Any other model: the batch unchanged.
    """
    if not pm.task.next_token or not forward_accepts(pm.model, "logits_to_keep"):
        return batch
    positions = batch.target_positions  # [rows, n_target]
    if slices_logits_to_keep(pm.model):
        kwargs["logits_to_keep"] = positions
        n_rows, n_target = positions.shape
        kept = torch.arange(n_target, device=positions.device).expand(n_rows, n_target)
    else:
        union = torch.unique(positions)  # sorted
        kwargs["logits_to_keep"] = union
        kept = torch.searchsorted(union, positions)
    return dataclasses.replace(batch, target_positions=kept)
