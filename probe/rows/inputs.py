"""What a function of :mod:`probe.api` is handed, checked before it runs: its keywords bound (an
unknown one refused in one line) and the target keywords folded into one target
(:func:`arguments_checked`), its model (:func:`probe_model`, run in eval mode by :func:`in_eval`),
its texts as a list (:func:`text_list`) and examples another model prepared refused
(:func:`check_prepared_by`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import pandas as pd
import torch

from probe.errors import InputError
from probe.models.core import ProbeModel
from probe.rows.target import TARGET_KEYWORDS

if TYPE_CHECKING:
    from probe.rows.target import PreparedExample

#: a function of :mod:`probe.api` that a decorator here wraps, its signature kept
_F = TypeVar("_F", bound=Callable[..., Any])


def probe_model(pm: Any, argument: str = "pm") -> ProbeModel:
    """``pm`` as a :class:`~probe.models.core.ProbeModel`, or a one-line error naming the argument and the fix."""
    if isinstance(pm, ProbeModel):
        return pm
    if isinstance(pm, (str, Path)):
        raise InputError(f"{argument} is the name {str(pm)!r}, not a loaded model: load it first, "
                         f"pm = probe.load_model({str(pm)!r})")
    if is_pipeline(pm):
        raise InputError(f"{argument} is a transformers pipeline, not a ProbeModel: wrap it first, "
                         f"pm = probe.wrap(pipeline)")
    if isinstance(pm, torch.nn.Module):
        raise InputError(f"{argument} is a {type(pm).__name__} (a model in memory), not a ProbeModel: wrap it with "
                         f"its tokenizer first, pm = probe.wrap(model, tokenizer)")
    raise InputError(f"{argument} must be a ProbeModel from probe.load_model or probe.wrap, got {type(pm).__name__}")


def is_pipeline(value: Any) -> bool:
    """Whether ``value`` is a transformers Pipeline (checked only where transformers is imported already)."""
    pipelines = sys.modules.get("transformers.pipelines.base")
    return pipelines is not None and isinstance(value, pipelines.Pipeline)


def unknown_keywords(options: Mapping[str, Any], accepted: Sequence[str], doing: str) -> None:
    """Refuse, in one line, keyword arguments ``doing`` does not take, naming the first and the accepted ones."""
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise InputError(f"{doing} got an unknown keyword {unknown[0]!r}; it accepts: {', '.join(accepted)}")


@overload
def arguments_checked(function: _F, /, *, passed_on: Sequence[str] = ()) -> _F: ...


@overload
def arguments_checked(function: None = None, /, *, passed_on: Sequence[str] = ()) -> Callable[[_F], _F]: ...


def arguments_checked(function: _F | None = None, /, *, passed_on: Sequence[str] = ()) -> _F | Callable[[_F], _F]:
    """A decorator: ``function`` with its arguments bound before it runs: an unknown keyword, a missing
    argument or too many positional ones is one :class:`~probe.errors.InputError` line (naming the
    accepted keywords), not Python's TypeError. ``@arguments_checked`` or, for a function whose
    ``**options`` pass some keywords on (it checks those itself), ``@arguments_checked(passed_on=...)``.

    A function that declares the target keywords (``**keywords: Unpack[TargetKeywords]``) accepts
    them by name (:class:`~probe.rows.target.TargetKeywords`); it folds them into its ``target``
    itself, with :func:`~probe.rows.target.target_from`."""
    if function is None:
        return lambda f: arguments_checked(f, passed_on=passed_on)
    import functools
    import inspect

    signature = inspect.signature(function)
    parameters = signature.parameters
    targeted = "target" in parameters
    named = [k for k in TARGET_KEYWORDS if k not in passed_on] if targeted else []
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD and n != "keywords" for n, p in parameters.items())
    accepted = [n for n, p in parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)] + named
    doing = f"probe.{function.__name__}()"

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not passes_on:
            unknown_keywords(kwargs, accepted, doing)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise InputError(f"{doing}: {err}; its parameters: {', '.join(accepted)}") from None
        return function(*args, **kwargs)

    return cast(_F, wrapper)


def in_eval(function: _F) -> _F:
    """Run an API function with its model in eval mode (dropout off for every pass, the targets'
    included); the model's mode is restored afterwards."""
    import functools

    @functools.wraps(function)
    def wrapper(pm: Any, *args: Any, **kwargs: Any) -> Any:
        from probe.rows.queries import eval_mode

        pm = probe_model(pm)
        with eval_mode(pm.model):
            return function(pm, *args, **kwargs)

    return cast(_F, wrapper)



def text_list(texts: Any, *, chat: bool = False) -> list:
    """``texts`` as a non-empty list; with ``chat``, a list of messages is one conversation."""
    if texts is None:
        raise InputError("texts is None: give a string or a non-empty list of strings")
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, pd.DataFrame):
        # iterating a DataFrame gives its column names, never its rows
        if "text" not in texts.columns:
            columns = ", ".join(repr(c) for c in texts.columns) or "none"
            raise InputError(f"texts is a DataFrame without a 'text' column (its columns: {columns}): pass the "
                             "column of texts, e.g. texts=df['review']")
        texts = texts["text"]
    if isinstance(texts, pd.Series):
        texts = texts.tolist()
    if not isinstance(texts, Iterable) or isinstance(texts, (bytes, bytearray, Mapping)):
        raise InputError(f"texts={texts!r} is not a string or a list of strings; write e.g. texts=['a gripping film']")
    items = list(texts)
    if not items:
        raise InputError("no text given: give a string or a non-empty list of strings")
    if chat and isinstance(items[0], Mapping):  # one conversation: a list of messages
        return [items]
    return items


def check_prepared_by(pm: ProbeModel, examples: list[PreparedExample]) -> None:
    """Refuse examples that another model's tokenizer prepared: their ids and tokens must be this one's."""
    rows = getattr(pm.model.get_input_embeddings(), "num_embeddings", None)
    for i, e in enumerate(examples):
        too_big = isinstance(rows, int) and any(t >= rows for t in e.input_ids)
        if too_big or list(pm.tokenizer.convert_ids_to_tokens(list(e.input_ids))) != list(e.tokens):
            raise InputError(f"example #{i} was prepared by another model's tokenizer (its token ids are not "
                             f"{pm.name}'s): prepare the texts with probe.prepare(pm, texts) for this model")
