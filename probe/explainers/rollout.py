"""Attention rollout and attention flow (Abnar & Zuidema 2020): token scores from the residual
attention of every layer up to the target query, by matrix product (rollout) or max-flow (flow).
Run by name through :func:`probe.explainers.attention.attention_scores`, which re-exports them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe import registry
from probe.errors import CaptureError, InputError
from probe.explainers.attention_params import attention_params as _params
from probe.hooks.capture import capture_attention
from probe.hooks.types import EditContext
from probe.rows.queries import (
    TargetQueries,
    capture_masks,
    crop,
    eval_mode,
    mixing_widths,
    row_batches,
)
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, RowBatch

if TYPE_CHECKING:
    from probe.hooks.types import AttentionInputs
    from probe.models.core import ProbeModel

#: Attention flow solves (layers x tokens) max-flow problems per example on a graph of
#: layers x tokens^2 edges; beyond this many explained tokens an example is skipped (NaN scores).
FLOW_MAX_TOKENS = registry.FLOW_MAX_TOKENS  # flow's registered length limit
#: Max-flow needs integer capacities (scipy): weights are scaled by this and rounded (~6e-8).
FLOW_CAPACITY_SCALE = 2**24


# ---------------------------------------------------------------------------
# rollout and flow (Abnar & Zuidema 2020)
# ---------------------------------------------------------------------------


def residual_attention(weights: torch.Tensor) -> torch.Tensor:
    """Head-averaged attention with the residual added: [..., head, T, T] -> [..., T, T] fp32.

    A = 0.5 W + 0.5 I with rows renormalised (Abnar & Zuidema). Renormalising matters where W's row
    is not a distribution: a row with no allowed key becomes the identity row (the residual alone).
    """
    return add_residual_(weights.float().mean(dim=-3))  # [..., T, T]


def add_residual_(mean: torch.Tensor) -> torch.Tensor:
    """0.5 W + 0.5 I with rows renormalised, in place on the head-mean ``mean`` [..., T, T] (fp32)."""
    mean.mul_(0.5).diagonal(dim1=-2, dim2=-1).add_(0.5)
    return mean.div_(mean.sum(dim=-1, keepdim=True))


def rollout_matrices(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rollout of per-layer attention [head, T, T] (layer 0 first): [layer, T, T], entry l = A_l ... A_0.

    The reference implementation; :func:`rollout` computes the same product streaming over layers.
    """
    product = None
    out = []
    for layer_weights in weights:
        augmented = residual_attention(layer_weights)  # [T, T]
        product = augmented if product is None else augmented @ product
        out.append(product)
    return torch.stack(out)


class _ResidualStream:
    """Attention observer that folds each layer's residual attention into a running product.

    The capture shows it each layer's head-mean attention [batch, T, T] during the forward pass
    (computed one head at a time, while the model's own kernel computes the output), so
    the rollout needs one pass and holds one [batch, T, T] product: never every layer's maps, nor
    one layer's every head. ``keep_width`` also keeps each layer's (cropped) residual attention,
    which flow needs.
    """

    def __init__(self, n_layers: int, target: torch.Tensor | None, keep_width: int | None = None,
                 queries: TargetQueries | None = None):
        self.n_layers = n_layers
        self.target = target  # [batch, rows] query positions whose rollout rows are kept (averaged), or None
        self.queries = queries  # averages several target rows (a mean-pooled encoder's)
        self.keep_width = keep_width
        self.product: torch.Tensor | None = None  # [batch, T, T]
        self.rows: list[torch.Tensor] = []  # per layer [batch, T]
        self.kept: list[torch.Tensor] = []  # per layer [batch, W, W] residual attention
        self.next_layer = 0

    def __call__(self, mean: torch.Tensor, context: EditContext) -> None:
        if context.layer != self.next_layer:
            raise CaptureError(f"rollout expected layer {self.next_layer} next, got {context.layer}: "
                               "the model ran its layers out of order or twice")
        self.next_layer += 1
        with torch.no_grad():
            # in place on the observer's own copy: no [T, T] temporaries beyond the product
            augmented = add_residual_(mean.float())  # [batch, T, T]
            self.product = augmented if self.product is None else augmented @ self.product
            if self.target is not None:
                index = self.target[:, :, None].expand(-1, -1, self.product.shape[-1])  # [batch, rows, T]
                picked = torch.gather(self.product, 1, index)  # [batch, rows, T]
                self.rows.append(picked[:, 0] if picked.shape[1] == 1 else self.queries.mean_over_rows(picked))
            if self.keep_width is not None:
                self.kept.append(augmented[:, : self.keep_width, : self.keep_width].clone())


