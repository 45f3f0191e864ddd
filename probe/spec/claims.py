"""A claim file: a model, some data, and claims about the model's attention to test by intervention.

Written in YAML and validated like a study file, with the same helpers (:mod:`probe.spec.validation`):
every problem is one :class:`~probe.errors.InputError` line naming the file, the line and the key::

    claims.yaml line 12: claims[1].kind: unknown claim kind 'importance' (valid: token_importance, ...)

Layout::

    model: {id: builtin:minilm-rt, device: cpu, dtype: fp32}
    data: {dataset: builtin:rotten_tomatoes, split: test, n: 60, seed: 0}   # or data: {texts: [...]}
    target: {kind: prob}                   # optional; the fields of a study's target
    statistics: {bootstrap: 2000, level: 0.95, seed: 0}                     # optional
    output: reports/audit_minilm_rt        # optional; `probe audit --out` wins
    claims:
      - claim: the most-attended token is the most important one
        kind: token_importance
        attention: attention_mean@last
      - ...

The claim kinds and their fields are the ``*Claim`` classes below (the values their keys hold are parsed
and checked in :mod:`probe.spec.claim_values`; the ``data`` section is :class:`~probe.spec.parts.DataSpec`); the
decision rules are in :mod:`probe.claims.rules`; what each kind measures in :mod:`probe.claims.kinds`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from probe.errors import InputError
from probe.patterns import UserPattern, user_pattern
from probe.registry.params import AdversarialParams, PermutedParams, declared_limits
from probe.spec.claim_values import (
    AttentionRanking,
    check_head,
    check_reference,
    check_regex,
    check_words,
    parse_attention,
    parse_head,
    parse_layer_window,
)
from probe.spec.parts import DataSpec, ModelSpec, SpansSpec, TargetConfig
from probe.spec.validation import (
    LAYER_WORDS,
    Bool,
    Float,
    Int,
    SpecFile,
    SpecModel,
    fail,
    line_of,
    located_error,
    read_yaml_mapping,
    show,
    suggest,
    walk,
)

__all__ = [
    "AuditStatistics", "ClaimFile", "CLAIM_KINDS", "CounterfactualClaim", "EdgeClaim", "FaithfulnessClaim",
    "HeadRoleClaim", "SinkHeadClaim", "SpecificTokensClaim", "TokenImportanceClaim", "claims_from_dict", "load_claims",
]

# ------------------------------------------------------------------------------------------ claims


class _Claim(SpecModel):
    #: the claim, as a sentence (the audit shows it)
    claim: str
    #: the kind of claim, which decides its other keys
    kind: str

    @field_validator("claim")
    @classmethod
    def _sentence(cls, value: str) -> str:
        if not value.strip():
            fail("is empty; write the claim as a sentence, e.g. 'the most-attended token is the most important'")
        return " ".join(value.split())

    # shared by the kinds that have these fields
    @field_validator("attention", check_fields=False)
    @classmethod
    def _attention(cls, value: str) -> str:
        try:
            return str(parse_attention(value))
        except ValueError as exc:
            fail(str(exc))

    @field_validator("reference", check_fields=False)
    @classmethod
    def _reference(cls, value: str) -> str:
        return check_reference(value)

    @field_validator("pattern", "attends_to", check_fields=False)
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        return check_regex(value)


class TokenImportanceClaim(_Claim):
    """The most-attended token is the most important one (by the reference, signed: largest drop)."""

    kind: Literal["token_importance"]
    #: the attention read: METHOD, METHOD@LAYER or METHOD@LAYER.HEAD (layer: an index, first or last)
    attention: str = "attention_mean@last"
    #: what importance is: an intervention (loo_delete, ...) or a gradient method
    reference: str = "loo_delete"
    #: the k of the top-k overlap given as evidence
    k: Annotated[Int, Field(ge=1)] = 3

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)


class FaithfulnessClaim(_Claim):
    """Attention ranks tokens like the reference does: mean rank correlation >= threshold."""

    kind: Literal["faithfulness"]
    #: the attention read: METHOD, METHOD@LAYER or METHOD@LAYER.HEAD (layer: an index, first or last)
    attention: str = "attention_mean@last"
    #: what importance is: an intervention (loo_delete, ...) or a gradient method
    reference: str = "loo_delete"
    #: the mean rank correlation the claim needs
    threshold: Annotated[Float, Field(ge=-1, le=1)]
    #: the rank correlation: Kendall tau-b or Spearman
    measure: Literal["kendall_tau", "spearman"] = "kendall_tau"

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)


class SpecificTokensClaim(_Claim):
    """Removing the tokens matching ``pattern`` (or ``words``) changes the output more than removing
    as many other tokens at random."""

    kind: Literal["specific_tokens"]
    #: a regular expression a token's text matches whole (case-insensitive)
    pattern: str | None = None
    #: instead of pattern: the words whose tokens match
    words: list[str] | None = None
    #: how tokens are removed: deleted, or replaced by the mask, unk or pad token
    intervention: Literal["delete", "mask", "unk", "pad"] = "delete"
    #: seeded draws of as many random other tokens, removed for comparison
    repeats: Annotated[Int, Field(ge=1)] = 10
    #: the attention whose most-attended other tokens are removed for comparison (evidence)
    attention: str = "attention_mean@last"

    @field_validator("words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        return check_words(value, "the claim is about", "not, never")

    @model_validator(mode="after")
    def _one_matcher(self) -> SpecificTokensClaim:
        if (self.pattern is None) == (self.words is None):
            fail("give exactly one of pattern (a regular expression) or words (a list); "
                  f"{'both were' if self.pattern is not None else 'neither was'} given", at=["pattern"])
        return self

    @property
    def ranking(self) -> AttentionRanking:
        return parse_attention(self.attention)

    def matcher(self) -> UserPattern:
        """The compiled, case-insensitive full-match pattern for a token's text (bounded in time)."""
        if self.words is not None:
            return user_pattern("|".join(re.escape(w.strip()) for w in self.words), "words", ignore_case=True)
        return user_pattern(self.pattern, "pattern", ignore_case=True)

    @property
    def matches_what(self) -> str:
        return f"pattern {self.pattern!r}" if self.words is None else f"words {', '.join(self.words)}"


