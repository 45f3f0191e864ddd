"""The batched execution engine every perturbation shares.

A perturbation method (leave-one-out, erasure curves, ...) only *describes* rows: a tuple of token
ids paired with the :class:`~probe.rows.target.PreparedExample` whose target it evaluates. The
engine turns many such rows, from many examples and methods, into as few forward passes as the
token budget allows, and evaluates each row's target with the one shared code path
(:func:`~probe.rows.target.build_rows` + :func:`~probe.rows.target.target_values`), so every
method explains exactly the same number.

What it does, and why:

* **Packing.** Rows are sorted by padded length and cut into batches whose padded size
  ``rows x width`` (the causal LM continuation and the seq2seq decoder included) stays under
  ``token_budget``. Sorting keeps padding small; the budget bounds memory whatever the mix.
* **De-duplication.** A row is identified by its content: ``(ids, kind, label, target ids)``. Its
  value is cached for the engine's lifetime, so the unperturbed input is run once however many
  methods ask for it, and identical perturbations (two random draws of the same token, a
  comprehensiveness row equal to a flip row) are run once. The key is content, never ``id()``:
  a freed example's id can be reused by a new one.
* **Prefix reuse (causal LMs).** A perturbed row of a causal LM leaves the tokens before its first
  change untouched, and a causal model's keys/values there do not depend on anything later. A
  pass over the examples' original inputs (``use_cache=True``, which also gives the originals'
  values) therefore holds the prefix cache of *every* length; each perturbed row then feeds only
  its *segment* (from its first change on, plus the continuation) against its own exact prefix
  cut from that cache. Segments of many rows are packed side by side into bins under a 4-D mask,
  so rows of every width and first-change position share a handful of large, nearly unpadded
  passes (see :meth:`Engine._evaluate_prefix_reuse`): every unchanged token is reused, and the
  saving is not drowned in per-call overhead or padding.
* **Provenance.** :attr:`Engine.stats` counts rows asked for, rows run, cache hits, forward passes
  and padded tokens.

Every pass runs with ``torch.no_grad()`` and the model in eval mode (dropout off; the model's
previous mode is restored afterwards). Padding is always on the right and masked, so a row's value
does not depend on what it is batched with (up to float rounding, ~1e-7 in fp32).

An empty row (every token removed, possible for a model without special tokens) has no defined
target: its value is NaN and no pass is run for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from probe.errors import InputError, ProbeError
from probe.rows.memory import free_memory, halving, in_halves, is_out_of_memory  # noqa: F401  (re-exported)
from probe.rows.target import (PreparedExample, RowBatch, build_rows, forward_accepts, keep_target_logits,
                                  slices_logits_to_keep, target_values)

Row = tuple[tuple[int, ...], PreparedExample]

#: Cost of one model call beyond its tokens, in token-equivalents, used only to decide how finely
#: rows of different widths are split into batches. Measured on a shared 2-core CPU with SmolLM2-135M
#: a call cost ~0.4 s beyond ~2 ms per token (small batches stream every weight from memory once per
#: call), i.e. ~200 tokens; GPUs are launch bound (a call is worth about a thousand tokens).
CALL_OVERHEAD_TOKENS = {"cpu": 256, "cuda": 1024, "mps": 256}
#: Planning heuristics for packed prefix-reuse passes, in token-equivalents (they change the
#: batching only, never the values): one cached prefix slot carried by one bin (gathered and
#: copied into each layer's cache and its key/value heads: ~0.3 MB of memory traffic on
#: SmolLM2-135M, against ~1 ms of compute per token; its attention is counted per pair), and one
#: query-key pair of attention (a bin scores every query against every key before masking). The
#: FLOP ratio of one pair to one token is ~2 x hidden / parameters per layer (3e-4 for
#: SmolLM2-135M); CPU attention kernels are less efficient than its matmuls (~6e-4 measured),
#: hence the margin.
CACHE_SLOT_COST = 0.05
ATTENTION_PAIR_COST = 1e-3
#: Bin widths (tokens of packed segments per batch row) the prefix-reuse planner tries.
PACK_WIDTHS = (64, 128, 256, 512)


@dataclass
class _Segment:
    """A perturbed causal-LM row as prefix reuse feeds it: its tokens from its first change on."""

    key: tuple  # the row's cache key
    row: Row
    shared: int  # c: tokens before the first change (read from the prefix cache)
    ids: list[int]  # row[c:] + the continuation but its last token
    slot: int  # the example's index in its prefix pass
    length: int  # the example's input length (for grouping similar examples)


@dataclass
class EngineStats:
    """Counters for the benchmark and for provenance (cumulative over the engine's life)."""

    rows_requested: int = 0  # rows asked for, duplicates and cached rows included
    rows_evaluated: int = 0  # rows actually run through the model
    cache_hits: int = 0  # rows answered from the cache (or duplicates within a call)
    forward_passes: int = 0  # model calls, prefix passes included
    padded_tokens: int = 0  # sum over calls of rows x width (what was actually computed)
    prefix_passes: int = 0  # calls over original inputs that produced prefix caches
    prefix_rows: int = 0  # rows evaluated as a suffix on top of a cached prefix
    seconds: float = 0.0  # wall time spent in model calls
    oom_splits: int = 0  # batches that ran out of memory and were halved and retried

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def target_key(example: PreparedExample) -> tuple:
    """What makes two examples' targets the same number (for de-duplication)."""
    # a similarity target also depends on its reference text (label_name)
    return (example.kind, example.label, tuple(example.target_ids)) + ((example.label_name,) if example.kind == "similarity" else ())


def row_key(ids: Sequence[int], example: PreparedExample) -> tuple:
    return (tuple(int(i) for i in ids), target_key(example))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@contextlib.contextmanager
def eval_no_grad(model):
    """Eval mode (dropout off) and no autograd for the duration; the model's previous mode is
    restored. Every intervention runs under it (Jain & Wallace's permutations ran with dropout on)."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


class Engine:
    """Evaluate targets on many token rows in budgeted, sorted, de-duplicated batches.

    ``token_budget``: upper bound on ``rows x padded width`` of one forward pass (a single row
    longer than the budget still runs, alone). For prefix reuse the budget counts
    ``rows x (cached prefix slots + suffix width)``, since the cache is copied per row.
    ``progress``: show a progress bar over batches. ``call_overhead_tokens``: what one model call
    costs beyond its tokens, in token-equivalents, when deciding how finely to split rows of
    different widths into batches (default by device: :data:`CALL_OVERHEAD_TOKENS`). It changes
    the batching only, never the values.
    """

    def __init__(self, pm, token_budget: int = 8192, progress: bool = False, *,
                 call_overhead_tokens: int | None = None):
        if int(token_budget) < 1:
            raise InputError(f"token_budget must be a positive number of tokens, got {token_budget!r}")
        self.pm = pm
        self.token_budget = int(token_budget)
        self.progress = progress
        device_type = torch.device(pm.device).type
        self.call_overhead_tokens = (CALL_OVERHEAD_TOKENS.get(device_type, 256) if call_overhead_tokens is None
                                     else max(0, int(call_overhead_tokens)))
        self.stats = EngineStats()
        # row key -> (target value, predicted class or -1)
        self._cache: dict[tuple, tuple[float, int]] = {}
        self._trim_logits = pm.task == "causal_lm" and forward_accepts(pm.model, "logits_to_keep")
        # packed passes keep ragged positions per bin: a boolean logits_to_keep, which transformers'
        # slice_logits_to_keep flattens to the kept positions (a model slicing its own way projects all)
        self._packed_logits = self._trim_logits and slices_logits_to_keep(pm.model)
        self._prefix_reuse_ok: bool | None = None

    # ------------------------------------------------------------------ public API

    def values(self, rows: Sequence[tuple[Sequence[int], PreparedExample]], *,
               reuse_prefix: bool = False) -> torch.Tensor:
        """``[len(rows)]`` float32 target value of each row, in the order given.

        ``reuse_prefix=True`` (causal LMs only; ignored otherwise) feeds each perturbed row only from
        its first change on, over its example's cached prefix (:meth:`_evaluate_prefix_reuse`);
        the result is the same within float rounding.
        """
        rows = [(tuple(int(i) for i in ids), example) for ids, example in rows]
        if reuse_prefix and self.pm.task == "causal_lm":
            self._evaluate_prefix_reuse(rows)
        else:
            self._evaluate_missing(rows)
        self.stats.rows_requested += len(rows)
        return self._lookup(rows)[0]

    def predicted_labels(self, rows: Sequence[tuple[Sequence[int], PreparedExample]]) -> torch.Tensor:
        """``[len(rows)]`` long: the classifier's argmax class on each row (-1 for empty rows).

        Shares the cache and the passes of :meth:`values` (the argmax is kept when a row is run).
        """
        if self.pm.task != "classification":
            raise InputError(f"predicted labels need a classifier; this model is a {self.pm.task} model")
        rows = [(tuple(int(i) for i in ids), example) for ids, example in rows]
        # a re-read of rows usually just asked for by values(): not counted as requests or hits again
        self._evaluate_missing(rows, count_hits=False)
        return self._lookup(rows)[1]

    def values_with_prefix_reuse(self, example: PreparedExample,
                                 rows: Sequence[Sequence[int] | tuple[Sequence[int], PreparedExample]]) -> torch.Tensor:
        """``[len(rows)]`` target values of perturbations of one causal-LM example, reusing the
        unchanged prefix of ``example.input_ids``. ``rows`` are id sequences (or ``(ids, example)``
        pairs of this example). Equal to :meth:`values` within float rounding."""
        pairs: list[Row] = []
        for row in rows:
            ids = row[0] if (isinstance(row, tuple) and len(row) == 2 and isinstance(row[1], PreparedExample)) else row
            pairs.append((tuple(int(i) for i in ids), example))
        if self.pm.task != "causal_lm":
            self._evaluate_missing(pairs)
        else:
            self._evaluate_prefix_reuse(pairs)
        self.stats.rows_requested += len(pairs)
        return self._lookup(pairs)[0]

    def clear(self) -> None:
        """Forget cached values (counters are kept)."""
        self._cache.clear()

    @property
    def cached_rows(self) -> int:
        """How many distinct rows have a cached value."""
        return len(self._cache)

    # ------------------------------------------------------------------ cache

    def _lookup(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.empty(len(rows), dtype=torch.float32)  # [rows]
        labels = torch.empty(len(rows), dtype=torch.long)  # [rows]
        for r, (ids, example) in enumerate(rows):
            if not ids:
                values[r], labels[r] = float("nan"), -1
                continue
            values[r], labels[r] = self._cache[row_key(ids, example)]
        return values, labels

    def _missing(self, rows: Iterable[Row], count_hits: bool = True) -> list[tuple[tuple, Row]]:
        """Unique non-empty rows not in the cache, with their keys; counts the rest as hits."""
        seen: dict[tuple, Row] = {}
        hits = 0
        for ids, example in rows:
            if not ids:
                continue
            key = row_key(ids, example)
            if key in self._cache or key in seen:
                hits += 1
            else:
                seen[key] = (ids, example)
        if count_hits:
            self.stats.cache_hits += hits
        return list(seen.items())

    def _store(self, keyed: Sequence[tuple[tuple, Row]], values: torch.Tensor, labels: torch.Tensor | None) -> None:
        for j, (key, _) in enumerate(keyed):
            self._cache[key] = (float(values[j]), int(labels[j]) if labels is not None else -1)
        self.stats.rows_evaluated += len(keyed)

    # ------------------------------------------------------------------ plain batched evaluation

    def _padded_length(self, row: Row) -> int:
        ids, example = row
        if self.pm.task == "classification":
            return len(ids)
        if self.pm.task == "causal_lm":
            return len(ids) + len(example.target_ids) - 1  # the last continuation token is not fed
        return len(ids) + len(example.target_ids)  # encoder + decoder (seq2seq)

    def _pack(self, widths: Sequence[int]) -> list[list[int]]:
        """Cut rows into batches: indices into ``widths``, each batch sorted by width.

        A batch computes ``rows x max width`` tokens (padding included), kept under the budget.
        Rows are sorted by width and batches are runs of consecutive widths; a dynamic programme
        over the distinct widths picks the runs that minimise padded tokens plus
        ``call_overhead_tokens`` per call (so rows of very different widths are not padded to the
        widest, and near-equal widths are not split into many small calls).
        """
        if not widths:
            return []
        order = sorted(range(len(widths)), key=lambda i: widths[i])
        # buckets of equal width: (width, rows)
        buckets: list[list[int]] = []
        for i in order:
            if buckets and buckets[-1][0] == widths[i]:
                buckets[-1][1] += 1
            else:
                buckets.append([widths[i], 1])
        k = len(buckets)

        def capacity(width: int) -> int:
            return max(1, self.token_budget // max(1, width))

        best = [0.0] + [math.inf] * k
        cut = [0] * (k + 1)
        for b in range(1, k + 1):
            width, rows = buckets[b - 1][0], 0
            for a in range(b - 1, -1, -1):  # the run of buckets a..b-1, padded to the widest (b-1)
                rows += buckets[a][1]
                cost = best[a] + rows * width + math.ceil(rows / capacity(width)) * self.call_overhead_tokens
                if cost < best[b]:
                    best[b], cut[b] = cost, a
                if rows * width > 4 * self.token_budget:  # longer runs only add padding
                    break
        runs = []
        b = k
        while b > 0:
            runs.append((cut[b], b))
            b = cut[b]
        batches: list[list[int]] = []
        start = 0
        for a, b in reversed(runs):
            rows = sum(bucket[1] for bucket in buckets[a:b])
            size = capacity(buckets[b - 1][0])
            members = order[start:start + rows]
            start += rows
            batches.extend(members[j:j + size] for j in range(0, rows, size))
        return batches

    def _evaluate_missing(self, rows: Sequence[Row], count_hits: bool = True) -> None:
        missing = self._missing(rows, count_hits)
        if not missing:
            return
        # target_values reads the target kind from a batch's first example: never mix kinds.
        by_kind: dict[str, list[tuple[tuple, Row]]] = {}
        for item in missing:
            by_kind.setdefault(item[1][1].kind, []).append(item)
        plans = []
        for items in by_kind.values():
            for batch in self._pack([self._padded_length(row) for _, row in items]):
                plans.append([items[i] for i in batch])
        def run(keyed):
            values, labels = self._forward([row for _, row in keyed])
            self._store(keyed, values, labels)

        for keyed in self._iterate(plans, "rows"):
            halving(keyed, run, self.stats, self.pm.device)

    def _iterate(self, plans, unit: str):
        if not self.progress:
            return plans
        from tqdm.auto import tqdm

        return tqdm(plans, desc=f"engine ({unit})", unit="batch", leave=False)

    def _forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model call on ``rows``: ``([rows] values, [rows] argmax class or None)``."""
        batch = build_rows(self.pm, [(list(ids), example) for ids, example in rows])
        kwargs = dict(batch.inputs)
        if self.pm.task != "classification":
            kwargs["use_cache"] = False
        batch = keep_target_logits(self.pm, batch, kwargs)
        started = time.perf_counter()
        with eval_no_grad(self.pm.model):
            logits = self.pm.model(**kwargs).logits
        self._count(started, batch.inputs["input_ids"].numel()
                    + (batch.inputs["decoder_input_ids"].numel() if "decoder_input_ids" in batch.inputs else 0))
        values = target_values(self.pm, batch, logits).float().cpu()
        labels = logits.argmax(-1).cpu() if self.pm.task == "classification" else None
        return values, labels

    def _count(self, started: float, padded_tokens: int) -> None:
        self.stats.seconds += time.perf_counter() - started
        self.stats.forward_passes += 1
        self.stats.padded_tokens += int(padded_tokens)

    # ------------------------------------------------------------------ prefix reuse (causal LMs)

    def _cache_supports_reuse(self) -> bool:
        """Prefix reuse is implemented for plain full-attention ``DynamicLayer`` caches, with the
        eager or sdpa attention (which take a custom 4-D additive mask) only.

        Sliding-window, chunked, linear-attention or shared-KV layers keep a different state, and
        other attention kernels may ignore a 4-D mask; for them the engine falls back to full
        recomputation rather than risk a wrong number.
        """
        if self._prefix_reuse_ok is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            try:
                probe_cache = DynamicCache(config=self.pm.model.config)
                layers = getattr(probe_cache, "layers", [])
                self._prefix_reuse_ok = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
            except Exception:  # an unusual config: do not reuse
                self._prefix_reuse_ok = False
            implementation = getattr(self.pm.model.config, "_attn_implementation", None) or "eager"
            # inline attention (read through a probability module) builds its own masks (bloom's
            # alibi from a 2-D mask): only models that call the attention function take a 4-D one
            inline = any(site.kind != "function" for site in (getattr(self.pm.contract, "sites", None) or {}).values())
            self._prefix_reuse_ok = (self._prefix_reuse_ok and forward_accepts(self.pm.model, "cache")
                                     and implementation in ("eager", "sdpa") and not inline)
        return self._prefix_reuse_ok

    def _evaluate_prefix_reuse(self, rows: Sequence[Row]) -> None:
        """Evaluate causal-LM rows (of any number of examples) reusing each row's unchanged prefix.

        Every pass here is *packed*: a row is fed as a *segment*, the tokens it needs computed,
        and segments sit side by side in bins (of W tokens, :meth:`_pack_segments`, or of one
        example each, :meth:`_pack_by_example`; :meth:`_plan_bins` picks the cheaper), so there is
        almost no padding however different the rows' widths.
        A custom 4-D additive mask lets a segment token read its own segment's earlier tokens
        (and, below, its own example's cached prefix) and nothing else; position ids restart where
        each segment starts (RoPE and learned position embeddings alike read them). A padding
        token reads only itself, and nothing reads it.

        1. *Prefix passes*: the examples' originals (input + continuation but its last token) run
           as segments with ``use_cache=True``. In a causal model the keys/values at position j
           depend on tokens <= j only, so this holds the prefix cache of every length for every row
           of the example; it also yields the originals' values.
        2. *Suffix passes*: a row whose first change is at position c is fed as the segment
           ``row[c:] + continuation[:-1]``, reading its example's cached keys and values at
           positions < c. A bin's cache holds the prefixes of the (one or few) examples its
           segments come from, gathered once per bin rather than once per row.

        Examples are processed in chunks of about ``token_budget`` original tokens, so the
        prefix cache held at once stays bounded.
        """
        if not self._cache_supports_reuse():
            self._evaluate_missing(rows)
            return
        missing = self._missing(rows)
        if not missing:
            return
        examples: dict[int, PreparedExample] = {}
        perturbed: dict[int, list[tuple[tuple, Row, int]]] = {}  # example -> (key, row, shared prefix c)
        wanted = {key for key, _ in missing}
        for key, (ids, example) in missing:
            examples[id(example)] = example
            original = tuple(int(i) for i in example.input_ids)
            if ids == original:
                continue  # computed by the prefix pass
            # at most len(row) - 1: the logit predicting the first continuation token (at the row's
            # last input position) must be recomputed
            c = min(common_prefix(ids, original), len(ids) - 1)
            perturbed.setdefault(id(example), []).append((key, (ids, example), c))
        order = sorted(examples, key=lambda e: len(examples[e].input_ids))
        chunks: list[list[int]] = [[]]
        used = 0
        for e in order:
            size = len(examples[e].input_ids) + len(examples[e].target_ids) - 1
            if chunks[-1] and used + size > self.token_budget:
                chunks.append([])
                used = 0
            chunks[-1].append(e)
            used += size

        def run(chunk):
            slot_of = {e: slot for slot, e in enumerate(chunk)}
            kv, origin = self._prefix_passes([examples[e] for e in chunk], wanted)
            # a retried half skips the rows an earlier, interrupted attempt already stored
            segments = [_Segment(key, row, c, list(row[0][c:]) + list(row[1].target_ids[:-1]), slot_of[e],
                                 len(row[1].input_ids))
                        for e in chunk for key, row, c in perturbed.get(e, []) if key not in self._cache]
            if segments:
                self._suffix_passes(segments, kv, origin)
            del kv

        for chunk in self._iterate(chunks, "example chunks"):
            halving(chunk, run, self.stats, self.pm.device, "examples")

    def _prefix_passes(self, chunk: list[PreparedExample], wanted: set) -> tuple[list, dict[int, int]]:
        """Run the originals of ``chunk`` packed, with a cache. Returns per-layer ``(keys, values)``
        flattened to ``[slots, kv_heads, head_dim]``, and where each example's token 0 is in them
        (token j of example ``chunk[s]`` is slot ``origin[s] + j``)."""
        segments = []
        for slot, example in enumerate(chunk):
            original = tuple(int(i) for i in example.input_ids)
            key = row_key(original, example)
            segments.append(_Segment(key if key in wanted and key not in self._cache else None, (original, example),
                                     0, list(original) + list(example.target_ids[:-1]), slot, len(original)))
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        origin: dict[int, int] = {}
        size = 0

        def run(bins):
            nonlocal size
            kv, starts = self._packed_batch(bins, None, {}, keep_cache=True)
            pieces.append(kv)
            origin.update({slot: size + start for slot, start in starts.items()})
            size += kv[0][0].shape[0]

        for batch in self._plan_bins(segments):
            halving([[segments[i] for i in b] for b in batch], run, self.stats, self.pm.device, "bins")
        kv = [(torch.cat([piece[layer][0] for piece in pieces]), torch.cat([piece[layer][1] for piece in pieces]))
              for layer in range(len(pieces[0]))] if len(pieces) > 1 else pieces[0]
        return kv, origin

    def _pack_segments(self, segments: list[_Segment], width: int) -> list[list[int]]:
        """Bins of at most ``width`` segment tokens (indices into ``segments``), first fit.

        Segments are taken example by example (examples by length, each example's segments longest
        first) and placed in the first of the last few open bins they fit in, so a bin holds the
        segments of one or a few neighbouring examples and every bin but the last few is nearly full.
        """
        order = sorted(range(len(segments)), key=lambda i: (segments[i].length, segments[i].slot,
                                                            -len(segments[i].ids)))
        bins: list[list[int]] = []
        fill: list[int] = []
        open_bins: list[int] = []
        for i in order:
            size = len(segments[i].ids)
            home = next((b for b in open_bins if fill[b] + size <= width), None)
            if home is None:
                bins.append([])
                fill.append(0)
                home = len(bins) - 1
                open_bins.append(home)
                if len(open_bins) > 8:
                    open_bins.pop(0)
            bins[home].append(i)
            fill[home] += size
        return bins

    @staticmethod
    def _bin_depth(members: Sequence[_Segment]) -> int:
        """Cached prefix slots a bin needs: for each of its examples, the deepest first change."""
        deepest: dict[int, int] = {}
        for seg in members:
            deepest[seg.slot] = max(deepest.get(seg.slot, 0), seg.shared)
        return sum(deepest.values())

    @staticmethod
    def _pack_by_example(segments: list[_Segment]) -> list[list[int]]:
        """Bins of one example's segments each, as wide as its longest segment (first fit
        decreasing). A bin then carries one example's prefix only, so each query scores about
        twice the example's length in keys rather than P + W; leave-one-out's segments pair off
        exactly (lengths L - c and c fill a bin of L)."""
        by_example: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            by_example.setdefault(seg.slot, []).append(i)
        bins: list[list[int]] = []
        for members in by_example.values():
            members.sort(key=lambda i: -len(segments[i].ids))
            width = len(segments[members[0]].ids)
            first, room = len(bins), []
            for i in members:
                size = len(segments[i].ids)
                home = next((b for b, free in enumerate(room) if free >= size), None)
                if home is None:
                    home = len(room)
                    room.append(width)
                    bins.append([])
                bins[first + home].append(i)
                room[home] -= size
        return bins

    def _plan_bins(self, segments: list[_Segment]) -> list[list[list[int]]]:
        """Batches of bins of segments (indices into ``segments``): the packing that plans
        cheapest, among bins of one width W (from :data:`PACK_WIDTHS`, at least the longest
        segment) and bins of one example each (:meth:`_pack_by_example`).

        A bin of width W over P cached slots costs about ``W`` tokens, plus
        :data:`ATTENTION_PAIR_COST` per query-key pair (W x (P + W): every query of a bin is scored
        against every key, masked or not), plus :data:`CACHE_SLOT_COST` per cached slot; a model
        call costs ``call_overhead_tokens``.
        """
        longest = max(len(segment.ids) for segment in segments)
        packings = [self._pack_segments(segments, width) for width in sorted({max(w, longest) for w in PACK_WIDTHS})]
        packings.append(self._pack_by_example(segments))
        best_plan, best_cost = None, math.inf
        for bins in packings:
            sized = sorted(((self._bin_depth([segments[i] for i in b]), sum(len(segments[i].ids) for i in b), b)
                            for b in bins), key=lambda item: (item[1], item[0]))
            plan, cost = self._batch_bins(sized)
            if cost < best_cost:
                best_plan, best_cost = plan, cost
        return best_plan or []

    def _batch_bins(self, sized: list[tuple[int, int, list[int]]]) -> tuple[list[list[list[int]]], float]:
        """Cut bins ``(cache depth, fill, members)``, sorted by fill, into runs of consecutive bins
        (one model call each, padded to the run's widest fill and deepest cache, with
        ``bins x (depth + fill)`` under the token budget) by a dynamic programme that minimises the
        estimated cost (see :meth:`_plan_bins`); returns the batches' members and that cost."""
        n = len(sized)
        best = [0.0] + [math.inf] * n
        cut = [0] * (n + 1)
        for b in range(1, n + 1):
            depth = fill = 0
            for a in range(b - 1, -1, -1):  # the run a..b-1
                depth, fill = max(depth, sized[a][0]), max(fill, sized[a][1])
                bins = b - a
                if bins > 1 and bins * (depth + fill) > self.token_budget:
                    break
                cost = best[a] + (bins * (fill + ATTENTION_PAIR_COST * fill * (depth + fill) + CACHE_SLOT_COST * depth)
                                  + self.call_overhead_tokens)
                if cost < best[b]:
                    best[b], cut[b] = cost, a
        batches: list[list[list[int]]] = []
        b = n
        while b > 0:
            batches.append([members for _, _, members in sized[cut[b]:b]])
            b = cut[b]
        return batches[::-1], best[n]

    def _suffix_passes(self, segments: list[_Segment], kv: list, origin: dict[int, int]) -> None:
        for batch in self._plan_bins(segments):
            halving([[segments[i] for i in b] for b in batch], lambda bins: self._packed_batch(bins, kv, origin),
                    self.stats, self.pm.device, "bins")
            self.stats.prefix_rows += sum(len(b) for b in batch)

    def _packed_batch(self, bins: list[list[_Segment]], kv: list | None, origin: dict[int, int], *,
                      keep_cache: bool = False):
        """One model call over bins of segments (see :meth:`_evaluate_prefix_reuse`); stores each
        segment's value under its key (none when the key is None).

        ``kv``: per layer ``(keys, values)`` flattened to ``[slots, kv_heads, head_dim]``, where
        token j of the example in slot s is ``origin[s] + j`` (None: no segment reads a cache).
        ``keep_cache``: return this call's own keys/values, flattened the same way, and where each
        segment's token 0 is in them (the prefix passes).
        """
        from transformers import DynamicCache

        device = self.pm.device
        pad = self.pm.tokenizer.pad_token_id if self.pm.tokenizer.pad_token_id is not None else 0
        n_bins = len(bins)
        depth = max(self._bin_depth(b) for b in bins)
        fill = max(sum(len(seg.ids) for seg in b) for b in bins)
        ids = torch.full((n_bins, fill), pad, dtype=torch.long)
        positions = torch.zeros((n_bins, fill), dtype=torch.long)
        start = torch.arange(fill).repeat(n_bins, 1)  # first own-segment slot each query may read
        low = torch.zeros((n_bins, fill), dtype=torch.long)  # cached slots [low, high) each query may read
        high = torch.zeros((n_bins, fill), dtype=torch.long)
        gather = torch.zeros((n_bins, depth), dtype=torch.long)  # flat cache slot behind each cache slot
        keep = torch.zeros((n_bins, fill), dtype=torch.bool)  # positions whose logits are read
        owners: list[tuple[int, int, _Segment]] = []  # (bin, position of its first kept logit, segment)
        starts: dict[int, int] = {}  # segment slot -> flat position of its token 0 in this call
        for b, members in enumerate(bins):
            offset: dict[int, int] = {}  # example slot -> its first cache slot in this bin
            used = 0
            for seg in members:
                if seg.slot not in offset and seg.shared:
                    offset[seg.slot] = used
                    deepest = max(other.shared for other in members if other.slot == seg.slot)
                    gather[b, used:used + deepest] = origin[seg.slot] + torch.arange(deepest)
                    used += deepest
            at = 0
            for seg in members:
                n, n_target = len(seg.ids), len(seg.row[1].target_ids)
                ids[b, at:at + n] = torch.tensor(seg.ids)
                positions[b, at:at + n] = seg.shared + torch.arange(n)
                start[b, at:at + n] = at
                if seg.shared:
                    low[b, at:at + n] = offset[seg.slot]
                    high[b, at:at + n] = offset[seg.slot] + seg.shared
                # the logits at the row's last input token and at the continuation tokens fed
                keep[b, at + n - n_target:at + n] = True
                owners.append((b, at + n - n_target, seg))
                starts[seg.slot] = b * fill + at
                at += n
        slots = torch.arange(depth)
        keys = torch.arange(fill)
        queries = torch.arange(fill)[None, :, None]
        allowed = torch.cat([(slots[None, None, :] >= low[:, :, None]) & (slots[None, None, :] < high[:, :, None]),
                             (keys[None, None, :] >= start[:, :, None]) & (keys[None, None, :] <= queries)],
                            dim=2)  # [bins, fill, depth + fill]; a padding query reads itself only
        dtype = self.pm.model.dtype if self.pm.model.dtype.is_floating_point else torch.float32
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        cache = None
        if depth:
            index = gather.reshape(-1)
            layers = []
            for keys_flat, values_flat in kv:  # each [slots, kv_heads, head_dim], on its layer's device
                shape = (n_bins, depth) + tuple(keys_flat.shape[1:])
                at = index.to(keys_flat.device)
                layers.append((keys_flat.index_select(0, at).view(shape).transpose(1, 2),
                               values_flat.index_select(0, at).view(shape).transpose(1, 2)))
            cache = DynamicCache(ddp_cache_data=layers, config=self.pm.model.config)
        elif keep_cache:
            cache = DynamicCache(config=self.pm.model.config)
        kwargs = {"input_ids": ids.to(device), "attention_mask": mask[:, None].to(device),
                  "position_ids": positions.to(device), "cache": cache, "use_cache": cache is not None}
        if self._packed_logits:
            kwargs["logits_to_keep"] = keep.to(device)  # the kept positions only, flattened
        started = time.perf_counter()
        with eval_no_grad(self.pm.model):
            logits = self.pm.model(**kwargs).logits  # [kept positions, vocab], or [bins, fill, vocab]
        self._count(started, n_bins * fill)
        if keep_cache:
            self.stats.prefix_passes += 1
        # one row per segment: its kept logits (a short continuation repeats its last one, which the
        # target arithmetic then ignores), then the shared target arithmetic
        n_target = max(len(seg.row[1].target_ids) for _, _, seg in owners)
        picked = torch.tensor([[b * fill + k + min(j, len(seg.row[1].target_ids) - 1) for j in range(n_target)]
                               for b, k, seg in owners])  # [segments, n_target] flat positions
        if self._packed_logits:
            picked = (keep.reshape(-1).cumsum(0) - 1)[picked]  # the rank of each kept position
        else:
            logits = logits.reshape(-1, logits.shape[-1])
        per_row = logits[picked.to(device)]  # [segments, n_target, vocab]
        values = torch.empty(len(owners), dtype=torch.float32)
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
                            target_tokens=tokens.to(device), target_valid=valid.to(device))
            values[members] = target_values(self.pm, rows, per_row[torch.tensor(members, device=device)]).float().cpu()
        stored = [r for r, (_, _, seg) in enumerate(owners) if seg.key is not None]
        self._store([(owners[r][2].key, owners[r][2].row) for r in stored], values[stored], None)
        if not keep_cache:
            return None

        def flat(states: torch.Tensor) -> torch.Tensor:  # [bins, kv_heads, fill, head_dim] -> [slots, kv_heads, head_dim]
            return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])

        return [(flat(layer.keys), flat(layer.values)) for layer in cache.layers], starts