def encoder_stream(pm: ProbeModel, batch: RowBatch, tq: TargetQueries, *, keep_width: int | None = None
                   ) -> tuple[_ResidualStream, torch.Tensor | None]:
    """One pass with a residual stream on the attention that carries the explained tokens.

    Returns (stream, cross) where cross is the head-mean cross-attention at the target rows
    [batch, layer, key] for seq2seq (None otherwise).
    """
    cross_target = pm.task.encoder_decoder  # the target reads the encoder's stream through cross-attention
    stack, target = pm.task.input_stack(pm.contract), (None if cross_target else tq.rows)
    if stack not in pm.contract.stacks:
        from probe.errors import CaptureError

        why = "; ".join(sorted(set(pm.contract.unreadable.values()))) or "no attention module was found there"
        raise CaptureError(f"{pm.contract.model_type}: probe cannot read the {stack} attention ({why})")
    n_layers = pm.contract.stacks[stack].n_layers
    stream = _ResidualStream(n_layers, target, keep_width, queries=tq)
    observers = {(stack, layer): stream for layer in range(n_layers)}
    record: dict[str, Sequence[int] | None] = {stack: ()}
    queries: dict[str, torch.Tensor] | None = None
    if cross_target:
        record, queries = {"cross": None}, {"cross": tq.rows}
    with torch.no_grad(), capture_attention(pm, observers=observers, layers=record, queries=queries,
                                            stacks=list(record), **capture_masks(batch)) as capture:
        pm.model(**batch.inputs)
    if stream.next_layer != n_layers:
        raise CaptureError(f"rollout saw {stream.next_layer} of {n_layers} {stack} layers")
    cross = None
    if cross_target:
        cross = tq.mean_over_rows(capture.maps("cross").weights.mean(dim=2))  # [batch, layer, key]
    return stream, cross


#: Query rows of one layer's residual attention formed at once by the row-only rollout: memory
#: ``ROLLOUT_BLOCK x T`` per block instead of ``T x T``.
ROLLOUT_BLOCK = 256


