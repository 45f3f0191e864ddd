"""Attribution patching (AtP): the first-order estimate of every edge knockout and every head ablation,
from one forward and one backward per batch of examples.

Exact edge knockout (:mod:`probe.intervene.knockout`) runs one forward per (layer, head, token) it
scores; exact head ablation (:func:`probe.intervene.heads.head_ablation_effects`) one per head. Both
edits change only attention weights ``alpha`` ``[batch, head, query, key]``, and the target ``f`` is a
smooth function of every layer's weights, so each effect has a first-order estimate (Nanda 2023;
Syed et al. 2023, "edge attribution patching"; Kramar et al. 2024, "AtP*")

    f(x) - f(x')  ~  - sum_{q,j} (alpha'_qj - alpha_qj) * g_qj,      g = d f / d alpha

with ``g`` the total derivative of the target with respect to the weights of one layer (through every
later layer, their attention included) and ``alpha'`` the edited weights. One backward gives ``g`` for
every layer at once: each layer's weights are handed to the model as ``alpha + delta`` with a zero
leaf ``delta`` (an attention editor on every layer), and ``g = d f / d delta``.

Edges (the knockout of key ``k`` from query row ``q`` of head ``(l, h)``, as ``knockout`` blocks it):

``renormalise=False``  alpha'_qk = 0, the other weights kept:  estimate = a g_k
``renormalise=True``   alpha'_qk = 0, the other weights over what they leave, r = 1 - a (the row's
                       remaining mass, a learned sink's included, as the knockout editor counts it):
                       alpha'_qj = alpha_qj / r, so delta alpha_qj = alpha_qj a / r for j != k and

                           estimate = a g_k - (a / r) (S - a g_k) = (a / r) (g_k - S),   S = sum_j alpha_qj g_qj

with ``a = alpha_qk``. A row whose only key is blocked (r = 0) reads nothing after the knockout:
estimate = S = a g_k. An edge whose weight is 0 (masked, or a causal row before the key) is exactly 0,
as the knockout's no-op rows are. Since g_j = grad . v_j at the head's output (o = sum_j alpha_j v_j),
g_k - S = grad . (v_k - o): the estimates are ``m_t c_t`` of the per-head causal test's derivation
(:mod:`probe.study.heads_causal`), m_t = a / (1 - a) or a, c_t = grad . (v_t - o) or grad . v_t.
An edge knockout blocks every chosen query row at once (the target rows, or every row from
``query_from`` on): the estimate is the sum over those rows. Per token, ``knockout`` blocks the key in
every head of the window at once; the first-order estimate of that joint edit is the sum of the
per-head estimates over the window (a linearisation adds), which is the per-token score here.

Heads (ablated as :func:`probe.intervene.heads.ablate_heads` ablates: every weight of the head times
xi = 0, so it adds nothing): the estimate is d f / d xi at xi = 1, Michel et al.'s head-gate gradient
(:func:`probe.intervene.heads.head_importance` with ``loss="target"``, without its absolute value), which
by the chain rule is ``sum_{q,j} alpha_qj g_qj`` over every row of the head: the same backward gives it.

Which of AtP*'s corrections apply (Kramar et al. 2024, section 3):

* The *QK fix* recomputes the attention pattern exactly where the patched node feeds a softmax (a
  node's change to queries or keys moves the pattern, and a saturated softmax is far from linear), and
  linearises only from the pattern on. An edge knockout *is* a pattern edit, known in closed form (the
  renormalised row above): the estimate already starts from the exact edited pattern, so the fix holds
  by construction and nothing is linearised through the edited softmax. A head ablation edits the
  head's output (through its weights, linearly); it does not pass through its own softmax, so the fix
  has nothing to correct. What stays linearised, for both units, is the path from the edit to the
  target through later layers, their softmaxes included: AtP* does not correct that either.
* *GradDrop* (one more backward per layer, with that layer's residual gradient dropped, to expose
  effects that cancel across paths) is not implemented: the estimates here are plain AtP's, and a unit
  whose paths cancel to first order can be a false negative. The benchmark (benchmarks/bench_atp.py)
  measures how many of the exact top-k edges AtP misses.

Where the estimate errs: a saturated target (a class probability near 0 or 1: its gradient is small
where the knockout moves it a lot), a large edit (a weight near 1, renormalised: a / (1 - a) is large),
and later layers that respond non-linearly. It is a screen for which units to run exactly, not a
reference that rests on evidence by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from probe.errors import InputError
from probe.hooks.capture import capture_attention
from probe.hooks.types import EditContext
from probe.intervene.heads import HeadEffects
from probe.intervene.knockout import knockout_window
from probe.intervene.knockout_passes import kind_chunks
from probe.registry.params import AtpParams, check_params
from probe.rows.forward import build_rows, keep_target_logits
from probe.rows.queries import capture_masks, eval_mode, target_queries
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, RowBatch
from probe.rows.values import target_values

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

#: the registry's name of the method (``probe explain --methods atp``, study and claim files)
NAME = "atp"


@dataclass(repr=False)
class AtpResult:
    """AtP estimates of a list of examples (see the module docstring).

    ``tokens``: per example ``[tokens]``, the estimate of ``knockout``'s per-token score (the key
    blocked in every chosen head of the window: the sum of the per-head estimates).
    ``per_head``: per example ``[layer, head, tokens]`` over the stack's every layer and head, NaN
    outside the window and the chosen heads, as ``knockout``'s ``per_head``.
    ``heads``: the head-ablation estimates (:class:`probe.intervene.heads.HeadEffects`, ``change`` =
    the estimate of f(x) - f(x with the head ablated), ``ablated`` = f(x) - that estimate).
    ``original_value``: ``[example]`` the target unedited (through the recomputed attention)."""

    tokens: TokenScores
    per_head: TokenScores
    heads: HeadEffects
    original_value: torch.Tensor
    stats: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        p = self.tokens.params
        return (f"<AtpResult {p['stack']} layers {list(p['layers'])} heads {list(p['heads'])}, query={p['query']}, "
                f"renormalise={p['renormalise']}: {len(self.tokens.scores)} examples in "
                f"{self.stats.get('backward_passes', 0)} forward + backward passes>")


# ---------------------------------------------------------------------------
# the one forward and backward
# ---------------------------------------------------------------------------


def pattern_gradients(pm: ProbeModel, batch: RowBatch, stack: str
                      ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One forward and one backward of ``batch``: ``(values [rows], weights, grads)`` with, per layer
    of ``stack``, its attention weights and the target's total derivative with respect to them, both
    ``[rows, head, query, key]`` fp32 (detached). Each row's gradient is its own target's (rows are
    independent, so the gradient of the summed targets splits by row)."""
    n_layers = pm.contract.stacks[stack].n_layers
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hold(weights: torch.Tensor, context: EditContext) -> torch.Tensor:
        # a zero leaf added to the weights: d f / d delta is d f / d alpha through every later layer,
        # whether or not the parameters require gradients
        delta = torch.zeros_like(weights, requires_grad=True)
        held[context.layer] = (weights.detach(), delta)
        return weights + delta

    kwargs = dict(batch.inputs)
    if pm.task.continuations:
        kwargs["use_cache"] = False
    batch = keep_target_logits(pm, batch, kwargs)
    editors = {(stack, layer): hold for layer in range(n_layers)}
    with eval_mode(pm.model, grad=True, inputs_only=True), capture_attention(
            pm, editors=editors, stacks=[stack], layers={stack: ()}, **capture_masks(batch)):
        values = target_values(pm, batch, pm.model(**kwargs).logits)  # [rows]
        missing = [layer for layer in range(n_layers) if layer not in held]
        if missing:
            raise InputError(f"atp differentiates every layer's attention weights, and the {stack} layers "
                             f"{missing} were never edited in the forward")
        deltas = [held[layer][1] for layer in range(n_layers)]
        grads = torch.autograd.grad(values.sum(), deltas, allow_unused=True)
    weights = [held[layer][0] for layer in range(n_layers)]
    grads = [torch.zeros_like(w) if g is None else g.detach() for w, g in zip(weights, grads, strict=True)]
    return values.detach().float(), weights, list(grads)