class _HeadClaim(_Claim):
    """A claim about one head, named as LAYER.HEAD."""

    #: the head as LAYER.HEAD (e.g. "5.3"; the layer may be first or last)
    head: str

    @field_validator("head", mode="before")
    @classmethod
    def _head(cls, value: Any) -> Any:
        return check_head(value)

    @property
    def site(self) -> tuple[int | str, int]:
        return parse_head(self.head)


class HeadRoleClaim(_HeadClaim):
    """Head L.H matters for the prediction (more than the other heads of its layer), and with
    ``attends_to`` also: it puts more than a uniform share of its attention on matching tokens."""

    kind: Literal["head_role"]
    #: a regular expression: the head also puts more than a uniform share of its attention on the
    #: tokens it matches
    attends_to: str | None = None

    def matcher(self) -> UserPattern | None:
        return None if self.attends_to is None else user_pattern(self.attends_to, "attends_to", ignore_case=True)


class SinkHeadClaim(_HeadClaim):
    """Head L.H is a sink head: its target row puts more than ``share`` of its attention on sink
    keys (keys whose mean received attention over the query rows exceeds ``threshold``, found per
    example), while blocking the target row's edges to those keys in this head alone changes the
    target by less than ``max_effect``: much attention, little effect. Both parts must hold."""

    kind: Literal["sink_head"]
    #: the mean share of the target row's attention on sink keys the claim needs
    share: Annotated[Float, Field(gt=0, lt=1)] = 0.5
    #: the mean |change of the target| (its units: a probability, a log-prob, ...) when the target
    #: row's edges to the sinks are blocked in the head, which the claim must stay under
    max_effect: Annotated[Float, Field(gt=0)] = 0.05
    #: a key is a sink of the head when its mean received attention over the query rows exceeds this
    threshold: Annotated[Float, Field(ge=0, lt=1)] = 0.3
    #: the blocked edges are only zeroed (the default: what the sinks carry through their values is
    #: removed), or the row is renormalised over the other keys (= -inf before the softmax: the
    #: sinks' mass moves onto the other keys, which measures losing the sink, not what it carries)
    renormalise: Bool = False


