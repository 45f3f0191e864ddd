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

Each entry of ``claims`` is validated by its kind's spec (:data:`probe.claims.kinds.KINDS`: each kind's
module holds its keys, its rule and what it measures; the values the keys hold are parsed and checked in
:mod:`probe.spec.claim_values`); the ``data`` section is :class:`~probe.spec.parts.DataSpec`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from probe.claims.kinds import CLAIM_KINDS, KINDS
from probe.claims.spec import AuditStatistics, ClaimFile
from probe.errors import InputError
from probe.spec.parts import DataSpec, ModelSpec, SpansSpec, TargetConfig
from probe.spec.validation import (
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

__all__ = ["AuditStatistics", "ClaimFile", "claims_from_dict", "load_claims"]


# ------------------------------------------------------------------------------------ the file


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
    """Validate a dict (e.g. parsed YAML, or ``ClaimFile.to_dict()``) into a :class:`~probe.claims.spec.ClaimFile`."""
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
        head = entry.get("head") if isinstance(entry, dict) else None
        if isinstance(head, (float, int)) and not isinstance(head, bool):
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
        if kind not in KINDS:
            raise _located(f"claims[{i}].kind: unknown claim kind {show(kind)} (valid: {', '.join(CLAIM_KINDS)})"
                           f"{suggest(kind, CLAIM_KINDS)}", at + ("kind",), source, root)
        model = KINDS[kind].spec
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