def edge_estimates(weights: torch.Tensor, grads: torch.Tensor, blocked: torch.Tensor, *, renormalise: bool,
                   sinks: bool) -> torch.Tensor:
    """``[rows, head, key]`` first-order estimates of f(x) - f(x with the edges to each key blocked),
    one head at a time, summed over the blocked query rows.

    weights, grads  [rows, head, query, key] alpha and d f / d alpha of one layer
    blocked         [rows, query, key] bool: the query rows blocked when key k is knocked out
    """
    w, g = weights.double(), grads.double()
    own = w * g  # [rows, head, query, key] a g_k
    if renormalise:
        row_sum = w.sum(dim=-1, keepdim=True)  # [rows, head, query, 1]
        remaining = row_sum - w  # the row's other keys
        if sinks:  # a learned sink's mass stays in the denominator, as the knockout editor keeps it
            remaining = remaining + (1.0 - row_sum).clamp(min=0.0)
        total = own.sum(dim=-1, keepdim=True)  # [rows, head, query, 1] S = sum_j alpha_j g_j
        factor = torch.where(remaining > 0, w / remaining.clamp(min=torch.finfo(w.dtype).tiny),
                             torch.zeros_like(w))  # a / r; r = 0: the row reads nothing, estimate a g_k
        estimate = own - factor * (total - own)
    else:
        estimate = own
    estimate = torch.where(w > 0, estimate, torch.zeros_like(estimate))  # weight 0: a no-op, exactly 0
    rows_on = blocked[:, None, : w.shape[2], : w.shape[3]].to(estimate.dtype)  # [rows, 1, query, key]
    return (estimate * rows_on).sum(dim=2)


