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

Every method evaluates its target with :func:`probe.rows.target.target_values` on the rows of
:func:`probe.rows.target.build_rows`, so gradients explain exactly the number interventions change.
captum is used at one boundary, :class:`_EmbeddingForward` (house rule 5): it sees a plain function
``f(embeddings [n, tokens, dim], row [n]) -> target [n]`` and its outputs become ``TokenScores`` here.
Gradients are taken in fp32: the attributed embeddings are fp32 and are cast to the model's dtype
only when they enter the model, so a bf16 model still gives fp32 scores (of bf16 precision).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from probe import registry
from probe.errors import InputError, ProbeError
from probe.names import GRADIENT_METHODS  # noqa: F401  (re-exported: derived from the registry)
from probe.rows.scores import TokenScores
from probe.rows.target import (PreparedExample, RowBatch, build_rows, example_seed, keep_target_logits,
                                  target_values)

BASELINES = ("pad", "zero", "mask", "unk")
AUTO_STEPS = (16, 32, 64, 128, 256, 512)  # Gauss-Legendre points tried by steps="auto", in order
IG_RULES = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")

SITES = ("word", "embeddings")
SPACE = "word_embeddings"  # params["space"] of the word site (the only site before sites were named)
SPACE_NOTE = ("output of get_input_embeddings(): before position/token-type embeddings, LayerNorm "
              "and embedding scaling")
SITE_SPACES = {"word": (SPACE, SPACE_NOTE),
               "embeddings": ("embeddings_output", "output of the model's embeddings module: word + position "
                              "(+ token type) embeddings after its normalisation, what enters the first layer")}


# ---------------------------------------------------------------------------
# the attributed site
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """Where gradients are taken: ``name`` in :data:`SITES`, the module whose output is attributed
    (``None`` for ``word``: the model is then fed ``inputs_embeds``) and its dotted name."""

    name: str
    module_name: str
    module: object = dataclasses.field(compare=False, repr=False, default=None)
    normalising: str | None = None  # class name of the norm inside the embeddings module, if any


