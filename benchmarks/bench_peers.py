"""probe's study against the naive floor in bare torch, ferret and captum, on one workload.

The default workload (issue 18), on N held-out rotten_tomatoes sentences and ``builtin:minilm-rt``:
head-mean attention, saliency, input x gradient, integrated gradients (S Gauss-Legendre steps from
the pad embedding), leave-one-out by [MASK], comprehensiveness and sufficiency at 10, 20, ..., 100%
for the three gradient rankings, Kendall tau of each ranking against LOO.

Two more workloads (issue 18, item 4: scale with length; benchmarks/peers_workloads.py):

* ``--length L``: N held-out imdb reviews of at least L tokens, each cut to its first L-2
  wordpieces and decoded back to text (about L tokens again; the header prints mean/min/max). Every
  contender gets these texts; probe's study reads them from a CSV in the work dir (a generated copy
  of the study: dataset = that file, max_length = the longest text, token budget 16384 so that one
  LOO row set of a 128-token text is one pass). The floor splits its batches by the same budget
  (4096 tokens per forward+backward, as probe's gradients do), since a 512-token LOO batch of 510
  rows would not fit in memory; the default workload runs every batch whole, as before.
* ``--model builtin:smollm2-135m``: the causal LM. Target log p(greedy next token | text) (probe's
  default for a causal LM); head-mean last-layer attention of the last position; gradients at the
  word embeddings (probe's site for a model without an embeddings module); IG from the pad
  embedding (<|im_end|>, SmolLM2's pad); LOO by deletion (no mask token); erasure by deletion, flips
  off. Study: benchmarks/peers_study_smollm2.yaml; probe's engine reuses each text's causal prefix
  for the LOO and erasure rows. ferret (classifiers only) and captum are skipped with a printed line.
  Combines with ``--length`` (cut with SmolLM2's tokenizer, which adds no special tokens).

Contenders, each in a fresh process so none inherits another's warm caches, in interleaved rounds
(floor, probe, ferret, captum, floor, probe, ...), each timing only its work (model loading and
imports are outside the clock, except ``probe run`` whose whole process is timed separately):

* ``floor``   per sentence, unpadded, bare torch: 1 eager forward with attentions; LOO as one
              batch of T-2 copies (causal LM: T copies of length T-1, no padding needed); 1
              forward+backward for saliency and input x gradient; IG as one batch of S points + 1
              backward; comprehensiveness/sufficiency as one batch of 60 rows (causal LM: the value
              read at each right-padded row's last token; the empty 100% rows are not run).
* ``probe``   ``run_study`` on the workload's study (the same work as a study; probe also runs its
              random ranking in the erasure curves): the clock is the sum of the batches' wall time
              (the study steps); the statistics and the report are timed apart, and the whole
              ``probe run`` process (imports, model load, sanity checks, statistics, report) twice more
              (``--cli``): the study as it is, and the floor's work alone (the same study without the
              randomisation sanity check, which reruns the explainers on re-initialised models: work
              the floor does not do, fixed in the study's size), each set beside the floor's work and
              the floor's whole child process (interpreter, imports, model load and work: like with
              like). It prints its token and LOO row counts and mean taus beside the floor's
              (attention: last layer).
* ``probe_auto`` (not the workload, so not in the default --only): ``probe`` with integrated
              gradients at ``steps: auto``: Gauss-Legendre points per example, 16 then doubled
              until the completeness delta is under 5% of |f(x) - f(baseline)|.
* ``ferret``  ferret-xai 0.4.2's ``Benchmark.explain`` + ``evaluate_explanations`` with Gradient,
              GradientXInput, IntegratedGradients and AOPC comprehensiveness, AOPC sufficiency,
              tau-LOO; it needs its own virtual environment (``--ferret-python PATH`` or
              ``$FERRET_PYTHON``), skipped if absent. To build one beside torch 2.13.0 (ferret's
              pins resolve numpy 1.26 with a pyarrow that numpy cannot import, hence the last line)::

                  python -m venv ~/ferret-venv
                  ~/ferret-venv/bin/pip install torch==2.13.0 ferret-xai==0.4.2
                  ~/ferret-venv/bin/pip install "pyarrow<16"
                  export FERRET_PYTHON=~/ferret-venv/bin/python
* ``captum``  the same work written with captum's attribution classes per sentence (Saliency,
              InputXGradient, IntegratedGradients, FeatureAblation for LOO), erasure as the floor.

    python benchmarks/bench_peers.py [--n 50] [--rounds 2] [--steps 50] [--threads 2]
        [--only floor,probe] [--ferret-python ~/ferret-venv/bin/python]
        [--length 128|512] [--model builtin:minilm-rt|builtin:smollm2-135m] [--cli]

    python benchmarks/bench_peers.py --n 50 --rounds 1 --only floor,probe,ferret --cli       # default
    python benchmarks/bench_peers.py --n 50 --rounds 1 --only floor,probe,ferret --length 128
    python benchmarks/bench_peers.py --n 20 --rounds 1 --only floor,probe,ferret --length 512
    python benchmarks/bench_peers.py --n 20 --rounds 1 --only floor,probe --model builtin:smollm2-135m

Prints the workload (model, dataset, token counts, study file), seconds per contender and round, and
every ratio to the floor and to ferret from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # peers_workloads beside this file, however the script is started
from peers_workloads import (  # noqa: E402
    LONG_GRADIENT_BUDGET,
    LONG_TOKEN_BUDGET,
    cut_texts,
    is_causal,
    run_floor_causal,
    token_counts,
    write_study,
)

STUDY = HERE / "peers_study.yaml"
STUDY_CAUSAL = HERE / "peers_study_smollm2.yaml"  # --model builtin:smollm2-135m
CONTENDERS = ("floor", "probe", "ferret", "captum", "probe_auto")
#: ``--before DIR``: also run probe from another checkout (the code before a change), same round
BINS = tuple(b / 10 for b in range(1, 11))  # 10, 20, ..., 100%


# --------------------------------------------------------------------------- shared helpers (no probe)


def bin_size(frac: float, n: int) -> int:
    """Tokens in a bin: at least one, rounded half up, at most n (ERASER, as probe states it)."""
    import math

    return min(n, max(1, int(math.floor(frac * n + 0.5)))) if n > 0 else 0


def gauss_legendre(steps: int):
    """Gauss-Legendre nodes and weights on [0, 1]: ``[steps]`` alphas and ``[steps]`` weights."""
    import numpy as np

    nodes, weights = np.polynomial.legendre.leggauss(steps)
    return (nodes + 1) / 2, weights / 2


def load_texts(n: int) -> list[str]:
    from probe.data import load_dataset

    return [e.text for e in load_dataset("builtin:rotten_tomatoes", split="test", n=n, seed=0)]


def row_chunks(rows: int, width: int, budget: int | None) -> list[slice]:
    """Slices of at most ``budget // width`` rows; one slice of all rows when ``budget`` is None
    (the default workload: every batch in one pass)."""
    if budget is None:
        return [slice(0, rows)]
    per = max(1, budget // max(1, width))
    return [slice(start, start + per) for start in range(0, rows, per)]


def pad_rows(rows: list[list[int]], pad_id: int):
    """Token rows of different lengths, right-padded: ``([rows, width] ids, [rows, width] mask)``."""
    import torch

    width = max(len(r) for r in rows)
    batch = torch.full((len(rows), width), pad_id)  # [rows, width]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [rows, width]
    for r, row in enumerate(rows):
        batch[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return batch, mask


def erasure_rows(ids: list[int], rankings, inner, keep: set[int]) -> list[list[int]]:
    """Per ranking (each ``[T]``) and bin: the comprehensiveness row (the bin's top scorable tokens
    removed), then the sufficiency row (only they and the ``keep`` positions left)."""
    import torch

    rows = []
    for ranking in rankings:
        order = (inner[torch.argsort(-ranking[inner].detach(), stable=True)]).tolist()
        for frac in BINS:
            top = set(order[:bin_size(frac, len(order))])
            rows.append([t for s, t in enumerate(ids) if s not in top])
            rows.append([t for s, t in enumerate(ids) if s in top or s in keep])
    return rows


def taus_against(reference, inner, rankings) -> list[float]:
    """Kendall tau of each ranking's scorable positions with the reference (LOO) scores."""
    from scipy.stats import kendalltau

    return [kendalltau(r[inner].detach().numpy(), reference.numpy()).statistic for r in rankings]


