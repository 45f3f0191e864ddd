"""TokenScores: every method's output, aligned on the explained tokens of each example."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenScores:
    """One method's scores for a list of examples.

    scores[i] is a float tensor over example i's explained tokens: ``[tokens]`` for token-level
    methods, ``[layer, head, tokens]`` for per-head ones (``per_head=True``), ``[layer, tokens]``
    for per-layer ones (``per_layer=True``). Higher means more important; interventions store the
    signed change f(x) - f(x perturbed). ``extras`` holds method diagnostics (e.g. IG's
    convergence delta per example).
    """

    method: str
    scores: list[torch.Tensor]
    params: dict = field(default_factory=dict)
    per_head: bool = False
    per_layer: bool = False
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        self.scores = [s.detach().float().cpu() for s in self.scores]

    def for_example(self, index: int) -> torch.Tensor:
        return self.scores[index]