class EdgeClaim(_Claim):
    """The target row's attention to the named tokens matters in a window of layers: blocking the
    edges from the target query row to every token matching ``to`` (or ``to_words``, or the one at
    ``to_position``) in every head of ``layers`` (or ``heads``), all at once (Geva et al. 2023's
    attention knockout), changes the target by more than ``threshold`` (mean |change| per example).
    Examples without such a token are left out."""

    kind: Literal["edge"]
    #: the layer window: an index, first, last, an inclusive range "A-B" ("10-14", "10-last") or a list
    layers: int | str | list[int]
    #: query heads whose edges are blocked: one index or a list (default: every head)
    heads: Int | list[Int] | None = None
    #: a regular expression a token's text matches whole (case-insensitive): the attended tokens
    to: str | None = None
    #: instead of to: the words whose tokens are the attended ones
    to_words: list[str] | None = None
    #: instead of to: one position of the explained tokens (0 the first; negative from the end)
    to_position: Int | None = None
    #: the mean |change of the target| (its units: a probability, a log-prob, ...) the claim needs
    threshold: Annotated[Float, Field(gt=0)] = 0.05
    #: blocked edges leave the row renormalised over the other keys (= -inf before the softmax), or
    #: only zeroed
    renormalise: Bool = True

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        try:
            parse_layer_window(value)
        except ValueError as exc:
            fail(str(exc))
        return value.strip() if isinstance(value, str) else value

    @field_validator("to")
    @classmethod
    def _to(cls, value: str | None) -> str | None:
        return check_regex(value)

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, value: Any) -> Any:
        # checked here, not by the union's branches, whose names (constrained-int) would reach the message
        if value is None:
            return value
        listed = isinstance(value, list)
        for i, head in enumerate(value if listed else [value]):
            if isinstance(head, bool) or not isinstance(head, int) or head < 0:
                fail(f"{show(head)} is not a head index; give an index >= 0 (0 the first head) or a list of them, "
                     "or leave heads out for every head", item=[i] if listed else [])
        return value

    @field_validator("to_words")
    @classmethod
    def _to_words(cls, value: list[str] | None) -> list[str] | None:
        return check_words(value, "the edges go to", "Paris")

    @model_validator(mode="after")
    def _one_target(self) -> EdgeClaim:
        given = [k for k in ("to", "to_words", "to_position") if getattr(self, k) is not None]
        if len(given) != 1:
            fail("give exactly one of to (a regular expression), to_words (a list) or to_position (an index); "
                 f"{'none was' if not given else ', '.join(given) + ' were'} given", at=["to"])
        return self

    @property
    def window(self) -> tuple[tuple[int | str, int | str] | None, tuple[int | str, ...]]:
        return parse_layer_window(self.layers)

    @property
    def head_list(self) -> tuple[int, ...] | None:
        return None if self.heads is None else tuple(self.heads) if isinstance(self.heads, list) else (self.heads,)

    def matcher(self) -> UserPattern | None:
        if self.to_words is not None:
            return user_pattern("|".join(re.escape(w.strip()) for w in self.to_words), "to_words", ignore_case=True)
        return None if self.to is None else user_pattern(self.to, "to", ignore_case=True)

    @property
    def to_what(self) -> str:
        if self.to_position is not None:
            return f"the token at position {self.to_position}"
        return (f"the tokens matching {self.to!r}" if self.to is not None
                else f"the tokens of the words {', '.join(self.to_words)}")


