"""Run a study: examples in fixed batches, every explainer and reference, tables after every batch.

The examples are selected once (filters, length limit, ``n`` with the dataset seed) and cut into
batches of ``engine.batch_size`` in that order. Batch ``b`` always holds the same examples, and
every seeded method draws from the example's content, so a batch computes the same numbers
whether it runs alone, after a restart, or in another shard. A shard ``i/n`` computes the batches
``b`` with ``b % n == i``; whoever finds every batch done merges the tables and writes the
statistics (:mod:`probe.study.summary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError
from probe.explain.methods import family
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, TargetSpec, evaluate, prepare
from probe.metrics.agreement import agreement
from probe.study.checks import study_sanity
from probe.study.lock import folder_lock
from probe.study.plan import _ceiling_pairs, erasure_rankings, methods_needed  # noqa: F401  (re-exported)
from probe.study.store import ResultStore
from probe.study.summary import finalize

BASELINES_DOC = {
    "random": "a seeded random permutation of the scored tokens",
    "uniform": "uniform attention: every token equal, so it ranks nothing (tau = rho = 0, top-k = k/n by definition)",
    "position": "position: later tokens ranked higher (recency)",
}


@dataclass
class RunResult:
    out: Path
    n_examples: int
    n_batches: int
    computed: list[int]
    skipped: list[int]
    complete: bool
    verdict: dict | None = None


# --------------------------------------------------------------------------- examples


def _passes_filters(example, filters) -> bool:
    words = len(example.text.split())
    if filters.min_words is not None and words < filters.min_words:
        return False
    if filters.max_words is not None and words > filters.max_words:
        return False
    if filters.labels is not None and example.label not in filters.labels:
        return False
    if filters.contains is not None and not re.search(filters.contains, example.text):
        return False
    return True


def model_text(study, text: str) -> str:
    prompt = study.target.prompt
    return prompt.replace("{text}", text) if prompt else text


def select_examples(pm, study) -> tuple[list, dict]:
    """The study's examples, in study order, and counts of what was left out and why."""
    from probe.data import _take, load_dataset

    ds = study.dataset
    everything = load_dataset(ds.name, split=ds.split, n=None, seed=ds.seed,
                              text_column=ds.text_column, label_column=ds.label_column)
    kept = [e for e in everything if _passes_filters(e, ds.filters)]
    dropped = {"filters": len(everything) - len(kept)}
    limit = min(ds.max_length or pm.contract.max_positions, pm.contract.max_positions)
    lengths = [len(ids) for ids in pm.tokenizer([model_text(study, e.text) for e in kept])["input_ids"]]
    fitting = [e for e, n in zip(kept, lengths) if n <= limit]
    dropped["too_long"] = len(kept) - len(fitting)
    if not fitting:
        raise InputError(f"no example of {ds.name} is left after the filters and max_length={limit}; loosen them")
    if ds.n is not None and ds.n > len(fitting):
        raise InputError(f"n={ds.n} is larger than the {len(fitting)} examples of {ds.name} left after the filters "
                         f"and the length limit; give n <= {len(fitting)}")
    return _take(fitting, ds.n, ds.seed, ds.name), dropped


