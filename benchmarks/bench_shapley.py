"""Benchmark: sampled Shapley values through probe's engine vs captum's ShapleyValueSampling.

Prints figures measured in this one run (no asserts; the machine's load shows in the numbers):

1. ``builtin:minilm-rt``, N held-out rotten_tomatoes sentences, P permutations each, absent tokens
   replaced by [MASK]: probe's ``shapley`` (``exact_max=0``: sampled, P orders in antithetic pairs)
   vs captum ``ShapleyValueSampling(n_samples=P)`` with one feature per scorable token (the special
   tokens put back by the forward function, as probe keeps them), at captum's default
   ``perturbations_per_eval=1`` and at 64. Both draw P orders (captum's own, not the same ones), so
   the values differ by sampling noise: the mean |difference| is printed beside probe's mean standard
   error. Rows: probe's distinct coalitions vs captum's P x (players + 1) evaluations.
2. The same model on 64-token inputs (sentences joined and cut to 64 scorable tokens) at 200
   permutations: probe's seconds per example.

Usage:  python benchmarks/bench_shapley.py [--n 8] [--permutations 50] [--n-long 2] [--threads 1]
            [--device cpu|cuda]
        python benchmarks/bench_shapley.py --accuracy [--n 4] [--seeds 3] [--n-long 1] [--long-tokens 40]
            [--long-seeds 2] [--long-truth 128] [--threads 1]

``--accuracy`` measures time at equal accuracy instead (:mod:`bench_shapley_accuracy`): the CPU
seconds each estimator needs to bring the mean error down to 5% of the value range, on texts of at
most 12 tokens against their exact values, and on long texts against a high-budget estimate.

``--device cuda`` runs both sides on the GPU (the model there; captum's coalitions still built on
the CPU and handed to the same forward function, as a captum user's would be), each timing closed
by a synchronisation. On CPU the two sides do the same arithmetic and probe wins by its packing
only (1.0x against captum's 64 perturbations per forward, 2.0-2.7x against its default of one); the
gap the issue asks for (5x) is the GPU's, where captum's small sequential batches leave it idle.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _threads_asked(argv: list[str], default: str = "1") -> str:
    """``--threads`` from the command line, read before numpy is imported (see below)."""
    for k, arg in enumerate(argv):
        if arg == "--threads" and k + 1 < len(argv):
            return argv[k + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return default


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# numpy's BLAS (probe's regression and its size game; captum's side solves in torch) reads its thread
# count once, at import: held to --threads as torch's is, so that both sides run on the same threads
# and process time counts no BLAS thread spinning beside them
os.environ.setdefault("OPENBLAS_NUM_THREADS", _threads_asked(sys.argv))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from probe.intervene.engine import Engine  # noqa: E402
from probe.intervene.shapley import shapley  # noqa: E402
from probe.models.loading import load_model  # noqa: E402
from probe.rows.prepare import prepare  # noqa: E402
from probe.rows.values import evaluate  # noqa: E402


def load_texts(n: int, skip: int = 0) -> list[str]:
    from probe.data import load_dataset

    return [e.text for e in load_dataset("builtin:rotten_tomatoes", split="test", n=n + skip)][skip:]


def captum_sampling(pm, examples, baseline: int, permutations: int, per_eval: int, seed: int) -> list[torch.Tensor]:
    """captum's ShapleyValueSampling per example over its scorable token ids."""
    from captum.attr import ShapleyValueSampling

    torch.manual_seed(seed)
    out = []
    for example in examples:
        ids = torch.tensor(example.input_ids)  # [tokens]
        scorable = ~torch.tensor(example.special)

        def forward(players: torch.Tensor, ids=ids, scorable=scorable, example=example) -> torch.Tensor:
            rows = ids.repeat(len(players), 1)  # [batch, tokens]
            rows[:, scorable] = players
            return evaluate(pm, [(row.tolist(), example) for row in rows]).cpu()  # captum's tensors stay on the CPU

        values = ShapleyValueSampling(forward).attribute(ids[scorable][None], baselines=baseline,
                                                         n_samples=permutations, perturbations_per_eval=per_eval)
        full = torch.full((len(ids),), float("nan"), dtype=torch.float64)
        full[scorable] = values[0].double()
        out.append(full)
    return out