def _rollout_target_rows(pm: ProbeModel, batch: RowBatch, tq: TargetQueries, *, block: int = ROLLOUT_BLOCK) -> torch.Tensor:
    """Rollout rows of the one target query per example, ``[batch, layer, T]``, in memory linear in T.

    r_l = e_q A_l ... A_0 is taken from the top layer down, r <- r A_k, for every layer's row at
    once ([batch, layer, T] vectors), with each A_k formed ``block`` query rows at a time from the
    queries and keys the forward pass handed the attention function (kept per layer, linear in T).
    Equal to the streamed [T, T] product (:class:`_ResidualStream`) up to float rounding.
    """
    from probe.hooks import math as amath

    stack = tq.stack
    n_layers = pm.contract.stacks[stack].n_layers
    kept: dict[int, AttentionInputs] = {}
    readers = {(stack, layer): (lambda inputs, layer=layer: kept.__setitem__(layer, inputs)) for layer in range(n_layers)}
    with torch.no_grad(), capture_attention(pm, readers=readers, layers={stack: ()}, stacks=[stack],
                                            **capture_masks(batch)):
        pm.model(**batch.inputs)
    if len(kept) != n_layers:
        raise CaptureError(f"rollout saw {len(kept)} of {n_layers} {stack} layers")
    home = tq.rows.device
    n_rows, length = tq.rows.shape[0], kept[0].key.shape[2]
    start_row = torch.zeros(n_rows, 1, length, device=home)  # [batch, 1, T]: e_q
    start_row.scatter_(2, tq.rows[:, :1, None], 1.0)
    vectors = start_row[:, :0]  # [batch, rows so far, T]; row j is layer n_layers - 1 - j
    with torch.no_grad():
        for layer in reversed(range(n_layers)):
            inputs = kept.pop(layer)
            vectors = torch.cat([vectors, start_row], dim=1)  # [batch, m, T]
            product = torch.zeros_like(vectors)
            for first in range(0, length, block):
                last = min(length, first + block)
                part = vectors[:, :, first:last]  # [batch, m, R]
                if not bool(part.any()):
                    continue  # these query rows carry no rollout mass (causal models: after the target)
                rows = torch.arange(first, last, device=inputs.query.device).expand(n_rows, -1)  # [batch, R]
                allowed = amath.allowed_keys(inputs.attention_mask, batch=n_rows, q_len=inputs.query.shape[2],
                                             k_len=length, is_causal=inputs.is_causal, rows=rows,
                                             device=inputs.query.device)
                bias = None if inputs.position_bias is None else inputs.position_bias[:, :, first:last]
                mean = amath.head_mean_weights(inputs.query[:, :, first:last], inputs.key, allowed,
                                               scaling=inputs.scaling, position_bias=bias,
                                               softcap=inputs.softcap).to(home)  # [batch, R, T]
                # A = 0.5 W + 0.5 I with rows renormalised, on this block of rows
                mean.mul_(0.5)[:, :, first:last].diagonal(dim1=-2, dim2=-1).add_(0.5)
                mean.div_(mean.sum(dim=-1, keepdim=True))
                product.add_(part @ mean)  # [batch, m, T]
                del mean, allowed
            vectors = product
            del inputs
    return vectors.flip(1)  # [batch, layer, T], layer 0 first


def _rows_recomputable(pm: ProbeModel, stack: str) -> bool:
    """Whether the row-only rollout can recompute ``stack``'s weights from the queries and keys its
    layers hand the attention function: not where probe reads a probability module (inline
    attention), a module called several times per forward, or an attention sink it would not see."""
    contract = pm.contract.stacks.get(stack)
    return (contract is not None and contract.capture_path == "attention function" and not contract.sinks
            and not contract.shared_layers)


def rollout(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 16) -> TokenScores:
    """Attention rollout (Abnar & Zuidema): [layer, tokens], row of the target in A_l ... A_0.

    Computed in fp32. With one target query per example (classifiers, causal LMs) the target's
    row is carried from the top layer down through each layer's residual attention, formed a
    block of query rows at a time from the kept queries and keys: memory linear in T
    (:func:`_rollout_target_rows`), where the layers are read through the attention function
    (:func:`_rows_recomputable`; elsewhere the streamed product below). For seq2seq the target row at decoder layer l is that layer's
    head-mean cross-attention (averaged over the predicting positions, no residual: the decoder
    stream holds no encoder token) times the full encoder rollout, streamed as one running
    [batch, T, T] product, never all layers' maps.
    """
    scores: list[torch.Tensor] = []
    stack = None
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            stack = tq.stack
            if not pm.task.encoder_decoder and tq.rows.shape[1] == 1 and _rows_recomputable(pm, tq.stack):
                rows = _rollout_target_rows(pm, batch, tq)  # [batch, layer, T]
                scores += crop(rows, tq.lengths)
                continue
            stream, cross = encoder_stream(pm, batch, tq)
            if cross is None:
                rows = torch.stack(stream.rows, dim=1)  # [batch, layer, T]
            else:
                encoder = stream.product  # [batch, K, K] full encoder rollout
                rows = cross @ encoder  # [batch, layer, K]
            scores += crop(rows, tq.lengths)
    return TokenScores("rollout", scores, per_layer=True, params=_params(
        pm, stack, residual="A = 0.5 W + 0.5 I, rows renormalised, head mean", dtype="float32",
        product_stack=pm.task.input_stack(pm.contract)))


