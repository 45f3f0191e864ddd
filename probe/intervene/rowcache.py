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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.rows.forward import forward_accepts, slices_logits_to_keep
from probe.rows.target import PreparedExample
from probe.rows.values import reduce_positions

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

Row = tuple[tuple[int, ...], PreparedExample]

#: Cost of one model call beyond its tokens, in token-equivalents, used only to decide how finely
#: rows of different widths are split into batches. Measured on a shared 2-core CPU with SmolLM2-135M
#: a call cost ~0.4 s beyond ~2 ms per token (small batches stream every weight from memory once per
#: call), i.e. ~200 tokens; GPUs are launch bound (a call is worth about a thousand tokens).
CALL_OVERHEAD_TOKENS = {"cpu": 256, "cuda": 1024, "mps": 256}


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
        self.call_overhead_tokens = (CALL_OVERHEAD_TOKENS.get(device_type, 256) if call_overhead_tokens is None
                                     else max(0, int(call_overhead_tokens)))
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

    def _iterate(self, plans, unit: str):
        if not self.progress:
            return plans
        from probe.progress import progress_bar

        return progress_bar(plans, desc=f"engine ({unit})", unit="batch")
