"""One batch of a study: prepare its examples, run every method once, and make every table.

A batch is computed the same whether it runs alone, after a restart or in another shard: every
seeded method draws from the example's content (see :mod:`probe.study.runner`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError
from probe.rows.scores import TokenScores
from probe.rows.target import sources
from probe.study.examples import prepare_examples
from probe.study.plan import erasure_rankings, methods_needed
from probe.study.sinks import study_sinks
from probe.study.steps import STEP_STRIDE, unit_number
from probe.study.tables import (
    agreement_rows,
    convergence_rows,
    counterfactual_rows,
    head_edge_rows,
    head_rows,
    ranking_vectors,
    score_rows,
    token_rows,
)

if TYPE_CHECKING:
    from probe.data import Example
    from probe.intervene.engine import Engine
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study

__all__ = ["ForwardCounter", "peak_memory", "run_batch"]


class ForwardCounter:
    """Counts model calls and rows (a pre-hook on the model: captum's and the engine's calls alike);
    ``backward_rows``: the rows of calls made with gradients on (each a forward and a backward)."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.rows = 0
        self.backward_rows = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls += 1
        rows = 0
        for key in ("input_ids", "inputs_embeds"):
            value = kwargs.get(key)
            if value is not None:
                rows = int(value.shape[0])
                break
        else:
            if args and hasattr(args[0], "shape"):
                rows = int(args[0].shape[0])
        self.rows += rows
        if torch.is_grad_enabled():
            self.backward_rows += rows

    def close(self) -> None:
        self._handle.remove()


class _Timings:
    """``timed(name, fn)``: runs ``fn`` and adds its seconds to ``seconds[name]`` (in first-call order)
    and the model rows it ran to ``rows[name]`` (``[forwards, backwards]``: rows run without and with
    gradients, from ``counter``); ``on_step(name)`` is told each step as it starts (progress)."""

    def __init__(self, on_step: Callable[[str], None] | None = None, counter: ForwardCounter | None = None):
        self.seconds: dict[str, float] = {}
        self.rows: dict[str, list[int]] = {}
        self.on_step = on_step
        self.counter = counter

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        if self.on_step is not None:
            self.on_step(name)
        counter = self.counter
        rows, backward = (counter.rows, counter.backward_rows) if counter is not None else (0, 0)
        t0 = time.perf_counter()
        result = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        if counter is not None:
            done = self.rows.setdefault(name, [0, 0])
            done[0] += (counter.rows - rows) - (counter.backward_rows - backward)
            done[1] += counter.backward_rows - backward
        return result


def run_batch(pm: ProbeModel, study: Study, data_examples: list[Example],
              first_index: int, *, on_step: Callable[[str], None] | None = None,
              settled: Mapping[str, Any] | None = None) -> tuple[dict[str, pd.DataFrame], dict]:
    """Every table for one batch of dataset examples, and the batch's timings and engine counters
    (``info["engine"]``: :class:`~probe.intervene.rowcache.EngineStats`, with the sizes settled on
    after running out of memory); ``on_step(name)`` is told each step (a method, the agreement, ...)
    as it starts. ``settled``: an earlier batch's ``info["engine"]``, whose settled sizes this batch
    starts from (:meth:`~probe.intervene.rowcache.RowCache.start_from`)."""
    from probe.intervene.engine import Engine

    started = time.perf_counter()
    counter = ForwardCounter(pm.model)
    timed = _Timings(on_step, counter)
    try:
        examples = timed("prepare", lambda: prepare_examples(pm, study.target, [e.text for e in data_examples],
                                                             [e.label for e in data_examples]))
        data_index = first_index  # the batch's first dataset example (units may be numbered otherwise)
        if study.target.stepwise:  # units: the output tokens of the batch's examples, from first example * STEP_STRIDE
            first_index = unit_number(first_index, 0)
            if len(examples) > STEP_STRIDE * len(data_examples):
                raise InputError(f"an output of more than {STEP_STRIDE} tokens cannot be explained token by token; "
                                 "give a shorter continuation")
        engine = Engine(pm, token_budget=study.engine.token_budget)
        engine.start_from(settled)
        token_scores = _method_scores(pm, study, examples, engine, timed)
        units, scores = examples, token_scores
        if study.spans is not None:  # the units compared are spans: scores folded, references perturb whole spans
            units, scores = _span_units(pm, study, examples, token_scores, engine, timed)
        baselines = _baselines(study, units)
        frame = (_step_frame(study, data_examples, units, data_index, first_index) if study.target.stepwise
                 else _examples_frame(study, data_examples, units, first_index))
        frame["n_tokens"] = [len(e.input_ids) for e in examples]
        tables = {"examples": frame,
                  "tokens": token_rows(units, first_index, study.statistics.include_special),
                  "scores": score_rows(units, first_index, scores),
                  "convergence": convergence_rows(first_index, scores)}
        left_out: list[dict] = []
        tables["agreement"] = timed("agreement", lambda: agreement_rows(study, units, first_index, scores, baselines,
                                                                        left_out))
        tables["left_out"] = pd.DataFrame(left_out, columns=["example", "explainer", "reference", "role", "reason"])
        tables.update(_intervention_tables(pm, study, examples, first_index, token_scores, engine, timed))
        sinks = (timed("sinks", lambda: study_sinks(pm, study, examples, first_index, data_index, token_scores))
                 if study.metrics.sinks else None)
        if sinks is not None:
            tables["sinks"] = sinks
        if study.spans is None and study.metrics.interactions:
            tables["interactions"] = timed("interactions", lambda: _interactions(study, examples, first_index,
                                                                                  token_scores, engine))
    finally:
        counter.close()
    wall = time.perf_counter() - started
    info = {"examples": len(examples), "first_example": first_index, "wall_s": wall,
            "forward_calls": counter.calls, "forward_rows": counter.rows, "peak_memory_bytes": peak_memory(pm),
            "load_average": _load_average(), "engine": engine.stats.as_dict()}
    return tables, {**info, "timings": timed.seconds, "step_rows": timed.rows}