def _template_positions(pm, study, text: str, ids: list[int]) -> list[bool]:
    """True where a prompt token lies outside the inserted text (the template is not explained)."""
    prompt = study.target.prompt
    if not prompt:
        return [False] * len(ids)
    start = prompt.index("{text}")
    span = (start, start + len(text))
    enc = pm.tokenizer(model_text(study, text), return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        return [False] * len(ids)
    return [not (b > span[0] and a < span[1]) for a, b in enc["offset_mapping"]]


def prepare_study_examples(pm, study, texts: Sequence[str], gold: Sequence[int | None] | None = None) -> list[PreparedExample]:
    """Tokenise and resolve each example's target as the study says.

    ``target.choices`` (causal LMs): the explained continuation is the choice with the highest
    log-prob; ``example.label`` then holds its index, so choices are listed in label order.
    ``target.label: gold`` (classifiers): each example's dataset label (``gold``), as Abnar &
    Zuidema's "correct class". ``target.prompt``: the template's own tokens are marked special (kept in the input, never
    scored or perturbed).
    """
    t = study.target
    inputs = [model_text(study, text) for text in texts]
    if t.choices:
        per_choice = [prepare(pm, inputs, TargetSpec(kind=t.kind, continuation=c), strict_length=True) for c in t.choices]
        values = torch.tensor([[e.original_value for e in group] for group in per_choice])  # [choice, example]
        best = values.argmax(dim=0).tolist()
        examples = [dataclasses.replace(per_choice[c][i], label=c) for i, c in enumerate(best)]
    elif t.label == "gold":
        examples = prepare(pm, inputs, TargetSpec(kind=t.kind), strict_length=True)
        if gold is None or any(g is None for g in gold):
            raise InputError("target.label: gold explains each example's dataset label, and some examples have none; "
                             "give a label column or leave target.label out (the predicted class)")
        names = pm.model.config.id2label or {}
        examples = [dataclasses.replace(e, label=int(g), label_name=str(names.get(int(g), g)))
                    for e, g in zip(examples, gold)]
        values = evaluate(pm, [(e.input_ids, e) for e in examples])
        examples = [dataclasses.replace(e, original_value=value) for e, value in zip(examples, values.tolist())]
    else:
        examples = prepare(pm, inputs, TargetSpec(kind=t.kind, label=t.label, continuation=t.continuation,
                                                  reference=getattr(t, "reference", None),
                                                  dimension=getattr(t, "dimension", None)),
                           strict_length=True)
    marked = []
    for text, example in zip(texts, examples):
        template = _template_positions(pm, study, text, example.input_ids)
        marked.append(dataclasses.replace(example, special=[s or m for s, m in zip(example.special, template)]))
    return marked


# --------------------------------------------------------------------------- agreement


def units(scores: TokenScores, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An example's score rows ``[M, T]`` with the layer and head of each row (-1: not applicable)."""
    s = scores.scores[index].double().numpy()
    if s.ndim == 3:
        n_layers, n_heads, _ = s.shape
        layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
        return s.reshape(n_layers * n_heads, -1), layer, head
    if s.ndim == 2:
        return s, np.arange(s.shape[0]), np.full(s.shape[0], -1)
    return s[None], np.array([-1]), np.array([-1])


def _rows(example_index: int, explainer: str, reference: str, role: str, layer, head, values: dict, n: int) -> pd.DataFrame:
    frame = pd.DataFrame({"example": example_index, "explainer": explainer, "reference": reference, "role": role,
                          "layer": np.asarray(layer, dtype=np.int16), "head": np.asarray(head, dtype=np.int16),
                          "n_tokens": n})
    for key, value in values.items():
        frame[key] = np.asarray(value, dtype=np.float64)
    return frame


def agreement_rows(study, examples, first_index: int, scores: dict[str, TokenScores],
                   baselines: dict[str, TokenScores], left_out: list | None = None) -> pd.DataFrame:
    """One row per example x explainer x reference x layer x head (see :mod:`probe.study` docs).

    A pair scored on fewer than 2 tokens of an example is left out of the table; when ``left_out``
    is a list, each such (example, explainer, reference, role, reason) is appended to it."""
    top_k = list(study.metrics.top_k)
    wanted = set(study.metrics.agreement)
    include_special = study.statistics.include_special
    references = list(study.references)
    absolute = set(study.metrics.absolute)
    pairs: list[tuple[str, str, str]] = []  # (explainer, reference, role)
    for ref in references:
        for name in study.explainers:
            if name != ref:
                pairs.append((name, ref, "explainer"))
        for name in baselines:
            pairs.append((name, ref, "baseline"))
    for a, b in _ceiling_pairs(study):
        pairs.append((a, b, "ceiling"))
    frames = []
    for i, example in enumerate(examples):
        scorable = np.array([include_special or not s for s in example.special])
        for explainer, reference, role in pairs:
            y = scores[reference].scores[i].double().numpy()
            if reference in absolute:
                y = np.abs(y)
            if y.ndim != 1:  # a per-layer/head reference: its last layer, head mean
                y = y.reshape(-1, y.shape[-1])[-1] if y.ndim == 2 else y[-1].mean(axis=0)
            if explainer == "uniform":
                x, layer, head = np.zeros((1, len(y))), np.array([-1]), np.array([-1])
            else:
                source = baselines[explainer] if role == "baseline" else scores[explainer]
                x, layer, head = units(source, i)
                if explainer in absolute:
                    x = np.abs(x)
            keep = scorable & np.isfinite(y) & np.isfinite(x).all(axis=0)
            n = int(keep.sum())
            if n < 2:
                if left_out is not None:
                    left_out.append({"example": first_index + i, "explainer": explainer, "reference": reference,
                                     "role": role, "reason": _left_out_reason(scorable, x, y)})
                continue
            if explainer == "uniform":
                values = {"kendall_tau": [0.0], "kendall_p": [1.0], "spearman": [0.0], "spearman_p": [1.0]}
                values.update({f"top{k}": [min(k, n) / n] for k in top_k})
            else:
                values = agreement(x[:, keep], y[keep], k=top_k)
            values = {k: v for k, v in values.items() if _measure_wanted(k, wanted)}
            frames.append(_rows(first_index + i, explainer, reference, role, layer, head, values, n))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _left_out_reason(scorable: np.ndarray, x: np.ndarray, y: np.ndarray) -> str:
    if scorable.sum() < 2:
        return "fewer than 2 scored tokens"
    if not np.isfinite(x[:, scorable]).all(axis=0).any() or not np.isfinite(y[scorable]).any():
        return "not computed (over the method's length limit)"
    return "fewer than 2 tokens with a score"


def _measure_wanted(key: str, wanted: set) -> bool:
    if key.startswith("kendall"):
        return "kendall" in wanted
    if key.startswith("spearman"):
        return "spearman" in wanted
    return "top_k" in wanted


# --------------------------------------------------------------------------- other tables


def ranking_vectors(scores: TokenScores, spec: str) -> list[torch.Tensor]:
    """``METHOD@LAYER`` -> one ``[tokens]`` vector per example (per-head methods: the head mean)."""
    _, _, where = spec.partition("@")
    out = []
    for s in scores.scores:
        if s.dim() == 1:
            out.append(s)
            continue
        n_layers = s.shape[0]
        layer = {"": n_layers - 1, "last": n_layers - 1, "first": 0}.get(where)
        layer = int(where) if layer is None else layer
        if not -n_layers <= layer < n_layers:
            raise InputError(f"erasure ranking {spec!r}: the model has layers 0..{n_layers - 1}")
        v = s[layer]
        out.append(v.mean(dim=0) if v.dim() == 2 else v)
    return out


def _sites(pm, study) -> list[tuple[int, int | None]]:
    spec = study.metrics.counterfactual
    stack = "cross" if pm.task == "seq2seq" else pm.contract.primary_stack
    info = pm.contract.stacks[stack]
    layers = range(info.n_layers) if spec.layers == "all" else [
        {"first": 0, "last": info.n_layers - 1}.get(layer, layer) for layer in spec.layers]
    sites = []
    for layer in layers:
        if not isinstance(layer, int) or not 0 <= layer < info.n_layers:
            raise InputError(f"counterfactual layer {layer!r} does not exist: the model has layers 0..{info.n_layers - 1}")
        if spec.heads == "layer":
            sites.append((layer, None))
        else:
            heads = range(info.n_heads) if spec.heads == "all" else spec.heads
            for head in heads:
                if not 0 <= head < info.n_heads:
                    raise InputError(f"counterfactual head {head} does not exist: the model has heads 0..{info.n_heads - 1}")
                sites.append((layer, head))
    return sites


def _by_halves(pm, examples, first_index: int, make) -> pd.DataFrame:
    """``make(examples, first_index)``: a frame of those examples' rows. When it runs out of memory,
    it runs on each half of the examples in turn (:func:`probe.intervene.engine.in_halves`) and
    the parts are joined in example order; every intervention seeds per example, so the halves
    give what one call gives."""
    from probe.intervene.engine import in_halves

    parts = in_halves(examples, lambda part, start: make(part, first_index + start), device=pm.device)
    return parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)


def counterfactual_rows(pm, study, examples, first_index: int) -> pd.DataFrame:
    frames = [_by_halves(pm, examples, first_index,
                         lambda part, start, layer=layer, head=head: _counterfactual_site(pm, study, part, start, layer, head))
              for layer, head in _sites(pm, study)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _counterfactual_site(pm, study, examples, first_index: int, layer: int, head: int | None) -> pd.DataFrame:
    from probe.intervene.counterfactual import adversarial_attention, permuted_attention

    spec = study.metrics.counterfactual
    base = {"example": np.arange(first_index, first_index + len(examples)), "layer": layer,
            "head": -1 if head is None else head}
    perm = permuted_attention(pm, examples, layer=layer, head=head, n=spec.permutations,
                              seed=study.statistics.seed)
    summary = perm.summary()
    frame = pd.DataFrame({**base, "max_attention": summary["max_attention"].double().numpy(),
                          "perm_median_output_tvd": summary["median_output_tvd"].double().numpy(),
                          "perm_median_abs_target_change": summary["median_abs_target_change"].double().numpy(),
                          "perm_max_output_tvd": perm.output_tvd.double().nan_to_num(-1).max(dim=1).values.numpy(),
                          "perm_median_attention_jsd": perm.attention_jsd.double().nanmedian(dim=1).values.numpy()})
    if spec.adversarial:
        adv = adversarial_attention(pm, examples, layer=layer, head=head, bound=spec.max_output_tvd,
                                    candidates=spec.adversarial_candidates, steps=spec.adversarial_steps,
                                    seed=study.statistics.seed)
        frame["adv_max_attention_jsd"] = adv.summary()["max_attention_jsd"].double().numpy()
        frame["adv_feasible_frac"] = adv.feasible.double().mean(dim=1).numpy()
        frame["adv_bound"] = spec.max_output_tvd
    return frame


def head_rows(pm, study, examples, first_index: int) -> pd.DataFrame:
    return _by_halves(pm, examples, first_index, lambda part, start: _head_frame(pm, study, part, start))


def _head_frame(pm, study, examples, first_index: int) -> pd.DataFrame:
    from probe.intervene.heads import head_ablation_effects, head_importance

    spec = study.metrics.heads
    if spec.importance:
        result = head_importance(pm, examples, ablation=spec.ablation)
        importance, effects = result.per_example, result.ablation
    else:
        importance, effects = None, head_ablation_effects(pm, examples)
    n_ex = len(examples)
    if effects is not None:
        shape = effects.ablated.shape
    else:
        shape = importance.shape
    ex, layer, head = np.meshgrid(np.arange(n_ex), np.arange(shape[1]), np.arange(shape[2]), indexing="ij")
    frame = pd.DataFrame({"example": (first_index + ex).ravel(), "layer": layer.ravel().astype(np.int16),
                          "head": head.ravel().astype(np.int16)})
    if effects is not None:
        frame["ablation_change"] = effects.change.double().numpy().ravel()
    if importance is not None:
        frame["importance"] = importance.double().numpy().ravel()
    return frame


def score_rows(examples, first_index: int, scores: dict[str, TokenScores]) -> pd.DataFrame:
    frames = []
    for name, result in scores.items():
        for i in range(len(examples)):
            x, layer, head = units(result, i)
            m, t = x.shape
            frames.append(pd.DataFrame({
                "example": first_index + i, "method": name,
                "layer": np.repeat(layer, t).astype(np.int16), "head": np.repeat(head, t).astype(np.int16),
                "position": np.tile(np.arange(t), m).astype(np.int32), "score": x.ravel().astype(np.float32)}))
    return pd.concat(frames, ignore_index=True)


def convergence_rows(first_index: int, scores: dict[str, TokenScores]) -> pd.DataFrame:
    """IG's completeness delta per example and number of Gauss-Legendre points tried: one row per
    try (``steps: auto`` tries several; ``final`` marks the one the scores come from), so a report
    can show delta against steps."""
    frames = []
    for name, result in scores.items():
        deltas = result.extras.get("convergence_delta")
        if name != "integrated_gradients" or deltas is None:
            continue
        history = result.extras.get("delta_by_steps") or [[[result.params.get("steps"), d]] for d in deltas]
        gaps = [t - b for t, b in zip(result.extras["target_value"], result.extras["baseline_value"])]
        for i, tries in enumerate(history):
            frames.append(pd.DataFrame({
                "example": first_index + i, "method": name,
                "steps": np.array([int(steps) for steps, _ in tries], dtype=np.int32),
                "delta": np.array([float(delta) for _, delta in tries], dtype=np.float64), "gap": float(gaps[i]),
                "final": np.arange(len(tries)) == len(tries) - 1}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def token_rows(examples, first_index: int, include_special: bool) -> pd.DataFrame:
    rows = []
    for i, e in enumerate(examples):
        for p, (tok, tid, special) in enumerate(zip(e.tokens, e.input_ids, e.special)):
            rows.append((first_index + i, p, tok, tid, special, include_special or not special))
    return pd.DataFrame(rows, columns=["example", "position", "token", "token_id", "special", "scored"])


# --------------------------------------------------------------------------- one batch


class ForwardCounter:
    """Counts model calls and rows (a pre-hook on the model: captum's and the engine's calls alike)."""

    def __init__(self, model):
        self.calls = 0
        self.rows = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls += 1
        for key in ("input_ids", "inputs_embeds"):
            value = kwargs.get(key)
            if value is not None:
                self.rows += int(value.shape[0])
                break
        else:
            if args and hasattr(args[0], "shape"):
                self.rows += int(args[0].shape[0])

    def close(self):
        self._handle.remove()


def run_batch(pm, study, data_examples, first_index: int) -> tuple[dict[str, pd.DataFrame], dict]:
    """Every table for one batch of dataset examples, and the batch's timings."""
    from probe.explain.gradients import SHARED_GRADIENT_METHODS
    from probe.explain.methods import run_method, run_shared_gradients
    from probe.intervene.engine import Engine
    from probe.intervene.erasure import erasure, random_ranking

    started = time.perf_counter()
    counter = ForwardCounter(pm.model)
    timings: dict[str, float] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        result = fn()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        return result

    try:
        examples = timed("prepare", lambda: prepare_study_examples(pm, study, [e.text for e in data_examples],
                                                                         [e.label for e in data_examples]))
        engine = Engine(pm, token_budget=study.engine.token_budget)
        scores = {}
        needed = methods_needed(study)
        shared = [m for m in needed if m in SHARED_GRADIENT_METHODS and not study.params.get(m)]
        if len(shared) > 1:  # one gradient pass serves them all
            scores.update(timed("+".join(shared), lambda: run_shared_gradients(pm, examples, shared)))
        for method in (m for m in needed if m not in scores):
            scores[method] = timed(method, lambda m=method: run_method(pm, examples, m, engine=engine,
                                                                       params=study.params.get(m)))
        baselines = {}
        if "random" in study.metrics.baselines:
            baselines["random"] = random_ranking(examples, study.statistics.seed)
        if "position" in study.metrics.baselines:
            baselines["position"] = TokenScores("position", [torch.arange(len(e.input_ids), dtype=torch.float32)
                                                             for e in examples])
        if "uniform" in study.metrics.baselines:
            baselines["uniform"] = None
        tables = {
            "examples": pd.DataFrame({
                "example": np.arange(first_index, first_index + len(examples)),
                "id": [e.id for e in data_examples], "text": [e.text for e in data_examples],
                "label": [e.label if e.label is not None else -1 for e in data_examples],
                "target_label": [e.label if e.label is not None else -1 for e in examples],
                "target_name": [str(e.label_name) for e in examples],
                "target_value": [float(e.original_value) for e in examples],
                "n_tokens": [len(e.input_ids) for e in examples],
                "n_scored": [sum(1 for s in e.special if study.statistics.include_special or not s) for e in examples]}),
            "tokens": token_rows(examples, first_index, study.statistics.include_special),
            "scores": score_rows(examples, first_index, scores),
            "convergence": convergence_rows(first_index, scores),
        }
        left_out: list[dict] = []
        tables["agreement"] = timed("agreement", lambda: agreement_rows(study, examples, first_index, scores, baselines,
                                                                        left_out))
        tables["left_out"] = pd.DataFrame(left_out, columns=["example", "explainer", "reference", "role", "reason"])
        if study.metrics.erasure is not None:
            spec = study.metrics.erasure
            rankings = {name: ranking_vectors(scores[name.split("@")[0]], name) for name in erasure_rankings(study)}
            frame = timed("erasure", lambda: erasure(engine, examples, rankings, bins=[b / 100 for b in spec.bins],
                                                     seed=study.statistics.seed))
            frame["example"] = frame["example"] + first_index
            frame["flip"] = frame["flip"].astype("float64")
            tables["erasure"] = frame
        if study.metrics.counterfactual is not None:
            tables["counterfactual"] = timed("counterfactual", lambda: counterfactual_rows(pm, study, examples, first_index))
        if study.metrics.heads is not None and (study.metrics.heads.ablation or study.metrics.heads.importance):
            tables["heads"] = timed("heads", lambda: head_rows(pm, study, examples, first_index))
    finally:
        counter.close()
    wall = time.perf_counter() - started
    info = {"examples": len(examples), "first_example": first_index, "wall_s": wall,
            "forward_calls": counter.calls, "forward_rows": counter.rows, "peak_memory_bytes": peak_memory(pm)}
    return tables, {**info, "timings": timings}


def peak_memory(pm) -> int:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in bytes."""
    device = torch.device(pm.device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover - not on every platform
        return -1


# --------------------------------------------------------------------------- the run


def _distributed() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() and os.environ.get("PROBE_DIST_BACKEND") != "gloo"
                                else "gloo")
    return dist.get_rank(), dist.get_world_size()


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise InputError(f"--shard {text!r} is not I/N with 0 <= I < N (e.g. 0/2)")
    return int(match.group(1)), int(match.group(2))


def output_folder(study) -> Path:
    return Path(study.output or Path("results") / study.name)


def run_study(study, *, shard: tuple[int, int] | None = None, progress: bool = True,
              log: Callable[[str], None] | None = None, stop_after: int | None = None,
              report: bool = True, wait: bool = False) -> RunResult:
    """Run (or continue) ``study``; returns what was computed and, once complete, the verdict.

    ``stop_after``: stop after computing that many batches (for tests of resumption).
    ``report``: write the HTML/Markdown report (:mod:`probe.report`) once the study is complete.
    ``wait``: when another process holds the result folder (:mod:`probe.study.lock`), wait for it
    instead of refusing.
    """
    with contextlib.ExitStack() as locks:
        return _run_study(study, shard=shard, progress=progress, log=log, stop_after=stop_after, report=report,
                          wait=wait, locks=locks)


def _run_study(study, *, shard, progress, log, stop_after, report, wait, locks: contextlib.ExitStack) -> RunResult:
    from probe.models.loading import load_model

    log = log or (lambda text: print(text, file=sys.stderr))
    dist_info = _distributed()
    if dist_info is not None and shard is None:
        shard = dist_info
    device = study.model.device
    if dist_info is not None and device.startswith("cuda") and ":" not in device:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', dist_info[0]))}"
    out = output_folder(study)
    store = ResultStore(out)
    record = {"fingerprint": study.fingerprint(), "study": study.to_dict()}
    store.check(record)  # refuses another study's folder before the model loads, writing nothing
    locked = out.is_dir()
    if locked:  # a run to continue: whoever holds the folder is found before the model loads
        locks.enter_context(folder_lock(out, shard=shard, wait=wait, log=log))
        store.check(record)  # the holder may have started the folder meanwhile
    t_load = time.perf_counter()
    pm = load_model(study.model.id, device=device, dtype=study.model.dtype,
                    attn_implementation=study.model.attn_implementation, task=study.model.task,
                    allow_random_weights=study.model.allow_random_weights)
    load_seconds = time.perf_counter() - t_load
    _check_methods(pm, study)
    data, dropped = select_examples(pm, study)
    _check_labels(pm, study, data)
    store.open(record)
    if not locked:
        locks.enter_context(folder_lock(out, shard=shard, wait=wait, log=log))
    size = study.engine.batch_size
    batches = [data[s: s + size] for s in range(0, len(data), size)]
    mine = [b for b in range(len(batches)) if shard is None or b % shard[1] == shard[0]]
    done = store.done_batches()
    todo = [b for b in mine if b not in done]
    where = f" (shard {shard[0]}/{shard[1]})" if shard else ""
    log(f"study {study.name}: {len(data)} examples in {len(batches)} batches{where}; "
        f"{len(mine) - len(todo)} already done, {len(todo)} to run -> {out}")
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(batches[b]) for b in mine), initial=sum(len(batches[b]) for b in mine if b in done),
                   unit="ex", desc=study.name, dynamic_ncols=True)
    computed = []
    try:
        for b in todo:
            if stop_after is not None and len(computed) >= stop_after:
                break
            tables, info = run_batch(pm, study, batches[b], b * size)
            store.write_batch(b, tables, {**info, "device": str(pm.device), "shard": list(shard) if shard else None})
            computed.append(b)
            if bar is not None:
                bar.update(len(batches[b]))
    finally:
        if bar is not None:
            bar.close()
    if dist_info is not None:
        import torch.distributed as dist

        dist.barrier()
    all_done = store.done_batches() >= set(range(len(batches)))
    verdict = None
    if all_done and (dist_info is None or dist_info[0] == 0):
        sample = data[: study.metrics.sanity.examples]
        checks = study_sanity(pm, study, prepare_study_examples(pm, study, [e.text for e in sample],
                                                                [e.label for e in sample]))
        verdict = finalize(store, study, pm, n_batches=len(batches), dropped=dropped, load_seconds=load_seconds,
                           sanity=checks)
        if report:
            from probe.report import build_report

            files = build_report(out)
            log(f"report: {files.html}")
    if dist_info is not None:
        import torch.distributed as dist

        dist.barrier()
    elif not all_done:
        log(_not_done_hint(set(range(len(batches))) - store.done_batches(), shard))
    if all_done and (dist_info is None or dist_info[0] == 0):
        _warn_about_ties(out, study)
    return RunResult(out=out, n_examples=len(data), n_batches=len(batches), computed=computed,
                     skipped=[b for b in mine if b in done], complete=all_done, verdict=verdict)


def _not_done_hint(left: set[int], shard: tuple[int, int] | None) -> str:
    """What to run to finish: the same command, or with a sharded run the shards still missing."""
    if shard is None:
        return f"{len(left)} batch(es) not done yet: run the same command again to continue"
    n = shard[1]
    missing = sorted({b % n for b in left})
    commands = " and ".join(f"--shard {i}/{n}" for i in missing)
    return (f"{len(left)} batch(es) not done yet, of shard(s) {', '.join(f'{i}/{n}' for i in missing)}: run the same "
            f"command with {commands} to continue (or without --shard for all of them)")


def _warn_about_ties(out: Path, study) -> None:
    """Warn when a reference scores many tokens exactly 0: in bf16/fp16 small target changes round
    to zero, and those ties make the rank correlations with it less informative."""
    import warnings

    path = out / "scores.parquet"
    if not path.is_file():
        return
    refs = [r for r in study.references if family(r) == "intervention"]
    if not refs:
        return
    scores = pd.read_parquet(path, columns=["method", "score"], filters=[("method", "in", refs)])
    scores = scores[np.isfinite(scores["score"])]
    for method, values in scores.groupby("method", sort=False)["score"]:
        zeros = int((values == 0).sum())
        if len(values) and zeros / len(values) >= 0.1:
            why = (f"in {study.model.dtype} small changes of the target round to zero; fp32 resolves them"
                   if study.model.dtype != "fp32" else "the target did not change when those tokens were perturbed")
            warnings.warn(f"{method}: {zeros} of {len(values)} token scores are exactly 0 ({why}); rank agreement with "
                          f"{method} is computed over these ties", stacklevel=2)


def _check_labels(pm, study, data) -> None:
    """Refuse, before anything is written, labels the model has no class for: ``target.label`` (index
    or name), the labels of ``dataset.filters``, and with ``target.label: gold`` every example's
    label. Without ``gold`` a dataset label outside the classes is only stored: a warning says so."""
    import warnings

    from probe.rows.target import _label_index

    if pm.task != "classification":
        return
    n_labels = int(getattr(pm.model.config, "num_labels", 0) or 0)
    classes = f"this model has labels 0..{n_labels - 1}"
    names = pm.model.config.id2label or {}
    if names:
        classes += " (" + ", ".join(f"{int(k)} = {v}" for k, v in sorted(names.items(), key=lambda kv: int(kv[0]))) + ")"
    if study.target.label is not None and study.target.label != "gold":
        try:
            _label_index(pm, study.target.label)
        except InputError as err:
            raise InputError(f"target.label: {err}") from None
    wrong = [label for label in (study.dataset.filters.labels or []) if not 0 <= label < n_labels]
    if wrong:
        raise InputError(f"dataset.filters.labels {wrong} are not classes of the model: {classes}")
    outside = [e for e in data if e.label is not None and not 0 <= e.label < n_labels]
    if not outside:
        return
    first = outside[0]
    message = (f"{len(outside)} of {len(data)} examples of {study.dataset.name} have labels outside the model's "
               f"classes (e.g. {first.id}: label {first.label}); {classes}")
    if study.target.label == "gold":
        raise InputError(f"target.label: gold explains each example's label, and {message}; fix the labels or the "
                         "label column, or leave target.label out (the predicted class)")
    warnings.warn(f"{message}; they are stored as they are", stacklevel=2)


def _check_methods(pm, study) -> None:
    """Refuse methods this model cannot run before any batch starts."""
    if pm.tokenizer.mask_token_id is None and "loo_mask" in methods_needed(study):
        raise InputError("loo_mask needs a mask token and this tokenizer has none: use loo_unk, loo_pad, loo_random"
                         + (" or loo_lm" if pm.task == "causal_lm" else "") + " instead")
    if pm.tokenizer.unk_token_id is None and "loo_unk" in methods_needed(study):
        raise InputError("loo_unk needs an unknown token and this tokenizer has none: use loo_pad or loo_random instead")
    if pm.task != "causal_lm" and "loo_lm" in methods_needed(study):
        raise InputError("loo_lm draws replacements from the model itself and needs a causal LM: use loo_random instead")
    if study.target.label == "gold" and pm.task != "classification":
        raise InputError("target.label: gold applies to classifiers; a language model explains a continuation")
    if study.target.choices and pm.task != "causal_lm":
        raise InputError("target.choices applies to causal LMs; a classifier explains its predicted or given label")


__all__ = ["RunResult", "run_study", "run_batch", "select_examples", "prepare_study_examples", "parse_shard",
           "output_folder"]
