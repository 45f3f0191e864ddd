"""Attention edge knockout: block the edges from query rows to one key, and measure the target.

An *edge* is one entry ``(layer, head, query, key)`` of the attention map. Knocking out the edges
to key ``k`` removes what the chosen query rows read from ``k`` directly in the chosen heads of the
chosen layers, and nothing else (the key's own residual stream, and every other edge, run as
usual). The effect of key ``k`` is

    score[k] = f(x) - f(x with the edges to k blocked)

with ``f`` the target every reference explains (:func:`probe.rows.values.target_values`: a class
probability / logit / log-prob, a continuation's log-prob, ...). Positive: reading ``k`` through
these edges supports the target.

Which query rows (``query``):

``target``  the rows that read the target (:func:`probe.rows.queries.target_queries`): [CLS] of a
            classifier, the last prompt token (or the step's position) of a causal LM, the
            predicting decoder rows of a seq2seq model's cross-attention. Geva et al. 2023
            ("Dissecting recall"): the last position is blocked from attending to a token.
``from``    every query row from a position on (``query_from``): None = the key's own position + 1
            (every later token loses its direct read of the key: the key's information then
            reaches the target only through positions that read it before the window, or not at
            all), an int >= 0 = that position, a negative int = counted from each row's explained
            length (-1: the last explained token). Continuation rows of a causal LM lie after it
            and are blocked too.

Which edges (``layers``, ``heads``): a window of layers of the target stack (None = every layer;
an int = one layer; negatives count from the last) and query heads (None = every head; under
GQA a query head is blocked alone, the other query heads reading the same key/value head are not).

Two scores come out of one call, both batched:

* per token ``[tokens]``: the key blocked in every chosen head of every layer of the window at once;
* per (layer, head, token) ``[layer, head, tokens]`` (the layout of per-head methods: every layer
  and head of the stack, NaN outside the window and the chosen heads): the key blocked in that one
  head of that one layer. Knockouts do not add up (the target is not linear in the weights), so the
  per-head scores need not sum to the per-token one; with a window of one layer and one head the
  two are the same row, and are then equal exactly.

Renormalisation (``renormalise``), an experimental factor to report:

``True``   the blocked weight is removed and the row renormalised over its remaining keys: what a
           score of -inf before the softmax gives (``w_i / (1 - w_k)``; with an attention sink the
           sink's mass stays in the denominator, exactly as its logit stays in the softmax). A row
           whose only allowed key is blocked reads nothing (all weights 0), never NaN.
``False``  the blocked weight is set to 0 and the row keeps its other weights: the row then sums to
           ``1 - w_k`` (the head's output shrinks with it).

How: every pass runs under :func:`probe.hooks.capture.capture_attention` with one editor per layer
of the window, i.e. the same attention-edit mechanism as counterfactual attention and head
ablation, on every read path that can edit (the attention-function path under eager, sdpa and
flash, with GQA, sliding windows, sinks and position biases; the probability-module and softmax
paths of inline attention). A read path that cannot edit (banded, block-sparse, local-global and
implicit mixers) is refused in one line before any pass. The unedited target ``f(x)`` is computed
in the same batches through the same recomputed attention (an identity edit), so a score holds the
edit's effect and not the drift between the model's own kernel and the recomputation.

Batched: each example becomes one row per (key, blocked edge set) plus its original; rows are
packed ``batch_size`` at a time, each batch row blocking its own key in its own heads. De-duplicated:
identical rows (the per-token row and the per-head row of a one-layer, one-head window) run once,
and a row whose blocked edges the causal mask already closes (every chosen query row before the
key) is a no-op whose score is exactly 0: it runs no pass. Within a row, a query row whose blocked
weight is already 0 is left untouched, so masked edges (a sliding window's, padding's) never move a
row by rounding either. Prefix-reused in a causal LM (``reuse_prefix``, on by default): no row edits a
query before its example's first blocked query row, so those positions are the same in every row of
the example; they run once as a cache (through the same recomputed attention) and each row feeds
only the tokens from there on: one token per row for the target query of a one-token target,
about T times less work than the whole row (where the model's cache is plain and its attention
eager or sdpa, :func:`probe.intervene.prefix.model_supports_reuse`; otherwise every row runs whole).

Special tokens ([CLS], [SEP], <s>) are not scored by default (NaN, as leave-one-out's);
``keep_special=True`` scores them too (blocking the edges to a sink token is a meaningful knockout).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from probe.errors import InputError
from probe.hooks.types import python_layer
from probe.intervene.knockout_edits import blocked_query_rows, key_set_editor, knockout_editor
from probe.intervene.knockout_passes import edited_targets, evaluate, fed_width, reuses_prefix, suffix_targets
from probe.registry.params import KnockoutParams, check_params
from probe.rows.forward import build_rows
from probe.rows.queries import target_queries
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

if TYPE_CHECKING:
    from probe.models.core import ProbeModel, StackContract

METHOD = "edge_knockout"

#: one batch row: (example index, key position or -1 for the original, frozenset of (layer, head) blocked)
_Row = tuple[int, int, frozenset]


@dataclass(repr=False)
class KnockoutResult:
    """Edge-knockout scores of a list of examples (see the module docstring).

    ``tokens``: per example ``[tokens]``, the key blocked in every chosen head of the window.
    ``per_head``: per example ``[layer, head, tokens]`` over the stack's every layer and head, NaN
    outside the window and the chosen heads (None when not asked for).
    ``original_value``: ``[example]`` the target unedited (through the same recomputed attention)."""

    tokens: TokenScores
    per_head: TokenScores | None
    original_value: torch.Tensor
    stats: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        p = self.tokens.params
        return (f"<KnockoutResult {p['stack']} layers {list(p['layers'])} heads {list(p['heads'])}, "
                f"query={p['query']}, renormalise={p['renormalise']}: {len(self.tokens.scores)} examples, "
                f"{self.stats.get('rows_run', 0)} rows run in {self.stats.get('forward_passes', 0)} passes>")


# ---------------------------------------------------------------------------
# checking the options
# ---------------------------------------------------------------------------


def _window(info: StackContract, layers) -> tuple[int, ...]:
    return _layer_window(layers, info.n_layers, info.stack)


def _layer_window(layers, n_layers: int, stack: str) -> tuple[int, ...]:
    if layers is None:
        chosen = list(range(n_layers))
    elif isinstance(layers, (list, tuple, range)):
        chosen = list(layers)
    else:
        chosen = [layers]
    out = []
    for layer in chosen:
        index = python_layer(layer, n_layers)
        if index is None:
            raise InputError(f"layer {layer!r} does not exist in the {stack}: it has layers "
                             f"0..{n_layers - 1} (-1 is the last)")
        out.append(index)
    if not out:
        raise InputError("edge knockout needs at least one layer: give layers=None (all), an int or a list")
    return tuple(sorted(set(out)))


def _heads(info: StackContract, heads) -> tuple[int, ...]:
    return _head_set(heads, info.n_heads, info.stack)


def _head_set(heads, n_heads: int, stack: str) -> tuple[int, ...]:
    chosen = list(range(n_heads)) if heads is None else list(heads) if isinstance(heads, (list, tuple, range)) \
        else [heads]
    for head in chosen:
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < n_heads:
            raise InputError(f"head {head!r} does not exist in the {stack}: it has query heads "
                             f"0..{n_heads - 1} (or None = all)")
    if not chosen:
        raise InputError("edge knockout needs at least one head: give heads=None (all), an int or a list")
    return tuple(sorted(set(chosen)))


def _refuse_uneditable(pm: ProbeModel, stack: str, info: StackContract, window: tuple[int, ...]) -> None:
    """One line where a layer of the window is read by a path that cannot hand edited weights back."""
    if not info.can_edit:
        raise InputError(f"edge knockout edits attention weights, and probe reads the {stack} of "
                         f"{pm.contract.model_type} through the {info.capture_path} path, which cannot edit")
    for layer in window:
        if info.layer_implicit(layer):
            raise InputError(f"edge knockout cannot block edges in {stack} layer {layer}: its map is the implicit "
                             f"matrix of a {info.mixer_class or info.module_class} (signed, not a softmax), "
                             "which probe reads but cannot edit")


def _query_from(query: str, query_from) -> int | None:
    check_params(KnockoutParams, "knockout", query=query)
    if query == "target":
        if query_from is not None:
            raise InputError(f"query_from={query_from!r} applies to query='from' only; query='target' blocks the "
                             "target rows")
        return None
    if query_from is not None and (isinstance(query_from, bool) or not isinstance(query_from, int)):
        raise InputError(f"query_from={query_from!r}: give a position (int, negative = from the end of the "
                         "explained tokens) or None (the key's own position + 1)")
    return query_from


# ---------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------


def _scored_keys(example: PreparedExample, keep_special: bool) -> list[int]:
    return [t for t, special in enumerate(example.special) if keep_special or not special]


def _query_rows(pm: ProbeModel, example: PreparedExample, query: str) -> list[int]:
    """Positions of the target query rows of one example (no forward: build_rows only lays out tensors)."""
    if query != "target":
        return []
    tq = target_queries(pm, build_rows(pm, [(example.input_ids, example)], device="cpu"))
    return [int(r) for r, v in zip(tq.rows[0].tolist(), tq.valid[0].tolist()) if v]


def _row_width(pm: ProbeModel, example: PreparedExample, stack: str) -> int:
    """How many query rows the target stack has for this example (a causal LM's fed continuation
    included; the decoder's for cross-attention)."""
    if stack == "cross" or (pm.task.encoder_decoder and stack == "decoder"):
        return max(1, len(example.target_ids))
    extra = max(0, len(example.target_ids) - 1) if pm.task.next_token else 0
    return len(example.input_ids) + extra


def _first_row(example: PreparedExample, key: int, query_from: int | None) -> int:
    """query='from': the first blocked query row for ``key``."""
    if query_from is None:
        return key + 1
    if query_from < 0:
        return max(0, len(example.input_ids) + query_from)
    return query_from


def _is_noop(pm: ProbeModel, stack: str, example: PreparedExample, key: int, query: str, query_from: int | None,
             target_rows: list[int]) -> bool:
    """Whether every blocked edge of ``key`` is closed before any edit: no chosen query row exists, or
    (a causal stack) every chosen query row lies before the key."""
    causal = pm.contract.stacks[stack].mask_kind.startswith(("causal", "sliding"))
    width = _row_width(pm, example, stack)
    if query == "target":
        rows = target_rows
    else:  # rows first .. width - 1; a causal stack's rows before the key never read it
        first = _first_row(example, key, query_from)
        rows = [max(first, key) if causal else first]
    rows = [r for r in rows if r < width]
    return not rows or (causal and max(rows) < key)


def _plan(pm: ProbeModel, stack: str, examples: Sequence[PreparedExample], window, heads, query, query_from,
          per_head: bool, keep_special: bool, units: Sequence[Collection[tuple[int, int]]] | None = None):
    """The unique rows to run, and for every score where its row is (None: a no-op, exactly 0); with
    ``units``, example i's per-head rows only for the pairs in ``units[i]``.

    Returns (rows, token_at, head_at): ``token_at[i][t]`` and ``head_at[i][(layer, head, t)]`` map
    to a row index or None; ``rows[originals[i]]`` is example i's unedited row."""
    rows: list[_Row] = []
    index: dict[_Row, int] = {}

    def add(row: _Row) -> int:
        if row not in index:
            index[row] = len(rows)
            rows.append(row)
        return index[row]

    originals, token_at, head_at = [], [], []
    everything = frozenset((layer, head) for layer in window for head in heads)
    for i, example in enumerate(examples):
        originals.append(add((i, -1, frozenset())))
        target_rows = _query_rows(pm, example, query)
        tokens, singles = {}, {}
        pairs = [(layer, head) for layer in window for head in heads
                 if units is None or (layer, head) in units[i]] if per_head else []
        for t in _scored_keys(example, keep_special):
            noop = _is_noop(pm, stack, example, t, query, query_from, target_rows)
            tokens[t] = None if noop else add((i, t, everything))
            for layer, head in pairs:
                singles[(layer, head, t)] = None if noop else add((i, t, frozenset({(layer, head)})))
        token_at.append(tokens)
        head_at.append(singles)
    return rows, originals, token_at, head_at


# ---------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------


def _run_batch(pm: ProbeModel, stack: str, examples, rows: Sequence[_Row], window, query, query_from,
               renormalise: bool, start: int = 0, prefix: list | None = None) -> torch.Tensor:
    """[rows] target values of one batch of rows, every window layer under its editor (``start`` > 0:
    rows of one example fed from ``start`` on, reading ``prefix``, :func:`suffix_targets`)."""
    info = pm.contract.stacks[stack]
    batch = build_rows(pm, [(examples[i].input_ids, examples[i]) for i, _, _ in rows])
    tq = target_queries(pm, batch)
    device = pm.device
    keys = torch.tensor([k for _, k, _ in rows], dtype=torch.long, device=device)  # [rows]
    width = max(batch.inputs["input_ids"].shape[1],
                batch.inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in batch.inputs else 0)
    rows_on = blocked_query_rows(batch, tq, keys, query, query_from, width)[:, start:]  # [rows, fed width]
    editors = {}
    for layer in window:
        heads_on = torch.zeros((len(rows), info.n_heads), dtype=torch.bool)  # [rows, head]
        for r, (_, _, blocked) in enumerate(rows):
            for (blocked_layer, head) in blocked:
                if blocked_layer == layer:
                    heads_on[r, head] = True
        editors[(stack, layer)] = knockout_editor(keys, heads_on.to(device), rows_on, renormalise=renormalise,
                                                   sinks=info.sinks)
    if start:
        return suffix_targets(pm, batch, stack, editors, start, prefix)
    return edited_targets(pm, batch, stack, editors)


def _reuse_starts(pm: ProbeModel, stack: str, examples, rows: Sequence[tuple[int, int, frozenset | None]],
                  query: str, query_from, reuse_prefix: bool) -> list[int] | None:
    """Per example, the first query position any of its rows edits (every earlier position is the
    same in all of them), or None where the rows are run whole."""
    if not reuse_prefix or not reuses_prefix(pm, stack):
        return None
    starts = [fed_width(pm, e) - 1 for e in examples]  # at least the last fed token is fed
    targets = [_query_rows(pm, e, query) for e in examples] if query == "target" else None
    for i, key, _ in rows:
        if key < 0:
            continue
        first = min(targets[i], default=0) if query == "target" else _first_row(examples[i], key, query_from)
        starts[i] = min(starts[i], first)
    return [max(0, s) for s in starts]


def edge_knockout(pm: ProbeModel, examples: Sequence[PreparedExample], *, layers: int | Sequence[int] | None = None,
                  heads: int | Sequence[int] | None = None, query: str = "target", query_from: int | None = None,
                  renormalise: bool = True, per_head: bool = True, keep_special: bool = False,
                  batch_size: int = 32, reuse_prefix: bool = True,
                  units: Sequence[Collection[tuple[int, int]]] | None = None) -> KnockoutResult:
    """Edge-knockout scores of every scored token of every example (see the module docstring).

    ``layers``: the window (None = every layer of the target stack); ``heads``: query heads (None =
    all); ``query``: ``"target"`` (the target rows) or ``"from"`` (every query row from ``query_from``
    on; None = after the key); ``renormalise``: remaining weights renormalised (= -inf before the
    softmax) or not (the blocked weight zeroed); ``per_head``: also the ``[layer, head, tokens]``
    scores; ``batch_size``: model rows per pass; ``reuse_prefix``: in a causal LM, run each example's
    tokens before its first edited query row once and feed every row from there on (the same values;
    False: every row whole, as for any other model). ``units``: per example, the ``(layer, head)`` pairs
    of the window whose per-head rows run (the others' per-head scores NaN; None: every pair), as the
    per-head causal test's screen picks them (:mod:`probe.study.head_screen`).
    """
    if not examples:
        raise InputError("no examples to knock out: give at least one prepared example")
    if units is not None and len(units) != len(examples):
        raise InputError(f"units: {len(units)} lists of (layer, head) pairs for {len(examples)} examples; give one "
                         "per example")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(renormalise, bool):
        raise InputError(f"renormalise={renormalise!r}: give True (renormalise the row, = -inf before the softmax) "
                         "or False (zero the blocked weight only)")
    query_from = _query_from(query, query_from)
    stack = pm.task.target_stack(pm.contract)
    info = pm.contract.stacks[stack]
    window = _window(info, layers)
    chosen_heads = _heads(info, heads)
    _refuse_uneditable(pm, stack, info, window)
    examples = list(examples)
    rows, originals, token_at, head_at = _plan(pm, stack, examples, window, chosen_heads, query, query_from,
                                               per_head, keep_special, units)

    starts = _reuse_starts(pm, stack, examples, rows, query, query_from, reuse_prefix)
    values, passes = evaluate(
        pm, stack, examples, [i for i, _, _ in rows], starts, batch_size, window,
        lambda chunk, start, prefix: _run_batch(pm, stack, examples, [rows[r] for r in chunk], window, query,
                                                query_from, renormalise, start, prefix))

    original = values[originals]  # [example]
    token_scores, head_scores = _scores(examples, values, original, token_at, head_at, info, per_head)
    params = {"stack": stack, "layers": list(window), "heads": list(chosen_heads), "query": query,
              "query_from": query_from, "renormalise": renormalise, "keep_special": keep_special,
              "renormalisation": ("-inf before the softmax: w_i / (1 - w_key)" if renormalise
                                  else "blocked weight set to 0, the row not renormalised"),
              "target_kind": examples[0].kind}
    stats = _stats(pm, examples, rows, token_at, head_at, starts, passes)
    extras = {"original_values": original.tolist(), **stats}
    tokens = TokenScores(method=METHOD, scores=token_scores, params={**params, "scope": "window"}, extras=extras)
    heads_result = (TokenScores(method=METHOD, scores=head_scores, params={**params, "scope": "layer x head"},
                                per_head=True, extras=extras) if per_head else None)
    return KnockoutResult(tokens=tokens, per_head=heads_result, original_value=original.float(), stats=stats)


def _scores(examples: Sequence[PreparedExample], values: torch.Tensor, original: torch.Tensor, token_at: list[dict],
            head_at: list[dict], info: StackContract, per_head: bool) -> tuple[list, list]:
    """Per example the token scores ``[tokens]`` and (with ``per_head``) ``[layer, head, tokens]``:
    f(x) - f(x with the edges blocked) from the rows' ``values`` (0 for a no-op row, NaN where nothing
    was asked)."""
    token_scores, head_scores = [], []
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        scores = torch.full((n,), float("nan"), dtype=torch.float64)
        for t, r in token_at[i].items():
            scores[t] = 0.0 if r is None else original[i] - values[r]
        token_scores.append(scores)
        if per_head:
            grid = torch.full((info.n_layers, info.n_heads, n), float("nan"), dtype=torch.float64)
            for (layer, head, t), r in head_at[i].items():
                grid[layer, head, t] = 0.0 if r is None else original[i] - values[r]
            head_scores.append(grid)
    return token_scores, head_scores


def _stats(pm: ProbeModel, examples: Sequence[PreparedExample], rows: Sequence[_Row], token_at: list[dict],
           head_at: list[dict], starts: list[int] | None, passes: int) -> dict:
    """What the call ran: rows asked for and run, forward passes, tokens fed, prefix reuse, no-ops."""
    n_requested = sum(len(t) for t in token_at) + sum(len(h) for h in head_at)
    fed = sum(fed_width(pm, examples[i]) - (starts[i] if starts else 0) for i, _, _ in rows)
    return {"rows_requested": n_requested + len(examples), "rows_run": len(rows), "forward_passes": passes,
            "tokens_fed": fed, "prefix_reuse": starts is not None,
            "noops": sum(r is None for t in token_at for r in t.values())
            + sum(r is None for h in head_at for r in h.values())}


# ---------------------------------------------------------------------------
# a set of edges blocked at once (audits: sink heads, edges to a token or span)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EdgeSet:
    """The edges from an example's target query rows to the keys ``keys`` (positions of its
    explained tokens), in the query heads ``sites`` ``((layer, head), ...)`` of the target stack,
    all blocked in one forward."""

    example: int
    keys: tuple[int, ...]
    sites: tuple[tuple[int, int], ...]


def _run_sets(pm: ProbeModel, stack: str, examples, sets: Sequence[tuple[int, EdgeSet | None]], window,
              renormalise: bool, start: int = 0, prefix: list | None = None) -> torch.Tensor:
    """[rows] target values of one batch of ``(example, edge set)`` rows: each example with its edge
    set blocked (None: unedited), every layer of ``window`` through the same recomputed attention."""
    info = pm.contract.stacks[stack]
    batch = build_rows(pm, [(examples[i].input_ids, examples[i]) for i, _ in sets])
    tq = target_queries(pm, batch)
    device = pm.device
    width = max(batch.inputs["input_ids"].shape[1],
                batch.inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in batch.inputs else 0)
    dummy = torch.zeros(len(sets), dtype=torch.long, device=device)
    rows_on = blocked_query_rows(batch, tq, dummy, "target", None, width)[:, start:]  # [rows, fed width]
    keys_on = torch.zeros((len(sets), batch.inputs["input_ids"].shape[1]), dtype=torch.bool)  # [rows, key]
    heads_on = {layer: torch.zeros((len(sets), info.n_heads), dtype=torch.bool) for layer in window}  # [rows, head]
    for r, (_, s) in enumerate(sets):
        if s is None:
            continue
        keys_on[r, list(s.keys)] = True
        for layer, head in s.sites:
            heads_on[layer][r, head] = True
    editors = {(stack, layer): key_set_editor(keys_on.to(device), heads_on[layer].to(device), rows_on,
                                               renormalise=renormalise, sinks=info.sinks) for layer in window}
    if start:
        return suffix_targets(pm, batch, stack, editors, start, prefix)
    return edited_targets(pm, batch, stack, editors)


def block_edges(pm: ProbeModel, examples: Sequence[PreparedExample], sets: Sequence[EdgeSet], *,
                renormalise: bool = True, batch_size: int = 32, reuse_prefix: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target of each example unedited and with each edge set blocked (every edge of a set at
    once: keys together, heads and layers together), from the target query rows only.

    Returns ``(original [example], blocked [set])`` (float64); an edge set whose keys are all closed
    to the target rows (a causal stack: keys after them) edits nothing. Every layer named is checked
    as :func:`edge_knockout` checks its window (refused in one line
    where its read path cannot edit); the unedited value runs through the same recomputed attention
    as the edited ones; ``reuse_prefix`` as :func:`edge_knockout`'s."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(renormalise, bool):
        raise InputError(f"renormalise={renormalise!r}: give True (renormalise the row, = -inf before the softmax) "
                         "or False (zero the blocked weights only)")
    examples = list(examples)
    for s in sets:  # before any layer is read: an edge set names an example of this batch and where to block
        if isinstance(s.example, bool) or not isinstance(s.example, int) or not 0 <= s.example < len(examples):
            raise InputError(f"edge set of example {s.example!r}: give an example index 0..{len(examples) - 1} of "
                             f"the {len(examples)} examples given")
        if not s.sites:
            raise InputError(f"edge set of example {s.example} names no (layer, head): give at least one, e.g. "
                             "sites=((0, 0),); an edge set without one would block nothing")
    stack = pm.task.target_stack(pm.contract)
    info = pm.contract.stacks[stack]
    window = _window(info, sorted({layer for s in sets for layer, _ in s.sites}) or None)
    _heads(info, sorted({head for s in sets for _, head in s.sites}) or None)
    _refuse_uneditable(pm, stack, info, window)
    for s in sets:
        n = len(examples[s.example].input_ids)
        if not s.keys or not all(0 <= k < n for k in s.keys):
            raise InputError(f"edge set of example {s.example}: keys {list(s.keys)} must be positions 0..{n - 1} of "
                             "its explained tokens (at least one)")
    # (example, set or None): every example once unedited, then each set; one target kind per batch
    rows: list[tuple[int, EdgeSet | None]] = [(i, None) for i in range(len(examples))]
    rows += [(s.example, s) for s in sets]
    starts = _reuse_starts(pm, stack, examples, [(i, 0 if s is not None else -1, None) for i, s in rows], "target",
                           None, reuse_prefix)
    values, _ = evaluate(pm, stack, examples, [i for i, _ in rows], starts, batch_size, window,
                          lambda chunk, start, prefix: _run_sets(pm, stack, examples, [rows[r] for r in chunk], window,
                                                                 renormalise, start, prefix))
    return values[: len(examples)], values[len(examples):]


# ---------------------------------------------------------------------------
# the registered reference ``knockout`` (probe.registry)
# ---------------------------------------------------------------------------

#: the registry's name of the method (``probe explain --methods knockout``, study and claim files)
NAME = "knockout"


def _index_spec(value, what: str):
    """``layers`` / ``heads`` as the registered method takes them (study and claim files give ints
    and strings only): None (all), an int, or a string of ints ``"0,2,5"`` or a range ``"a:b"``
    (Python's slice: ``"-4:"`` the last four layers, ``":2"`` the first two); a sequence of ints
    as edge_knockout takes it. Returns what :func:`edge_knockout` takes (ranges as ``range``)."""
    if value is None or isinstance(value, (int, list, tuple, range)) and not isinstance(value, bool):
        return value
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{what}={value!r}: give None (all), an int, a list of ints, \"0,2\" or a range \"a:b\"")
    text = value.strip()
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            if ":" in stop:
                raise ValueError
            return slice(int(start) if start.strip() else None, int(stop) if stop.strip() else None)
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"{what}={value!r}: give None (all), an int, a list of ints, \"0,2\" or a range "
                         "\"a:b\" (Python's slice, negatives from the end)") from None


