"""Prefix reuse for causal LMs: a perturbed row is fed from its first change on.

A perturbed row of a causal LM leaves the tokens before its first change untouched, and a causal
model's keys/values there do not depend on anything later. Every pass here is *packed*: a row is
fed as a *segment*, the tokens it needs computed, and segments sit side by side in bins (planned
by :func:`probe.intervene.packing.plan_bins`), so there is almost no padding however different
the rows' widths. A custom 4-D additive mask lets a segment token read its own segment's earlier
tokens (and, below, its own example's cached prefix) and nothing else; position ids restart where
each segment starts (RoPE and learned position embeddings alike read them). A padding token reads
only itself, and nothing reads it.

1. *Prefix passes*: the examples' originals (input + continuation but its last token) run as
   segments with ``use_cache=True``. In a causal model the keys/values at position j depend on
   tokens <= j only, so this holds the prefix cache of every length for every row of the example;
   it also yields the originals' values.
2. *Suffix passes*: a row whose first change is at position c is fed as the segment
   ``row[c:] + continuation[:-1]``, reading its example's cached keys and values at positions < c.
   A bin's cache holds the prefixes of the (one or few) examples its segments come from, gathered
   once per bin rather than once per row.

Examples are processed in chunks of about ``token_budget`` original tokens, so the prefix cache
held at once stays bounded. The functions take the engine's :class:`RowCache` (the engine is one):
they read its settings and store into it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, overload

import torch

from probe.hooks.attention_functions import implementation_of
from probe.hooks.readers import FUNCTION
from probe.intervene.packing import Segment, bin_depth, plan_bins
from probe.intervene.rowcache import Row, RowCache, common_prefix, row_key
from probe.rows.forward import foil_tokens, plain_kv_cache
from probe.rows.queries import eval_mode
from probe.rows.target import PreparedExample, RowBatch
from probe.rows.values import position_values

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

#: per layer ``(keys, values)``, each flattened to ``[slots, kv_heads, head_dim]``
FlatCache = list[tuple[torch.Tensor, torch.Tensor]]
#: a segment longer than this (tokens fed) is fed in query blocks of this many, each reading the cache of
#: those before it: its mask and attention scores then grow as the input, not its square
QUERY_BLOCK = 1024


def supports_prefix_reuse(engine: RowCache) -> bool:
    """Prefix reuse is implemented for plain full-attention ``DynamicLayer`` caches, with the
    eager or sdpa attention (which take a custom 4-D additive mask) only.

    Sliding-window, chunked, linear-attention or shared-KV layers keep a different state, and
    other attention kernels may ignore a 4-D mask; for them the engine falls back to full
    recomputation rather than risk a wrong number. The answer is kept on the engine.
    """
    if engine._prefix_reuse_ok is None:
        engine._prefix_reuse_ok = model_supports_reuse(engine.pm)
    return engine._prefix_reuse_ok


def model_supports_reuse(pm: ProbeModel) -> bool:
    """Whether a causal LM's unchanged prefix can be fed once as a cache (see :func:`supports_prefix_reuse`)."""
    implementation = implementation_of(pm.model)
    # inline attention (read through a probability module) builds its own masks (bloom's
    # alibi from a 2-D mask): only models that call the attention function take a 4-D one
    inline = any(site.reader is not FUNCTION for site in (getattr(pm.contract, "sites", None) or {}).values())
    return plain_kv_cache(pm) and implementation in ("eager", "sdpa") and not inline


def evaluate_prefix_reuse(engine: RowCache, rows: Sequence[Row]) -> None:
    """Evaluate causal-LM rows (of any number of examples) into the engine's cache, reusing each
    row's unchanged prefix (see the module's docstring). The model must support it
    (:func:`supports_prefix_reuse`)."""
    missing = engine._missing(rows)
    if not missing:
        return
    examples, perturbed = _perturbed_rows(missing)
    wanted = {key for key, _ in missing}

    def run(chunk: list[int]) -> None:
        slot_of = {e: slot for slot, e in enumerate(chunk)}
        kv, origin = _prefix_passes(engine, [examples[e] for e in chunk], wanted)
        # a retried half skips the rows an earlier, interrupted attempt already stored
        segments = [Segment(key, row, c, list(row[0][c:]) + list(row[1].target_ids[:-1]), slot_of[e],
                            len(row[1].input_ids))
                    for e in chunk for key, row, c in perturbed.get(e, []) if key not in engine._cache]
        if segments:
            _suffix_passes(engine, segments, kv, origin)
        del kv

    def chunks(ids: list[int], budget: int) -> list[list[int]]:
        return _example_chunks({e: examples[e] for e in ids}, budget)

    engine.run_planned(list(examples), chunks, run, lambda chunk: sum(_example_size(examples[e]) for e in chunk),
                       items_of=list, what="examples", unit="example chunks")


