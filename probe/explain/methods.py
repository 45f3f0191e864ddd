"""Every explainer and reference by name, run over the same prepared examples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from probe.errors import InputError
from probe.rows.scores import TokenScores
from probe.names import ALL_METHODS, ATTENTION_METHODS, GRADIENT_METHODS, INTERVENTION_METHODS, method_family

__all__ = ["ALL_METHODS", "ATTENTION_METHODS", "GRADIENT_METHODS", "INTERVENTION_METHODS", "family", "parse_methods",
           "applicable_methods", "run_method", "run_methods", "run_shared_gradients"]


def family(method: str) -> str:
    kind = method_family(method)
    if kind is not None:
        return kind
    raise InputError(f"unknown method {method!r}: valid methods are {', '.join(ALL_METHODS)}")


def parse_methods(text: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` or a list -> validated method names (``all`` = every method)."""
    if text is None:
        return []
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return list(ALL_METHODS)
    for name in names:
        family(name)
    if not names:
        raise InputError(f"no method given: valid methods are {', '.join(ALL_METHODS)}")
    return list(dict.fromkeys(names))


def applicable_methods(pm, examples) -> tuple[list[str], dict[str, str]]:
    """The default method set for this model and these examples, and why others were left out."""
    from probe.explain.attention import FLOW_MAX_TOKENS

    skipped: dict[str, str] = {}
    if pm.task != "causal_lm":
        skipped["loo_lm"] = "needs a causal LM to draw in-context replacements"
    if pm.tokenizer.mask_token_id is None:
        skipped["loo_mask"] = "the tokenizer has no mask token"
    if pm.tokenizer.unk_token_id is None:
        skipped["loo_unk"] = "the tokenizer has no unknown token"
    longest = max(len(e.input_ids) for e in examples)
    if longest > FLOW_MAX_TOKENS:
        skipped["flow"] = f"attention flow is limited to {FLOW_MAX_TOKENS} tokens (longest input has {longest})"
    skipped.setdefault("saliency_sum", "a variant of saliency; ask for it by name")
    from probe.explain.context_mixing import CONTEXT_MIXING_METHODS, context_mixing_support

    skipped.update({m: why for m in CONTEXT_MIXING_METHODS if (why := context_mixing_support(pm, m)) is not None})
    return [m for m in ALL_METHODS if m not in skipped], skipped


def run_method(pm, examples, method: str, *, engine=None, params: Mapping | None = None) -> TokenScores:
    """One method on every example; interventions share ``engine`` (and so its cache)."""
    params = dict(params or {})
    kind = family(method)
    from probe.names import CONTEXT_MIXING_METHODS

    if method in CONTEXT_MIXING_METHODS:
        from probe.explain.context_mixing import context_mixing_scores

        return _halving_examples(pm, examples, lambda part: context_mixing_scores(pm, part, method, **params))
    if kind == "attention":
        from probe.explain.attention import attention_scores

        return _halving_examples(pm, examples, lambda part: attention_scores(pm, part, method, **params))
    if kind == "gradient":
        from probe.explain.gradients import gradient_scores

        return _halving_examples(pm, examples, lambda part: gradient_scores(pm, part, method, **params))
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo

    engine = engine or Engine(pm)
    return loo(engine, examples, method.removeprefix("loo_"), **params)


def _halving_examples(pm, examples, compute) -> TokenScores:
    """``compute(examples)``; when it runs out of memory, on each half of the examples in turn
    (:func:`probe.intervene.engine.in_halves`), the parts joined in order: per-example ``extras``
    lists are joined, other extras and params are the first part's (they do not depend on the
    examples)."""
    from probe.rows.memory import in_halves

    return _join_parts(in_halves(examples, lambda part, _: compute(part), device=pm.device))


def _join_parts(parts: Sequence[TokenScores]) -> TokenScores:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    extras = {}
    for key, value in first.extras.items():
        values = [part.extras.get(key) for part in parts]
        extras[key] = [v for each in values for v in each] if all(isinstance(v, list) for v in values) else value
    return TokenScores(method=first.method, scores=[s for part in parts for s in part.scores], params=first.params,
                       per_head=first.per_head, per_layer=first.per_layer, extras=extras)


def run_shared_gradients(pm, examples, methods: Sequence[str]) -> dict[str, TokenScores]:
    """Saliency, saliency_sum and input x gradient (any of them, default parameters) from one
    gradient pass (:func:`probe.explain.gradients.shared_gradient_scores`), halving on OOM."""
    from probe.explain.gradients import shared_gradient_scores
    from probe.rows.memory import in_halves

    parts = in_halves(examples, lambda part, _: shared_gradient_scores(pm, part, methods), device=pm.device)
    return {m: _join_parts([part[m] for part in parts]) for m in methods}


def run_methods(pm, examples, methods: Sequence[str], *, engine=None,
                params: Mapping[str, Mapping] | None = None) -> dict[str, TokenScores]:
    """Several methods; ``params`` maps a method name to its keyword parameters."""
    from probe.intervene.engine import Engine

    engine = engine or Engine(pm)
    params = params or {}
    return {m: run_method(pm, examples, m, engine=engine, params=params.get(m)) for m in methods}
