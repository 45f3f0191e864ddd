"""`probe plan` (probe.study.cost): the rows it counts against the rows the methods run, its plan of a
study, the budgets it reads and the run it refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from probe.errors import InputError
from probe.methods import run_method
from probe.models.loading import load_model
from probe.spec.study import study_from_dict
from probe.study.batch import ForwardCounter
from probe.study.budget import fit_budget
from probe.study.cost import calibration_params, method_rows, parse_budget, parse_memory, plan_study
from probe.study.examples import prepare_examples

from test_runner import tiny_study, write_dataset

TEXTS = ["a fine and moving film", "dull , slow and far too long", "not bad at all"]

#: (method, params, exact): exact where the engine cannot merge two rows (no two perturbations equal)
COUNTED = [
    ("attention_mean", None, True), ("rollout", None, True), ("attn_grad", None, True),
    ("saliency", None, True), ("integrated_gradients", {"steps": 8}, True),
    ("gradient_shap", {"n_samples": 3}, True), ("loo_mask", None, True), ("loo_pad", None, True),
    ("loo_random", {"k": 2}, False), ("knockout", None, True), ("knockout", {"per_head": True}, True),
    ("knockout", {"per_head": True, "layers": [0]}, True), ("shapley", {"exact_max": 10}, False),
    ("shapley", {"exact_max": 0, "permutations": 4}, False), ("loo_delete", None, False), ("atp", None, True),
]


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    pm = load_model(str(tiny_dirs["bert"]))
    target = study_from_dict({"name": "t", "model": {"id": str(tiny_dirs["bert"])},
                              "dataset": {"name": "builtin:rotten_tomatoes", "n": 3},
                              "explainers": ["attention"], "references": ["loo_mask"]}).target
    return pm, prepare_examples(pm, target, TEXTS)


@pytest.mark.parametrize(("name", "params", "exact"), COUNTED, ids=[f"{m}-{p}" for m, p, _ in COUNTED])
def test_the_rows_counted_are_the_rows_the_method_runs(bert, name, params, exact):
    """The oracle is a hook on the model counting every row of every call (captum's, the engine's, the
    capture's), with gradients on or off: the plan's count must equal it, or bound it where the engine
    merges equal rows (Shapley's orders share the empty and full coalitions, and with every player deleted
    two examples of one target are one row; two random replacements may draw the same token)."""
    pm, examples = bert
    counted = [method_rows(pm, name, params, e) for e in examples]
    counter = ForwardCounter(pm.model)
    try:
        run_method(pm, examples, name, params=params)
    finally:
        counter.close()
    forwards = sum(c[0] for c in counted)
    backwards = sum(c[1] for c in counted)
    assert backwards == counter.backward_rows
    if exact:
        assert forwards == counter.rows - counter.backward_rows
    else:
        assert 0 < counter.rows - counter.backward_rows <= forwards


def test_adaptive_points_are_not_counted_and_costly_methods_calibrate_cheaply(bert):
    pm, examples = bert
    assert method_rows(pm, "integrated_gradients", {"steps": "auto"}, examples[0]) is None
    assert calibration_params("shapley", {"permutations": 200}) == {"exact_max": 0, "permutations": 2}
    assert calibration_params("integrated_gradients", {"steps": 50})["steps"] == 16
    assert calibration_params("integrated_gradients", {"steps": "auto"}) == {"steps": "auto"}
    assert calibration_params("knockout", {"per_head": True})["layers"] == [0]
    assert calibration_params("attention", None) is None


def test_budgets_are_read_or_refused_in_one_line():
    assert parse_budget("2h") == 7200 and parse_budget("90m") == 5400 and parse_budget("45") == 45
    assert parse_memory("40GiB") == 40 * 2**30 and parse_memory("16GB") == 16 * 10**9
    for bad, parse in (("two hours", parse_budget), ("-3h", parse_budget), ("40 parsecs", parse_memory)):
        with pytest.raises(InputError, match="is not an amount") as caught:
            parse(bad)
        assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def tiny_plan(tiny_dirs, tmp_path_factory):
    data = write_dataset(tmp_path_factory.mktemp("plan") / "reviews.csv")
    spec = tiny_study(tiny_dirs["bert"], data, tmp_path_factory.mktemp("plan_out"),
                      explainers=["attention_mean", "saliency", "integrated_gradients"],
                      references=["loo_mask"], params={"integrated_gradients": {"steps": 32}})
    spec["metrics"] = {"top_k": [1], "erasure": {"rankings": ["saliency"], "bins": [10, 50]}, "counterfactual": None}
    spec["dataset"]["n"] = 10
    spec["statistics"] = {"bootstrap": 200, "reference": "loo_mask"}
    study = study_from_dict(spec)
    return study, plan_study(study)


def test_a_plan_counts_every_step_and_scales_the_sample_to_the_study(tiny_plan, tiny_dirs):
    study, plan = tiny_plan
    steps = {s.step: s for s in plan.steps}
    assert {"prepare", "saliency+input_x_gradient" if "saliency+input_x_gradient" in steps else "saliency",
            "attention_mean", "integrated_gradients", "loo_mask", "erasure"} <= set(steps)
    assert plan.examples == 10
    ig = steps["integrated_gradients"]
    assert ig.backwards == 32 * 10 and ig.forwards == 4 * 10 and not ig.approximate  # counted at the study's 32
    assert steps["attention_mean"].forwards == 10
    assert all(s.seconds >= 0 for s in plan.steps) and plan.seconds > plan.load_seconds
    assert plan.peak_bytes >= plan.model_bytes > 0 and plan.fits
    table = "\n".join(plan.lines())
    assert "integrated_gradients" in table and "total" in table and "fits" in table
    assert json.loads(json.dumps(plan.to_dict()))["examples"] == 10


def test_a_budget_too_small_names_settings_that_fit(tiny_plan):
    study, plan = tiny_plan
    assert fit_budget(plan, study, seconds=plan.seconds * 10) == []
    fixes = fit_budget(plan, study, seconds=plan.load_seconds + sum(plan.phases.values()) + 0.5 * sum(
        s.seconds for s in plan.steps))
    assert fixes and fixes[-1].startswith("dataset.n: ")
    memory = fit_budget(plan, study, memory=plan.model_bytes + 1)
    assert memory and "engine.token_budget" in memory[0]
    assert "the model alone" in fit_budget(plan, study, memory=plan.model_bytes // 2)[0]


def test_run_with_plan_refuses_a_study_that_does_not_fit_in_one_line(tiny_dirs, tmp_path):
    """`probe run --plan` prints the plan and refuses, writing nothing, where the predicted peak exceeds
    the available memory (here made tiny through PROBE_PLAN_MEMORY, the memory a user grants a study)."""
    import os

    data = write_dataset(tmp_path / "reviews.csv")
    spec = tiny_study(tiny_dirs["bert"], data, tmp_path / "out", explainers=["attention_mean"], references=["loo_mask"])
    spec["metrics"] = {"top_k": [1], "erasure": None, "counterfactual": None, "sanity": {"randomisation": False}}
    spec["dataset"]["n"] = 4
    spec["statistics"] = {"bootstrap": 200, "reference": "loo_mask"}
    import yaml

    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PROBE_PLAN_MEMORY": "1000B"}
    done = subprocess.run([sys.executable, "-m", "probe", "run", str(tmp_path / "study.yaml"), "--plan",
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode != 0
    assert "plan of tiny" in done.stdout and "DOES NOT FIT" in done.stdout
    error = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert error[-1].startswith("error: the study's predicted peak memory") and "probe plan" in error[-1]
    assert not (tmp_path / "out").exists()


def test_a_malformed_plan_memory_is_refused_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch):
    """PROBE_PLAN_MEMORY=lots: one line naming the variable, before any model is loaded (plan_study
    and `probe run --plan`)."""
    import os

    import probe.study.runner as runner
    from probe.study.cost import granted_memory, plan_study

    monkeypatch.setenv("PROBE_PLAN_MEMORY", "lots")
    loads = []
    monkeypatch.setattr(runner, "load_study_model", lambda *a, **k: loads.append(a) or None)
    data = write_dataset(tmp_path / "reviews.csv")
    spec = study_from_dict(tiny_study(tiny_dirs["bert"], data, tmp_path / "out"))
    with pytest.raises(InputError, match=r"^PROBE_PLAN_MEMORY 'lots' is not an amount"):
        plan_study(spec)
    assert loads == []
    monkeypatch.setenv("PROBE_PLAN_MEMORY", "2GiB")
    assert granted_memory() == 2 * 2**30
    monkeypatch.delenv("PROBE_PLAN_MEMORY")
    assert granted_memory() is None and "PROBE_PLAN_MEMORY" not in os.environ


def test_the_plan_prices_the_completeness_search_where_the_sample_fails_completeness(tiny_dirs, tmp_path):
    """Issue 64: the sanity checks of a study whose integrated gradients fail completeness ran past the
    plan by the completeness check's search for the points that would do (SmolLM2: 32 to 256 points on
    each sampled example). The plan prices it where the calibration batch's IG fails completeness: every
    try up to MAX_STEPS, on the examples that decide each (here 2 of the 4: riemann_left at 2 points is
    far off), at the seconds per point and example IG took; a phase of its own."""
    from probe.study.sanity import MAX_STEPS

    data = write_dataset(tmp_path / "reviews.csv")
    spec = tiny_study(tiny_dirs["bert"], data, tmp_path / "out", explainers=["integrated_gradients"],
                      references=["loo_mask"], params={"integrated_gradients": {"steps": 2, "rule": "riemann_left"}})
    spec["metrics"] = {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                       "sanity": {"examples": 4, "randomisation": False}}
    spec["dataset"]["n"] = 8
    spec["statistics"] = {"bootstrap": 200, "reference": "loo_mask"}
    plan = plan_study(study_from_dict(spec))
    ig = next(s for s in plan.steps if s.step == "integrated_gradients")
    tries = [2 ** k for k in range(2, MAX_STEPS.bit_length())]  # 4, 8, ..., MAX_STEPS points
    rows = sum(points + 4 for points in tries) * 2  # each try on 2 examples: its points and 4 forwards each
    per_row = ig.seconds / (ig.forwards + ig.backwards)  # the study's examples; the search runs at the sample's
    assert 0.5 < plan.phases["completeness check"] / (per_row * rows) < 2
    assert "randomisation check" not in plan.phases
    assert any(line.startswith("completeness check") for line in plan.lines())
