"""Shapley values at equal accuracy: CPU seconds to a target error, probe's estimators vs captum's.

Run by ``python benchmarks/bench_shapley.py --accuracy`` (see there for the options). Everything is
``builtin:minilm-rt`` on held-out rotten_tomatoes sentences, absent tokens replaced by [MASK], the
target the model's own (probe's default: the predicted class's probability) for every estimator:
captum's forward function puts the special tokens back around the players and evaluates the rows
with :func:`probe.rows.values.evaluate`, the function probe's engine runs.

1. **Short texts** (8-12 scorable tokens): the truth is probe's exact values (2^n coalitions). For
   each estimator and configuration the budget is doubled until the mean error, averaged over the
   examples and ``--seeds`` seeds, is at most ``--target`` (5%) of the value range (an example's
   error: mean |estimate - exact| over its players / (max - min of its exact values)); then one more
   budget is run between the last two (their geometric mean), and the time to the target is
   interpolated on log-log axes between the two budgets of that bracket on either side of it (the
   first budget that reached it is printed with its own time and error). Each run gets a fresh
   engine (no row cache carried over); seconds are ``time.process_time`` (CPU, all threads; torch's
   and numpy's BLAS both held to ``--threads``).
2. **Long texts** (``--long-tokens`` players, default 40): the truth is probe's regression estimate at
   ``--long-truth`` order-equivalents (default 128, its standard error and its own seconds printed);
   the same sweep with ``--long-seeds`` seeds (default 2), fewer configurations (see :func:`runners`),
   a budget's runs stopped past 150 s (then the time to the target is printed as "> seconds").

Estimators: probe ``permutation`` (budget: orders), ``kernel`` (order-equivalents: orders x (n + 1)
coalitions), ``auto`` (budget: ``target_se``, halved from 0.16; ``permutations`` 1024 the cap; short
texts only); captum ``ShapleyValueSampling`` (n_samples orders) at ``perturbations_per_eval`` 1, 4 and
16 (16 covers a whole order of <= 16 players: captum batches within one order only; 64 on long
texts) and ``KernelShap`` (n_samples coalitions, doubled from 2 (n + 1)) at ``perturbations_per_eval``
1, 16 and 64 (64 on long texts). captum's KernelShap fits its linear model with scikit-learn's
LinearRegression when scikit-learn is installed; without it, with the same weighted least squares
(intercept, captum's own sample weights) solved in torch.
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
    """Each configuration's runner and its doubling budgets. On long texts, fewer: probe's two
    estimators (``auto`` is the choice where the better one is unknown, and costs its pilot), captum's
    ``ShapleyValueSampling`` at 64 perturbations per forward (a whole order of up to 63 players in one
    batch: its best, as fewer only split the same order) and ``KernelShap`` at 64 (its best on short texts)."""
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
    }
    if not long:
        out["probe auto"] = (probe("auto"), [0.16 / 2 ** k for k in range(8)])

    def sampling(per_eval: int) -> Runner:
        def run(budget: float, seed: int) -> list[np.ndarray]:
            return _scorable(captum_sampling(pm, examples, mask, int(budget), per_eval, seed), examples)
        return run

    def kernel(per_eval: int) -> Runner:
        def run(budget: float, seed: int) -> list[np.ndarray]:
            return captum_kernel(pm, examples, mask, int(budget), per_eval, seed)
        return run

    for per_eval in ((64,) if long else (1, 4, 16)):
        out[f"captum ShapleyValueSampling ppe={per_eval}"] = (sampling(per_eval), orders)
    for per_eval in ((64,) if long else (1, 16, 64)):
        out[f"captum KernelShap ppe={per_eval}"] = (kernel(per_eval), [x * (n + 1) for x in orders])
    return out


def sweep(run: Runner, budgets: list[float], truth: list[np.ndarray], seeds: int, target: float,
          stop_seconds: float) -> list[tuple[float, float, float]]:
    """``(budget, mean CPU seconds, mean relative error)`` per budget until the error is at most
    ``target`` (or one budget's runs took more than ``stop_seconds``); then one more budget between
    the last two (their geometric mean, rounded where budgets are whole), so that the time to the
    target is interpolated over a step of about 1.4x rather than 2x. Every configuration gets the same."""
    ranges = [float(np.ptp(t)) for t in truth]

    def measure(budget: float) -> tuple[float, float, float]:
        seconds, errors = [], []
        for seed in range(seeds):
            started = time.process_time()
            found = run(budget, seed)
            seconds.append(time.process_time() - started)
            errors.append(np.mean([np.mean(np.abs(f - t)) / r for f, t, r in zip(found, truth, ranges)]))
        return budget, float(np.mean(seconds)), float(np.mean(errors))

    rows: list[tuple[float, float, float]] = []
    for budget in budgets:
        rows.append(measure(budget))
        if rows[-1][2] <= target or rows[-1][1] > stop_seconds:
            break
    if len(rows) >= 2 and rows[-1][2] <= target:
        low, high = rows[-2][0], rows[-1][0]
        middle = math.sqrt(low * high)
        if float(low).is_integer() and float(high).is_integer():
            middle = float(round(middle))
        if middle not in (low, high):
            rows.insert(len(rows) - 1, measure(middle))
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


def compare(configurations: dict[str, tuple[Runner, list[float]]], truth: list[np.ndarray], seeds: int,
            target: float, stop_seconds: float) -> None:
    """Sweep each configuration and print its row as it finishes (its time to the target, the first
    budget that reached it with its seconds and error, or the last budget run where none did), then
    the ratio of the best of each side."""
    print(f"  {'estimator':38s} {'s to target':>11s} {'budget':>8s} {'s there':>8s} {'error':>7s}", flush=True)
    times = {}
    for name, (run, budgets) in configurations.items():
        rows = sweep(run, budgets, truth, seeds, target, stop_seconds)
        times[name] = time_to_target(rows, target)
        budget, seconds, error = next((row for row in rows if row[2] <= target), rows[-1])
        shown = f"{times[name]:11.3f}" if math.isfinite(times[name]) else f"{'> ' + format(seconds, '.1f'):>11s}"
        print(f"  {name:38s} {shown} {budget:8.4g} {seconds:8.3f} {error:7.4f}", flush=True)
    probe_best = min((t, n) for n, t in times.items() if n.startswith("probe"))
    captum_best = min((t, n) for n, t in times.items() if n.startswith("captum"))
    print(f"  probe's best: {probe_best[1]} {probe_best[0]:.3f} s; captum's best: {captum_best[1]} "
          f"{captum_best[0]:.3f} s; probe is {captum_best[0] / probe_best[0]:.2f}x faster", flush=True)


def run_accuracy(args, load_texts: Callable, captum_sampling: Callable) -> None:
    from probe.models.loading import load_model

    pm = load_model("builtin:minilm-rt", device=args.device)
    mask = pm.tokenizer.mask_token_id
    examples = short_examples(pm, load_texts, args.n)
    lengths = [sum(not s for s in e.special) for e in examples]
    exact = shapley(Engine(pm), examples, "mask", exact_max=16)
    truth = _scorable(exact.scores, examples)
    print(f"short texts: minilm-rt, {len(examples)} sentences of {lengths} tokens, truth exact, mask replacement, "
          f"{args.seeds} seeds, target mean error <= {args.target:.0%} of the value range, {args.threads} thread(s)",
          flush=True)
    compare(runners(pm, examples, mask, False, captum_sampling), truth, args.seeds, args.target, 120.0)
    if args.n_long:
        run_long(pm, args, load_texts, captum_sampling)


def run_long(pm, args, load_texts: Callable, captum_sampling: Callable) -> None:
    """Long texts against probe's regression at ``--long-truth`` order-equivalents (its own standard
    error printed), ``--long-seeds`` seeds per budget, a budget's runs stopped past 150 s."""
    long = long_examples(pm, load_texts, args.n_long, args.long_tokens)
    started = time.process_time()
    reference = shapley(Engine(pm), long, "mask", exact_max=0, permutations=args.long_truth, estimator="kernel",
                        seed=99)
    truth = _scorable(reference.scores, long)
    se = [float(np.sqrt(np.nanmean(e.double().numpy() ** 2))) / float(np.ptp(t))
          for e, t in zip(reference.extras["standard_error"], truth)]
    print(f"long texts: {len(long)} of {args.long_tokens} tokens, truth probe kernel at {args.long_truth} x (n + 1) "
          f"coalitions ({time.process_time() - started:.0f} s; its rms standard error {max(se):.2%} of the value "
          f"range), {args.long_seeds} seed(s)", flush=True)
    configurations = runners(pm, long, pm.tokenizer.mask_token_id, True, captum_sampling)
    compare(configurations, truth, args.long_seeds, args.target, 150.0)