class CounterfactualClaim(_Claim):
    """A different attention at ``layer`` (``head``) would change the output: permuting the target
    row moves the output distribution by more than ``bound`` (total variation)."""

    kind: Literal["counterfactual"]
    #: the layer whose target-row attention is replaced: an index, first or last
    layer: int | Literal["first", "last"] = "last"
    #: one head of that layer (default: every head)
    head: Annotated[Int, Field(ge=0)] | None = None
    #: seeded permutations of the attention row per example
    permutations: Annotated[Int, Field(ge=1, le=declared_limits(PermutedParams, "n")[1])] = 20
    #: the output change (total variation) the permutations must exceed; the adversarial search's bound
    bound: Annotated[Float, Field(gt=0, le=1)] = 0.01
    #: also run Jain & Wallace's adversarial search (evidence only)
    adversarial: Bool = True
    #: adversarial search: attention candidates per example
    candidates: Annotated[Int, Field(ge=1, le=declared_limits(AdversarialParams, "candidates")[1])] \
        = AdversarialParams.candidates  # the registry's defaults and limits
    #: adversarial search: Adam steps
    steps: Annotated[Int, Field(ge=1, le=declared_limits(AdversarialParams, "steps")[1])] = AdversarialParams.steps

    @field_validator("layer", mode="before")
    @classmethod
    def _layer(cls, value: Any) -> Any:
        if isinstance(value, bool) or not (isinstance(value, int) or value in LAYER_WORDS):
            fail(f"{show(value)} is not a layer; give a layer index (0, 1, ...), first or last")
        if isinstance(value, int) and value < 0:
            fail(f"{value} is negative; give a layer index >= 0, or last")
        return value


CLAIM_CLASSES: dict[str, type[_Claim]] = {
    "token_importance": TokenImportanceClaim,
    "specific_tokens": SpecificTokensClaim,
    "head_role": HeadRoleClaim,
    "faithfulness": FaithfulnessClaim,
    "counterfactual": CounterfactualClaim,
    "sink_head": SinkHeadClaim,
    "edge": EdgeClaim,
}
CLAIM_KINDS = tuple(CLAIM_CLASSES)
Claim = (TokenImportanceClaim | SpecificTokensClaim | HeadRoleClaim | FaithfulnessClaim | CounterfactualClaim
         | SinkHeadClaim | EdgeClaim)


# ------------------------------------------------------------------------------------ the file


class AuditStatistics(SpecModel):
    """The audit's statistics: bootstrap intervals and the seed of every random draw."""

    #: bootstrap resamples per confidence interval
    bootstrap: Annotated[Int, Field(ge=100, le=1_000_000)] = 2000
    #: the confidence level of the intervals
    level: Annotated[Float, Field(gt=0.5, lt=1)] = 0.95
    #: the seed of the bootstrap and the random draws
    seed: Int = 0


class _FileSchema(SpecModel):
    """The claim file's top level; each entry of ``claims`` is validated by its kind afterwards."""

    model: ModelSpec
    data: DataSpec
    target: TargetConfig = Field(default_factory=TargetConfig)
    statistics: AuditStatistics = Field(default_factory=AuditStatistics)
    #: spans instead of tokens as the units ranking claims compare (token_importance, faithfulness)
    spans: SpansSpec | None = None
    #: the report folder (default: results/audit_NAME); probe audit --out wins
    output: str | None = None
    #: a few sentences shown in the audit
    description: str = ""
    #: the claims tested: each has claim:, kind: and the keys of its kind
    claims: list[Any]

    @field_validator("claims")
    @classmethod
    def _some(cls, value: list[Any]) -> list[Any]:
        if not value:
            fail("is empty; list at least one claim (claim:, kind:, ...)")
        return value


@dataclass(frozen=True)
class ClaimFile:
    """A validated claim file. ``lines`` maps ``(claim index, key)`` to its line in the file
    (``(i, None)``: the claim's first line), so run-time errors can point at the file too."""

    model: ModelSpec
    data: DataSpec
    target: TargetConfig
    statistics: AuditStatistics
    claims: tuple[Claim, ...]
    output: str | None = None
    description: str = ""
    source: str = "<dict>"
    spans: SpansSpec | None = None
    lines: dict = field(default_factory=dict, compare=False, repr=False)

    def where(self, index: int, key: str | None = None) -> str:
        """``"FILE line N: claims[i].key"`` for messages about a claim."""
        line = self.lines.get((index, key)) or self.lines.get((index, None))
        at = f"{self.source} line {line}" if line is not None else self.source
        return f"{at}: claims[{index}]" + (f".{key}" if key else "")

    def to_dict(self) -> dict:
        return {"model": self.model.model_dump(mode="json"), "data": self.data.model_dump(mode="json"),
                "target": self.target.model_dump(mode="json"), "statistics": self.statistics.model_dump(mode="json"),
                "output": self.output, "description": self.description,
                **({"spans": self.spans.model_dump(mode="json")} if self.spans is not None else {}),
                "claims": [c.model_dump(mode="json") for c in self.claims]}


