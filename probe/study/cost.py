"""What a study will cost before it runs (``probe plan``): per step, the model rows it runs without
gradients (forwards) and with them (backwards: a forward and a backward each), the seconds and the
peak memory predicted on the study's device, the total, and whether it fits the device's memory.

The prediction is a calibration on the real model, not a table of constants. The study's model is
loaded (its seconds are the run's load), a sample of the examples is prepared for their lengths, and
one batch of :data:`SAMPLE` examples near the median length runs every step of the study as the run
would (:func:`probe.study.batch.run_batch`), with the costliest methods at reduced settings
(:func:`calibration_params`: Shapley at 2 orders, per-head knockout on one layer, integrated
gradients at 16 points, ...). Each step's seconds, rows and memory are measured there and scaled to
the study:

* rows: a method's rows per example are counted from its parameters and each example's length
  (:func:`method_rows`: leave-one-out one row per scored token, Shapley ``2^players`` exact or
  ``orders x (players + 1)`` sampled, integrated gradients one backward per point, ...); a step that
  is not a method (erasure, the pair check, ...) runs a fixed number of rows per example, read off
  the sample; an adaptive method (``steps: auto``) at the rate the sample needed (marked ``~``);
* seconds: the sample's seconds per row, scaled by each row's length with the forward's FLOPs
  (``T (6 d + T)`` for ``T`` tokens and width ``d``: projections and MLP linear in ``T``, attention
  quadratic);
* memory: the loaded model plus the largest step's activations, measured on the sample per token
  of its largest call and scaled to the run's largest call (the engine packs ``engine.token_budget``
  tokens a call; gradients :data:`~probe.explainers.gradient_forward.GRADIENT_TOKEN_BUDGET`; the
  attention methods a whole batch of examples).

The checks after the steps: the randomisation check from the same rates (each method on the sanity
examples on :data:`~probe.study.randomisation.RANDOM_DRAWS` random weight draws per cascade stage,
integrated gradients at 16 points, the reference on them and on the trained model); the completeness
check's search for the points that would do where the calibration batch's IG fails completeness
(every try up to :data:`~probe.study.sanity.MAX_STEPS`, on the examples that decide each); the statistics
timed on the calibration batch's tables, alone and repeated (a fixed part and a part per example);
the report from the figures it draws (:func:`_report_seconds`, not calibrated).
:func:`probe.study.budget.fit_budget` says which settings would bring the plan under a time or memory
budget."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from probe.errors import InputError
from probe.study.meter import StepMeter, resident_bytes, trim_allocator

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study

__all__ = ["PLAN_MEMORY_VARIABLE", "SAMPLE", "StepCost", "StudyPlan", "calibration_params", "duration_words",
           "granted_memory", "method_rows", "parse_budget", "parse_memory", "plan_study", "row_weight", "size_words"]

#: the environment variable that sets the memory a study may use (an amount: ``40GiB``)
PLAN_MEMORY_VARIABLE = "PROBE_PLAN_MEMORY"
#: examples the calibration batch runs every step on
SAMPLE = 2
#: examples prepared to read the study's length distribution (more are scaled from them)
LENGTH_SAMPLE = 64
#: the report's fixed seconds; the statistics where they could not be timed on the calibration batch
#: add as many
AFTER_STEPS_SECONDS = 0.5
#: the report's seconds per method drawn per layer x head, and per section beyond the agreement: fitted
#: to the reports of the quickstart, context-mixing and bench studies on a 2-core CPU (6.9, 1.7, 0.9 s)
REPORT_SECONDS_PER_HEAD_METHOD = 1.3
REPORT_SECONDS_PER_SECTION = 0.6
#: times the calibration batch's tables are repeated to time the statistics' growth with the examples
STATISTICS_COPIES = 4
#: what each copy adds to the example numbers (past every real one)
COPY_STRIDE = 10**6


@dataclasses.dataclass
class StepCost:
    """One step of the plan: ``forwards`` rows run without gradients, ``backwards`` rows run with them
    (a forward and a backward each), predicted ``seconds`` and activation ``peak_bytes`` above the
    loaded model; ``approximate`` where the rows are a rate read off the sample (an adaptive method,
    or rows the engine de-duplicates) rather than counted."""
    step: str
    forwards: int
    backwards: int
    seconds: float
    peak_bytes: int
    approximate: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StudyPlan:
    """A study's predicted cost (:func:`plan_study`)."""
    study: str
    model: str
    device: str
    examples: int
    lengths: dict[str, float]
    load_seconds: float
    steps: list[StepCost]
    phases: dict[str, float]
    model_bytes: int
    available_bytes: int | None
    calibration_seconds: float

    @property
    def seconds(self) -> float:
        """The whole run: the model's load, every step, and the phases after them."""
        return self.load_seconds + sum(s.seconds for s in self.steps) + sum(self.phases.values())

    @property
    def peak_bytes(self) -> int:
        """The loaded model plus the largest step's activations."""
        return self.model_bytes + max((s.peak_bytes for s in self.steps), default=0)

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits the device's available memory (True where it is unknown)."""
        return self.available_bytes is None or self.peak_bytes <= self.available_bytes

    def lines(self) -> list[str]:
        """The plan as a text table: a row per step and phase, the total, the peak and the memory."""
        head = (f"plan of {self.study}: {self.examples} examples on {self.model}, {self.device}; tokens per "
                f"example {self.lengths['median']:.0f} median, {self.lengths['max']:.0f} longest "
                f"(calibrated in {self.calibration_seconds:.0f} s)")
        rows = [("model load", "", "", duration_words(self.load_seconds), "")]
        for s in self.steps:
            mark = "~" if s.approximate else ""
            rows.append((s.step, f"{mark}{s.forwards:,}", f"{mark}{s.backwards:,}", duration_words(s.seconds),
                         size_words(s.peak_bytes)))
        rows += [(name, "", "", duration_words(seconds), "") for name, seconds in self.phases.items()]
        rows.append(("total", f"{sum(s.forwards for s in self.steps):,}", f"{sum(s.backwards for s in self.steps):,}",
                     duration_words(self.seconds), ""))
        header = ("step", "forwards", "backwards", "seconds", "peak (above the model)")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
        table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [header, *rows]]
        memory = (f"peak {size_words(self.peak_bytes)} = the loaded model {size_words(self.model_bytes)} + "
                  "the largest step; "
                  + (f"{size_words(self.available_bytes)} available: " + ("fits" if self.fits else "DOES NOT FIT")
                     if self.available_bytes is not None else "the device's memory is unknown"))
        return [head, *table, memory, "forwards: rows run without gradients; backwards: rows run with them (a "
                "forward and a backward each); ~: a rate read off the calibration batch, not counted"]

    def to_dict(self) -> dict:
        return {"study": self.study, "model": self.model, "device": self.device, "examples": self.examples,
                "lengths": self.lengths, "load_seconds": self.load_seconds,
                "steps": [s.to_dict() for s in self.steps], "phases": self.phases,
                "seconds": self.seconds, "model_bytes": self.model_bytes, "peak_bytes": self.peak_bytes,
                "available_bytes": self.available_bytes, "fits": self.fits,
                "calibration_seconds": self.calibration_seconds}


