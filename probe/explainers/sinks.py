"""Attention sinks: keys that soak up a head's attention whatever the input, and attention without them.

Definition (the one this module measures). In head ``(layer, head)`` of one example, key ``k`` is a
*sink* when the attention it receives, averaged over the example's query rows, exceeds ``threshold``:

    received[l, h, k] = (1 / T) * sum over query rows t of  w[l, h, t, k]
    sink[l, h, k]     = received[l, h, k] > threshold            (default threshold 0.3)

This is the sink metric of Gu et al. 2024 ("When attention sink emerges in language models: an
empirical view", ICLR 2025: a token is a sink of a head when its mean received attention is above
epsilon = 0.3), which makes precise what Xiao et al. 2023 ("Efficient streaming language models with
attention sinks") observed: in causal LMs the initial token receives a large share of attention in
most heads of most layers, far above what its content explains (removing it from the cache breaks
the model although it carries no semantics). The mean runs over every real query row of the
example, so a key is a sink only when many rows read it heavily, not when one row happens to; in a
causal stack rows before ``k`` contribute 0 (they cannot read it), so a late key must be read
heavily by most of the rows that can see it.

Query rows ``t`` (``T`` of them): the explained tokens' own rows ``0..n-1`` of a self-attention
stack (an encoder's, or a causal LM's prompt: a fed continuation's rows are left out), the decoder
rows that read the target of a seq2seq model's cross-attention. Keys: the explained tokens ``0..n-1``
(padding never). Sinks are found per example, layer and head, from the example's own maps (no
knockout pass: whether a sink's mass is matched by its causal effect is what
:func:`probe.intervene.knockout.edge_knockout` with ``keep_special=True`` measures, and comparing the
two is the point; this module gives the attention side).

What comes out:

:func:`attention_sinks`   per example the sinks ``[layer, head, tokens]`` (bool), the mean received
                          attention, the target row's weights, and the *sink share* ``[layer, head]``
                          = the target row's weight on sink keys; over the examples the mean share
                          and the fraction of examples whose first token is a sink, per layer and head.
:func:`attention_nosink`  the registered explainer ``attention_nosink``: the target row's raw weights
                          ``[layer, head, tokens]`` with sink keys set to 0 and the row renormalised
                          over the non-sink keys (``w_k / sum of w over non-sink keys``); a row whose
                          every key is a sink (or whose non-sink weights are all 0) is all zeros.
                          ``extras``: ``sink_share`` and ``sinks`` per example, so a study reads its
                          sinks from this method's own pass (no second one).

The views of the model (the study report's model section, ``probe inspect``) read sinks as data:
:func:`sink_rows` makes the tidy table (one row per example, layer and query head: the share, how
many keys are sinks, whether the first token is one, which positions); :mod:`probe.report.sinks`
(torch-free, as every report module) summarises it per layer and head and names the sinks in
sentences ("the first token is a sink in 99% of the heads of layers 15-29").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import CaptureError, InputError
from probe.explainers.attention_params import attention_params
from probe.hooks.capture import capture_attention
from probe.rows.queries import capture_masks, eval_mode, row_batches
from probe.rows.scores import TokenScores

if TYPE_CHECKING:
    import pandas as pd

    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample

#: Gu et al. 2024's epsilon: a key receiving more than this mean share of a head's attention is a sink
SINK_THRESHOLD = 0.3
DEFINITION = ("a key is a sink of a head when the attention it receives, averaged over the example's query "
              "rows, exceeds the threshold (Gu et al. 2024's metric; Xiao et al. 2023's attention sinks)")


@dataclass(frozen=True)
class SinkExample:
    """One example's sinks and attention, every layer and query head of the stack read.

    ``sinks``    [layer, head, tokens] bool: key k is a sink of the head
    ``received`` [layer, head, tokens] fp32: mean attention the key receives over the query rows
    ``target``   [layer, head, tokens] fp32: the target query row's weights (mean over its rows)
    ``share``    [layer, head] fp32: the target row's weight on the head's sink keys"""

    sinks: torch.Tensor
    received: torch.Tensor
    target: torch.Tensor
    share: torch.Tensor


@dataclass(frozen=True)
class SinkResult:
    """Sinks of a list of examples (see the module docstring).

    ``examples``: one :class:`SinkExample` each. ``share`` [example, layer, head]: the target row's
    weight on sink keys; ``mean_share`` [layer, head] its mean over the examples; ``first_token``
    [layer, head] the fraction of examples whose first token (position 0) is a sink of the head."""

    stack: str
    threshold: float
    examples: tuple[SinkExample, ...]

    @property
    def share(self) -> torch.Tensor:
        return torch.stack([e.share for e in self.examples])  # [example, layer, head]

    @property
    def mean_share(self) -> torch.Tensor:
        return self.share.nanmean(dim=0)  # [layer, head]

    @property
    def first_token(self) -> torch.Tensor:
        first = torch.stack([e.sinks[..., 0] for e in self.examples]).float()  # [example, layer, head]
        heads = torch.stack([e.received[..., 0] for e in self.examples]).isnan()
        return first.masked_fill(heads, float("nan")).nanmean(dim=0)  # [layer, head]

    def __repr__(self) -> str:
        return (f"<SinkResult {self.stack}, threshold {self.threshold}: {len(self.examples)} examples, first token a "
                f"sink in {float(self.first_token.nanmean()):.0%} of heads, mean sink share "
                f"{float(self.mean_share.nanmean()):.2f}>")


def _check_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise InputError(f"threshold={threshold!r}: give the mean attention share above which a key is a sink, "
                         f"in [0, 1) (Gu et al. 2024 use {SINK_THRESHOLD})")
    return float(threshold)


def _full_maps(pm: ProbeModel, batch, stack: str) -> torch.Tensor:
    """Every query row of every layer: [batch, layer, head, query, key] fp32 (a layer with fewer heads
    than the stack's most has its missing heads NaN)."""
    with torch.no_grad(), capture_attention(pm, stacks=[stack], **capture_masks(batch)) as capture:
        pm.model(**batch.inputs)
    per_layer = [m.weights[:, 0] for _, m in sorted(capture.layer_maps(stack).items())]  # [batch, head, query, key]
    keys = {int(w.shape[-1]) for w in per_layer}
    if len(keys) > 1:
        raise CaptureError(f"the {stack} layers attend over {sorted(keys)} positions (downsampled keys): sinks "
                           "are found over the input's tokens, which every layer must attend")
    heads = max(w.shape[1] for w in per_layer)
    if all(w.shape[1] == heads for w in per_layer):
        return capture.maps(stack).weights  # the capture's own stacked tensor: no second copy
    out = per_layer[0].new_full((per_layer[0].shape[0], len(per_layer), heads, *per_layer[0].shape[2:]), float("nan"))
    for i, w in enumerate(per_layer):
        out[:, i, : w.shape[1]] = w
    return out


def _example_sinks(weights: torch.Tensor, mean_rows: torch.Tensor, target_rows: torch.Tensor, n: int,
                   threshold: float) -> SinkExample:
    """weights [layer, head, query, key] of one row; mean_rows / target_rows long positions; n explained tokens."""
    weights = weights[..., :n]  # [layer, head, query, tokens]
    received = weights[:, :, mean_rows].mean(dim=2)  # [layer, head, tokens]
    target = weights[:, :, target_rows].mean(dim=2)  # [layer, head, tokens]
    sinks = received > threshold  # NaN (a missing head) compares False
    share = torch.where(sinks, target, torch.zeros_like(target)).sum(dim=-1)  # [layer, head]
    share = share.masked_fill(received[..., 0].isnan(), float("nan"))
    return SinkExample(sinks=sinks, received=received, target=target, share=share)


def attention_sinks(pm: ProbeModel, examples: Sequence[PreparedExample], *, threshold: float = SINK_THRESHOLD,
                    batch_size: int = 8) -> SinkResult:
    """Sinks of every layer and query head of the target stack, per example, and the share of the
    target query row's attention that falls on them (see the module docstring for the definition)."""
    threshold = _check_threshold(threshold)
    if not examples:
        raise InputError("no examples to find sinks in: give at least one prepared example")
    found: list[SinkExample] = []
    stack = None
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, list(examples), batch_size):
            stack = tq.stack
            maps = _full_maps(pm, batch, stack)  # [batch, layer, head, query, key]
            for r, n in enumerate(tq.lengths.tolist()):
                target_rows = tq.rows[r][tq.valid[r]].to(maps.device)
                mean_rows = target_rows if stack == "cross" else torch.arange(int(n), device=maps.device)
                found.append(_example_sinks(maps[r], mean_rows, target_rows, int(n), threshold))
    return SinkResult(stack=stack, threshold=threshold,
                      examples=tuple(SinkExample(*(t.cpu() for t in (e.sinks, e.received, e.target, e.share)))
                                     for e in found))


