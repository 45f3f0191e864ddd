"""The verdict on models whose truth was planted (probe.models.planted): studies/planted.yaml on each
must give the documented answer, yes where attention is right, no where it is uniform, undecidable
where the output ignores the input or its effects are at the float noise floor (DESIGN rule 14)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from probe.models.planted import PLANTED_MODELS, self_test_names
from probe.spec.study import load_study
from probe.study.planted import run_planted, write_planted

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """``planted_run(name)``: studies/planted.yaml run on planted model ``name`` once per module, as
    ``(row of run_planted's frame, result folder)``."""
    root = tmp_path_factory.mktemp("planted")
    done = {}

    def get(name):
        if name not in done:
            frame = run_planted(load_study(ROOT / "studies" / "planted.yaml"), names=[name], results=root)
            done[name] = (frame.iloc[0], root / name)
        return done[name]

    return get


@pytest.mark.parametrize("name", self_test_names())  # sink-head, edge-head: tests/test_head_causal.py
def test_the_verdict_gives_the_planted_answer(name, planted_run):
    row, folder = planted_run(name)
    assert row.answer in PLANTED_MODELS[name].expected, row.headline
    verdict = json.loads((folder / "verdict.json").read_text())
    if row.answer == "undecidable":
        assert verdict["undecidable"] and verdict["undecidable"] in verdict["headline"]
    if name == "uniform-attention":  # attention is constant: its own check fails, so it cannot carry anything
        assert "attention_mean" in verdict["unreliable"] and "constant" in verdict["unreliable"]["attention_mean"]
    if name == "trigger-soft":  # the sign check catches input x gradient scoring zz as lowering the target
        assert "sign" in verdict["unreliable"].get("input_x_gradient", [])
    if name in ("trigger-saturated", "trigger-soft", "copy-lm", "copy-lm-cue"):  # one token carries the effect: top-1
        assert verdict["measure"] == "top1"
    if name == "copy-lm-cue":  # rollout and ALTI are right there, and their randomisation check says so
        families = verdict["families"]
        assert families["attention-derived"]["answer"] == "yes" and families["context mixing"]["answer"] == "yes"
        assert families["attention-derived"]["best_layer"]["unit"] == "rollout L0"
        assert families["context mixing"]["best_layer"]["unit"] == "alti L0"
        assert not any(unit.startswith(("rollout", "alti")) for unit in verdict["unreliable_units"]), verdict["unreliable_units"]


def test_probe_planted_writes_the_table_and_fails_on_a_wrong_answer(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "probe", "planted", str(ROOT / "studies" / "planted.yaml"),
                           "--only", "constant-output", "--results", str(tmp_path / "res"), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ok    constant-output: undecidable" in proc.stdout and "1/1 right" in proc.stdout
    text = (out / "planted.md").read_text()
    assert "constant-output" in text and "**undecidable**" in text and "does not depend on the input" in text
    rows = json.loads((out / "planted.json").read_text())
    assert rows[0]["right"] is True
    # a wrong answer is said, and the command's status says so too
    frame = run_planted(load_study(ROOT / "studies" / "planted.yaml"), names=["constant-output"],
                        results=tmp_path / "res")
    frame.loc[0, "right"] = False
    write_planted(frame, tmp_path / "wrong")
    assert "| NO |" in (tmp_path / "wrong" / "planted.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "probe", "planted", "--only", "nosuch"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode != 0 and "unknown planted model" in bad.stderr and "Traceback" not in bad.stderr


def test_the_verdict_is_calibrated_over_200_statistics_seeds(planted_run):
    """The verdict recomputed from the stored tables at 200 statistics seeds (no model reruns): on 72
    heads whose attention knows nothing of the causal token, a "yes" or "heads only" at no more than
    5% of the seeds; with one planted head among them, that head named, alone, at 95% of them at least."""
    from probe.study.calibration import calibration_summary, folder_calibration

    null = calibration_summary(folder_calibration(planted_run("position-heads")[1], seeds=range(200)))
    assert null["seeds"] == 200 and null["positive"] <= 0.05 and null["rule1_any"] <= 0.05, null
    sparse = calibration_summary(folder_calibration(planted_run("one-head")[1], seeds=range(200)), ["attention L5.H7"])
    assert sparse["exactly_expected"] >= 0.95 and sparse["answers"]["heads only"] >= 0.95, sparse


@pytest.mark.parametrize("name", ["trigger-twice", "trigger-twice-soft"])
def test_redundant_copies_are_judged_against_shapley_and_single_deletion_says_why_not(name, planted_run):
    """Two copies of the trigger: against Shapley values the verdict is right ("yes"); judged on the same
    tables against single deletion it is not ("undecidable": no single deletion moved the target; "no":
    filler words ranked above the copies), and the pair check says why, naming the copies."""
    from probe.study.calibration import read_folder
    from probe.study.summary import judge_tables

    row, folder = planted_run(name)
    verdict = json.loads((folder / "verdict.json").read_text())
    assert verdict["reference"] == "shapley" and row.answer == "yes"
    substitutes = verdict["interactions"]["substitutes"]
    assert len(substitutes["examples"]) >= 0.9 * verdict["interactions"]["examples"]
    assert substitutes["strongest"]["tokens"] == ["zz", "zz"]
    tables, study, dtype, sanity = read_folder(folder)
    single = study.model_copy(update={"statistics": study.statistics.model_copy(update={"reference": "loo_delete"})})
    judged = judge_tables(tables, single, dtype=dtype, sanity=sanity)["verdict"]
    if name == "trigger-twice":  # saturated: deleting one copy changes nothing at all
        assert judged["answer"] == "undecidable" and "stand in for each other" in judged["undecidable"]
    else:  # the pair check distrusts single deletion on most examples: it cannot judge (no flat "no")
        assert judged["answer"] == "undecidable" and judged["undecidable"].startswith("the reference cannot judge")
        assert "statistics.reference: shapley" in judged["undecidable"]
    assert any("misjudges interacting tokens" in w and "'zz' + 'zz'" in w for w in judged["warnings"])


def test_at_small_n_a_planted_positive_still_answers_yes_and_a_null_never_does(planted_run):
    """The verdict re-judged on random subsets of the stored tables (probe.study.subsets, no model reruns):
    trigger-saturated at 12 scored examples (drawn from the texts that hold the trigger; half its texts do,
    and the others are left out by the effect floor) answers yes at 95% of draws at least, so "undecidable
    whenever n is small" cannot pass; at 24 examples of all its texts, every draw with at least 10 scored
    (the minimum any answer rests on) says yes; the null
    position-heads (72 heads that know nothing of the deciding word) answers yes or heads only at no
    more than 5% of draws of 10, 12, 20 and 40 examples."""
    from probe.study.calibration import read_folder
    from probe.study.subsets import scored_examples, subset_answers, subset_summary

    tables, study, dtype, sanity = read_folder(planted_run("trigger-saturated")[1])
    scored = scored_examples(tables, study, dtype=dtype)
    assert 0.3 * len(tables["examples"]) < len(scored) < 0.7 * len(tables["examples"])  # about half hold zz
    positive = subset_answers(tables, study, dtype=dtype, sanity=sanity, sizes=(12,), draws=20, seed=1, pool=scored)
    assert (positive.n_scored == 12).all() and (positive.answer == "yes").mean() >= 0.95, positive
    mixed = subset_answers(tables, study, dtype=dtype, sanity=sanity, sizes=(24,), draws=10, seed=1)
    enough = mixed[mixed.n_scored >= 10]
    assert len(enough) >= 5 and (enough.answer == "yes").all(), mixed
    assert (mixed[mixed.n_scored < 10].answer == "undecidable").all()
    tables, study, dtype, sanity = read_folder(planted_run("position-heads")[1])
    null = subset_summary(subset_answers(tables, study, dtype=dtype, sanity=sanity, sizes=(10, 12, 20, 40), draws=5,
                                         seed=2))
    assert (null.positive <= 0.05).all(), null


def test_judged_against_shapley_values_the_randomised_model_still_gets_no_yes(tmp_path):
    """Shapley values as the verdict reference on a model whose weights are random: the reference changes,
    the answer must not become "yes" (attention and Shapley values of random weights agree by chance only)."""
    template = load_study(ROOT / "studies" / "planted.yaml")
    template = template.model_copy(update={
        "references": [*template.references, "shapley"],
        "statistics": template.statistics.model_copy(update={"reference": "shapley"})})
    row = run_planted(template, names=["randomised"], results=tmp_path, n=24).iloc[0]
    verdict = json.loads((tmp_path / "randomised" / "verdict.json").read_text())
    assert verdict["reference"] == "shapley"
    assert row.answer in PLANTED_MODELS["randomised"].expected, row.headline