def _is_norm(module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in type(module).__name__.lower()


def embeddings_module(model) -> tuple[str, torch.nn.Module] | None:
    """(dotted name, module) of the model's embeddings module, or None when it has none.

    Found from the structure: the parent of ``get_input_embeddings()`` when that parent holds no
    ``ModuleList`` (no layer stack). BERT's ``bert.embeddings`` qualifies; GPT-2's and Llama's word
    embeddings sit directly in the model beside the layers, so they have none.
    """
    word = model.get_input_embeddings()
    word_name = next((name for name, module in model.named_modules() if module is word), None)
    if not word_name or "." not in word_name:
        return None
    parent_name = word_name.rsplit(".", 1)[0]
    parent = model.get_submodule(parent_name)
    if any(isinstance(module, torch.nn.ModuleList) for module in parent.modules()):
        return None
    return parent_name, parent


def _word_name(model) -> str:
    word = model.get_input_embeddings()
    return next((name for name, module in model.named_modules() if module is word), "get_input_embeddings()")


def normalising_module(model) -> str | None:
    """Class name of the norm applied inside the embeddings module (None: no module, or no norm)."""
    found = embeddings_module(model)
    if found is None:
        return None
    return next((type(m).__name__ for m in found[1].modules() if _is_norm(m)), None)


def default_site(pm) -> str:
    """``embeddings`` where the embeddings module normalises (input x gradient and the signed
    gradient sum are degenerate on the word embedding there), else ``word``."""
    return "embeddings" if normalising_module(pm.model) is not None else "word"


def resolve_site(pm, site: str | None = None) -> Site:
    """The :class:`Site` called ``site`` (None or ``auto``: :func:`default_site`) on this model."""
    if site is None or site == "auto":
        site = default_site(pm)
    if site not in SITES:
        raise InputError(f"unknown gradient site {site!r}: use one of {', '.join(SITES)} (or auto)")
    if site == "word":
        return Site("word", _word_name(pm.model), None, normalising_module(pm.model))
    found = embeddings_module(pm.model)
    if found is None:
        raise InputError(f"gradient site 'embeddings' needs an embeddings module: looked for the parent module of "
                         f"the word embeddings ({_word_name(pm.model)}) holding no layer stack, and this model has "
                         f"none: use site word")
    name, module = found
    return Site("embeddings", name, module, normalising_module(pm.model))


class _StopForward(Exception):
    """Raised by a capture hook once the site's output is read, so the rest of the forward is skipped."""


@contextlib.contextmanager
def _hooked(module, hook) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _site_tensor(site: Site, output) -> torch.Tensor:
    """The embeddings module's output tensor: the output itself, or the first item of a tuple whose
    other items are side values (ibert hands on (embeddings, scaling factor))."""
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ProbeError(f"the embeddings module {site.module_name} returned {type(output).__name__}, not a "
                         f"tensor: use gradient site word")
    return output


def _replace_site_output(replaced: torch.Tensor):
    """A forward hook that puts ``replaced`` where the embeddings module's tensor was (in a tuple: its first item)."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (replaced, *output[1:])
        return replaced
    return hook


def site_values(pm, site: Site, inputs: dict) -> torch.Tensor:
    """[rows, seq, dim] fp32 output of ``site`` for the model inputs ``inputs`` (no gradient)."""
    if site.module is None:
        with torch.no_grad():
            return pm.model.get_input_embeddings()(inputs["input_ids"]).float()
    held = {}

    def keep(module, args, output):
        held["output"] = _site_tensor(site, output)
        raise _StopForward

    with torch.no_grad(), _hooked(site.module, keep):
        try:
            pm.model(**inputs)
        except _StopForward:
            pass
    return held["output"].float()


# ---------------------------------------------------------------------------
# the one forward function every gradient method differentiates
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _EmbeddingForward:
    """The target as a function of the explained tokens' word embeddings, for a fixed set of rows.

    ``embeds`` (what captum differentiates) covers only the explained positions ``[rows, width, dim]``
    with ``width = max explained length``; everything else the model sees (causal continuation,
    decoder inputs, padding) comes from ``fixed``. Call with ``(embeds [n, width, dim], row [n])``
    where ``row`` says which prepared row each of the ``n`` inputs is (captum repeats rows along
    its interpolation steps; the row index lets every step find its mask and target).
    """

    pm: object
    batch: RowBatch
    embeds: torch.Tensor  # [rows, width, dim] fp32, zero at padding
    fixed: torch.Tensor  # [rows, seq, dim] fp32: embeddings of the whole model input
    explained: torch.Tensor  # [rows, seq] bool: positions taken from ``embeds``
    rows: torch.Tensor  # [rows] long: 0..rows-1, the ``row`` argument for the unexpanded inputs
    site: Site = Site("word", "get_input_embeddings()")

    @property
    def mask(self) -> torch.Tensor:
        """[rows, width] bool: explained (attributed) positions."""
        return self.explained[:, : self.embeds.shape[1]]

    def __call__(self, embeds: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        seq = self.fixed.shape[1]
        padded = F.pad(embeds, (0, 0, 0, seq - embeds.shape[1]))  # [n, seq, dim]
        full = torch.where(self.explained[row][..., None], padded, self.fixed[row])  # [n, seq, dim]
        inputs = {key: value[row] for key, value in self.batch.inputs.items() if key != "input_ids"}
        if self.site.module is None:
            inputs["inputs_embeds"] = full.to(_model_dtype(self.pm))
        else:  # the model embeds the ids as usual; its embeddings module's output is replaced by ``full``
            inputs["input_ids"] = self.batch.inputs["input_ids"][row]
        selected = keep_target_logits(self.pm, _select_rows(self.batch, row), inputs)
        if self.site.module is None:
            logits = self.pm.model(**inputs).logits
        else:
            replaced = full.to(_model_dtype(self.pm))
            with _hooked(self.site.module, _replace_site_output(replaced)):
                logits = self.pm.model(**inputs).logits
        return target_values(self.pm, selected, logits)  # [n] fp32


def _select_rows(batch: RowBatch, row: torch.Tensor) -> RowBatch:
    picked = row.tolist()

    def take(tensor):
        return None if tensor is None else tensor[row]

    return dataclasses.replace(
        batch,
        inputs={key: value[row] for key, value in batch.inputs.items()},
        examples=[batch.examples[i] for i in picked],
        input_lengths=batch.input_lengths[row],
        target_positions=take(batch.target_positions),
        target_tokens=take(batch.target_tokens),
        target_valid=take(batch.target_valid),
    )


def _model_dtype(pm) -> torch.dtype:
    return next(pm.model.parameters()).dtype


def _embedding_forward(pm, examples: Sequence[PreparedExample], site: str | None = None) -> _EmbeddingForward:
    where = resolve_site(pm, site)
    if not examples:
        raise InputError("no examples to explain: give at least one prepared example")
    batch = build_rows(pm, [(example.input_ids, example) for example in examples])
    input_ids = batch.inputs["input_ids"]  # [rows, seq]
    with _gradient_mode(pm.model):
        fixed = site_values(pm, where, batch.inputs)  # [rows, seq, dim]
    seq = input_ids.shape[1]
    lengths = batch.input_lengths  # [rows]
    explained = torch.arange(seq, device=input_ids.device)[None, :] < lengths[:, None]  # [rows, seq]
    width = int(lengths.max())
    embeds = fixed[:, :width] * explained[:, :width, None]  # [rows, width, dim]
    rows = torch.arange(len(examples), device=input_ids.device)  # [rows]
    return _EmbeddingForward(pm=pm, batch=batch, embeds=embeds, fixed=fixed, explained=explained, rows=rows,
                             site=where)


@contextlib.contextmanager
def _gradient_mode(model) -> Iterator[None]:
    """Eval mode (no dropout: attributions must be deterministic) with autograd on, restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            yield
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------
# turning [rows, width, dim] attributions into TokenScores
# ---------------------------------------------------------------------------


def _per_example(values: torch.Tensor, problem: _EmbeddingForward) -> list[torch.Tensor]:
    """[rows, width] -> one ``[tokens]`` tensor per example; padding is zeroed, then cut off."""
    values = values * problem.mask
    return [values[r, : int(n)] for r, n in enumerate(problem.batch.input_lengths.tolist())]


def _common_params(pm, problem: _EmbeddingForward) -> dict:
    examples = problem.batch.examples
    space, note = SITE_SPACES[problem.site.name]
    return {
        "site": problem.site.name,
        "site_module": problem.site.module_name,
        "site_default": default_site(pm),
        "embedding_norm": problem.site.normalising,
        "space": space,
        "space_note": note,
        "target_kind": examples[0].kind,
        "attributed": {"classification": "input tokens", "causal_lm": "prompt tokens (continuation held fixed)",
                       "seq2seq": "encoder input tokens (decoder inputs held fixed)",
                       "encoder": "input tokens (a similarity target's reference held fixed)"}[pm.task],
        "gradient_dtype": "float32",
        "model_dtype": str(_model_dtype(pm)).replace("torch.", ""),
    }


def _gradients(pm, examples: Sequence[PreparedExample], *, times_input: bool,
               site: str | None = None) -> tuple[torch.Tensor, _EmbeddingForward]:
    """Gradient (captum ``Saliency``, signed) or embedding x gradient (``InputXGradient``) of every
    example in one forward/backward. Returns ``[rows, width, dim]`` fp32 and the forward used."""
    from captum.attr import InputXGradient, Saliency

    problem = _embedding_forward(pm, examples, site)
    with _gradient_mode(pm.model):
        if times_input:
            attributions = InputXGradient(problem).attribute(problem.embeds.clone().requires_grad_(),
                                                             additional_forward_args=(problem.rows,))
        else:
            attributions = Saliency(problem).attribute(problem.embeds.clone().requires_grad_(), abs=False,
                                                       additional_forward_args=(problem.rows,))
    return attributions.detach().float(), problem


def saliency(pm, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """L2 norm over the embedding dim of d target / d word embedding (unsigned, >= 0).

    The norm is the common "saliency" of NLP work (Li et al. 2016 style); see
    :func:`saliency_sum` for the signed variant.
    """
    return _from_gradients(pm, "saliency", *_gradients(pm, examples, times_input=False, site=site))


def saliency_sum(pm, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """Signed sum over the embedding dim of d target / d word embedding."""
    return _from_gradients(pm, "saliency_sum", *_gradients(pm, examples, times_input=False, site=site))


def input_x_gradient(pm, examples: Sequence[PreparedExample], *, site: str | None = None) -> TokenScores:
    """Signed sum over the embedding dim of embedding * gradient.

    Jain & Wallace 2019 use the absolute value of this sum as their gradient reference: take
    ``abs()`` of these scores to reproduce them (kept signed here so no information is lost).
    """
    products, problem = _gradients(pm, examples, times_input=True, site=site)
    return _from_gradients(pm, "input_x_gradient", products, problem, times_input=True)


#: Methods computed from one gradient of the target (those whose only parameter is the site,
#: registry.GradientParams): :func:`shared_gradient_scores` runs one forward/backward for any set of them.
SHARED_GRADIENT_METHODS = tuple(m.name for m in registry.methods(family="gradient") if m.params is registry.GradientParams)


def _from_gradients(pm, method: str, values: torch.Tensor, problem: _EmbeddingForward, *,
                    times_input: bool = False) -> TokenScores:
    """``method``'s TokenScores from ``[rows, width, dim]`` gradients (embedding x gradient when
    ``times_input``; input_x_gradient takes the product, the saliencies the gradient)."""
    if method == "input_x_gradient":
        products = values if times_input else values * problem.embeds
        params = {**_common_params(pm, problem), "reduction": "signed sum over embedding dim", "signed": True,
                  "note": "Jain & Wallace 2019 take |score|"}
        return TokenScores(method=method, scores=_per_example(products.sum(dim=-1), problem), params=params)
    if method == "saliency":
        params = {**_common_params(pm, problem), "reduction": "l2 norm over embedding dim", "signed": False}
        return TokenScores(method=method, scores=_per_example(values.norm(dim=-1), problem), params=params)
    params = {**_common_params(pm, problem), "reduction": "signed sum over embedding dim", "signed": True}
    return TokenScores(method=method, scores=_per_example(values.sum(dim=-1), problem), params=params)


def shared_gradient_scores(pm, examples: Sequence[PreparedExample], methods: Sequence[str], *,
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
# baselines (IG and GradientSHAP)
# ---------------------------------------------------------------------------


def _baseline_vector(pm, kind: str) -> torch.Tensor:
    """[dim] fp32 embedding every attributed position starts from."""
    if kind not in BASELINES:
        raise InputError(f"unknown baseline {kind!r}: use one of {', '.join(BASELINES)}")
    embedding = pm.model.get_input_embeddings()
    dim = embedding.weight.shape[1]
    if kind == "zero":
        return torch.zeros(dim, device=embedding.weight.device)
    token_id = {"pad": pm.tokenizer.pad_token_id, "mask": getattr(pm.tokenizer, "mask_token_id", None),
                "unk": getattr(pm.tokenizer, "unk_token_id", None)}[kind]
    if token_id is None:
        available = [k for k in BASELINES if k == "zero" or getattr(pm.tokenizer, f"{k}_token_id", None) is not None]
        raise InputError(f"baseline {kind!r} needs a {kind} token, which this tokenizer does not have: "
                         f"use one of {', '.join(available)}")
    ids = torch.tensor([token_id], device=embedding.weight.device)
    with torch.no_grad():
        return embedding(ids)[0].float()  # through the module: keeps any scaling it applies


def _baseline(pm, problem: _EmbeddingForward, kind: str, keep_special: bool) -> torch.Tensor:
    """[rows, width, dim] baseline: ``kind``'s embedding at explained positions, zero at padding.

    ``keep_special`` leaves special tokens at their own embedding (captum's BERT tutorial keeps
    [CLS]/[SEP]); they then get exactly zero IG attribution.
    """
    if problem.site.module is None:
        vector = _baseline_vector(pm, kind)
        baseline = vector.expand_as(problem.embeds) * problem.mask[..., None]  # [rows, width, dim]
    else:
        baseline = _site_baseline(pm, problem, kind)  # [rows, width, dim]
    if keep_special:
        special = torch.zeros_like(problem.mask)  # [rows, width]
        for r, example in enumerate(problem.batch.examples):
            special[r, : len(example.special)] = torch.tensor(example.special, device=special.device)
        baseline = torch.where(special[..., None], problem.embeds, baseline)
    return baseline.clone()


def _site_baseline(pm, problem: _EmbeddingForward, kind: str) -> torch.Tensor:
    """[rows, width, dim] at a module site: the module's output when every explained token is
    ``kind``'s token (each keeps its position and type embedding), zero for ``zero``; zero at padding."""
    vector = _baseline_vector(pm, kind)  # validates kind against the tokenizer
    if kind == "zero":
        return torch.zeros_like(problem.embeds)
    token_id = {"pad": pm.tokenizer.pad_token_id, "mask": getattr(pm.tokenizer, "mask_token_id", None),
                "unk": getattr(pm.tokenizer, "unk_token_id", None)}[kind]
    del vector
    ids = problem.batch.inputs["input_ids"]  # [rows, seq]
    replaced = torch.where(problem.explained, torch.full_like(ids, token_id), ids)  # [rows, seq]
    with _gradient_mode(pm.model):
        values = site_values(pm, problem.site, {**problem.batch.inputs, "input_ids": replaced})  # [rows, seq, dim]
    return values[:, : problem.embeds.shape[1]] * problem.mask[..., None]


def _baseline_norm(pm, problem: _EmbeddingForward, baseline: str, base: torch.Tensor) -> float:
    """Norm of the baseline embedding (word site), or its mean over explained tokens (module site)."""
    if problem.site.module is None:
        return float(_baseline_vector(pm, baseline).norm())
    return float(base.norm(dim=-1)[problem.mask].mean())


def _values(problem: _EmbeddingForward, *embeds: torch.Tensor) -> torch.Tensor:
    """[len(embeds) * rows] target at each ``[rows, width, dim]`` set of embeddings, in one forward."""
    with torch.no_grad():
        return problem(torch.cat(embeds), problem.rows.repeat(len(embeds)))


# ---------------------------------------------------------------------------
# integrated gradients
# ---------------------------------------------------------------------------


def integrated_gradients(pm, examples: Sequence[PreparedExample], *, baseline: str = "pad", steps: int | str = 50,
                         rule: str = "gausslegendre", internal_batch_size: int | str | None = "auto",
                         keep_special: bool = False, site: str | None = None, tolerance: float = 0.05,
                         max_steps: int = AUTO_STEPS[-1]) -> TokenScores:
    """captum ``IntegratedGradients`` from ``baseline`` to the site's embeddings; scores sum over dim.

    ``baseline``: pad (embedding of the pad id), zero, mask or unk (where the tokenizer has them),
    an experimental factor (PROTOCOLS.md: it moves tau by > 0.1), so it is in ``params``.
    ``steps`` points of the ``rule`` quadrature (captum's default Gauss-Legendre converges far
    faster than Riemann sums). ``internal_batch_size``: at most this many (row, step) inputs per
    forward/backward ("auto": as many as fit :data:`GRADIENT_TOKEN_BUDGET` tokens, since the
    activations kept for the backward pass grow with tokens); all rows go together, so a chunk holds ``max(1, internal_batch_size // rows)``
    steps of every row (None: all steps in one pass).

    ``extras``: ``convergence_delta`` per example = sum of attributions - (f(x) - f(baseline)),
    captum's completeness definition; ``target_value`` f(x) and ``baseline_value`` f(baseline).

    ``steps="auto"``: IG that knows when it is done. Each example starts at
    ``AUTO_STEPS[0]`` points and is rerun with twice the points while its completeness delta is
    above ``tolerance`` x |f(x) - f(baseline)| (Sundararajan et al. 2017 suggest checking 5%) and
    above :data:`AUTO_ABSOLUTE_TOLERANCE`, up to ``max_steps``; Gauss-Legendre points are not
    nested, so a rerun starts afresh (at most about twice the points of the final run). Extras
    add ``steps_used`` and ``converged`` per example, and ``delta_by_steps`` (``[[steps, delta],
    ...]``, every try) so a report can show delta against steps.

    Watch the delta on RMSNorm models (Llama family): their word embedding enters a scale-invariant
    norm directly, so from a zero vector (``zero``, or ``pad`` where the pad row is zero because of
    ``padding_idx``; ``params["baseline_norm"]`` says) f barely moves along most of the path and
    jumps close to the baseline; IG then needs several hundred steps to converge.
    """
    from captum.attr import IntegratedGradients

    if steps == "auto":
        return _integrated_gradients_auto(pm, examples, tolerance=tolerance, max_steps=max_steps, baseline=baseline,
                                          rule=rule, internal_batch_size=internal_batch_size,
                                          keep_special=keep_special, site=site)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer or auto, got {steps!r}")
    if rule not in IG_RULES:
        raise InputError(f"unknown integration rule {rule!r}: use one of {', '.join(IG_RULES)}")
    _check_internal_batch_size(internal_batch_size)
    problem = _embedding_forward(pm, examples, site)
    base = _baseline(pm, problem, baseline, keep_special)  # [rows, width, dim]
    rows = len(examples)
    with _gradient_mode(pm.model):
        ig = IntegratedGradients(problem)
        attributions = ig.attribute(
            problem.embeds.clone().requires_grad_(), baselines=base, additional_forward_args=(problem.rows,), n_steps=steps,
            method=rule,
            # captum splits steps, never rows, and refuses a chunk smaller than the rows
            internal_batch_size=None if internal_batch_size is None else max(_chunk(problem, internal_batch_size), rows),
        ).detach().float()  # [rows, width, dim]
    attributions = attributions * problem.mask[..., None]
    scores = attributions.sum(dim=-1)  # [rows, width]
    both = _values(problem, problem.embeds, base)  # [2 * rows]
    target, at_baseline = both[:rows], both[rows:]
    delta = scores.sum(dim=1) - (target - at_baseline)  # [rows]
    params = {**_common_params(pm, problem), "baseline": baseline,
              "baseline_norm": _baseline_norm(pm, problem, baseline, base), "steps": steps, "rule": rule,
              "internal_batch_size": internal_batch_size, "baseline_keeps_special": keep_special,
              "reduction": "signed sum over embedding dim", "signed": True}
    extras = {"convergence_delta": delta.tolist(), "target_value": target.tolist(),
              "baseline_value": at_baseline.tolist()}
    return TokenScores(method="integrated_gradients", scores=_per_example(scores, problem), params=params,
                       extras=extras)


#: |delta| (target units) below which steps="auto" calls an example converged whatever its gap
#: f(x) - f(baseline): a relative tolerance cannot be met when the gap itself is ~0.
AUTO_ABSOLUTE_TOLERANCE = 1e-4


def _integrated_gradients_auto(pm, examples: Sequence[PreparedExample], *, tolerance: float, max_steps: int,
                               **params) -> TokenScores:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise InputError(f"tolerance must be a positive fraction of |f(x) - f(baseline)| (e.g. 0.05), got {tolerance!r}")
    ladder = [s for s in AUTO_STEPS if s <= max_steps] if isinstance(max_steps, int) else []
    if isinstance(max_steps, bool) or not ladder:
        raise InputError(f"max_steps must be an integer >= {AUTO_STEPS[0]} (steps auto tries "
                         f"{', '.join(map(str, AUTO_STEPS))}), got {max_steps!r}")
    n = len(examples)
    final: list[TokenScores | None] = [None] * n  # per example: its last try, a batch of one
    position = [0] * n
    history: list[list[list[float]]] = [[] for _ in range(n)]
    converged = [False] * n
    remaining = list(range(n))
    first = None
    for steps in ladder:
        if not remaining:
            break
        chosen = [examples[i] for i in remaining]
        buckets = width_buckets(pm, chosen, points=steps + 2)
        result = join_buckets([integrated_gradients(pm, [chosen[i] for i in bucket], steps=steps, **params)
                               for bucket in buckets], buckets)
        first = first or result
        still = []
        for j, i in enumerate(remaining):
            delta = result.extras["convergence_delta"][j]
            gap = result.extras["target_value"][j] - result.extras["baseline_value"][j]
            history[i].append([steps, delta])
            final[i], position[i] = result, j
            if abs(delta) <= max(tolerance * abs(gap), AUTO_ABSOLUTE_TOLERANCE):
                converged[i] = True
            else:
                still.append(i)
        remaining = still
    extras = {key: [final[i].extras[key][position[i]] for i in range(n)]
              for key in ("convergence_delta", "target_value", "baseline_value")}
    extras.update({"steps_used": [int(history[i][-1][0]) for i in range(n)], "converged": converged,
                   "delta_by_steps": history})
    params_out = {**first.params, "steps": "auto", "tolerance": tolerance, "max_steps": ladder[-1],
                  "auto_steps": ladder, "absolute_tolerance": AUTO_ABSOLUTE_TOLERANCE}
    return TokenScores(method="integrated_gradients", scores=[final[i].scores[position[i]] for i in range(n)],
                       params=params_out, extras=extras)


#: Tokens (rows x model input width) one gradient forward/backward may hold when the chunk size is
#: "auto": the activations kept for the backward pass grow with tokens x layers x hidden size
#: (about 0.2 MB a token for MiniLM, 1.4 MB for SmolLM2-135M in fp32).
GRADIENT_TOKEN_BUDGET = 4096


def _chunk(problem: "_EmbeddingForward", internal_batch_size: int | str) -> int:
    if internal_batch_size == "auto":
        return max(1, GRADIENT_TOKEN_BUDGET // max(1, problem.fixed.shape[1]))
    return int(internal_batch_size)


def _check_internal_batch_size(value) -> None:
    if value == "auto":
        return
    if value is not None and (not isinstance(value, int) or value < 1):
        raise InputError(f"internal_batch_size must be a positive integer, auto or None, got {value!r}")


# ---------------------------------------------------------------------------
# GradientSHAP
# ---------------------------------------------------------------------------


def gradient_shap(pm, examples: Sequence[PreparedExample], *, baseline: str | Sequence[str] = "pad",
                  n_samples: int = 20, noise: float = 0.1, seed: int = 0,
                  internal_batch_size: int | str | None = "auto", keep_special: bool = False,
                  site: str | None = None) -> TokenScores:
    """GradientSHAP (Lundberg & Lee 2017, captum's estimator) on the word embeddings.

    For each example, ``n_samples`` draws of: a baseline kind from ``baseline`` (uniform), Gaussian
    noise added to the input embeddings with std ``noise`` x (std of the embedding matrix), and a
    point ``alpha ~ U(0, 1)`` on the segment baseline -> noisy input. Attribution = mean over draws
    of (noisy input - baseline) * gradient at that point, summed over the embedding dim.

    Why not ``captum.attr.GradientShap`` itself: it draws alphas from numpy's global RNG and noise
    from torch's, for the whole batch at once, so an example's draws depend on its batch neighbours
    (batch of 1 != batch of N, house rule 7) and on global state (house rule 9). Here draws come
    from a generator seeded per example (``seed`` and the example's tokens and target), and the
    gradients at the drawn points come from captum's ``Saliency`` on the same forward function.
    DeepLift is not offered: captum's DeepLift needs its supported nonlinearities as modules, and
    transformers use functional softmax / GELU and LayerNorm, where its rules do not apply.

    ``extras["convergence_delta"]``: sum of attributions - (f(x) - mean over draws of f(baseline));
    completeness holds only in expectation here, so this mixes Monte Carlo error and noise.
    """
    from captum.attr import Saliency

    kinds = (baseline,) if isinstance(baseline, str) else tuple(baseline)
    if not kinds:
        raise InputError(f"baseline must name at least one of {', '.join(BASELINES)}")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise InputError(f"n_samples must be a positive integer, got {n_samples!r}")
    if not noise >= 0:
        raise InputError(f"noise must be >= 0 (a fraction of the embedding std), got {noise!r}")
    _check_internal_batch_size(internal_batch_size)
    problem = _embedding_forward(pm, examples, site)
    rows, width, dim = problem.embeds.shape
    device = problem.embeds.device
    bases = torch.stack([_baseline(pm, problem, kind, keep_special) for kind in kinds])  # [kinds, rows, width, dim]
    stdev = noise * float(pm.model.get_input_embeddings().weight.detach().float().std())
    if problem.site.module is not None:  # the site's own scale: the std of each example's values there
        stdev = [noise * float(problem.embeds[r][problem.mask[r]].std()) for r in range(rows)]

    # per-example draws: [rows, samples] baseline kinds and alphas, [rows, samples, width, dim] noise
    which = torch.zeros(rows, n_samples, dtype=torch.long)
    alpha = torch.zeros(rows, n_samples)
    eps = torch.zeros(rows, n_samples, width, dim)
    for r, example in enumerate(problem.batch.examples):
        generator = torch.Generator().manual_seed(example_seed(seed, example))
        n = len(example.input_ids)
        which[r] = torch.randint(len(kinds), (n_samples,), generator=generator)
        alpha[r] = torch.rand(n_samples, generator=generator)
        eps[r, :, :n] = torch.randn(n_samples, n, dim, generator=generator) * (stdev[r] if isinstance(stdev, list) else stdev)
    which, alpha, eps = which.to(device), alpha.to(device), eps.to(device)

    row_of = problem.rows.repeat_interleave(n_samples)  # [rows * samples]
    drawn_base = bases[which.reshape(-1), row_of]  # [rows * samples, width, dim]
    noisy = (problem.embeds[:, None] + eps * problem.mask[:, None, :, None]).reshape(-1, width, dim)
    points = drawn_base + alpha.reshape(-1, 1, 1) * (noisy - drawn_base)  # [rows * samples, width, dim]

    chunk = len(points) if internal_batch_size is None else _chunk(problem, internal_batch_size)
    grads = []
    with _gradient_mode(pm.model):
        saliency_method = Saliency(problem)
        for start in range(0, len(points), chunk):
            part = slice(start, start + chunk)
            grads.append(saliency_method.attribute(points[part].clone().requires_grad_(), abs=False,
                                                   additional_forward_args=(row_of[part],)).detach().float())
    grads = torch.cat(grads)  # [rows * samples, width, dim]
    attributions = ((noisy - drawn_base) * grads).reshape(rows, n_samples, width, dim).mean(dim=1)
    attributions = attributions * problem.mask[..., None]  # [rows, width, dim]
    scores = attributions.sum(dim=-1)  # [rows, width]

    values = _values(problem, problem.embeds, *bases).reshape(1 + len(kinds), rows)
    target, at_bases = values[0], values[1:]  # [rows], [kinds, rows]
    expected_base = at_bases.gather(0, which.T).mean(dim=0)  # [rows] mean over each row's draws
    delta = scores.sum(dim=1) - (target - expected_base)
    params = {**_common_params(pm, problem), "baseline": list(kinds), "n_samples": n_samples, "noise": noise,
              "noise_std": stdev, "seed": seed, "internal_batch_size": internal_batch_size,
              "baseline_keeps_special": keep_special, "estimator": "captum GradientShap, per-example seeded draws",
              "reduction": "signed sum over embedding dim", "signed": True}
    extras = {"convergence_delta": delta.tolist(), "target_value": target.tolist(),
              "baseline_value": expected_base.tolist()}
    return TokenScores(method="gradient_shap", scores=_per_example(scores, problem), params=params, extras=extras)


# ---------------------------------------------------------------------------
# by name
# ---------------------------------------------------------------------------

#: the registry's by-name entry for the gradient methods (this module's :func:`gradient_scores`)
SCORER = f"{__name__}:gradient_scores"


def __getattr__(name: str):
    """``GRADIENT_EXPLAINERS``: ``{name: function}`` derived from the registry (kept for older callers)."""
    if name == "GRADIENT_EXPLAINERS":
        return {m.name: m.load() for m in registry.methods(family="gradient")}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def gradient_scores(pm, examples: Sequence[PreparedExample], method: str, **params) -> TokenScores:
    """Run the gradient explainer called ``method`` with its keyword ``params``, on width buckets
    of the examples (:func:`width_buckets`) so that no pass pads a short example to a long one."""
    entry = registry.find(method)
    if entry is None or entry.scorer != SCORER:
        raise InputError(f"unknown gradient method {method!r}: use one of {', '.join(GRADIENT_METHODS)}")
    explainer = entry.load()
    if method == "integrated_gradients" and params.get("steps") == "auto":
        return explainer(pm, examples, **params)  # buckets each round of its own
    buckets = width_buckets(pm, examples, points=_points_per_example(method, params))
    if len(buckets) == 1:
        return explainer(pm, examples, **params)
    return join_buckets([explainer(pm, [examples[i] for i in bucket], **params) for bucket in buckets], buckets)


# ---------------------------------------------------------------------------
# width buckets: no padding waste in gradient passes
# ---------------------------------------------------------------------------

#: Cost of one gradient forward/backward beyond its tokens, in token-equivalents; it decides only
#: how examples of different widths are grouped, never the values. Measured on a shared 2-core CPU
#: with builtin:minilm-rt: a call costs ~15 ms beyond ~0.25 ms per token and row (forward and
#: backward), i.e. ~64 tokens; GPUs are launch bound.
GRADIENT_CALL_OVERHEAD_TOKENS = {"cpu": 64, "cuda": 1024, "mps": 256}


def _points_per_example(method: str, params: dict) -> int:
    """Model inputs one example becomes in a gradient method (interpolation points, draws)."""
    if method == "integrated_gradients":
        steps = params.get("steps", 50)
        return (steps if isinstance(steps, int) else 1) + 2
    if method == "gradient_shap":
        n_samples = params.get("n_samples", 20)
        return (n_samples if isinstance(n_samples, int) else 1) + 2
    return 1


def _row_width(example: PreparedExample) -> int:
    return len(example.input_ids) + len(example.target_ids)


def width_buckets(pm, examples: Sequence[PreparedExample], *, points: int) -> list[list[int]]:
    """Indices of ``examples`` in groups of similar width, each group one explainer call.

    Every example becomes ``points`` model inputs padded to its group's widest row, and every pass
    holds at most :data:`GRADIENT_TOKEN_BUDGET` tokens; a dynamic programme over the examples
    sorted by width picks the cuts that minimise padded tokens plus
    :data:`GRADIENT_CALL_OVERHEAD_TOKENS` per pass. Within a group the order is the examples'
    own. Grouping changes which rows share a pass, never a value (padding is masked and
    attributions are per row: batch of 1 equals batch of N).
    """
    if not examples:
        return [[]]
    device = str(getattr(pm, "device", "cpu")).split(":")[0]
    overhead = GRADIENT_CALL_OVERHEAD_TOKENS.get(device, 256)
    widths = [_row_width(e) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: (widths[i], i))
    best = [0.0] + [math.inf] * len(order)  # best[j]: cost of the first j examples (sorted)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]
        per_pass = max(1, GRADIENT_TOKEN_BUDGET // width)  # inputs per pass
        for i in range(j):
            inputs = (j - i) * points
            cost = best[i] + inputs * width + math.ceil(inputs / per_pass) * overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def join_buckets(parts: Sequence[TokenScores], buckets: Sequence[Sequence[int]]) -> TokenScores:
    """One TokenScores in example order from one per bucket: scores and per-example ``extras``
    lists are put back in place; params and other extras are the first part's."""
    if len(parts) == 1 and list(buckets[0]) == list(range(len(buckets[0]))):
        return parts[0]
    n = sum(len(bucket) for bucket in buckets)
    scores: list = [None] * n
    for part, bucket in zip(parts, buckets):
        for position, index in enumerate(bucket):
            scores[index] = part.scores[position]
    first = parts[0]
    extras = {}
    for key, value in first.extras.items():
        if all(isinstance(part.extras.get(key), list) for part in parts):
            joined: list = [None] * n
            for part, bucket in zip(parts, buckets):
                for position, index in enumerate(bucket):
                    joined[index] = part.extras[key][position]
            extras[key] = joined
        else:
            extras[key] = value
    return TokenScores(method=first.method, scores=scores, params=first.params, per_head=first.per_head,
                       per_layer=first.per_layer, extras=extras)