def _resolve(spec, count: int):
    """A parsed ``_index_spec`` with its slices over ``count`` items made lists (an empty one is refused later)."""
    return list(range(count))[spec] if isinstance(spec, slice) else spec


def knockout_window(layers: int | str | Sequence[int] | None, heads: int | str | Sequence[int] | None, n_layers: int,
                    n_heads: int, stack: str = "model") -> tuple[list[int], list[int]]:
    """The layers and query heads ``knockout`` blocks, from the forms a study or claim file writes
    (None, an int, a list, ``"0,2"``, ``"a:b"``), in a stack of ``n_layers`` layers and ``n_heads``
    query heads: ``(layers, heads)`` as sorted index lists, or the one-line refusal the run would give.
    Needs only the two counts, so a study's parameters are checked against the model's config before
    it loads (:mod:`probe.study.sizes`)."""
    layer_spec = _resolve(_index_spec(layers, "layers"), n_layers)
    head_spec = _resolve(_index_spec(heads, "heads"), n_heads)
    if isinstance(layer_spec, list) and not layer_spec:
        raise InputError(f"layers={layers!r} selects no layer of the {stack} (layers 0..{n_layers - 1})")
    if isinstance(head_spec, list) and not head_spec:
        raise InputError(f"heads={heads!r} selects no head of the {stack} (query heads 0..{n_heads - 1})")
    return list(_layer_window(layer_spec, n_layers, stack)), list(_head_set(head_spec, n_heads, stack))