STEPS = ("attention", "loo", "gradients", "integrated_gradients", "erasure", "tau")


def add_step_times(timings: dict[str, float], marks: list[float]) -> None:
    """Adds the time between consecutive ``marks`` (one more than :data:`STEPS`) to each step."""
    for key, a, b in zip(STEPS, marks, marks[1:]):
        timings[key] = timings.get(key, 0.0) + b - a


def model_folder(name: str) -> str:
    from probe.models.builtins import materialize_builtin

    if Path(name).is_dir():  # a local classifier folder of the same architecture (e.g. while the built-in builds)
        return str(Path(name).resolve())
    return str(materialize_builtin(name.removeprefix("builtin:"), progress=False))


# --------------------------------------------------------------------------- the floor


def run_floor(folder: str, texts: list[str], steps: int, budget: int | None = None,
              grad_budget: int | None = None) -> dict:
    """The naive floor: per sentence, unpadded, bare torch and transformers, nothing else.

    ``budget`` / ``grad_budget`` (the long workloads only) split a batch into passes of at most
    that many rows x width tokens, as probe's engine does; the default workload runs each batch whole.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    embed = model.get_input_embeddings()
    alphas, weights = gauss_legendre(steps)
    alphas = torch.tensor(alphas, dtype=torch.float32)  # [steps]
    weights = torch.tensor(weights, dtype=torch.float32)  # [steps]
    with torch.no_grad():
        pad = embed(torch.tensor([tok.pad_token_id]))[0]  # [dim]

    def probs(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask).logits.softmax(-1)  # [rows, classes]

    timings = dict.fromkeys(STEPS, 0.0)
    taus, tokens, loo_rows = [], 0, 0
    started = time.perf_counter()
    for text in texts:
        ids = torch.tensor(tok(text)["input_ids"])  # [T]
        n_tokens = len(ids)
        inner = torch.arange(1, n_tokens - 1)  # scorable positions: all but [CLS] and [SEP]
        tokens += n_tokens
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids[None], output_attentions=True)
            p = out.logits[0].softmax(-1)  # [classes]
            label = int(p.argmax())
            attention = out.attentions[-1][0].mean(0)[0]  # [T]: last layer, head mean, [CLS] row
        t1 = time.perf_counter()
        with torch.no_grad():
            copies = ids.repeat(len(inner), 1)  # [T-2, T]
            copies[torch.arange(len(inner)), inner] = tok.mask_token_id
            loo = p[label] - torch.cat([probs(copies[s])[:, label]
                                        for s in row_chunks(len(copies), n_tokens, budget)])  # [T-2]
        loo_rows += len(copies)
        t2 = time.perf_counter()
        with torch.enable_grad():
            x = embed(ids[None]).detach().requires_grad_()  # [1, T, dim]
            value = model(inputs_embeds=x).logits.softmax(-1)[0, label]
            (grad,) = torch.autograd.grad(value, x)  # [1, T, dim]
        saliency = grad[0].norm(dim=-1)  # [T]
        ixg = (grad[0] * x[0].detach()).sum(-1)  # [T]
        t3 = time.perf_counter()
        with torch.enable_grad():
            base = pad.expand_as(x[0])  # [T, dim]
            diff = x[0].detach() - base  # [T, dim]
            total = 0.0
            for s in row_chunks(steps, n_tokens, grad_budget):
                points = (base + alphas[s, None, None] * diff).requires_grad_()  # [chunk of steps, T, dim]
                values = model(inputs_embeds=points).logits.softmax(-1)[:, label]  # [chunk]
                (grads,) = torch.autograd.grad(values, points, grad_outputs=weights[s])  # [chunk, T, dim]
                total = total + grads.sum(0)  # [T, dim]
        ig = (total * diff).sum(-1)  # [T]
        t4 = time.perf_counter()
        rows = erasure_rows(ids.tolist(), (saliency, ixg, ig), inner, {0, n_tokens - 1})
        batch, mask = pad_rows(rows, tok.pad_token_id)  # [60, width] each
        width = batch.shape[1]
        with torch.no_grad():
            curves = p[label] - torch.cat([probs(batch[s], mask[s])[:, label]
                                           # [60]: comp, suff alternating per bin
                                           for s in row_chunks(len(rows), width, budget)])
        t5 = time.perf_counter()
        taus.append(taus_against(loo, inner, (attention, saliency, ixg, ig)))
        add_step_times(timings, [t0, t1, t2, t3, t4, t5, time.perf_counter()])
        del curves
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "steps": timings, "mean_tau": np.nanmean(np.array(taus), axis=0).tolist(),
            "tokens": tokens, "loo_rows": loo_rows}


# --------------------------------------------------------------------------- probe


def run_probe(texts: list[str], steps: int, out: str, n: int, model: str, study_path: str) -> dict:
    import pandas as pd

    from probe.api import run_study
    from probe.spec.study import load_study, study_from_dict

    from peers_workloads import probe_agreement

    study = load_study(study_path, n=n, out=out)
    if model != study.model.id:
        data = study.to_dict()
        data["model"]["id"] = model
        study = study_from_dict(data)
    if steps != 50:
        raise SystemExit("the study file fixes 50 steps; use --steps 50 for probe")
    started = time.perf_counter()
    result = run_study(study, progress=False, report=True)
    total = time.perf_counter() - started
    root = Path(out)
    infos = [json.loads(p.read_text()) for p in sorted((root / "done").glob("b*.json"))]
    steps_seconds: dict[str, float] = {}
    for info in infos:
        for step, seconds in info.get("timings", {}).items():
            steps_seconds[step] = steps_seconds.get(step, 0.0) + seconds
    seconds = sum(info["wall_s"] for info in infos)
    provenance = json.loads((root / "provenance.json").read_text())
    examples = pd.read_parquet(root / "examples.parquet")
    return {"seconds": float(seconds), "steps": {k: round(v, 2) for k, v in steps_seconds.items()},
            "load_seconds": provenance.get("model_load_seconds"),
            "outside_steps_seconds": total - seconds - provenance.get("model_load_seconds", 0.0),
            "complete": result.complete, "same_texts": sorted(examples["text"]) == sorted(texts),
            **probe_agreement(root)}


def study_variant(study_path: str, out: str, suffix: str, edit) -> str:
    """A copy of the study file beside ``out`` (``out.<suffix>.yaml``), changed by ``edit(study dict)``."""
    import yaml

    study = yaml.safe_load(Path(study_path).read_text())
    edit(study)
    path = Path(out).with_suffix(f".{suffix}.yaml")
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return str(path)


def auto_steps_study(study_path: str, out: str) -> str:
    """A copy of the study whose integrated gradients run ``steps: auto`` (Gauss-Legendre points
    per example, doubled from 16 until the completeness delta is under 5% of f(x) - f(baseline))."""
    def edit(study: dict) -> None:
        study["params"]["integrated_gradients"] = {"steps": "auto"}
    return study_variant(study_path, out, "auto", edit)


def floor_work_study(study_path: str, out: str) -> str:
    """A copy of the study without the randomisation sanity check, the one part of a default study
    that is not the floor's work: it reruns every explainer on re-initialised copies of the model
    (3 weight draws per cascade step and 3 for the bottom-up units) on the sanity examples, a cost
    fixed in the study's size. The whole ``probe run`` process on this copy is the like-with-like
    figure; the default's minus it is what the check costs."""
    def edit(study: dict) -> None:
        metrics = study.setdefault("metrics", {})
        metrics["sanity"] = {**(metrics.get("sanity") or {}), "randomisation": False}
    return study_variant(study_path, out, "work", edit)


