"""Integrated gradients (Sundararajan et al. 2017) and GradientSHAP (Lundberg & Lee 2017) through
captum, interpolating at the gradient site from a baseline embedding (pad, zero, mask or unk);
see :mod:`probe.explainers.gradients` for the sites and what is attributed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from probe import registry
from probe.errors import InputError
from probe.explainers.gradient_forward import (
    GRADIENT_TOKEN_BUDGET,
    EmbeddingForward,
    common_params,
    embedding_forward,
    grouped_gradients,
    grouped_values,
    join_buckets,
    per_example,
    site_values,
    width_buckets,
)
from probe.registry.params import IG_BASELINES as BASELINES
from probe.registry.params import IG_RULES, GradientShapParams, IntegratedGradientsParams, check_params
from probe.rows.queries import eval_mode
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, target_generator

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

AUTO_STEPS = (16, 32, 64, 128, 256, 512)  # Gauss-Legendre points tried by steps="auto", in order


# ---------------------------------------------------------------------------
# baselines (IG and GradientSHAP)
# ---------------------------------------------------------------------------


def _baseline_vector(pm: ProbeModel, kind: str) -> torch.Tensor:
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


def _baseline(pm: ProbeModel, problem: EmbeddingForward, kind: str, keep_special: bool) -> torch.Tensor:
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


def _site_baseline(pm: ProbeModel, problem: EmbeddingForward, kind: str) -> torch.Tensor:
    """[rows, width, dim] at a module site: the module's output when every explained token is
    ``kind``'s token (each keeps its position and type embedding), zero for ``zero``; zero at padding."""
    vector = _baseline_vector(pm, kind)  # validates kind against the tokenizer
    if kind == "zero":
        return torch.zeros_like(problem.embeds)
    token_id = {"pad": pm.tokenizer.pad_token_id, "mask": getattr(pm.tokenizer, "mask_token_id", None),
                "unk": getattr(pm.tokenizer, "unk_token_id", None)}[kind]
    del vector
    ids = problem.batch.inputs["input_ids"]  # [rows, seq]
    explained = problem.explained[:, : ids.shape[1]]  # the site may hold more positions (padded inside the model)
    replaced = torch.where(explained, torch.full_like(ids, token_id), ids)  # [rows, seq]
    with eval_mode(pm.model, grad=True):
        values = site_values(pm, problem.site, {**problem.batch.inputs, "input_ids": replaced})  # [rows, seq, dim]
    return values[:, : problem.embeds.shape[1]] * problem.mask[..., None]


def _baseline_norm(pm: ProbeModel, problem: EmbeddingForward, baseline: str, base: torch.Tensor) -> float:
    """Norm of the baseline embedding (word site), or its mean over explained tokens (module site)."""
    if problem.site.module is None:
        return float(_baseline_vector(pm, baseline).norm())
    return float(base.norm(dim=-1)[problem.mask].mean())


def _values(problem: EmbeddingForward, *embeds: torch.Tensor) -> torch.Tensor:
    """[len(embeds) * rows] target at each ``[rows, width, dim]`` set of embeddings, in one forward
    (the output tokens of one text: one forward of their shared row)."""
    if problem.groups:
        return grouped_values(problem, *embeds)
    with torch.no_grad():
        return problem(torch.cat(embeds), problem.rows.repeat(len(embeds)))


# ---------------------------------------------------------------------------
# integrated gradients
# ---------------------------------------------------------------------------


