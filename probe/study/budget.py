"""Budgets for a study's plan (``probe plan --budget 2h --memory 40GiB``): the settings that would bring
a :class:`~probe.study.cost.StudyPlan` under them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from probe.study.cost import duration_words, size_words

if TYPE_CHECKING:
    from probe.spec.study import Study
    from probe.study.cost import StudyPlan

__all__ = ["fit_budget"]

def fit_budget(plan: StudyPlan, study: Study, *, seconds: float | None = None,
               memory: int | None = None) -> list[str]:
    """Settings that would bring ``plan`` under ``seconds`` and ``memory``, each with what it saves, in
    the order to try them (empty where the plan fits both)."""
    out: list[str] = []
    if seconds is not None and plan.seconds > seconds:
        out += _time_fits(plan, study, seconds)
    limit = memory if memory is not None else plan.available_bytes
    if limit is not None and plan.peak_bytes > limit:
        out += _memory_fits(plan, study, limit)
    return out


def _time_fits(plan: StudyPlan, study: Study, budget: float) -> list[str]:
    out = []
    over = plan.seconds - budget
    for step in sorted(plan.steps, key=lambda s: -s.seconds):
        if over <= 0 or step.seconds < 0.05 * plan.seconds:
            break
        params = dict(study.params.get(step.step) or {})
        points = params.get("steps", 50)
        if step.step == "integrated_gradients" and isinstance(points, int) and points > 32:
            saved = step.seconds * (1 - 24 / points)
            out.append(f"params.integrated_gradients.steps: auto (16 or 32 points where they converge, checked): "
                       f"saves about {duration_words(saved)}")
            over -= saved
        elif step.step == "shapley":
            keep = max(0.1, 1 - over / step.seconds)
            orders = max(2, int(params.get("permutations", 64) * keep) // 2 * 2)
            out.append(f"params.shapley.permutations: {orders} (sampled orders, wider standard errors): saves about "
                       f"{duration_words(step.seconds * (1 - keep))}")
            over -= step.seconds * (1 - keep)
        elif step.step == "knockout" and params.get("per_head"):
            out.append("params.knockout.layers: the layers to test (per-head rows grow with layers x heads), or "
                       "metrics.heads_causal with an AtP screen (screen: {heads: 16}): exact rows for the heads "
                       "AtP picks per example")
        elif step.step == "heads_causal" and study.metrics.heads_causal is not None \
                and study.metrics.heads_causal.screen is None:
            out.append("metrics.heads_causal.screen: {heads: 16, audit: 4} (per example AtP picks the heads that run "
                       "the exact knockout: 20 heads' rows per example instead of every tested head's; the audit "
                       "bounds what it misses)")
        elif step.step.startswith("loo_") and plan.lengths["median"] > 256 and study.spans is None:
            out.append("spans: {pattern: sentence} (sentences as the units: one row per sentence, not per token)")
    if over > 0:
        fixed = plan.load_seconds + sum(plan.phases.values())
        per_example = (plan.seconds - fixed) / max(plan.examples, 1)
        n = int((budget - fixed) / per_example) if per_example > 0 and budget > fixed else 0
        out.append(f"dataset.n: {n} (of {plan.examples})" if n > 0 else
                   f"no study fits {duration_words(budget)}: loading and the checks alone take {duration_words(fixed)}")
    return out


def _memory_fits(plan: StudyPlan, study: Study, limit: int) -> list[str]:
    out = []
    worst = max(plan.steps, key=lambda s: s.peak_bytes)
    room = limit - plan.model_bytes
    if room <= 0:
        out.append(f"the model alone takes {size_words(plan.model_bytes)} of {size_words(limit)}: "
                   "model.dtype: bf16, or a "
                   "device with more memory (model.device)")
        return out
    factor = room / max(worst.peak_bytes, 1)
    out.append(f"engine.token_budget: {max(256, int(study.engine.token_budget * factor))} and engine.batch_size: "
               f"{max(1, int(study.engine.batch_size * factor))} (the largest step, {worst.step}, needs "
               f"{size_words(worst.peak_bytes)} above the model's {size_words(plan.model_bytes)})")
    if study.model.dtype == "fp32":
        out.append("model.dtype: bf16 (halves the model and its activations)")
    return out
