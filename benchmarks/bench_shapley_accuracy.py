"""Shapley values at equal accuracy: CPU seconds to a target error, probe's estimators vs captum's.

Run by ``python benchmarks/bench_shapley.py --accuracy`` (see there for the options). Everything is
``builtin:minilm-rt`` on held-out rotten_tomatoes sentences, absent tokens replaced by [MASK], the
target the model's own (probe's default: the predicted class's probability) for every estimator:
captum's forward function puts the special tokens back around the players and evaluates the rows
with :func:`probe.rows.values.evaluate`, the function probe's engine runs.

1. **Short texts** (8-12 scorable tokens): the truth is probe's exact values (2^n coalitions). For
   each estimator and configuration the budget is doubled until the mean error, averaged over the
   examples and ``--seeds`` seeds, is at most ``--target`` (5%) of the value range (an example's
   error: mean |estimate - exact| over its players / (max - min of its exact values)). The time to
   the target is interpolated on log-log axes between the last budget above it and the first at or
   below it (the first budget's own time is printed beside it). Each run gets a fresh engine (no
   row cache carried over); seconds are ``time.process_time`` (CPU, all threads).
2. **Long texts** (``--long-tokens`` players): the truth is probe's regression estimate at a large
   budget (its standard error printed); the same sweep, fewer configurations.

Estimators: probe ``permutation`` (budget: orders), ``kernel`` (order-equivalents: orders x (n + 1)
coalitions), ``auto`` (budget: ``target_se``, halved from 0.16; ``permutations`` 1024 the cap);
captum ``ShapleyValueSampling`` (n_samples orders) at ``perturbations_per_eval`` 1, 4 and 16 (16 covers
a whole order of <= 16 players: captum batches within one order only) and ``KernelShap`` (n_samples
coalitions, doubled from 2 (n + 1)) at ``perturbations_per_eval`` 1, 16 and 64. captum's KernelShap
fits its linear model with scikit-learn's LinearRegression when scikit-learn is installed; without
it, with the same weighted least squares (intercept, captum's own sample weights) solved in torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from probe.intervene.engine import Engine
from probe.intervene.shapley import shapley
from probe.rows.prepare import prepare
from probe.rows.values import evaluate

Runner = Callable[[float, int], list[np.ndarray]]  # (budget, seed) -> per example [players] values


class _LeastSquares:
    """captum's interpretable model for KernelShap without scikit-learn: weighted least squares with
    an intercept (what its default, sklearn's LinearRegression, computes)."""

    def __init__(self) -> None:
        self.weights = torch.zeros(1, 0)

    def fit(self, data, **kwargs) -> None:
        xs, ys, ws = zip(*[(x, y, w) for x, y, w in data])
        x = torch.cat(xs).double()
        y = torch.cat(ys).double().reshape(len(x), -1)
        w = torch.cat(ws).double().reshape(-1, 1).sqrt()
        design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)  # [samples, features + 1]
        solution = torch.linalg.lstsq(design * w, y * w, driver="gelsd").solution  # [features + 1, outputs]
        self.weights = solution[:-1].T.float()  # [outputs, features]

    def representation(self) -> torch.Tensor:
        return self.weights


def _captum_forward(pm, example) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    ids = torch.tensor(example.input_ids)  # [tokens]
    scorable = ~torch.tensor(example.special)

    def forward(players: torch.Tensor) -> torch.Tensor:  # [batch, players] -> [batch]
        rows = ids.repeat(len(players), 1)  # [batch, tokens]
        rows[:, scorable] = players
        return evaluate(pm, [(row.tolist(), example) for row in rows]).cpu()

    return ids, scorable, forward


def captum_kernel(pm, examples, baseline: int, samples: int, per_eval: int, seed: int) -> list[np.ndarray]:
    """captum's KernelShap per example over its scorable token ids."""
    from captum.attr import KernelShap

    torch.manual_seed(seed)
    out = []
    for example in examples:
        ids, scorable, forward = _captum_forward(pm, example)
        explainer = KernelShap(forward)
        try:
            import sklearn  # noqa: F401
        except ImportError:
            explainer.interpretable_model = _LeastSquares()  # type: ignore[assignment]
        values = explainer.attribute(ids[scorable][None], baselines=baseline, n_samples=int(samples),
                                     perturbations_per_eval=per_eval)
        out.append(values[0].double().numpy())
    return out


def short_examples(pm, load_texts: Callable, n: int, low: int = 8, high: int = 12) -> list:
    """The first ``n`` held-out sentences of ``low``..``high`` scorable tokens."""
    examples = prepare(pm, load_texts(400))
    return [e for e in examples if low <= sum(not s for s in e.special) <= high][:n]


def long_examples(pm, load_texts: Callable, n: int, tokens: int) -> list:
    """``n`` texts of ``tokens`` scorable tokens: held-out sentences joined and cut."""
    ids = pm.tokenizer(" ".join(load_texts(60, skip=400)), add_special_tokens=False)["input_ids"]
    return prepare(pm, [pm.tokenizer.decode(ids[k * tokens:(k + 1) * tokens]) for k in range(n)])


def _scorable(values: Sequence[torch.Tensor], examples) -> list[np.ndarray]:
    return [v.double().numpy()[~np.array(e.special)] for v, e in zip(values, examples)]