def integrated_gradients(pm: ProbeModel, examples: Sequence[PreparedExample], *, baseline: str = "pad", steps: int | str = 50,
                         rule: str = "gausslegendre", internal_batch_size: int | str | None = "auto",
                         keep_special: bool = False, site: str | None = None, tolerance: float = 0.05,
                         max_steps: int = AUTO_STEPS[-1]) -> TokenScores:
    """captum ``IntegratedGradients`` from ``baseline`` to the site's embeddings; scores sum over dim.

    ``baseline``: pad (embedding of the pad id), zero, mask or unk (where the tokenizer has them),
    an experimental factor (PROTOCOLS.md: it moves tau by > 0.1), so it is in ``params``.
    ``keep_special``: False (the default) puts the baseline at every explained position, special
    tokens ([CLS], [SEP], <s>) included; True leaves them at their own embedding, as captum's BERT
    tutorial's reference ``[CLS] [PAD] ... [PAD] [SEP]`` does (they then score exactly 0). With True,
    ``baseline="pad"`` and the same ``steps`` this equals captum's ``LayerIntegratedGradients`` on the
    site's layer (``bert.embeddings`` at site embeddings, the word embeddings at site word) from that
    reference, summed over the embedding axis (tests/across/test_peer_habits.py).
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
    above :data:`AUTO_ABSOLUTE_TOLERANCE`, up to ``max_steps`` (:func:`auto_ladder`: a last try at
    ``max_steps`` itself where it is not a power of two); Gauss-Legendre points are not
    nested, so a rerun starts afresh (at most about twice the points of the final run). Extras
    add ``steps_used`` and ``converged`` per example, and ``delta_by_steps`` (``[[steps, delta],
    ...]``, every try) so a report can show delta against steps.

    Watch the delta on RMSNorm models (Llama family): their word embedding enters a scale-invariant
    norm directly, so from a zero vector (``zero``, or ``pad`` where the pad row is zero because of
    ``padding_idx``; ``params["baseline_norm"]`` says) f barely moves along most of the path and
    jumps close to the baseline; IG then needs several hundred steps to converge.
    """
    if steps == "auto":
        return _integrated_gradients_auto(pm, examples, tolerance=tolerance, max_steps=max_steps, baseline=baseline,
                                          rule=rule, internal_batch_size=internal_batch_size,
                                          keep_special=keep_special, site=site)
    _check_fixed_steps(steps, rule, internal_batch_size)
    problem = embedding_forward(pm, examples, site)
    base = _baseline(pm, problem, baseline, keep_special)  # [rows, width, dim]
    rows = len(examples)
    attributions = _ig_attributions(pm, problem, base, steps, rule, internal_batch_size)  # [rows, width, dim]
    attributions = attributions * problem.mask[..., None]
    scores = attributions.sum(dim=-1)  # [rows, width]
    both = _values(problem, problem.embeds, base)  # [2 * rows]
    target, at_baseline = both[:rows], both[rows:]
    delta = scores.sum(dim=1) - (target - at_baseline)  # [rows]
    params = {**common_params(pm, problem), "baseline": baseline,
              "baseline_norm": _baseline_norm(pm, problem, baseline, base), "steps": steps, "rule": rule,
              "internal_batch_size": internal_batch_size, "baseline_keeps_special": keep_special,
              "reduction": "signed sum over embedding dim", "signed": True}
    params["label"] = registry.labelled("integrated_gradients", params)
    extras = {"convergence_delta": delta.tolist(), "target_value": target.tolist(),
              "baseline_value": at_baseline.tolist()}
    return TokenScores(method="integrated_gradients", scores=per_example(scores, problem), params=params,
                       extras=extras)


