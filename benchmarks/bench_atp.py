"""Benchmark: attribution patching (``atp``) against the exact per-head edge knockout and head ablation.

Prints figures measured in this one run (no asserts; the machine's load shows in the seconds). For each
model, a few texts: the exact per-head knockout of the target row's edges
(:func:`probe.intervene.knockout.edge_knockout` with ``per_head``, one row per layer x head x token,
prefix reused where the model takes it) and AtP's estimates of the same edges
(:func:`probe.intervene.atp.attribution_patching`, one forward and one backward per batch), and the
exact single-head ablation (:func:`probe.intervene.heads.head_ablation_effects`) against AtP's head
estimates from that same backward. Per example:

* ``rho``: Spearman's rank correlation over every (layer, head, token) edge, signed; ``rho abs`` on the
  magnitudes (what a screen ranks by);
* ``FN k/k'``: of the exact top-k edges by |effect|, how many AtP ranks outside its own top-k'
  (k' = k, and k' = 3k: the AtP* recipe runs exactly the estimate's top-k' and can miss only these),
  the exact top-k taken among the edges whose effect clears the noise floor (``above floor``);
* ``heads rho``: Spearman over the heads, estimate against exact ablation;

averaged over the texts, with the seconds of each (exact knockout; AtP; exact head ablation), the
knockout renormalised (a -inf logit) and not (the weight zeroed).

Models: ``builtin:smollm2-135m`` (a causal LM, 30 layers x 9 heads, the target the next token's
log-prob), and the planted ``one-head`` (6 x 12 heads), ``edge-head`` and ``sink-head`` (1 x 1; there
the ranking is over tokens only, and the top-k is capped at the tokens scored).

Usage:  python benchmarks/bench_atp.py [--n 3] [--threads 1] [--models smollm2-135m,one-head,edge-head,sink-head]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from probe.intervene.atp import attribution_patching  # noqa: E402
from probe.intervene.heads import head_ablation_effects  # noqa: E402
from probe.intervene.knockout import edge_knockout  # noqa: E402
from probe.models.loading import load_model  # noqa: E402
from probe.models.planted import materialize_planted  # noqa: E402
from probe.rows.prepare import prepare  # noqa: E402
from probe.study.decide import noise_floor  # noqa: E402

SMOLLM2_TEXTS = ["The capital of France is", "The cat sat on the", "Water boils at a temperature of",
                 "She opened the door and saw"]


def _texts(name: str, n: int) -> list[str]:
    if name == "smollm2-135m":
        return SMOLLM2_TEXTS[:n]
    import json

    folder = materialize_planted(name)
    lines = (folder / "data.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines[:n]]


def _false_negatives(exact: np.ndarray, estimate: np.ndarray, k: int, k_prime: int) -> int:
    """How many of the exact top-k units (by |effect|) the estimate ranks outside its top-k'."""
    top = set(np.argsort(-np.abs(exact), kind="stable")[:k].tolist())
    screened = set(np.argsort(-np.abs(estimate), kind="stable")[:k_prime].tolist())
    return len(top - screened)


def _edge_rows(exact, estimate, ks: tuple[int, ...]) -> dict[str, list[float]]:
    """Per example the agreement of the estimate's per-head edges with the exact ones. The exact
    top-k counts only edges whose effect clears the example's noise floor (rounding of the target,
    :func:`probe.study.decide.noise_floor`): k is capped at how many do."""
    out: dict[str, list[float]] = {}
    for truth, guess, value in zip(exact.per_head.scores, estimate.per_head.scores, exact.original_value.tolist()):
        t, g = truth.flatten().double().numpy(), guess.flatten().double().numpy()
        keep = ~(np.isnan(t) | np.isnan(g))
        t, g = t[keep], g[keep]
        measured = int((np.abs(t) > noise_floor(abs(value))).sum())
        out.setdefault("units", []).append(len(t))
        out.setdefault("above floor", []).append(measured)
        out.setdefault("rho", []).append(float(spearmanr(t, g).statistic))
        out.setdefault("rho abs", []).append(float(spearmanr(np.abs(t), np.abs(g)).statistic))
        for k in ks:
            kk = min(k, measured)
            out.setdefault(f"FN {k}/{k}", []).append(_false_negatives(t, g, kk, k))
            out.setdefault(f"FN {k}/{3 * k}", []).append(_false_negatives(t, g, kk, 3 * k))
    return out


def _measure(name: str, n: int, ks: tuple[int, ...], renormalise: bool) -> dict[str, float | str]:
    pm = load_model(f"builtin:{name}" if name == "smollm2-135m" else f"planted:{name}")
    examples = prepare(pm, _texts(name, n))
    started = time.perf_counter()
    exact = edge_knockout(pm, examples, per_head=True, renormalise=renormalise)
    exact_seconds = time.perf_counter() - started
    started = time.perf_counter()
    estimate = attribution_patching(pm, examples, renormalise=renormalise)
    atp_seconds = time.perf_counter() - started
    started = time.perf_counter()
    ablated = head_ablation_effects(pm, examples)
    heads_seconds = time.perf_counter() - started
    rows = _edge_rows(exact, estimate, ks)
    heads_rho = [float(spearmanr(a.flatten().numpy(), b.flatten().numpy()).statistic)
                 if a.numel() > 1 else float("nan") for a, b in zip(ablated.change, estimate.heads.change)]
    info = pm.contract.stacks[pm.task.target_stack(pm.contract)]
    return {"model": name, "shape": f"{info.n_layers}x{info.n_heads}", "renormalise": "yes" if renormalise else "no",
            "texts": len(examples),
            **{key: float(np.mean(values)) for key, values in rows.items()},
            "heads rho": float(np.nanmean(heads_rho)) if not np.all(np.isnan(heads_rho)) else float("nan"),
            "s exact": exact_seconds, "s atp": atp_seconds, "s heads": heads_seconds}


def _cell(column: str, value: float | str) -> str:
    if isinstance(value, str):
        return value
    if column in ("texts", "units", "above floor") or (column.startswith("FN") and float(value).is_integer()):
        return f"{value:.0f}"
    return f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3, help="texts per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="smollm2-135m,one-head,edge-head,sink-head")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = (10, 20)
    rows = [_measure(name, args.n, ks, renormalise) for name in args.models.split(",") for renormalise in (True, False)]
    fn_columns = [c for k in ks for c in (f"FN {k}/{k}", f"FN {k}/{3 * k}")]
    columns = ["model", "shape", "renormalise", "texts", "units", "above floor", "rho", "rho abs", *fn_columns,
               "heads rho", "s exact", "s atp", "s heads"]
    print(f"AtP vs exact per-head knockout (target rows) and head ablation, {args.threads} thread(s)")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(_cell(c, row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
