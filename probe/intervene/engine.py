"""The batched execution engine every perturbation shares.

A perturbation method (leave-one-out, erasure curves, ...) only *describes* rows: a tuple of token
ids paired with the :class:`~probe.explain.target.PreparedExample` whose target it evaluates. The
engine turns many such rows, from many examples and methods, into as few forward passes as the
token budget allows, and evaluates each row's target with the one shared code path
(:func:`~probe.explain.target.build_rows` + :func:`~probe.explain.target.target_values`), so every
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
  change untouched, and a causal model's keys/values there do not depend on anything later. One
  batched pass over the examples' original inputs (``use_cache=True``, which also gives the
  originals' values) therefore holds the prefix cache of *every* length; each perturbed row then
  feeds only its suffix (from its first change on, plus the continuation) against its own exact
  prefix cut from that cache. Rows of many examples and different first-change positions share a
  batch through a padded cache whose unused slots are masked (see
  :meth:`Engine._evaluate_prefix_reuse`). Grouping is thus per row, at the exact position of its
  first change: every unchanged token is reused, in a handful of large passes rather than many
  small ones (which would drown the saving in per-call overhead on both CPU and GPU).
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
import inspect
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from probe.errors import InputError, ProbeError
from probe.explain.target import PreparedExample, RowBatch, build_rows, target_values

Row = tuple[tuple[int, ...], PreparedExample]

#: Cost of one model call beyond its tokens, in token-equivalents, used only to decide how finely
#: rows of different widths are split into batches. Measured on a shared 2-core CPU with SmolLM2-135M
#: a call cost ~0.4 s beyond ~2 ms per token (small batches stream every weight from memory once per
#: call), i.e. ~200 tokens; GPUs are launch bound (a call is worth about a thousand tokens).
CALL_OVERHEAD_TOKENS = {"cpu": 256, "cuda": 1024, "mps": 256}
#: Cost of one cached prefix slot carried by one row of a prefix-reuse batch, in token-equivalents:
#: a planning heuristic. Copying and attending to a slot measured ~0.1 token on CPU with
#: SmolLM2-135M (masked slots included: they are copied and scored before being masked); 0.25 also
#: prices the memory they hold, and makes the planner group examples of similar length.
CACHE_SLOT_COST = 0.25

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


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's / a backend's "out of memory" RuntimeError."""
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def halving(items: list, run, stats: EngineStats | None = None, device="cpu", what: str = "rows") -> None:
    """``run(items)``; when it runs out of memory, free what can be freed and run each half in turn
    (recursively). ``run`` must store its results only once it has them all, so a failed attempt
    leaves nothing behind and a retried item is computed exactly once. One item that does not fit
    is an error."""
    try:
        run(items)
        return
    except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_out_of_memory(error):
            raise
        if len(items) <= 1:
            raise ProbeError(f"out of memory on a single batch item ({what}) on {device}: use a smaller dtype "
                             "(--dtype bf16), a shorter text, or a device with more memory") from None
    free_memory(device)
    if stats is not None:
        stats.oom_splits += 1
    half = len(items) // 2
    halving(items[:half], run, stats, device, what)
    halving(items[half:], run, stats, device, what)


def target_key(example: PreparedExample) -> tuple:
    """What makes two examples' targets the same number (for de-duplication)."""
    return (example.kind, example.label, tuple(example.target_ids))


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


