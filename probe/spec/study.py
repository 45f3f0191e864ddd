"""A study file: which model, which data, which explainers against which references, which statistics.

A study is a YAML file validated into a frozen :class:`Study` (pydantic v2). Every problem is raised
as one :class:`~probe.errors.InputError` line that names the file, the line and the bad key or value,
and says what to do::

    studies/x.yaml line 3: model.dtype: 'fp64' is not one of fp32, bf16, fp16

Entry points: :func:`load_study` (a file, plus command-line overrides), :func:`study_from_dict`,
and :meth:`Study.from_record` (the study a result folder's study.json holds).

Size: every section a study file may hold, with the checks across sections and the fingerprint that
leaves out keys added later; the sections a claim file shares live in :mod:`probe.spec.parts`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from probe.data import BUILTIN_PREFIX
from probe.data.planted_texts import PREFIX as PLANTED_PREFIX
from probe.errors import InputError
from probe.names import ALL_METHODS, ATTENTION_METHODS
from probe.registry import method as method_entry
from probe.registry import params_problem
from probe.registry.params import AdversarialParams, PermutedParams, declared_limits
from probe.spec.parts import DatasetSpec, ModelSpec, SpansSpec, TargetConfig
from probe.spec.validation import (
    LAYER_WORDS,
    Bool,
    Float,
    Int,
    SpecFile,
    SpecModel,
    describe,
    error_context,
    fail,
    first_error,
    layer_value,
    located_error,
    method_list,
    read_yaml_mapping,
    show,
    unknown_method,
)

__all__ = [
    "CounterfactualSpec", "EngineSpec", "ErasureSpec", "HeadsCausalSpec", "HeadsScreenSpec", "HeadsSpec", "MetricsSpec",
    "PublishedNumber", "SanitySpec", "StatisticsSpec", "Study", "load_study", "parse_ranking", "study_from_dict",
]

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_RANKING = re.compile(r"([A-Za-z0-9_]+)(?:@(.*))?")


def parse_ranking(text: str) -> tuple[str, int | str | None]:
    """``"METHOD"`` or ``"METHOD@LAYER"`` (LAYER: an index >= 0, first or last) -> ``(method, layer)``.

    Raises ``ValueError`` with the reason if ``text`` is not of that form.
    """
    match = _RANKING.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{show(text)} is not METHOD or METHOD@LAYER (e.g. rollout, attention_mean@last)")
    method, layer_text = match.group(1), match.group(2)
    if method not in ALL_METHODS:
        raise ValueError(unknown_method(method))
    if layer_text is None:
        return method, None
    if method not in ATTENTION_METHODS:
        raise ValueError(f"{text!r}: only attention methods take @LAYER ({', '.join(ATTENTION_METHODS)}); "
                         f"write {method} alone")
    layer_text = layer_text.strip()
    if layer_text in LAYER_WORDS:
        return method, layer_text
    if re.fullmatch(r"\d+", layer_text):
        return method, int(layer_text)
    raise ValueError(f"{text!r}: layer {layer_text!r} is not a layer index (0, 1, ...), first or last")


# ------------------------------------------------------------------------------------------- the schema


def _head_indices(value: list, more: str) -> list:
    """A list of head indices (ints >= 0); ``more`` names the other forms the field takes."""
    for i, head in enumerate(value):
        if isinstance(head, bool) or not isinstance(head, int) or head < 0:
            fail(f"head {show(head)} is not a head index; give integers >= 0{more}", item=[i])
    return value


def _layer_list(value: Any) -> Any:
    """``layers`` of a study part: ``all``, or one layer or a list of them (ints, ``first``, ``last``)."""
    if value == "all":
        return value
    if not isinstance(value, list):
        value = [value]
    if not value:
        fail("is empty; give layers such as [last] or [0, last], or all")
    return [layer_value(v, i) for i, v in enumerate(value)]


class ErasureSpec(SpecModel):
    """Erasure curves (ERASER): how the target changes as each ranking's top tokens are removed,
    or all but them kept; and decision flips."""

    #: the rankings whose top tokens are removed: METHOD, or METHOD@LAYER for an attention method
    #: read at one layer (first, last or an index); each among the explainers and references
    rankings: list[str] = Field(default_factory=list)
    #: percentages of the scorable tokens (the Python API's probe.erasure takes fractions)
    bins: list[Float] = Field(default_factory=lambda: [1.0, 5.0, 10.0, 20.0, 50.0])
    #: tokens are removed (ids deleted), as ERASER does; no other mode is offered
    mode: Literal["delete"] = "delete"
    #: decision flips (Serrano & Smith 2019): the fraction removed at the first change of the
    #: predicted class, one extra row per token depth per ranking; false leaves the column empty
    flips: Bool = True

    @field_validator("rankings", mode="before")
    @classmethod
    def _rankings(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, entry in enumerate(value):
            try:
                parse_ranking(entry)
            except ValueError as exc:
                fail(str(exc), item=[i])
        return [entry.strip() for entry in value]

    @field_validator("bins")
    @classmethod
    def _some_bins(cls, value: list[float]) -> list[float]:
        if not value:
            fail("is empty; give erasure percentages such as [1, 5, 10, 20, 50]")
        for i, percent in enumerate(value):
            if not 0 < percent <= 100:
                fail(f"{percent:g} is out of range; erasure bins are percentages in (0, 100] of the scorable "
                     "tokens, e.g. 10 for 10%", at=[i])
        return value


class CounterfactualSpec(SpecModel):
    """Counterfactual attention: the target row's attention replaced by permutations of itself (and,
    when asked, by Jain & Wallace's adversarial search), and how far the output moves."""

    #: the layers whose attention is replaced: indices, first and last, or all
    layers: list[int | Literal["first", "last"]] | Literal["all"] = Field(default_factory=lambda: ["last"])
    #: layer (the whole layer's attention at once), all (each head on its own) or a list of head indices
    heads: list[int] | Literal["all", "layer"] = "layer"
    #: seeded permutations of the attention row per example
    permutations: Annotated[Int, Field(ge=declared_limits(PermutedParams, "n")[0],
                                       le=declared_limits(PermutedParams, "n")[1])] = 10
    #: Jain & Wallace's adversarial search is the slowest part of a study (129 of 185 s for 8
    #: sentences on MiniLM): asked for by name, as the shipped studies that run it do
    adversarial: Bool = False
    #: the adversarial search's bound on the output's change (total variation distance)
    max_output_tvd: Annotated[Float, Field(gt=0, le=1)] = 0.01
    #: adversarial search: attention candidates per example (Jain & Wallace)
    adversarial_candidates: Annotated[Int, Field(ge=declared_limits(AdversarialParams, "candidates")[0],
                                                 le=declared_limits(AdversarialParams, "candidates")[1])] \
        = AdversarialParams.candidates
    #: adversarial search: Adam steps (Jain & Wallace)
    adversarial_steps: Annotated[Int, Field(ge=1, le=declared_limits(AdversarialParams, "steps")[1])] \
        = AdversarialParams.steps

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        return _layer_list(value)

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, value: Any) -> Any:
        if value in ("all", "layer"):
            return value
        if not isinstance(value, list):
            fail(f"{show(value)} is not layer, all or a list of head indices; "
                  "layer replaces the whole layer's attention, all does each head separately")
        if not value:
            fail("is empty; give head indices such as [0, 3], or layer, or all")
        return _head_indices(value, "")


