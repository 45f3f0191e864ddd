"""Every explainer and reference by name, run over the same prepared examples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from probe import registry
from probe.errors import InputError
from probe.names import ALL_METHODS
from probe.rows.scores import TokenScores

if TYPE_CHECKING:
    from probe.intervene.engine import Engine
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample

_R = TypeVar("_R")

__all__ = [
    "family", "parse_methods", "applicable_methods", "refuse_gradients_under_inference_mode", "run_method",
    "run_methods", "run_shared_gradients",
]


def family(method: str) -> str:
    """attention, gradient or intervention (its registry entry); a one-line error for an unknown name."""
    return registry.method(method).family


def parse_methods(text: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` or a list -> validated method names (``all`` = every method)."""
    if text is None:
        return []
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return list(ALL_METHODS)
    for name in names:
        registry.method(name)
    if not names:
        raise InputError(f"no method given: valid methods are {', '.join(ALL_METHODS)}")
    return list(dict.fromkeys(names))


def applicable_methods(pm: ProbeModel, examples: Sequence[PreparedExample]) -> tuple[list[str], dict[str, str]]:
    """The default method set for this model and these examples, and why others were left out
    (what each registered method applies to: :func:`probe.registry.skipped`)."""
    skipped = registry.skipped(pm, max(len(e.input_ids) for e in examples))
    return [m for m in ALL_METHODS if m not in skipped], skipped


def refuse_gradients_under_inference_mode(methods: Sequence[str], doing: str = "probe.explain") -> None:
    """One line refusing the first of ``methods`` that needs gradients (its registry entry's
    ``needs_gradients``) while ``torch.inference_mode()`` is on: no backward pass can run there."""
    import torch

    if not torch.is_inference_mode_enabled():
        return
    needing = [m for m in methods if registry.method(m).needs_gradients]
    if needing:
        free = [m for m in methods if m not in needing][:2]
        also = f", or run only methods without gradients (e.g. {', '.join(free)})" if free else ""
        raise InputError(f"{', '.join(needing)} {'needs' if len(needing) == 1 else 'need'} gradients, which "
                         f"torch.inference_mode() switches off: call {doing} outside the "
                         f"`with torch.inference_mode():` block{also}")


def run_method(pm: ProbeModel, examples: Sequence[PreparedExample], method: str, *, engine: Engine | None = None,
               params: Mapping | None = None) -> TokenScores:
    """One method on every example, through its registry entry's scorer; interventions share
    ``engine`` (and so its cache), the others halve the examples when memory runs out, and from
    then on (in this call, and in later calls given the same ``engine``) run at most as many
    examples per call as fitted (``engine.stats.examples_per_call_used``)."""
    params = dict(params or {})
    entry = registry.method(method)
    refuse_gradients_under_inference_mode([method], "it")
    if (why := entry.skip_reason("maps", pm, 0)) is not None:  # asked for by name on implicit maps
        raise InputError(why)
    from probe.hooks.readers import guarded

    score = entry.load_scorer()
    # each read path's guard around this method's forwards (BigBird's: HF keeps full attention after
    # one short input, so each forward runs what its own input runs: probe.hooks.blocksparse)
    with guarded(pm.model):
        if entry.engine:
            from probe.intervene.engine import Engine

            return score(engine or Engine(pm), examples, **{**dict(entry.preset), **params})
        parts = _settled_halves(pm, examples, lambda part: score(pm, part, method, **params), engine, method)
        return _with_target_queries(pm, examples, _join_parts(parts))


def _with_target_queries(pm: ProbeModel, examples, result: TokenScores) -> TokenScores:
    """``result`` whose ``params.target_query`` (an attention method's) names the query row of every
    example (:meth:`probe.tasks.Task.target_query_params`: each output token's own position), not only
    the rule for a whole target."""
    if "target_query" not in result.params:
        return result
    return dataclasses.replace(result, params={**result.params, **pm.task.target_query_params(examples)})


