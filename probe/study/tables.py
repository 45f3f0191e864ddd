"""A batch's tables: agreement rows (explainer x reference x layer x head per example), token
scores, tokens, IG convergence, counterfactual attention and head effects.

Every function takes one batch of prepared examples and the index of its first example, and
returns a tidy frame whose ``example`` column counts from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from probe import registry
from probe.errors import InputError
from probe.metrics.agreement import agreement
from probe.rows.scores import TokenScores
from probe.study.head_screen import screen_units
from probe.study.heads_causal import SCREENED
from probe.study.plan import ceiling_pairs
from probe.study.sizes import counterfactual_sites, heads_causal_window

if TYPE_CHECKING:
    from collections.abc import Sequence

    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study

__all__ = ["agreement_rows", "convergence_rows", "counterfactual_rows", "head_edge_rows", "head_rows",
           "ranking_vectors", "score_rows", "token_rows"]


# --------------------------------------------------------------------------- agreement


class _Columns:
    """The agreement table's columns, filled a (example, explainer, reference) block of units at a
    time and made into one frame at the end (one small frame per block, concatenated, cost ~2 ms
    each). A measure missing from a block is NaN there, as ``pd.concat`` would leave it."""

    def __init__(self):
        self.length = 0
        self.base: dict[str, list] = {key: [] for key in ("example", "explainer", "reference", "role", "layer", "head",
                                                           "n_tokens")}
        self.measures: dict[str, list[np.ndarray]] = {}

    def add(self, example_index: int, explainer: str, reference: str, role: str, layer, head, values: dict,
            n: int) -> None:
        m = len(layer)
        self.base["example"].append(np.full(m, example_index, dtype=np.int64))
        for key, value in (("explainer", explainer), ("reference", reference), ("role", role)):
            self.base[key].append(np.full(m, value, dtype=object))
        self.base["layer"].append(np.asarray(layer, dtype=np.int16))
        self.base["head"].append(np.asarray(head, dtype=np.int16))
        self.base["n_tokens"].append(np.full(m, n, dtype=np.int64))
        for key in values:
            if key not in self.measures:
                self.measures[key] = [np.full(self.length, np.nan)]
        for key, parts in self.measures.items():
            parts.append(np.asarray(values[key], dtype=np.float64) if key in values else np.full(m, np.nan))
        self.length += m

    def frame(self) -> pd.DataFrame:
        if not self.length:
            return pd.DataFrame()
        columns = {key: np.concatenate(parts) for key, parts in {**self.base, **self.measures}.items()}
        return pd.DataFrame(columns)


#: why an example of a span study has no agreement row: the pattern covers none of its scored tokens
#: (its unit example has no token at all); counted as ``no_span`` in the provenance's ``left_out``
NO_SPAN = "no span (the pattern covers none of its scored tokens)"


def agreement_rows(study: Study, examples: Sequence[PreparedExample], first_index: int,
                   scores: dict[str, TokenScores], baselines: dict[str, TokenScores | None],
                   left_out: list | None = None) -> pd.DataFrame:
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
    for a, b in ceiling_pairs(study):
        pairs.append((a, b, "ceiling"))
    columns = _Columns()
    for i, example in enumerate(examples):
        scorable = np.array([include_special or not s for s in example.special], dtype=bool)
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
                x, layer, head = source.unit_rows(i)
                if explainer in absolute:
                    x = np.abs(x)
            keep = scorable & np.isfinite(y) & np.isfinite(x).all(axis=0)
            n = int(keep.sum())
            if n < 2:
                if left_out is not None:
                    left_out.append({"example": first_index + i, "explainer": explainer, "reference": reference,
                                     "role": role, "reason": _left_out_reason(scorable, x, y) if len(scorable)
                                     else NO_SPAN})
                continue
            if explainer == "uniform":
                values = {"kendall_tau": [0.0], "kendall_p": [1.0], "spearman": [0.0], "spearman_p": [1.0]}
                values.update({f"top{k}": [min(k, n) / n] for k in top_k})
            else:
                values = agreement(x[:, keep], y[keep], k=top_k)
            values = {k: v for k, v in values.items() if _measure_wanted(k, wanted)}
            columns.add(first_index + i, explainer, reference, role, layer, head, values, n)
    return columns.frame()


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


def _sites(pm: ProbeModel, study: Study) -> list[tuple[int, int | None]]:
    info = pm.contract.stacks[pm.task.target_stack(pm.contract)]
    return counterfactual_sites(study.metrics.counterfactual, info.n_layers, info.n_heads)


def _by_halves(pm: ProbeModel, examples: Sequence[PreparedExample], first_index: int, make) -> pd.DataFrame:
    """``make(examples, first_index)``: a frame of those examples' rows. When it runs out of memory,
    it runs on each half of the examples in turn (:func:`probe.rows.memory.in_halves`) and
    the parts are joined in example order; every intervention seeds per example, so the halves
    give what one call gives."""
    from probe.rows.memory import in_halves

    parts = in_halves(examples, lambda part, start: make(part, first_index + start), device=pm.device)
    return parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)


def counterfactual_rows(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample],
                        first_index: int) -> pd.DataFrame:
    frames = [_by_halves(pm, examples, first_index,
                         lambda part, start, layer=layer, head=head: _counterfactual_site(pm, study, part, start, layer, head))
              for layer, head in _sites(pm, study)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _counterfactual_site(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int,
                         layer: int, head: int | None) -> pd.DataFrame:
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


def head_rows(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int) -> pd.DataFrame:
    return _by_halves(pm, examples, first_index, lambda part, start: _head_frame(pm, study, part, start))


def _head_frame(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int) -> pd.DataFrame:
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


def tested_heads(pm: ProbeModel, study: Study) -> tuple[list[int], list[int]]:
    """The layers and query heads of the target stack the per-head causal test
    (``study.metrics.heads_causal``) covers; a one-line error naming one that does not exist."""
    info = pm.contract.stacks[pm.task.target_stack(pm.contract)]
    return heads_causal_window(study.metrics.heads_causal, info.n_layers, info.n_heads)


def head_edge_rows(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int,
                   scores: Mapping[str, TokenScores]) -> pd.DataFrame:
    """The per-head causal test's rows (``study.metrics.heads_causal``, judged by
    :mod:`probe.study.heads_causal`): per example, tested layer x head and position, the head's
    attention weight from the target row (the ``attention`` explainer's scores, reused when the study
    computed them) and the knockout effect of that one edge, blocked in that head of that layer alone
    (:func:`probe.intervene.knockout.edge_knockout` with ``per_head``; NaN where a token is not scored)."""
    computed = scores.get("attention")
    if computed is not None and len(computed.scores) != len(examples):
        computed = None

    def make(part, start: int) -> pd.DataFrame:
        attention = computed.scores[start:start + len(part)] if computed is not None else None
        return _head_edge_frame(pm, study, part, first_index + start, attention)

    return _by_halves(pm, examples, 0, make)


def _head_edge_frame(pm: ProbeModel, study: Study, examples: Sequence[PreparedExample], first_index: int,
                     attention: list | None) -> pd.DataFrame:
    from probe.intervene.knockout import edge_knockout
    from probe.methods import run_method

    spec = study.metrics.heads_causal
    layers, heads = tested_heads(pm, study)
    if attention is None:  # the study does not run the attention explainer: read it here
        attention = run_method(pm, examples, "attention", params=study.params.get("attention")).scores
    grid = np.array([(layer, head) for layer in layers for head in heads], dtype=np.int64)  # [unit, 2]
    weights = [attention[i].double().numpy()[grid[:, 0], grid[:, 1], :len(e.input_ids)]  # [unit, tokens]
               for i, e in enumerate(examples)]
    estimates = labels = units = None
    if spec.screen is not None:  # AtP picks, per example, the heads that run exactly (probe.study.head_screen)
        estimates, labels = screen_units(pm, study, examples, first_index, grid)
        units = [{(int(grid[u, 0]), int(grid[u, 1])) for u in np.flatnonzero(lab != SCREENED)} for lab in labels]
    knocked = edge_knockout(pm, examples, layers=layers, heads=heads, per_head=True, renormalise=spec.renormalise,
                            keep_special=study.statistics.include_special, batch_size=spec.batch_size,
                            units=units).per_head
    frames = []
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        effects = knocked.scores[i].double().numpy()[grid[:, 0], grid[:, 1], :n]  # [unit, tokens]
        frame = pd.DataFrame({
            "example": np.full(grid.shape[0] * n, first_index + i, dtype=np.int64),
            "layer": np.repeat(grid[:, 0], n).astype(np.int16), "head": np.repeat(grid[:, 1], n).astype(np.int16),
            "position": np.tile(np.arange(n), grid.shape[0]).astype(np.int32),
            "attention": weights[i].ravel(), "knockout": effects.ravel()})
        if estimates is not None and labels is not None:
            frame["atp"] = estimates[i].ravel()
            frame["screen"] = np.repeat(labels[i], n).astype(str)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def score_rows(examples: Sequence[PreparedExample], first_index: int, scores: dict[str, TokenScores]) -> pd.DataFrame:
    frames = []
    for name, result in scores.items():
        frame = result.to_pandas()
        frame["example"] += first_index
        frame.insert(1, "method", name)
        frames.append(frame.astype({"layer": np.int16, "head": np.int16, "position": np.int32, "score": np.float32}))
    return pd.concat(frames, ignore_index=True)


def scores_from_rows(scores: pd.DataFrame, convergence: pd.DataFrame | None,
                     examples: Sequence[PreparedExample],
                     params: Mapping[str, Mapping] | None = None) -> dict[str, TokenScores]:
    """The inverse of :func:`score_rows` and :func:`convergence_rows` for the study's first
    ``len(examples)`` examples: each method's :class:`TokenScores` as the batch computed it (the
    stored fp32 scores are the computed ones, bit for bit), with a path method's convergence delta
    and gap in ``extras``. A method whose rows do not cover those examples' tokens is left out
    (the caller computes it)."""
    params = params or {}
    first = scores[scores["example"] < len(examples)]
    out: dict[str, TokenScores] = {}
    for method, rows in first.groupby("method", sort=False):
        layers, heads = int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1
        per_head, per_layer = heads > 0, heads <= 0 and layers > 0
        tensors = []
        for i, e in enumerate(examples):
            part = rows[rows["example"] == i].sort_values(["layer", "head", "position"], kind="stable")
            n = len(e.tokens)
            shape = (layers, heads, n) if per_head else (layers, n) if per_layer else (n,)
            if len(part) != int(np.prod(shape)) or part["position"].max() != n - 1:
                break
            tensors.append(torch.from_numpy(part["score"].to_numpy(np.float32).reshape(shape).copy()))
        if len(tensors) != len(examples):
            continue
        extras: dict[str, Any] = {}
        entry = registry.find(method)
        if entry is not None and entry.completeness:
            if convergence is None or not len(convergence):
                continue
            final = convergence[(convergence["method"] == method) & convergence["final"]
                                & (convergence["example"] < len(examples))].sort_values("example")
            if len(final) != len(examples):
                continue
            extras = {"convergence_delta": final["delta"].tolist(), "target_value": final["gap"].tolist(),
                      "baseline_value": [0.0] * len(final)}  # the check reads the gap, target - baseline
        out[str(method)] = TokenScores(method=str(method), scores=tensors, params=dict(params.get(method) or {}),
                                       per_head=per_head, per_layer=per_layer, extras=extras)
    return out


def convergence_rows(first_index: int, scores: dict[str, TokenScores]) -> pd.DataFrame:
    """IG's completeness delta per example and number of Gauss-Legendre points tried: one row per
    try (``steps: auto`` tries several; ``final`` marks the one the scores come from), so a report
    can show delta against steps."""
    frames = []
    for name, result in scores.items():
        deltas = result.extras.get("convergence_delta")
        entry = registry.find(name)
        if entry is None or not entry.completeness or deltas is None:
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


def token_rows(examples: Sequence[PreparedExample], first_index: int, include_special: bool) -> pd.DataFrame:
    rows = []
    for i, e in enumerate(examples):
        for p, (tok, tid, special) in enumerate(zip(e.tokens, e.input_ids, e.special)):
            rows.append((first_index + i, p, tok, tid, special, include_special or not special))
    return pd.DataFrame(rows, columns=["example", "position", "token", "token_id", "special", "scored"])