def run_probe_cli(n: int, out: str, study_path: str) -> dict:
    """The whole ``probe run`` process: imports, model load, the study, statistics and the report."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "probe", "run", study_path, "--n", str(n), "--out", out, "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    total = time.perf_counter() - started
    provenance = json.loads((Path(out) / "provenance.json").read_text())
    return {"process_seconds": total, "study_seconds": provenance.get("wall_seconds"),
            "load_seconds": provenance.get("model_load_seconds")}


# --------------------------------------------------------------------------- captum


def run_captum(folder: str, texts: list[str], steps: int) -> dict:
    """The same work with captum's classes, one sentence at a time (its usual use)."""
    import numpy as np
    import torch
    from captum.attr import (
        FeatureAblation,
        InputXGradient,
        IntegratedGradients,
        Saliency,
    )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    embed = model.get_input_embeddings()

    def from_embeds(x, label):
        return model(inputs_embeds=x).logits.softmax(-1)[:, label]

    def from_ids(ids, label):
        return model(input_ids=ids).logits.softmax(-1)[:, label]

    taus = []
    started = time.perf_counter()
    for text in texts:
        ids = torch.tensor([tok(text)["input_ids"]])  # [1, T]
        n_tokens = ids.shape[1]
        inner = torch.arange(1, n_tokens - 1)
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
            label = int(out.logits[0].argmax())
            attention = out.attentions[-1][0].mean(0)[0]  # [T]
        feature_mask = torch.arange(n_tokens)[None]  # [1, T]: one feature per token
        loo = FeatureAblation(from_ids).attribute(ids, baselines=tok.mask_token_id, additional_forward_args=(label,),
                                                  # f(x) - f(ablated)
                                                  feature_mask=feature_mask, perturbations_per_eval=n_tokens)[0]
        x = embed(ids).detach()  # [1, T, dim]
        grad = Saliency(from_embeds).attribute(x.clone().requires_grad_(), additional_forward_args=(label,), abs=False)
        saliency = grad[0].norm(dim=-1)
        ixg = InputXGradient(from_embeds).attribute(x.clone().requires_grad_(), additional_forward_args=(label,
                                                                                                         ))[0].sum(-1)
        with torch.no_grad():
            base = embed(torch.tensor([[tok.pad_token_id]])).expand_as(x)
        ig = IntegratedGradients(from_embeds).attribute(x.clone().requires_grad_(), baselines=base, n_steps=steps,
                                                        additional_forward_args=(label,))[0].sum(-1)
        rows = erasure_rows(ids[0].tolist(), (saliency, ixg, ig), inner, {0, n_tokens - 1})
        batch, mask = pad_rows(rows, tok.pad_token_id)  # [60, width] each
        with torch.no_grad():
            model(input_ids=batch, attention_mask=mask)
        taus.append(taus_against(loo[inner].detach(), inner, (attention, saliency, ixg, ig)))
    return {"seconds": time.perf_counter() - started, "mean_tau": np.nanmean(np.array(taus), axis=0).tolist()}


