"""Benchmark: what the largest accepted value of a parameter that multiplies work costs.

Each case runs ``probe.explain`` with one method at the top of its declared range
(:mod:`probe.registry.params`) on two texts of 46 words (the issue's inputs), in a process of its
own, and prints the seconds (model load excluded) and the process's peak resident memory (model
included). ``--case NAME`` runs one case; ``--list`` lists them. No asserts: the figures are the
machine's at the time (docs/reference/limits.md states where they were measured).

Usage:  python benchmarks/bench_limits.py [--model builtin:minilm-rt] [--case shapley_permutations ...]
        python benchmarks/bench_limits.py --model PRETRAINED_MINILM_FOLDER --random-head  (the same
        MiniLM-L6 architecture, where the built-in is not built yet)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = ("the film is a slow and tender portrait of two brothers who never quite say what they mean and "
         "the camera lingers on every silence until the quiet becomes its own kind of drama that some will "
         "find moving and others merely tedious while the rest of us wait").split()
#: two texts of 46 words each, as the issue's
TEXTS = [" ".join(WORDS[:46]), " ".join((WORDS[2:] + WORDS[:2])[:46])]

#: case -> (method, params): each at the largest value its declaration accepts
CASES = {
    "shapley_permutations": ("shapley", {"exact_max": 0, "permutations": 1024}),
    "shapley_exact_max": ("shapley", {"exact_max": 16, "units": "word"}),
    # not a limit: the default, for the rows per second of the model (the largest value's rows over it)
    "shapley_default": ("shapley", {"exact_max": 0, "permutations": 64}),
    "integrated_gradients_steps": ("integrated_gradients", {"steps": 1024}),
    "gradient_shap_n_samples": ("gradient_shap", {"n_samples": 1024}),
    "loo_random_k": ("loo_random", {"k": 256}),
    # flow solves a max-flow per layer and token: its cap bounds the input, so it runs on a text of 254 tokens
    "flow_max_tokens": ("flow", {"max_tokens": 256}),
    # the counterfactual attention of the last layer (probe.counterfactual_attention), at their caps
    "permuted_n": ("permuted", {"n": 10_000}),
    "adversarial_candidates_steps": ("adversarial", {"candidates": 64, "steps": 1000}),
}
#: the cases run through probe.counterfactual_attention rather than probe.explain
COUNTERFACTUAL = ("permuted", "adversarial")


def _one(model: str, case: str, random_head: bool) -> dict:
    import probe

    method, params = CASES[case]
    texts = TEXTS
    if case == "shapley_exact_max":  # exact on 16 words: the cap's 2^16 coalitions per example
        texts = [" ".join(t.split()[:16]) for t in TEXTS]
    pm = (probe.load_model(model, task="classification", allow_random_weights=True) if random_head
          else probe.load_model(model))
    if case == "flow_max_tokens":  # as long as the cap allows: 254 words of one token each, [CLS] and [SEP]
        tokens = pm.tokenizer(TEXTS[0])["input_ids"]
        texts = [pm.tokenizer.decode((tokens[1:-1] * 8)[:254])]
    started = time.perf_counter()
    if method in COUNTERFACTUAL:
        probe.counterfactual_attention(pm, texts, method, layer=-1, **params)
        rows = None
    else:
        rows = probe.explain(pm, texts, method, params={method: params})[method].extras.get("rows_evaluated")
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"case": case, "method": method, "params": params, "seconds": round(seconds, 1), "peak_mib": round(peak),
            "examples": len(texts), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:minilm-rt")
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--random-head", action="store_true",
                        help="load --model (a folder) as a classifier with a random head: the built-in's cost")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{k}: {m} {p}" for k, (m, p) in CASES.items()))
        return
    if args.inside:
        print(json.dumps(_one(args.model, args.inside, args.random_head)))
        return
    for case in args.case or list(CASES):
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--inside", case]
                              + (["--random-head"] if args.random_head else []),
                              capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else f"{case}: failed: {done.stderr[-300:]}",
              flush=True)


if __name__ == "__main__":
    main()
