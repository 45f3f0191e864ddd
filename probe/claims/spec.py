"""What a claim file holds once validated: the keys every claim has (each kind's spec adds its own,
:mod:`probe.claims.kinds`), the audit's statistics, and the :class:`ClaimFile` itself. Reading and
validating the YAML is :mod:`probe.claims.file`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, field_validator

from probe.spec.claim_values import check_head, check_reference, check_regex, parse_attention, parse_head
from probe.spec.parts import DataSpec, ModelSpec, SpansSpec, TargetConfig
from probe.spec.validation import Float, Int, SpecModel, fail

__all__ = ["AuditStatistics", "ClaimFile", "ClaimSpec", "HeadClaimSpec"]

# ------------------------------------------------------------------------------------------ a claim


class ClaimSpec(SpecModel):
    """What every claim has; each kind's spec adds its own keys (``kind`` a ``Literal`` of its name)."""

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


class HeadClaimSpec(ClaimSpec):
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


# ------------------------------------------------------------------------------------------ the file


class AuditStatistics(SpecModel):
    """The audit's statistics: bootstrap intervals and the seed of every random draw."""

    #: bootstrap resamples per confidence interval
    bootstrap: Annotated[Int, Field(ge=100, le=1_000_000)] = 2000
    #: the confidence level of the intervals
    level: Annotated[Float, Field(gt=0.5, lt=1)] = 0.95
    #: the seed of the bootstrap and the random draws
    seed: Int = 0


@dataclass(frozen=True)
class ClaimFile:
    """A validated claim file. ``lines`` maps ``(claim index, key)`` to its line in the file
    (``(i, None)``: the claim's first line), so run-time errors can point at the file too."""

    model: ModelSpec
    data: DataSpec
    target: TargetConfig
    statistics: AuditStatistics
    claims: tuple[ClaimSpec, ...]
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