# --------------------------------------------------------------------------- ferret (its own venv)


def run_ferret(folder: str, texts: list[str], steps: int) -> dict:
    if steps != 50:
        raise SystemExit("ferret's IntegratedGradientExplainer runs captum's default, 50 steps: use --steps 50")
    import torch
    from ferret import (
        AOPC_Comprehensiveness_Evaluation,
        AOPC_Sufficiency_Evaluation,
        Benchmark,
        GradientExplainer,
        IntegratedGradientExplainer,
        TauLOO_Evaluation,
    )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    explainers = [GradientExplainer(model, tok, multiply_by_inputs=False),
                  GradientExplainer(model, tok, multiply_by_inputs=True),
                  IntegratedGradientExplainer(model, tok, multiply_by_inputs=True)]
    evaluators = [AOPC_Comprehensiveness_Evaluation(model, tok), AOPC_Sufficiency_Evaluation(model, tok),
                  TauLOO_Evaluation(model, tok)]
    bench = Benchmark(model, tok, explainers=explainers, evaluators=evaluators)
    started = time.perf_counter()
    for text in texts:
        with torch.no_grad():
            label = int(model(**tok(text, return_tensors="pt")).logits[0].argmax())
        explanations = bench.explain(text, target=label, show_progress=False)  # captum's IG default: 50 steps
        bench.evaluate_explanations(explanations, target=label, show_progress=False)
    return {"seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- driver


def child(args) -> None:
    torch_threads(args.threads)
    texts = json.loads(Path(args.texts).read_text())
    long = args.length is not None  # the long workloads split batches as probe's engine does
    budgets = (LONG_TOKEN_BUDGET, LONG_GRADIENT_BUDGET) if long else (None, None)
    if args.child == "floor" and is_causal(args.folder):
        result = run_floor_causal(args.folder, texts, args.steps, *budgets)
    elif args.child == "floor":
        result = run_floor(args.folder, texts, args.steps, *budgets)
    elif args.child in ("probe", "probe_before"):
        result = run_probe(texts, args.steps, args.out, len(texts), args.model, args.study)
    elif args.child == "probe_auto":  # not the workload: IG stops per example at the 5% completeness tolerance
        result = run_probe(texts, args.steps, args.out, len(texts), args.model, auto_steps_study(args.study, args.out))
    elif args.child == "probe_cli":
        result = run_probe_cli(len(texts), args.out, args.study)
    elif args.child == "probe_cli_work":  # the floor's work only: no randomisation check
        result = run_probe_cli(len(texts), args.out, floor_work_study(args.study, args.out))
    elif args.child == "captum":
        result = run_captum(args.folder, texts, args.steps)
    else:
        result = run_ferret(args.folder, texts, args.steps)
    print("RESULT " + json.dumps(result))


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def spawn(python: str, name: str, args, texts_path: str, folder: str, workdir: str, study: str) -> dict | None:
    out = tempfile.mkdtemp(prefix=f"peers-{name}-", dir=workdir)
    cmd = [python, str(Path(__file__).resolve()), "--child", name, "--texts", texts_path, "--folder", folder,
           "--steps", str(args.steps), "--threads", str(args.threads), "--out", out, "--model", args.model,
           "--study", study] + (["--length", str(args.length)] if args.length is not None else [])
    env = {**os.environ, **({"PYTHONPATH": args.before} if name == "probe_before" else {}), "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    whole = time.perf_counter() - started  # the child's whole process: interpreter, imports, model load, work
    line = next((s for s in done.stdout.splitlines() if s.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        print(f"  {name} failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:] or ['?']}")
        return None
    return {**json.loads(line.removeprefix("RESULT ")), "child_process_seconds": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="builtin:minilm-rt",
                        help="builtin:minilm-rt (default), builtin:smollm2-135m (causal LM), or a classifier folder")
    parser.add_argument("--length", type=int, help="held-out imdb texts cut to this many model tokens "
                        "(e.g. 128, 512) instead of rotten_tomatoes sentences")
    parser.add_argument("--only", default=",".join(c for c in CONTENDERS if c != "probe_auto"),
                        help="comma-separated contenders: " + ", ".join(CONTENDERS))
    parser.add_argument("--cli", action="store_true", help="also time two whole `probe run` processes per round: the study "
                        "as it is, and the floor's work alone (no randomisation check)")
    parser.add_argument("--ferret-python", default=os.environ.get("FERRET_PYTHON"),
                        help="the python of a virtual environment with ferret-xai (default: $FERRET_PYTHON; see the "
                             "docstring to build it)")
    parser.add_argument("--before", help="a checkout of probe to time as probe_before (PYTHONPATH)")
    parser.add_argument("--child", choices=(*CONTENDERS, "probe_cli", "probe_cli_work", "probe_before"), help=argparse.SUPPRESS)
    parser.add_argument("--texts", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--study", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    for name in wanted:
        if name not in CONTENDERS:
            raise SystemExit(f"unknown contender {name!r}: use {', '.join(CONTENDERS)}")
    if "ferret" in wanted and not (args.ferret_python and Path(args.ferret_python).exists()):
        print(f"ferret: {args.ferret_python or 'no --ferret-python and no $FERRET_PYTHON'} not found, skipped (see "
              "the docstring to build its venv)")
        wanted.remove("ferret")
    folder = model_folder(args.model)
    causal = is_causal(folder)
    for name in ("ferret", "captum"):
        if causal and name in wanted:
            print(f"{name}: skipped for the causal LM "
                  f"({'ferret explains classifiers only' if name == 'ferret' else 'not written for a causal LM'})")
            wanted.remove(name)
    texts = cut_texts(folder, args.n, args.length) if args.length is not None else load_texts(args.n)
    counts = token_counts(folder, texts)
    workdir = tempfile.mkdtemp(prefix="bench-peers-")
    texts_path = str(Path(workdir) / "texts.json")
    Path(texts_path).write_text(json.dumps(texts))
    study = str(write_study(STUDY_CAUSAL if causal else STUDY, texts, counts, workdir, args.length is not None))
    dataset = f"imdb held-out reviews cut to {args.length} tokens" if args.length is not None else "rotten_tomatoes sentences"
    print(f"workload: {args.model} "
          f"({'causal LM, target log p(greedy next token)' if causal else 'classifier, target p(predicted class)'}), "
          f"{len(texts)} {dataset}: {sum(counts) / len(counts):.1f} tokens on average (min {min(counts)}, max "
          f"{max(counts)}); "
          f"study {study}")
    print(f"{args.model}: {len(texts)} {dataset}, IG {args.steps} steps, {args.threads} threads; "
          f"load {os.getloadavg()[0]:.1f} (1-min average) at start")
    extra = (["probe_before"] if args.before else []) + (["probe_cli", "probe_cli_work"] if args.cli else [])
    runs: dict[str, list[dict]] = {name: [] for name in wanted + extra}
    for round_ in range(args.rounds):
        for name in runs:
            python = args.ferret_python if name == "ferret" else sys.executable
            result = spawn(python, name, args, texts_path, folder, workdir, study)
            if result is not None:
                runs[name].append(result)
                shown = result.get("seconds", result.get("process_seconds"))
                print(f"round {round_ + 1} {name:<10}{shown:>8.1f} s  "
                      f"{json.dumps({k: v for k, v in result.items() if k != 'seconds'})}")
    print(f"load {os.getloadavg()[0]:.1f} (1-min average) at the end")
    print()
    print(f"{'contender':<12}" + "".join(f"{'round ' + str(r + 1):>10}" for r in range(args.rounds))
          + f"{'/ floor':>10}{'ferret /':>10}")
    for name, results in runs.items():
        if name.startswith("probe_cli") or not results:
            continue
        cells = "".join(f"{r['seconds']:>10.1f}" for r in results)
        floor = [r["seconds"] for r in runs.get("floor", [])]
        ferret = [r["seconds"] for r in runs.get("ferret", [])]
        to_floor = ", ".join(f"{a / b:.2f}" for a, b in zip((r["seconds"] for r in results), floor)) if floor else "-"
        from_ferret = ", ".join(f"{b / a:.2f}" for a, b in zip((r["seconds"] for r in results), ferret)) if ferret else "-"
        print(f"{name:<12}{cells}   {to_floor:>10}   {from_ferret:>10}")
    for round_, (floor, ferret) in enumerate(zip(runs.get("floor", []), runs.get("ferret", []))):
        # the least any contender doing this work can spend: the floor's IG (one unpadded batch of
        # the points, one backward) and LOO (one unpadded batch of copies) are that arithmetic alone
        least = floor["steps"]["integrated_gradients"] + floor["steps"]["loo"]
        print(f"round {round_ + 1}: the floor's integrated gradients and leave-one-out alone take {least:.1f} s; "
              f"2.5x faster than ferret means the whole study in {ferret['seconds'] / 2.5:.1f} s")
    print_taus(runs)
    print_cli(runs)


def print_taus(runs: dict[str, list[dict]]) -> None:
    """The mean Kendall tau against LOO of each ranking, per contender (their first round), and why
    probe's gradient rankings need not equal the floor's: the gradient site."""
    order = ("attention (last layer)", "saliency", "input x gradient", "integrated gradients")
    shown = {name: results[0]["mean_tau"] for name, results in runs.items() if results and results[0].get("mean_tau")}
    if not shown:
        return
    print()
    print(f"{'mean tau with LOO':<24}" + "".join(f"{name:>12}" for name in shown))
    for i, label in enumerate(order):
        print(f"{label:<24}" + "".join(f"{'-' if taus[i] is None else format(taus[i], '+.3f'):>12}"
                                       for taus in shown.values()))
    print("the floor and captum take gradients at the word embeddings (inputs_embeds); probe at the embeddings "
          "module's output (word + position + token type embeddings, after its LayerNorm), its default site "
          "(docs/guides/coming-from.md): saliency and input x gradient multiply or measure another vector, so "
          "their taus differ by that choice, not by an error; attention and LOO match")


def print_cli(runs: dict[str, list[dict]]) -> None:
    """The whole ``probe run`` processes beside the floor: the default study (its sanity checks
    included) and the floor's work alone (no randomisation check), each against the floor's work and
    the floor's whole child process (interpreter, imports, model load and work: like with like)."""
    floors = runs.get("floor", [])
    kinds = (("probe_cli", "probe run process, default checks"),
             ("probe_cli_work", "probe run process, the floor's work (no randomisation check)"))
    for name, label in kinds:
        for round_, r in enumerate(runs.get(name, [])):
            overhead = r["process_seconds"] - (r["study_seconds"] or 0.0) - (r["load_seconds"] or 0.0)
            print(f"{label}: {r['process_seconds']:.1f} s = study steps {r['study_seconds']:.1f} s, model load "
                  f"{r['load_seconds']:.1f} s, everything else (imports, sanity checks, statistics, report) "
                  f"{overhead:.1f} s")
            if round_ < len(floors):
                floor = floors[round_]
                print(f"  round {round_ + 1}: {r['process_seconds'] / floor['seconds']:.2f}x the floor's work "
                      f"({floor['seconds']:.1f} s), {r['process_seconds'] / floor['child_process_seconds']:.2f}x the "
                      f"floor's whole process ({floor['child_process_seconds']:.1f} s: interpreter, imports, model load "
                      "and its work)")
    for round_, (full, work) in enumerate(zip(runs.get("probe_cli", []), runs.get("probe_cli_work", []))):
        print(f"  round {round_ + 1}: the randomisation check costs {full['process_seconds'] - work['process_seconds']:.1f} s "
              "(the two processes' difference; fixed in the study's size: its sanity examples only)")


if __name__ == "__main__":
    main()
