"""Attention explainers: token scores read from a model's attention at the target query.

The *target query* is the attention row that reads the position whose output becomes the target:

    classification  the pooled position: 0 ([CLS]) for an encoder; the last real token for a
                    decoder-only classifier (GPT-2 style pooling)
    causal_lm       position len(input_ids) - 1, the last explained token, whose logits predict the
                    first continuation token
    seq2seq         the decoder positions whose logits predict the output tokens, read through
                    *cross*-attention (keys = encoder tokens = the explained tokens); every score is
                    the mean over those positions (padding positions of shorter outputs excluded)

Every explainer returns :class:`TokenScores` over the explained tokens of each example (padding is
cut off, never scored; special tokens are scored and flagged by ``PreparedExample.special``):

    attention        [layer, head, tokens]  raw weights of the target row
    attention_mean   [layer, tokens]        head mean of the above
    rollout          [layer, tokens]        Abnar & Zuidema rollout, target row of the product up to l
    flow             [layer, tokens]        Abnar & Zuidema attention flow (max-flow), normalised
    attn_norm        [layer, head, tokens]  Kobayashi et al. ||alpha_ij f_h(x_j)|| (or [layer, tokens]
                                            ||sum_h alpha_ij f_h(x_j)|| with ``per_head=False``)
    attn_grad        [layer, head, tokens]  alpha * d target / d alpha at the target row

Query heads are reported one by one; under GQA/MQA a query head reads the values of key/value head
``contract.kv_head_of_query[h]`` (the capture repeats keys; ``attn_norm`` maps values explicitly).
Every forward runs the rows :func:`~probe.rows.forward.build_rows` builds, so all methods explain
the model on the same inputs as the target.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from probe import registry
from probe.errors import CaptureError, InputError
from probe.explainers.attention_params import attention_params as _params
from probe.explainers.rollout import add_residual_
from probe.hooks.capture import capture_attention
from probe.hooks.types import EditContext
from probe.models.architectures import (
    VALUE_OUTPUT_LAYOUTS,
    ValueOutputLayout,
    relative_path,
)
from probe.rows.queries import (
    TargetQueries,
    capture_masks,
    crop,
    eval_mode,
    row_batches,
    shared_row_batches,
)
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, RowBatch
from probe.rows.values import target_values

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def target_rows(pm: ProbeModel, batch: RowBatch, tq: TargetQueries, *, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Attention at the target rows: [batch, layer, head, rows, key] fp32 (keys padded to the batch width).
    Layers with fewer heads than the stack's most (a hybrid's mixers, per-layer head counts) have
    their missing heads NaN: the layers are read one by one and never refused for not stacking."""
    with torch.no_grad(), capture_attention(pm, queries={tq.stack: tq.rows}, stacks=[tq.stack],
                                            layers={tq.stack: layers} if layers is not None else None,
                                            **capture_masks(batch)) as capture:
        pm.model(**batch.inputs)
    layer_maps = sorted(capture.layer_maps(tq.stack).items())
    per_layer = [m.weights[:, 0] for _, m in layer_maps]  # [batch, head, rows, key]
    keys = {layer: int(m.weights.shape[-1]) for layer, m in layer_maps}
    width = max(keys.values())
    shorter = [layer for layer, k in keys.items() if k != width]
    if shorter:  # canine's deep stack attends over downsampled "molecules", not over the input's tokens
        raise CaptureError(f"{tq.stack} layers {', '.join(map(str, shorter))} attend over {keys[shorter[0]]} "
                           f"positions, not the {width} tokens of the other layers (downsampled keys): token-level "
                           "attention methods cannot score them; use leave-one-out or gradient methods")
    heads = max(w.shape[1] for w in per_layer)
    if all(w.shape[1] == heads for w in per_layer):
        return capture.maps(tq.stack).weights  # the capture's own stacked tensor: no second copy
    padded = per_layer[0].new_full((per_layer[0].shape[0], len(per_layer), heads, *per_layer[0].shape[2:]), torch.nan)
    for i, w in enumerate(per_layer):
        padded[:, i, : w.shape[1]] = w
    return padded


# ---------------------------------------------------------------------------
# raw attention
# ---------------------------------------------------------------------------


def attention(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 16) -> TokenScores:
    """Raw attention weights of the target row, every layer and query head: [layer, head, tokens]."""
    scores: list[torch.Tensor | None] = [None] * len(examples)
    stack = None
    with eval_mode(pm.model):
        # the output tokens of one text share its row: one forward, each reads its own query row
        for batch, tq, picks in shared_row_batches(pm, examples, batch_size):
            stack = tq.stack
            weights = target_rows(pm, batch, tq)  # [batch, layer, head, rows, key]
            merged = tq.mean_over_rows(weights)  # [batch, layer, head, key]
            for r, (pick, n) in enumerate(zip(picks, tq.lengths.tolist())):
                for i, q in pick:
                    scores[i] = (merged[r] if q is None else weights[r, :, :, q])[..., : int(n)]
    return TokenScores("attention", scores, params=_params(pm, stack), per_head=True)