class HeadsSpec(SpecModel):
    """What each attention head does for the target: ablated alone, and its importance."""

    #: each head's attention weights zeroed on their own, and the target's change
    ablation: Bool = True
    #: Michel et al.'s head importance: the mean absolute gradient of the loss by a gate on each head
    importance: Bool = True


class HeadsScreenSpec(SpecModel):
    """The per-head causal test's screen (probe.study.head_screen): per example, only the heads whose
    AtP estimates could show the largest effects, and a few drawn at random, run the exact knockout."""

    #: the first-order estimate that ranks the heads: attribution patching (probe.intervene.atp)
    by: Literal["atp"] = "atp"
    #: heads run exactly per example: the tested heads with the largest AtP estimate of an edge effect
    heads: Annotated[Int, Field(ge=1, le=65_536)] = 16
    #: further heads per example drawn at random from the rest and run exactly: they measure what the
    #: screen misses (the bound in verdict.json) and enter the test like the kept ones
    audit: Annotated[Int, Field(ge=0, le=65_536)] = 4


class HeadsCausalSpec(SpecModel):
    """The per-head causal test (probe.study.heads_causal): each head's attention row (the target
    query's, as the ``attention`` explainer reads it) against the knockout effect of that head's own
    edges (the edge from the target row to each token blocked in that head of that layer alone,
    probe.intervene.knockout), one unit per head: does where the head looks match what matters
    through it? Off unless asked for: it costs one forward row per layer x head x token."""

    #: the layers whose heads are tested: indices, first and last, or all
    layers: list[int | Literal["first", "last"]] | Literal["all"] = "all"
    #: the heads tested in each of those layers: all or a list of query head indices
    heads: list[int] | Literal["all"] = "all"
    #: true: the blocked weight removed and the row renormalised over its other keys (-inf before the
    #: softmax); false: the blocked weight set to 0, the row left as it is
    renormalise: Bool = True
    #: compare |knockout effect| (a token the head reads against the target matters too); false: signed
    absolute: Bool = False
    #: model rows per knockout pass
    batch_size: Annotated[Int, Field(ge=1, le=65_536)] = 32
    #: run the exact knockout only for the heads an AtP screen picks per example (null: every tested head)
    screen: HeadsScreenSpec | None = None

    @field_validator("screen", mode="before")
    @classmethod
    def _screen_on(cls, value: Any) -> Any:
        """``true`` or ``atp`` asks for the screen with its defaults; ``false`` is none."""
        if value is True or value == "atp":
            return {}
        return None if value is False else value

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        return _layer_list(value)

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, value: Any) -> Any:
        if value == "all":
            return value
        if not isinstance(value, list):
            value = [value]
        if not value:
            fail("is empty; give head indices such as [0, 3], or all")
        return _head_indices(value, ", or all")