# --------------------------------------------------------------------------- rows, counted


def row_weight(tokens: int, width: int) -> float:
    """A model row's cost in the plan's units, the forward's FLOPs up to a constant: ``T (6 d + T)`` for
    ``T`` tokens and width ``d`` (projections and MLP linear in ``T``, attention quadratic). A measured
    row's seconds scale to another length by the ratio of these."""
    return tokens * (6 * width + tokens)


def _scored(example: PreparedExample) -> int:
    return sum(1 for s in example.special if not s)


def method_rows(pm: ProbeModel, name: str, params: Mapping[str, Any] | None,
                example: PreparedExample) -> tuple[int, int] | None:
    """``(forwards, backwards)``: the model rows ``name`` runs on ``example`` at ``params``, or None where
    they are not counted here (adaptive: integrated gradients with ``steps: auto``). The engine's
    de-duplication may run fewer (deleting either of two equal neighbours gives one row)."""
    from probe.registry import method as method_entry

    entry = method_entry(name)
    p = dataclasses.replace(entry.defaults(), **{k: v for k, v in (params or {}).items()
                                                 if k in {f.name for f in dataclasses.fields(entry.params)}})
    scored = _scored(example)
    if entry.family == "attention":
        return (0, 1) if entry.needs_gradients else (1, 0)
    if entry.family == "intervention" and entry.needs_gradients:  # atp: one forward and backward per example
        return 0, 1
    if entry.family == "gradient":
        points = getattr(p, entry.points, 1) if entry.points else 1
        if not isinstance(points, int) or isinstance(points, bool):
            return None
        return (4 if entry.points else 1), points
    if name == "shapley":
        return _shapley_rows(pm, p, example), 0
    if name == "knockout":
        return _knockout_rows(pm, p, scored), 0
    draws = int(getattr(p, "k", 1)) if dict(entry.preset).get("mode") in ("random", "lm") else 1
    return draws * scored + 1, 0


