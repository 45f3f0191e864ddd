"""A study of a language model's output token by token (``target.generate`` / ``target.steps``):
every output token is a unit, explained as the API explains it, and the statistics, the verdict and
the report are over the dataset examples (each the mean of its output tokens), not over the units."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from probe.errors import InputError
from probe.metrics.statistics import group_seed, summarize
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

WORDS = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting"]
N_EXAMPLES = 10
NEW_TOKENS = 3


def _dataset(path: Path) -> Path:
    texts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4 + i % 3)) for i in range(N_EXAMPLES)]
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(N_EXAMPLES)]}).to_csv(path, index=False)
    return path


def _study(model, data, out, target, **metrics) -> dict:
    return {"name": "steps", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": N_EXAMPLES, "seed": 0},
            "target": target, "explainers": ["attention_mean", "saliency"], "references": ["loo_delete"],
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False, "examples": 2}, **metrics},
            "statistics": {"bootstrap": 200}, "engine": {"batch_size": 5}, "output": str(out)}


@pytest.fixture(scope="module")
def step_run(tiny_dirs, tmp_path_factory):
    """A finished step study on tiny GPT-2: its folder, model and dataset texts."""
    import probe
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    root = tmp_path_factory.mktemp("step_study")
    data = _dataset(root / "data.csv")
    spec = _study(tiny_dirs["gpt2"], data, root / "out", {"generate": NEW_TOKENS})
    first = run_study(study_from_dict(spec), progress=False, log=lambda _: None, stop_after=1)
    assert not first.complete  # stopped after one of two batches: the second is a resume
    result = run_study(study_from_dict(spec), progress=False, log=lambda _: None)
    assert result.complete and result.computed == [1]
    return root / "out", probe.load_model(str(tiny_dirs["gpt2"])), pd.read_csv(data)["text"].tolist()


def test_every_output_token_is_a_unit_explained_as_the_api_explains_it(step_run):
    from probe.methods import run_method

    out, pm, _ = step_run
    examples = pd.read_parquet(out / "examples.parquet")
    assert examples["example"].is_unique  # across the two batches and the resume
    assert sorted(examples["source"].unique()) == list(range(N_EXAMPLES))
    scores = pd.read_parquet(out / "scores.parquet")
    for _source, units in examples.groupby("source"):
        text = units["text"].iloc[0]
        by_api = prepare(pm, [text], TargetSpec(steps=True, max_new_tokens=NEW_TOKENS))
        assert units.sort_values("step")["step"].tolist() == list(range(len(by_api)))
        assert units.sort_values("step")["target_value"].to_numpy() == pytest.approx(
            [e.original_value for e in by_api], abs=1e-5)
        saliency = run_method(pm, by_api, "saliency")
        for _, unit in units.iterrows():
            stored = scores[(scores["example"] == unit["example"]) & (scores["method"] == "saliency")]
            got = stored.sort_values("position")["score"].to_numpy()
            assert got == pytest.approx(saliency.scores[int(unit["step"])].numpy(), abs=1e-5)


def test_the_statistics_are_over_the_examples_each_the_mean_of_its_output_tokens(step_run):
    out, _, _ = step_run
    examples = pd.read_parquet(out / "examples.parquet")
    units = pd.read_parquet(out / "agreement.parquet")
    summary = pd.read_parquet(out / "summary.parquet")
    assert len(examples) > N_EXAMPLES  # more units than examples, or the test says nothing
    owner = examples.set_index("example")["source"]
    sel = units[(units["explainer"] == "attention_mean") & (units["layer"] == 0) & (units["reference"] == "loo_delete")]
    per_prompt = sel.assign(source=owner.reindex(sel["example"]).to_numpy()).groupby("source")["kendall_tau"].mean()
    row = summary[(summary["explainer"] == "attention_mean") & (summary["layer"] == 0)
                  & (summary["measure"] == "kendall_tau")].iloc[0]
    assert int(row["n"]) == N_EXAMPLES and row["mean"] == pytest.approx(per_prompt.mean(), abs=1e-12)
    # the CI is a bootstrap over the ten prompts (resampling the units would give another interval)
    seeded = summarize(per_prompt.to_numpy(), n_boot=200, level=0.95,
                       seed=group_seed(("explainer", "attention_mean", "loo_delete", 0, -1), 0))
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((seeded["ci_low"], seeded["ci_high"]), abs=1e-12)
    verdict = json.loads((out / "verdict.json").read_text())
    assert "too few scored examples" not in json.dumps(verdict)  # ten examples decide, whatever the units
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["examples"] == N_EXAMPLES and provenance["output_tokens"] == len(examples)


def test_per_source_averages_each_measure_and_drops_the_unit_p_values():
    from probe.study.steps import per_source

    examples = pd.DataFrame({"example": [0, 1, 2, 1024], "source": [0, 0, 0, 1], "step": [0, 1, 2, 0]})
    agreement = pd.DataFrame({"example": [0, 1, 2, 1024], "explainer": "a", "reference": "r", "role": "explainer",
                              "layer": -1, "head": -1, "n_tokens": [4, 4, 4, 6],
                              "kendall_tau": [0.2, np.nan, 0.6, -0.5], "kendall_p": [0.01, 0.5, 0.02, 0.3]})
    out = per_source(agreement, examples)
    assert out["example"].tolist() == [0, 1]
    assert out["kendall_tau"].tolist() == pytest.approx([0.4, -0.5])  # NaN steps left out of the mean
    assert out["n_steps"].tolist() == [3, 1] and out["kendall_p"].isna().all()


def test_the_report_of_a_step_study_draws_agreement_by_step_and_output_matrices(step_run, tmp_path):
    from probe.report.build import build_report
    from probe.report.results import load_result
    from probe.report.steps import step_lines, unit_matrix

    out, _, _ = step_run
    r = load_result(out)
    assert r.stepwise and r.n_examples == N_EXAMPLES and r.n_units > N_EXAMPLES
    assert r.table("agreement")["example"].nunique() == N_EXAMPLES  # what the report's statistics read
    files = build_report(out, tmp_path / "report")
    text = Path(files.markdown).read_text()
    assert "## Output tokens" in text and f"· {N_EXAMPLES} examples ·" in text
    figures = {p.name for p in (tmp_path / "report" / "figures").iterdir()}
    assert "steps.png" in figures and any(f.startswith("matrix_e") for f in figures)
    lines = step_lines(r)
    assert set(lines["step"]) == set(range(int(r.table("examples")["step"].max()) + 1))
    # a matrix row is that output token's stored scores
    examples, scores = r.table("examples"), r.table("scores")
    values, rows, columns = unit_matrix(r, 0, "loo_delete")
    units = examples[examples["source"] == 0].sort_values("step")
    assert values.shape == (len(units), len(columns)) and len(rows) == len(units)
    for j, unit in enumerate(units["example"]):
        stored = scores[(scores["example"] == unit) & (scores["method"] == "loo_delete")].sort_values("position")
        assert values[j] == pytest.approx(stored["score"].to_numpy(), abs=1e-7, nan_ok=True)


@pytest.mark.parametrize("target, message", [
    ({"generate": 4, "continuation": " good"}, "generate writes the output and continuation gives it"),
    ({"steps": True}, "steps: true explains each token of a continuation"),
    ({"generate": 4, "choices": [" a", " b"]}, "cannot be combined with choices"),
    ({"generate": 4, "contrast": " bad"}, "a contrast is set against a given output"),
    ({"generate": 0}, "generate"),
    ({"generate": 2000}, "generate"),
    ({"target_side": True}, "target_side scores the output written before each output token"),
])
def test_a_study_file_refuses_a_step_target_it_cannot_explain(tmp_path, target, message):
    from probe.spec.study import study_from_dict

    with pytest.raises(InputError) as err:
        study_from_dict(_study("builtin:smollm2-135m", "builtin:rotten_tomatoes", tmp_path / "out", target))
    assert message in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_a_step_study_on_a_classifier_is_refused_before_it_writes(tiny_dirs, tmp_path):
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    data = _dataset(tmp_path / "data.csv")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="target.generate explains a language model's output token by token"):
        run_study(study_from_dict(_study(tiny_dirs["bert"], data, out, {"generate": 2})), progress=False,
                  log=lambda _: None)
    assert not list(out.glob("*.parquet"))


def test_a_claim_over_generated_tokens_is_judged_over_the_prompts(tiny_dirs):
    """token_importance with target.generate: each output token's top-1 match (its own attention row
    against its own leave-one-out), averaged per prompt, then judged over the prompts."""
    import probe
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit
    from probe.explainers.attention import attention
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo

    texts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4 + i % 3)) for i in range(N_EXAMPLES)]
    pm = probe.load_model(str(tiny_dirs["gpt2"]))
    spec = claims_from_dict({"model": {"id": str(tiny_dirs["gpt2"])}, "data": {"texts": texts},
                             "target": {"generate": NEW_TOKENS},
                             "claims": [{"claim": "when it writes, the most-attended token matters most",
                                         "kind": "token_importance", "attention": "attention@1.2"}]})
    result = run_audit(spec, model=pm)
    units = prepare(pm, texts, TargetSpec(steps=True, max_new_tokens=NEW_TOKENS))
    att = attention(pm, units).scores
    ref = loo(Engine(pm), units, "delete").scores
    per_prompt: dict[str, list[float]] = {}
    for i, unit in enumerate(units):
        per_prompt.setdefault(unit.text, []).append(float(np.argmax(att[i][1, 2].numpy()) == np.argmax(ref[i].numpy())))
    assert len(units) > N_EXAMPLES and len(per_prompt) == N_EXAMPLES
    claim = result.claims[0]
    assert claim.evidence["n_excluded"] == 0
    assert claim.effect == pytest.approx(np.mean([np.mean(v) for v in per_prompt.values()]))
    evidence = claim.evidence["for"] + claim.evidence["against"]
    assert evidence and all("step" in e and e["text"] in texts for e in evidence)


def test_when_it_writes_the_most_attended_span_is_the_most_important_one(tiny_dirs):
    """The issue's claim: token_importance over spans of the prompt, for every generated token,
    checked by hand (attention summed over each span, each span deleted in one forward)."""
    import probe
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit
    from probe.explainers.attention import attention
    from probe.rows.values import evaluate

    texts = ["the movie was good and the plot was bad", "the film is fun but the story is boring",
             "a boring plot and the worst film", "the acting was great , the ending was not"]
    pattern = r"the \w+|bad|boring|fun|great|not|good"
    pm = probe.load_model(str(tiny_dirs["gpt2"]))
    spec = claims_from_dict({"model": {"id": str(tiny_dirs["gpt2"])}, "data": {"texts": texts},
                             "target": {"generate": NEW_TOKENS}, "spans": {"pattern": pattern},
                             "claims": [{"claim": "when it writes, the most-attended span matters most",
                                         "kind": "token_importance", "attention": "attention@1.0"}]})
    claim = run_audit(spec, model=pm).claims[0]
    units = prepare(pm, texts, TargetSpec(steps=True, max_new_tokens=NEW_TOKENS))
    att = attention(pm, units).scores
    per_prompt: dict[str, list[float]] = {}
    for i, unit in enumerate(units):
        spans = probe.find_spans(pm, unit, pattern)
        x = [float(att[i][1, 0, list(s.positions)].sum()) for s in spans]
        whole = float(evaluate(pm, [(unit.input_ids, unit)])[0])
        y = [whole - float(evaluate(pm, [([t for p, t in enumerate(unit.input_ids) if p not in s.positions], unit)])[0])
             for s in spans]
        per_prompt.setdefault(unit.text, []).append(float(np.argmax(x) == np.argmax(y)))
    assert claim.effect == pytest.approx(np.mean([np.mean(v) for v in per_prompt.values()]))
    assert claim.n == len(texts)


def test_the_sink_table_covers_the_first_dataset_examples_in_every_batch(step_run):
    """The sinks table (probe.study.sinks) is measured on the first SINK_EXAMPLES dataset examples,
    counted by dataset example, not by unit number: the second batch (examples 5-9) holds 5, 6 and 7."""
    from probe.study.sinks import SINK_EXAMPLES

    out, _, _ = step_run
    sinks = pd.read_parquet(out / "sinks.parquet")
    examples = pd.read_parquet(out / "examples.parquet").set_index("example")["source"]
    assert sorted(examples.loc[sinks["example"].unique()].unique()) == list(range(min(SINK_EXAMPLES, N_EXAMPLES)))