def _load_average() -> float | None:
    """The machine's 1-minute load average as a batch ends (None where the system has none): a
    timing read beside it says whether other work shared the machine."""
    import os

    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _method_scores(pm: ProbeModel, study: Study, examples: list[PreparedExample], engine: Engine,
                   timed: _Timings) -> dict[str, TokenScores]:
    """Every method the study needs, once; gradient methods without parameters share one pass."""
    from probe.methods import one_pass_gradients, run_method, run_shared_gradients

    scores = {}
    needed = methods_needed(study)
    shared = one_pass_gradients(needed, study.params)
    if shared:  # one gradient pass serves them all
        scores.update(timed("+".join(shared), lambda: run_shared_gradients(pm, examples, shared, engine=engine)))
    for method in (m for m in needed if m not in scores):
        scores[method] = timed(method, lambda m=method: run_method(pm, examples, m, engine=engine,  # type: ignore[misc]  # mypy cannot infer a lambda with a default (python/mypy#15459)
                                                                   params=study.params.get(m)))
    return scores


def _span_units(pm: ProbeModel, study: Study, examples: list[PreparedExample], token_scores: dict[str, TokenScores],
                engine: Engine, timed: _Timings) -> tuple[list[PreparedExample], dict[str, TokenScores]]:
    """``study.spans`` as the units: each example's spans (:func:`probe.rows.spans.find_spans`) as
    the positions of a unit example (its tokens the spans' texts, none special), each method's
    token scores folded over them, and every intervention with a span form run again on whole spans
    (:func:`probe.intervene.spans.span_reference`: loo_delete, loo_mask, loo_unk, loo_pad on whole
    spans; shapley with the spans as its players)."""
    from probe.intervene.spans import span_reference
    from probe.registry import method as method_entry
    from probe.rows.spans import folded_scores, spans_per_example

    found = spans_per_example(pm, examples, study.spans.pattern, require_any=False)  # checked over the study: runner
    scores = {}
    for name, result in token_scores.items():
        if not method_entry(name).has_span_form:
            scores[name] = folded_scores(result, found, study.spans.aggregate)
            continue
        by_example = timed(f"{name} (spans)", lambda m=name: span_reference(engine, examples, found, m,  # type: ignore[misc]  # mypy cannot infer a lambda with a default (python/mypy#15459)
                                                                            study.params.get(m)))
        scores[name] = TokenScores(name, [torch.from_numpy(v.astype(np.float32)) for v in by_example],
                                   params=result.params)
    units = [dataclasses.replace(e, input_ids=[e.input_ids[s.positions[0]] for s in spans],
                                 special=[False] * len(spans), tokens=[s.text for s in spans])
             for e, spans in zip(examples, found)]
    return units, scores


def _baselines(study: Study, examples: list[PreparedExample]) -> dict[str, TokenScores | None]:
    """The study's baseline rankings (``uniform`` needs no scores: its agreement is known)."""
    from probe.intervene.erasure import random_ranking

    baselines: dict[str, TokenScores | None] = {}
    if "random" in study.metrics.baselines:
        baselines["random"] = random_ranking(examples, study.statistics.seed)
    if "position" in study.metrics.baselines:
        baselines["position"] = TokenScores("position", [torch.arange(len(e.input_ids), dtype=torch.float32)
                                                         for e in examples])
    if "uniform" in study.metrics.baselines:
        baselines["uniform"] = None
    return baselines