# ------------------------------------------------------------------------------------ loading


def _document(schema: type[SpecModel]) -> SpecFile:
    """The claim file (or one claim of it, ``schema`` then the claim's kind) as error messages name it."""
    return SpecFile(schema=schema, top="the claim file", the_top="the claim file")


def load_claims(path: str | Path) -> ClaimFile:
    """Read and validate a claim file (YAML); every problem is one InputError line with the line number."""
    path = Path(path)
    data, root = _read_yaml(path)
    _raw_heads(data, root)
    return _validate(data, source=str(path), root=root, base_dir=path.parent)


def claims_from_dict(data: dict, *, source: str = "<dict>") -> ClaimFile:
    """Validate a dict (e.g. parsed YAML, or ``ClaimFile.to_dict()``) into a :class:`ClaimFile`."""
    return _validate(data, source=source, root=None, base_dir=None)


def _read_yaml(path: Path) -> tuple[Any, yaml.Node]:
    return read_yaml_mapping(path, "claim file", "claim file", "write a claim file with model:, data: and claims:",
                             "model:, data:, claims:")


def _raw_heads(data: dict, root: yaml.Node) -> None:
    """``head: 5.10`` is the float 5.1 to YAML; keep a head's text exactly as written."""
    claims = data.get("claims")
    if not isinstance(claims, list):
        return
    for i, entry in enumerate(claims):
        if isinstance(entry, dict) and isinstance(entry.get("head"), (float, int)) and not isinstance(entry["head"], bool):
            node, _, found = walk(root, ("claims", i, "head"))
            if found and isinstance(node, yaml.ScalarNode):
                entry["head"] = node.value


def _validate(data: Any, *, source: str, root: yaml.Node | None, base_dir: Path | None) -> ClaimFile:
    if not isinstance(data, dict):
        raise InputError(f"{source}: the claim file is {show(data)}, not a mapping of keys (model, data, claims)")
    try:
        top = _FileSchema.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise located_error(exc, _document(_FileSchema), source, root) from None
    claims = []
    for i, entry in enumerate(top.claims):
        at = ("claims", i)
        if not isinstance(entry, dict):
            raise _located(f"claims[{i}]: {show(entry)} is not a mapping; write claim:, kind: and the kind's fields",
                           at, source, root)
        kind = entry.get("kind")
        if "kind" not in entry:
            raise _located(f"claims[{i}]: missing required key 'kind'; add kind: (one of {', '.join(CLAIM_KINDS)})",
                           at, source, root)
        if kind not in CLAIM_CLASSES:
            raise _located(f"claims[{i}].kind: unknown claim kind {show(kind)} (valid: {', '.join(CLAIM_KINDS)})"
                           f"{suggest(kind, CLAIM_KINDS)}", at + ("kind",), source, root)
        model = CLAIM_CLASSES[kind]
        try:
            claims.append(model.model_validate(entry))
        except ValidationError as exc:
            raise located_error(exc, _document(model), source, root, prefix=at) from None
    lines: dict = {}
    if root is not None:
        for i, claim in enumerate(claims):
            node, _, found = walk(root, ("claims", i))
            if found:
                lines[(i, None)] = node.start_mark.line + 1
            for key in type(claim).model_fields:
                node, key_node, found = walk(root, ("claims", i, key))
                if found and key_node is not None:
                    lines[(i, key)] = key_node.start_mark.line + 1
    return ClaimFile(model=top.model, data=top.data, target=top.target, statistics=top.statistics,
                     claims=tuple(claims), output=top.output, description=top.description, source=source, lines=lines,
                     spans=top.spans)


def _located(message: str, at: tuple, source: str, root: yaml.Node | None) -> InputError:
    line = line_of(root, at)
    return InputError(f"{source} line {line}: {message}" if line is not None else f"{source}: {message}")
