"""Gradient attributions of the target with respect to the word embeddings of the explained tokens.

Where the gradient is taken (recorded as ``params["space"]`` in every result):
    the output of the model's input-embedding matrix (``pm.model.get_input_embeddings()``), i.e.
    word-embedding space *before* position / token-type embeddings, LayerNorm and any embedding
    scale the model applies afterwards. Integrated gradients and GradientSHAP interpolate there.
    PROTOCOLS.md ("Lessons") measured that interpolating after BERT's ``embeddings`` module instead
    changes rankings (Spearman 0.73 at worst), so the choice is fixed here and written down.

What is attributed:
    classification  the text's tokens (special tokens included: they are scored; the caller uses
                    ``example.special`` to drop them)
    causal_lm       the prompt tokens, i.e. the first ``len(example.input_ids)`` positions of each
                    row; the continuation whose log-prob is the target is part of the sequence but
                    held fixed (same embeddings at the input and at the baseline) and never scored
    seq2seq         the encoder input tokens; decoder inputs are held fixed
Padding is never attributed: the forward function takes padded positions from fixed pad embeddings
(masked by the attention mask), so the gradient there is exactly zero and batch of 1 equals batch of N.

Every method evaluates its target with :func:`probe.explain.target.target_values` on the rows of
:func:`probe.explain.target.build_rows`, so gradients explain exactly the number interventions change.
captum is used at one boundary, :class:`_EmbeddingForward` (house rule 5): it sees a plain function
``f(embeddings [n, tokens, dim], row [n]) -> target [n]`` and its outputs become ``TokenScores`` here.
Gradients are taken in fp32: the attributed embeddings are fp32 and are cast to the model's dtype
only when they enter the model, so a bf16 model still gives fp32 scores (of bf16 precision).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from probe.errors import InputError
from probe.explain.scores import TokenScores
from probe.explain.target import (PreparedExample, RowBatch, build_rows, example_seed, keep_target_logits,
                                  target_values)

GRADIENT_METHODS = ("saliency", "saliency_sum", "input_x_gradient", "integrated_gradients", "gradient_shap")
BASELINES = ("pad", "zero", "mask", "unk")
IG_RULES = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")

SPACE = "word_embeddings"  # where gradients are taken and IG / GradientSHAP interpolate
SPACE_NOTE = ("output of get_input_embeddings(): before position/token-type embeddings, LayerNorm "
              "and embedding scaling")


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

    @property
    def mask(self) -> torch.Tensor:
        """[rows, width] bool: explained (attributed) positions."""
        return self.explained[:, : self.embeds.shape[1]]

    def __call__(self, embeds: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        seq = self.fixed.shape[1]
        padded = F.pad(embeds, (0, 0, 0, seq - embeds.shape[1]))  # [n, seq, dim]
        full = torch.where(self.explained[row][..., None], padded, self.fixed[row])  # [n, seq, dim]
        inputs = {key: value[row] for key, value in self.batch.inputs.items() if key != "input_ids"}
        inputs["inputs_embeds"] = full.to(_model_dtype(self.pm))
        selected = keep_target_logits(self.pm, _select_rows(self.batch, row), inputs)
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


def _embedding_forward(pm, examples: Sequence[PreparedExample]) -> _EmbeddingForward:
    if not examples:
        raise InputError("no examples to explain: give at least one prepared example")
    batch = build_rows(pm, [(example.input_ids, example) for example in examples])
    input_ids = batch.inputs["input_ids"]  # [rows, seq]
    with torch.no_grad():
        fixed = pm.model.get_input_embeddings()(input_ids).float()  # [rows, seq, dim]
    seq = input_ids.shape[1]
    lengths = batch.input_lengths  # [rows]
    explained = torch.arange(seq, device=input_ids.device)[None, :] < lengths[:, None]  # [rows, seq]
    width = int(lengths.max())
    embeds = fixed[:, :width] * explained[:, :width, None]  # [rows, width, dim]
    rows = torch.arange(len(examples), device=input_ids.device)  # [rows]
    return _EmbeddingForward(pm=pm, batch=batch, embeds=embeds, fixed=fixed, explained=explained, rows=rows)


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
    return {
        "space": SPACE,
        "space_note": SPACE_NOTE,
        "target_kind": examples[0].kind,
        "attributed": {"classification": "input tokens", "causal_lm": "prompt tokens (continuation held fixed)",
                       "seq2seq": "encoder input tokens (decoder inputs held fixed)",
                       "encoder": "input tokens (a similarity target's reference held fixed)"}[pm.task],
        "gradient_dtype": "float32",
        "model_dtype": str(_model_dtype(pm)).replace("torch.", ""),
    }


def _gradients(pm, examples: Sequence[PreparedExample], *, times_input: bool) -> tuple[torch.Tensor, _EmbeddingForward]:
    """Gradient (captum ``Saliency``, signed) or embedding x gradient (``InputXGradient``) of every
    example in one forward/backward. Returns ``[rows, width, dim]`` fp32 and the forward used."""
    from captum.attr import InputXGradient, Saliency

    problem = _embedding_forward(pm, examples)
    with _gradient_mode(pm.model):
        if times_input:
            attributions = InputXGradient(problem).attribute(problem.embeds.clone().requires_grad_(),
                                                             additional_forward_args=(problem.rows,))
        else:
            attributions = Saliency(problem).attribute(problem.embeds.clone().requires_grad_(), abs=False,
                                                       additional_forward_args=(problem.rows,))
    return attributions.detach().float(), problem


def saliency(pm, examples: Sequence[PreparedExample]) -> TokenScores:
    """L2 norm over the embedding dim of d target / d word embedding (unsigned, >= 0).

    The norm is the common "saliency" of NLP work (Li et al. 2016 style); see
    :func:`saliency_sum` for the signed variant.
    """
    grads, problem = _gradients(pm, examples, times_input=False)
    scores = grads.norm(dim=-1)  # [rows, width]
    params = {**_common_params(pm, problem), "reduction": "l2 norm over embedding dim", "signed": False}
    return TokenScores(method="saliency", scores=_per_example(scores, problem), params=params)


def saliency_sum(pm, examples: Sequence[PreparedExample]) -> TokenScores:
    """Signed sum over the embedding dim of d target / d word embedding."""
    grads, problem = _gradients(pm, examples, times_input=False)
    scores = grads.sum(dim=-1)  # [rows, width]
    params = {**_common_params(pm, problem), "reduction": "signed sum over embedding dim", "signed": True}
    return TokenScores(method="saliency_sum", scores=_per_example(scores, problem), params=params)


def input_x_gradient(pm, examples: Sequence[PreparedExample]) -> TokenScores:
    """Signed sum over the embedding dim of embedding * gradient.

    Jain & Wallace 2019 use the absolute value of this sum as their gradient reference: take
    ``abs()`` of these scores to reproduce them (kept signed here so no information is lost).
    """
    products, problem = _gradients(pm, examples, times_input=True)
    scores = products.sum(dim=-1)  # [rows, width]
    params = {**_common_params(pm, problem), "reduction": "signed sum over embedding dim", "signed": True,
              "note": "Jain & Wallace 2019 take |score|"}
    return TokenScores(method="input_x_gradient", scores=_per_example(scores, problem), params=params)


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
    vector = _baseline_vector(pm, kind)
    baseline = vector.expand_as(problem.embeds) * problem.mask[..., None]  # [rows, width, dim]
    if keep_special:
        special = torch.zeros_like(problem.mask)  # [rows, width]
        for r, example in enumerate(problem.batch.examples):
            special[r, : len(example.special)] = torch.tensor(example.special, device=special.device)
        baseline = torch.where(special[..., None], problem.embeds, baseline)
    return baseline.clone()


def _values(problem: _EmbeddingForward, *embeds: torch.Tensor) -> torch.Tensor:
    """[len(embeds) * rows] target at each ``[rows, width, dim]`` set of embeddings, in one forward."""
    with torch.no_grad():
        return problem(torch.cat(embeds), problem.rows.repeat(len(embeds)))


# ---------------------------------------------------------------------------
# integrated gradients
# ---------------------------------------------------------------------------


def integrated_gradients(pm, examples: Sequence[PreparedExample], *, baseline: str = "pad", steps: int = 50,
                         rule: str = "gausslegendre", internal_batch_size: int | str | None = "auto",
                         keep_special: bool = False) -> TokenScores:
    """captum ``IntegratedGradients`` from ``baseline`` to the word embeddings; scores sum over dim.

    ``baseline``: pad (embedding of the pad id), zero, mask or unk (where the tokenizer has them),
    an experimental factor (PROTOCOLS.md: it moves tau by > 0.1), so it is in ``params``.
    ``steps`` points of the ``rule`` quadrature (captum's default Gauss-Legendre converges far
    faster than Riemann sums). ``internal_batch_size``: at most this many (row, step) inputs per
    forward/backward ("auto": as many as fit :data:`GRADIENT_TOKEN_BUDGET` tokens, since the
    activations kept for the backward pass grow with tokens); all rows go together, so a chunk holds ``max(1, internal_batch_size // rows)``
    steps of every row (None: all steps in one pass).

    ``extras``: ``convergence_delta`` per example = sum of attributions - (f(x) - f(baseline)),
    captum's completeness definition; ``target_value`` f(x) and ``baseline_value`` f(baseline).

    Watch the delta on RMSNorm models (Llama family): their word embedding enters a scale-invariant
    norm directly, so from a zero vector (``zero``, or ``pad`` where the pad row is zero because of
    ``padding_idx``; ``params["baseline_norm"]`` says) f barely moves along most of the path and
    jumps close to the baseline; IG then needs several hundred steps to converge.
    """
    from captum.attr import IntegratedGradients

    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer, got {steps!r}")
    if rule not in IG_RULES:
        raise InputError(f"unknown integration rule {rule!r}: use one of {', '.join(IG_RULES)}")
    _check_internal_batch_size(internal_batch_size)
    problem = _embedding_forward(pm, examples)
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
              "baseline_norm": float(_baseline_vector(pm, baseline).norm()), "steps": steps, "rule": rule,
              "internal_batch_size": internal_batch_size, "baseline_keeps_special": keep_special,
              "reduction": "signed sum over embedding dim", "signed": True}
    extras = {"convergence_delta": delta.tolist(), "target_value": target.tolist(),
              "baseline_value": at_baseline.tolist()}
    return TokenScores(method="integrated_gradients", scores=_per_example(scores, problem), params=params,
                       extras=extras)


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
                  internal_batch_size: int | str | None = "auto", keep_special: bool = False) -> TokenScores:
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
    problem = _embedding_forward(pm, examples)
    rows, width, dim = problem.embeds.shape
    device = problem.embeds.device
    bases = torch.stack([_baseline(pm, problem, kind, keep_special) for kind in kinds])  # [kinds, rows, width, dim]
    stdev = noise * float(pm.model.get_input_embeddings().weight.detach().float().std())

    # per-example draws: [rows, samples] baseline kinds and alphas, [rows, samples, width, dim] noise
    which = torch.zeros(rows, n_samples, dtype=torch.long)
    alpha = torch.zeros(rows, n_samples)
    eps = torch.zeros(rows, n_samples, width, dim)
    for r, example in enumerate(problem.batch.examples):
        generator = torch.Generator().manual_seed(example_seed(seed, example))
        n = len(example.input_ids)
        which[r] = torch.randint(len(kinds), (n_samples,), generator=generator)
        alpha[r] = torch.rand(n_samples, generator=generator)
        eps[r, :, :n] = torch.randn(n_samples, n, dim, generator=generator) * stdev
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

GRADIENT_EXPLAINERS: dict[str, Callable[..., TokenScores]] = {
    "saliency": saliency,
    "saliency_sum": saliency_sum,
    "input_x_gradient": input_x_gradient,
    "integrated_gradients": integrated_gradients,
    "gradient_shap": gradient_shap,
}


def gradient_scores(pm, examples: Sequence[PreparedExample], method: str, **params) -> TokenScores:
    """Run the gradient explainer called ``method`` with its keyword ``params``."""
    if method not in GRADIENT_EXPLAINERS:
        raise InputError(f"unknown gradient method {method!r}: use one of {', '.join(GRADIENT_METHODS)}")
    return GRADIENT_EXPLAINERS[method](pm, examples, **params)