def _examples_frame(study: Study, data_examples: list[Example], examples: list[PreparedExample],
                    first_index: int) -> pd.DataFrame:
    return pd.DataFrame({
        "example": np.arange(first_index, first_index + len(examples)),
        "id": [e.id for e in data_examples], "text": [e.text for e in data_examples],
        "label": [e.label if e.label is not None else -1 for e in data_examples],
        "target_label": [e.label if e.label is not None else -1 for e in examples],
        "target_name": [str(e.label_name) for e in examples],
        "target_value": [float(e.original_value) for e in examples],
        "n_tokens": [len(e.input_ids) for e in examples],
        "n_scored": [sum(1 for s in e.special if study.statistics.include_special or not s) for e in examples]})


def _step_frame(study: Study, data_examples: list[Example], examples: list[PreparedExample], data_index: int,
                first_unit: int) -> pd.DataFrame:
    """A step study's examples table: one row per unit (an output token of a dataset example), with the
    dataset example it belongs to (``source``), its ``step`` and the output token (``target_name``)."""
    owners = sources(examples)
    frame = _examples_frame(study, [data_examples[o] for o in owners], examples, first_unit)
    frame.insert(1, "source", np.asarray(owners, dtype=np.int64) + data_index)
    frame.insert(2, "step", np.asarray([e.output_index for e in examples], dtype=np.int64))
    return frame


def _intervention_tables(pm: ProbeModel, study: Study, examples: list[PreparedExample], first_index: int,
                         scores: dict[str, TokenScores], engine: Engine, timed: _Timings) -> dict[str, pd.DataFrame]:
    """The erasure curves, counterfactual attention, head effects and the per-head causal test's edges
    the study asks for."""
    from probe.intervene.erasure import erasure

    tables = {}
    if study.metrics.erasure is not None:
        spec = study.metrics.erasure
        rankings = {name: ranking_vectors(scores[name.split("@")[0]], name) for name in erasure_rankings(study)}
        frame = timed("erasure", lambda: erasure(engine, examples, rankings, bins=[b / 100 for b in spec.bins],
                                                 seed=study.statistics.seed, flips=spec.flips))
        frame["example"] = frame["example"] + first_index
        frame["flip"] = frame["flip"].astype("float64")
        tables["erasure"] = frame
    if study.metrics.counterfactual is not None:
        tables["counterfactual"] = timed("counterfactual", lambda: counterfactual_rows(pm, study, examples, first_index))
    if study.metrics.heads is not None and (study.metrics.heads.ablation or study.metrics.heads.importance):
        tables["heads"] = timed("heads", lambda: head_rows(pm, study, examples, first_index))
    if study.metrics.heads_causal is not None:
        tables["head_edges"] = timed("heads_causal", lambda: head_edge_rows(pm, study, examples, first_index, scores))
    return tables


def interaction_mode(study: Study) -> str:
    """How the pair check removes a token: as the verdict reference does (its leave-one-out or Shapley
    mode, where deterministic), else by deletion."""
    from probe.registry import find

    ref = study.verdict_reference
    entry = find(ref)
    mode = entry.span_mode if entry is not None else None
    if mode is None and ref == "shapley":
        mode = (study.params.get("shapley") or {}).get("mode", "delete")
    return mode or "delete"


def _interactions(study: Study, examples: list[PreparedExample], first_index: int,
                  scores: dict[str, TokenScores], engine: Engine) -> pd.DataFrame:
    """Joint deletion of each example's top tokens in pairs (:func:`probe.intervene.pairs.pair_interactions`):
    the top tokens of the verdict reference and of the study's first attention explainer."""
    from probe.intervene.pairs import pair_interactions, top_positions
    from probe.registry import find

    rankings = [ranking_vectors(scores[study.verdict_reference], study.verdict_reference)]
    attention = [m for m in study.explainers if (entry := find(m)) is not None and entry.family == "attention"]
    if attention:
        first = "attention_mean" if "attention_mean" in attention else attention[0]
        rankings.append(ranking_vectors(scores[first], first))
    candidates = [sorted({t for ranking in rankings for t in top_positions(ranking[i], e)})
                  for i, e in enumerate(examples)]
    return pair_interactions(engine, examples, candidates, mode=interaction_mode(study), first_index=first_index)


def peak_memory(pm: ProbeModel) -> int:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in bytes."""
    device = torch.device(pm.device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover - not on every platform
        return -1
