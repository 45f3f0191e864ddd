"""Studies run the sanity checks, exclude unreliable methods from the verdict's gradient bar and
ceilings, report redundant units, and count the examples they leave out, with the reason."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from probe.spec.study import study_from_dict
from probe.study.runner import run_study

from test_runner import tiny_study, write_dataset


@pytest.fixture(scope="module")
def checked_run(tiny_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("checked")
    data = write_dataset(folder / "reviews.csv", n=10)
    frame = pd.read_csv(data)
    frame.loc[0, "text"] = "good"  # one scored token: left out, with the reason
    frame.loc[3, "text"] = "bad"
    frame.to_csv(data, index=False)
    spec = tiny_study(tiny_dirs["bert"], data, folder / "out",
                      explainers=["attention_mean", "rollout", "input_x_gradient", "saliency"],
                      references=["loo_delete", "loo_mask", "input_x_gradient"],
                      params={"input_x_gradient": {"site": "word"}},
                      metrics={"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                               "ceilings": [["input_x_gradient", "loo_delete"], ["loo_mask", "loo_delete"]],
                               "sanity": {"examples": 3, "fractions": [0.5, 1.0]}})
    spec["dataset"]["n"] = 10
    study = study_from_dict(spec)
    run_study(study, progress=False, log=lambda _: None)
    return folder / "out"


def test_sanity_in_verdict_and_table(checked_run):
    verdict = json.loads((checked_run / "verdict.json").read_text())
    table = pd.read_parquet(checked_run / "sanity.parquet")
    assert {"degeneracy", "constant", "randomisation"} <= set(table.check)
    ixg = [c for c in verdict["sanity"] if c["method"] == "input_x_gradient" and c["check"] == "degeneracy"]
    assert ixg[0]["status"] == "fail"
    assert "degeneracy" in verdict["unreliable"]["input_x_gradient"]
    # the word-site input x gradient is neither the gradient bar nor a ceiling
    assert verdict["best_gradient"]["explainer"] == "saliency"
    assert verdict["ceiling"]["pair"] == ["loo_mask", "loo_delete"]
    assert "Failed sanity checks (their units never track" in verdict["headline"] and "input_x_gradient (degeneracy" in verdict["headline"]
    assert "attention_mean L0 = rollout L0" in verdict["headline"]  # rollout L0 = 0.5 A + 0.5 I: same order off [CLS]
    curves = [c["curve"] for c in verdict["sanity"] if c["check"] == "randomisation" and c["status"] != "not run"]
    assert curves and all(curve[0] == [0.0, 1.0] for curve in curves)


def test_left_out_examples_are_counted_with_the_reason(checked_run):
    summary = pd.read_parquet(checked_run / "summary.parquet")
    left = pd.read_parquet(checked_run / "left_out.parquet")
    examples = pd.read_parquet(checked_run / "examples.parquet")
    short = set(examples[examples.n_scored < 2].example)
    assert len(short) == 2 and set(left.example) == short and set(left.reason) == {"fewer than 2 scored tokens"}
    row = summary[(summary.explainer == "attention_mean") & (summary.reference == "loo_delete")
                  & (summary.measure == "kendall_tau")].iloc[0]
    assert row.left_out >= 2 and "fewer than 2 scored tokens: 2" in row.left_out_reasons
    assert row.n + 2 <= 10


def test_report_shows_checks_left_out_and_flags(checked_run, tmp_path):
    from probe.report.build import build_report

    files = build_report(checked_run, tmp_path / "report")
    text = files.markdown.read_text().replace("\\_", "_")
    assert "Sanity checks" in text and "randomisation" in text
    assert "examples left out of n" in text and "fewer than 2 scored tokens: 2" in text
    assert "input_x_gradient failed its sanity checks (degeneracy" in text
    assert "identical rankings on this model: attention_mean L0 = rollout L0" in text
    assert any(p.name.startswith("randomisation") for p in files.figures)
    assert "time after the steps" in text  # the phases' seconds (issue 63)


def test_provenance_times_each_phase_after_the_steps(checked_run):
    """provenance.json records the seconds of the sanity checks, the randomisation check among them,
    and the statistics (issue 63: each phase's cost on the report)."""
    phases = json.loads((checked_run / "provenance.json").read_text())["phase_seconds"]
    assert set(phases) == {"sanity checks", "randomisation check", "statistics"}
    assert 0 < phases["randomisation check"] <= phases["sanity checks"] and phases["statistics"] > 0


def test_redundant_units_are_one_row_in_the_table_and_named_in_the_figures(checked_run):
    from probe.report import analysis as an
    from probe.report.results import load_result

    r = load_result(checked_run)
    wide = an.agreement_wide(r)
    assert "attention_mean L0 = rollout L0 (one ranking)" in set(wide.explainer)
    assert "rollout L0" not in set(wide.explainer) and "attention_mean L0" not in set(wide.explainer)
    by_layer = an.agreement_by_layer(r)
    marked = by_layer[by_layer.same_ranking_as != ""]
    assert {(e, int(l_)) for e, l_ in zip(marked.explainer, marked.layer)} >= {("attention_mean", 0), ("rollout", 0)}
    notes = an.layer_line_notes(r)
    assert notes["rollout"] == "attention_mean L0 = rollout L0: one ranking"


# ------------------------------------------------------------- integrated gradients on randomised models


def test_the_check_runs_ig_at_the_fewest_points_up_to_the_studys_that_pass_completeness(tiny_dirs, tmp_path):
    from probe.explainers.integrated_gradients import auto_ladder
    from probe.study.checks import randomised_params

    assert auto_ladder(50) == [16, 32, 50] and auto_ladder(64) == [16, 32, 64] and auto_ladder(512)[-1] == 512
    assert auto_ladder(15) == []

    def study(params):
        spec = tiny_study(tiny_dirs["bert"], write_dataset(tmp_path / "r.csv", n=4), tmp_path / "out",
                          explainers=["attention_mean", "integrated_gradients", "saliency"], references=["loo_delete"],
                          params=params)
        return study_from_dict(spec)

    s = study({"integrated_gradients": {"steps": 50, "tolerance": 0.01, "baseline": "zero"}})
    assert randomised_params(s, "integrated_gradients") == {"steps": "auto", "max_steps": 50, "tolerance": 0.01,
                                                            "baseline": "zero"}
    assert randomised_params(s, "saliency") is None
    assert randomised_params(study({}), "integrated_gradients") == {"steps": "auto", "max_steps": 50}  # the default 50
    for kept in ({"steps": 16}, {"steps": "auto", "max_steps": 64}, {"steps": 1024}):
        assert randomised_params(study({"integrated_gradients": kept}), "integrated_gradients") == kept


def test_ig_verified_up_to_the_studys_points_never_runs_more_and_is_the_fixed_run_where_it_must(tiny_dirs,
                                                                                               monkeypatch):
    import probe
    from probe.explainers import integrated_gradients as ig_module
    from probe.explainers.integrated_gradients import integrated_gradients
    from probe.rows.prepare import prepare

    pm = probe.load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the movie was good", "a dull and lifeless film , sadly", "not bad at all"])
    fixed = integrated_gradients(pm, examples, steps=24)
    with monkeypatch.context() as patch:
        patch.setattr(ig_module, "AUTO_ABSOLUTE_TOLERANCE", 0.0)
        strict = integrated_gradients(pm, examples, steps="auto", max_steps=24, tolerance=1e-12)  # never done early
    assert strict.extras["steps_used"] == [24, 24, 24]  # the study's own points, no more
    assert [h[-1][0] for h in strict.extras["delta_by_steps"]] == [24, 24, 24]
    assert all(torch_close(a, b) for a, b in zip(strict.scores, fixed.scores))
    loose = integrated_gradients(pm, examples, steps="auto", max_steps=24, tolerance=0.5)
    for used, delta, target, base in zip(loose.extras["steps_used"], loose.extras["convergence_delta"],
                                         loose.extras["target_value"], loose.extras["baseline_value"]):
        assert used <= 24 and (used == 24 or abs(delta) <= max(0.5 * abs(target - base), 1e-4))  # shown complete


def torch_close(a, b) -> bool:
    import torch

    return bool(torch.allclose(a, b, atol=1e-5, rtol=1e-4))