def runners(pm, examples, mask: int, long: bool, captum_sampling: Callable) -> dict[str, tuple[Runner, list[float]]]:
    """Each configuration's runner and its doubling budgets."""
    n = max(sum(not s for s in e.special) for e in examples)

    def probe(estimator: str) -> Runner:
        def run(budget: float, seed: int) -> list[np.ndarray]:
            kwargs = dict(permutations=int(budget)) if estimator != "auto" else \
                dict(permutations=1024, target_se=float(budget))
            result = shapley(Engine(pm), examples, "mask", exact_max=0, seed=seed, estimator=estimator, **kwargs)
            return _scorable(result.scores, examples)
        return run

    orders = [2.0 * 2 ** k for k in range(10)]
    out: dict[str, tuple[Runner, list[float]]] = {
        "probe permutation": (probe("permutation"), orders),
        "probe kernel": (probe("kernel"), orders),
        "probe auto": (probe("auto"), [0.16 / 2 ** k for k in range(8)]),
    }
    for per_eval in ((16, 64) if long else (1, 4, 16)):
        out[f"captum ShapleyValueSampling ppe={per_eval}"] = (
            lambda b, s, p=per_eval: _scorable(captum_sampling(pm, examples, mask, int(b), p, s), examples), orders)
    for per_eval in ((64,) if long else (1, 16, 64)):
        out[f"captum KernelShap ppe={per_eval}"] = (
            lambda b, s, p=per_eval: captum_kernel(pm, examples, mask, int(b), p, s), [x * (n + 1) for x in orders])
    return out


def sweep(run: Runner, budgets: list[float], truth: list[np.ndarray], seeds: int, target: float,
          stop_seconds: float) -> list[tuple[float, float, float]]:
    """``(budget, mean CPU seconds, mean relative error)`` per budget until the error is at most
    ``target`` (or one budget's runs took more than ``stop_seconds``)."""
    ranges = [float(np.ptp(t)) for t in truth]
    rows = []
    for budget in budgets:
        seconds, errors = [], []
        for seed in range(seeds):
            started = time.process_time()
            found = run(budget, seed)
            seconds.append(time.process_time() - started)
            errors.append(np.mean([np.mean(np.abs(f - t)) / r for f, t, r in zip(found, truth, ranges)]))
        rows.append((budget, float(np.mean(seconds)), float(np.mean(errors))))
        if rows[-1][2] <= target or rows[-1][1] > stop_seconds:
            break
    return rows


def time_to_target(rows: list[tuple[float, float, float]], target: float) -> float:
    """Seconds at which the error reaches ``target``: log-log interpolation between the budgets on
    either side of it (the first budget's own seconds when it is already below); inf if never."""
    for k, (_, seconds, error) in enumerate(rows):
        if error <= target:
            if k == 0:
                return seconds
            _, before_s, before_e = rows[k - 1]
            share = (math.log(before_e) - math.log(target)) / (math.log(before_e) - math.log(max(error, 1e-12)))
            return math.exp(math.log(before_s) + share * (math.log(seconds) - math.log(before_s)))
    return math.inf


def table(results: dict[str, list[tuple[float, float, float]]], target: float) -> None:
    """Print each configuration's time to the target, the budget that reached it, and the ratio."""
    times = {name: time_to_target(rows, target) for name, rows in results.items()}
    print(f"  {'estimator':38s} {'s to target':>11s} {'budget':>8s} {'s there':>8s} {'error':>7s}")
    for name, rows in results.items():
        budget, seconds, error = rows[-1]
        print(f"  {name:38s} {times[name]:11.3f} {budget:8.4g} {seconds:8.3f} {error:7.4f}")
    probe_best = min((t, n) for n, t in times.items() if n.startswith("probe"))
    captum_best = min((t, n) for n, t in times.items() if n.startswith("captum"))
    print(f"  probe's best: {probe_best[1]} {probe_best[0]:.3f} s; captum's best: {captum_best[1]} "
          f"{captum_best[0]:.3f} s; probe is {captum_best[0] / probe_best[0]:.2f}x faster")


def run_accuracy(args, load_texts: Callable, captum_sampling: Callable) -> None:
    from probe.models.loading import load_model

    pm = load_model("builtin:minilm-rt", device=args.device)
    mask = pm.tokenizer.mask_token_id
    examples = short_examples(pm, load_texts, args.n)
    lengths = [sum(not s for s in e.special) for e in examples]
    exact = shapley(Engine(pm), examples, "mask", exact_max=16)
    truth = _scorable(exact.scores, examples)
    print(f"short texts: minilm-rt, {len(examples)} sentences of {lengths} tokens, truth exact, mask replacement, "
          f"{args.seeds} seeds, target mean error <= {args.target:.0%} of the value range, {args.threads} thread(s)")
    results = {name: sweep(run, budgets, truth, args.seeds, args.target, 120.0)
               for name, (run, budgets) in runners(pm, examples, mask, False, captum_sampling).items()}
    table(results, args.target)
    if args.n_long == 0:
        return
    long = long_examples(pm, load_texts, args.n_long, args.long_tokens)
    reference = shapley(Engine(pm), long, "mask", exact_max=0, permutations=256, estimator="kernel", seed=99)
    truth = _scorable(reference.scores, long)
    se = [float(np.sqrt(np.nanmean(e.double().numpy() ** 2))) / float(np.ptp(t))
          for e, t in zip(reference.extras["standard_error"], truth)]
    print(f"long texts: {len(long)} of {args.long_tokens} tokens, truth probe kernel at 256 x (n + 1) coalitions "
          f"(its rms standard error {max(se):.2%} of the value range), {args.seeds} seeds")
    results = {name: sweep(run, budgets, truth, args.seeds, args.target, 300.0)
               for name, (run, budgets) in runners(pm, long, mask, True, captum_sampling).items()}
    table(results, args.target)
