"""Explaining generated text token by token: probe against the naive floor and inseq, one workload.

Workload (issue 27, item 7): ``builtin:smollm2-135m``, N short prompts, the greedy output of T new
tokens of each, and for every generated token: saliency, integrated gradients (S points), head
attention of every layer at the token's query row, and leave-one-out by deletion of each prompt
token, each explaining log p(generated token | prompt, output before it).

Contenders, each in a fresh process (imports and model loading outside the clock), in interleaved
rounds:

* ``floor``  bare torch, per prompt and per generated token, unpadded: greedy generation; then per
             step one forward+backward for saliency, one batch of S interpolation points + one
             backward for IG (zero baseline, Riemann midpoints), one eager forward with attentions,
             and one batch of the prompt's n copies with a token deleted for LOO (equal lengths,
             no padding). What a capable user writes.
* ``probe``  ``probe.explain(pm, prompts, generate=T, methods=[saliency, integrated_gradients,
             attention, loo_delete])`` (IG with S Gauss-Legendre points): every output token is its
             own target. The output tokens of one prompt share its row: greedy outputs come from
             one left-padded batch, attention and the steps' values from one forward of each row,
             the gradient methods from one forward per point (fed through the key/value cache in
             pieces, so each output token's backward stops at its own position), and the
             interventions score each perturbed prompt once over the whole output.
* ``inseq``  inseq 0.7.1 on the same model object: ``saliency``, ``integrated_gradients``
             (n_steps=S), ``attention`` (an eager copy of the model: inseq reads
             ``output_attentions``) and ``occlusion`` (its leave-one-out) with ``generation_args``
             ``max_new_tokens=T``. inseq is not a dependency of probe: install it apart, e.g.
             ``pip install --no-deps --target /tmp/inseq_pkgs inseq==0.7.1 jaxtyping
             "typeguard<=2.13.3" treescope wadler_lindig``, and pass ``--inseq-path /tmp/inseq_pkgs``
             (skipped with a line when absent). Its occlusion replaces a token's embedding by a
             baseline instead of deleting the token: the same number of forwards.

    python benchmarks/bench_generation.py [--prompts 20] [--tokens 16] [--steps 16] [--rounds 1]
        [--threads 2] [--only floor,probe,inseq] [--inseq-path /tmp/inseq_pkgs]

Prints seconds per contender and round (and per method: probe's and the floor's generation apart,
inseq's each including its own generation), and the ratios to the floor and to inseq from the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system is",
    "The author of Romeo and Juliet is", "The chemical symbol for gold is", "The first man on the moon was",
    "This movie was a delight from start to finish. Overall it was", "The food was cold and the service was slow, so",
    "The tallest mountain on Earth is", "The speed of light is about", "A week has seven days and a year has",
    "The opposite of hot is", "Paris is to France as Rome is to", "The Great Wall is in",
    "I loved the acting but the plot was", "The sun rises in the", "Photosynthesis turns sunlight into",
    "The currency of Japan is the", "An octagon has", "The best thing about summer is",
]
MODEL = "builtin:smollm2-135m"


def _load_hf(attn_implementation: str = "sdpa"):
    import torch
    import transformers

    from probe.models.builtins import materialize_builtin

    folder = materialize_builtin(MODEL.split(":", 1)[1])
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation=attn_implementation).eval()
    return model, tok


def worker_floor(prompts: list[str], n_new: int, steps: int) -> dict:
    import torch

    model, tok = _load_hf("eager")
    emb = model.get_input_embeddings()
    methods = dict.fromkeys(("generate", "saliency", "integrated_gradients", "attention", "loo_delete"), 0.0)
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        methods[name] += now - clock[0]
        clock[0] = now

    started = time.perf_counter()
    for text in prompts:
        ids = tok(text, return_tensors="pt")["input_ids"]  # SmolLM2 adds no special tokens
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        n = ids.shape[1]
        lap("generate")
        for j, target in enumerate(out.tolist()):
            seq = torch.cat([ids[0], out[:j]])[None]  # [1, n + j]
            # saliency: |d log p / d e| per prompt token
            e = emb(seq).detach().requires_grad_(True)
            logp = torch.log_softmax(model(inputs_embeds=e).logits[0, -1], -1)[target]
            (grad,) = torch.autograd.grad(logp, e)
            _ = grad[0, :n].norm(dim=-1)
            lap("saliency")
            # integrated gradients: S midpoints from a zero baseline, one batch
            base = emb(seq).detach()
            alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
            points = (alphas[:, None, None] * base).requires_grad_(True)
            logp = torch.log_softmax(model(inputs_embeds=points).logits[:, -1], -1)[:, target].sum()
            (grad,) = torch.autograd.grad(logp, points)
            _ = (grad.mean(0) * base[0]).sum(-1)[:n]
            lap("integrated_gradients")
            with torch.no_grad():
                # attention of every layer and head at the query row predicting the token
                attentions = model(seq, output_attentions=True).attentions
                _ = torch.stack([a[0, :, -1, :n] for a in attentions])
                lap("attention")
                # leave-one-out by deletion: n copies of the sequence, each without one prompt token
                whole = torch.log_softmax(model(seq).logits[0, -1], -1)[target]
                rows = torch.stack([torch.cat([seq[0, :t], seq[0, t + 1:]]) for t in range(n)])
                _ = whole - torch.log_softmax(model(rows).logits[:, -1], -1)[:, target]
                lap("loo_delete")
    return {"seconds": time.perf_counter() - started, "methods": {k: round(v, 1) for k, v in methods.items()}}


def worker_probe(prompts: list[str], n_new: int, steps: int) -> dict:
    import probe

    pm = probe.load_model(MODEL)
    started = time.perf_counter()
    examples = probe.prepare(pm, prompts, generate=n_new)  # the greedy outputs, one example per output token
    methods = {"generate": time.perf_counter() - started}
    for method in ("saliency", "integrated_gradients", "attention", "loo_delete"):
        at = time.perf_counter()
        probe.explain(pm, examples, [method],
                      params={method: {"steps": steps}} if method == "integrated_gradients" else None)
        methods[method] = time.perf_counter() - at
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": len(examples), "methods": {k: round(v, 1) for k, v in methods.items()}}


def worker_inseq(prompts: list[str], n_new: int, steps: int) -> dict:
    import inseq

    model, tok = _load_hf("sdpa")
    eager, _ = _load_hf("eager")
    runs = [("saliency", model, {}), ("integrated_gradients", model, {"n_steps": steps}),
            ("attention", eager, {}), ("occlusion", model, {})]
    loaded = [(inseq.load_model(m, method, tokenizer=tok), kwargs) for method, m, kwargs in runs]
    started = time.perf_counter()
    n_tokens = 0
    methods = {}
    for (method, _, _), (attribution_model, kwargs) in zip(runs, loaded):
        at = time.perf_counter()
        out = attribution_model.attribute(prompts, generation_args={"max_new_tokens": n_new, "do_sample": False},
                                          show_progress=False, **kwargs)
        methods[method] = round(time.perf_counter() - at, 1)  # each includes its own greedy generation
        # a decoder-only model's target in inseq is the prompt and the generated tokens: the output
        # tokens, which probe counts, are what follows the source (the prompt)
        n_tokens = sum(len(s.target) - len(s.source) for s in out.sequence_attributions)
    return {"seconds": time.perf_counter() - started, "output_tokens": n_tokens, "methods": methods}


WORKERS = {"floor": worker_floor, "probe": worker_probe, "inseq": worker_inseq}


def _run(name: str, args) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if name == "inseq":
        if not args.inseq_path or not Path(args.inseq_path).is_dir():
            print("inseq: skipped (give --inseq-path, the folder inseq 0.7.1 was installed into)")
            return None
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.inseq_path, env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--worker", name, "--prompts", str(args.prompts), "--tokens", str(args.tokens),
               "--steps", str(args.steps), "--threads", str(args.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{name}: failed\n{done.stderr[-2000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="floor,probe,inseq")
    parser.add_argument("--inseq-path", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompts = PROMPTS[: args.prompts]
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(WORKERS[args.worker](prompts, args.tokens, args.steps)))
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    print(f"workload: {MODEL}, {len(prompts)} prompts, {args.tokens} generated tokens each; saliency, IG "
          f"({args.steps} points), attention, LOO by deletion per generated token; {args.threads} threads")
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            result = _run(name, args)
            if result is None:
                continue
            seconds[name].append(result["seconds"])
            extra = {k: v for k, v in result.items() if k != "seconds"}
            print(f"round {r}: {name:6s} {result['seconds']:8.1f} s {extra or ''}", flush=True)
    best = {n: min(v) for n, v in seconds.items() if v}
    for name, value in best.items():
        ratios = [f"{value / best[base]:.2f}x {base}" for base in ("floor", "inseq") if base in best and base != name]
        print(f"{name:6s} {value:8.1f} s  ({', '.join(ratios) or 'no baseline'})")
    if "probe" in best and "inseq" in best:
        print(f"probe is {best['inseq'] / best['probe']:.1f}x faster than inseq")


if __name__ == "__main__":
    main()
