"""7B shapes (issue 64): every registered method's seconds and peak memory on a random-weight model of a
real 7-8B shape (probe.models.shapes: Llama-3-8B, Mistral-7B v0.1, Qwen2-7B; bf16; built on the device,
nothing downloaded), at 512 and 4,096 tokens. Run by tests/gpu/run.sh on a lent GPU (the section ``seven_b``)
and, the same code path at a few layers, on the CPU as the dry run:

    python tests/gpu/seven_b.py                                   # a GPU: full depth, 512 and 4,096 tokens
    python tests/gpu/seven_b.py --device cpu --layers 2 --tokens 64            # the dry run
    python tests/gpu/seven_b.py --device cpu --layers 1 2 --tokens 64 --predict  # and the predictions

Each method runs once on one text of random words, at small settings so that the GPU section keeps within
about 8 minutes on an H100: integrated gradients at 16 points, GradientSHAP at 4 samples, the sampled
leave-one-out variants at 2 draws, Shapley values at 2 sampled orders (antithetic: 4 permutations' rows)
of every token, edge knockout per head in the last layer only. Before a method runs, the plan's row count
(``probe.study.cost.method_rows``) times the measured forward's seconds predicts its time; a method
predicted past ``--cap`` seconds or past what is left of ``--budget`` is not run and says so. A method
that runs out of memory is recorded as OOM and the next one runs. Every result is checked: one score row
per token (per layer and head where the method has them), finite wherever the method scores a token.

``--predict`` turns the measured rows into the plan's predictions for the full shape (``--predict-layers``,
default the shape's own depth) at ``--predict-tokens``: each method's seconds at its measured depths fitted
as fixed + per-layer (two depths) or taken as all per-layer (one), scaled by the method's counted rows and
the plan's per-row weight ``T (6 d + T)`` (probe.study.cost.row_weight); on a GPU by the ratio of the CPU's
measured forward throughput to an assumed achieved ``--gpu-tflops``. Memory: the weights exactly, plus the
measured activation peak scaled linearly with the tokens (and with the layers for gradients, whose backward
keeps every layer). These are predictions; the JSON and the tables mark them so.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: settings below the defaults, so that one 7B pass of every method fits the GPU section's minutes
SETTINGS = {"integrated_gradients": {"steps": 16}, "gradient_shap": {"n_samples": 4}, "loo_random": {"k": 2},
            "loo_lm": {"k": 2}, "shapley": {"exact_max": 0, "permutations": 2}}
#: methods whose rows, in a causal LM, feed one token each (the target query's row, edited) against the
#: example's other tokens cached once (knockout's prefix reuse): a row costs a token's pass, not the text's
ONE_TOKEN_ROWS = ("knockout",)
GIB = 2**30


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from probe.models.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--layers", type=int, nargs="+", default=[None], help="decoder layers (default: the shape's)")
    p.add_argument("--heads", type=int, default=None, help="query heads, cut (default: the shape's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary, cut (default: the shape's)")
    p.add_argument("--attn", default="eager", help="attention implementation: eager (default) or sdpa")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--methods", nargs="*", default=None, help="only these methods")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all the methods together")
    p.add_argument("--cap", type=float, default=None, help="the most seconds one method is predicted to take "
                   "(default 150 on a GPU, unlimited on the CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--predict", action="store_true", help="predict the full shape from the measured rows")
    p.add_argument("--predict-layers", type=int, default=None)
    p.add_argument("--predict-tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--gpu-tflops", type=float, default=400.0, help="assumed achieved bf16 TFLOP/s on the GPU")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if args.cap is None:
        args.cap = 150.0 if args.device.startswith("cuda") else math.inf
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(pm, name: str, fn):
    """((wall seconds, the process's CPU seconds, the largest model call's tokens), peak bytes above the
    start, fn's result) through the
    plan's StepMeter: CUDA's peak allocation, or the process's resident set sampled every 2 ms on a CPU.
    On a CPU at one thread the CPU seconds are the work's own, whatever else the machine runs."""
    from probe.study.meter import StepMeter

    device = torch.device(pm.device)
    sync(device)
    with StepMeter(pm) as meter:
        meter.on_step(name)
        began, busy = time.perf_counter(), time.process_time()
        result = fn()
        sync(device)
        seconds, busy = time.perf_counter() - began, time.process_time() - busy
    return (seconds, busy, meter.call_tokens.get(name, 0)), meter.peak.get(name, 0), result


def forward(pm, examples) -> None:
    """One plain forward of the examples (no gradients; only the last position's logits where the
    model can keep fewer), the unit every prediction here is in."""
    from probe.rows.forward import forward_accepts

    ids = torch.tensor([e.input_ids for e in examples], device=pm.device)
    extra = {"logits_to_keep": 1} if forward_accepts(pm.model, "logits_to_keep") else {}
    with torch.no_grad():
        pm.model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra)


