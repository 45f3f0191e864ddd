"""The sections a study file and a claim file share: the model, a dataset, the explained target.

Frozen pydantic models (:class:`~probe.spec.validation.SpecModel`); problems are raised with
:func:`~probe.spec.validation.fail` as finished sentences.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from probe.data import BUILTIN_PREFIX, SPLITS
from probe.patterns import pattern_problem
from probe.spec.validation import Int, SpecModel, check_dataset_name, fail, show

__all__ = ["DataSpec", "DatasetSpec", "Filters", "ModelSpec", "SpansSpec", "TargetConfig"]


class ModelSpec(SpecModel):
    """The model: which one, on which device, in which precision."""

    #: builtin:NAME, planted:NAME, a local folder or a Hugging Face hub id
    id: str
    #: cpu, cuda, cuda:N or auto
    device: str = "cpu"
    #: the precision the weights are loaded in
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: the attention implementation transformers loads the model with (default: transformers' own, sdpa)
    attn_implementation: str | None = None
    #: load as classification, causal_lm, seq2seq or encoder (default: read from the model)
    task: str | None = None
    #: explain a model whose checkpoint leaves weights random (e.g. a missing head); shown in every report
    allow_random_weights: bool = False
    #: spread the model over the devices with accelerate (auto, balanced, sequential; transformers'
    #: from_pretrained(device_map=...)) instead of moving it to ``device``
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = None

    @field_validator("id", "device")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            fail("is empty; give a value (e.g. id: builtin:minilm-rt, device: cpu)")
        return value.strip()


class Filters(SpecModel):
    """Which examples of the dataset are kept, before ``n`` of them are drawn."""

    #: keep texts of at least this many words (split at whitespace)
    min_words: Annotated[Int, Field(ge=1)] | None = None
    #: keep texts of at most this many words
    max_words: Annotated[Int, Field(ge=1)] | None = None
    #: keep the examples whose label is one of these
    labels: list[Int] | None = None
    #: keep the texts in which this regular expression matches
    contains: str | None = None

    @field_validator("labels")
    @classmethod
    def _some_labels(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            fail("is empty; list the labels to keep (e.g. [0, 1]) or leave labels out")
        return value

    @field_validator("contains")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            problem = pattern_problem(value)
            if problem is not None:
                fail(f"{value!r} {problem}")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> Filters:
        if self.min_words is not None and self.max_words is not None and self.min_words > self.max_words:
            fail(f"min_words {self.min_words} is above max_words {self.max_words}; no example could pass",
                  at=["min_words"])
        return self


class ExampleDraw(SpecModel):
    """What a study's ``dataset`` and a claim file's ``data`` share: which split, how many examples
    with which seed, the columns of a user's file, and a length cap. The two sections differ only in
    how they name the source (:class:`DatasetSpec`, :class:`DataSpec`)."""

    #: the split of a built-in dataset
    split: str = "test"
    #: how many examples are drawn (default: every example that passes the filters and fits; a
    #: claim file's texts: the first n)
    n: Annotated[Int, Field(ge=1)] | None = None
    #: the seed of the shuffle the n examples are drawn after
    seed: Int = 0
    #: the column of a .csv/.jsonl file that holds the text
    text_column: str = "text"
    #: the column of a .csv/.jsonl file that holds the label
    label_column: str = "label"
    #: leave out examples longer than this many tokens (the model's window always applies)
    max_length: Annotated[Int, Field(ge=2, le=2**24)] | None = None

    @field_validator("text_column", "label_column", "split")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            fail("is empty; give a name or leave the key out for the default")
        return value

    #: the section's own source key, written first (as the section's keys were before they shared a class)
    source_key: ClassVar[str] = ""

    @property
    def source(self) -> str | None:
        """The dataset drawn from (builtin:NAME, planted:NAME or a file); None for a list of texts."""
        raise NotImplementedError

    @model_serializer(mode="wrap")
    def _source_first(self, handler):
        data = handler(self)
        if isinstance(data, dict) and self.source_key in data:
            data = {self.source_key: data.pop(self.source_key), **data}
        return data

    def _check_split(self) -> None:
        """A built-in dataset's split is one it has."""
        if self.source is not None and self.source.startswith(BUILTIN_PREFIX) and self.split not in SPLITS:
            fail(f"{self.split!r} is not a split of {self.source} (valid: {', '.join(SPLITS)})", at=["split"])


