"""The batched execution engine every perturbation shares.

A perturbation method (leave-one-out, erasure curves, ...) only *describes* rows: a tuple of token
ids paired with the :class:`~probe.rows.target.PreparedExample` whose target it evaluates. The
engine turns many such rows, from many examples and methods, into as few forward passes as the
token budget allows, and evaluates each row's target with the one shared code path
(:func:`~probe.rows.forward.build_rows` + :func:`~probe.rows.values.target_values`), so every
method explains exactly the same number.

What it does, and why:

* **Packing.** Rows are sorted by padded length and cut into batches whose padded size
  ``rows x width`` (the causal LM continuation and the seq2seq decoder included) stays under
  ``token_budget``. Sorting keeps padding small; the budget bounds memory whatever the mix.
* **De-duplication.** A row is identified by its content: ``(ids, kind, label, target ids)``, and
  a contrast's label or foil ids. Its value is cached for the engine's lifetime, so the unperturbed
  input is run once however many methods ask for it, and identical perturbations (two random draws
  of the same token, a comprehensiveness row equal to a flip row) are run once. The key is content, never ``id()``:
  a freed example's id can be reused by a new one.
* **Prefix reuse (causal LMs).** A perturbed row of a causal LM leaves the tokens before its first
  change untouched, and a causal model's keys/values there do not depend on anything later. A
  pass over the examples' original inputs (``use_cache=True``, which also gives the originals'
  values) therefore holds the prefix cache of *every* length; each perturbed row then feeds only
  its *segment* (from its first change on, plus the continuation) against its own exact prefix
  cut from that cache. Segments of many rows are packed side by side into bins under a 4-D mask,
  so rows of every width and first-change position share a handful of large, nearly unpadded
  passes (see :mod:`probe.intervene.prefix`): every unchanged token is reused, and the
  saving is not drowned in per-call overhead or padding.
* **Running out of memory.** A batch that runs out of memory is halved and continued where it
  stopped (:func:`~probe.rows.memory.halving`); the token budget then settles on the tokens of the
  largest part that ran, and every later batch is planned at it (never raised again in the
  engine's life), so one out-of-memory error is not repeated batch after batch.
* **Provenance.** :attr:`Engine.stats` counts rows asked for, rows run, cache hits, forward passes,
  padded tokens and out-of-memory splits, and records the token budget settled on.

Every pass runs with ``torch.no_grad()`` and the model in eval mode (dropout off; the model's
previous mode is restored afterwards). Padding is always on the right and masked, so a row's value
does not depend on what it is batched with (up to float rounding, ~1e-7 in fp32).

An empty row (every token removed, possible for a model without special tokens) has no defined
target: its value is NaN and no pass is run for it.

Where: the cache, row keys and counters are in :mod:`probe.intervene.rowcache`, the batch plans in
:mod:`probe.intervene.packing`, the prefix-reuse passes in :mod:`probe.intervene.prefix`; this
module holds the :class:`Engine` and re-exports the names callers import from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.intervene.packing import pack_rows
from probe.intervene.prefix import evaluate_prefix_reuse, supports_prefix_reuse

# re-exported: the names callers import from probe.intervene.engine
from probe.intervene.rowcache import Row, RowCache
from probe.rows.forward import build_rows, keep_target_logits
from probe.rows.queries import eval_mode
from probe.rows.target import PreparedExample
from probe.rows.values import position_values, target_values

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


class Engine(RowCache):
    """Evaluate targets on many token rows in budgeted, sorted, de-duplicated batches.

    ``token_budget``: upper bound on ``rows x padded width`` of one forward pass (a single row
    longer than the budget still runs, alone). For prefix reuse the budget counts
    ``rows x (cached prefix slots + suffix width)``, since the cache is copied per row. After a
    batch runs out of memory the budget is lowered to what fitted (:meth:`settle_budget`).
    ``progress``: show a progress bar over batches. ``call_overhead_tokens``: what one model call
    costs beyond its tokens, in token-equivalents, when deciding how finely to split rows of
    different widths into batches (default by device: :data:`PLAIN_CALL_OVERHEAD_TOKENS` for plain
    padded calls, :data:`CALL_OVERHEAD_TOKENS` for the packed calls of prefix reuse; given, both). It
    changes the batching only, never the values.
    """

    def __init__(self, pm: ProbeModel, token_budget: int = 8192, progress: bool = False, *,
                 call_overhead_tokens: int | None = None):
        super().__init__(pm, token_budget, progress, call_overhead_tokens=call_overhead_tokens)

    # ------------------------------------------------------------------ public API

    def values(self, rows: Sequence[tuple[Sequence[int], PreparedExample]], *,
               reuse_prefix: bool = False) -> torch.Tensor:
        """``[len(rows)]`` float32 target value of each row, in the order given.

        ``reuse_prefix=True`` (causal LMs only; ignored otherwise) feeds each perturbed row only from
        its first change on, over its example's cached prefix (:mod:`probe.intervene.prefix`);
        the result is the same within float rounding.
        """
        rows = [(tuple(int(i) for i in ids), example) for ids, example in rows]
        if reuse_prefix and self.pm.task.next_token:
            self._evaluate_prefix_reuse(rows)
        else:
            self._evaluate_missing(rows)
        self.stats.rows_requested += len(rows)
        return self._lookup(rows)[0]

    def predicted_labels(self, rows: Sequence[tuple[Sequence[int], PreparedExample]]) -> torch.Tensor:
        """``[len(rows)]`` long: the classifier's argmax class on each row (-1 for empty rows).

        Shares the cache and the passes of :meth:`values` (the argmax is kept when a row is run).
        """
        if not self.pm.task.labels:
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
        if not self.pm.task.next_token:
            self._evaluate_missing(pairs)
        else:
            self._evaluate_prefix_reuse(pairs)
        self.stats.rows_requested += len(pairs)
        return self._lookup(pairs)[0]

    # ------------------------------------------------------------------ plain batched evaluation

    def _padded_length(self, row: Row) -> int:
        ids, example = row
        return self.pm.task.row_length(len(ids), len(example.target_ids))

    def _evaluate_missing(self, rows: Sequence[Row], count_hits: bool = True) -> None:
        missing = self._missing(rows, count_hits)
        if not missing:
            return
        # target_values reads the target kind from a batch's first example: never mix kinds.
        by_kind: dict[str, list[tuple[tuple, Row]]] = {}
        for item in missing:
            by_kind.setdefault(item[1][1].kind, []).append(item)

        def plan(items: list[tuple[tuple, Row]], budget: int) -> list[list[tuple[tuple, Row]]]:
            widths = [self._padded_length(row) for _, row in items]
            return [[items[i] for i in batch] for batch in pack_rows(widths, budget, self.plain_call_overhead_tokens)]

        def run(keyed: list[tuple[tuple, Row]]) -> None:
            values, labels = self._forward([row for _, row in keyed])
            self._store(keyed, values, labels)

        def tokens(keyed: list[tuple[tuple, Row]]) -> int:  # rows x padded width, the budget's measure
            return len(keyed) * max(self._padded_length(row) for _, row in keyed)

        for items in by_kind.values():
            self.run_planned(items, plan, run, tokens, items_of=list, what="rows", unit="rows")

    def _forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model call on ``rows``: ``([rows] values, [rows] argmax class or None)``."""
        batch = build_rows(self.pm, [(list(ids), example) for ids, example in rows])
        kwargs = dict(batch.inputs)
        if self.pm.task.continuations:  # a decoder's cache is never read again here
            kwargs["use_cache"] = False
        batch = keep_target_logits(self.pm, batch, kwargs)
        started = time.perf_counter()
        with eval_mode(self.pm.model, grad=False):
            logits = self.pm.model(**kwargs).logits
        self._count(started, batch.inputs["input_ids"].numel()
                    + (batch.inputs["decoder_input_ids"].numel() if "decoder_input_ids" in batch.inputs else 0))
        if self.pm.task.continuations:  # every position's value: each step of the output is read from them
            return position_values(self.pm, batch, logits).float().cpu(), None
        values = target_values(self.pm, batch, logits).float().cpu()
        labels = logits.argmax(-1).cpu() if self.pm.task.labels else None
        return values, labels

    # ------------------------------------------------------------------ prefix reuse (causal LMs)

    def _evaluate_prefix_reuse(self, rows: Sequence[Row]) -> None:
        """Causal-LM rows fed from their first change on (:func:`~probe.intervene.prefix.evaluate_prefix_reuse`),
        or recomputed in full where the model's cache or attention cannot take it
        (:func:`~probe.intervene.prefix.supports_prefix_reuse`)."""
        if supports_prefix_reuse(self):
            evaluate_prefix_reuse(self, rows)
        else:
            self._evaluate_missing(rows)
