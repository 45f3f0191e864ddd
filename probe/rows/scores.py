"""TokenScores: every method's output, aligned on the explained tokens of each example."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import pandas as pd
import torch

#: the columns of :meth:`TokenScores.to_pandas`
SCORE_COLUMNS = ("example", "layer", "head", "position", "score")


@dataclass(frozen=True, repr=False)
class TokenScores:
    """One method's scores for a list of examples; frozen (a changed result is a new TokenScores).

    scores[i] is a float tensor over example i's explained tokens: ``[tokens]`` for token-level
    methods, ``[layer, head, tokens]`` for per-head ones (``per_head=True``), ``[layer, tokens]``
    for per-layer ones (``per_layer=True``); :attr:`axes` names them. Higher means more important;
    interventions store the signed change f(x) - f(x perturbed). ``extras`` holds method
    diagnostics (e.g. IG's convergence delta per example). ``scores`` is kept as a tuple of cpu
    fp32 tensors, ``params`` and ``extras`` as read-only mappings.
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
        text = f"<TokenScores {self.method}: {n} example{'s' if n != 1 else ''}, [{', '.join(self.axes)}] ({shapes})"
        return clip(text + (f", {params}" if params else ""), 280) + ">"

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
        values = self.scores[index].double().numpy()
        if values.ndim == 3:  # [layer, head, tokens]
            n_layers, n_heads, _ = values.shape
            layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
            return values.reshape(n_layers * n_heads, -1), layer, head
        if values.ndim == 2:  # [layer, tokens]
            return values, np.arange(values.shape[0]), np.full(values.shape[0], -1)
        return values[None], np.array([-1]), np.array([-1])  # [tokens]

    def to_pandas(self) -> pd.DataFrame:
        """One row per (example, layer, head, token): columns ``example`` (index into the examples),
        ``layer``, ``head`` (-1 where the method has none), ``position``, ``score`` (float64; NaN
        where the method does not score the token). Ordered by example, unit, position."""
        frames = []
        for i in range(len(self.scores)):
            values, layer, head = self.unit_rows(i)
            n_units, n_tokens = values.shape
            frames.append(pd.DataFrame({
                "example": i, "layer": np.repeat(layer, n_tokens), "head": np.repeat(head, n_tokens),
                "position": np.tile(np.arange(n_tokens), n_units), "score": values.ravel()}))
        if not frames:
            return pd.DataFrame(columns=list(SCORE_COLUMNS))
        frame = pd.concat(frames, ignore_index=True)
        return frame.astype({"example": "int64", "layer": "int64", "head": "int64", "position": "int64"})
