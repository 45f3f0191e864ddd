"""A study file: which model, which data, which explainers against which references, which statistics.

A study is a YAML file validated into a frozen :class:`Study` (pydantic v2). Every problem is raised
as one :class:`~probe.errors.InputError` line that names the file, the line and the bad key or value,
and says what to do::

    studies/x.yaml line 3: model.dtype: 'fp64' is not one of fp32, bf16, fp16

Entry points: :func:`load_study` (a file, plus command-line overrides) and :func:`study_from_dict`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import yaml
from pydantic import (
    BaseModel, ConfigDict, Field, Strict, ValidationError, ValidationInfo, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from probe.data import BUILTIN_PREFIX, SPLITS, USER_FILE_SUFFIXES, builtin_dataset_names
from probe.errors import InputError
from probe.explain.methods import ALL_METHODS, ATTENTION_METHODS

__all__ = [
    "CounterfactualSpec", "DatasetSpec", "EngineSpec", "ErasureSpec", "Filters", "HeadsSpec", "MetricsSpec",
    "ModelSpec", "StatisticsSpec", "Study", "TargetConfig", "load_study", "parse_ranking", "study_from_dict",
]

Int = Annotated[int, Strict()]          # no bools, no floats, no numeric strings
Float = Annotated[float, Strict()]      # ints are accepted (1 -> 1.0), strings are not
Bool = Annotated[bool, Strict()]

LAYER_WORDS = ("first", "last")
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_RANKING = re.compile(r"([A-Za-z0-9_]+)(?:@(.*))?")


# ------------------------------------------------------------------------------------ validation helpers


def _fail(message: str, at: Sequence[str | int] = (), item: Sequence[str | int] = ()):
    """Raise a validation error with a finished ``message``.

    ``at`` extends the error's location (shown in the message and used for the line number);
    ``item`` extends it for the line number only (e.g. the index of a bad list entry).
    """
    raise PydanticCustomError("study", "{message}", {"message": message, "at": list(at), "item": list(item)})


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _suggest(word: Any, options: Sequence[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown_method(name: Any) -> str:
    if not isinstance(name, str):
        return f"{_show(name)} is not a method name (valid: {', '.join(ALL_METHODS)})"
    return f"unknown method {name!r} (valid: {', '.join(ALL_METHODS)}, or all){_suggest(name, ALL_METHODS)}"


def _method_list(value: Any) -> list[str]:
    """A list (or comma-separated string) of method names -> validated names, ``all`` expanded, no duplicates."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        _fail(f"{_show(value)} is not a list of methods; write e.g. [attention, rollout] "
              f"(valid: {', '.join(ALL_METHODS)}, or all)")
    names: list[str] = []
    for i, name in enumerate(value):
        if name == "all":
            names.extend(ALL_METHODS)
        elif isinstance(name, str) and name in ALL_METHODS:
            names.append(name)
        else:
            _fail(_unknown_method(name), item=[i])
    if not names:
        _fail(f"no method given; list at least one (valid: {', '.join(ALL_METHODS)}, or all)")
    return list(dict.fromkeys(names))


def _layer(value: Any, i: int | None = None) -> int | str:
    item = [] if i is None else [i]
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not (isinstance(value, int) or value in LAYER_WORDS):
        _fail(f"layer {_show(value)} is not a layer; give a layer index (0, 1, ...), first or last", item=item)
    if isinstance(value, int) and value < 0:
        _fail(f"layer {value} is negative; give a layer index >= 0, or last for the last layer", item=item)
    return value


def parse_ranking(text: str) -> tuple[str, int | str | None]:
    """``"METHOD"`` or ``"METHOD@LAYER"`` (LAYER: an index >= 0, first or last) -> ``(method, layer)``.

    Raises ``ValueError`` with the reason if ``text`` is not of that form.
    """
    match = _RANKING.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{_show(text)} is not METHOD or METHOD@LAYER (e.g. rollout, attention_mean@last)")
    method, layer_text = match.group(1), match.group(2)
    if method not in ALL_METHODS:
        raise ValueError(_unknown_method(method))
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


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------------- the schema