def _clock(device: str):
    """Seconds now, after the device's queued work is done (CUDA runs asynchronously)."""
    def now() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--permutations", type=int, default=50)
    parser.add_argument("--n-long", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--accuracy", action="store_true", help="time to a target error (bench_shapley_accuracy)")
    parser.add_argument("--seeds", type=int, default=3, help="--accuracy: seeds per budget")
    parser.add_argument("--long-tokens", type=int, default=40, help="--accuracy: players of a long text")
    parser.add_argument("--long-seeds", type=int, default=2, help="--accuracy: seeds per budget on long texts")
    parser.add_argument("--long-truth", type=int, default=128,
                        help="--accuracy: order-equivalents of the long texts' reference (probe kernel)")
    parser.add_argument("--target", type=float, default=0.05, help="--accuracy: mean error / value range")
    return parser


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    if args.accuracy:
        from bench_shapley_accuracy import run_accuracy

        run_accuracy(args, load_texts, captum_sampling)
        return

    pm = load_model("builtin:minilm-rt", device=args.device)
    clock = _clock(args.device)
    examples = prepare(pm, load_texts(args.n))
    players = [sum(not s for s in e.special) for e in examples]
    mask = pm.tokenizer.mask_token_id
    print(f"minilm-rt, {args.n} sentences ({min(players)}-{max(players)} tokens), {args.permutations} permutations, "
          f"mask replacement, {args.device}, {args.threads} thread(s)")

    started = clock()
    ours = shapley(Engine(pm), examples, "mask", exact_max=0, permutations=args.permutations, seed=0)
    probe_s = clock() - started
    se = float(np.nanmean(np.concatenate([e.numpy() for e in ours.extras["standard_error"]])))
    print(f"  probe shapley          {probe_s:8.2f} s   {sum(ours.extras['coalitions'])} distinct coalitions, "
          f"{ours.extras['forward_passes']} forward passes, mean standard error {se:.4f}")

    for per_eval in (1, 64):
        started = clock()
        theirs = captum_sampling(pm, examples, mask, args.permutations, per_eval, seed=0)
        captum_s = clock() - started
        diff = float(np.nanmean(np.concatenate([(a.double() - b).abs().numpy()
                                                for a, b in zip(ours.scores, theirs)])))
        evaluations = sum(args.permutations * (p + 1) for p in players)
        print(f"  captum per_eval={per_eval:<3}   {captum_s:8.2f} s   {evaluations} evaluations; probe is "
              f"{captum_s / probe_s:5.1f}x faster; mean |probe - captum| {diff:.4f} (sampling noise of both)")

    if args.n_long == 0:
        return
    # 64-token inputs at 200 permutations
    joined = " ".join(load_texts(40, skip=args.n))
    long_examples = []
    for k in range(args.n_long):
        ids = pm.tokenizer(joined, add_special_tokens=False)["input_ids"][k * 64:(k + 1) * 64]
        long_examples.append(pm.tokenizer.decode(ids))
    long = prepare(pm, long_examples)
    lengths = [sum(not s for s in e.special) for e in long]
    started = clock()
    result = shapley(Engine(pm), long, "mask", exact_max=0, permutations=200, seed=0)
    seconds = clock() - started
    print(f"64-token inputs ({lengths} tokens), 200 permutations: {seconds / len(long):.1f} s per example, "
          f"{sum(result.extras['coalitions']) // len(long)} distinct coalitions per example, max |efficiency delta| "
          f"{max(abs(d) for d in result.extras['efficiency_delta']):.1e}")


if __name__ == "__main__":
    main()