class SanitySpec(SpecModel):
    """Sanity checks (probe.study.sanity), always run: their examples, and the cascading randomisation."""

    #: the examples the sanity checks run on
    examples: Annotated[Int, Field(ge=1, le=64)] = 4
    #: run the model-parameter randomisation check (Adebayo et al. 2018)
    randomisation: Bool = True
    #: the fractions of the layers re-initialised from the top (and the head), one cascade stage each,
    #: judged at the first >= 0.5; more (e.g. [0.25, 0.5, 1.0]) draw the curve, from the head alone
    fractions: list[Annotated[Float, Field(gt=0, le=1)]] = Field(default_factory=lambda: [0.5])


class PublishedNumber(SpecModel):
    """A number from the paper a study follows, set beside ours in the report (context, not a target)."""

    #: the explainer the paper measured (a method of the study)
    explainer: str
    #: the reference it was measured against (a method of the study)
    reference: str
    #: the layer, 0-based as probe counts them; null for a token-level method
    layer: Int | None = None
    #: the measure of the paper's number
    measure: Literal["kendall_tau", "spearman"] = "spearman"
    #: the paper's number
    value: Float
    #: where the paper reports it (e.g. its table)
    source: str = ""


class MetricsSpec(SpecModel):
    """What is measured: agreement with the references, its baselines and ceilings, erasure,
    counterfactual attention and the heads; a section set to null or false is switched off."""

    #: the agreement measures computed per example: Kendall tau-b, Spearman, top-k overlap
    agreement: list[Literal["kendall", "spearman", "top_k"]] = Field(
        default_factory=lambda: ["kendall", "spearman", "top_k"])
    #: the k of the top-k overlap
    top_k: list[Annotated[Int, Field(ge=1, le=100_000)]] = Field(default_factory=lambda: [1, 3, 5])
    #: the rankings every agreement is set beside: seeded random, uniform attention, position (later
    #: tokens first)
    baselines: list[Literal["random", "uniform", "position"]] = Field(
        default_factory=lambda: ["random", "uniform", "position"])
    #: pairs of references whose agreement is the most an explainer can be expected to reach; null:
    #: every pair of references, false or []: none
    ceilings: list[tuple[str, str]] | None = None
    erasure: ErasureSpec | None = Field(default_factory=ErasureSpec)
    counterfactual: CounterfactualSpec | None = Field(default_factory=CounterfactualSpec)
    heads: HeadsSpec | None = Field(default_factory=HeadsSpec)
    #: the per-head causal test (off by default: one forward row per layer x head x token); true: every
    #: head of every layer
    heads_causal: HeadsCausalSpec | None = None
    #: the pair check (top tokens deleted in pairs: tokens single deletion misjudges); false or null: off
    interactions: bool = True
    #: the attention sinks per layer and head, on the study's first examples; false or null: off
    sinks: bool = True
    #: methods compared by magnitude (|score|), as Jain & Wallace compare |delta y| and |grad x input|
    absolute: list[str] = Field(default_factory=list)
    sanity: SanitySpec = Field(default_factory=SanitySpec)
    published: list[PublishedNumber] = Field(default_factory=list)

    @field_validator("erasure", "counterfactual", "heads", "heads_causal", mode="before")
    @classmethod
    def _false_is_off(cls, value: Any) -> Any:
        """``false`` switches the metric off, as ``null`` does."""
        return None if value is False else value

    @field_validator("interactions", "sinks", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any) -> Any:
        """``null`` switches the pass off, as ``false`` does."""
        return False if value is None else value

    @field_validator("heads_causal", mode="before")
    @classmethod
    def _true_is_on(cls, value: Any) -> Any:
        """``true`` asks for the per-head causal test with its defaults."""
        return {} if value is True else value

    @field_validator("ceilings", mode="before")
    @classmethod
    def _no_ceilings(cls, value: Any) -> Any:
        """``false`` (or ``[]``) computes no ceiling; ``null`` (the default) every pair of references."""
        return [] if value is False else value

    @field_validator("absolute", mode="before")
    @classmethod
    def _absolute(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, name in enumerate(value):
            if name not in ALL_METHODS:
                fail(unknown_method(name), item=[i])
        return value

    @field_validator("ceilings", mode="before")
    @classmethod
    def _ceilings(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, pair in enumerate(value):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                fail(f"{show(pair)} is not a pair of methods; write e.g. [loo_delete, loo_mask]", item=[i])
            for j, name in enumerate(pair):
                if name not in ALL_METHODS:
                    fail(unknown_method(name), item=[i, j])
            if pair[0] == pair[1]:
                fail(f"{show(pair)} pairs a method with itself; give two different methods", item=[i])
        return [tuple(pair) for pair in value]


class StatisticsSpec(SpecModel):
    """The statistics: bootstrap intervals, the tests' level, the verdict's reference and measure."""

    #: bootstrap resamples per confidence interval; bounded here and, against the free memory, when
    #: the examples are known (probe.rows.memory)
    bootstrap: Annotated[Int, Field(ge=100, le=1_000_000)] = 2000
    #: the confidence level of the intervals
    level: Annotated[Float, Field(gt=0.5, lt=1)] = 0.95
    #: the significance level of the verdict's tests
    alpha: Annotated[Float, Field(gt=0, lt=0.5)] = 0.05
    #: rule 2's non-inferiority margin, as a share of the gradient bar's lead over the random ranking: a unit
    #: tracks only when shown to keep at least 1 - margin of that lead (the lower bound of its paired interval
    #: of unit - bar above -margin x lead); shown below that it is worse; between, undecided (probe.study.power)
    margin: Annotated[Float, Field(gt=0, lt=1)] = 0.2
    #: the seed of the bootstrap and the permutations
    seed: Int = 0
    #: count special tokens ([CLS], [SEP], ...) and a prompt template's tokens in agreement
    include_special: Bool = False
    #: the reference the verdict is judged against (default: the first of references)
    reference: str | None = None
    #: random rankings per example in the verdict's chance test (probe.metrics.nulls): rule 1's p-values
    #: are resolved to 1 / (permutations + 1)
    permutations: Annotated[Int, Field(ge=1000, le=100_000)] = 1000
    #: the verdict's measure: kendall_tau, spearman, topK (top-k agreement, K one of metrics.top_k),
    #: or auto (top-1 or top-k when the reference's effect sits on one or two tokens, else kendall_tau:
    #: probe.study.decide)
    measure: str = "auto"

    @field_validator("measure")
    @classmethod
    def _measure(cls, value: str) -> str:
        if value in ("auto", "kendall_tau", "spearman") or re.fullmatch(r"top[1-9]\d*", value):
            return value
        fail(f"{show(value)} is not a measure: use auto, kendall_tau, spearman or topK (e.g. top1, one of "
             "metrics.top_k)")


class EngineSpec(SpecModel):
    """How the work is cut: batches of examples, and the size of one forward pass."""

    #: examples per batch: the unit a run is stored, resumed and sharded in
    batch_size: Annotated[Int, Field(ge=1, le=65_536)] = 16
    #: the most rows x padded tokens of one forward pass of the interventions
    token_budget: Annotated[Int, Field(ge=64, le=2**28)] = 8192


class Study(SpecModel):
    """A study file: the model, the examples, the target, the methods compared and how."""

    #: the study's name (letters, digits, '-', '_', '.'): its results go to results/NAME unless
    #: output says otherwise
    name: str
    #: a few sentences shown in the report
    description: str = ""
    model: ModelSpec
    dataset: DatasetSpec
    target: TargetConfig = Field(default_factory=TargetConfig)
    #: the methods whose rankings are checked: a list of names, a comma-separated string, or all
    explainers: list[str]
    #: what the explainers are checked against, usually interventions (loo_delete, ...)
    references: list[str]
    #: each method's parameters: {METHOD: {KEY: VALUE}}
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    statistics: StatisticsSpec = Field(default_factory=StatisticsSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    #: spans instead of tokens as the units compared (default: tokens)
    spans: SpansSpec | None = None
    #: the result folder (default: results/NAME); probe run --out wins
    output: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value) or set(value) == {"."}:
            fail(f"{value!r} may use only letters, digits, '-', '_' and '.'; "
                  f"e.g. {re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('-.') or 'my-study'!r}")
        return value

    @field_validator("explainers", "references", mode="before")
    @classmethod
    def _methods(cls, value: Any) -> Any:
        return method_list(value)

    @field_validator("output")
    @classmethod
    def _output(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            fail("is empty; give a folder for the results or leave output out")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Study:
        used = self.methods
        listed = f"explainers and references: {', '.join(used)}"
        for key in self.params:
            if key not in ALL_METHODS:
                fail(unknown_method(key), at=["params", key])
            if key not in used:
                fail(f"parameters for {key!r}, which is not among the study's {listed}; "
                      f"add {key} to explainers or references, or remove its parameters", at=["params", key])
            problem = params_problem(key, self.params[key])
            if problem is not None:
                bad, sentence = problem
                fail(sentence, at=["params", key] + ([bad] if bad is not None else []))
        measure = self.statistics.measure
        if measure.startswith("top") and (int(measure[3:]) not in self.metrics.top_k
                                          or "top_k" not in self.metrics.agreement):
            fail(f"{measure} is not computed: add {measure[3:]} to metrics.top_k (now {list(self.metrics.top_k)}) "
                 "and keep top_k in metrics.agreement", at=["statistics", "measure"])
        if self.statistics.reference is not None and self.statistics.reference not in self.references:
            fail(f"{self.statistics.reference!r} is not one of the references ({', '.join(self.references)}); "
                  "give one of them, or leave it out for the first", at=["statistics", "reference"])
        erasure = self.metrics.erasure
        for i, entry in enumerate(erasure.rankings if erasure is not None else []):
            method, _ = parse_ranking(entry)
            if method not in used:
                fail(f"{entry!r}: {method} is not among the study's {listed}; add it there or drop this ranking",
                      at=["metrics", "erasure", "rankings"], item=[i])
        if self.spans is not None and self.metrics.heads_causal is not None:
            fail("the per-head causal test ranks tokens (a head's attention row against the knockout of its own "
                 "edges), not spans; remove spans or metrics.heads_causal", at=["metrics", "heads_causal"])
        if self.spans is not None:
            for name in self.references:
                registered = method_entry(name)
                if registered.family == "intervention" and not registered.has_span_form:
                    fail(f"{name} has no span form (a span is deleted or replaced by the mask, unk or pad token, "
                          "is a Shapley player, or has its edges knocked out); use loo_delete, loo_mask, loo_unk, "
                          "loo_pad, shapley or knockout as the reference, or remove spans", at=["references"])
        for i, pair in enumerate(self.metrics.ceilings or []):
            for j, method in enumerate(pair):
                if method not in used:
                    fail(f"{method} is not among the study's {listed}; add it there or drop this pair",
                          at=["metrics", "ceilings"], item=[i, j])
        return self

    # ------------------------------------------------------------------------------------- derived

    @property
    def methods(self) -> list[str]:
        """Explainers then references, without duplicates: every method the study runs."""
        return list(dict.fromkeys(self.explainers + self.references))

    @property
    def verdict_reference(self) -> str:
        """The reference the verdict is judged against: ``statistics.reference`` or the first reference."""
        return self.statistics.reference or self.references[0]

    @classmethod
    def from_record(cls, data: dict, *, source: str = "study.json") -> Study:
        """The study a result folder's study.json holds (its ``study`` mapping, as :meth:`to_dict`
        wrote it). Keys added to the schema since then take their defaults; ``source`` names the
        file in an error."""
        return study_from_dict(data, source=source)

    def to_dict(self) -> dict:
        """Plain JSON-able dict; ``study_from_dict(study.to_dict()) == study``."""
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of everything except ``output`` and ``description``."""
        payload = self.model_dump(mode="json", exclude={"output", "description"})
        # keys added later count only when set, so studies written before them keep their fingerprint
        if not payload["model"].get("allow_random_weights"):
            payload["model"].pop("allow_random_weights", None)
        if payload["model"].get("device_map") is None:
            payload["model"].pop("device_map", None)
        for key in ("reference", "dimension", "contrast", "contrast_label", "generate"):
            if payload["target"].get(key) is None:
                payload["target"].pop(key, None)
        if payload.get("spans") is None:
            payload.pop("spans", None)
        if payload["metrics"].get("heads_causal") is None:
            payload["metrics"].pop("heads_causal", None)
        elif payload["metrics"]["heads_causal"].get("screen") is None:
            payload["metrics"]["heads_causal"].pop("screen", None)
        for key in ("interactions", "sinks"):
            if payload["metrics"].get(key) is True:
                payload["metrics"].pop(key)
        for key in ("steps", "target_side"):
            if payload["target"].get(key) is False:
                payload["target"].pop(key)
        if (payload["metrics"].get("erasure") or {}).get("flips") is True:
            payload["metrics"]["erasure"].pop("flips")
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------- loading

STUDY = SpecFile(schema=Study, top="study", the_top="the study")


def study_from_dict(data: dict, *, source: str = "<dict>") -> Study:
    """Validate ``data`` (e.g. parsed YAML, or ``Study.to_dict()``) into a :class:`Study`."""
    return _validate(data, source=source, root=None, base_dir=None)


def load_study(path: str | Path, *, n: int | None = None, dataset: str | None = None, device: str | None = None,
               dtype: str | None = None, out: str | None = None) -> Study:
    """Read and validate a study file, then apply command-line overrides (validated too).

    ``n`` replaces ``dataset.n``; ``dataset`` (a .csv/.jsonl path relative to the current directory,
    which must exist, or builtin:NAME) replaces ``dataset.name`` and resets the split to ``test``;
    ``device``, ``dtype`` and ``out`` replace ``model.device``, ``model.dtype`` and ``output``.
    """
    path = Path(path)
    data, root = read_yaml_mapping(path, "study file", "study",
                                   "write a study with at least name, model, dataset, explainers and references",
                                   "name:, model:, dataset:, explainers:, references:, ...")
    study = _validate(data, source=str(path), root=root, base_dir=path.parent)
    overrides: list[tuple[str, Any, tuple[str, ...]]] = []  # (option, value given, key path it replaces)
    for option, value, keys in (("n", n, ("dataset", "n")), ("dataset", dataset, ("dataset", "name")),
                                ("device", device, ("model", "device")), ("dtype", dtype, ("model", "dtype")),
                                ("out", out, ("output",))):
        if value is not None:
            overrides.append((option, value, keys))
    return _overridden(study, overrides, path) if overrides else study


def _overridden(study: Study, overrides: list[tuple[str, Any, tuple[str, ...]]], path: Path) -> Study:
    """``study`` with each ``(option, value, key path)`` replaced, validated; an error blames the option."""
    merged = study.to_dict()
    for option, value, keys in overrides:
        if option == "dataset":
            value = _dataset_override(value)
            merged["dataset"]["split"] = "test"
        section = merged
        for key in keys[:-1]:
            section = section[key]
        section[keys[-1]] = value
    try:
        return Study.model_validate(merged)
    except ValidationError as exc:
        error, _ = first_error(exc.errors(), None)
        loc = tuple(error["loc"]) + tuple(error_context(error, "at"))
        blamed = [f"{option}={show(value)}" for option, value, keys in overrides if loc[:len(keys)] == keys]
        given = f"the override {blamed[0]}" if blamed else "the overrides"
        raise InputError(f"{path} with {given}: {describe(error, STUDY)}") from None


def _dataset_override(dataset: str) -> str:
    if not isinstance(dataset, str) or not dataset.strip():
        raise InputError(f"dataset override {dataset!r} is empty; give a .csv/.jsonl file or builtin:NAME")
    if dataset.startswith((BUILTIN_PREFIX, PLANTED_PREFIX)):
        return dataset
    file = Path(dataset).expanduser()
    if not file.exists():
        raise InputError(f"dataset file {dataset} not found (from the current directory {Path.cwd()}); "
                         "give an existing .csv or .jsonl file")
    if not file.is_file():
        raise InputError(f"dataset path {dataset} is not a file; give a .csv or .jsonl file")
    return str(file)


def _validate(data: Any, *, source: str, root: yaml.Node | None, base_dir: Path | None) -> Study:
    if not isinstance(data, dict):
        raise InputError(f"{source}: the study is {show(data)}, not a mapping of keys "
                         "(name, model, dataset, explainers, references, ...)")
    try:
        return Study.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise located_error(exc, STUDY, source, root) from None
