"""The target, declared once: every field of what is explained, which readers take it, what it means
and the check of its value.

Four readers take a target, each in its own form: the Python keywords of ``probe.explain`` and its
siblings (:class:`~probe.rows.target.TargetKeywords`), the :class:`~probe.rows.target.TargetSpec`
they fold into, ``probe explain``'s options (:data:`probe.cli.options.TARGET_OPTIONS`) and a study or
claim file's ``target:`` section (:class:`~probe.spec.parts.TargetConfig`). :data:`TARGET_FIELDS` is
the one list; from it come the keywords' names and which take one value per text, the command
line's options (flag, type, help), and the checks a keyword or a TargetSpec field's value gets. The
typed declarations a type checker reads (the TypedDict, the dataclass, the pydantic section) stay
written out, and ``tests/test_api.py`` fails where one of them drifts from this table.

Torch-free: the study file's schema and the command line read it before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probe.errors import InputError, check_flag, positive_int

__all__ = ["TARGET_FIELDS", "TARGET_KINDS", "TargetField", "field_named"]

#: every target kind; which a model takes is its task's (:attr:`probe.tasks.Task.kinds`)
TARGET_KINDS = ("prob", "logit", "logprob", "similarity", "dimension")


def _text(what: str) -> Callable[[Any, str], object]:
    def check(value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise InputError(f"{name}={value!r} is not text; give {what}")
        return value

    return check


def _component(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name}={value!r}: give a component index >= 0 of the pooled embedding")
    return value


@dataclass(frozen=True)
class TargetField:
    """One field of the target.

    ``keyword``: a Python target keyword (and so a field of :class:`~probe.rows.target.TargetSpec`,
    but ``generate``, which sets ``steps`` and ``max_new_tokens``); ``spec``: a TargetSpec field that
    is no keyword (``max_new_tokens``); ``study``: a key of a file's ``target:`` section;
    ``per_text``: a keyword that takes one value for every text or a list with one per text.
    ``option``: ``probe explain``'s flag (None: no option), with its parameter name
    (``option_param``, default the field's), Python type, help and place in ``--help``
    (``option_rank``). ``check(value, name)``: raises the one-line :class:`~probe.errors.InputError`
    of a wrong value (a field whose default is None is not checked when None)."""

    name: str
    keyword: bool = True
    spec: bool = False
    study: bool = True
    per_text: bool = False
    option: str | None = None
    option_param: str | None = None
    option_type: Any = None
    help: str = ""
    option_rank: int = 0
    check: Callable[[Any, str], object] | None = None
    nullable: bool = True

    @property
    def spec_field(self) -> bool:
        """Whether :class:`~probe.rows.target.TargetSpec` has a field of this name."""
        return self.spec or (self.keyword and self.name != "generate")

    def check_value(self, value: Any) -> None:
        """Refuse a wrong ``value`` for this field in one line (:class:`~probe.errors.InputError`)."""
        if self.check is not None and not (value is None and self.nullable):
            self.check(value, self.name)


#: every field of the target, the Python keywords first in the order the functions list them
TARGET_FIELDS: tuple[TargetField, ...] = (
    TargetField("label", per_text=True, option="--label", option_type=str | None, option_rank=0,
                help="classifier label (index or name) to explain; default the predicted one"),
    TargetField("continuation", per_text=True, option="--continuation", option_type=str | None, option_rank=1,
                help="for a language model, the output text whose log-prob is explained"),
    TargetField("kind", option="--target", option_param="target_kind", option_type=str | None, option_rank=7,
                help="prob, logit or logprob (default prob for classifiers, logprob for LMs); similarity or dimension "
                     "for a headless encoder",
                check=_text(f"one of {', '.join(TARGET_KINDS)}")),
    TargetField("generate", option="--generate", option_type=int | None, option_rank=2,
                help="for a language model, explain each token of its greedy output of up to N tokens (or of "
                     "--continuation) on its own: a \\[prompt token x output token] table per method",  # \\[: rich
                check=positive_int),
    TargetField("steps", check=check_flag, nullable=False),
    TargetField("chat", study=False, option="--chat", option_type=bool, option_rank=4,
                help="a chat model: TEXT is the user's message in the tokenizer's chat template (the template's "
                     "tokens are not scored; control-token text in TEXT is read as plain text)",
                check=check_flag, nullable=False),
    TargetField("contrast", per_text=True, option="--contrast", option_type=str | None, option_rank=5,
                help="for a language model, a foil text: explain the log-prob of the continuation minus the foil's "
                     "at the same positions (as many tokens, or one)"),
    TargetField("contrast_label", per_text=True, option="--contrast-label", option_type=str | None, option_rank=6,
                help="for a classifier, a label (index or name): explain logit\\[label] - logit\\[contrast label]"),
    TargetField("target_side", option="--target-side", option_type=bool, option_rank=3,
                help="with --generate (causal LMs): score the output written before each output token too, as "
                     "part of its input",
                check=check_flag, nullable=False),
    TargetField("reference", option="--reference", option_type=str | None, option_rank=8,
                help="--target similarity: the text whose pooled embedding the input's is compared with (cosine)",
                check=_text("the text whose pooled embedding is compared")),
    TargetField("dimension", option="--dimension", option_type=int | None, option_rank=9,
                help="--target dimension: which component of the pooled embedding", check=_component),
    TargetField("max_new_tokens", keyword=False, spec=True, study=False, check=positive_int),
    TargetField("prompt", keyword=False),
    TargetField("choices", keyword=False),
)


def field_named(name: str) -> TargetField:
    """The field ``name`` of :data:`TARGET_FIELDS`."""
    return next(f for f in TARGET_FIELDS if f.name == name)