def _shapley_rows(pm: ProbeModel, p: Any, example: PreparedExample) -> int:
    from probe.intervene.shapley import PILOT_ORDERS, shapley_players
    from probe.registry.params import SHAPLEY_ROW_LIMIT

    players = len(shapley_players(pm, example, p.units))
    if players <= p.exact_max:
        return 2 ** players
    # the kernel estimator asks for as many coalitions as the orders; auto's pilot of the estimator it
    # does not choose adds its rows (the chosen one's are the final run's first)
    pilot = PILOT_ORDERS * (players + 1) if getattr(p, "estimator", "permutation") == "auto" else 0
    return min(p.permutations * (players + 1), SHAPLEY_ROW_LIMIT) + pilot + 1


def _knockout_rows(pm: ProbeModel, p: Any, scored: int) -> int:
    from probe.intervene.knockout import knockout_window

    rows = scored + 1
    if p.per_head:
        layers, heads = knockout_window(p.layers, p.heads, pm.contract.n_layers, pm.contract.n_heads)
        rows += len(layers) * len(heads) * scored
    return rows


def calibration_params(name: str, params: Mapping[str, Any] | None) -> dict | None:
    """The settings ``name`` runs at in the calibration batch: the study's, except where one example
    would cost minutes (Shapley at 2 orders, per-head knockout on one layer, integrated gradients at
    16 points, GradientSHAP at 4 samples, sampled leave-one-out at 2 draws). Rows scale from them."""
    p = dict(params or {})
    if name == "shapley":
        return {**p, "exact_max": 0, "permutations": 2}
    if name == "knockout" and p.get("per_head"):
        return {**p, "layers": [0]}
    if name == "integrated_gradients" and isinstance(p.get("steps", 50), int):
        return {**p, "steps": min(int(p.get("steps", 50)), 16)}
    if name == "gradient_shap":
        return {**p, "n_samples": min(int(p.get("n_samples", 20)), 4)}
    if name.startswith("loo_") and name.removeprefix("loo_") in ("random", "lm"):
        return {**p, "k": min(int(p.get("k", 8)), 2)}
    return params if params is None else p


# --------------------------------------------------------------------------- the calibration batch


def _sample_examples(examples: Sequence[Any], lengths: Sequence[int], k: int) -> list[int]:
    """The indices of the ``k`` examples nearest the median length."""
    median = statistics.median(lengths)
    return sorted(sorted(range(len(examples)), key=lambda i: (abs(lengths[i] - median), i))[:k])


def _calibration_study(study: Study) -> Study:
    names = {*study.params, "shapley", "knockout", "integrated_gradients", "gradient_shap", "loo_random", "loo_lm"}
    params = {name: calibration_params(name, study.params.get(name)) for name in names}
    return study.model_copy(update={"params": {name: p for name, p in params.items() if p is not None}})


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class _Measured:
    """The calibration batch: per step its seconds, ``[forwards, backwards]`` rows, largest call's
    tokens and peak memory; the sample's examples."""
    seconds: dict[str, float]
    rows: dict[str, list[int]]
    call_tokens: dict[str, int]
    peak: dict[str, int]
    examples: list[PreparedExample]
    statistics: tuple[float, float] | None = None
    #: a path method's points in the sample (the largest where they vary) and its relative completeness
    #: delta per sampled example (None: f(x) = f(baseline))
    relative: dict[str, tuple[int, list[float | None]]] = dataclasses.field(default_factory=dict)