def attention_mean(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 16) -> TokenScores:
    """Head-averaged attention of the target row per layer: [layer, tokens]."""
    raw = attention(pm, examples, batch_size=batch_size)
    # nanmean: a layer with fewer heads than the stack's most (a hybrid) averages its own heads
    return TokenScores("attention_mean", [s.nanmean(dim=1) for s in raw.scores],
                       params={**raw.params, "heads": "mean over query heads"}, per_layer=True)


# ---------------------------------------------------------------------------
# attention norms (Kobayashi et al. 2020)
# ---------------------------------------------------------------------------


def value_output_modules(pm: ProbeModel, stack: str, layer: int
                         ) -> tuple[ValueOutputLayout, torch.nn.Module, torch.nn.Module]:
    """(layout, value projection module, output projection module) of one attention layer."""
    model_type = pm.contract.model_type
    layout = VALUE_OUTPUT_LAYOUTS.get(model_type)
    if layout is None:
        raise InputError(f"attn_norm does not know where model type {model_type!r} keeps W_V and W_O: "
                         f"supported are {', '.join(sorted(VALUE_OUTPUT_LAYOUTS))}")
    path = pm.contract.module_paths[(stack, layer)]
    modules = dict(pm.model.named_modules())
    try:
        return layout, modules[relative_path(path, layout.value)], modules[relative_path(path, layout.output)]
    except KeyError as missing:
        raise InputError(f"model type {model_type!r}: no module {missing} next to {path}; "
                         "the value/output layout table does not match this model") from None


def in_out_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [in, out], bias [out] or None) of a Linear or a transformers Conv1D, fp32."""
    from transformers.pytorch_utils import Conv1D

    weight = module.weight if isinstance(module, Conv1D) else module.weight.t()
    bias = getattr(module, "bias", None)
    return weight.float(), (bias.float() if bias is not None else None)


def value_vectors(layout: ValueOutputLayout, value_module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """x W_V + b_V from the value projection's input: [batch, key, in] -> [batch, key, kv_head * dim] fp32."""
    weight, bias = in_out_weight(value_module)
    index, chunks = layout.value_chunk
    size = weight.shape[1] // chunks
    weight = weight[:, index * size: (index + 1) * size]
    values = inputs.float() @ weight
    if bias is not None:
        values = values + bias[index * size: (index + 1) * size]
    return values


