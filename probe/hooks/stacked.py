"""One tensor per stack that the capture writes each layer's maps into as the layer runs.

Capturing every row of every layer used to hold the maps twice at the end: once per layer, as the
layers ran, and once more in the ``[batch, layer, head, query, key]`` tensor that
:meth:`probe.hooks.capture.Capture.maps` stacked them into (a 4-layer, 8-head Llama at 8,192 tokens
peaked at 16 GiB for 8 GiB of maps). Here the first layer of a forward allocates the stacked tensor
of the layers the capture records, each layer's maps are copied into their slot and the session's
record of the layer is a view of that slot, so the stacked tensor is the only copy: ``maps()``
hands it out as it is.

A tensor that has been handed out (``lend``) is never written again: the next forward's first
layer starts a new one, so maps read after one forward are not changed by the next. A layer whose
maps do not fit the slot (another batch or key length, a dtype the first layer did not have, a
stack whose layers differ in heads) is kept as it came, and ``maps()`` stacks as before. Maps
that keep their autograd graph (``keep_grad``) are never copied here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Stacked:
    """The stacked maps of one stack and which of its slots hold this forward's layers."""

    weights: torch.Tensor  # [batch, layer, head, rows, key]
    layers: tuple[int, ...]  # the layer of each slot, ascending
    filled: set[int] = field(default_factory=set)
    lent: bool = False


class LayerStacks:
    """The stacked maps of each stack a capture records (see the module docstring)."""

    def __init__(self, slots: dict[str, tuple[int, ...]]) -> None:
        #: per stack, the layers its stacked tensor has slots for; a stack not named is never stacked here
        self.slots = dict(slots)
        self._stacked: dict[str, _Stacked] = {}

    def put(self, stack: str, layer: int, picked: torch.Tensor, home: torch.device) -> torch.Tensor:
        """``picked`` [batch, head, rows, key] written into its layer's slot on ``home``: returns that
        slot (a view of the stack's tensor), or ``picked`` moved to ``home`` where it has no slot."""
        layers = self.slots.get(stack)
        if layers is None or layer not in layers or picked.requires_grad:
            self.forget(stack, layer)
            return picked.to(home)
        current = self._stacked.get(stack)
        shape = (picked.shape[0], len(layers), *picked.shape[1:])
        fits = (current is not None and not current.lent and tuple(current.weights.shape) == shape
                and current.weights.dtype == picked.dtype)
        if not fits and layer == layers[0]:  # a forward begins: its own tensor
            current = _Stacked(torch.empty(shape, dtype=picked.dtype, device=home), layers)
            self._stacked[stack] = current
            fits = True
        if not fits or current is None:
            self.forget(stack, layer)
            return picked.to(home)
        slot = current.weights[:, layers.index(layer)]
        slot.copy_(picked)
        current.filled.add(layer)
        return slot

    def forget(self, stack: str, layer: int) -> None:
        """The layer's record is no longer in the stack's tensor."""
        current = self._stacked.get(stack)
        if current is not None:
            current.filled.discard(layer)

    def stacked(self, stack: str, layers: tuple[int, ...]) -> torch.Tensor | None:
        """[batch, layer, head, rows, key] of ``layers`` when every one of them is in the stack's
        tensor (the tensor itself when they are all its slots, no copy), else None. Either way the
        tensor counts as handed out from now on."""
        current = self._stacked.get(stack)
        if current is None:
            return None
        current.lent = True
        if not set(layers) <= current.filled:
            return None
        if layers == current.layers:
            return current.weights
        index = torch.tensor([current.layers.index(layer) for layer in layers], device=current.weights.device)
        return current.weights.index_select(1, index)

    def lend(self, stack: str) -> None:
        """Views of the stack's tensor were handed out (a layer's maps): never write it again."""
        current = self._stacked.get(stack)
        if current is not None:
            current.lent = True

    def clear(self) -> None:
        self._stacked.clear()


def stack_slots(contract: Any, stacks: tuple[str, ...],
                wants: Callable[[str, int], bool]) -> dict[str, tuple[int, ...]]:
    """The layers each of ``stacks`` records (``wants``), for a stack whose layers' maps share one
    shape: the same query heads in every layer and one kind of map (not a hybrid)."""
    out = {}
    for stack in stacks:
        info = contract.stacks.get(stack)
        if info is None or len(set(info.layer_heads)) > 1 or len(set(info.layer_maps)) > 1:
            continue
        out[stack] = tuple(sorted(layer for (s, layer) in contract.module_paths if s == stack and wants(s, layer)))
    return out