def check_dataset_name(value: str, info: ValidationInfo) -> str:
    """A validator body: ``builtin:NAME`` or a CSV/JSONL path (relative paths resolved against the
    file's folder, ``info.context["base_dir"]``, when they exist there)."""
    value = value.strip()
    valid_builtins = ", ".join(BUILTIN_PREFIX + n for n in builtin_dataset_names())
    if not value:
        _fail(f"is empty; give builtin:NAME ({valid_builtins}) or a .csv/.jsonl file")
    if value.startswith(BUILTIN_PREFIX):
        if value[len(BUILTIN_PREFIX):] not in builtin_dataset_names():
            _fail(f"unknown built-in dataset {value!r} (valid: {valid_builtins})"
                  f"{_suggest(value, [BUILTIN_PREFIX + n for n in builtin_dataset_names()])}")
        return value
    if Path(value).suffix.lower() not in USER_FILE_SUFFIXES:
        _fail(f"{value!r} is neither builtin:NAME ({valid_builtins}) nor a file ending in "
              f"{', '.join(USER_FILE_SUFFIXES)}")
    base = (info.context or {}).get("base_dir")
    if base is not None and not Path(value).is_absolute() and not value.startswith("~"):
        candidate = Path(base) / value
        if candidate.exists():
            return str(candidate)
    return value


class ModelSpec(_Spec):
    id: str
    device: str = "cpu"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    attn_implementation: str | None = None
    task: str | None = None
    #: explain a model whose checkpoint leaves weights random (e.g. a missing head); shown in every report
    allow_random_weights: bool = False

    @field_validator("id", "device")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            _fail("is empty; give a value (e.g. id: builtin:minilm-rt, device: cpu)")
        return value.strip()


