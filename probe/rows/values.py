"""Target arithmetic: each row's target value from the model's logits (:func:`target_values`), a
language model's per-position values and their sum or step (:func:`position_values`,
:func:`reduce_positions`), what a contrast subtracts (:func:`contrast_terms`), and the forward
passes that read them (:func:`evaluate`, :func:`output_values`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError, ProbeError
from probe.rows.forward import build_rows, keep_target_logits
from probe.rows.target import PreparedExample, RowBatch

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def target_values(pm: ProbeModel, batch: RowBatch, logits: torch.Tensor) -> torch.Tensor:
    """[rows] target value of each row from the model's logits (fp32)."""
    logits = logits.float()
    if pm.task.embeds:  # logits: [rows, hidden] pooled embeddings
        if batch.examples[0].kind == "similarity":
            reference = torch.stack(
                [e.reference_embedding for e in batch.examples]  # type: ignore[misc]  # set on every similarity example
            ).to(logits.device)  # [rows, hidden]
            return torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
        dims = torch.tensor([e.label for e in batch.examples], device=logits.device)
        return logits.gather(1, dims[:, None])[:, 0]
    if pm.task.labels:
        labels = torch.tensor([e.label for e in batch.examples], device=logits.device)
        kind = batch.examples[0].kind
        if kind == "logit":
            return logits.gather(1, labels[:, None])[:, 0] - contrast_terms(batch, logits, kind)
        logp = torch.log_softmax(logits, dim=-1).gather(1, labels[:, None])[:, 0]
        if kind == "logprob":
            return logp - contrast_terms(batch, logits, kind)
        return logp.exp() - contrast_terms(batch, logits, kind)  # refused where a row is contrasted
    return reduce_positions(position_values(pm, batch, logits), batch.examples)


def position_values(pm: ProbeModel, batch: RowBatch, logits: torch.Tensor) -> torch.Tensor:
    """A language model's ``[rows, n_target]`` per output position: the log-prob of the target
    token there (kind ``logit``: its logit; with a contrast, minus the foil's), 0 past a shorter
    row's output. Every target of the row's example (the whole output, or one ``step``) is a
    reduction of it (:func:`reduce_positions`), so one forward pass gives them all."""
    logits = logits.float()
    kind = batch.examples[0].kind
    index = batch.target_positions[:, :, None].expand(-1, -1, logits.shape[-1])
    at = logits.gather(1, index)  # [rows, n_target, vocab]
    chosen = batch.target_tokens[:, :, None]
    if batch.examples[0].kind == "logit":
        per_token = at.gather(2, chosen)[..., 0]
    else:
        per_token = torch.log_softmax(at, dim=-1).gather(2, chosen)[..., 0]
    per_token = per_token - contrast_terms(batch, at, kind)
    return per_token * batch.target_valid


def reduce_positions(values: torch.Tensor, examples: list[PreparedExample]) -> torch.Tensor:
    """``[rows]`` target values from :func:`position_values` ``[rows, n_target]``: the sum over the
    output, or the example's ``step`` alone; exponentiated for kind ``prob``."""
    if any(e.step is not None for e in examples):
        positions = torch.arange(values.shape[1], device=values.device)
        steps = torch.tensor([-1 if e.step is None else e.step for e in examples], device=values.device)
        values = values * ((positions[None, :] == steps[:, None]) | (steps[:, None] < 0))
    total = values.sum(1)
    return total.exp() if examples[0].kind == "prob" else total


def contrast_terms(batch: RowBatch, scores: torch.Tensor, kind: str) -> torch.Tensor | float:
    """What a contrastive target subtracts, from the same logits as the target (no forward of its own).

    Classifier (``scores`` ``[rows, classes]``): ``[rows]`` the contrast label's logit (kind logit) or
    log-prob (kind logprob), 0 for rows without a contrast label. Language model (``scores``
    ``[rows, n_target, vocab]``, the logits at the target positions): ``[rows, n_target]`` the
    foil's logit or log-prob at each position, 0 where a row has no foil. ``0.`` when no row of the
    batch is contrasted.
    """
    examples = batch.examples
    if not any(e.contrasted for e in examples):
        return 0.0
    if kind not in ("logit", "logprob"):
        raise InputError(f"target kind {kind!r} cannot be contrasted (a difference of log-probs is not a probability): "
                         "use logprob or logit")
    scores = scores.float()
    if scores.dim() == 2:  # classifier
        contrast = torch.tensor([-1 if e.contrast_label is None else e.contrast_label for e in examples],
                                device=scores.device)  # [rows]
        picked = scores.gather(1, contrast.clamp(min=0)[:, None])[:, 0]  # [rows]
        if kind == "logprob":
            picked = picked - torch.logsumexp(scores, dim=-1)
        return picked * (contrast >= 0)
    foil = batch.foil_tokens
    if foil is None:
        raise ProbeError("a contrasted language-model batch was built without its foil tokens "
                         "(RowBatch.foil_tokens): build it with build_rows or fill it with foil_tokens()")
    picked = scores.gather(2, foil.clamp(min=0)[..., None])[..., 0]  # [rows, n_target]
    if kind == "logprob":
        picked = picked - torch.logsumexp(scores, dim=-1)
    return picked * (foil >= 0)


def evaluate(pm: ProbeModel, rows: list[tuple[list[int], PreparedExample]]) -> torch.Tensor:
    """Target values of ``rows`` in one forward pass (callers batch; see the engine)."""
    batch = build_rows(pm, rows)
    with torch.no_grad():
        logits = pm.model(**batch.inputs).logits
    return target_values(pm, batch, logits)


def output_values(pm: ProbeModel, example: PreparedExample) -> torch.Tensor:
    """``[n_target]`` the value of each output token of ``example`` (log-prob, logit or prob, minus
    its foil's where contrasted) given the input and the output before it, from one forward of the
    example's row: every step of it reads a column of the same row (:func:`position_values`)."""
    whole = dataclasses.replace(example, step=None)
    batch = build_rows(pm, [(whole.input_ids, whole)])
    inputs = dict(batch.inputs)
    kept = keep_target_logits(pm, batch, inputs)
    with torch.no_grad():
        logits = pm.model(**inputs).logits
    values = position_values(pm, kept, logits)[0]  # [n_target]
    return values.exp() if example.kind == "prob" else values
