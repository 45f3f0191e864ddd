"""Benchmark: leave-one-out through probe's engine vs captum, and causal-LM prefix reuse.

Prints figures measured in this one run (no asserts; the machine's load shows in the numbers):

1. MiniLM classifier (``builtin:minilm-rt`` when its folder is built, else the raw MiniLM folder
   with a random head), N held-out rotten_tomatoes sentences: LOO by [MASK] with the engine vs
   captum ``FeatureAblation`` (one feature per position, baseline = the mask id) at
   ``perturbations_per_eval=1`` and at its best of a few larger values; times, ratios, max |diff|.
   captum ablates every position (special tokens included: it has no way to skip a feature), the
   engine only scorable ones; both row counts are printed.
2. SmolLM2-135M (``builtin:smollm2-135m``, only when its folder is built): LOO rows by replacement
   (the UNK id) evaluated with prefix reuse vs full recomputation of the same rows.

Usage:  python benchmarks/bench_loo.py [--n 200] [--n-lm 20] [--budget 8192] [--threads 1] [--repeat 1] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from probe.intervene.engine import Engine  # noqa: E402
from probe.intervene.rowcache import common_prefix  # noqa: E402
from probe.intervene.tokens import loo, scorable_positions  # noqa: E402
from probe.models.loading import load_model  # noqa: E402
from probe.rows.prepare import prepare  # noqa: E402
from probe.rows.values import evaluate  # noqa: E402


def load_texts(n: int) -> list[str]:
    """N held-out rotten_tomatoes sentences."""
    from probe.data import load_dataset

    return [e.text for e in load_dataset("builtin:rotten_tomatoes", split="test", n=n)]


def load_classifier(cache_dir: Path | None):
    return load_model("builtin:minilm-rt", cache_dir=cache_dir), "builtin:minilm-rt"


def captum_loo(pm, examples, baseline: int, perturbations_per_eval: int) -> list[torch.Tensor]:
    from captum.attr import FeatureAblation

    out = []
    for example in examples:
        def forward(ids: torch.Tensor, example=example) -> torch.Tensor:  # [batch, tokens] -> [batch]
            return evaluate(pm, [(row.tolist(), example) for row in ids])

        ids = torch.tensor([example.input_ids])  # [1, tokens]
        attribution = FeatureAblation(forward).attribute(
            ids, baselines=baseline, feature_mask=torch.arange(ids.shape[1])[None],
            perturbations_per_eval=perturbations_per_eval)
        out.append(attribution[0].double())
    return out


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def max_diff(ours, theirs, examples) -> float:
    worst = 0.0
    for a, b, example in zip(ours, theirs, examples):
        scored = [t for t in scorable_positions(example)]
        worst = max(worst, float((a[scored].double() - b[scored]).abs().max()))
    return worst


def bench_classifier(args) -> None:
    pm, label = load_classifier(args.cache_dir)
    texts = load_texts(args.n)
    examples = prepare(pm, texts)
    n_tokens = sum(len(e.input_ids) for e in examples)
    n_scorable = sum(len(scorable_positions(e)) for e in examples)
    print(f"== LOO by [MASK] on {label}: {len(examples)} rotten_tomatoes test sentences, "
          f"{n_tokens} tokens ({n_scorable} scorable)", flush=True)
    mask = pm.tokenizer.mask_token_id

    # warm-up (first calls pay one-off costs in both paths)
    loo(Engine(pm), examples[:2], "mask")
    captum_loo(pm, examples[:1], mask, 1)

    times: dict[str, list[float]] = {}
    diffs: dict[str, float] = {}
    for _ in range(args.repeat):  # interleaved, so that load changes hit every method alike
        engine = Engine(pm, token_budget=args.budget)
        ours, t = timed(lambda engine=engine: loo(engine, examples, "mask"))
        times.setdefault("engine", []).append(t)
        for ppe in [1, *args.ppe]:
            theirs, t = timed(lambda ppe=ppe: captum_loo(pm, examples, mask, ppe))
            times.setdefault(f"captum ppe={ppe}", []).append(t)
            diffs[f"captum ppe={ppe}"] = max_diff(ours.scores, theirs, examples)
    best = {name: min(ts) for name, ts in times.items()}
    print(f"engine          {best['engine']:8.2f} s  rows {engine.stats.rows_evaluated}  forward passes "
          f"{engine.stats.forward_passes}  padded tokens {engine.stats.padded_tokens}")
    for ppe in [1, *args.ppe]:
        name = f"captum ppe={ppe}"
        calls = "" if ppe > 1 else f"  rows {n_tokens + len(examples)}  forward passes {n_tokens + len(examples)}"
        print(f"{name:<15} {best[name]:8.2f} s  max|diff| {diffs[name]:.2e}{calls}")
    fastest = min((name for name in best if name != "captum ppe=1" and name != "engine"), key=best.get)
    print(f"speed-up vs captum ppe=1: {best['captum ppe=1'] / best['engine']:.2f}x   "
          f"vs captum best ({fastest}): {best[fastest] / best['engine']:.2f}x   "
          f"(best of {args.repeat} interleaved run(s))", flush=True)


def bench_prefix_reuse(args) -> None:
    pm = load_model("builtin:smollm2-135m", cache_dir=args.cache_dir)
    texts = load_texts(args.n_lm)
    examples = prepare(pm, texts)  # target: the greedy next token after each sentence
    replacement = pm.tokenizer.unk_token_id
    rows = []
    for example in examples:
        ids = list(example.input_ids)
        rows.append((ids, example))
        rows.extend((ids[:t] + [replacement] + ids[t + 1:], example) for t in scorable_positions(example))
    lengths = [len(ids) + len(e.target_ids) - 1 for ids, e in rows]  # fed tokens (not the last target token)
    # what reuse must feed at least: each original once, each other row from its first change on
    suffix_floor = sum(len(e.input_ids) + len(e.target_ids) - 1 for e in examples) + sum(
        len(ids) - min(common_prefix(ids, e.input_ids), len(ids) - 1) + len(e.target_ids) - 1
        for ids, e in rows if list(ids) != list(e.input_ids))
    print(f"== LOO by replacement (UNK) on builtin:smollm2-135m: {len(examples)} sentences, {len(rows)} rows, "
          f"mean row length {sum(lengths) / len(lengths):.1f} tokens", flush=True)
    Engine(pm).values(rows[:8], reuse_prefix=True)  # warm-up
    Engine(pm).values(rows[:8])
    t_full, t_reuse = [], []
    for _ in range(args.repeat):
        full_engine = Engine(pm, token_budget=args.budget)
        full, t = timed(lambda full_engine=full_engine: full_engine.values(rows))
        t_full.append(t)
        reuse_engine = Engine(pm, token_budget=args.budget)
        reused, t = timed(lambda reuse_engine=reuse_engine: reuse_engine.values(rows, reuse_prefix=True))
        t_reuse.append(t)
    print(f"full recomputation {min(t_full):8.2f} s  forward passes {full_engine.stats.forward_passes}  "
          f"padded tokens {full_engine.stats.padded_tokens}")
    print(f"prefix reuse       {min(t_reuse):8.2f} s  forward passes {reuse_engine.stats.forward_passes} "
          f"(prefix passes {reuse_engine.stats.prefix_passes})  padded tokens {reuse_engine.stats.padded_tokens}")
    print(f"unpadded tokens: full {sum(lengths)}, reuse {suffix_floor} "
          f"({suffix_floor / sum(lengths):.2f}x: the floor of the token ratio)")
    print(f"prefix reuse / full: {min(t_reuse) / min(t_full):.2f}x time, "
          f"{reuse_engine.stats.padded_tokens / full_engine.stats.padded_tokens:.2f}x tokens;  "
          f"max|diff| {float((reused - full).abs().max()):.2e}  (best of {args.repeat} interleaved run(s))",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="sentences for the classifier benchmark")
    parser.add_argument("--n-lm", type=int, default=20, help="sentences for the SmolLM2 benchmark")
    parser.add_argument("--budget", type=int, default=8192, help="engine token budget")
    parser.add_argument("--ppe", type=int, nargs="+", default=[8, 32, 64], help="captum perturbations_per_eval to try")
    parser.add_argument("--cache-dir", type=Path, default=None, help="built-in model cache (default: $PROBE_CACHE or "
                                                                     "the user cache)")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the best time is shown")
    parser.add_argument("--skip-lm", action="store_true")
    parser.add_argument("--skip-classifier", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 is steadier on a shared, loaded machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    torch.manual_seed(0)
    if not args.skip_classifier:
        bench_classifier(args)
    if not args.skip_lm:
        bench_prefix_reuse(args)


if __name__ == "__main__":
    main()