def forward_flops(config, tokens: int) -> float:
    """A forward's multiply-adds x 2 over ``tokens`` tokens: every layer's projections and MLP, the
    attention's scores and weighted values, and one position's output head."""
    from probe.models.shapes import parameter_count

    d, vocab = config.hidden_size, config.vocab_size
    layers = config.num_hidden_layers
    per_layer = (parameter_count(config) - 2 * vocab * d - d) / layers
    attention = 4 * tokens * tokens * config.num_attention_heads * config.head_dim
    return layers * (2 * per_layer * tokens + attention) + 2 * d * vocab


def chosen_methods(pm, examples, only) -> list[tuple[str, dict | None, str | None]]:
    """(method, params, why it does not run or None) for every registered method, in the registry's order."""
    from probe import registry
    from probe.methods import applicable_methods

    _, skipped = applicable_methods(pm, examples)
    out = []
    for entry in registry.methods():
        name = entry.name
        if only and name not in only:
            continue
        params = SETTINGS.get(name)
        if name == "knockout":
            params = {"per_head": True, "layers": [-1]}  # the last layer, at any depth
        reason = skipped.get(name)
        by_name = reason is not None and reason == entry.applies.by_name  # run only when asked: asked here
        out.append((name, params, None if by_name else reason))
    return out


def predicted_seconds(pm, name: str, params, example, forward_s: float) -> float:
    """The plan's count of the method's rows on ``example`` times one forward's seconds (a backward row
    counted as three forwards): an upper bound where the engine reuses a causal prefix."""
    from probe.study.cost import method_rows

    rows = method_rows(pm, name, params, example)
    share = 1 / len(example.input_ids) if name in ONE_TOKEN_ROWS else 1.0
    return math.nan if rows is None else (rows[0] + 3 * rows[1]) * forward_s * share


def check_scores(result, examples) -> str:
    """'ok', or what is wrong: one score per token on the last axis, finite at every scored token."""
    for scores, example in zip(result.scores, examples):
        tokens = len(example.input_ids)
        if scores.shape[-1] != tokens:
            return f"shape {tuple(scores.shape)}: the last axis is not the {tokens} tokens"
        scored = scores[..., [not s for s in example.special]]
        finite = torch.isfinite(scored)
        if not bool(finite.all()):
            return f"{int((~finite).sum())} of {finite.numel()} scores at scored tokens not finite"
    return "ok"


def warm_gradients(pm, examples) -> None:
    """One backward, not measured: the first gradient method would pay the one-time costs (imports,
    the backward's first allocation) that a run pays once."""
    from probe.methods import run_method

    try:
        run_method(pm, examples[:1], "saliency")
    except Exception:  # noqa: BLE001 - a warm-up; the measured call reports any failure
        pass


def run_one(pm, name: str, params, examples) -> dict:
    from probe.methods import run_method

    try:
        (seconds, busy, call), peak, result = measure(pm, name, lambda: run_method(pm, examples, name,
                                                                                   params=params))
    except Exception as exc:  # one method's failure, memory above all, is a row of the table, not the end
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
        if torch.device(pm.device).type == "cuda":
            torch.cuda.empty_cache()
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        return {"status": "OOM" if oom else "error", "detail": f"{type(exc).__name__}: {first}"}
    shape = list(result.scores[0].shape)
    return {"status": check_scores(result, examples), "seconds": seconds, "cpu_seconds": busy, "peak_gib": peak / GIB,
            "call_tokens": call, "shape": shape}