def _accepts(model, name: str) -> bool:
    """Whether the model class's forward takes ``name`` (the class, not the instance: a wrapped
    instance method would hide the signature)."""
    try:
        return name in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


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
        self._trim_logits = pm.task == "causal_lm" and _accepts(pm.model, "logits_to_keep")
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
        return len(ids) + len(example.target_ids)  # continuation (causal) or decoder (seq2seq)

    def _pack(self, widths: Sequence[int], depths: Sequence[int] | None = None, *,
              call_overhead_tokens: float | None = None) -> list[list[int]]:
        """Cut rows into batches: indices into ``widths``, each batch sorted by width.

        A batch computes ``rows x max width`` tokens (padding included) and must keep
        ``rows x (max width + max depth)`` under the budget (``depth``: cached prefix slots a row
        brings, 0 without a cache). Rows are sorted by width and batches are runs of consecutive
        widths; a dynamic programme over the distinct widths picks the runs that minimise
        :meth:`_plan_cost` (so rows of very different widths are not padded to the widest, and
        near-equal widths are not split into many small calls).
        """
        if not widths:
            return []
        overhead = self.call_overhead_tokens if call_overhead_tokens is None else call_overhead_tokens
        depths = list(depths) if depths is not None else [0] * len(widths)
        order = sorted(range(len(widths)), key=lambda i: (widths[i], depths[i]))
        # buckets of equal width: (width, rows, deepest)
        buckets: list[list[int]] = []
        for i in order:
            if buckets and buckets[-1][0] == widths[i]:
                buckets[-1][1] += 1
                buckets[-1][2] = max(buckets[-1][2], depths[i])
            else:
                buckets.append([widths[i], 1, depths[i]])
        k = len(buckets)

        def capacity(width: int, deepest: int) -> int:
            return max(1, self.token_budget // max(1, width + deepest))

        best = [0.0] + [math.inf] * k
        cut = [0] * (k + 1)
        for b in range(1, k + 1):
            width, rows, deepest = buckets[b - 1][0], 0, 0
            for a in range(b - 1, -1, -1):  # the run of buckets a..b-1, padded to the widest (b-1)
                rows += buckets[a][1]
                deepest = max(deepest, buckets[a][2])
                cost = (best[a] + rows * width + CACHE_SLOT_COST * rows * deepest
                        + math.ceil(rows / capacity(width, deepest)) * overhead)
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
            size = capacity(buckets[b - 1][0], max(bucket[2] for bucket in buckets[a:b]))
            members = order[start:start + rows]
            start += rows
            batches.extend(members[j:j + size] for j in range(0, rows, size))
        return batches

    def _plan_cost(self, batches: list[list[int]], widths: Sequence[int], depths: Sequence[int]) -> float:
        """Estimated cost of a batching in token-equivalents: padded tokens, plus
        :data:`CACHE_SLOT_COST` per cached prefix slot each row carries, plus the per-call overhead."""
        total = 0.0
        for batch in batches:
            total += len(batch) * (max(widths[i] for i in batch) + CACHE_SLOT_COST * max(depths[i] for i in batch))
            total += self.call_overhead_tokens
        return total

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
        batch = self._trim(batch, kwargs)
        started = time.perf_counter()
        with eval_no_grad(self.pm.model):
            logits = self.pm.model(**kwargs).logits
        self._count(started, batch.inputs["input_ids"].numel()
                    + (batch.inputs["decoder_input_ids"].numel() if "decoder_input_ids" in batch.inputs else 0))
        values = target_values(self.pm, batch, logits).float().cpu()
        labels = logits.argmax(-1).cpu() if self.pm.task == "classification" else None
        return values, labels

    def _trim(self, batch: RowBatch, kwargs: dict) -> RowBatch:
        """Causal LMs: project only the positions the target reads onto the vocabulary.

        ``logits_to_keep`` takes ``[rows, n_target]`` positions; the logits come back as
        ``[rows, n_target, vocab]``, so the batch's target positions become ``0..n_target-1``.
        The values are those of the full projection (same rows of the same matmul).
        """
        if not self._trim_logits:
            return batch
        kwargs["logits_to_keep"] = batch.target_positions  # [rows, n_target]
        n_rows, n_target = batch.target_positions.shape
        kept = torch.arange(n_target, device=batch.target_positions.device).expand(n_rows, n_target)
        return dataclasses.replace(batch, target_positions=kept)

    def _count(self, started: float, padded_tokens: int) -> None:
        self.stats.seconds += time.perf_counter() - started
        self.stats.forward_passes += 1
        self.stats.padded_tokens += int(padded_tokens)

    # ------------------------------------------------------------------ prefix reuse (causal LMs)

    def _cache_supports_reuse(self) -> bool:
        """Prefix reuse is implemented for plain full-attention ``DynamicLayer`` caches only.

        Sliding-window, chunked, linear-attention or shared-KV layers keep a different state; for
        them the engine falls back to full recomputation rather than risk a wrong number.
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
            self._prefix_reuse_ok = self._prefix_reuse_ok and _accepts(self.pm.model, "cache")
        return self._prefix_reuse_ok

    def _evaluate_prefix_reuse(self, rows: Sequence[Row]) -> None:
        """Evaluate causal-LM rows (of any number of examples) reusing each row's unchanged prefix.

        1. *Prefix pass*: the examples' original rows (input + continuation) run in as few
           budgeted, right-padded batches as possible with ``use_cache=True``. In a causal model
           the keys/values at position j depend on tokens <= j only, so this pass holds the prefix
           cache of every length for every row of the example; it also yields the originals' values.
        2. *Suffix passes*: a row whose first change is at position c feeds only
           ``row[c:] + continuation`` on top of its example's cache cut to c. Rows of different
           examples and different c share a batch: the caches are laid out in slots ``0..P-1``
           (P = the largest c in the batch), slots ``c..P-1`` of a row are masked out by the
           attention mask, and its position ids start at c. (transformers builds the causal mask
           from cache *slots*, so slot P+i attends to slots <= P+i minus the masked ones, and
           RoPE / position embeddings use the given position ids.) A row changed at its first
           token (c = 0) is simply a row whose cache slots are all masked. Rows are sorted by
           suffix width and batched so that ``rows x (P + width)`` stays under the token budget.
        """
        if not self._cache_supports_reuse():
            self._evaluate_missing(rows)
            return
        missing = self._missing(rows)
        if not missing:
            return
        originals: dict[int, tuple[int, ...]] = {}
        examples: dict[int, PreparedExample] = {}
        suffix_items: list[tuple[tuple, Row, int]] = []  # (key, row, shared prefix length c)
        for key, (ids, example) in missing:
            original = originals.setdefault(id(example), tuple(int(i) for i in example.input_ids))
            examples[id(example)] = example
            if ids == original:
                continue  # computed by the prefix pass
            # at most len(row) - 1: the logit predicting the first continuation token (at the row's
            # last input position) must be recomputed
            suffix_items.append((key, (ids, example), min(common_prefix(ids, original), len(ids) - 1)))
        wanted = {key for key, _ in missing}

        needed = list(examples)
        lengths = [len(originals[e]) + len(examples[e].target_ids) for e in needed]
        # as few prefix passes as the budget allows: the suffix rows of the examples of one
        # prefix pass are batched together, so fewer, larger prefix batches mean fuller suffix batches
        prefix_batches = self._pack(lengths, call_overhead_tokens=1e9)
        def run(chunk):
            kv, slot_of = self._prefix_pass(chunk, [examples[e] for e in chunk], originals, wanted)
            # a retried half skips the rows an earlier, interrupted attempt already stored
            self._suffix_passes([item for item in suffix_items if id(item[1][1]) in slot_of and item[0] not in self._cache],
                                kv, slot_of)
            del kv

        for chunk in self._iterate([[needed[i] for i in b] for b in prefix_batches], "prefix batches"):
            halving(chunk, run, self.stats, self.pm.device, "examples")

    def _prefix_pass(self, chunk: list[int], chunk_examples: list[PreparedExample],
                     originals: dict[int, tuple[int, ...]], wanted: set) -> tuple[list, dict[int, int]]:
        """Run the originals of ``chunk`` with a cache; returns per-layer ``(keys, values)``
        ``[examples, kv_heads, width, head_dim]`` and each example's batch slot."""
        from transformers import DynamicCache

        rows = [(list(originals[e]), example) for e, example in zip(chunk, chunk_examples)]
        batch = build_rows(self.pm, rows)
        cache = DynamicCache(config=self.pm.model.config)
        kwargs = dict(batch.inputs, cache=cache, use_cache=True)
        batch = self._trim(batch, kwargs)
        started = time.perf_counter()
        with eval_no_grad(self.pm.model):
            logits = self.pm.model(**kwargs).logits
        self._count(started, batch.inputs["input_ids"].numel())
        self.stats.prefix_passes += 1
        values = target_values(self.pm, batch, logits).float().cpu()  # [examples]
        keyed = [(row_key(ids, ex), (tuple(ids), ex)) for ids, ex in rows]
        fresh = [j for j, (key, _) in enumerate(keyed) if key in wanted and key not in self._cache]
        if fresh:
            self._store([keyed[j] for j in fresh], values[fresh], None)
        kv = [(layer.keys, layer.values) for layer in cache.layers]  # each [examples, kv_heads, width, head_dim]
        return kv, {e: slot for slot, e in enumerate(chunk)}

    def _plan_suffixes(self, items: list[tuple[tuple, Row, int]]) -> list[list[int]]:
        """Batches of suffix rows (indices into ``items``).

        Rows are batched by suffix width; but rows of equal width from a short and a long example
        have very different prefixes, and every row carries the batch's deepest prefix (its own
        slots beyond its c masked). So the examples are first split into G groups of similar
        length (G = 1, 2, 3, 4, 6 or 8, whichever plans cheapest by :meth:`_plan_cost`) and each
        group is batched by width on its own.
        """
        widths = [len(ids) - c + len(example.target_ids) for _, (ids, example), c in items]
        depths = [c for _, _, c in items]
        by_example: dict[int, list[int]] = {}
        for r, (_, (_, example), _) in enumerate(items):
            by_example.setdefault(id(example), []).append(r)
        ordered = sorted(by_example.values(), key=lambda members: len(items[members[0]][1][1].input_ids))
        best_plan, best_cost = None, math.inf
        for groups in (1, 2, 3, 4, 6, 8):
            if groups > len(ordered):
                break
            plan: list[list[int]] = []
            # contiguous groups of examples (by length) with about equal numbers of rows
            target = len(items) / groups
            group: list[int] = []
            for members in ordered:
                group.extend(members)
                if len(group) >= target:
                    plan.extend([[group[i] for i in batch] for batch in
                                 self._pack([widths[r] for r in group], [depths[r] for r in group])])
                    group = []
            if group:
                plan.extend([[group[i] for i in batch] for batch in
                             self._pack([widths[r] for r in group], [depths[r] for r in group])])
            cost = self._plan_cost(plan, widths, depths)
            if cost < best_cost:
                best_plan, best_cost = plan, cost
        return best_plan or []

    def _suffix_passes(self, items: list[tuple[tuple, Row, int]], kv: list, slot_of: dict[int, int]) -> None:
        device = self.pm.device
        for members in self._plan_suffixes(items):
            halving([items[r] for r in members], lambda chosen: self._suffix_batch(chosen, kv, slot_of),
                    self.stats, device)

    def _suffix_batch(self, chosen: list[tuple[tuple, Row, int]], kv: list, slot_of: dict[int, int]) -> None:
        """One batch of suffix rows over their examples' cached prefixes (see :meth:`_evaluate_prefix_reuse`)."""
        from transformers import DynamicCache

        device = self.pm.device
        shared = torch.tensor([c for _, _, c in chosen], device=device)  # [rows]
        depth = int(shared.max())  # P: cache slots every row of the batch gets
        slots = torch.tensor([slot_of[id(example)] for _, (_, example), _ in chosen], device=device)
        # per layer [rows, kv_heads, P, head_dim]; a row's slots >= its c hold later tokens of
        # its original and are masked out below
        layers = [(k[:, :, :depth].index_select(0, slots), v[:, :, :depth].index_select(0, slots)) for k, v in kv]
        cache = DynamicCache(ddp_cache_data=layers, config=self.pm.model.config) if depth else None
        batch = build_rows(self.pm, [(list(ids[c:]), example) for _, (ids, example), c in chosen])
        m, width = batch.inputs["input_ids"].shape  # [rows, suffix width]
        steps = torch.arange(width, device=device)
        prefix_mask = (torch.arange(depth, device=device)[None, :] < shared[:, None])  # [rows, P]
        attention_mask = torch.cat([prefix_mask.to(batch.inputs["attention_mask"].dtype),
                                    batch.inputs["attention_mask"]], dim=1)  # [rows, P + width]
        # real suffix tokens sit at c + i; padding slots get position c (any valid position: masked)
        position_ids = torch.where(batch.inputs["attention_mask"].bool(), shared[:, None] + steps[None, :],
                                   shared[:, None])  # [rows, width]
        kwargs = {"input_ids": batch.inputs["input_ids"], "attention_mask": attention_mask,
                  "position_ids": position_ids, "cache": cache, "use_cache": cache is not None}
        batch = self._trim(batch, kwargs)
        started = time.perf_counter()
        with eval_no_grad(self.pm.model):
            logits = self.pm.model(**kwargs).logits
        self._count(started, m * width)
        self.stats.prefix_rows += m
        values = target_values(self.pm, batch, logits).float().cpu()  # [rows]
        self._store([(key, row) for key, row, _ in chosen], values, None)