def knockout(pm: ProbeModel, examples: Sequence[PreparedExample], *, layers: int | str | None = None,
             heads: int | str | None = None, query: str = "target", query_from: int | None = None,
             renormalise: bool = True, per_head: bool = False, keep_special: bool = False,
             batch_size: int = 32) -> TokenScores:
    """Edge knockout as a registered reference (``knockout``): token scores ``[tokens]`` =
    f(x) - f(x with the edges to the token blocked in every chosen head of the layer window), the
    per-token scores of :func:`edge_knockout` (see the module docstring for every option).

    ``layers`` / ``heads``: None (all), an int, a list, or a string ``"0,2,5"`` / ``"a:b"`` (a slice,
    negatives from the end: ``"-4:"`` = the last four layers), the form a study file can write.
    ``per_head`` (off by default: it costs a row per layer x head x token) adds
    ``extras["per_head"]``: per example ``[layer, head, tokens]`` (every layer and head of the target
    stack, NaN outside the window and the chosen heads), the key blocked in that one head alone.

    ``extras``: ``original_values`` (f(x) through the same recomputed attention, per example),
    ``per_head`` (when asked), ``rows_requested``, ``rows_run``, ``forward_passes`` and ``noops``.
    """
    stack = pm.task.target_stack(pm.contract)
    info = pm.contract.stacks[stack]
    layer_spec, head_spec = knockout_window(layers, heads, info.n_layers, info.n_heads, stack)
    result = edge_knockout(pm, examples, layers=layer_spec, heads=head_spec, query=query, query_from=query_from,
                           renormalise=renormalise, per_head=per_head, keep_special=keep_special,
                           batch_size=batch_size)
    extras = dict(result.tokens.extras)
    if per_head:
        extras["per_head"] = list(result.per_head.scores)  # per example [layer, head, tokens]
    params = {**result.tokens.params, "per_head": per_head}
    return TokenScores(method=NAME, scores=list(result.tokens.scores), params=params, extras=extras)


def knockout_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str = NAME,
                    **params: Any) -> TokenScores:
    """The registry's scorer for ``knockout`` (``scorer(pm, examples, name, **params)``)."""
    if method != NAME:
        raise InputError(f"unknown knockout method {method!r}: use {NAME}")
    return knockout(pm, examples, **params)


__all__ = ["EdgeSet", "KnockoutResult", "NAME", "block_edges", "edge_knockout", "knockout", "knockout_window",
           "knockout_scores"]