def run_length(pm, tokens: int, args, deadline: float) -> list[dict]:
    """Every method at ``tokens`` tokens on ``pm``: one row each."""
    from probe.models.shapes import shape_texts
    from probe.rows.prepare import prepare

    examples = prepare(pm, shape_texts(pm, tokens))
    forward(pm, examples)  # the kernels' first call, not measured
    warm_gradients(pm, examples)
    runs = sorted((measure(pm, "forward", lambda: forward(pm, examples)) for _ in range(3)), key=lambda m: m[0])
    (forward_s, forward_busy, call), forward_peak, _ = runs[1]  # the median of three
    base = {"model": pm.name, "layers": pm.contract.n_layers, "tokens": tokens}
    rows = [{**base, "method": "forward", "status": "ok", "seconds": forward_s, "cpu_seconds": forward_busy,
             "call_tokens": call, "peak_gib": max(m[1] for m in runs) / GIB,
             "flops": forward_flops(pm.model.config, tokens)}]
    say(rows[-1])
    for name, params, reason in chosen_methods(pm, examples, args.methods):
        row = {**base, "method": name, "params": params}
        guess = predicted_seconds(pm, name, params, examples[0], forward_s) if reason is None else math.nan
        left = deadline - time.perf_counter()
        if reason is not None:
            row.update(status="not applicable", detail=reason)
        elif guess > min(args.cap, left):
            row.update(status="not run", detail=f"predicted {guess:.0f} s by its rows, over the "
                       f"{'cap' if args.cap < left else 'time left'} ({min(args.cap, left):.0f} s)", predicted=guess)
        else:
            row.update(run_one(pm, name, params, examples), predicted=guess)
        rows.append(row)
        say(row)
    return rows


def say(row: dict) -> None:
    if "seconds" in row:
        print(f"{row['status'].upper():<4}  {row['layers']} layers, {row['tokens']} tokens {row['method']}: "
              f"{row['seconds']:.2f} s ({row['cpu_seconds']:.2f} s of CPU), peak {row['peak_gib']:.2f} GiB", flush=True)
    else:
        print(f"{row['status'].upper()}  {row['layers']} layers, {row['tokens']} tokens {row['method']}: "
              f"{row.get('detail', '')}", flush=True)


def measured_runs(args) -> tuple[list[dict], dict]:
    """Build the model at each of ``--layers`` and run every length; the rows and each model's figures."""
    from probe.models.shapes import shape_model

    deadline = time.perf_counter() + args.budget
    rows, models = [], {}
    for layers in args.layers:
        began = time.perf_counter()
        pm = shape_model(args.shape, layers=layers, heads=args.heads, vocab=args.vocab, device=args.device,
                         dtype=args.dtype, attn_implementation=args.attn)
        sync(torch.device(pm.device))
        weights = sum(p.numel() * p.element_size() for p in pm.model.parameters())
        models[pm.name] = {**pm.metadata, "build_seconds": time.perf_counter() - began, "weights_gib": weights / GIB,
                           "hidden": pm.model.config.hidden_size, "kv_heads": pm.contract.n_kv_heads,
                           "dtype": str(pm.contract.dtype), "implementation": pm.contract.implementation}
        print(f"built {pm!r} in {models[pm.name]['build_seconds']:.1f} s, weights {weights / GIB:.2f} GiB",
              flush=True)
        for tokens in args.tokens:
            rows += run_length(pm, tokens, args, deadline)
            if args.json:  # so far, in case the call is cut off
                Path(args.json).write_text(json.dumps({"measured": rows, "models": models, "partial": True},
                                                      default=str) + "\n")
        del pm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows, models


def environment(args) -> dict:
    import transformers

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": torch.cuda.get_device_name(0) if cuda else
            f"cpu ({platform.processor() or platform.machine()})", "threads": torch.get_num_threads(),
            "command": " ".join(["python", "tests/gpu/seven_b.py", *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("SKIP  seven_b: no CUDA device (--device cpu for the dry run)", flush=True)
        return 0
    env = environment(args)
    print(" ".join(f"{k} {v}," for k, v in env.items()), flush=True)
    rows, models = measured_runs(args)
    out = {"environment": env, "measured": rows, "models": models, "settings": SETTINGS}
    if args.json:  # the measured rows are kept whatever the predictions do
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.predict:
        from seven_b_predict import predictions

        out["predictions"] = predictions(args, rows, models)
    bad = [r for r in rows if r["status"] not in ("ok", "OOM", "not run", "not applicable")]
    for r in bad:
        print(f"FAIL  {r['tokens']} tokens {r['method']}: {r['status']} {r.get('detail', '')}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"seven_b: {len(rows)} rows, {len(bad)} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
