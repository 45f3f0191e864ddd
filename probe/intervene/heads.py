"""Head ablation and head importance (Michel et al. 2019).

Ablating head h means multiplying its output by xi_h = 0 (Michel et al.'s head mask). A head's
output is weights_h @ V_h, linear in its weights, so an attention editor that scales the head's
weights by xi_h scales its output by xi_h: zeroing every row of the head removes its contribution
(value bias included) and nothing else. transformers 5 dropped the ``head_mask`` argument, so the
tests check this against a manual mask on the output projection's input instead.

Many ablations run in one batch: the examples are repeated, one ablation set per row, and the
editor of each layer multiplies by a per-row keep mask ``[row, head]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.hooks.capture import capture_attention
from probe.hooks.types import python_layer
from probe.rows.forward import build_rows
from probe.rows.frames import grid_frame
from probe.rows.queries import capture_masks, eval_mode
from probe.rows.target import PreparedExample
from probe.rows.values import target_values

if TYPE_CHECKING:
    import pandas as pd

    from probe.models.core import ProbeModel

HeadSet = Collection[tuple[int, int]]  # {(layer, head), ...}
LOSSES = ("nll", "target")


def _stack(pm: ProbeModel, stack: str | None) -> str:
    stack = stack or pm.contract.primary_stack
    if stack not in pm.contract.stacks:
        raise InputError(f"model has no {stack!r} attention: its stacks are {', '.join(pm.contract.stacks)}")
    return stack


def _keep_masks(pm: ProbeModel, stack: str, ablations: Sequence[HeadSet]) -> torch.Tensor:
    """[ablation, layer, head] float: 0 where the head is ablated, 1 elsewhere."""
    info = pm.contract.stacks[stack]
    keep = torch.ones((len(ablations), info.n_layers, info.n_heads))
    for a, heads in enumerate(ablations):
        for layer, head in heads:
            index = python_layer(layer, info.n_layers)
            if index is None or not 0 <= head < info.n_heads:
                raise InputError(f"head ({layer}, {head}) does not exist in the {stack}: it has layers "
                                 f"0..{info.n_layers - 1} (-1 is the last) and heads 0..{info.n_heads - 1}")
            keep[a, index, head] = 0.0
    return keep


def _scale_heads(factor: torch.Tensor):
    """Editor multiplying each row's heads by ``factor`` [batch, head] (0 = ablated, or a gate xi)."""

    def edit(weights, context):  # weights [batch, head, query, key]
        return weights * factor[:, :, None, None].to(weights.dtype)

    return edit


def ablate_heads(pm: ProbeModel, examples: Sequence[PreparedExample], ablations: Sequence[Iterable[tuple[int, int]]], *,
                 stack: str | None = None, batch_size: int = 32) -> torch.Tensor:
    """Target value of every example with each set of heads ablated: [example, ablation].

    ``ablations``: a list of head sets, each ``{(layer, head), ...}`` (an empty set = no ablation).
    Rows are example-major and run ``batch_size`` at a time.
    """
    stack = _stack(pm, stack)
    ablations = [list(a) for a in ablations]
    if not ablations or not examples:
        raise InputError("head ablation needs at least one example and one set of heads")
    keep = _keep_masks(pm, stack, ablations)  # [ablation, layer, head]
    rows = [(e.input_ids, e) for e in examples for _ in ablations]
    row_keep = keep.repeat(len(examples), 1, 1)  # [example * ablation, layer, head]
    values = []
    with eval_mode(pm.model, grad=False):
        for start in range(0, len(rows), batch_size):
            batch = build_rows(pm, rows[start: start + batch_size])
            chunk_keep = row_keep[start: start + batch_size].to(pm.device)  # [rows, layer, head]
            editors = {(stack, layer): _scale_heads(chunk_keep[:, layer])
                       for layer in range(chunk_keep.shape[1]) if bool((chunk_keep[:, layer] < 1).any())}
            with capture_attention(pm, editors=editors, stacks=[stack], layers={stack: ()}, **capture_masks(batch)):
                logits = pm.model(**batch.inputs).logits
            values.append(target_values(pm, batch, logits).cpu())
    return torch.cat(values).view(len(examples), len(ablations))


@dataclass(repr=False)
class HeadEffects:
    """Target with each single head ablated; ``change`` = original - ablated (the sign TokenScores use)."""

    stack: str
    original: torch.Tensor  # [example]
    ablated: torch.Tensor  # [example, layer, head]
    params: dict = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        n, n_layers, n_heads = self.ablated.shape
        text = f"<HeadEffects {self.stack}: {n} examples x {n_layers} layers x {n_heads} heads"
        mean = self.mean_abs_change
        if mean.numel() and bool(torch.isfinite(mean).any()):
            layer, head = divmod(int(torch.nan_to_num(mean, nan=-1.0).argmax()), n_heads)
            text += f"; largest mean |change| {float(mean[layer, head]):.4g} at L{layer}.H{head}"
        return text + ">"

    @property
    def change(self) -> torch.Tensor:
        """[example, layer, head] original - ablated."""
        return self.original[:, None, None] - self.ablated

    @property
    def mean_abs_change(self) -> torch.Tensor:
        """[layer, head] mean over examples of ``|change|``."""
        return self.change.abs().mean(dim=0)

    def to_pandas(self) -> pd.DataFrame:
        """One row per (example, layer, head): ``original``, ``ablated``, ``change``."""
        return grid_frame(("example", "layer", "head"), {"original": self.original[:, None, None],
                                                         "ablated": self.ablated, "change": self.change})


