"""The workloads of benchmarks/bench_peers.py beyond the default one, and the causal LM's floor.

* ``--length L``: held-out imdb reviews cut to L model tokens (special tokens included): each review
  of at least L tokens is cut to its first L - (special tokens) wordpieces and decoded back to text,
  so that the tokenizer gives L tokens again (or a few fewer where decoding merges pieces; never
  more: a text that comes back longer is cut shorter until it fits). Written to a CSV (text,label)
  that a generated copy of the study reads, so probe explains exactly the contenders' texts.
* ``--model builtin:smollm2-135m``: the causal LM explains the log-prob of its greedy next token
  after the text (probe's ``prepare`` default for a causal LM: kind ``logprob``, target = the
  argmax of the logits at the last position); its study is peers_study_smollm2.yaml and its floor
  :func:`run_floor_causal`.

Imported by the bench's driver and children (probe's venv only; never by the ferret child at
import time): the heavy imports stay inside the functions.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUDY_CAUSAL = HERE / "peers_study_smollm2.yaml"
#: rows x width of one no-grad batch in the long workloads, for probe's engine and the floor alike:
#: one LOO row set of a 128-token text (126 x 128) fits one pass
LONG_TOKEN_BUDGET = 16384
#: rows x width of one forward+backward in the long workloads (probe's GRADIENT_TOKEN_BUDGET)
LONG_GRADIENT_BUDGET = 4096
#: held-out imdb reviews searched for ones long enough (the whole held-out split)
IMDB_POOL = 1000


def special_count(tok) -> int:
    """Special tokens the tokenizer adds around one text ([CLS] and [SEP]: 2; SmolLM2: 0)."""
    return len(tok("a")["input_ids"]) - len(tok("a", add_special_tokens=False)["input_ids"])


def cut_texts(folder: str, n: int, length: int) -> list[str]:
    """``n`` held-out imdb reviews of at least ``length`` tokens, each cut to ``length`` tokens."""
    import warnings

    from transformers import AutoTokenizer

    from probe.data import load_dataset

    tok = AutoTokenizer.from_pretrained(folder)
    extra = special_count(tok)
    if length <= extra:
        raise SystemExit(f"--length {length} leaves no room for text beside {extra} special tokens")
    window = getattr(tok, "model_max_length", None)
    if window is not None and window < 10**6 and length > window:  # probe would drop such texts
        raise SystemExit(f"--length {length} is longer than the model's window of {window} tokens")
    texts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sequence longer than the model's maximum": we cut it
        for example in load_dataset("builtin:imdb", split="test", n=IMDB_POOL, seed=0):
            pieces = tok(example.text, add_special_tokens=False)["input_ids"]
            if len(pieces) < length - extra:
                continue
            keep = length - extra
            while keep > 0:
                text = tok.decode(pieces[:keep]).strip()
                over = len(tok(text)["input_ids"]) - length
                if over <= 0:
                    break
                keep -= over
            texts.append(text)
            if len(texts) == n:
                return texts
    raise SystemExit(f"only {len(texts)} of {IMDB_POOL} held-out imdb reviews have {length} tokens; lower --n or "
                     f"--length")


def token_counts(folder: str, texts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [len(ids) for ids in tok(texts)["input_ids"]]


def is_causal(folder: str) -> bool:
    """Whether the model folder holds a causal LM (its config's architectures end in ForCausalLM)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


def write_study(base: Path, texts: list[str], counts: list[int], workdir: str, long: bool) -> Path:
    """The study for this workload: ``base`` (the model's peers study), with the long workload's
    texts and budgets.

    ``long`` (--length): the dataset becomes a CSV of exactly ``texts`` in the work dir (no labels:
    the target is the predicted class / next token), with ``max_length`` the longest count
    (select_examples drops longer texts), the engine's token budget :data:`LONG_TOKEN_BUDGET`, and as
    many examples per batch as fit that budget. Its model runs transformers' default attention
    (sdpa), not the short sentences' eager: on a 2-core CPU a no-grad pass of MiniLM took 4.4 s eager
    against 2.9 s sdpa at 32 x 512 tokens and 3.0 against 2.5 s at 128 x 128, while at 280 x 29 eager
    was 3% ahead. (The floor keeps eager, which its attention step needs for the weights.)
    """
    import yaml

    if not long:
        return base
    study = yaml.safe_load(base.read_text())
    data = Path(workdir) / "texts.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for text in texts:
            writer.writerow([text, ""])
    longest = max(counts)
    study["dataset"] = {"name": str(data), "n": len(texts), "seed": 0, "max_length": max(longest, 2)}
    study["engine"] = {"batch_size": max(1, min(len(texts), LONG_TOKEN_BUDGET // longest)),
                       "token_budget": LONG_TOKEN_BUDGET}
    study["model"].pop("attn_implementation", None)
    study["output"] = str(Path(workdir) / "results")
    path = Path(workdir) / f"study_{Path(base).stem}_long.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def probe_agreement(root: Path) -> dict:
    """probe's own counts beside the floor's: tokens, LOO rows (one per scored token), and the mean
    Kendall tau of each explainer against LOO (attention_mean at the last layer, as the floor takes it)."""
    import pandas as pd

    examples = pd.read_parquet(root / "examples.parquet")
    tokens = pd.read_parquet(root / "tokens.parquet")
    frame = pd.read_parquet(root / "agreement.parquet")  # layer / head -1: not per layer / head
    frame = frame[((frame["layer"] == -1) | (frame["layer"] == frame["layer"].max())) & (frame["head"] == -1)]
    means = frame.groupby("explainer")["kendall_tau"].mean()
    order = ["attention_mean", "saliency", "input_x_gradient", "integrated_gradients"]
    return {"tokens": int(examples["n_tokens"].sum()), "loo_rows": int(tokens["scored"].sum()),
            "mean_tau": [round(float(means[k]), 4) if k in means else None for k in order]}


# --------------------------------------------------------------------------- the causal LM's floor


def run_floor_causal(folder: str, texts: list[str], steps: int, budget: int | None = None,
                     grad_budget: int | None = None) -> dict:
    """The naive floor for a causal LM: per text, unpadded, bare torch and transformers.

    Target: log p(greedy next token | text), the log-softmax at the last position. Per text: 1 eager
    forward with attentions (the last position's row); LOO by deletion as one batch of T copies of
    length T-1 (no padding); 1 forward+backward at the word embeddings for saliency and input x
    gradient; IG as one batch of S points (from the pad embedding) + 1 backward; erasure as one
    right-padded batch of 60 rows, the value read at each row's last token (an empty row, every token
    removed, has no value and is not run, as in probe). ``budget`` / ``grad_budget`` (long workloads)
    split a batch into passes of at most that many rows x width tokens.
    """
    import numpy as np
    import torch
    from bench_peers import (
        STEPS,
        add_step_times,
        erasure_rows,
        gauss_legendre,
        pad_rows,
        row_chunks,
        taus_against,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    embed = model.get_input_embeddings()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # probe's choice when none
    special = set(tok.all_special_ids)
    alphas, weights = gauss_legendre(steps)
    alphas = torch.tensor(alphas, dtype=torch.float32)  # [steps]
    weights = torch.tensor(weights, dtype=torch.float32)  # [steps]
    with torch.no_grad():
        pad = embed(torch.tensor([pad_id]))[0]  # [dim]

    def next_logprobs(**inputs) -> torch.Tensor:
        """[rows, vocab] log-softmax at the last position of unpadded rows (only it is projected)."""
        return model(**inputs, logits_to_keep=1).logits[:, -1].float().log_softmax(-1)

    def last_logprobs(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] log-softmax at each right-padded row's last token."""
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [rows, width, dim]
        last = hidden[torch.arange(len(ids)), mask.sum(1) - 1]  # [rows, dim]
        return model.lm_head(last).float().log_softmax(-1)  # [rows, vocab]

    timings = dict.fromkeys(STEPS, 0.0)
    taus, tokens, loo_rows, n_erasure_rows = [], 0, 0, 0
    started = time.perf_counter()
    for text in texts:
        ids = torch.tensor(tok(text)["input_ids"])  # [T]
        n_tokens = len(ids)
        inner = torch.tensor([s for s, t in enumerate(ids.tolist()) if t not in special])  # scorable positions
        tokens += n_tokens
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids[None], output_attentions=True, logits_to_keep=1)
            logp = out.logits[0, -1].float().log_softmax(-1)  # [vocab]
            target = int(logp.argmax())  # the greedy next token
            value = logp[target]
            attention = out.attentions[-1][0].mean(0)[-1]  # [T]: last layer, head mean, last position's row
        t1 = time.perf_counter()
        with torch.no_grad():
            copies = torch.stack([torch.cat([ids[:t], ids[t + 1:]]) for t in inner.tolist()])  # [n_inner, T-1]
            loo = value - torch.cat([next_logprobs(input_ids=copies[s])[:, target]
                                     for s in row_chunks(len(copies), n_tokens - 1, budget)])  # [n_inner]
        loo_rows += len(copies)
        t2 = time.perf_counter()
        with torch.enable_grad():
            x = embed(ids[None]).detach().requires_grad_()  # [1, T, dim]
            (grad,) = torch.autograd.grad(next_logprobs(inputs_embeds=x)[0, target], x)  # [1, T, dim]
        saliency = grad[0].norm(dim=-1)  # [T]
        ixg = (grad[0] * x[0].detach()).sum(-1)  # [T]
        t3 = time.perf_counter()
        base = pad.expand_as(x[0])  # [T, dim]
        diff = x[0].detach() - base  # [T, dim]
        total = torch.zeros_like(diff)  # [T, dim]
        with torch.enable_grad():
            for s in row_chunks(steps, n_tokens, grad_budget):
                points = (base + alphas[s, None, None] * diff).requires_grad_()  # [chunk, T, dim]
                values = next_logprobs(inputs_embeds=points)[:, target]  # [chunk]
                (grads,) = torch.autograd.grad(values, points, grad_outputs=weights[s])  # [chunk, T, dim]
                total += grads.sum(0)
        ig = (total * diff).sum(-1)  # [T]
        t4 = time.perf_counter()
        keep_always = set(range(n_tokens)) - set(inner.tolist())  # special tokens stay in sufficiency rows
        rows = erasure_rows(ids.tolist(), (saliency, ixg, ig), inner, keep_always)
        rows = [r for r in rows if r]  # comprehensiveness at 100% of a text without special tokens: empty
        n_erasure_rows += len(rows)
        batch, mask = pad_rows(rows, pad_id)  # [rows, width] each
        width = batch.shape[1]
        with torch.no_grad():
            curves = value - torch.cat([last_logprobs(batch[s], mask[s])[:, target]
                                        for s in row_chunks(len(rows), width, budget)])  # [rows]
        t5 = time.perf_counter()
        taus.append(taus_against(loo, inner, (attention, saliency, ixg, ig)))
        add_step_times(timings, [t0, t1, t2, t3, t4, t5, time.perf_counter()])
        del curves
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "steps": timings, "mean_tau": np.nanmean(np.array(taus), axis=0).tolist(),
            "tokens": tokens, "loo_rows": loo_rows, "erasure_rows": n_erasure_rows}
