"""The full method set against the floor of the model passes it needs, on builtin:minilm-rt.

Per run of N held-out sentences: capture ([CLS] row), saliency, input x gradient, integrated
gradients (50 steps), leave-one-out by [MASK], and erasure curves for three rankings (attention
at the last layer, integrated gradients, LOO) plus the random ranking. Every model call the
methods make is recorded (its inputs and whether it needed a backward pass); the floor is those
same calls replayed alone, plain forward (and backward where the method took one), in the same
run. The ratio total / floor is the overhead of everything that is not the model: captum, the
engine, bookkeeping.

    python benchmarks/bench_methods.py [--n 200] [--steps 50]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model", default="builtin:minilm-rt")
    args = parser.parse_args()

    import torch

    from probe.data import load_dataset
    from probe.intervene.engine import Engine
    from probe.intervene.erasure import erasure
    from probe.methods import run_method
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare

    torch.manual_seed(0)
    pm = load_model(args.model)
    texts = [e.text for e in load_dataset("builtin:rotten_tomatoes", split="test", n=args.n, seed=0)]
    examples = prepare(pm, texts)
    print(f"{args.model}: {len(examples)} sentences, {sum(len(e.input_ids) for e in examples)} tokens, "
          f"IG {args.steps} steps, {torch.get_num_threads()} threads")

    # Warm-up: first autograd and first forward pay one-off costs the replay would not.
    run_method(pm, examples[:2], "saliency")
    run_method(pm, examples[:2], "attention")

    calls = []

    def record(module, positional, kwargs):
        entry = {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        calls.append((entry, torch.is_grad_enabled()))

    handle = pm.model.register_forward_pre_hook(record, with_kwargs=True)
    timings = {}
    engine = Engine(pm)
    plan = [
        ("capture", "attention", {}),
        ("saliency", "saliency", {}),
        ("input_x_gradient", "input_x_gradient", {}),
        ("integrated_gradients", "integrated_gradients", {"steps": args.steps}),
        ("loo_mask", "loo_mask", {}),
    ]
    results = {}
    call_ranges = {}
    try:
        for label, method, params in plan:
            first = len(calls)
            started = time.perf_counter()
            results[label] = run_method(pm, examples, method, engine=engine, params=params)
            timings[label] = time.perf_counter() - started
            call_ranges[label] = (first, len(calls))
        rankings = {
            "attention": [s[-1].mean(dim=0) for s in results["capture"].scores],
            "integrated_gradients": results["integrated_gradients"].scores,
            "loo_mask": results["loo_mask"].scores,
        }
        first = len(calls)
        started = time.perf_counter()
        erasure(engine, examples, rankings, flips=False)
        timings["erasure (3 rankings + random)"] = time.perf_counter() - started
        call_ranges["erasure (3 rankings + random)"] = (first, len(calls))
    finally:
        handle.remove()

    def replay(entries):
        started = time.perf_counter()
        for inputs, needs_grad in entries:
            if needs_grad:
                inputs = dict(inputs)
                if "inputs_embeds" in inputs:
                    inputs["inputs_embeds"] = inputs["inputs_embeds"].requires_grad_(True)
                    out = pm.model(**inputs).logits
                    # gradients for the inputs only, as the explainers take them (no parameter grads)
                    torch.autograd.grad(out.float().sum(), inputs["inputs_embeds"])
                continue
            with torch.no_grad():
                pm.model(**inputs)
        return time.perf_counter() - started

    floors = {label: replay(calls[a:b]) for label, (a, b) in call_ranges.items()}
    total, floor = sum(timings.values()), sum(floors.values())
    print(f"{'step':<32}{'ours (s)':>10}{'floor (s)':>11}{'ratio':>8}{'passes':>8}")
    for label in timings:
        a, b = call_ranges[label]
        print(f"{label:<32}{timings[label]:>10.2f}{floors[label]:>11.2f}{timings[label] / max(floors[label], 1e-9):>8.2f}{b - a:>8}")
    print(f"{'all methods':<32}{total:>10.2f}{floor:>11.2f}{total / floor:>8.2f}{len(calls):>8}")
    print(f"engine: {engine.stats.as_dict()}")


if __name__ == "__main__":
    main()
