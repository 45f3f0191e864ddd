"""The cost frontier's rule (probe.study.frontier) on summaries whose answer is known by construction."""

from __future__ import annotations

import pandas as pd
import pytest

from probe.study.frontier import cost_frontier, method_seconds


def _row(role: str, explainer: str, reference: str, mean: float, layer: int = -1, head: int = -1,
         half: float = 0.05) -> dict:
    return {"role": role, "explainer": explainer, "reference": reference, "layer": layer, "head": head,
            "measure": "kendall_tau", "n": 20, "mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def _summary() -> pd.DataFrame:
    return pd.DataFrame([
        _row("explainer", "attention", "shapley", 0.10, layer=0, head=1),
        _row("explainer", "attention", "shapley", 0.45, layer=2, head=0),  # attention's best unit
        _row("explainer", "attention", "loo_delete", 0.90, layer=1, head=0),  # another reference: not this frontier
        _row("explainer", "saliency", "shapley", 0.50),
        _row("explainer", "integrated_gradients", "shapley", 0.60),
        {**_row("explainer", "integrated_gradients", "shapley", 0.99), "measure": "spearman"},  # another measure
        _row("ceiling", "loo_delete", "shapley", 0.55),
        _row("baseline", "random", "shapley", 0.0),
    ])


CEILING = {"pair": ["loo_delete", "shapley"], "mean": 0.55, "ci": [0.50, 0.60]}
STEPS = {"attention": 2.0, "saliency+input_x_gradient": 4.0, "integrated_gradients": 40.0, "loo_delete": 20.0,
         "shapley": 400.0, "prepare": 1.0}


def test_each_method_is_its_best_unit_at_its_steps_seconds_per_example():
    f = cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=CEILING, step_seconds=STEPS,
                      n_examples=20)
    points = {p["method"]: p for p in f["points"]}
    assert set(points) == {"attention", "saliency", "integrated_gradients", "loo_delete"}
    assert points["attention"]["unit"] == "attention L2.H0" and points["attention"]["mean"] == pytest.approx(0.45)
    assert points["integrated_gradients"]["mean"] == pytest.approx(0.60)  # the study's measure only
    # a step shared by two methods costs each of them whole; seconds over the examples run
    assert points["saliency"]["seconds_per_example"] == pytest.approx(0.2)
    assert f["reference_seconds_per_example"] == pytest.approx(20.0)
    assert [p["method"] for p in f["points"]] == ["attention", "saliency", "loo_delete", "integrated_gradients"]


def test_the_cheapest_method_within_the_ceiling_is_named_and_the_ceilings_own_member_is_not():
    f = cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=CEILING, step_seconds=STEPS,
                      n_examples=20)
    points = {p["method"]: p for p in f["points"]}
    # attention 0.45 < 0.50: outside; saliency 0.50 reaches the bound; loo_delete makes the ceiling itself
    assert not points["attention"]["within_ceiling"] and points["saliency"]["within_ceiling"]
    assert points["loo_delete"]["defines_ceiling"] and not points["loo_delete"]["within_ceiling"]
    assert f["cheapest"]["method"] == "saliency" and f["cheapest"]["speedup"] == pytest.approx(20.0 / 0.2)
    assert "saliency is the cheapest" in f["why"] and "loo_delete defines the ceiling" in f["why"]


def test_a_method_that_failed_a_check_is_drawn_but_never_named():
    f = cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=CEILING, step_seconds=STEPS,
                      n_examples=20, unreliable={"saliency": ["randomisation"]})
    points = {p["method"]: p for p in f["points"]}
    assert points["saliency"]["failed_checks"] and not points["saliency"]["within_ceiling"]
    assert f["cheapest"]["method"] == "integrated_gradients"


def test_without_a_ceiling_or_a_method_reaching_it_nothing_is_named_and_it_says_why():
    one = cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=None, step_seconds=STEPS,
                        n_examples=20)
    assert one["cheapest"] is None and one["why"].startswith("no ceiling")
    high = {**CEILING, "mean": 0.9, "ci": [0.85, 0.95]}
    none = cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=high, step_seconds=STEPS,
                         n_examples=20)
    assert none["cheapest"] is None and none["why"].startswith("no method reaches the ceiling's lower bound +0.850")
    assert cost_frontier(_summary(), reference="shapley", measure="kendall_tau", ceiling=CEILING, step_seconds={},
                         n_examples=20) is None


def test_method_seconds_reads_shared_steps_and_says_none_for_an_unrun_method():
    assert method_seconds(STEPS, "input_x_gradient") == 4.0
    assert method_seconds(STEPS, "gradient") is None  # a name inside another name is not a step of it