def head_ablation_effects(pm: ProbeModel, examples: Sequence[PreparedExample], *, stack: str | None = None,
                          batch_size: int = 32) -> HeadEffects:
    """Ablate every head of ``stack`` alone (one head per row, all in few batches)."""
    stack = _stack(pm, stack)
    info = pm.contract.stacks[stack]
    singles: list[list[tuple[int, int]]] = [[]] + [[(layer, head)] for layer in range(info.n_layers)
                                                   for head in range(info.n_heads)]
    values = ablate_heads(pm, examples, singles, stack=stack, batch_size=batch_size)  # [example, 1 + L*H]
    return HeadEffects(stack=stack, original=values[:, 0],
                       ablated=values[:, 1:].reshape(len(examples), info.n_layers, info.n_heads),
                       params={"ablation": "head weights zeroed (xi_h = 0): the head adds nothing",
                               "target_kind": examples[0].kind})


@dataclass(repr=False)
class HeadImportance:
    """Michel et al. head importance, with the ablation effect beside it."""

    stack: str
    importance: torch.Tensor  # [layer, head] E_x |dL/dxi_h|, each layer divided by its L2 norm
    raw: torch.Tensor  # [layer, head] E_x |dL/dxi_h| before the per-layer normalisation
    per_example: torch.Tensor  # [example, layer, head] |dL/dxi_h|
    ablation: HeadEffects | None
    params: dict = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        n_layers, n_heads = self.importance.shape
        text = f"<HeadImportance {self.stack}: {n_layers} layers x {n_heads} heads"
        if self.importance.numel() and bool(torch.isfinite(self.importance).any()):
            layer, head = divmod(int(torch.nan_to_num(self.importance, nan=-1.0).argmax()), n_heads)
            text += f"; most important L{layer}.H{head} ({float(self.importance[layer, head]):.3g})"
        return text + ("; with single-head ablation>" if self.ablation is not None else ">")

    def to_pandas(self) -> pd.DataFrame:
        """One row per (layer, head): ``importance``, ``raw`` and, with the ablation, its ``mean_abs_change``."""
        extra = {"mean_abs_change": self.ablation.mean_abs_change} if self.ablation is not None else {}
        return grid_frame(("layer", "head"), {"importance": self.importance, "raw": self.raw, **extra})


def _loss_rows(examples: Sequence[PreparedExample], loss: str) -> list[PreparedExample]:
    if loss == "nll":
        return [dataclasses.replace(e, kind="logprob") for e in examples]
    return list(examples)


def head_importance(pm: ProbeModel, examples: Sequence[PreparedExample], *, stack: str | None = None, loss: str = "nll",
                    batch_size: int = 16, ablation: bool = True) -> HeadImportance:
    """I_h = E_x |dL/dxi_h| with a differentiable gate xi_h = 1 on every head (Michel et al. 2019).

    ``loss="nll"``: L = -log p(target) (the cross-entropy of the explained label or continuation,
    Michel's choice; with a contrast, the negated log-prob difference of target and contrast);
    ``loss="target"``: L = the target value itself. Each example has its own gate
    [layer, head] so that |.| is taken per example before the mean. The importance is normalised
    per layer by its L2 norm. With ``ablation=True`` the actual single-head ablation effect on the
    target is computed too.
    """
    if loss not in LOSSES:
        raise InputError(f"unknown head-importance loss {loss!r}: use one of {', '.join(LOSSES)}")
    stack = _stack(pm, stack)
    info = pm.contract.stacks[stack]
    rows_examples = _loss_rows(examples, loss)
    grads = []
    with eval_mode(pm.model):
        for start in range(0, len(examples), batch_size):
            chunk = rows_examples[start: start + batch_size]
            batch = build_rows(pm, [(e.input_ids, e) for e in chunk])
            gate = torch.ones((len(chunk), info.n_layers, info.n_heads), device=pm.device, requires_grad=True)
            editors = {(stack, layer): _scale_heads(gate[:, layer]) for layer in range(info.n_layers)}
            with torch.enable_grad(), capture_attention(pm, editors=editors, stacks=[stack], layers={stack: ()},
                                                        **capture_masks(batch)):
                logits = pm.model(**batch.inputs).logits
                values = target_values(pm, batch, logits)  # [rows]
                objective = -values if loss == "nll" else values
            (grad,) = torch.autograd.grad(objective.sum(), gate)
            grads.append(grad.abs().detach().cpu())
    per_example = torch.cat(grads)  # [example, layer, head]
    raw = per_example.mean(dim=0)
    importance = raw / raw.norm(dim=1, keepdim=True).clamp(min=1e-20)
    effects = head_ablation_effects(pm, examples, stack=stack, batch_size=max(batch_size, 32)) if ablation else None
    return HeadImportance(stack=stack, importance=importance, raw=raw, per_example=per_example, ablation=effects,
                          params={"loss": loss, "normalisation": "per layer, L2",
                                  "gate": "weights of head h multiplied by xi_h (= its output times xi_h)"})


__all__ = ["HeadEffects", "HeadImportance", "ablate_heads", "head_ablation_effects", "head_importance"]