def head_estimates(weights: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``[rows, head]`` first-order estimate of f(x) - f(x with the head ablated): the head-gate
    gradient d f / d xi = sum over every query row and key of alpha g."""
    return (weights.double() * grads.double()).sum(dim=(-1, -2))


def blocked_rows(batch: RowBatch, tq: Any, query: str, query_from: int | None, shape: tuple[int, int]
                 ) -> torch.Tensor:
    """``[rows, query, key]`` bool over a layer's ``shape`` = (query rows, keys): the query rows
    ``knockout`` blocks when it knocks out each key (:func:`probe.intervene.knockout_edits.blocked_query_rows`,
    for every key at once)."""
    n_query, n_key = shape
    n_rows = batch.inputs["input_ids"].shape[0]
    if query == "target":
        on = torch.zeros((n_rows, n_query), dtype=torch.bool)
        rows, valid = tq.rows.cpu(), tq.valid.cpu()
        index, column = valid.nonzero(as_tuple=True)
        keep = rows[index, column] < n_query
        on[index[keep], rows[index, column][keep]] = True
        return on[:, :, None].expand(n_rows, n_query, n_key)
    queries = torch.arange(n_query)[None, :, None]
    keys = torch.arange(n_key)[None, None, :]
    if query_from is None:
        first = (keys + 1).expand(n_rows, 1, n_key)
    elif query_from < 0:
        first = (batch.input_lengths.cpu() + query_from).clamp(min=0)[:, None, None].expand(n_rows, 1, n_key)
    else:
        first = torch.full((n_rows, 1, n_key), query_from)
    return queries >= first


# ---------------------------------------------------------------------------
# every example
# ---------------------------------------------------------------------------


@dataclass
class _Collected:
    """Per example (in the caller's order): the target, the per-head edge estimates ``[layer, head,
    key]`` (padding keys cut) and the head estimates ``[layer, head]``."""
    values: list[float]
    edges: list[torch.Tensor]
    heads: list[torch.Tensor]
    passes: int = 0


def _collect(pm: ProbeModel, examples: Sequence[PreparedExample], stack: str, query: str, query_from: int | None,
             renormalise: bool, batch_size: int) -> _Collected:
    """The estimates of every example, ``batch_size`` examples of one target kind per pass."""
    info = pm.contract.stacks[stack]
    n = len(examples)
    out = _Collected([0.0] * n, [torch.empty(0)] * n, [torch.empty(0)] * n)
    order = sorted(range(n), key=lambda i: examples[i].kind)
    for chunk in kind_chunks(order, [examples[i].kind for i in order], batch_size):
        batch = build_rows(pm, [(examples[i].input_ids, examples[i]) for i in chunk])
        tq = target_queries(pm, batch)
        values, weights, grads = pattern_gradients(pm, batch, stack)
        out.passes += 1
        edges, heads = [], []
        for w, g in zip(weights, grads, strict=True):
            blocked = blocked_rows(batch, tq, query, query_from, (w.shape[2], w.shape[3])).to(w.device)
            edges.append(edge_estimates(w, g, blocked, renormalise=renormalise, sinks=info.sinks).cpu())
            heads.append(head_estimates(w, g).cpu())
        edge_grid = torch.stack(edges, dim=1)  # [rows, layer, head, key]
        head_grid = torch.stack(heads, dim=1)  # [rows, layer, head]
        for r, i in enumerate(chunk):
            out.values[i] = float(values[r])
            out.edges[i] = edge_grid[r, ..., : len(examples[i].input_ids)]
            out.heads[i] = head_grid[r]
    return out


def _check_options(pm: ProbeModel, stack: str, query: str, query_from: int | None, renormalise: bool,
                   batch_size: int) -> None:
    """One line for an option outside its range, or a stack whose weights cannot be edited."""
    check_params(AtpParams, NAME, query=query, batch_size=batch_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(renormalise, bool):
        raise InputError(f"renormalise={renormalise!r}: give True (the knockout renormalises the row) or False "
                         "(it zeroes the blocked weight only)")
    if query == "target" and query_from is not None:
        raise InputError(f"query_from={query_from!r} applies to query='from' only; query='target' blocks the "
                         "target rows")
    if query_from is not None and (isinstance(query_from, bool) or not isinstance(query_from, int)):
        raise InputError(f"query_from={query_from!r}: give a position (int, negative = from the end of the "
                         "explained tokens) or None (the key's own position + 1)")
    info = pm.contract.stacks[stack]
    if not info.can_edit:
        raise InputError(f"atp differentiates edited attention weights, and probe reads the {stack} of "
                         f"{pm.contract.model_type} through the {info.capture_path} path, which cannot edit")


def attribution_patching(pm: ProbeModel, examples: Sequence[PreparedExample], *,
                         layers: int | str | Sequence[int] | None = None,
                         heads: int | str | Sequence[int] | None = None, query: str = "target",
                         query_from: int | None = None, renormalise: bool = True, keep_special: bool = False,
                         batch_size: int = 8) -> AtpResult:
    """AtP estimates of every edge knockout and head ablation of the target stack (module docstring).

    The options are ``knockout``'s (:func:`probe.intervene.knockout.knockout`): ``layers`` / ``heads``
    the window (None, an int, a list, ``"0,2"``, ``"a:b"``), ``query`` / ``query_from`` the blocked
    query rows, ``renormalise`` the edit, ``keep_special`` whether [CLS]/[SEP]/<s> are scored (NaN
    otherwise). ``batch_size``: examples per forward and backward."""
    if not examples:
        raise InputError("no examples for atp: give at least one prepared example")
    stack = pm.task.target_stack(pm.contract)
    info = pm.contract.stacks[stack]
    _check_options(pm, stack, query, query_from, renormalise, batch_size)
    window, chosen = knockout_window(layers, heads, info.n_layers, info.n_heads, stack)
    examples = list(examples)
    got = _collect(pm, examples, stack, query, query_from, renormalise, batch_size)
    inside = torch.zeros((info.n_layers, info.n_heads), dtype=torch.bool)  # [layer, head] the window
    inside[torch.tensor(window)[:, None], torch.tensor(chosen)[None, :]] = True
    token_scores, head_scores = [], []
    for example, grid in zip(examples, got.edges, strict=True):
        scored = torch.tensor([keep_special or not s for s in example.special], dtype=torch.bool)  # [tokens]
        grid = torch.where(inside[:, :, None] & scored, grid, torch.full_like(grid, float("nan")))
        head_scores.append(grid)  # [layer, head, tokens]
        tokens = grid[inside].sum(dim=0)  # [tokens] the window's sum
        token_scores.append(torch.where(scored, tokens, torch.full_like(tokens, float("nan"))))
    original = torch.tensor(got.values, dtype=torch.float64)
    params = {"stack": stack, "layers": list(window), "heads": list(chosen), "query": query, "query_from": query_from,
              "renormalise": renormalise, "keep_special": keep_special, "target_kind": examples[0].kind,
              "estimate": "first order (AtP): -sum (alpha' - alpha) d f / d alpha, alpha' the knockout's edited "
                          "pattern in closed form",
              "per_token": "sum of the per-head estimates over the window (the joint knockout's first order)"}
    stats = {"backward_passes": got.passes, "rows_run": len(examples)}
    extras = {"original_values": original.tolist(), **stats}
    ablated = original[:, None, None] - torch.stack(got.heads)  # [example, layer, head]
    return AtpResult(
        tokens=TokenScores(method=NAME, scores=token_scores, params={**params, "scope": "window"}, extras=extras),
        per_head=TokenScores(method=NAME, scores=head_scores, params={**params, "scope": "layer x head"},
                             per_head=True, extras=extras),
        heads=HeadEffects(stack=stack, original=original, ablated=ablated,
                          params={"ablation": "first-order estimate (AtP) of zeroing the head's weights: the "
                                              "head-gate gradient", "target_kind": examples[0].kind}),
        original_value=original, stats=stats)


# ---------------------------------------------------------------------------
# the registered method ``atp`` and the head estimates
# ---------------------------------------------------------------------------


def atp(pm: ProbeModel, examples: Sequence[PreparedExample], *, layers: int | str | None = None,
        heads: int | str | None = None, query: str = "target", query_from: int | None = None,
        renormalise: bool = True, per_head: bool = False, keep_special: bool = False,
        batch_size: int = 8) -> TokenScores:
    """AtP as a registered method (``atp``): token scores ``[tokens]`` estimating ``knockout``'s with the
    same options (the sum over the window of the per-head estimates), from one forward and one backward
    per ``batch_size`` examples.

    ``extras``: ``original_values`` (f(x) per example), ``heads`` (per example ``[layer, head]``, the
    estimate of f(x) - f(x with that head ablated), every layer and head of the target stack) and, with
    ``per_head``, ``per_head`` (per example ``[layer, head, tokens]``, NaN outside the window, as
    ``knockout``'s); ``backward_passes``."""
    result = attribution_patching(pm, examples, layers=layers, heads=heads, query=query, query_from=query_from,
                                  renormalise=renormalise, keep_special=keep_special, batch_size=batch_size)
    extras = {**result.tokens.extras, "heads": list(result.heads.change.float())}
    if per_head:
        extras["per_head"] = list(result.per_head.scores)  # per example [layer, head, tokens]
    return TokenScores(method=NAME, scores=list(result.tokens.scores),
                       params={**result.tokens.params, "per_head": per_head}, extras=extras)


def atp_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str = NAME, **params: Any) -> TokenScores:
    """The registry's scorer for ``atp`` (``scorer(pm, examples, name, **params)``)."""
    if method != NAME:
        raise InputError(f"unknown atp method {method!r}: use {NAME}")
    return atp(pm, examples, **params)


def atp_heads(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8) -> HeadEffects:
    """The first-order estimate of :func:`probe.intervene.heads.head_ablation_effects` (every head of the
    target stack ablated alone), from one forward and one backward per ``batch_size`` examples:
    ``change`` [example, layer, head] is the estimate of f(x) - f(x with the head ablated)."""
    return attribution_patching(pm, examples, batch_size=batch_size).heads


__all__ = ["AtpResult", "NAME", "atp", "atp_heads", "atp_scores", "attribution_patching", "blocked_rows",
           "edge_estimates", "head_estimates", "pattern_gradients"]