def _width(pm: ProbeModel) -> int:
    config = getattr(pm.model, "config", None)
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 768


def plan_study(study: Study, *, pm: ProbeModel | None = None, log: Callable[[str], None] | None = None) -> StudyPlan:
    """The study's predicted cost on its device (see the module): loads the model (unless ``pm``, the
    study's model loaded already, whose ``load_seconds`` count), prepares up to :data:`LENGTH_SAMPLE`
    examples for their lengths and runs one calibration batch of :data:`SAMPLE` (after one of a
    single example, unmeasured: the first call of each kind pays one-time costs the run pays once)."""
    from probe.rows.memory import available_memory
    from probe.study.examples import prepare_examples, select_examples
    from probe.study.runner import load_study_model

    say = log or (lambda text: None)
    started = time.perf_counter()
    granted = granted_memory()
    if pm is None:
        pm = load_study_model(study)
    load_seconds = float(getattr(pm, "load_seconds", 0.0) or 0.0)
    data, _ = select_examples(pm, study.dataset, study.target)
    if not data:
        raise InputError(f"the study {study.name!r} selects no example to plan for")
    stride = max(1, math.ceil(len(data) / LENGTH_SAMPLE))
    chosen = data[::stride]
    say(f"plan: {len(data)} examples; preparing {len(chosen)} for their lengths")
    prepared = prepare_examples(pm, study.target, [e.text for e in chosen], [e.label for e in chosen])
    if torch.device(pm.device).type != "cuda":
        trim_allocator()
    model_bytes = (int(torch.cuda.memory_allocated(pm.device)) if torch.device(pm.device).type == "cuda"
                   else resident_bytes())
    measured = _calibrate(pm, study, chosen, prepared, say)
    scale = len(data) / len(chosen)  # each prepared example stands for this many of the study's
    steps = _step_costs(pm, study, prepared, measured, scale)
    lengths = [len(e.input_ids) for e in prepared]
    available = _available(pm, available_memory, granted)
    return StudyPlan(study=study.name, model=study.model.id, device=str(pm.device), examples=len(data),
                     lengths={"mean": float(statistics.fmean(lengths)), "median": float(statistics.median(lengths)),
                              "max": float(max(lengths))},
                     load_seconds=load_seconds, steps=steps, phases=_phases(pm, study, steps, measured, len(data)),
                     model_bytes=model_bytes, available_bytes=available,
                     calibration_seconds=time.perf_counter() - started)


def granted_memory() -> int | None:
    """The bytes :envvar:`PROBE_PLAN_MEMORY` grants a study (an amount, ``40GiB``: a device shared with
    other work), None where it is unset; a malformed amount is refused in one line naming the variable.
    Read before the model loads, so a typo costs no load."""
    given = os.environ.get(PLAN_MEMORY_VARIABLE)
    return int(_amount(given, _BYTES, PLAN_MEMORY_VARIABLE, "40GiB, 16GB or 512MiB")) if given else None


def _available(pm: ProbeModel, system: Callable[[], int | None], granted: int | None) -> int | None:
    """The memory the study may use: ``granted`` (:func:`granted_memory`) where given, else the
    device's (CUDA: free plus what this process holds; CPU: the system's available memory)."""
    if granted is not None:
        return granted
    return system() if torch.device(pm.device).type == "cpu" else _cuda_free(pm)


def _cuda_free(pm: ProbeModel) -> int | None:
    try:
        free, _ = torch.cuda.mem_get_info(pm.device)
        return int(free + torch.cuda.memory_allocated(pm.device))
    except (RuntimeError, AssertionError):
        return None