def nosink_rows(target: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The target row's weights ``[..., tokens]`` with sink keys 0 and the rest renormalised to sum to 1
    (all zeros where nothing is left)."""
    kept = torch.where(sinks, torch.zeros_like(target), target)
    total = kept.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp(min=torch.finfo(kept.dtype).tiny), torch.zeros_like(kept))


def attention_nosink(pm: ProbeModel, examples: Sequence[PreparedExample], *, threshold: float = SINK_THRESHOLD,
                     batch_size: int = 8) -> TokenScores:
    """Raw attention of the target row renormalised over its non-sink keys: ``[layer, head, tokens]``
    (sink keys 0). ``extras["sink_share"]``: per example ``[layer, head]``, the weight the row put on
    its sinks before renormalising."""
    found = attention_sinks(pm, examples, threshold=threshold, batch_size=batch_size)
    scores = []
    for e in found.examples:
        row = nosink_rows(e.target, e.sinks)
        scores.append(row.masked_fill(e.target.isnan(), float("nan")))  # a missing head stays NaN
    params = attention_params(pm, found.stack, threshold=found.threshold, sinks=DEFINITION,
                              renormalisation="sink keys set to 0, the row divided by its non-sink weight")
    return TokenScores("attention_nosink", scores, params=params, per_head=True,
                       extras={"sink_share": [e.share for e in found.examples],
                               "sinks": [e.sinks for e in found.examples]})


# ---------------------------------------------------------------------------
# sinks as data: the tidy table, the per-layer summary and the sentences naming them
# ---------------------------------------------------------------------------

#: the columns of a sink table (a study's ``sinks`` table): one row per example, layer and query head
SINK_COLUMNS = ("example", "layer", "head", "share", "n_sinks", "first", "positions", "n_tokens", "threshold")


def sink_rows(sinks: Sequence[torch.Tensor], shares: Sequence[torch.Tensor], *, threshold: float,
              first_index: int = 0) -> pd.DataFrame:
    """The tidy sink table (:data:`SINK_COLUMNS`) of examples ``first_index, first_index + 1, ...``
    from their sinks ``[layer, head, tokens]`` (bool) and sink shares ``[layer, head]``; a head a
    layer does not have (NaN share) has no row. ``positions``: the sink keys' positions, comma-joined."""
    import numpy as np
    import pandas as pd

    records = []
    for i, (found, share) in enumerate(zip(sinks, shares)):
        found = found.cpu().numpy().astype(bool)  # [layer, head, tokens]
        share = share.double().cpu().numpy()  # [layer, head]
        n_tokens = found.shape[-1]
        for (layer, head), value in np.ndenumerate(share):
            if not np.isfinite(value):
                continue
            keys = np.flatnonzero(found[layer, head])
            first = bool(n_tokens and found[layer, head, 0])
            records.append((first_index + i, layer, head, float(value), len(keys), first,
                            ",".join(str(int(k)) for k in keys), n_tokens, float(threshold)))
    frame = pd.DataFrame.from_records(records, columns=list(SINK_COLUMNS))
    return frame.astype({"example": "int64", "layer": "int64", "head": "int64", "share": "float64",
                         "n_sinks": "int64", "first": "bool", "n_tokens": "int64", "threshold": "float64"})


def result_rows(result: SinkResult, first_index: int = 0) -> pd.DataFrame:
    """:func:`sink_rows` of an :func:`attention_sinks` result."""
    return sink_rows([e.sinks for e in result.examples], [e.share for e in result.examples],
                     threshold=result.threshold, first_index=first_index)


__all__ = ["DEFINITION", "SINK_COLUMNS", "SINK_THRESHOLD", "SinkExample", "SinkResult", "attention_nosink",
           "attention_sinks", "nosink_rows", "result_rows", "sink_rows"]
