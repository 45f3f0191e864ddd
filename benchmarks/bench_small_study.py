"""The small study a notebook runs (issue 43, item 2): 12 held-out sentences on builtin:minilm-rt, the
notebook's methods (head-mean attention and saliency against leave-one-out by deletion) and every
default besides (metrics: erasure, counterfactual attention, head ablation and importance; sanity
checks, statistics, report), the model already loaded as in a notebook. Prints the wall time of
each run.

    python benchmarks/bench_small_study.py [--n 12] [--runs 3] [--threads 2]

The bar (issue 43): under 30 s on 2 idle cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import probe

    pm = probe.load_model("builtin:minilm-rt")
    load = os.getloadavg()[0]
    spec = {"name": "small", "model": {"id": "builtin:minilm-rt"},
            "dataset": {"name": "builtin:rotten_tomatoes", "n": args.n, "seed": 0},
            "explainers": ["attention_mean", "saliency"], "references": ["loo_delete"]}
    times = []
    for run in range(args.runs):
        folder = tempfile.mkdtemp()
        started = time.perf_counter()
        result = probe.run_study(spec, out=folder + "/study", model=pm)
        times.append(time.perf_counter() - started)
        print(f"run {run + 1}: {times[-1]:.1f} s, answer {result.verdict.answer!r}", flush=True)
    print(f"builtin:minilm-rt, {args.n} examples, default metrics, {args.threads} threads, load {load:.1f} at start "
          f"and {os.getloadavg()[0]:.1f} at the end: {min(times):.1f}-{max(times):.1f} s wall per study")


if __name__ == "__main__":
    main()
