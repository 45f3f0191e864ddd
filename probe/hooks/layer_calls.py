"""What the sparse-layout readers (:mod:`.banded`, :mod:`.blocksparse`, :mod:`.local_global`) share:
hooks on a model's watched layers that hand each call of a layer on to ``handle``, the length and
mask of the input the model's forward was given, and for a layer that returns its map only when
``output_attentions`` is asked, the asking (the caller still gets what it asked for). Each
reader adds how it reads one call; :meth:`LayerCallReader.close` removes exactly these hooks."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["LayerCallReader"]


class LayerCallReader:
    """Hooks that read the watched layers (``modules``) of ``model`` while it runs, handing each call
    to ``handle(module, call)``. By default each watched layer is asked for its map on entry
    (:meth:`_ask`) and read on exit (:meth:`_read`, the subclass's); ``reads_input``: the model's
    forward is watched too, for the input's ``length`` and 2-D ``mask``."""

    reads_input = False

    def __init__(self, model: torch.nn.Module, modules: Mapping[str, torch.nn.Module],
                 handle: Callable[[torch.nn.Module, Any], None]):
        self.handle = handle
        self.length: int | None = None
        self.mask: torch.Tensor | None = None
        self._asked: list[bool] = []  # per open call: whether its caller asked for output_attentions
        self._handles: list = []
        try:
            self._prepare(model)
            if self.reads_input:
                self._handles.append(model.register_forward_pre_hook(self._read_input, with_kwargs=True))
            for module in modules.values():
                self._watch(module)
        except BaseException:
            self.close()
            raise

    def _prepare(self, model: torch.nn.Module) -> None:
        """What a reader sets up on the model before its hooks (nothing here); undone by :meth:`close`."""

    def _watch(self, module: torch.nn.Module) -> None:
        """Hook one watched layer: asked on entry, read on exit."""
        self._handles.append(module.register_forward_pre_hook(self._ask, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._read, with_kwargs=True))

    def _read_input(self, module, args, kwargs) -> None:
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        self.length, self.mask = None, None
        for name in ("input_ids", "inputs_embeds"):
            value = bound.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                self.length = int(value.shape[1])
                break
        mask = bound.get("attention_mask")
        self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _ask(self, module, args, kwargs):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        self._asked.append(bool(bound.arguments.get("output_attentions", False)))
        bound.arguments["output_attentions"] = True
        return bound.args, bound.kwargs

    def _was_asked(self) -> bool:
        """Whether the caller of the call now ending asked for the map itself (then it gets the
        layer's whole output; else the output without the map, as it would have been)."""
        return self._asked.pop() if self._asked else True

    def _read(self, module, args, kwargs, output):
        raise NotImplementedError

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._asked.clear()