class Filters(_Spec):
    min_words: Annotated[Int, Field(ge=1)] | None = None
    max_words: Annotated[Int, Field(ge=1)] | None = None
    labels: list[Int] | None = None
    contains: str | None = None

    @field_validator("labels")
    @classmethod
    def _some_labels(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            _fail("is empty; list the labels to keep (e.g. [0, 1]) or leave labels out")
        return value

    @field_validator("contains")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                _fail(f"{value!r} is not a valid regular expression ({exc}); "
                      "fix it (escape special characters with \\)")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> Filters:
        if self.min_words is not None and self.max_words is not None and self.min_words > self.max_words:
            _fail(f"min_words {self.min_words} is above max_words {self.max_words}; no example could pass",
                  at=["min_words"])
        return self


class DatasetSpec(_Spec):
    name: str
    split: str = "test"
    n: Annotated[Int, Field(ge=1)] | None = None
    seed: Int = 0
    text_column: str = "text"
    label_column: str = "label"
    max_length: Annotated[Int, Field(ge=2)] | None = None
    filters: Filters = Field(default_factory=Filters)

    @field_validator("name")
    @classmethod
    def _dataset_name(cls, value: str, info: ValidationInfo) -> str:
        return check_dataset_name(value, info)

    @field_validator("text_column", "label_column", "split")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            _fail("is empty; give a name or leave the key out for the default")
        return value

    @model_validator(mode="after")
    def _builtin_split(self) -> DatasetSpec:
        if self.name.startswith(BUILTIN_PREFIX) and self.split not in SPLITS:
            _fail(f"{self.split!r} is not a split of {self.name} (valid: {', '.join(SPLITS)})", at=["split"])
        return self


class TargetConfig(_Spec):
    kind: Literal["prob", "logit", "logprob", "similarity", "dimension"] | None = None
    label: int | str | None = None
    continuation: str | None = None
    prompt: str | None = None
    choices: list[str] | None = None
    #: a headless encoder's targets: the text a similarity is taken to, the embedding dimension explained
    reference: str | None = None
    dimension: Annotated[Int, Field(ge=0)] | None = None

    @field_validator("label", mode="before")
    @classmethod
    def _label(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            _fail(f"{_show(value)} is not a label; give a class index (e.g. 1) or a label name (e.g. positive)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | None) -> str | None:
        if value is not None and value.count("{text}") != 1:
            _fail(f"{_show(value)} must contain {{text}} exactly once (it has {value.count('{text}')}); "
                  "e.g. 'Review: {text}\\nSentiment:'")
        return value

    @field_validator("choices")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        for i, choice in enumerate(value):
            if not choice:
                _fail("an empty choice; every choice needs some text (e.g. ' positive')", item=[i])
            if choice in value[:i]:
                _fail(f"{choice!r} is listed twice; the choices must be distinct", item=[i])
        if len(value) < 2:
            _fail(f"{_show(value)} has fewer than 2 choices; give at least two, e.g. [' positive', ' negative']")
        return value

    @model_validator(mode="after")
    def _encoder_target(self) -> TargetConfig:
        if self.kind == "similarity" and not (self.reference or "").strip():
            _fail("similarity needs a reference text; add reference: 'some text' (its pooled embedding is "
                  "compared with each example's)", at=["reference"])
        if self.kind == "dimension" and self.dimension is None:
            _fail("dimension needs the embedding component to explain; add dimension: N", at=["dimension"])
        if self.reference is not None and self.kind != "similarity":
            _fail(f"reference applies to kind: similarity (kind is {self.kind or 'the default'}); set kind: similarity "
                  "or remove reference", at=["reference"])
        if self.dimension is not None and self.kind != "dimension":
            _fail(f"dimension applies to kind: dimension (kind is {self.kind or 'the default'}); set kind: dimension "
                  "or remove dimension", at=["dimension"])
        return self

    @model_validator(mode="after")
    def _exclusive(self) -> TargetConfig:
        if self.choices is not None and self.continuation is not None:
            _fail("choices and continuation exclude each other; give the answer options (choices) "
                  "or one fixed continuation, not both", at=["choices"])
        if self.label is not None and (self.choices is not None or self.continuation is not None):
            other = "choices" if self.choices is not None else "continuation"
            _fail(f"label cannot be combined with {other} (the explained output is then the "
                  f"{'chosen answer' if other == 'choices' else 'continuation'}); remove one of them", at=["label"])
        return self


class ErasureSpec(_Spec):
    rankings: list[str] = Field(default_factory=list)
    bins: list[Annotated[Float, Field(gt=0, le=100)]] = Field(default_factory=lambda: [1.0, 5.0, 10.0, 20.0, 50.0])
    #: tokens are removed (ids deleted), as ERASER does; no other mode is offered
    mode: Literal["delete"] = "delete"

    @field_validator("rankings", mode="before")
    @classmethod
    def _rankings(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, entry in enumerate(value):
            try:
                parse_ranking(entry)
            except ValueError as exc:
                _fail(str(exc), item=[i])
        return [entry.strip() for entry in value]

    @field_validator("bins")
    @classmethod
    def _some_bins(cls, value: list[float]) -> list[float]:
        if not value:
            _fail("is empty; give erasure percentages such as [1, 5, 10, 20, 50]")
        return value


class CounterfactualSpec(_Spec):
    layers: list[int | Literal["first", "last"]] | Literal["all"] = Field(default_factory=lambda: ["last"])
    heads: list[int] | Literal["all", "layer"] = "layer"
    permutations: Annotated[Int, Field(ge=1)] = 10
    adversarial: Bool = True
    max_output_tvd: Annotated[Float, Field(gt=0, le=1)] = 0.01
    #: adversarial search: attention candidates per example and Adam steps (Jain & Wallace)
    adversarial_candidates: Annotated[Int, Field(ge=1)] = 5
    adversarial_steps: Annotated[Int, Field(ge=1)] = 200

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        if value == "all":
            return value
        if not isinstance(value, list):
            value = [value]
        if not value:
            _fail("is empty; give layers such as [last] or [0, last], or all")
        return [_layer(v, i) for i, v in enumerate(value)]

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, value: Any) -> Any:
        if value in ("all", "layer"):
            return value
        if not isinstance(value, list):
            _fail(f"{_show(value)} is not layer, all or a list of head indices; "
                  "layer replaces the whole layer's attention, all does each head separately")
        if not value:
            _fail("is empty; give head indices such as [0, 3], or layer, or all")
        for i, head in enumerate(value):
            if isinstance(head, bool) or not isinstance(head, int) or head < 0:
                _fail(f"head {_show(head)} is not a head index; give integers >= 0", item=[i])
        return value


class HeadsSpec(_Spec):
    ablation: Bool = True
    importance: Bool = True


class SanitySpec(_Spec):
    """Sanity checks (probe.metrics.sanity), always run: how many examples they use, and the
    cascading randomisation (fractions of the layers re-initialised from the top)."""

    examples: Annotated[Int, Field(ge=1, le=64)] = 4
    randomisation: Bool = True
    fractions: list[Annotated[Float, Field(gt=0, le=1)]] = Field(default_factory=lambda: [0.5, 1.0])


class PublishedNumber(_Spec):
    """A number from the paper a study follows, set beside ours in the report (context, not a target)."""

    explainer: str
    reference: str
    layer: Int | None = None  # 0-based, ours; None for a token-level method
    measure: Literal["kendall_tau", "spearman"] = "spearman"
    value: Float
    source: str = ""


class MetricsSpec(_Spec):
    agreement: list[Literal["kendall", "spearman", "top_k"]] = Field(
        default_factory=lambda: ["kendall", "spearman", "top_k"])
    top_k: list[Annotated[Int, Field(ge=1)]] = Field(default_factory=lambda: [1, 3, 5])
    baselines: list[Literal["random", "uniform", "position"]] = Field(
        default_factory=lambda: ["random", "uniform", "position"])
    ceilings: list[tuple[str, str]] | None = None
    erasure: ErasureSpec | None = Field(default_factory=ErasureSpec)
    counterfactual: CounterfactualSpec | None = Field(default_factory=CounterfactualSpec)
    heads: HeadsSpec | None = Field(default_factory=HeadsSpec)
    #: methods compared by magnitude (|score|), as Jain & Wallace compare |delta y| and |grad x input|
    absolute: list[str] = Field(default_factory=list)
    sanity: SanitySpec = Field(default_factory=SanitySpec)
    published: list[PublishedNumber] = Field(default_factory=list)

    @field_validator("absolute", mode="before")
    @classmethod
    def _absolute(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, name in enumerate(value):
            if name not in ALL_METHODS:
                _fail(_unknown_method(name), item=[i])
        return value

    @field_validator("ceilings", mode="before")
    @classmethod
    def _ceilings(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, pair in enumerate(value):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                _fail(f"{_show(pair)} is not a pair of methods; write e.g. [loo_delete, loo_mask]", item=[i])
            for j, name in enumerate(pair):
                if name not in ALL_METHODS:
                    _fail(_unknown_method(name), item=[i, j])
            if pair[0] == pair[1]:
                _fail(f"{_show(pair)} pairs a method with itself; give two different methods", item=[i])
        return [tuple(pair) for pair in value]


class StatisticsSpec(_Spec):
    bootstrap: Annotated[Int, Field(ge=100)] = 2000
    level: Annotated[Float, Field(gt=0.5, lt=1)] = 0.95
    alpha: Annotated[Float, Field(gt=0, lt=0.5)] = 0.05
    seed: Int = 0
    include_special: Bool = False
    reference: str | None = None
    measure: Literal["kendall_tau", "spearman"] = "kendall_tau"


class EngineSpec(_Spec):
    batch_size: Annotated[Int, Field(ge=1)] = 16
    token_budget: Annotated[Int, Field(ge=64)] = 8192


class Study(_Spec):
    name: str
    description: str = ""
    model: ModelSpec
    dataset: DatasetSpec
    target: TargetConfig = Field(default_factory=TargetConfig)
    explainers: list[str]
    references: list[str]
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    statistics: StatisticsSpec = Field(default_factory=StatisticsSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    output: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value) or set(value) == {"."}:
            _fail(f"{value!r} may use only letters, digits, '-', '_' and '.'; "
                  f"e.g. {re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('-.') or 'my-study'!r}")
        return value

    @field_validator("explainers", "references", mode="before")
    @classmethod
    def _methods(cls, value: Any) -> Any:
        return _method_list(value)

    @field_validator("output")
    @classmethod
    def _output(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            _fail("is empty; give a folder for the results or leave output out")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Study:
        used = self.methods
        listed = f"explainers and references: {', '.join(used)}"
        for key in self.params:
            if key not in ALL_METHODS:
                _fail(_unknown_method(key), at=["params", key])
            if key not in used:
                _fail(f"parameters for {key!r}, which is not among the study's {listed}; "
                      f"add {key} to explainers or references, or remove its parameters", at=["params", key])
        if self.statistics.reference is not None and self.statistics.reference not in self.references:
            _fail(f"{self.statistics.reference!r} is not one of the references ({', '.join(self.references)}); "
                  "give one of them, or leave it out for the first", at=["statistics", "reference"])
        erasure = self.metrics.erasure
        for i, entry in enumerate(erasure.rankings if erasure is not None else []):
            method, _ = parse_ranking(entry)
            if method not in used:
                _fail(f"{entry!r}: {method} is not among the study's {listed}; add it there or drop this ranking",
                      at=["metrics", "erasure", "rankings"], item=[i])
        for i, pair in enumerate(self.metrics.ceilings or []):
            for j, method in enumerate(pair):
                if method not in used:
                    _fail(f"{method} is not among the study's {listed}; add it there or drop this pair",
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

    def to_dict(self) -> dict:
        """Plain JSON-able dict; ``study_from_dict(study.to_dict()) == study``."""
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of everything except ``output`` and ``description``."""
        payload = self.model_dump(mode="json", exclude={"output", "description"})
        # keys added later count only when set, so studies written before them keep their fingerprint
        if not payload["model"].get("allow_random_weights"):
            payload["model"].pop("allow_random_weights", None)
        for key in ("reference", "dimension"):
            if payload["target"].get(key) is None:
                payload["target"].pop(key, None)
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------- loading


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
    data, root = _read_yaml(path)
    study = _validate(data, source=str(path), root=root, base_dir=path.parent)

    overrides: list[tuple[str, Any, tuple[str, ...]]] = []  # (option, value given, key path it replaces)
    if n is not None:
        overrides.append(("n", n, ("dataset", "n")))
    if dataset is not None:
        overrides.append(("dataset", dataset, ("dataset", "name")))
    if device is not None:
        overrides.append(("device", device, ("model", "device")))
    if dtype is not None:
        overrides.append(("dtype", dtype, ("model", "dtype")))
    if out is not None:
        overrides.append(("out", out, ("output",)))
    if not overrides:
        return study

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
        error = _first_error(exc, None)
        loc = tuple(error["loc"]) + tuple(_ctx(error, "at"))
        blamed = [f"{option}={_show(value)}" for option, value, keys in overrides if loc[:len(keys)] == keys]
        given = f"the override {blamed[0]}" if blamed else "the overrides"
        raise InputError(f"{path} with {given}: {_describe(error)}") from None


def _dataset_override(dataset: str) -> str:
    if not isinstance(dataset, str) or not dataset.strip():
        raise InputError(f"dataset override {dataset!r} is empty; give a .csv/.jsonl file or builtin:NAME")
    if dataset.startswith(BUILTIN_PREFIX):
        return dataset
    file = Path(dataset).expanduser()
    if not file.exists():
        raise InputError(f"dataset file {dataset} not found (from the current directory {Path.cwd()}); "
                         "give an existing .csv or .jsonl file")
    if not file.is_file():
        raise InputError(f"dataset path {dataset} is not a file; give a .csv or .jsonl file")
    return str(file)


def _read_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    return read_yaml_mapping(path, "study file", "study",
                             "write a study with at least name, model, dataset, explainers and references",
                             "name:, model:, dataset:, explainers:, references:, ...")


def read_yaml_mapping(path: Path, what: str, top: str, empty_hint: str, keys_hint: str) -> tuple[dict, yaml.Node]:
    """Read a YAML file whose top level is a mapping, with one-line errors naming the file and line:
    a missing file, a folder, bad encoding, bad YAML, an empty file, a top level that is not a
    mapping, a duplicate key. ``what``: e.g. "study file"; ``top``: what the document is called
    ("study"); ``empty_hint`` / ``keys_hint``: what to write instead.
    """
    if not path.exists():
        raise InputError(f"{what} not found: {path}")
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a {what}; give the path of a .yaml {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text; save the {what} as UTF-8 YAML") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = str(exc.problem or exc.context or "unreadable")
        if exc.problem and exc.context and str(exc.context).startswith("expected"):
            problem = f"{exc.context}, {exc.problem}"  # e.g. "expected a single document ..., but found another"
        problem = " ".join(problem.split())
        raise InputError(f"{path}{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()
    if root is None or data is None:
        raise InputError(f"{path} is empty; {empty_hint}")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the value {_show(data)}"
        raise InputError(f"{path} line {root.start_mark.line + 1}: the {top} is {kind}, not a mapping; "
                         f"write it as key: value lines ({keys_hint})")
    _check_duplicate_keys(root, str(path), top=top)
    return data, root


def _check_duplicate_keys(node: yaml.Node, source: str, trail: tuple[str | int, ...] = (), top: str = "study") -> None:
    """YAML keeps the last of two equal keys silently; a study (or claim) file must not have any."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is not None and name in seen:
                raise InputError(f"{source} line {key.start_mark.line + 1}: duplicate key {name!r} in "
                                 f"{_dotted(trail) or top}; keep only one of them")
            if name is not None:
                seen.add(name)
            _check_duplicate_keys(value, source, trail + (name if name is not None else "?",), top)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, source, trail + (i,), top)


def _validate(data: Any, *, source: str, root: yaml.Node | None, base_dir: Path | None) -> Study:
    if not isinstance(data, dict):
        raise InputError(f"{source}: the study is {_show(data)}, not a mapping of keys "
                         "(name, model, dataset, explainers, references, ...)")
    try:
        return Study.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        error = _first_error(exc, root)
        line = _error_line(error, root)
        where = f"{source} line {line}" if line is not None else source
        raise InputError(f"{where}: {_describe(error)}") from None


# ------------------------------------------------------------------------------------ error messages


def _ctx(error: dict, key: str) -> list:
    return list((error.get("ctx") or {}).get(key) or [])


def _first_error(exc: ValidationError, root: yaml.Node | None) -> dict:
    """The problem that comes first in the file (errors without a line come last)."""
    errors = exc.errors()
    if root is None:
        return errors[0]
    lines = [_error_line(e, root) for e in errors]
    order = sorted(range(len(errors)), key=lambda i: (lines[i] is None, lines[i] or 0, i))
    return errors[order[0]]


def _walk(root: yaml.Node, path: Sequence[str | int]) -> tuple[yaml.Node, yaml.Node | None, bool]:
    """Follow ``path`` down the node tree: ``(deepest node reached, its key node if it is a mapping value,
    whether the whole path was followed)``."""
    node, key = root, None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)),
                         None)
            if found is None:
                return node, key, False
            key, node = found
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            key, node = None, node.value[part]
        else:
            return node, key, False
    return node, key, True


def _error_line(error: dict, root: yaml.Node | None) -> int | None:
    if root is None:
        return None
    loc = tuple(error["loc"]) + tuple(_ctx(error, "at")) + tuple(_ctx(error, "item"))
    if error["type"] == "missing":
        if len(loc) <= 1:
            return None
        node, key, _ = _walk(root, loc[:-1])
    else:
        node, key, _ = _walk(root, loc)
    return (key if key is not None else node).start_mark.line + 1


def _dotted(loc: Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The schema model found at ``loc`` (e.g. ``("metrics", "erasure")`` -> ErasureSpec)."""
    model: type[BaseModel] = Study
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        nested = _find_model(field.annotation)
        if nested is None:
            return None
        model = nested
    return model


def _find_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _describe(error: dict) -> str:
    """One line: the key path, the bad value and what to do."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    if kind == "study":
        path = _dotted(loc + tuple(_ctx(error, "at")))
        message = error["ctx"]["message"]
        return f"{path}: {message}" if path else message
    if kind in ("extra_forbidden", "invalid_key"):
        model = _model_at(loc[:-1])
        keys = list(model.model_fields) if model is not None else []
        where = _dotted(loc[:-1]) or "study"
        hint = _suggest(loc[-1], keys) or "; remove it or fix its spelling"
        return f"unknown key {_show(loc[-1])} in {where} (valid keys: {', '.join(keys)}){hint}"
    if kind == "missing":
        where = _dotted(loc[:-1])
        prefix = f"{where}: " if where else ""
        return f"{prefix}missing required key {loc[-1]!r}; add {loc[-1]}: to {where or 'the study'}"
    path = _dotted(loc)
    shown = _show(value)
    ctx = error.get("ctx") or {}
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"{path}: {shown} is not one of {', '.join(options)}{_suggest(value, options)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        model = _model_at(loc)
        keys = f" with keys such as {', '.join(model.model_fields)}" if model is not None else ""
        return f"{path}: {shown} is not a mapping; write key: value pairs{keys}"
    if kind == "list_type":
        return f"{path}: {shown} is not a list; write [a, b, ...]"
    if kind == "string_type":
        return f"{path}: {shown} is not text; write a string (quote it if YAML reads it as something else)"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{path}: {shown} is not a whole number; give an integer such as 1"
    if kind in ("float_type", "float_parsing"):
        return f"{path}: {shown} is not a number; give one such as 0.5"
    if kind in ("bool_type", "bool_parsing"):
        return f"{path}: {shown} is not true or false"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
              "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
    if kind in bounds:
        sign, key = bounds[kind]
        return f"{path}: {shown} is out of range; give a value {sign} {ctx.get(key)}"
    message = str(error.get("msg", "invalid value"))
    message = message[:1].lower() + message[1:]
    return f"{path}: {shown} is not valid: {' '.join(message.split())}"
