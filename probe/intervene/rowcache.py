"""The engine's memory of evaluated rows, shared by its plain and its prefix-reuse passes.

A row is a tuple of token ids paired with the :class:`~probe.rows.target.PreparedExample` whose
target it evaluates. It is identified by its *content*, ``(ids, kind, label, target ids)`` and, for a
contrastive target, the contrast label or foil ids, never
by ``id()`` (a freed example's id can be reused by a new one), and its value is kept for the
cache's lifetime. :class:`RowCache` holds those values, the counters (:class:`EngineStats`) and
what every pass needs to know about the model; :class:`~probe.intervene.engine.Engine` fills it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from probe.errors import InputError
from probe.rows.forward import forward_accepts, slices_logits_to_keep
from probe.rows.memory import halving
from probe.rows.target import PreparedExample
from probe.rows.values import reduce_positions

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

Row = tuple[tuple[int, ...], PreparedExample]
_Item = TypeVar("_Item")
_Unit = TypeVar("_Unit")

#: Cost of one model call beyond its tokens, in token-equivalents, used only to decide how finely
#: rows of different widths are split into batches. Measured on a shared 2-core CPU with SmolLM2-135M
#: a call cost ~0.4 s beyond ~2 ms per token (small batches stream every weight from memory once per
#: call), i.e. ~200 tokens; GPUs are launch bound (a call is worth about a thousand tokens). These are
#: the packed calls of prefix reuse (:mod:`probe.intervene.prefix`), which also gather each bin's cache.
CALL_OVERHEAD_TOKENS = {"cpu": 256, "cuda": 1024, "mps": 256}
#: The same for a plain call (rows padded side by side, nothing to gather). On one CPU thread, a linear
#: fit of process time over 16-256 rows of 14 tokens gave 9 ms a call beside 0.20 ms a token for
#: MiniLM (22.7M parameters; 44 tokens) and 58 ms beside 1.9 ms for SmolLM2-135M (31 tokens); 64
#: keeps a margin. At 256 the rows of a 10-token sentence were padded to the 14 tokens of three others
#: rather than run in a call of their own, which took 13% longer (Shapley values of 4 MiniLM sentences).
PLAIN_CALL_OVERHEAD_TOKENS = {"cpu": 64, "cuda": 1024, "mps": 256}


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
    oom_splits: int = 0  # batches (or a method's examples, probe.methods) that ran out of memory, halved and retried
    # after running out of memory: the tokens of the largest batch that then ran, which later batches
    # are planned with (RowCache.settle_budget); None where nothing ran out of memory
    token_budget_used: int | None = None
    # per method run on parts of the examples (probe.methods): the most examples of one call that
    # ran after running out of memory, which later calls are cut at; only methods that ran out
    examples_per_call_used: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def target_key(example: PreparedExample) -> tuple:
    """What makes two examples' targets come from the same evaluation (for de-duplication). A
    language model's row is kept as its per-position values (:func:`probe.rows.values.position_values`),
    so the steps of one output (``example.step``) share one evaluation of each row."""
    # a similarity target also depends on its reference text (label_name); a contrast on what it subtracts
    return ((example.kind, example.label, tuple(example.target_ids))
            + ((example.label_name,) if example.kind == "similarity" else ())
            + (("contrast", example.contrast_label, tuple(example.foil_ids)) if example.contrasted else ()))


def row_key(ids: Sequence[int], example: PreparedExample) -> tuple:
    return (tuple(int(i) for i in ids), target_key(example))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RowCache:
    """Cached target values of rows, by content, with the counters of the passes that made them.

    ``token_budget``, ``progress`` and ``call_overhead_tokens`` are the engine's settings (see
    :class:`~probe.intervene.engine.Engine`); the passes that fill the cache read them here.
    """

    def __init__(self, pm: ProbeModel, token_budget: int = 8192, progress: bool = False, *,
                 call_overhead_tokens: int | None = None):
        if int(token_budget) < 1:
            raise InputError(f"token_budget must be a positive number of tokens, got {token_budget!r}")
        self.pm = pm
        self.token_budget = int(token_budget)
        self.progress = progress
        device_type = torch.device(pm.device).type
        given = None if call_overhead_tokens is None else max(0, int(call_overhead_tokens))
        self.call_overhead_tokens = CALL_OVERHEAD_TOKENS.get(device_type, 256) if given is None else given
        self.plain_call_overhead_tokens = (PLAIN_CALL_OVERHEAD_TOKENS.get(device_type, 256) if given is None
                                           else given)
        self.stats = EngineStats()
        # row key -> (target value, predicted class or -1)
        self._cache: dict[tuple, tuple[float, int]] = {}
        self._trim_logits = pm.task.next_token and forward_accepts(pm.model, "logits_to_keep")
        # packed passes keep ragged positions per bin: a boolean logits_to_keep, which transformers'
        # slice_logits_to_keep flattens to the kept positions (a model slicing its own way projects all)
        self._packed_logits = self._trim_logits and slices_logits_to_keep(pm.model)
        self._prefix_reuse_ok: bool | None = None

    def clear(self) -> None:
        """Forget cached values (counters are kept)."""
        self._cache.clear()

    def settle_budget(self, fitted_tokens: int | None) -> bool:
        """After a batch ran out of memory and was halved: plan every later batch with the tokens of
        the largest part that then ran (``fitted_tokens``, :func:`~probe.rows.memory.halving`'s answer;
        None: nothing ran out). The budget is only ever lowered, and recorded in
        ``stats.token_budget_used``. True where it was lowered (the batches not yet run are planned again)."""
        if fitted_tokens is None:
            return False
        lowered = max(1, int(fitted_tokens)) < self.token_budget
        self.token_budget = min(self.token_budget, max(1, int(fitted_tokens)))
        self.stats.token_budget_used = self.token_budget
        return lowered

    def start_from(self, earlier: Mapping[str, Any] | None) -> None:
        """Plan from the start with the sizes an earlier engine settled on after running out of memory
        (``earlier``: its :meth:`EngineStats.as_dict`, e.g. a study's earlier batch): its token budget
        where lower, and its examples per call."""
        if not earlier:
            return
        self.settle_budget(earlier.get("token_budget_used"))
        for method, size in (earlier.get("examples_per_call_used") or {}).items():
            known = self.stats.examples_per_call_used.get(method)
            self.stats.examples_per_call_used[method] = size if known is None else min(known, size)

    def run_planned(self, items: list[_Item], plan: Callable[[list[_Item], int], list[list[_Unit]]],
                    run: Callable[[list[_Unit]], object], size: Callable[[list[_Unit]], int], *,
                    items_of: Callable[[list[_Unit]], list[_Item]], what: str, unit: str | None = None) -> None:
        """Run ``items`` in the batches ``plan(items, token_budget)`` cuts them into (batches of units
        that :func:`~probe.rows.memory.halving` may halve; ``size``: a batch's tokens in the budget's
        measure), with a progress bar over them where the engine shows one and ``unit`` names them.
        A batch that runs out of memory is halved and continued where it stopped; the budget then
        settles on what fitted (:meth:`settle_budget`) and the items of the batches not yet run
        (``items_of``) are planned again at it, so they do not each run out of memory first."""
        batches = plan(items, self.token_budget)
        bar = None
        if self.progress and unit is not None:
            from probe.progress import progress_bar

            bar = progress_bar(total=len(batches), desc=f"engine ({unit})", unit="batch")
        try:
            while batches:
                batch = batches.pop(0)
                if self.settle_budget(halving(batch, run, self.stats, self.pm.device, what, size)) and batches:
                    batches = plan([item for rest in batches for item in items_of(rest)], self.token_budget)
                    if bar is not None:
                        bar.total = bar.n + 1 + len(batches)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def _lookup(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.empty(len(rows), dtype=torch.float32)  # [rows]
        labels = torch.empty(len(rows), dtype=torch.long)  # [rows]
        for r, (ids, example) in enumerate(rows):
            if not ids:
                values[r], labels[r] = float("nan"), -1
                continue
            value, labels[r] = self._cache[row_key(ids, example)]
            values[r] = value if not isinstance(value, torch.Tensor) else reduce_positions(value[None], [example])[0]
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
        """``values``: ``[rows]`` target values, or a language model's ``[rows, n_target]`` per-position
        values (kept as they are, so every step of the output is read from them)."""
        for j, (key, (_, example)) in enumerate(keyed):
            value = (values[j, : len(example.target_ids)].clone() if values.dim() == 2 else float(values[j]))
            self._cache[key] = (value, int(labels[j]) if labels is not None else -1)
        self.stats.rows_evaluated += len(keyed)

    def _count(self, started: float, padded_tokens: int) -> None:
        self.stats.seconds += time.perf_counter() - started
        self.stats.forward_passes += 1
        self.stats.padded_tokens += int(padded_tokens)