def flow_to_sinks(residual: np.ndarray, sinks: Sequence[tuple[int, np.ndarray]]) -> np.ndarray:
    """Max-flow from every input token to each sink through the layer graph: [sink, T] (raw values).

    residual [L, T, T]: residual attention per layer (row i = query node i of level l+1, column k =
    key node k of level l). Nodes are levels 0..L of T positions each; edge (l, k) -> (l+1, i) has
    capacity residual[l, i, k]. A sink is (level, capacities[T]): a node fed from that level's
    nodes. The target row of attention layer l is the sink (l, residual[l, t]); a seq2seq output is
    (L, cross-attention row). Capacities are scaled by FLOW_CAPACITY_SCALE and rounded because
    scipy's max-flow takes integers.
    """
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import maximum_flow

    n_layers, width, _ = residual.shape
    n_nodes = (n_layers + 1) * width + len(sinks)
    src, dst, cap = [], [], []
    for level in range(n_layers):
        query, key = np.nonzero(residual[level])
        src.append(level * width + key)
        dst.append((level + 1) * width + query)
        cap.append(residual[level][query, key])
    for s, (level, capacities) in enumerate(sinks):
        key = np.nonzero(capacities)[0]
        src.append(level * width + key)
        dst.append(np.full(key.shape, (n_layers + 1) * width + s))
        cap.append(capacities[key])
    src, dst = np.concatenate(src), np.concatenate(dst)
    cap = np.rint(np.concatenate(cap).astype(np.float64) * FLOW_CAPACITY_SCALE).astype(np.int32)
    keep = cap > 0
    graph = csr_array((cap[keep], (src[keep], dst[keep])), shape=(n_nodes, n_nodes))
    out = np.zeros((len(sinks), width), dtype=np.float64)
    for s in range(len(sinks)):
        sink = (n_layers + 1) * width + s
        for token in range(width):
            out[s, token] = maximum_flow(graph, token, sink).flow_value / FLOW_CAPACITY_SCALE
    return out


def flow_max_over_rows(residual: np.ndarray) -> np.ndarray:
    """Abnar & Zuidema's flow importance at every layer: for each node i of level l+1 the max-flow
    from every input token (level 0) into it, each row normalised to sum to 1 (their
    ``compute_flows``), then the maximum over the rows i (``.max(axis=0)``): [L, T].
    Costs L x T x T max-flow solves; each solve sees only the levels up to l+1."""
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import maximum_flow

    n_layers, width, _ = residual.shape
    out = np.zeros((n_layers, width), dtype=np.float64)
    src, dst, cap = [], [], []
    for level in range(n_layers):
        query, key = np.nonzero(residual[level])
        src.append(level * width + key)
        dst.append((level + 1) * width + query)
        cap.append(np.rint(residual[level][query, key].astype(np.float64) * FLOW_CAPACITY_SCALE).astype(np.int32))
        n_nodes = (level + 2) * width
        s, d, c = np.concatenate(src), np.concatenate(dst), np.concatenate(cap)
        keep = c > 0
        graph = csr_array((c[keep], (s[keep], d[keep])), shape=(n_nodes, n_nodes))
        rows = np.zeros((width, width), dtype=np.float64)
        for i in range(width):
            sink = (level + 1) * width + i
            for token in range(width):
                rows[i, token] = maximum_flow(graph, token, sink).flow_value
        total = rows.sum(axis=1, keepdims=True)
        out[level] = (rows / np.where(total > 0, total, 1.0)).max(axis=0)
    return out


def flow_max_over_queries(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8,
                          max_tokens: int = FLOW_MAX_TOKENS) -> TokenScores:
    """``flow`` with ``query: max``: Abnar & Zuidema's own importance (:func:`flow`)."""
    return flow(pm, examples, batch_size=batch_size, max_tokens=max_tokens, query="max")