def _calibrate(pm: ProbeModel, study: Study, chosen: list, prepared: list[PreparedExample],
               say: Callable[[str], None]) -> _Measured:
    """Every step of the study on :data:`SAMPLE` examples near the median length, measured."""
    from probe.study.batch import run_batch

    picked = _sample_examples(prepared, [len(e.input_ids) for e in prepared], SAMPLE)
    say(f"plan: calibrating every step on {len(picked)} examples of "
        f"{', '.join(str(len(prepared[i].input_ids)) for i in picked)} tokens")
    run_batch(pm, _calibration_study(study), [chosen[min(picked)]], 0)  # one-time costs, not measured
    meter = StepMeter(pm)
    with meter:
        tables, info = run_batch(pm, _calibration_study(study), [chosen[i] for i in picked], 0,
                                 on_step=meter.on_step)
    return _Measured(seconds=dict(info["timings"]), rows={k: list(v) for k, v in info["step_rows"].items()},
                     call_tokens=meter.call_tokens, peak=meter.peak, examples=[prepared[i] for i in picked],
                     statistics=_statistics_rate(pm, study, tables), relative=_relative_deltas(tables))


def _relative_deltas(tables: Mapping[str, Any]) -> dict[str, tuple[int, list[float | None]]]:
    """Per path method, the calibration batch's points and relative deltas per example (its
    ``convergence`` table: :func:`probe.study.completeness.table_relatives`)."""
    from probe.study.completeness import table_relatives

    frame = tables.get("convergence")
    return {} if frame is None or not len(frame) else table_relatives(frame)


def _statistics_rate(pm: ProbeModel, study: Study, tables: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(fixed, per example)`` seconds of the statistics and the verdict
    (:func:`~probe.study.summary.judge_tables`), timed on the calibration batch's tables and on them
    repeated :data:`STATISTICS_COPIES` times as further examples (the bootstraps and the permutation
    nulls grow with the examples); None where they cannot be judged on so few."""
    import pandas as pd

    from probe.study.summary import judge_tables, mixing_words

    def judged(copies: int) -> float:
        grown = {name: pd.concat([t.assign(example=t["example"] + k * COPY_STRIDE) if "example" in t.columns else t
                                  for k in range(copies)], ignore_index=True)
                 for name, t in tables.items() if isinstance(t, pd.DataFrame)}
        started = time.perf_counter()
        judge_tables(grown, study, dtype=pm.contract.dtype, mixing=mixing_words(pm.contract))
        return time.perf_counter() - started

    try:
        judged(1)  # first use: imports and caches, as the run pays them in its steps
        small, large = judged(1), judged(STATISTICS_COPIES)
    except Exception:  # noqa: BLE001 - a plan never fails on its estimate of the statistics
        return None
    n = len(tables["examples"])
    per_example = max(large - small, 0.0) / (n * (STATISTICS_COPIES - 1))
    return max(small - per_example * n, 0.0), per_example


def _step_costs(pm: ProbeModel, study: Study, prepared: list[PreparedExample], measured: _Measured,
                scale: float) -> list[StepCost]:
    """Each measured step scaled to the study (the module says how)."""
    width = _width(pm)

    def weight(example: PreparedExample) -> float:
        return row_weight(len(example.input_ids), width)

    calibration = _calibration_study(study)
    out = []
    for step, seconds in measured.seconds.items():
        methods = step.split("+")
        counted = [_counted(pm, methods[0], study.params.get(methods[0]), e) for e in prepared]
        sampled = [_counted(pm, methods[0], calibration.params.get(methods[0]), e) for e in measured.examples]
        fwd, bwd = measured.rows.get(step, [0, 0])
        exact = [c for c in counted if c is not None]
        exact_sample = [c for c in sampled if c is not None]
        if len(exact) == len(counted) and len(exact_sample) == len(sampled):
            units = sum(sum(c) * weight(e) for c, e in zip(exact, prepared)) * scale
            sample_units = sum(sum(c) * weight(e) for c, e in zip(exact_sample, measured.examples))
            forwards = round(sum(c[0] for c in exact) * scale)
            backwards = round(sum(c[1] for c in exact) * scale)
            approximate = methods[0] in ("shapley", "loo_delete", "loo_random", "loo_lm")  # equal rows merged
        else:  # rows per example as the sample ran them
            units = sum(weight(e) for e in prepared) * scale
            sample_units = sum(weight(e) for e in measured.examples)
            per = scale * len(prepared) / max(len(measured.examples), 1)
            forwards, backwards, approximate = round(fwd * per), round(bwd * per), True
        ratio = units / sample_units if sample_units else 0.0
        out.append(StepCost(step, forwards, backwards, seconds * ratio,
                            _run_peak(pm, study, step, measured, prepared), approximate))
    return out


def _counted(pm: ProbeModel, name: str, params: Mapping[str, Any] | None,
             example: PreparedExample) -> tuple[int, int] | None:
    from probe.registry import find

    if find(name) is None:
        return None
    return method_rows(pm, name, params, example)


def _run_peak(pm: ProbeModel, study: Study, step: str, measured: _Measured, prepared: list[PreparedExample]) -> int:
    """The step's activation peak in the run: the sample's per token of its largest call, times the
    run's largest call (the sample's scaled to a batch of examples at the longest length, up to what
    the engine or the gradient methods put in one call)."""
    from probe.explainers.gradient_forward import GRADIENT_TOKEN_BUDGET
    from probe.registry import find

    peak, tokens = measured.peak.get(step, 0), measured.call_tokens.get(step, 0)
    if peak <= 0 or tokens <= 0:
        return max(peak, 0)
    longest = max(len(e.input_ids) for e in prepared)
    sampled = max(len(e.input_ids) for e in measured.examples)
    per_batch = min(study.engine.batch_size, len(prepared)) / max(len(measured.examples), 1)
    entry = find(step.split("+")[0])
    grow = per_batch * longest / sampled  # linear in T: where maps of [T, T] dominate, an underestimate
    if measured.rows.get(step, [0, 0])[1]:
        cap = GRADIENT_TOKEN_BUDGET
    elif entry is None or entry.engine or entry.family == "intervention":
        cap = study.engine.token_budget
    else:
        cap = None
    run_tokens = tokens * grow if cap is None else min(tokens * grow, max(cap, tokens))
    return int(peak * run_tokens / tokens)


def _report_seconds(study: Study) -> float:
    """The report's seconds, not calibrated: :data:`AFTER_STEPS_SECONDS` plus
    :data:`REPORT_SECONDS_PER_HEAD_METHOD` per method drawn per layer x head (its heatmaps) and
    :data:`REPORT_SECONDS_PER_SECTION` per section beyond the agreement (erasure, counterfactual,
    heads, the per-head causal test), as the shipped studies' reports took on a 2-core CPU."""
    from probe.registry import find
    from probe.study.plan import methods_needed

    per_head = sum(1 for m in methods_needed(study) if (entry := find(m)) is not None and entry.per_head)
    metrics = study.metrics
    heads = metrics.heads is not None and (metrics.heads.ablation or metrics.heads.importance)
    sections = sum(1 for spec in (metrics.erasure, metrics.counterfactual, metrics.heads_causal) if spec is not None)
    sections += int(bool(heads))
    return AFTER_STEPS_SECONDS + REPORT_SECONDS_PER_HEAD_METHOD * per_head + REPORT_SECONDS_PER_SECTION * sections


