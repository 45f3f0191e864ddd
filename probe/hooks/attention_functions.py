"""The one piece of process-global state the capture keeps: probe's wrapper in transformers'
attention-function registry (``ALL_ATTENTION_FUNCTIONS``), installed while a session is open.

Modules of transformers 5 fetch their attention function from that registry on every call, by the
name of the implementation the model was loaded with. :func:`open_session` puts a wrapper under
that name in the registry's local mapping, for as long as any session is open; the wrapper hands
each call to the newest session that knows the calling module (``session.where.get(id(module))``
-> ``session.call(place, original, module, ...)``), and every other call straight to the model's
own function. A session is a :class:`probe.hooks.capture._Session` or the watched forward pass
of :mod:`probe.hooks.sites`. Only this module touches transformers' private
``_local_mapping`` / ``_global_mapping``: expect a transformers upgrade to hit it first.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from probe.hooks import math as amath

if TYPE_CHECKING:
    from transformers.modeling_utils import AttentionInterface

_MISSING = object()
_LOCK = threading.RLock()
#: open sessions, newest last: each has ``where`` (a module id -> its place, ``.get``) and ``call``
_SESSIONS: list = []
#: (id of a registry, implementation name) -> what that registry's local mapping held before us
_SAVED: dict[tuple[int, str], object] = {}
_HELD: dict[int, AttentionInterface] = {}  # id -> a registry probe has installed into (kept alive while installed)


def _registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


_FOUND: list = [-1, []]  # [len(sys.modules) when last scanned, the registries found then]


def _registries() -> list:
    """transformers' registry and every other registry instance a loaded modeling file made for
    itself (doge's ``ALL_ATTENTION_FUNCTIONS = AttentionInterface()``): each has its own local
    mapping, so the wrapper goes into each. Rescanned only when a module was imported since (a
    scan of ``sys.modules`` costs about a millisecond, and every capture session opens here)."""
    if _FOUND[0] == len(sys.modules):
        return _FOUND[1]
    found = [_registry()]
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or ".modeling_" not in name:
            continue
        other = vars(module).get("ALL_ATTENTION_FUNCTIONS") if hasattr(module, "__dict__") else None
        if other is not None and hasattr(other, "_local_mapping") and all(other is not r for r in found):
            found.append(other)
    _FOUND[:] = [len(sys.modules), found]
    return found


def _registry_of(module):
    """The registry the module's own modeling file fetches its attention function from."""
    own = vars(sys.modules.get(type(module).__module__, sys)).get("ALL_ATTENTION_FUNCTIONS")
    return own if own is not None and hasattr(own, "_local_mapping") else _registry()


def _generic_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scores = amath.attention_scores(query, key, scaling=scaling, position_bias=kwargs.get("position_bias"))
    if attention_mask is not None:
        scores = scores + attention_mask.float() if attention_mask.dtype != torch.bool else scores.masked_fill(
            ~attention_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    return amath.attention_output(weights, value), weights


class _Places(Protocol):
    def get(self, key: int, /) -> object: ...


class AttentionSession(Protocol):
    """What the wrapper asks of an open session (:class:`probe.hooks.capture._Session`, or the watched
    pass's stand-in in :mod:`probe.hooks.sites`): ``where.get(id(module))``, the place of a module it
    serves (None for the others), and ``call``, which runs one call of the attention function for it."""

    @property
    def where(self) -> _Places: ...

    def call(self, place: Any, original: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
             **kwargs: Any) -> Any: ...


def original_attention_function(name: str, module: torch.nn.Module) -> Callable:
    """The function the module would have used had no capture been open."""
    saved = _SAVED.get((id(_registry_of(module)), name), _MISSING)
    if saved is not _MISSING:
        return cast("Callable", saved)  # what a registry's local mapping held: an attention function
    if name == "eager":
        # Every transformers 5 modeling file defines its own eager function; use that one.
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward", _generic_eager)
    return type(_registry())._global_mapping[name]


def _make_wrapper(name: str) -> Callable:
    def probe_attention(module, query, key, value, attention_mask, *args, **kwargs):
        original = original_attention_function(name, module)
        for session in reversed(_SESSIONS):
            place = session.where.get(id(module))
            if place is not None:
                return session.call(place, original, module, query, key, value, attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    probe_attention.__probe_wrapper__ = True  # type: ignore[attr-defined]  # functions take attributes at run time
    return probe_attention


def _install(name: str) -> None:
    for registry in _registries():
        current = registry._local_mapping.get(name, _MISSING)
        if getattr(current, "__probe_wrapper__", False):
            continue
        _SAVED[(id(registry), name)] = current
        _HELD[id(registry)] = registry
        registry._local_mapping[name] = _make_wrapper(name)


def _uninstall_all() -> None:
    for (key, name), previous in list(_SAVED.items()):
        registry = _HELD[key]
        if previous is _MISSING:
            registry._local_mapping.pop(name, None)
        else:
            registry._local_mapping[name] = previous
        del _SAVED[(key, name)]
    _HELD.clear()


def installed_wrappers() -> list[str]:
    """Names under which a probe wrapper sits in a registry now (empty when no capture is open)."""
    return sorted({k for registry in _registries() for k, v in registry._local_mapping.items()
                   if getattr(v, "__probe_wrapper__", False)})


def implementation_of(model: torch.nn.Module) -> str:
    """The registry name of the attention implementation ``model`` runs (``eager`` when unset)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


@contextmanager
def open_session(session: AttentionSession, implementation: str) -> Iterator[None]:
    """The wrapper installed under ``implementation`` and ``session`` served by it, for the block;
    removed again in ``finally`` (the wrapper itself once no session is left)."""
    with _LOCK:
        _install(implementation)
        _SESSIONS.append(session)
    try:
        yield
    finally:
        with _LOCK:
            _SESSIONS.remove(session)
            if not _SESSIONS:
                _uninstall_all()


def sink_logits(kwargs: dict) -> torch.Tensor | None:
    """The attention-sink logits a model hands its attention function (``s_aux`` or ``sinks``:
    gpt-oss and kin), or None."""
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    return sinks if isinstance(sinks, torch.Tensor) else None
