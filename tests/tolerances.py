"""Floating-point tolerances derived from the dtype, the quantity's scale and the computation's depth.

Two results of the same mathematics computed in a different order (a batch of 1 against a batch of
N, chunked against whole, probe against captum or a hand oracle, another machine's kernels) differ
by rounding alone. Each floating-point operation rounds to half an ulp *of the magnitude of what it
combines*, and the rounding of every stage of a deep computation reaches its output, so their
difference is bounded by

    tol = ULPS_PER_STAGE * depth * eps(dtype) * scale

``eps(dtype)``
    ``torch.finfo(dtype).eps`` (fp32 1.19e-7, bf16 7.8e-3, fp64 2.2e-16): the dtype the
    computation ran in, not the dtype of the compared tensors.
``scale``
    the magnitude of the terms the quantity was computed from, not that of the result. By default
    the largest magnitude in either compared tensor (one tolerance for the tensor: a signed sum over
    the embedding dim that cancels to ~0 at one token still carries the rounding of terms as large as
    the largest score, so a per-element relative tolerance would be wrong). A quantity that is a
    difference of larger terms passes those terms' magnitude: a convergence delta
    (sum of attributions - (f(x) - f(baseline))), a leave-one-out effect (f(x) - f(x')), a sum of scores.
``depth``
    how many rounding stages lie between the inputs and the quantity: :func:`model_depth` for a
    model's forward (and backward) pass, ``1`` for one reduction done twice in another order. Stage
    errors are added linearly (the worst case; rounding that happens to cancel only helps).
``ULPS_PER_STAGE``
    16: one stage (a transformer layer, or the embeddings, or the head) chains about eight reductions
    (attention scores, softmax, values, output projection, two norms, two MLP matmuls), each moving its
    result by at most about one ulp of its scale when its summation order changes (a sum of w terms in
    another order: about sqrt(w) half-ulp roundings of partial sums that are mostly far smaller than the
    whole, for the widths <= 1536 of the models here), and passes on the error it received with a gain
    of about one (residual stream and norms); 8 reductions x 2 ulps.

Floor: there is none in ulps. ``scale`` is floored at the dtype's smallest normal number only, so
two exact zeros compare equal and nothing else passes for free; a quantity that can cancel to ~0
must pass the scale of the terms it cancelled (see ``scale``). A tolerance that stays a fixed
absolute number elsewhere in tests/ does so because its quantity is bounded near 1 (a probability,
an attention row, a normalised score, a cosine distance, a correlation or a p-value); a comment there
says why.

What it is not: a bound on the error of an approximation (IG's quadrature, a finite difference, a
Monte Carlo mean); those tests keep their own, larger, method tolerances. ``atol=0`` equality
(determinism, seeded draws, bit-identical capture) stays exact.

A wrong gradient (x (1 + 1e-3)) or a padding leak moves a result by 1e-3 or more relative to its
scale; the deepest model here allows 16 x 16 x 1.19e-7 = 3e-5 of it.
"""

from __future__ import annotations

import math

import torch

#: ulps of its scale that one stage of a computation may move its result by (see the module docstring)
ULPS_PER_STAGE = 16


def eps(dtype: torch.dtype = torch.float32) -> float:
    """Machine epsilon of ``dtype`` (the spacing of floats at 1)."""
    return float(torch.finfo(dtype).eps)


def model_depth(pm, *, backward: bool = False) -> int:
    """Rounding stages of one pass of ``pm``: every transformer layer of every stack, the embeddings
    and the head; twice that when a backward pass follows (gradients, attributions)."""
    # "cross" names the decoder layers' cross-attention: the same layers as "decoder"
    stages = sum(info.n_layers for name, info in pm.contract.stacks.items() if name != "cross") + 2
    return 2 * stages if backward else stages


def _magnitude(x) -> float:
    if isinstance(x, torch.Tensor):
        finite = x.detach().double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return float(finite.abs().max()) if finite.numel() else 0.0
    if isinstance(x, (list, tuple)):
        return max((_magnitude(v) for v in x), default=0.0)
    return 0.0 if math.isnan(float(x)) else abs(float(x))


