"""Frozen results that pickle: read-only mappings (``MappingProxyType``) cannot be pickled or
deep-copied, so the frozen dataclasses that hold them (TokenScores, Explanation, Verdict) pickle
their fields with each such mapping as a plain dict marked :class:`_ReadOnly`, and read them back
as read-only mappings again. Standard library only: a torch-free module may use it."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any


class _ReadOnly(dict):
    """A read-only mapping's items while pickled."""


def thaw(value: Any) -> Any:
    """``value`` with every read-only mapping in it (inside dicts, lists and tuples) a :class:`_ReadOnly` dict."""
    if isinstance(value, MappingProxyType):
        return _ReadOnly({key: thaw(item) for key, item in value.items()})
    if type(value) is dict:
        return {key: thaw(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(thaw(item) for item in value)
    return value


def freeze(value: Any) -> Any:
    """The inverse of :func:`thaw`: each :class:`_ReadOnly` dict a read-only mapping again."""
    if isinstance(value, _ReadOnly):
        return MappingProxyType({key: freeze(item) for key, item in value.items()})
    if type(value) is dict:
        return {key: freeze(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(freeze(item) for item in value)
    return value


class PicklableFrozen:
    """Mixin for a frozen dataclass with read-only mappings among its fields: pickle and
    ``copy.deepcopy`` see its fields thawed, and it is rebuilt with them frozen again, equal to
    the original."""

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, freeze(value))