def flow(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8,
         max_tokens: int = FLOW_MAX_TOKENS, query: str = "target") -> TokenScores:
    """Attention flow (Abnar & Zuidema): [layer, tokens] max-flow from each token to the target.

    The graph's capacities are the residual attention (see :func:`residual_attention`); the flow
    into the target row of layer l is normalised to sum to 1 over tokens, as in the authors' code.
    Costs layers x tokens max-flow solves per example, so examples longer than ``max_tokens``
    are skipped: their scores are NaN and ``params['skipped']`` lists them. seq2seq: sinks are the
    decoder layers' cross-attention rows on top of the encoder graph. ``query="max"``: Abnar &
    Zuidema's own importance, the maximum over every query row (:func:`flow_max_over_rows`,
    layers x tokens x tokens solves: tokens times the cost of the target row).
    """
    if query == "max" and pm.task.encoder_decoder:
        raise InputError("query: max reads one self-attention stack; for a seq2seq model use query: target")
    scores: list[torch.Tensor] = []
    short = [i for i, e in enumerate(examples) if len(e.input_ids) <= max_tokens]
    skipped = [i for i, e in enumerate(examples) if len(e.input_ids) > max_tokens]
    by_index: dict[int, torch.Tensor] = {}
    stack = None
    with eval_mode(pm.model):
        done = 0
        for batch, tq in (row_batches(pm, [examples[i] for i in short], batch_size) if short else ()):
            stack = tq.stack
            widths = mixing_widths(tq)  # a causal LM's output token: its query row after the input
            stream, cross = encoder_stream(pm, batch, tq, keep_width=max(widths))
            kept = torch.stack(stream.kept, dim=1).double().cpu().numpy()  # [batch, layer, W, W]
            for r, (n, width) in enumerate(zip(tq.lengths.tolist(), widths)):
                residual = kept[r, :, :width, :width]
                if query == "max":
                    by_index[short[done + r]] = torch.from_numpy(flow_max_over_rows(residual))
                    continue
                if cross is None:
                    # several target rows (a mean-pooled encoder): one sink fed by their average row
                    t = tq.rows[r][tq.valid[r]].cpu().numpy()
                    sinks = [(layer, residual[layer, t].mean(axis=0)) for layer in range(residual.shape[0])]
                else:
                    rows = cross[r, :, :n].double().cpu().numpy()  # [decoder layer, n]
                    sinks = [(residual.shape[0], rows[layer]) for layer in range(rows.shape[0])]
                raw = flow_to_sinks(residual, sinks)[:, :n]  # [layer, n]: from the explained tokens
                total = raw.sum(axis=1, keepdims=True)
                by_index[short[done + r]] = torch.from_numpy(raw / np.where(total > 0, total, 1.0))
            done += len(tq.lengths)
    stack = stack or pm.task.target_stack(pm.contract)
    n_layers = pm.contract.stacks[stack].n_layers
    for i, example in enumerate(examples):
        scores.append(by_index.get(i, torch.full((n_layers, len(example.input_ids)), float("nan"))))
    note = (f"flow is limited to {max_tokens} explained tokens (layers x tokens max-flow solves per example); "
            f"{len(skipped)} longer example(s) skipped with NaN scores" if skipped else
            f"flow is limited to {max_tokens} explained tokens; none skipped")
    rows = ({"query": "max", "target_query": "maximum over every real query row of the row-normalised flow "
                                             "(Abnar & Zuidema 2020, compute_flows then .max(axis=0))",
             "normalisation": "each row's flow divided by its sum over tokens, then the maximum over rows"}
            if query == "max" else {"normalisation": "flow into the target divided by its sum over tokens"})
    return TokenScores("flow", scores, per_layer=True, params=_params(
        pm, stack, residual="A = 0.5 W + 0.5 I, rows renormalised, head mean", max_tokens=max_tokens,
        capacity_resolution=1.0 / FLOW_CAPACITY_SCALE, skipped=skipped, limit_note=note, **rows))
