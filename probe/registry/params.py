"""The parameters of every registered method (:mod:`probe.registry`): one frozen dataclass per
implementation, its fields exactly the function's keyword parameters with the same defaults. The
annotations stay strings (``from __future__ import annotations``): :func:`probe.registry.params_problem`
checks study files, claim files and ``probe.explain(params=...)`` against them.

A parameter that multiplies work (orders, steps, samples, draws, candidates, batch sizes) declares
its range here (:func:`bounded`), and one that names a choice its choices (:func:`one_of`): the file
check (:func:`probe.registry.params_problem`) and the run-time check (:func:`check_params`, called
by the implementation) both read :func:`limit_problem`, so they cannot disagree. An int without a
declared range takes 0..:data:`MAX_PARAM_INT` (seeds any int)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from probe.errors import InputError

__all__ = [
    "AdversarialParams", "AtpParams", "AttentionParams", "AttnGradParams", "AttnNormParams", "DecompositionParams",
    "EdgeWindow",
    "FlowParams", "GradientParams", "GradientShapParams", "IntegratedGradientsParams", "KnockoutParams",
    "LeaveOneOutParams", "NoSinkParams", "PermutedParams", "ShapleyParams", "UniformParams", "ValueZeroingParams",
    "ADVERSARIAL_CONSTRAINTS", "IG_BASELINES", "IG_RULES", "KNOCKOUT_QUERIES", "MAX_BATCH_SIZE", "MAX_PARAM_INT",
    "SHAPLEY_ESTIMATORS", "SHAPLEY_EXACT_LIMIT", "SHAPLEY_MODES", "SHAPLEY_PERMUTATIONS_LIMIT", "SHAPLEY_ROW_LIMIT",
    "SHAPLEY_UNITS",
    "bounded", "check_params", "declared_limits", "limit_problem", "one_of",
]

#: the largest whole number a parameter without a declared range takes (seeds excepted)
MAX_PARAM_INT = 1_000_000
#: the largest batch any method takes (rows in one forward); more only holds more memory at once
MAX_BATCH_SIZE = 4096


def bounded(default: Any, low: int | float, high: int | float, why: str = "", **metadata: Any) -> Any:
    """A field whose whole numbers must lie in ``low..high`` (``why``: what the cap bounds, for the message)."""
    return dataclasses.field(default=default, metadata={"low": low, "high": high, "why": why, **metadata})


def one_of(default: Any, choices: Sequence[str]) -> Any:
    """A field whose text must be one of ``choices``."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def declared_limits(params: type, key: str) -> tuple[int | float, int | float] | None:
    """``(low, high)`` of a field's whole numbers: declared, or the generic range; None for a seed."""
    if key == "seed":
        return None
    field = {f.name: f for f in dataclasses.fields(params)}[key]
    if "low" in field.metadata:
        return field.metadata["low"], field.metadata["high"]
    # an index that counts from the end (a layer, -1 the last) may be negative; a count never
    return (-MAX_PARAM_INT if field.metadata.get("from_end") else 0), MAX_PARAM_INT


