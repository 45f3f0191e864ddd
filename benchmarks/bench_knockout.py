"""Benchmark: edge knockout with a causal LM's prefix reused vs every row run whole.

Prints figures measured in this one run (no asserts; the machine's load shows in the numbers):
``builtin:smollm2-135m``, N held-out rotten_tomatoes sentences in the smollm2_edges prompt, the
per-head knockout of the target row's edges (one row per layer x head x token, as the per-head causal
test runs it) over a window of layers, once with ``reuse_prefix=True`` (each text's tokens before the
target query run once as a cache; a row feeds one token) and once with every row run whole (the
baseline, what a row costs without the cache). Both give the same scores (the largest difference is
printed); rows, tokens fed and passes beside the seconds.

Usage:  python benchmarks/bench_knockout.py [--n 2] [--layers 12,13] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from probe.data import load_dataset  # noqa: E402
from probe.intervene.knockout import edge_knockout  # noqa: E402
from probe.models.loading import load_model  # noqa: E402
from probe.rows.prepare import prepare  # noqa: E402
from probe.rows.target import TargetSpec  # noqa: E402

PROMPT = "Review: {text}\nSentiment (positive or negative):"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--layers", default="12,13", help="comma-separated layers of the window")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.layers.split(",")]

    pm = load_model("builtin:smollm2-135m")
    texts = [PROMPT.format(text=e.text) for e in load_dataset("builtin:rotten_tomatoes", split="test", n=args.n)]
    examples = prepare(pm, texts, TargetSpec(continuation=" positive", contrast=" negative"))
    lengths = [len(e.input_ids) for e in examples]
    print(f"smollm2-135m, {args.n} prompts ({min(lengths)}-{max(lengths)} tokens), per-head knockout in layers "
          f"{layers} ({len(layers) * pm.contract.n_heads} heads), {args.threads} thread(s)")
    results, seconds = {}, {}
    for reuse in (True, False):
        started = time.perf_counter()
        results[reuse] = edge_knockout(pm, examples, layers=layers, per_head=True, reuse_prefix=reuse)
        seconds[reuse] = time.perf_counter() - started
        stats = results[reuse].stats
        print(f"  {'prefix reused' if reuse else 'rows whole   '}  {seconds[reuse]:8.2f} s   {stats['rows_run']} rows, "
              f"{stats['tokens_fed']} tokens fed, {stats['forward_passes']} passes")
    ratio = seconds[False] / seconds[True]
    diff = max(float((a - b).nan_to_num().abs().max()) for a, b in zip(results[True].per_head.scores,
                                                                        results[False].per_head.scores))
    print(f"prefix reuse is {ratio:.1f}x faster; largest |difference| of the per-head scores {diff:.2g}")


if __name__ == "__main__":
    main()