def _phases(pm: ProbeModel, study: Study, steps: list[StepCost], measured: _Measured, n: int) -> dict[str, float]:
    """The checks after the steps: the randomisation check from the methods' seconds per example on
    the sanity examples (RANDOM_DRAWS draws per cascade stage; the reference also on the trained model,
    on fully random models where a bottom-up method runs, and on the cascade's replayed at half its
    cost where :func:`~probe.study.replay.replays_layers`, else in full), the completeness check's
    search (:func:`_completeness_seconds`), and the statistics and report at :data:`AFTER_STEPS_SECONDS`."""
    from probe.registry import find
    from probe.study.randomisation import RANDOM_DRAWS
    from probe.study.replay import replays_layers

    sanity = study.metrics.sanity
    per_example = {s.step: s.seconds / max(n, 1) for s in steps}
    fixed, rate = measured.statistics or (AFTER_STEPS_SECONDS, 0.0)
    phases = {"statistics": fixed + rate * n, "report": _report_seconds(study)}
    search = _completeness_seconds(study, measured, min(sanity.examples, n))
    if search is not None:
        phases["completeness check"] = search
    if not sanity.randomisation:
        return phases
    stages = len(sanity.fractions)
    ref = per_example.get(study.verdict_reference, 0.0)
    methods = [s for s in per_example if s != study.verdict_reference and find(s.split("+")[0]) is not None
               and find(s.split("+")[0]).family != "intervention"]  # type: ignore[union-attr]
    seconds, bottom_up = 0.0, False
    for step in methods:
        entry = find(step.split("+")[0])
        bottom_up = bottom_up or bool(entry and entry.bottom_up)
        rate = (measured.seconds[step] / max(len(measured.examples), 1) if step == "integrated_gradients"
                else per_example[step])  # integrated gradients on a random model: 16 points, the sample's
        seconds += RANDOM_DRAWS * (1 if entry and entry.bottom_up else stages) * rate
    replayed = 0.5 if replays_layers(pm) else 1.0  # the layers below the re-initialised half, where they replay
    seconds += ref * (1 + (RANDOM_DRAWS if bottom_up else 0) + RANDOM_DRAWS * stages * replayed)
    phases["randomisation check"] = seconds * min(sanity.examples, n)
    return phases


