"""The parameters of every registered method (:mod:`probe.registry`): one frozen dataclass per
implementation, its fields exactly the function's keyword parameters with the same defaults. The
annotations stay strings (``from __future__ import annotations``): :func:`probe.registry.params_problem`
checks study files, claim files and ``probe.explain(params=...)`` against them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "AdversarialParams", "AttentionParams", "AttnGradParams", "AttnNormParams", "DecompositionParams", "FlowParams",
    "GradientParams", "GradientShapParams", "IntegratedGradientsParams", "KnockoutParams", "LeaveOneOutParams",
    "NoSinkParams", "PermutedParams", "ShapleyParams", "UniformParams", "ValueZeroingParams",
]


@dataclass(frozen=True)
class AttentionParams:
    batch_size: int = 16


@dataclass(frozen=True)
class AttnGradParams:
    batch_size: int = 8


@dataclass(frozen=True)
class FlowParams:
    batch_size: int = 8
    max_tokens: int = 64
    query: str = "target"


@dataclass(frozen=True)
class AttnNormParams:
    per_head: bool = True
    batch_size: int = 16


@dataclass(frozen=True)
class DecompositionParams:
    batch_size: int = 8


@dataclass(frozen=True)
class ValueZeroingParams:
    batch_size: int = 8
    token_budget: int = 8192


@dataclass(frozen=True)
class GradientParams:
    site: str | None = None


@dataclass(frozen=True)
class IntegratedGradientsParams:
    baseline: str = "pad"
    steps: int | str = 50
    rule: str = "gausslegendre"
    internal_batch_size: int | str | None = "auto"
    keep_special: bool = False
    site: str | None = None
    tolerance: float = 0.05
    max_steps: int = 512


@dataclass(frozen=True)
class GradientShapParams:
    baseline: str | tuple[str, ...] = "pad"
    n_samples: int = 20
    noise: float = 0.1
    seed: int = 0
    internal_batch_size: int | str | None = "auto"
    keep_special: bool = False
    site: str | None = None


@dataclass(frozen=True)
class LeaveOneOutParams:
    mode: str = "delete"
    k: int = 8
    seed: int = 0


@dataclass(frozen=True)
class ShapleyParams:
    """Shapley values (probe.intervene.shapley): an absent player's tokens deleted or replaced
    (``mode``); players are tokens or words (``units``); exact up to ``exact_max`` players, else
    ``permutations`` sampled orders in antithetic pairs, seeded per example."""
    mode: str = "delete"
    units: str = "token"
    exact_max: int = 10
    permutations: int = 64
    seed: int = 0


@dataclass(frozen=True)
class KnockoutParams:
    """Edge knockout (probe.intervene.knockout.knockout): the edges from the target rows (``query``
    target) or from every row from ``query_from`` on (``query`` from) to a key blocked in the heads
    ``heads`` of the layers ``layers`` (None: all; an int; ``"0,2"``; ``"a:b"`` a slice), the row
    renormalised or not; ``per_head`` adds ``extras["per_head"]`` ``[layer, head, tokens]``. A study
    or claim file may also give a list of ints (``layers: [0, 2]``); a layer may count from the end
    (``-1``, the last)."""
    layers: int | str | tuple[int, ...] | None = dataclasses.field(default=None, metadata={"from_end": True})
    heads: int | str | tuple[int, ...] | None = None
    query: str = "target"
    query_from: int | None = None
    renormalise: bool = True
    per_head: bool = False
    keep_special: bool = False
    batch_size: int = 32


@dataclass(frozen=True)
class NoSinkParams:
    """Raw attention renormalised over non-sink keys (probe.explainers.sinks.attention_nosink): a key
    is a sink of a head where the mean attention it receives over the query rows exceeds ``threshold``."""
    threshold: float = 0.3
    batch_size: int = 8


@dataclass(frozen=True)
class UniformParams:
    head: int | None = None
    batch_size: int = 16


@dataclass(frozen=True)
class PermutedParams:
    head: int | None = None
    n: int = 100
    seed: int = 0
    permute_special: bool = False
    batch_size: int = 64


@dataclass(frozen=True)
class AdversarialParams:
    """Jain & Wallace's adversarial search. These defaults are the only ones: the study spec
    (``adversarial_candidates``, ``adversarial_steps``) and claim files (``candidates``, ``steps``)
    read them; every shipped study sets its own (2 candidates, 50 steps) in its file."""
    head: int | None = None
    candidates: int = 5
    steps: int = 200
    lr: float = 0.01
    bound: float = 0.01
    constraint: str = "tvd"
    penalty: float = 100.0
    init_scale: float = 1.0
    seed: int = 0
    batch_size: int = 8