def _settled_halves(pm: ProbeModel, examples: Sequence[PreparedExample], compute: Callable[[list], _R],
                    engine: Engine | None, key: str) -> list[_R]:
    """``[compute(examples)]``; when it runs out of memory, ``compute`` of each half of the examples in
    turn (:func:`probe.rows.memory.in_halves`), and the examples after that in parts of the most
    that ran. That size is kept in ``engine.stats.examples_per_call_used[key]`` (where an engine is
    given), and a later call with the same engine and key starts from it."""
    from probe.rows.memory import SettledSize, in_halves

    record = engine.stats.examples_per_call_used if engine is not None else {}
    settled = SettledSize(record.get(key))
    parts = in_halves(examples, lambda part, _: compute(part), device=pm.device, settled=settled,
                      stats=engine.stats if engine is not None else None)
    if settled.size is not None:
        record[key] = settled.size
    return parts


def _join_parts(parts: Sequence[TokenScores]) -> TokenScores:
    """Parts of one method's scores on consecutive examples, joined in order: per-example ``extras``
    lists are joined, other extras and params are the first part's (they do not depend on the
    examples)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    extras = {}
    for key, value in first.extras.items():
        values = [part.extras.get(key) for part in parts]
        extras[key] = [v for each in values for v in each] if all(isinstance(v, list) for v in values) else value
    return TokenScores(method=first.method, scores=[s for part in parts for s in part.scores], params=first.params,
                       per_head=first.per_head, per_layer=first.per_layer, extras=extras)


def one_pass_gradients(methods: Sequence[str], params: Mapping[str, Mapping | None]) -> list[str]:
    """The methods of ``methods`` that :func:`run_shared_gradients` gives from one gradient pass
    (saliency, saliency_sum, input x gradient at their default parameters: none in ``params``);
    [] where fewer than two are (one alone gains nothing)."""
    from probe.explainers.gradients import SHARED_GRADIENT_METHODS

    shared = [m for m in methods if m in SHARED_GRADIENT_METHODS and not params.get(m)]
    return shared if len(shared) > 1 else []


def run_shared_gradients(pm: ProbeModel, examples: Sequence[PreparedExample], methods: Sequence[str], *,
                         engine: Engine | None = None) -> dict[str, TokenScores]:
    """Saliency, saliency_sum and input x gradient (any of them, default parameters) from one
    gradient pass (:func:`probe.explainers.gradients.shared_gradient_scores`), halving on OOM (the
    examples per call that fitted kept as :func:`run_method` keeps them, under the methods' names
    joined by ``+``)."""
    from probe.explainers.gradients import shared_gradient_scores

    refuse_gradients_under_inference_mode(methods, "it")
    parts = _settled_halves(pm, examples, lambda part: shared_gradient_scores(pm, part, methods), engine,
                            "+".join(methods))
    return {m: _join_parts([part[m] for part in parts]) for m in methods}


def run_methods(pm: ProbeModel, examples: Sequence[PreparedExample], methods: Sequence[str], *,
                engine: Engine | None = None, params: Mapping[str, Mapping] | None = None,
                progress: bool = False) -> dict[str, TokenScores]:
    """Several methods; ``params`` maps a method name to its keyword parameters. ``progress``: a
    bar over the methods, naming the one under way (standard error, or the notebook's widget)."""
    from probe.intervene.engine import Engine

    engine = engine or Engine(pm)  # the bar below names the method under way: no second bar beneath it
    params = params or {}
    if not progress:
        return {m: run_method(pm, examples, m, engine=engine, params=params.get(m)) for m in methods}
    from probe.progress import progress_bar

    out = {}
    with progress_bar(total=len(methods), desc="explain", unit="method") as bar:
        for m in methods:
            bar.set_postfix_str(m)
            out[m] = run_method(pm, examples, m, engine=engine, params=params.get(m))
            bar.update()
    return out