def _check_fixed_steps(steps, rule: str, internal_batch_size: int | str | None) -> None:
    """Refuse, in one line, a number of steps, a rule or an internal batch size IG cannot run with."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer or auto, got {steps!r}")
    check_params(IntegratedGradientsParams, "integrated_gradients", steps=steps)
    if rule not in IG_RULES:
        raise InputError(f"unknown integration rule {rule!r}: use one of {', '.join(IG_RULES)}")
    _check_internal_batch_size(internal_batch_size)


def _ig_attributions(pm: ProbeModel, problem: EmbeddingForward, base: torch.Tensor, steps: int, rule: str,
                     internal_batch_size: int | str | None) -> torch.Tensor:
    """captum ``IntegratedGradients`` of ``problem`` from ``base``: [rows, width, dim] fp32.

    The output tokens of one text (``problem.groups``) share each point's forward: the same
    quadrature as captum's (:func:`quadrature`), summed by :func:`grouped_gradients`.
    """
    from captum.attr import IntegratedGradients

    rows = problem.embeds.shape[0]
    if problem.groups:
        alphas, weights = quadrature(rule, steps)
        chunk = None if internal_batch_size is None else _chunk(problem, internal_batch_size)
        with eval_mode(pm.model, grad=True, inputs_only=True):
            path = grouped_gradients(problem, base, alphas, weights, chunk)  # [rows, width, dim]
        return (path * (problem.embeds - base)).detach().float()
    with eval_mode(pm.model, grad=True, inputs_only=True):
        ig = IntegratedGradients(problem)
        return ig.attribute(
            problem.embeds.clone().requires_grad_(), baselines=base, additional_forward_args=(problem.rows,), n_steps=steps,
            method=rule,
            # captum splits steps, never rows, and refuses a chunk smaller than the rows
            internal_batch_size=None if internal_batch_size is None else max(_chunk(problem, internal_batch_size), rows),
        ).detach().float()  # [rows, width, dim]


def quadrature(rule: str, steps: int) -> tuple[list[float], list[float]]:
    """Points on [0, 1] and their weights for ``steps`` points of ``rule`` (one of :data:`IG_RULES`),
    the ones captum's ``IntegratedGradients`` uses: Gauss-Legendre nodes mapped from [-1, 1], or
    a Riemann sum's left, right, middle or trapezoid points."""
    import numpy as np

    if rule == "gausslegendre":
        nodes, node_weights = np.polynomial.legendre.leggauss(steps)
        return (0.5 * (1 + nodes)).tolist(), (0.5 * node_weights).tolist()
    if steps < 2:
        raise InputError(f"the {rule} rule needs at least 2 steps, got {steps}")
    kind = rule.split("_")[-1]
    if kind == "trapezoid":  # captum's weights: 1/n, halved at both ends
        weights = [1 / steps] * steps
        weights[0] = weights[-1] = 1 / (2 * steps)
        return torch.linspace(0, 1, steps).tolist(), weights
    points = {"left": torch.linspace(0, 1 - 1 / steps, steps), "right": torch.linspace(1 / steps, 1, steps),
              "middle": torch.linspace(1 / (2 * steps), 1 - 1 / (2 * steps), steps)}[kind]
    return points.tolist(), [1 / steps] * steps


#: |delta| (target units) below which steps="auto" calls an example converged whatever its gap
#: f(x) - f(baseline): a relative tolerance cannot be met when the gap itself is ~0.
AUTO_ABSOLUTE_TOLERANCE = 1e-4


def auto_ladder(max_steps: int) -> list[int]:
    """The points ``steps="auto"`` tries in turn up to ``max_steps``: the :data:`AUTO_STEPS` below it,
    then ``max_steps`` itself (16, 32, 50 for 50); empty below the first."""
    if max_steps < AUTO_STEPS[0]:
        return []
    return [s for s in AUTO_STEPS if s < max_steps] + [max_steps]


def _integrated_gradients_auto(pm: ProbeModel, examples: Sequence[PreparedExample], *, tolerance: float, max_steps: int,
                               **params) -> TokenScores:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise InputError(f"tolerance must be a positive fraction of |f(x) - f(baseline)| (e.g. 0.05), got "
                         f"{tolerance!r}")
    ladder = auto_ladder(max_steps) if isinstance(max_steps, int) and not isinstance(max_steps, bool) else []
    if not ladder:
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


def _chunk(problem: EmbeddingForward, internal_batch_size: int | str) -> int:
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