def limit_problem(params: type, method: str, key: str, value: Any) -> str | None:
    """Why ``value`` is outside the declared limits of ``method``'s parameter ``key`` (one sentence
    naming the value and the valid range or choices), or None. Types are not checked here."""
    field = {f.name: f for f in dataclasses.fields(params)}[key]
    choices = field.metadata.get("choices")
    for text in [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else []:
        if choices is not None and isinstance(text, str) and text not in choices:
            return f"{text!r} is not a valid {method}.{key}; give one of {', '.join(choices)}"
    limits = declared_limits(params, key)
    if limits is None:
        return None
    low, high = limits
    for number in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(number, (int, float)) and not isinstance(number, bool) and not low <= number <= high:
            why = field.metadata.get("why")
            return f"{number!r} is out of range for {method}.{key}; give {low}..{high}" + (f" ({why})" if why else "")
    return None


def check_params(params: type, method: str, **values: Any) -> None:
    """Refuse, in one line, the first of ``values`` outside its declared limits (the run-time twin of
    the file check: the same sentence)."""
    for key, value in values.items():
        problem = limit_problem(params, method, key, value)
        if problem is not None:
            raise InputError(problem)


#: how an absent Shapley player is perturbed (as leave-one-out's deterministic modes)
SHAPLEY_MODES = ("delete", "mask", "unk", "pad")
#: what a Shapley player is: one scorable token, or one word (its word pieces together)
SHAPLEY_UNITS = ("token", "word")
#: the most players exact Shapley values are allowed for (2^16 coalitions per example)
SHAPLEY_EXACT_LIMIT = 16
#: the most sampled orders per example: each is up to players + 1 rows of the engine
SHAPLEY_PERMUTATIONS_LIMIT = 1024
#: how sampled Shapley values are estimated: antithetic orders, KernelSHAP-style regression over
#: complementary coalition pairs, or whichever a pilot shows reaching a standard error in fewer rows
SHAPLEY_ESTIMATORS = ("permutation", "kernel", "auto")
#: the most rows (coalitions) one example's sampled Shapley values take, as many as the exact cap's:
#: an example of n players runs at most ``SHAPLEY_ROW_LIMIT // (n + 1)`` orders (at least one pair)
SHAPLEY_ROW_LIMIT = 2 ** SHAPLEY_EXACT_LIMIT
#: what integrated gradients and GradientSHAP start from: an embedding of the pad, mask or unk token, or zero
IG_BASELINES = ("pad", "zero", "mask", "unk")
#: integrated gradients' quadrature rules (captum's)
IG_RULES = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")
#: what the adversarial search bounds: the output's total variation distance, or the target's change
ADVERSARIAL_CONSTRAINTS = ("tvd", "target")
#: which query rows edge knockout blocks: the target rows, or every row from ``query_from`` on
KNOCKOUT_QUERIES = ("target", "from")


@dataclass(frozen=True)
class AttentionParams:
    batch_size: int = bounded(16, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class AttnGradParams:
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class FlowParams:
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")
    max_tokens: int = bounded(64, 1, 256, "max flow per token grows with the cube of the tokens")
    query: str = "target"


@dataclass(frozen=True)
class AttnNormParams:
    per_head: bool = True
    batch_size: int = bounded(16, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class DecompositionParams:
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class ValueZeroingParams:
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")
    token_budget: int = bounded(8192, 1, 2**22, "tokens in one forward")


@dataclass(frozen=True)
class GradientParams:
    site: str | None = None


@dataclass(frozen=True)
class IntegratedGradientsParams:
    baseline: str = one_of("pad", IG_BASELINES)
    steps: int | str = bounded(50, 1, 1024, "points on the path: forwards and backwards per example")
    rule: str = one_of("gausslegendre", IG_RULES)
    internal_batch_size: int | str | None = "auto"
    keep_special: bool = False
    site: str | None = None
    tolerance: float = 0.05
    max_steps: int = bounded(512, 16, 512, "steps auto tries 16, 32, ..., 512")


@dataclass(frozen=True)
class GradientShapParams:
    baseline: str | tuple[str, ...] = one_of("pad", IG_BASELINES)
    n_samples: int = bounded(20, 1, 1024, "forwards and backwards per example")
    noise: float = 0.1
    seed: int = 0
    internal_batch_size: int | str | None = "auto"
    keep_special: bool = False
    site: str | None = None


@dataclass(frozen=True)
class LeaveOneOutParams:
    mode: str = "delete"
    k: int = bounded(8, 1, 256, "draws per token: rows per example = k x tokens")
    seed: int = 0


@dataclass(frozen=True)
class ShapleyParams:
    """Shapley values (probe.intervene.shapley): an absent player's tokens deleted or replaced
    (``mode``); players are tokens or words (``units``); exact up to ``exact_max`` players, else
    sampled, seeded per example, by ``estimator``: ``permutation`` (``permutations`` orders in
    antithetic pairs), ``kernel`` (KernelSHAP regression over complementary coalition pairs with the
    efficiency constraint, ``permutations x (players + 1)`` coalitions: the rows as many orders ask
    for) or ``auto`` (a pilot of both, then the one whose standard error per row is smaller).
    ``target_se`` > 0: stop where the root-mean-square standard error reaches that share of the
    value range (projected from the pilot; ``permutations`` the cap); 0 runs the whole budget."""
    mode: str = one_of("delete", SHAPLEY_MODES)
    units: str = one_of("token", SHAPLEY_UNITS)
    exact_max: int = bounded(10, 0, SHAPLEY_EXACT_LIMIT, "exact values cost 2^exact_max rows per example; above "
                             "it values are sampled")
    permutations: int = bounded(64, 2, SHAPLEY_PERMUTATIONS_LIMIT, "sampled orders: up to orders x (players + 1) "
                                f"rows per example, at most {SHAPLEY_ROW_LIMIT}")
    seed: int = 0
    estimator: str = one_of("permutation", SHAPLEY_ESTIMATORS)
    target_se: float = bounded(0.0, 0.0, 1.0, "a share of the value range; 0 runs the whole budget")


@dataclass(frozen=True)
class EdgeWindow:
    """The attention edges an edge knockout blocks (and attribution patching estimates its blocking
    of): from the target rows (``query`` target) or from every row from ``query_from`` on (``query``
    from) to a key, in the heads ``heads`` of the layers ``layers`` (None: all; an int; ``"0,2"``;
    ``"a:b"`` a slice), the row renormalised or not; ``per_head`` adds ``extras["per_head"]``
    ``[layer, head, tokens]``. A study or claim file may also give a list of ints (``layers: [0,
    2]``); a layer may count from the end (``-1``, the last)."""
    layers: int | str | tuple[int, ...] | None = dataclasses.field(default=None, metadata={"from_end": True})
    heads: int | str | tuple[int, ...] | None = None
    query: str = one_of("target", KNOCKOUT_QUERIES)
    query_from: int | None = None
    renormalise: bool = True
    per_head: bool = False
    keep_special: bool = False


@dataclass(frozen=True)
class KnockoutParams(EdgeWindow):
    """Edge knockout (probe.intervene.knockout.knockout): the edges from the target rows (``query``
    target) or from every row from ``query_from`` on (``query`` from) to a key blocked in the heads
    ``heads`` of the layers ``layers`` (None: all; an int; ``"0,2"``; ``"a:b"`` a slice), the row
    renormalised or not; ``per_head`` adds ``extras["per_head"]`` ``[layer, head, tokens]``. A study
    or claim file may also give a list of ints (``layers: [0, 2]``); a layer may count from the end
    (``-1``, the last)."""
    batch_size: int = bounded(32, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class AtpParams(EdgeWindow):
    """Attribution patching (probe.intervene.atp.atp): the first-order estimate of ``knockout`` with
    its options (``layers``, ``heads``, ``query``, ``query_from``, ``renormalise``, ``per_head``,
    ``keep_special``), from one forward and one backward per ``batch_size`` examples; the head-ablation
    estimates come with it in ``extras["heads"]``."""
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "examples in one forward and backward")


@dataclass(frozen=True)
class NoSinkParams:
    """Raw attention renormalised over non-sink keys (probe.explainers.sinks.attention_nosink): a key
    is a sink of a head where the mean attention it receives over the query rows exceeds ``threshold``."""
    threshold: float = 0.3
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class UniformParams:
    head: int | None = None
    batch_size: int = bounded(16, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class PermutedParams:
    head: int | None = None
    n: int = bounded(100, 1, 10_000, "permutations: rows per example")
    seed: int = 0
    permute_special: bool = False
    batch_size: int = bounded(64, 1, MAX_BATCH_SIZE, "rows in one forward")


@dataclass(frozen=True)
class AdversarialParams:
    """Jain & Wallace's adversarial search. These defaults are the only ones: the study spec
    (``adversarial_candidates``, ``adversarial_steps``) and claim files (``candidates``, ``steps``)
    read them; every shipped study sets its own (2 candidates, 50 steps) in its file."""
    head: int | None = None
    candidates: int = bounded(5, 1, 64, "optimised attention vectors per example")
    steps: int = bounded(200, 0, 1000, "optimiser steps: forwards and backwards per candidate")
    lr: float = 0.01
    bound: float = 0.01
    constraint: str = one_of("tvd", ADVERSARIAL_CONSTRAINTS)
    penalty: float = 100.0
    init_scale: float = 1.0
    seed: int = 0
    batch_size: int = bounded(8, 1, MAX_BATCH_SIZE, "rows in one forward")