def _perturbed_rows(missing: Sequence[tuple[tuple, Row]]
                    ) -> tuple[dict[int, PreparedExample], dict[int, list[tuple[tuple, Row, int]]]]:
    """The examples of ``missing`` rows by ``id()``, and per example its perturbed rows as
    ``(key, row, shared prefix c)`` (an unperturbed row is computed by the prefix pass)."""
    examples: dict[int, PreparedExample] = {}
    perturbed: dict[int, list[tuple[tuple, Row, int]]] = {}
    for key, (ids, example) in missing:
        examples[id(example)] = example
        original = tuple(int(i) for i in example.input_ids)
        if ids == original:
            continue
        # at most len(row) - 1: the logit predicting the first continuation token (at the row's
        # last input position) must be recomputed
        c = min(common_prefix(ids, original), len(ids) - 1)
        perturbed.setdefault(id(example), []).append((key, (ids, example), c))
    return examples, perturbed


def _example_chunks(examples: dict[int, PreparedExample], token_budget: int) -> list[list[int]]:
    """Example ids, shortest first, in chunks of about ``token_budget`` original tokens."""
    order = sorted(examples, key=lambda e: len(examples[e].input_ids))
    chunks: list[list[int]] = [[]]
    used = 0
    for e in order:
        size = _example_size(examples[e])
        if chunks[-1] and used + size > token_budget:
            chunks.append([])
            used = 0
        chunks[-1].append(e)
        used += size
    return chunks


def _example_size(example: PreparedExample) -> int:
    """The tokens of an example's original segment (input and continuation but its last token)."""
    return len(example.input_ids) + len(example.target_ids) - 1


def _planned_bins(engine: RowCache) -> Callable[[list[Segment], int], list[list[list[Segment]]]]:
    """``plan(segments, budget)``: :func:`~probe.intervene.packing.plan_bins` at ``budget``, as batches
    of bins of segments (what :meth:`~probe.intervene.rowcache.RowCache.run_planned` runs)."""
    def plan(segments: list[Segment], budget: int) -> list[list[list[Segment]]]:
        return [[[segments[i] for i in b] for b in batch]
                for batch in plan_bins(segments, budget, engine.call_overhead_tokens)]

    return plan


def _bins_tokens(bins: list[list[Segment]]) -> int:
    """A batch of bins in the token budget's measure: bins x (deepest cache + widest fill)."""
    return len(bins) * (max(bin_depth(b) for b in bins) + max(sum(len(s.ids) for s in b) for b in bins))


def _segments_of(bins: list[list[Segment]]) -> list[Segment]:
    return [segment for b in bins for segment in b]


def _prefix_passes(engine: RowCache, chunk: list[PreparedExample], wanted: set) -> tuple[FlatCache, dict[int, int]]:
    """Run the originals of ``chunk`` packed, with a cache. Returns per-layer ``(keys, values)``
    flattened to ``[slots, kv_heads, head_dim]``, and where each example's token 0 is in them
    (token j of example ``chunk[s]`` is slot ``origin[s] + j``)."""
    segments = []
    for slot, example in enumerate(chunk):
        original = tuple(int(i) for i in example.input_ids)
        key = row_key(original, example)
        segments.append(Segment(key if key in wanted and key not in engine._cache else None, (original, example),
                                0, list(original) + list(example.target_ids[:-1]), slot, len(original)))
    pieces: list[FlatCache] = []
    origin: dict[int, int] = {}
    size = 0

    def run(bins: list[list[Segment]]) -> None:
        nonlocal size
        short, long = _split_long(bins)
        if short:
            kv, starts = packed_batch(engine, short, None, {}, keep_cache=True)
            pieces.append(kv)
            origin.update({slot: size + start for slot, start in starts.items()})
            size += kv[0][0].shape[0]
        for seg in long:  # fed a query block at a time: its whole cache, token 0 first
            kv = blocked_segment(engine, seg, None, {}, keep_cache=True)
            pieces.append(kv)
            origin[seg.slot] = size
            size += kv[0][0].shape[0]

    engine.run_planned(segments, _planned_bins(engine), run, _bins_tokens, items_of=_segments_of, what="bins")
    kv = [(torch.cat([piece[layer][0] for piece in pieces]), torch.cat([piece[layer][1] for piece in pieces]))
          for layer in range(len(pieces[0]))] if len(pieces) > 1 else pieces[0]
    return kv, origin


