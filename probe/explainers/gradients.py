"""Gradient attributions of the target with respect to the input embeddings of the explained tokens.

Where the gradient is taken, the *site* (``params["site"]``, with ``params["space"]`` and the module's
dotted name in ``params["site_module"]``; every method takes ``site=``):
    word        the output of the model's input-embedding matrix (``pm.model.get_input_embeddings()``),
                i.e. word-embedding space *before* position / token-type embeddings, LayerNorm and
                any embedding scale the model applies afterwards.
    embeddings  the output of the model's embeddings module (:func:`embeddings_module`: the module
                that holds the word-embedding matrix and no layer stack, BERT's ``embeddings``),
                i.e. exactly what enters the first layer: after position / token-type embeddings
                and the embedding LayerNorm.
Integrated gradients and GradientSHAP interpolate at the site. The default (``site=None``) is
:func:`default_site`: ``embeddings`` where that module normalises its sum (a norm module inside
it), because the model is then invariant to scaling each token's word + position + type sum, so
input x gradient taken on the word embedding is minus (position + type) . gradient, a ranking set by
position, and the signed gradient sum is zero (PROTOCOLS.md, the LayerNorm lesson); ``word``
elsewhere (GPT-2, Llama, BART, T5: no embeddings module, or one that does not normalise).
PROTOCOLS.md also measured that interpolating after BERT's ``embeddings`` module instead of before
changes IG rankings (Spearman 0.73 at worst), so the site is a recorded experimental factor.

What is attributed:
    classification  the text's tokens (special tokens included: they are scored; the caller uses
                    ``example.special`` to drop them)
    causal_lm       the prompt tokens, i.e. the first ``len(example.input_ids)`` positions of each
                    row; the continuation whose log-prob is the target is part of the sequence but
                    held fixed (same embeddings at the input and at the baseline) and never scored
    seq2seq         the encoder input tokens; decoder inputs are held fixed
Padding is never attributed: the forward function takes padded positions from fixed pad embeddings
(masked by the attention mask), so the gradient there is exactly zero and batch of 1 equals batch of N.

Every method evaluates its target with :func:`probe.rows.values.target_values` on the rows of
:func:`probe.rows.forward.build_rows`, so gradients explain exactly the number interventions change.
captum is used at one boundary, :class:`EmbeddingForward` (house rule 5): it sees a plain function
``f(embeddings [n, tokens, dim], row [n]) -> target [n]`` and its outputs become ``TokenScores`` here.
Gradients are taken in fp32: the attributed embeddings are fp32 and are cast to the model's dtype
only when they enter the model, so a bf16 model still gives fp32 scores (of bf16 precision).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from probe import registry
from probe.errors import InputError
from probe.explainers.gradient_forward import (
    EmbeddingForward,
    common_params,
    embedding_forward,
    grouped_gradients,
    join_buckets,
    per_example,
    width_buckets,
)
from probe.names import GRADIENT_METHODS
from probe.rows.queries import eval_mode
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


# ---------------------------------------------------------------------------
# saliency and input x gradient: one plain gradient
# ---------------------------------------------------------------------------


def _gradients(pm: ProbeModel, examples: Sequence[PreparedExample], *, times_input: bool,
               site: str | None = None) -> tuple[torch.Tensor, EmbeddingForward]:
    """Gradient (captum ``Saliency``, signed) or embedding x gradient (``InputXGradient``) of every
    example in one forward/backward. Returns ``[rows, width, dim]`` fp32 and the forward used."""
    from captum.attr import InputXGradient, Saliency

    problem = embedding_forward(pm, examples, site)
    with eval_mode(pm.model, grad=True, inputs_only=True):
        if problem.groups:  # the output tokens of one text: one forward of their row, a backward per token
            grads = grouped_gradients(problem, problem.embeds, [1.0], [1.0], None)
            return (grads * problem.embeds if times_input else grads).detach().float(), problem
        if times_input:
            attributions = InputXGradient(problem).attribute(problem.embeds.clone().requires_grad_(),
                                                             additional_forward_args=(problem.rows,))
        else:
            attributions = Saliency(problem).attribute(problem.embeds.clone().requires_grad_(), abs=False,
                                                       additional_forward_args=(problem.rows,))
    return attributions.detach().float(), problem


def saliency(pm: ProbeModel, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """L2 norm over the embedding dim of d target / d word embedding (unsigned, >= 0).

    The norm is the common "saliency" of NLP work (Li et al. 2016 style) and inseq's (0.7: captum's
    Saliency reduced by its default ``vnorm`` aggregation, then divided by the sum over the
    attributed tokens of each target); see :func:`saliency_l1` for the L1 norm (captum's tutorials)
    and :func:`saliency_sum` for the signed variant.
    """
    return _from_gradients(pm, "saliency", *_gradients(pm, examples, times_input=False, site=site))


def saliency_l1(pm: ProbeModel, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """L1 norm over the embedding dim of d target / d word embedding (unsigned, >= 0): captum's
    ``Saliency(...).attribute(..., abs=True)`` summed over the embedding axis, the reduction captum's
    tutorials apply (and inseq's 2021 sources, ``sum_normalize(attr, dim_sum=-1)``); inseq 0.7 takes the L2
    norm (its ``vnorm`` aggregation), as :func:`saliency` does."""
    return _from_gradients(pm, "saliency_l1", *_gradients(pm, examples, times_input=False, site=site))


def saliency_sum(pm: ProbeModel, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """Signed sum over the embedding dim of d target / d word embedding."""
    return _from_gradients(pm, "saliency_sum", *_gradients(pm, examples, times_input=False, site=site))


def input_x_gradient(pm: ProbeModel, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """Signed sum over the embedding dim of embedding * gradient.

    Jain & Wallace 2019 use the absolute value of this sum as their gradient reference: take
    ``abs()`` of these scores to reproduce them (kept signed here so no information is lost).
    """
    products, problem = _gradients(pm, examples, times_input=True, site=site)
    return _from_gradients(pm, "input_x_gradient", products, problem, times_input=True)


#: Methods computed from one gradient of the target (a ``reduction`` in their registry entry):
#: :func:`shared_gradient_scores` runs one forward/backward for any set of them.
SHARED_GRADIENT_METHODS = tuple(m.name for m in registry.methods(family="gradient", listed=False)
                                if m.reduction is not None)

#: what each reduction records in the scores' params
REDUCTIONS = {"l2": "l2 norm over embedding dim", "l1": "l1 norm over embedding dim",
              "sum": "signed sum over embedding dim"}

#: each reduction over the embedding axis: ``[rows, width, dim] -> [rows, width]``
_REDUCE = {"l2": lambda v: v.norm(dim=-1), "l1": lambda v: v.abs().sum(dim=-1), "sum": lambda v: v.sum(dim=-1)}


def _from_gradients(pm: ProbeModel, method: str, values: torch.Tensor, problem: EmbeddingForward, *,
                    times_input: bool = False) -> TokenScores:
    """``method``'s TokenScores from ``[rows, width, dim]`` gradients (or, with ``times_input``,
    embedding x gradient products), reduced over the embedding axis as its registry entry says."""
    entry = registry.method(method)
    if entry.times_input and not times_input:
        values = values * problem.embeds
    reduced = _REDUCE[entry.reduction](values)  # [rows, width]
    params = {**common_params(pm, problem), "reduction": REDUCTIONS[entry.reduction], "signed": entry.signed}
    if entry.times_input:
        params["note"] = "Jain & Wallace 2019 take |score|"
    params["label"] = registry.labelled(method, params)
    return TokenScores(method=method, scores=per_example(reduced, problem), params=params)


def shared_gradient_scores(pm: ProbeModel, examples: Sequence[PreparedExample], methods: Sequence[str], *,
                           site: str | None = None) -> dict[str, TokenScores]:
    """Every method of ``methods`` (a subset of :data:`SHARED_GRADIENT_METHODS`) from one
    forward/backward per width bucket: they all read the same d target / d word embedding, so a
    study asking for saliency and input x gradient pays for one gradient, not two."""
    unknown = [m for m in methods if m not in SHARED_GRADIENT_METHODS]
    if unknown:
        raise InputError(f"{unknown[0]!r} is not computed from a plain gradient: share only "
                         f"{', '.join(SHARED_GRADIENT_METHODS)}")
    buckets = width_buckets(pm, examples, points=1)
    parts = []
    for bucket in buckets:
        grads, problem = _gradients(pm, [examples[i] for i in bucket], times_input=False, site=site)
        parts.append({m: _from_gradients(pm, m, grads, problem) for m in methods})
    return {m: join_buckets([part[m] for part in parts], buckets) for m in methods}


# ---------------------------------------------------------------------------
# by name
# ---------------------------------------------------------------------------

#: the registry's by-name entry for the gradient methods (this module's :func:`gradient_scores`)
SCORER = f"{__name__}:gradient_scores"


def gradient_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str, **params: Any) -> TokenScores:
    """Run the gradient explainer called ``method`` with its keyword ``params``, on width buckets
    of the examples (:func:`width_buckets`) so that no pass pads a short example to a long one."""
    entry = registry.find(method)
    if entry is None or entry.scorer != SCORER:
        raise InputError(f"unknown gradient method {method!r}: use one of {', '.join(GRADIENT_METHODS)}")
    explainer = entry.load()
    if entry.points is not None and params.get(entry.points) == "auto":
        return explainer(pm, examples, **params)  # buckets each round of its own
    buckets = width_buckets(pm, examples, points=_points_per_example(method, params))
    if len(buckets) == 1:
        return explainer(pm, examples, **params)
    return join_buckets([explainer(pm, [examples[i] for i in bucket], **params) for bucket in buckets], buckets)


def _points_per_example(method: str, params: dict) -> int:
    """Model inputs one example becomes in a gradient method (interpolation points, draws: the
    parameter its registry entry names as ``points``, plus the input and the baseline)."""
    entry = registry.method(method)
    if entry.points is None:
        return 1
    points = params.get(entry.points, getattr(entry.defaults(), entry.points))
    return (points if isinstance(points, int) else 1) + 2
