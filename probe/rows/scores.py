"""TokenScores: every method's output, aligned on the explained tokens of each example."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe.frozen import PicklableFrozen

#: the columns of :meth:`TokenScores.to_pandas`
SCORE_COLUMNS = ("example", "layer", "head", "position", "score")


def same_values(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values: tensors of one shape and dtype equal element by
    element (NaN equal to NaN), mappings and sequences item by item, anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point()
                                                 else (a == b)).all()))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind == "f"))
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))



def score_unit_rows(values: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example's scores (``[layer, head, tokens]``, ``[layer, tokens]`` or ``[tokens]``) as rows
    ``[unit, tokens]`` (float64), with the layer and the head of each row (-1: the method has none)."""
    array = values.double().numpy()
    if array.ndim == 3:  # [layer, head, tokens]
        n_layers, n_heads, _ = array.shape
        layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
        return array.reshape(n_layers * n_heads, -1), layer, head
    if array.ndim == 2:  # [layer, tokens]
        return array, np.arange(array.shape[0]), np.full(array.shape[0], -1)
    return array[None], np.array([-1]), np.array([-1])  # [tokens]

@dataclass(frozen=True, repr=False)
class TokenScores(PicklableFrozen):
    """One method's scores for a list of examples; frozen (a changed result is a new TokenScores).

    scores[i] is a float tensor over example i's explained tokens: ``[tokens]`` for token-level
    methods, ``[layer, head, tokens]`` for per-head ones (``per_head=True``), ``[layer, tokens]``
    for per-layer ones (``per_layer=True``); :attr:`axes` names them. Higher means more important;
    interventions store the signed change f(x) - f(x perturbed). ``extras`` holds method
    diagnostics (e.g. IG's convergence delta per example). ``scores`` is kept as a tuple of cpu
    fp32 tensors, ``params`` and ``extras`` as read-only mappings; it pickles.

    NaN marks a token the method does not score: special tokens ([CLS], [SEP], <s>, ...) under the
    interventions (leave-one-out never deletes them) and wherever a method leaves a token out. So
    ``scores[i].argmax()`` or ``topk`` may return a special token (NaN sorts above every number in
    torch); rank with NaN removed, e.g. :meth:`probe.Explanation.top_tokens`.
    """

    method: str
    scores: Sequence[torch.Tensor]
    params: Mapping[str, Any] = field(default_factory=dict)
    per_head: bool = False
    per_layer: bool = False
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "scores", tuple(s.detach().float().cpu() for s in self.scores))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))

    def __repr__(self) -> str:
        import dataclasses

        from probe import registry
        from probe.display import clip, name_list, shape_text

        n = len(self.scores)
        shapes = name_list((shape_text(t.shape) for t in self.scores), limit=3)
        entry = registry.find(self.method)  # its parameters only; params also holds the method's diagnostics
        names = [f.name for f in dataclasses.fields(entry.defaults())] if entry is not None else []
        params = ", ".join(f"{k}={self.params[k]}" for k in names if k in self.params)
        text = f"<TokenScores {self.label}: {n} example{'s' if n != 1 else ''}, [{', '.join(self.axes)}] ({shapes})"
        return clip(text + (f", {params}" if params else ""), 280) + ">"

    def __eq__(self, other: object) -> bool:
        """Equal method, flags, parameters, extras and scores (NaN equal to NaN, same shapes)."""
        if not isinstance(other, TokenScores):
            return NotImplemented
        return (self.method == other.method and self.per_head == other.per_head
                and self.per_layer == other.per_layer and same_values(self.params, other.params)
                and same_values(self.extras, other.extras) and same_values(self.scores, other.scores))

    def row(self, example: int, layer: int = -1, head: int | None = None) -> torch.Tensor:
        """Example ``example``'s ``[tokens]`` scores: a per-layer method's at ``layer`` (-1: the last), a
        per-head one's at ``layer`` and ``head`` (None: the mean over heads, NaN-aware, as the tables and
        plots show it). A layer or head that does not exist is a one-line error naming those that do."""
        from probe.errors import InputError

        values = self.scores[example]
        if self.per_head or self.per_layer:
            n_layers = values.shape[0]
            if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
                raise InputError(f"layer={layer!r} does not exist: {self.method} has layers 0..{n_layers - 1} "
                                 "(-1 is the last)")
            values = values[layer]
        if self.per_head:
            n_heads = values.shape[0]
            if head is None:  # [head, tokens] -> [tokens]: the head mean the table and the plots show
                return torch.nanmean(values.double(), dim=0)
            if isinstance(head, bool) or not isinstance(head, int) or not -n_heads <= head < n_heads:
                raise InputError(f"head={head!r} does not exist: {self.method} has heads 0..{n_heads - 1}")
            values = values[head]
        return values

    @property
    def label(self) -> str:
        """The method's name with the settings that make its numbers differ from captum's or inseq's
        (``probe.registry.labelled``): ``"saliency (L2)"``, ``"integrated_gradients (baseline
        pad, specials replaced)"``; the name alone where there are none. Every view shows it."""
        from probe import registry

        return registry.labelled(self.method, self.params)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axis names of each example's tensor: ``("token",)``, ``("layer", "token")`` or
        ``("layer", "head", "token")``."""
        if self.per_head:
            return ("layer", "head", "token")
        if self.per_layer:
            return ("layer", "token")
        return ("token",)

    def for_example(self, index: int) -> torch.Tensor:
        return self.scores[index]

    def unit_rows(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Example ``index``'s scores as rows ``[unit, tokens]`` (float64), with the layer and the
        head of each row (-1: the method has none): a token-level method has one row."""
        return score_unit_rows(self.scores[index])

    def to_pandas(self) -> pd.DataFrame:
        """One row per (example, layer, head, token): columns ``example`` (index into the examples),
        ``layer``, ``head`` (-1 where the method has none), ``position``, ``score`` (float64; NaN
        where the method does not score the token). Ordered by example, unit, position;
        ``attrs["label"]`` is :attr:`label`."""
        frames = []
        for i in range(len(self.scores)):
            values, layer, head = self.unit_rows(i)
            n_units, n_tokens = values.shape
            frames.append(pd.DataFrame({
                "example": i, "layer": np.repeat(layer, n_tokens), "head": np.repeat(head, n_tokens),
                "position": np.tile(np.arange(n_tokens), n_units), "score": values.ravel()}))
        frame = (pd.concat(frames, ignore_index=True).astype({"example": "int64", "layer": "int64", "head": "int64",
                                                              "position": "int64"})
                 if frames else pd.DataFrame(columns=list(SCORE_COLUMNS)))
        frame.attrs["label"] = self.label
        return frame