@contextmanager
def record_value_inputs(pm: ProbeModel, stack: str) -> Iterator[dict[int, torch.Tensor]]:
    """Keep the input of every layer's value projection (x_j as W_V sees it, after any pre-norm).

    Yields ``{layer: [batch, key, in]}`` filled by the forward passes run inside; forward pre-hooks
    are removed in ``finally``, also when the forward raises.
    """
    seen: dict[int, torch.Tensor] = {}
    handles = []
    try:
        for (s, layer), _ in sorted(pm.contract.module_paths.items()):
            if s != stack:
                continue
            _, value_module, _ = value_output_modules(pm, stack, layer)

            def keep(module, args, kwargs, layer=layer):
                seen[layer] = (args[0] if args else kwargs["input"]).detach()

            handles.append(value_module.register_forward_pre_hook(keep, with_kwargs=True))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def head_value_norms(pm: ProbeModel, stack: str, layer: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query head, the transformed vectors f_h(x_j) = (x_j W_V + b_V)_kv(h) W_O^h, as factors.

    Returns (values [batch, key, head, dim] of each query head's kv head, W_O per head
    [head, dim, out], norms ||f_h(x_j)|| [batch, key, head]). Norms come from the Gram matrix
    W_O^h W_O^h^T so that no [batch, key, head, out] tensor is formed.
    """
    info = pm.contract.stacks[stack]
    layout, value_module, output_module = value_output_modules(pm, stack, layer)
    values = value_vectors(layout, value_module, inputs)  # [batch, key, kv_head * dim]
    batch, keys, _ = values.shape
    values = values.view(batch, keys, info.n_kv_heads, info.head_dim)
    kv_index = torch.tensor(info.kv_head_of_query, device=values.device)
    per_query = values.index_select(2, kv_index)  # [batch, key, head, dim]
    out_weight, _ = in_out_weight(output_module)  # [head * dim, out]
    out_weight = out_weight.view(info.n_heads, info.head_dim, -1)  # [head, dim, out]
    gram = out_weight @ out_weight.transpose(1, 2)  # [head, dim, dim]
    norms = torch.einsum("bkhd,hde,bkhe->bkh", per_query, gram, per_query).clamp(min=0).sqrt()
    return per_query, out_weight, norms


def attn_norm(pm: ProbeModel, examples: Sequence[PreparedExample], *, per_head: bool = True, batch_size: int = 16) -> TokenScores:
    """Norm-weighted attention (Kobayashi et al.): ||alpha_ij f_h(x_j)||, f(x) = (x W_V + b_V) W_O.

    ``per_head=True``: [layer, head, tokens] = alpha_h,j ||f_h(x_j)||. ``per_head=False``:
    [layer, tokens] = ||sum_h alpha_h,j f_h(x_j)||, the norm of the summed vector, which is what the
    layer adds to the residual stream from token j (W_O's bias, the same for every j, is left out).
    For seq2seq alpha is the cross-attention row averaged over the predicting positions.
    """
    scores: list[torch.Tensor] = []
    stack = None
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            stack = tq.stack
            with record_value_inputs(pm, stack) as inputs, torch.no_grad(), capture_attention(
                    pm, queries={stack: tq.rows}, stacks=[stack], **capture_masks(batch)) as capture:
                pm.model(**batch.inputs)
            alpha = tq.mean_over_rows(capture.maps(stack).weights)  # [batch, layer, head, key]
            per_layer = []
            for layer in range(alpha.shape[1]):
                per_query, out_weight, norms = head_value_norms(pm, stack, layer, inputs[layer])
                a = alpha[:, layer, :, : norms.shape[1]]  # [batch, head, key]
                if per_head:
                    per_layer.append(a * norms.transpose(1, 2))  # [batch, head, key]
                else:
                    mixed = (a.transpose(1, 2)[..., None] * per_query)  # [batch, key, head, dim]
                    summed = torch.einsum("bkhd,hdo->bko", mixed, out_weight)  # [batch, key, out]
                    per_layer.append(summed.norm(dim=-1))  # [batch, key]
            scores += crop(torch.stack(per_layer, dim=1), tq.lengths)
    return TokenScores("attn_norm" if per_head else "attn_norm_sum", scores, per_head=per_head,
                       per_layer=not per_head, params=_params(
                           pm, stack, formula="||alpha_ij (x_j W_V + b_V) W_O^h||" if per_head
                           else "||sum_h alpha_h,ij (x_j W_V + b_V)_h W_O^h||",
                           value_output=asdict(VALUE_OUTPUT_LAYOUTS[pm.contract.model_type])))


# ---------------------------------------------------------------------------
# attention x gradient
# ---------------------------------------------------------------------------


def attn_grad(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8) -> TokenScores:
    """Attention times gradient: alpha_j * d target / d alpha_j at the target row, [layer, head, tokens].

    An identity editor on every layer hands back the weights themselves, so each layer's weights
    stay a node of the autograd graph; the gradient is the total derivative (through all later
    layers, including their attention). seq2seq: the per-position products are averaged over the
    predicting positions.
    """
    scores: list[torch.Tensor] = []
    stack = None
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            stack = tq.stack
            n_layers = pm.contract.stacks[stack].n_layers
            held: dict[int, torch.Tensor] = {}

            def keep(weights: torch.Tensor, context: EditContext, held=held) -> torch.Tensor:
                if not weights.requires_grad:  # frozen parameters: make this layer a leaf instead
                    weights = weights.detach().requires_grad_(True)
                held[context.layer] = weights  # [batch, head, query, key]
                return weights

            editors = {(stack, layer): keep for layer in range(n_layers)}
            # Nothing is recorded (layers=()): the editor holds the weights the forward really used.
            with torch.enable_grad(), capture_attention(pm, editors=editors, stacks=[stack], layers={stack: ()},
                                                        **capture_masks(batch)):
                logits = pm.model(**batch.inputs).logits
                values = target_values(pm, batch, logits)  # [batch]
            weights = [held[layer] for layer in range(n_layers)]
            grads = torch.autograd.grad(values.sum(), weights, allow_unused=True)
            per_layer = []
            for w, g in zip(weights, grads, strict=True):
                product = w.detach() * (g if g is not None else torch.zeros_like(w))  # [batch, head, query, key]
                index = tq.rows[:, None, :, None].expand(-1, product.shape[1], -1, product.shape[-1])
                per_layer.append(tq.mean_over_rows(torch.gather(product, 2, index)))  # [batch, head, key]
            scores += crop(torch.stack(per_layer, dim=1), tq.lengths)
    return TokenScores("attn_grad", scores, per_head=True, params=_params(
        pm, stack, target_kind=examples[0].kind, gradient="total derivative of the target w.r.t. the layer's weights"))


# ---------------------------------------------------------------------------
# Abnar & Zuidema's importance: the maximum over every query row
# ---------------------------------------------------------------------------

QUERIES = ("target", "max")
QUERY_MAX_METHODS = registry.query_max_methods()


class _RowMax:
    """Attention observer: per layer, the maximum over the real query rows of the head-mean map
    (``rollout``: of the running rollout product) -> ``rows`` [batch, T] per layer."""

    def __init__(self, lengths: torch.Tensor, rollout: bool):
        self.lengths = lengths  # [batch]
        self.rollout = rollout
        self.product: torch.Tensor | None = None  # [batch, T, T]
        self.rows: list[torch.Tensor] = []
        self.next_layer = 0

    def __call__(self, mean: torch.Tensor, context: EditContext) -> None:
        if context.layer != self.next_layer:
            raise CaptureError(f"expected layer {self.next_layer} next, got {context.layer}")
        self.next_layer += 1
        with torch.no_grad():
            values = mean.float().clone()  # [batch, T, T]
            if self.rollout:
                augmented = add_residual_(values)
                self.product = augmented if self.product is None else augmented @ self.product
                values = self.product
            real = torch.arange(values.shape[1], device=values.device)[None, :] < self.lengths[:, None]  # [batch, T]
            self.rows.append(values.masked_fill(~real[:, :, None], float("-inf")).amax(dim=1))  # [batch, T]


def attention_mean_max_over_queries(pm: ProbeModel, examples: Sequence[PreparedExample], *,
                                    batch_size: int = 16) -> TokenScores:
    """``attention_mean`` with ``query: max`` (:func:`max_over_queries`)."""
    return max_over_queries(pm, examples, "attention_mean", batch_size=batch_size, rollout=False)


def rollout_max_over_queries(pm: ProbeModel, examples: Sequence[PreparedExample], *,
                             batch_size: int = 16) -> TokenScores:
    """``rollout`` with ``query: max`` (:func:`max_over_queries`)."""
    return max_over_queries(pm, examples, "rollout", batch_size=batch_size, rollout=True,
                            residual="A = 0.5 W + 0.5 I, rows renormalised, head mean")


def max_over_queries(pm: ProbeModel, examples: Sequence[PreparedExample], method: str, *, batch_size: int = 16,
                     rollout: bool, **params: str) -> TokenScores:
    """Scores named ``method`` as Abnar & Zuidema's code computes them: for each key token and layer,
    the maximum over every real query row ([CLS] and [SEP] included) of the head-mean attention (or,
    with ``rollout``, of the rollout), ``.max(axis=0)``, instead of the target query's row:
    [layer, tokens]. ``params``: more notes stored with the result."""
    if pm.task.encoder_decoder:
        raise InputError("query: max reads one self-attention stack; for a seq2seq model use query: target")
    scores: list[torch.Tensor] = []
    stack = pm.contract.primary_stack
    n_layers = pm.contract.stacks[stack].n_layers
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            observer = _RowMax(tq.lengths, rollout=rollout)
            with torch.no_grad(), capture_attention(pm, observers={(stack, layer): observer for layer in range(n_layers)},
                                                    layers={stack: ()}, stacks=[stack], **capture_masks(batch)):
                pm.model(**batch.inputs)
            if observer.next_layer != n_layers:
                raise CaptureError(f"saw {observer.next_layer} of {n_layers} {stack} layers")
            scores += crop(torch.stack(observer.rows, dim=1), tq.lengths)  # [batch, layer, T]
    return TokenScores(method, scores, per_layer=True, params={
        **_params(pm, stack, **params), "heads": "mean over query heads", "query": "max",
        "target_query": "maximum over every real query row (Abnar & Zuidema 2020, .max(axis=0))"})


def attention_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str, **params: Any) -> TokenScores:
    """Run one attention explainer by its registry name (``attn_norm_sum`` = attn_norm with per_head=False).
    ``query``: ``target`` (default: the target query's row) or ``max`` (:func:`max_over_queries`)."""
    query = params.pop("query", "target")
    if query not in QUERIES:
        raise InputError(f"unknown query {query!r}: use one of {', '.join(QUERIES)}")
    entry = registry.find(method)
    if entry is None or entry.scorer != SCORER:
        raise InputError(f"unknown attention method {method!r}: use one of "
                         f"{', '.join(m.name for m in registry.methods(listed=False) if m.scorer == SCORER)}")
    if query == "max":
        if entry.query_max is None:
            raise InputError(f"query: max applies to {', '.join(QUERY_MAX_METHODS)}, not {method!r}")
        return entry.load_query_max()(pm, examples, **params)
    return entry.load()(pm, examples, **{**dict(entry.preset), **params})


#: the registry's by-name entry for the attention methods (this module's :func:`attention_scores`)
SCORER = f"{__name__}:attention_scores"

__all__ = [
    "attention", "attention_mean", "attention_mean_max_over_queries", "attention_scores", "attn_grad", "attn_norm",
    "max_over_queries", "record_value_inputs", "rollout_max_over_queries",
    "target_rows", "value_output_modules",
]