class DatasetSpec(ExampleDraw):
    """A study's examples: a dataset, its split, and how many are drawn with which seed."""

    #: builtin:NAME, planted:NAME or a .csv/.jsonl file (a relative path is read from the study
    #: file's folder when the file is there)
    name: str
    filters: Filters = Field(default_factory=Filters)
    source_key: ClassVar[str] = "name"

    @field_validator("name")
    @classmethod
    def _dataset_name(cls, value: str, info: ValidationInfo) -> str:
        return check_dataset_name(value, info)

    @property
    def source(self) -> str:
        return self.name

    @model_validator(mode="after")
    def _builtin_split(self) -> DatasetSpec:
        self._check_split()
        return self


class DataSpec(ExampleDraw):
    """A claim file's examples: ``dataset`` (builtin:NAME or a .csv/.jsonl file) with split, n,
    seed; or ``texts``."""

    #: builtin:NAME, planted:NAME or a .csv/.jsonl file (a relative path is read from the claim
    #: file's folder when the file is there)
    dataset: str | None = None
    #: instead of dataset: the texts themselves
    texts: list[str] | None = None
    source_key: ClassVar[str] = "dataset"

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else check_dataset_name(value, info)

    @property
    def source(self) -> str | None:
        return self.dataset

    @field_validator("texts")
    @classmethod
    def _texts(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                fail("is empty; list at least one text, or give dataset: instead")
            for i, text in enumerate(value):
                if not text.strip():
                    fail("an empty text; every text needs at least one word", item=[i])
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.dataset is None) == (self.texts is None):
            fail("give exactly one of dataset (builtin:NAME or a .csv/.jsonl file) or texts (a list); "
                  f"{'both were' if self.texts is not None else 'neither was'} given", at=["dataset"])
        self._check_split()
        return self