def _suffix_passes(engine: RowCache, segments: list[Segment], kv: FlatCache, origin: dict[int, int]) -> None:
    def run(bins: list[list[Segment]]) -> None:
        short, long = _split_long(bins)
        if short:
            packed_batch(engine, short, kv, origin)
        for seg in long:
            blocked_segment(engine, seg, kv, origin)

    engine.run_planned(segments, _planned_bins(engine), run, _bins_tokens, items_of=_segments_of, what="bins")
    engine.stats.prefix_rows += len(segments)


# ---------------------------------------------------------------------- long segments, a block at a time


def _split_long(bins: list[list[Segment]]) -> tuple[list[list[Segment]], list[Segment]]:
    """The bins without their segments longer than :data:`QUERY_BLOCK`, and those segments."""
    long = [seg for b in bins for seg in b if len(seg.ids) > QUERY_BLOCK]
    short = [[seg for seg in b if len(seg.ids) <= QUERY_BLOCK] for b in bins]
    return [b for b in short if b], long


def _block_cuts(seg: Segment, block: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each query block of ``seg``: ``block`` tokens each, the last one holding
    at least the positions whose logits are read (the row's target)."""
    n, n_target = len(seg.ids), len(seg.row[1].target_ids)
    cuts = [*range(0, n, max(block, n_target)), n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < n_target:
        del cuts[-2]
    return list(zip(cuts[:-1], cuts[1:]))


def blocked_segment(engine: RowCache, seg: Segment, kv: FlatCache | None, origin: dict[int, int], *,
                    keep_cache: bool = False) -> FlatCache | None:
    """Feed one long segment a query block at a time (:data:`QUERY_BLOCK` tokens): each block reads
    the example's cached prefix and the blocks before it as its cache, so no call holds a
    ``[T, T]`` mask or score matrix, only ``[block, T]``; the causal model's keys and values are the
    ones a single call computes. The value is stored from the last block. ``keep_cache``: returns
    the row's whole cache (prefix, then every block), token 0 at slot 0."""
    running: FlatCache | None = None
    if seg.shared:
        at = origin[seg.slot]
        running = [(keys[at:at + seg.shared], values[at:at + seg.shared]) for keys, values in kv or []]
    cuts = _block_cuts(seg, QUERY_BLOCK)
    for i, (a, b) in enumerate(cuts):
        last = i == len(cuts) - 1
        piece = replace(seg, key=seg.key if last else None, shared=seg.shared + a, ids=seg.ids[a:b])
        out = packed_batch(engine, [[piece]], running, {seg.slot: 0}, keep_cache=keep_cache or not last)
        if out is not None:
            running = out[0]
    return running if keep_cache else None


# ---------------------------------------------------------------------- one packed model call


@dataclass
class _Layout:
    """Where every segment of a packed call sits. Shapes ``[bins, fill]`` unless noted."""

    ids: torch.Tensor  # token ids (pad elsewhere)
    positions: torch.Tensor  # position ids: each segment restarts at its shared prefix length
    start: torch.Tensor  # first own-segment slot each query may read
    low: torch.Tensor  # cached slots [low, high) each query may read
    high: torch.Tensor
    gather: torch.Tensor  # [bins, depth]: the flat cache slot behind each cache slot of a bin
    keep: torch.Tensor  # bool: positions whose logits are read
    owners: list[tuple[int, int, Segment]]  # (bin, position of its first kept logit, segment)
    starts: dict[int, int]  # segment slot -> flat position of its token 0 in this call


def _layout(bins: list[list[Segment]], origin: dict[int, int], pad: int, depth: int, fill: int) -> _Layout:
    n_bins = len(bins)
    out = _Layout(ids=torch.full((n_bins, fill), pad, dtype=torch.long),
                  positions=torch.zeros((n_bins, fill), dtype=torch.long),
                  start=torch.arange(fill).repeat(n_bins, 1),
                  low=torch.zeros((n_bins, fill), dtype=torch.long),
                  high=torch.zeros((n_bins, fill), dtype=torch.long),
                  gather=torch.zeros((n_bins, depth), dtype=torch.long),
                  keep=torch.zeros((n_bins, fill), dtype=torch.bool), owners=[], starts={})
    for b, members in enumerate(bins):
        offset = _gather_prefixes(out.gather[b], members, origin)
        at = 0
        for seg in members:
            n, n_target = len(seg.ids), len(seg.row[1].target_ids)
            out.ids[b, at:at + n] = torch.tensor(seg.ids)
            out.positions[b, at:at + n] = seg.shared + torch.arange(n)
            out.start[b, at:at + n] = at
            if seg.shared:
                out.low[b, at:at + n] = offset[seg.slot]
                out.high[b, at:at + n] = offset[seg.slot] + seg.shared
            # the logits at the row's last input token and at the continuation tokens fed
            out.keep[b, at + n - n_target:at + n] = True
            out.owners.append((b, at + n - n_target, seg))
            out.starts[seg.slot] = b * fill + at
            at += n
    return out


def _gather_prefixes(gather: torch.Tensor, members: list[Segment], origin: dict[int, int]) -> dict[int, int]:
    """Fill one bin's ``gather`` ``[depth]`` with its examples' prefixes (each as deep as its
    deepest first change); returns each example's first cache slot in the bin."""
    offset: dict[int, int] = {}
    used = 0
    for seg in members:
        if seg.slot not in offset and seg.shared:
            offset[seg.slot] = used
            deepest = max(other.shared for other in members if other.slot == seg.slot)
            gather[used:used + deepest] = origin[seg.slot] + torch.arange(deepest)
            used += deepest
    return offset


def _packed_mask(layout: _Layout, depth: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """``[bins, fill, depth + fill]`` additive mask: a query reads its example's cached prefix and
    its own segment up to itself; a padding query reads itself only."""
    slots = torch.arange(depth)
    keys = torch.arange(fill)
    queries = torch.arange(fill)[None, :, None]
    allowed = torch.cat([(slots[None, None, :] >= layout.low[:, :, None]) & (slots[None, None, :] < layout.high[:, :, None]),
                         (keys[None, None, :] >= layout.start[:, :, None]) & (keys[None, None, :] <= queries)],
                        dim=2)  # [bins, fill, depth + fill]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _gathered_cache(pm: ProbeModel, kv: FlatCache | None, gather: torch.Tensor, keep_cache: bool):
    """A ``DynamicCache`` holding each bin's gathered prefix slots (``gather`` ``[bins, depth]``),
    an empty one for a prefix pass, or None."""
    from transformers import DynamicCache

    n_bins, depth = gather.shape
    if depth:
        index = gather.reshape(-1)
        layers = []
        for keys_flat, values_flat in kv:  # each [slots, kv_heads, head_dim], on its layer's device
            shape = (n_bins, depth) + tuple(keys_flat.shape[1:])
            at = index.to(keys_flat.device)
            layers.append((keys_flat.index_select(0, at).view(shape).transpose(1, 2),
                           values_flat.index_select(0, at).view(shape).transpose(1, 2)))
        return DynamicCache(ddp_cache_data=layers, config=pm.model.config)
    if keep_cache:
        return DynamicCache(config=pm.model.config)
    return None


@overload
def packed_batch(engine: RowCache, bins: list[list[Segment]], kv: FlatCache | None, origin: dict[int, int], *,
                 keep_cache: Literal[True]) -> tuple[FlatCache, dict[int, int]]: ...


@overload
def packed_batch(engine: RowCache, bins: list[list[Segment]], kv: FlatCache | None, origin: dict[int, int], *,
                 keep_cache: bool = False) -> tuple[FlatCache, dict[int, int]] | None: ...


def packed_batch(engine: RowCache, bins: list[list[Segment]], kv: FlatCache | None, origin: dict[int, int], *,
                 keep_cache: bool = False) -> tuple[FlatCache, dict[int, int]] | None:
    """One model call over bins of segments; stores each segment's value under its key (none
    when the key is None).

    ``kv``: per layer ``(keys, values)`` flattened to ``[slots, kv_heads, head_dim]``, where
    token j of the example in slot s is ``origin[s] + j`` (None: no segment reads a cache).
    ``keep_cache``: return this call's own keys/values, flattened the same way, and where each
    segment's token 0 is in them (the prefix passes).
    """
    pm = engine.pm
    device = pm.device
    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    depth = max(bin_depth(b) for b in bins)
    fill = max(sum(len(seg.ids) for seg in b) for b in bins)
    layout = _layout(bins, origin, pad, depth, fill)
    dtype = pm.model.dtype if pm.model.dtype.is_floating_point else torch.float32
    mask = _packed_mask(layout, depth, fill, dtype)
    cache = _gathered_cache(pm, kv, layout.gather, keep_cache)
    kwargs = {"input_ids": layout.ids.to(device), "attention_mask": mask[:, None].to(device),
              "position_ids": layout.positions.to(device), "cache": cache, "use_cache": cache is not None}
    if engine._packed_logits:
        kwargs["logits_to_keep"] = layout.keep.to(device)  # the kept positions only, flattened
    started = time.perf_counter()
    with eval_mode(pm.model, grad=False):
        logits = pm.model(**kwargs).logits  # [kept positions, vocab], or [bins, fill, vocab]
    engine._count(started, len(bins) * fill)
    if keep_cache:
        engine.stats.prefix_passes += 1
    values = _segment_values(pm, logits, layout, fill, engine._packed_logits)
    owners = layout.owners
    stored = [r for r, (_, _, seg) in enumerate(owners) if seg.key is not None]
    engine._store([(owners[r][2].key, owners[r][2].row) for r in stored],  # type: ignore[misc]  # keys not None
                  values[stored], None)
    if not keep_cache:
        return None

    def flat(states: torch.Tensor) -> torch.Tensor:  # [bins, kv_heads, fill, head_dim] -> [slots, kv_heads, head_dim]
        return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])

    return [(flat(layer.keys), flat(layer.values)) for layer in cache.layers], layout.starts


def _segment_values(pm: ProbeModel, logits: torch.Tensor, layout: _Layout, fill: int,
                    packed_logits: bool) -> torch.Tensor:
    """``[segments, n_target]`` float32 per-position target values of each segment of a packed call
    (:func:`~probe.rows.values.position_values`), in ``layout.owners`` order: its kept logits (a
    short continuation repeats its last one, which the target arithmetic then ignores), then the
    shared target arithmetic, one call per target kind."""
    device = pm.device
    owners = layout.owners
    n_target = max(len(seg.row[1].target_ids) for _, _, seg in owners)
    picked = torch.tensor([[b * fill + k + min(j, len(seg.row[1].target_ids) - 1) for j in range(n_target)]
                           for b, k, seg in owners])  # [segments, n_target] flat positions
    if packed_logits:
        picked = (layout.keep.reshape(-1).cumsum(0) - 1)[picked]  # the rank of each kept position
    else:
        logits = logits.reshape(-1, logits.shape[-1])
    per_row = logits[picked.to(device)]  # [segments, n_target, vocab]
    values = torch.zeros((len(owners), n_target), dtype=torch.float32)
    by_kind: dict[str, list[int]] = {}
    for r, (_, _, seg) in enumerate(owners):
        by_kind.setdefault(seg.row[1].kind, []).append(r)
    for members in by_kind.values():
        examples = [owners[r][2].row[1] for r in members]
        tokens = torch.zeros((len(members), n_target), dtype=torch.long)
        valid = torch.zeros((len(members), n_target), dtype=torch.bool)
        for j, example in enumerate(examples):
            tokens[j, :len(example.target_ids)] = torch.tensor(example.target_ids)
            valid[j, :len(example.target_ids)] = True
        rows = RowBatch(inputs={}, examples=examples, input_lengths=None,
                        target_positions=torch.arange(n_target, device=device).expand(len(members), -1),
                        target_tokens=tokens.to(device), target_valid=valid.to(device),
                        foil_tokens=foil_tokens(examples, n_target, device))
        values[members] = position_values(pm, rows, per_row[torch.tensor(members, device=device)]).float().cpu()
    return values