def gradient_shap(pm: ProbeModel, examples: Sequence[PreparedExample], *, baseline: str | Sequence[str] = "pad",
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
    kinds = (baseline,) if isinstance(baseline, str) else tuple(baseline)
    _check_shap_args(kinds, n_samples, noise, internal_batch_size)
    problem = embedding_forward(pm, examples, site)
    rows, width, dim = problem.embeds.shape
    bases = torch.stack([_baseline(pm, problem, kind, keep_special) for kind in kinds])  # [kinds, rows, width, dim]
    stdev = noise * float(pm.model.get_input_embeddings().weight.detach().float().std())
    if problem.site.module is not None:  # the site's own scale: the std of each example's values there
        stdev = [noise * float(problem.embeds[r][problem.mask[r]].std()) for r in range(rows)]
    which, alpha, eps = _shap_draws(problem, len(kinds), n_samples, stdev, seed)
    row_of = problem.rows.repeat_interleave(n_samples)  # [rows * samples]
    drawn_base = bases[which.reshape(-1), row_of]  # [rows * samples, width, dim]
    noisy = (problem.embeds[:, None] + eps * problem.mask[:, None, :, None]).reshape(-1, width, dim)
    points = drawn_base + alpha.reshape(-1, 1, 1) * (noisy - drawn_base)  # [rows * samples, width, dim]
    grads = _gradients_at(pm, problem, points, row_of, internal_batch_size)  # [rows * samples, width, dim]
    attributions = ((noisy - drawn_base) * grads).reshape(rows, n_samples, width, dim).mean(dim=1)
    attributions = attributions * problem.mask[..., None]  # [rows, width, dim]
    scores = attributions.sum(dim=-1)  # [rows, width]

    values = _values(problem, problem.embeds, *bases).reshape(1 + len(kinds), rows)
    target, at_bases = values[0], values[1:]  # [rows], [kinds, rows]
    expected_base = at_bases.gather(0, which.T).mean(dim=0)  # [rows] mean over each row's draws
    delta = scores.sum(dim=1) - (target - expected_base)
    params = {**common_params(pm, problem), "baseline": list(kinds), "n_samples": n_samples, "noise": noise,
              "noise_std": stdev, "seed": seed, "internal_batch_size": internal_batch_size,
              "baseline_keeps_special": keep_special, "estimator": "captum GradientShap, per-example seeded draws",
              "reduction": "signed sum over embedding dim", "signed": True}
    params["label"] = registry.labelled("gradient_shap", params)
    extras = {"convergence_delta": delta.tolist(), "target_value": target.tolist(),
              "baseline_value": expected_base.tolist()}
    return TokenScores(method="gradient_shap", scores=per_example(scores, problem), params=params, extras=extras)


def _check_shap_args(kinds: tuple, n_samples, noise, internal_batch_size) -> None:
    if not kinds:
        raise InputError(f"baseline must name at least one of {', '.join(BASELINES)}")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise InputError(f"n_samples must be a positive integer, got {n_samples!r}")
    check_params(GradientShapParams, "gradient_shap", n_samples=n_samples)
    if not noise >= 0:
        raise InputError(f"noise must be >= 0 (a fraction of the embedding std), got {noise!r}")
    _check_internal_batch_size(internal_batch_size)


def _shap_draws(problem: EmbeddingForward, n_kinds: int, n_samples: int, stdev: float | list[float],
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example draws from a generator seeded by the example's content: [rows, samples]
    baseline kinds and alphas, [rows, samples, width, dim] noise (zero beyond each example)."""
    rows, width, dim = problem.embeds.shape
    device = problem.embeds.device
    which = torch.zeros(rows, n_samples, dtype=torch.long)
    alpha = torch.zeros(rows, n_samples)
    eps = torch.zeros(rows, n_samples, width, dim)
    for r, example in enumerate(problem.batch.examples):
        generator = target_generator(seed, example)
        n = len(example.input_ids)
        which[r] = torch.randint(n_kinds, (n_samples,), generator=generator)
        alpha[r] = torch.rand(n_samples, generator=generator)
        eps[r, :, :n] = torch.randn(n_samples, n, dim, generator=generator) * (stdev[r] if isinstance(stdev, list) else stdev)
    return which.to(device), alpha.to(device), eps.to(device)


def _gradients_at(pm: ProbeModel, problem: EmbeddingForward, points: torch.Tensor, row_of: torch.Tensor,
                  internal_batch_size: int | str | None) -> torch.Tensor:
    """captum ``Saliency`` (signed) at each of ``points`` [n, width, dim], ``row_of`` [n] saying
    whose row each is, in chunks of ``internal_batch_size``: [n, width, dim] fp32."""
    from captum.attr import Saliency

    chunk = len(points) if internal_batch_size is None else _chunk(problem, internal_batch_size)
    grads = []
    with eval_mode(pm.model, grad=True, inputs_only=True):
        saliency_method = Saliency(problem)
        for start in range(0, len(points), chunk):
            part = slice(start, start + chunk)
            grads.append(saliency_method.attribute(points[part].clone().requires_grad_(), abs=False,
                                                   additional_forward_args=(row_of[part],)).detach().float())
    return torch.cat(grads)