class TargetConfig(SpecModel):
    """What is explained: which output of the model, as which number."""

    #: the number explained: prob, logit or logprob of the target (default prob for classifiers,
    #: logprob for language models); similarity or dimension for a headless encoder
    kind: Literal["prob", "logit", "logprob", "similarity", "dimension"] | None = None
    #: a classifier's class explained: an index, a label name, or gold (each example's dataset
    #: label); default the predicted class
    label: int | str | None = None
    #: a language model's output text whose log-prob is explained (default: its greedy output)
    continuation: str | None = None
    #: a template holding {text} once: each example is put in its place, and the template's own
    #: tokens are not scored
    prompt: str | None = None
    #: a language model's answer options: the one it prefers (the highest log-prob) is explained
    choices: list[str] | None = None
    #: kind similarity (a headless encoder): the text whose pooled embedding each example's is
    #: compared with (cosine)
    reference: str | None = None
    #: kind dimension (a headless encoder): the component of the pooled embedding explained
    dimension: Annotated[Int, Field(ge=0)] | None = None
    #: a contrastive target ("why this rather than that"): a language model's foil text, the
    #: continuation's log-prob minus the foil's at the same positions explained
    contrast: str | None = None
    #: a classifier's other label (index or name): logit[label] - logit[contrast_label] explained
    contrast_label: int | str | None = None
    #: a language model's output explained token by token (one unit per output token, statistics over
    #: the examples): ``generate`` its greedy output of up to N tokens, ``steps`` each token of ``continuation``
    generate: Annotated[Int, Field(ge=1, le=1024)] | None = None
    #: explain each token of ``continuation`` on its own (as ``generate`` does the model's own output)
    steps: bool = False
    #: causal LMs, with generate or steps: the output written before each token is scored too (target-side)
    target_side: bool = False

    @property
    def stepwise(self) -> bool:
        """Every output token is explained on its own (``generate`` or ``steps``)."""
        return self.generate is not None or self.steps

    @field_validator("label", "contrast_label", mode="before")
    @classmethod
    def _label(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            fail(f"{show(value)} is not a label; give a class index (e.g. 1) or a label name (e.g. positive)")
        return value

    @field_validator("contrast")
    @classmethod
    def _contrast(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            fail(f"{show(value)} is an empty foil; give the text the continuation is contrasted with (e.g. ' "
                 f"negative') "
                  "or leave contrast out")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | None) -> str | None:
        if value is not None and value.count("{text}") != 1:
            fail(f"{show(value)} must contain {{text}} exactly once (it has {value.count('{text}')}); "
                  "e.g. 'Review: {text}\\nSentiment:'")
        return value

    @field_validator("choices")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        for i, choice in enumerate(value):
            if not choice:
                fail("an empty choice; every choice needs some text (e.g. ' positive')", item=[i])
            if choice in value[:i]:
                fail(f"{choice!r} is listed twice; the choices must be distinct", item=[i])
        if len(value) < 2:
            fail(f"{show(value)} has fewer than 2 choices; give at least two, e.g. [' positive', ' negative']")
        return value

    @model_validator(mode="after")
    def _encoder_target(self) -> TargetConfig:
        if self.kind == "similarity" and not (self.reference or "").strip():
            fail("similarity needs a reference text; add reference: 'some text' (its pooled embedding is "
                  "compared with each example's)", at=["reference"])
        if self.kind == "dimension" and self.dimension is None:
            fail("dimension needs the embedding component to explain; add dimension: N", at=["dimension"])
        if self.reference is not None and self.kind != "similarity":
            fail(f"reference applies to kind: similarity (kind is {self.kind or 'the default'}); set kind: similarity "
                  "or remove reference", at=["reference"])
        if self.dimension is not None and self.kind != "dimension":
            fail(f"dimension applies to kind: dimension (kind is {self.kind or 'the default'}); set kind: dimension "
                  "or remove dimension", at=["dimension"])
        return self

    @model_validator(mode="after")
    def _exclusive(self) -> TargetConfig:
        if self.choices is not None and self.continuation is not None:
            fail("choices and continuation exclude each other; give the answer options (choices) "
                  "or one fixed continuation, not both", at=["choices"])
        if self.label is not None and (self.choices is not None or self.continuation is not None):
            other = "choices" if self.choices is not None else "continuation"
            fail(f"label cannot be combined with {other} (the explained output is then the "
                  f"{'chosen answer' if other == 'choices' else 'continuation'}); remove one of them", at=["label"])
        return self

    @model_validator(mode="after")
    def _steps(self) -> TargetConfig:
        if self.target_side and not self.stepwise:
            fail("target_side scores the output written before each output token: add generate: N (or steps: true "
                  "with a continuation)", at=["target_side"])
        if not self.stepwise:
            return self
        key = "generate" if self.generate is not None else "steps"
        if self.generate is not None and self.continuation is not None:
            fail("generate writes the output and continuation gives it; keep one (steps: true explains a given "
                  "continuation token by token)", at=["generate"])
        if self.steps and self.generate is None and self.continuation is None:
            fail("steps: true explains each token of a continuation; give continuation: TEXT, or generate: N for "
                  "the model's own output", at=["steps"])
        for other in ("choices", "label", "reference", "dimension"):
            if getattr(self, other) is not None:
                fail(f"{key} explains a language model's output token by token and cannot be combined with {other}; "
                      f"remove one of them", at=[key])
        if self.kind in ("similarity", "dimension"):
            fail(f"{key} needs a language model's output; kind {self.kind} has none", at=["kind"])
        if self.generate is not None and self.contrast is not None:
            fail("a contrast is set against a given output: give the output as continuation with steps: true "
                  "instead of generate", at=["contrast"])
        return self

    @model_validator(mode="after")
    def _contrasts(self) -> TargetConfig:
        if self.contrast is not None and self.contrast_label is not None:
            fail("contrast (a language model's foil text) and contrast_label (a classifier's other label) exclude "
                  "each other; keep the one for your model", at=["contrast_label"])
        if self.contrast is None and self.contrast_label is None:
            return self
        key = "contrast" if self.contrast is not None else "contrast_label"
        if self.kind == "prob":
            fail(f"kind prob cannot be contrasted (a difference of log-probs is not a probability); set kind: logprob "
                  f"or logit, or remove {key}", at=["kind"])
        if self.kind in ("similarity", "dimension"):
            fail(f"{key} needs a task head; kind {self.kind} (a headless encoder) has no class or continuation to "
                  f"contrast: remove {key}", at=[key])
        if self.choices is not None:
            fail(f"{key} cannot be combined with choices (the explained answer is chosen per example); give one "
                  "continuation and its contrast, or remove it", at=[key])
        if self.contrast_label is not None and self.label == "gold":
            fail("contrast_label cannot be combined with label: gold (an example whose gold label is the contrast "
                  "would have nothing to contrast); give a fixed label, or remove contrast_label", at=["contrast_label"])
        if self.contrast_label is not None and self.label is not None and str(self.contrast_label) == str(self.label):
            fail(f"contrast_label {show(self.contrast_label)} is the label itself; a contrast explains one class "
                  "rather than another: give a different contrast_label", at=["contrast_label"])
        return self


class SpansSpec(SpecModel):
    """Spans as the units compared (:mod:`probe.rows.spans`), in a study or an audit: each match of
    ``pattern`` in an example's text is one unit; every explainer's token scores are folded over it
    by ``aggregate``, and each leave-one-out reference perturbs the whole span at once."""

    #: a regular expression: each match in an example's text is one unit
    pattern: str
    #: how a span's token scores are folded into one
    aggregate: Literal["sum", "max", "mean"] = "sum"

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        if not value.strip():
            fail("is empty; give a regular expression whose matches are the spans (e.g. '\\w+' for words)")
        problem = pattern_problem(value)
        if problem is not None:
            fail(f"{value!r} {problem}; e.g. '[^,.]+' for clauses")
        return value