def fp_tol(scale: float, *, depth: int, dtype: torch.dtype = torch.float32) -> float:
    """The absolute tolerance for a quantity of magnitude ``scale`` after ``depth`` stages in ``dtype``."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return ULPS_PER_STAGE * depth * eps(dtype) * max(float(scale), float(torch.finfo(dtype).tiny))


def _scale_of(a, b, scale) -> float:
    return max(_magnitude(a), _magnitude(b), 0.0 if scale is None else float(scale))


def fp_close(a, b, *, depth: int, dtype: torch.dtype = torch.float32, scale: float | None = None) -> bool:
    """Whether numbers (or tensors) ``a`` and ``b`` agree within :func:`fp_tol` of their scale (NaN where both are)."""
    tol = fp_tol(_scale_of(a, b, scale), depth=depth, dtype=dtype)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.broadcast_tensors(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
        return bool(torch.equal(a.isnan(), b.isnan())) and bool(((a - b).nan_to_num().abs() <= tol).all())
    if math.isnan(float(a)) or math.isnan(float(b)):
        return math.isnan(float(a)) and math.isnan(float(b))
    return abs(float(a) - float(b)) <= tol


def assert_fp_close(actual, expected, *, depth: int, dtype: torch.dtype = torch.float32, scale: float | None = None,
                    msg=None) -> None:
    """``torch.testing.assert_close`` with ``rtol=0`` and ``atol`` = :func:`fp_tol` of the pair's scale
    (``scale``, when given, is a lower bound on it); NaNs must sit in the same places."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    tol = fp_tol(_scale_of(actual, expected, scale), depth=depth, dtype=dtype)
    message = f"tolerance {tol:.3g} = {ULPS_PER_STAGE} ulps x depth {depth} x eps({dtype}) x scale"
    if msg is not None:
        message = f"{msg}: {message}"
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=0, atol=tol, equal_nan=True,
                               msg=lambda default: f"{default}\n{message}")


def gradient_term_scales(pm, examples, method: str, **params) -> list[float]:
    """Per example, the largest ``sum over the embedding dim of |term|`` of ``method``'s per-token scores:
    the scale a signed sum over the embedding dim is rounded at (its terms), not that of the sum.

    It matters: a norm that removes the mean (LayerNorm, everything a word embedding reaches in GPT-2)
    makes ``sum_d d f / d x_d`` vanish, so saliency_sum is ~1e-8 where its terms are ~10, and
    input x gradient and IG cancel by factors of 5-300 on the tiny models and MiniLM. The L2
    saliency does not cancel (its scale is its own). Computed here, not read from probe: the plain
    gradient (captum Saliency / InputXGradient at the site) for saliency_sum and input_x_gradient,
    the per-dim IG attributions of the same call for IG, and the per-dim GradientSHAP attributions
    of the same draws for GradientSHAP.
    """
    from probe.explainers import gradients as G
    from probe.explainers import integrated_gradients as I

    site = params.get("site")
    if method in ("saliency", "saliency_l1"):  # norms: no cancellation, their scale is their own
        return [0.0] * len(examples)
    if method in ("saliency_sum", "input_x_gradient"):
        values, problem = G._gradients(pm, examples, times_input=method == "input_x_gradient", site=site)
        terms = values * problem.mask[..., None]
    elif method == "integrated_gradients":
        problem = I.embedding_forward(pm, examples, site)
        base = I._baseline(pm, problem, params.get("baseline", "pad"), params.get("keep_special", False))
        terms = I._ig_attributions(pm, problem, base, params.get("steps", 50), params.get("rule", "gausslegendre"),
                                   params.get("internal_batch_size", "auto")) * problem.mask[..., None]
    elif method == "gradient_shap":  # as I.gradient_shap draws its points (per-example seeded)
        problem = I.embedding_forward(pm, examples, site)
        kinds = params.get("baseline", "pad")
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        n_samples, noise = params.get("n_samples", 20), params.get("noise", 0.1)
        rows, width, dim = problem.embeds.shape
        bases = torch.stack([I._baseline(pm, problem, kind, params.get("keep_special", False)) for kind in kinds])
        stdev = noise * float(pm.model.get_input_embeddings().weight.detach().float().std())
        if problem.site.module is not None:
            stdev = [noise * float(problem.embeds[r][problem.mask[r]].std()) for r in range(rows)]
        which, alpha, noise_draws = I._shap_draws(problem, len(kinds), n_samples, stdev, params.get("seed", 0))
        row_of = problem.rows.repeat_interleave(n_samples)
        drawn = bases[which.reshape(-1), row_of]
        noisy = (problem.embeds[:, None] + noise_draws * problem.mask[:, None, :, None]).reshape(-1, width, dim)
        points = drawn + alpha.reshape(-1, 1, 1) * (noisy - drawn)
        grads = I._gradients_at(pm, problem, points, row_of, params.get("internal_batch_size", "auto"))
        # the per-sample products are averaged before the sum over dim: bound by their mean magnitude
        terms = ((noisy - drawn) * grads).abs().reshape(rows, n_samples, width, dim).mean(dim=1)
        terms = terms * problem.mask[..., None]
    else:
        raise ValueError(f"no term scale for {method!r}")
    return terms.abs().sum(dim=-1).amax(dim=1).tolist()  # [rows]: padding is masked out above