def _completeness_seconds(study: Study, measured: _Measured, examples: int) -> float | None:
    """The completeness check's seconds (None where no method has one): nothing where the calibration
    sample's median relative delta passes (at the study's points: where the sample ran fewer, its
    deltas shrunk as a quadrature's error at least does); else its search for the points that would do
    (:mod:`probe.study.completeness`), every try from twice the study's points up to
    :data:`~probe.study.sanity.MAX_STEPS` (the search where the method does not converge; an upper
    bound where it does on the way), each on the examples its rule runs given the sample's relative
    deltas (repeated to the check's ``examples``), at the sample's seconds per row."""
    from probe.registry import find
    from probe.study.completeness import search_rows
    from probe.study.sanity import COMPLETENESS_TOLERANCE, MAX_STEPS

    total = None
    for step, seconds in measured.seconds.items():
        entry = find(step.split("+")[0])
        if entry is None or not entry.completeness:
            continue
        total = total or 0.0
        params = {**dataclasses.asdict(entry.defaults()), **(study.params.get(entry.name) or {})}
        steps = params["steps"] if isinstance(params["steps"], int) and not isinstance(params["steps"], bool) \
            else entry.defaults().steps
        sampled, found = measured.relative.get(entry.name, (steps, []))
        # the sample ran at fewer points than the study where they are costly: its deltas shrunk as a
        # quadrature's error at least does (1/n for a left or right Riemann sum, 1/n^2 else)
        power = 1 if str(params.get("rule", "")).endswith(("_left", "_right")) else 2
        shrink = (sampled / steps) ** power if isinstance(params["steps"], int) and steps > sampled else 1.0
        relatives = [r * shrink for r in found if r is not None]
        forwards, backwards = measured.rows.get(step, [0, 0])
        per_row = seconds / max(forwards + backwards, 1)  # forwards and backwards alike, as a step's are scaled
        total += per_row * search_rows([relatives[i % len(relatives)] for i in range(examples)] if relatives else [],
                                       steps, tolerance=COMPLETENESS_TOLERANCE, max_steps=MAX_STEPS,
                                       forwards=round(forwards / max(len(measured.examples), 1)))
    return total


def duration_words(seconds: float) -> str:
    """``seconds`` as a person reads them (``45 s``, ``12 min``, ``3.5 h``)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def size_words(n: int) -> str:
    """``n`` bytes in binary units (``1.5 GiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def _amount(text: str, units: Mapping[str, int], what: str, example: str) -> float:
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in units) or float(match.group(1)) <= 0:
        raise InputError(f"{what} {text!r} is not an amount: write it as {example} (units: {', '.join(units)})")
    return float(match.group(1)) * units[unit or next(iter(units))]


def parse_budget(text: str) -> float:
    """Seconds from ``"2h"``, ``"90m"``, ``"45s"`` or a plain number of seconds."""
    return _amount(text, _UNITS, "--budget", "2h, 90m or 600s")


def parse_memory(text: str) -> int:
    """Bytes from ``"40GiB"``, ``"16GB"``, ``"512MiB"`` or a plain number of bytes."""
    return int(_amount(text, _BYTES, "--memory", "40GiB, 16GB or 512MiB"))
