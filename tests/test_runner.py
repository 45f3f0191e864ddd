"""Studies: the runner, the result store (resume, refusal, shards, torchrun) and the statistics."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from probe.errors import InputError, ProbeError
from probe.metrics.statistics import paired_bootstrap_ci, wilcoxon_method
from probe.names import TABLES
from probe.spec.study import study_from_dict
from probe.study.runner import run_study

from tolerances import fp_close, fp_tol, model_depth

#: The tolerance of two runs of the tiny study in other processes or threads (other summation orders).
#: Its target is the tiny classifier's class probability, so every number in its tables is bounded by 1
#: (scores: attention, gradients of a probability and their per-dim terms; LOO, erasure and head rows:
#: differences of probabilities; TVD, JSD, correlations, p-values): scale 1, after a forward and backward
#: pass of the 2-layer bert (depth 2 x (2 + 2), tolerances.py). Absolute, rtol 0.
TABLE_ATOL = fp_tol(1.0, depth=2 * (2 + 2))

WORDS = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting",
         "not", "very", "really", "awful", "excellent", "slow", "funny", "ending"]


def write_dataset(path: Path, n: int = 24, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        rows.append({"text": " ".join(words), "label": i % 2})
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def tiny_study(model: Path, data: Path, out: Path, **overrides) -> dict:
    study = {
        "name": "tiny",
        "model": {"id": str(model)},
        "dataset": {"name": str(data), "n": 12, "seed": 1},
        "explainers": ["attention", "attention_mean", "rollout", "saliency", "input_x_gradient"],
        "references": ["loo_delete", "loo_mask"],
        "params": {},
        "metrics": {"top_k": [1, 3], "erasure": {"rankings": ["attention_mean@last", "saliency"], "bins": [10, 50]},
                    "counterfactual": {"layers": ["last"], "permutations": 3, "adversarial": True,
                                       "adversarial_steps": 20, "adversarial_candidates": 2},
                    "heads": {"ablation": True, "importance": True},
                    # a random tiny model fails cascading randomisation (its scores barely move when its
                    # random top layer is redrawn), which would leave these tests without a gradient bar
                    "sanity": {"randomisation": False}},
        "statistics": {"bootstrap": 200, "reference": "loo_delete"},
        "engine": {"batch_size": 5},
        "output": str(out),
    }
    for key, value in overrides.items():
        study[key] = value
    return study


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    return {name: pd.read_parquet(folder / f"{name}.parquet") for name in TABLES if (folder / f"{name}.parquet").exists()}


def assert_same_tables(a: Path, b: Path, exact: bool = True) -> None:
    ta, tb = read_tables(a), read_tables(b)
    assert set(ta) == set(tb) and {"examples", "agreement", "scores", "erasure", "counterfactual", "heads"} <= set(ta)
    for name in ta:
        if exact:
            pd.testing.assert_frame_equal(ta[name], tb[name], check_exact=True)
        else:
            pd.testing.assert_frame_equal(ta[name], tb[name], check_exact=False, rtol=0, atol=TABLE_ATOL)
    sa, sb = pd.read_parquet(a / "summary.parquet"), pd.read_parquet(b / "summary.parquet")
    pd.testing.assert_frame_equal(sa, sb, check_exact=exact, **({} if exact else {"rtol": 0, "atol": TABLE_ATOL}))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "reviews.csv")


@pytest.fixture(scope="module")
def full_run(tiny_dirs, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    study = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out))
    result = run_study(study, progress=False, log=lambda _: None)
    return study, result, out


def test_run_writes_every_table_and_a_verdict(full_run):
    study, result, out = full_run
    assert result.complete and result.n_examples == 12 and result.n_batches == 3 and result.computed == [0, 1, 2]
    tables = read_tables(out)
    assert len(tables["examples"]) == 12 and tables["examples"]["example"].tolist() == list(range(12))
    agreement = tables["agreement"]
    # per-head attention: every layer x head of the tiny BERT, for every example and reference
    heads = agreement[(agreement.explainer == "attention") & (agreement.reference == "loo_delete")]
    assert heads.groupby("example").size().eq(2 * 4).all()  # tiny BERT: 2 layers x 4 heads
    assert set(agreement.role) == {"explainer", "baseline", "ceiling"}
    assert {"random", "uniform", "position"} <= set(agreement.explainer)
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["answer"] in ("yes", "heads only", "no", "undecidable") and verdict["rule"].startswith("An "
                                                                                                          "attention")
    assert verdict["reference"] == "loo_delete" and verdict["best_gradient"]["explainer"] in ("saliency", "input_x_gradient")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["examples"] == 12 and prov["forward_passes_per_example"] > 1 and prov["peak_memory_bytes"] > 0
    assert prov["attn_implementation"] and prov["dtype"] == "float32" and prov["model"]["weights_sha256"]
    assert set(prov["versions"]) >= {"probe", "torch", "transformers", "captum"}


def test_the_pair_check_and_the_sinks_pass_can_be_switched_off(full_run, tiny_dirs, tiny_data, tmp_path):
    """A study that does only the floor's work (benchmarks/peers_study.yaml) turns them off; the other
    tables are the default study's, and the verdict says nothing of interacting tokens."""
    _, _, full = full_run
    assert (full / "interactions.parquet").exists() and (full / "sinks.parquet").exists()
    out = tmp_path / "off"
    metrics = {**tiny_study(tiny_dirs["bert"], tiny_data, out)["metrics"], "interactions": False, "sinks": None}
    result = run_study(study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out, metrics=metrics)), progress=False,
                       log=lambda _: None)
    assert result.complete and not (out / "interactions.parquet").exists() and not (out / "sinks.parquet").exists()
    assert json.loads((out / "verdict.json").read_text())["interactions"] is None
    pd.testing.assert_frame_equal(read_tables(out)["agreement"], read_tables(full)["agreement"], check_exact=True)


def test_finalize_returns_the_frozen_verdict_it_wrote(full_run, tmp_path):
    import dataclasses

    from probe.study.store import write_json
    from probe.study.verdict import Verdict

    _, result, out = full_run
    verdict = result.verdict
    assert isinstance(verdict, Verdict) and verdict == Verdict.read(out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.answer = "no"
    # the verdict was complete before it was made: sanity, unreliable and redundant are in it, last
    data = verdict.to_dict()
    assert list(data)[-6:] == ["headline", "sanity", "unreliable", "unreliable_units", "redundant", "frontier"]
    assert data["sanity"]
    write_json(tmp_path / "again.json", data)
    assert (tmp_path / "again.json").read_bytes() == (out / "verdict.json").read_bytes()
    data["answer"], data["families"] = "changed", {}
    assert verdict.to_dict()["answer"] == verdict.answer != "changed" and verdict.to_dict()["families"]


def test_agreement_rows_equal_scipy_on_the_stored_scores(full_run):
    """The independent oracle: recompute tau/rho from the stored score table with scipy."""
    _, _, out = full_run
    tables = read_tables(out)
    scores, tokens, agreement = tables["scores"], tables["tokens"], tables["agreement"]
    checked = 0
    for example in (0, 7):
        scored = tokens[(tokens.example == example) & tokens.scored].position.to_numpy()
        ref = scores[(scores.example == example) & (scores.method == "loo_mask")].set_index("position").score
        for layer, head in ((0, 1), (1, 3)):
            att = scores[(scores.example == example) & (scores.method == "attention") & (scores.layer == layer)
                         & (scores["head"] == head)].set_index("position").score
            row = agreement[(agreement.example == example) & (agreement.explainer == "attention")
                            & (agreement.reference == "loo_mask") & (agreement.layer == layer) & (agreement["head"] == head)]
            tau, p = scipy.stats.kendalltau(att[scored].to_numpy(np.float64), ref[scored].to_numpy(np.float64))
            rho, _ = scipy.stats.spearmanr(att[scored].to_numpy(np.float64), ref[scored].to_numpy(np.float64))
            # correlations and p-values (bounded by 1) in fp64: absolute
            assert row.kendall_tau.item() == pytest.approx(tau, abs=1e-9)
            assert row.kendall_p.item() == pytest.approx(p, abs=1e-9)
            assert row.spearman.item() == pytest.approx(rho, abs=1e-9)
            assert row.n_tokens.item() == len(scored)
            checked += 1
    assert checked == 4
    # special tokens and padding never enter: [CLS]/[SEP] positions are not scored
    assert not tokens[tokens.special].scored.any()


def test_summary_matches_the_agreement_table(full_run):
    _, _, out = full_run
    agreement = pd.read_parquet(out / "agreement.parquet")
    summary = pd.read_parquet(out / "summary.parquet")
    row = summary[(summary.explainer == "saliency") & (summary.reference == "loo_delete")
                  & (summary.measure == "kendall_tau")]
    values = agreement[(agreement.explainer == "saliency") & (agreement.reference == "loo_delete")].kendall_tau
    assert row["mean"].item() == pytest.approx(values.mean())
    assert row["n"].item() == values.notna().sum()
    assert row.ci_low.item() <= values.mean() <= row.ci_high.item()
    p = agreement[(agreement.explainer == "saliency") & (agreement.reference == "loo_delete")].kendall_p
    assert row.sig_frac.item() == pytest.approx((p <= 0.05).mean())


def test_the_sanity_checks_read_the_studys_own_scores_and_find_what_computing_them_finds(full_run, loaded):
    """The trained model's scores of the sanity sample are read back from the batches, equal to a fresh
    computation, and the checks on them are the checks on the fresh scores."""
    import torch

    from probe.methods import run_method
    from probe.study import runner
    from probe.study.checks import study_sanity
    from probe.study.examples import select_examples
    from probe.study.store import ResultStore
    from probe.study.tables import convergence_rows, score_rows, scores_from_rows

    study, _, out = full_run
    pm = loaded("bert")
    data, _ = select_examples(pm, study.dataset, study.target)
    sample = data[: study.metrics.sanity.examples]
    examples = runner.prepare_study_examples(pm, study, [e.text for e in sample], [e.label for e in sample])
    stored = runner._stored_scores(ResultStore(out), study, examples)
    assert set(stored) == set(study.explainers) | set(study.references)
    for method, result in stored.items():
        fresh = run_method(pm, examples, method, params=study.params.get(method))
        assert (result.per_head, result.per_layer) == (fresh.per_head, fresh.per_layer), method
        for a, b in zip(result.scores, fresh.scores, strict=True):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=TABLE_ATOL)
    read = study_sanity(pm, study, examples, stored=stored)
    computed = study_sanity(pm, study, examples)
    assert [(c.method, c.check, c.status) for c in read] == [(c.method, c.check, c.status) for c in computed]

    ig = run_method(pm, examples[:3], "integrated_gradients", params={"steps": 8})  # a path method's extras
    back = scores_from_rows(score_rows(examples[:3], 0, {"integrated_gradients": ig}),
                            convergence_rows(0, {"integrated_gradients": ig}), examples[:3])["integrated_gradients"]
    assert all(torch.equal(a, b) for a, b in zip(back.scores, ig.scores))
    gap = np.subtract(ig.extras["target_value"], ig.extras["baseline_value"])
    assert np.allclose(np.subtract(back.extras["target_value"], back.extras["baseline_value"]), gap)
    assert np.allclose(back.extras["convergence_delta"], ig.extras["convergence_delta"])
    assert scores_from_rows(score_rows(examples[:3], 0, {"integrated_gradients": ig}), None, examples[:3]) == {}


def test_interrupted_run_resumes_to_identical_tables(full_run, tiny_dirs, tiny_data, tmp_path):
    _, _, reference = full_run
    out = tmp_path / "resumed"
    study = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out))
    first = run_study(study, progress=False, log=lambda _: None, stop_after=1)
    assert first.computed == [0] and not first.complete and not (out / "agreement.parquet").exists()
    # a half-written batch (parts without its done marker) is recomputed, never trusted
    (out / "parts" / "agreement").mkdir(parents=True, exist_ok=True)
    (out / "parts" / "agreement" / "b00001.parquet").write_bytes(b"garbage from a killed run")
    second = run_study(study, progress=False, log=lambda _: None)
    assert second.computed == [1, 2] and second.skipped == [0] and second.complete
    third = run_study(study, progress=False, log=lambda _: None)
    assert third.computed == [] and third.complete
    assert_same_tables(reference, out)


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_kill_9_then_rerun_gives_identical_tables(full_run, tiny_dirs, tiny_data, tmp_path):
    import yaml

    _, _, reference = full_run
    out = tmp_path / "killed"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tiny_dirs["bert"], tiny_data, out)))
    cmd = [sys.executable, "-m", "probe", "run", str(path), "--no-progress", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "done").is_dir() and any((out / "done").glob("b*.json")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in (out / "done").glob("b*.json"))
    assert 1 <= len(done) < 3 and not (out / "verdict.json").exists()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "already done" in rerun.stderr
    assert_same_tables(reference, out, exact=False)  # another process: same numbers up to thread rounding


def test_another_studys_folder_is_refused_and_left_intact(full_run, tiny_dirs, tiny_data):
    _, _, out = full_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    other = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out, references=["loo_delete", "loo_pad"]))
    with pytest.raises(InputError, match="another study"):
        run_study(other, progress=False, log=lambda _: None)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_a_folder_that_is_not_a_result_is_refused(tiny_dirs, tiny_data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not empty"):
        run_study(study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out)), progress=False, log=lambda _: None)
    assert (out / "notes.txt").read_text() == "keep me"


def test_bad_inputs_are_one_line_errors(tiny_dirs, tiny_data, tmp_path):
    with pytest.raises(InputError, match="n=500 is larger"):
        run_study(study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, tmp_path / "a",
                                             dataset={"name": str(tiny_data), "n": 500})),
                  progress=False, log=lambda _: None)
    missing = tmp_path / "nolabel.csv"
    pd.DataFrame({"text": ["good film", "bad film"]}).to_csv(missing, index=False)
    with pytest.raises(InputError, match="label"):
        run_study(study_from_dict(tiny_study(tiny_dirs["bert"], missing, tmp_path / "b")), progress=False,
                  log=lambda _: None)
    with pytest.raises(ProbeError, match="does not exist"):
        run_study(study_from_dict(tiny_study(tmp_path / "no-such-model", tiny_data, tmp_path / "c")),
                  progress=False, log=lambda _: None)
    assert not (tmp_path / "c").exists()  # nothing written for a study that cannot start
    # what a method applies to is read from its registry entry: loo_lm needs a causal LM, loo_mask a
    # mask token (the tiny GPT-2 has none); the alternatives named are the family's methods that apply
    with pytest.raises(InputError, match=r"loo_lm cannot run on .*: needs a causal LM.*; use loo_delete, loo_mask"):
        run_study(study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, tmp_path / "d",
                                             references=["loo_delete", "loo_lm"])), progress=False, log=lambda _: None)
    with pytest.raises(InputError, match=r"loo_mask cannot run on .*: the tokenizer has no mask token; use loo_delete"):
        run_study(study_from_dict(tiny_study(tiny_dirs["gpt2"], tiny_data, tmp_path / "e",
                                             references=["loo_delete", "loo_mask"])), progress=False,
                  log=lambda _: None)
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(InputError, match="writable"):
            run_study(study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, locked / "out")), progress=False,
                      log=lambda _: None)


def test_shards_merge_into_the_single_process_result(full_run, tiny_dirs, tiny_data, tmp_path):
    _, _, reference = full_run
    out = tmp_path / "sharded"
    study = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out))
    a = run_study(study, shard=(1, 2), progress=False, log=lambda _: None)
    assert a.computed == [1] and not a.complete
    b = run_study(study, shard=(0, 2), progress=False, log=lambda _: None)
    assert b.computed == [0, 2] and b.complete
    assert_same_tables(reference, out)


def test_shards_give_one_process_tables_for_shapley_and_knockout(tiny_dirs, tiny_data, tmp_path, monkeypatch):
    """Shapley values (sampled: more players than exact_max, seeded) and edge knockout as references:
    a study run as two shards gives, table by table, exactly what one process gives. Exact, not
    within rounding: a batch always holds the same examples and its own engine, and every draw is
    seeded by the example's content, so a shard computes each batch with the same calls. The same with the
    model handed to accelerate's device map (``model.device_map: auto``; all on the CPU here)."""
    def study(out: Path, **model):
        spec = tiny_study(
            tiny_dirs["bert"], tiny_data, out, explainers=["attention_mean", "rollout"],
            references=["loo_delete", "shapley", "knockout"],
            params={"shapley": {"exact_max": 3, "permutations": 4, "seed": 7}, "knockout": {"layers": -1}},
            metrics={"top_k": [1, 3], "erasure": None, "counterfactual": None, "heads": None,
                     "sanity": {"randomisation": False}})
        return study_from_dict({**spec, "model": {**spec["model"], **model}})

    whole = run_study(study(tmp_path / "one"), progress=False, log=lambda _: None)
    first = run_study(study(tmp_path / "two"), shard=(1, 2), progress=False, log=lambda _: None)
    second = run_study(study(tmp_path / "two"), shard=(0, 2), progress=False, log=lambda _: None)
    assert whole.complete and whole.computed == [0, 1, 2]
    assert first.computed == [1] and second.computed == [0, 2] and second.complete
    one, two = read_tables(tmp_path / "one"), read_tables(tmp_path / "two")
    assert set(one) == set(two) and {"examples", "agreement", "scores"} <= set(one)
    assert {"shapley", "knockout"} <= set(one["scores"]["method"]) <= set(two["scores"]["method"])
    assert {"shapley", "knockout"} <= set(one["agreement"]["reference"])
    for name in one:
        pd.testing.assert_frame_equal(one[name], two[name], check_exact=True, obj=name)
    for name in ("summary", "comparisons"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "one" / f"{name}.parquet"),
                                      pd.read_parquet(tmp_path / "two" / f"{name}.parquet"), check_exact=True, obj=name)
    # the model handed to accelerate's device map (all on the CPU here), as two shards: the same tables
    mapped = study(tmp_path / "mapped", device_map="auto")
    assert mapped.fingerprint() != study(tmp_path / "one").fingerprint()
    import probe.models.loading as loading

    asked = []
    original = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: asked.append(k.get("device_map")) or original(*a, **k))
    run_study(mapped, shard=(1, 2), progress=False, log=lambda _: None)
    assert run_study(mapped, shard=(0, 2), progress=False, log=lambda _: None).complete
    assert asked == ["auto", "auto"]  # each shard loaded it through accelerate's device map
    three = read_tables(tmp_path / "mapped")
    for name in one:
        pd.testing.assert_frame_equal(one[name], three[name], check_exact=True, obj=name)


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_torchrun_with_two_gloo_processes_matches_one_process(full_run, tiny_dirs, tiny_data, tmp_path):
    import yaml

    _, _, reference = full_run
    out = tmp_path / "torchrun"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_study(tiny_dirs["bert"], tiny_data, out)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PROBE_DIST_BACKEND": "gloo",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "probe", "run", str(path), "--no-progress"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    infos = [json.loads(p.read_text()) for p in sorted((out / "done").glob("b*.json"))]
    assert sorted(tuple(i["shard"]) for i in infos) == [(0, 2), (0, 2), (1, 2)]
    assert_same_tables(reference, out, exact=False)


def _cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_cli_overrides_n_and_dataset_and_reports_a_verdict(tiny_dirs, tiny_data, tmp_path):
    import yaml

    other = write_dataset(tmp_path / "other.csv", n=30, seed=5)
    path = tmp_path / "tiny.yaml"
    study = tiny_study(tiny_dirs["bert"], tiny_data, tmp_path / "unused")
    study["metrics"]["counterfactual"] = None
    study["metrics"]["heads"] = None
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "cli"
    proc = _cli("run", str(path), "--n", "11", "--dataset", str(other), "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(":")[0] in ("YES", "NO", "HEADS ONLY") and str(out) in proc.stdout
    examples = pd.read_parquet(out / "examples.parquet")
    texts = set(pd.read_csv(other).text)
    assert len(examples) == 11 and set(examples.text) <= texts
    recorded = json.loads((out / "study.json").read_text())["study"]
    assert recorded["dataset"]["n"] == 11 and recorded["dataset"]["name"] == str(other)
    # fewer examples than any answer may rest on: undecidable, and it says why (DESIGN rule 16)
    few = _cli("run", str(path), "--n", "7", "--dataset", str(other), "--out", str(tmp_path / "few"), "--no-progress")
    assert few.returncode == 0 and few.stdout.startswith("UNDECIDABLE") and "at least 10 needed" in few.stdout


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  id: builtin:minilm-rt\n  dtpye: fp32\n")
    proc = _cli("run", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "line 4" in proc.stderr and "dtpye" in proc.stderr
    proc = _cli("run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "study file not found" in proc.stderr
    proc = _cli("run", str(bad), "--shard", "3/2")
    assert proc.returncode == 2 and "--shard" in proc.stderr


def test_causal_lm_choices_mark_the_prompt_and_pick_the_preferred_answer(tiny_dirs, tiny_data, tmp_path):
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec
    from probe.study.runner import prepare_study_examples

    pm = load_model(str(tiny_dirs["llama_gqa"]))
    study = study_from_dict({**tiny_study(tiny_dirs["llama_gqa"], tiny_data, tmp_path / "x"),
                             "target": {"kind": "logprob", "prompt": "i saw this film , {text} . it was",
                                        "choices": [" bad", " good"]}})
    texts = ["the plot was fun", "boring and slow acting"]
    examples = prepare_study_examples(pm, study, texts)
    for text, example in zip(texts, examples):
        words = [t for t, s in zip(example.tokens, example.special) if not s]
        assert words == text.split()  # the template's tokens are kept in the input but never scored
        values = [prepare(pm, [f"i saw this film , {text} . it was"], TargetSpec(kind="logprob", continuation=c))[0]
                  .original_value for c in (" bad", " good")]
        assert example.label == int(np.argmax(values))
        # log-probs (unbounded), the study's prompt and prepare's: one forward each, at their scale
        assert fp_close(example.original_value, max(values), depth=model_depth(pm)), (example.original_value, values)


def test_erasure_without_flips_skips_their_rows_and_leaves_the_curves_unchanged(tiny_dirs, tiny_data, tmp_path):
    """``metrics.erasure.flips: false`` drops only the decision-flip rows (one per token depth and
    ranking): fewer rows are run, the flip column is empty, and the curves are the ones the default
    computes (float rounding aside: the passes are packed differently)."""
    runs = {}
    for flips in (True, False):
        metrics = {"top_k": [1], "counterfactual": None, "heads": None, "sanity": {"randomisation": False},
                   "erasure": {"rankings": ["attention_mean@last", "saliency"], "bins": [10, 50], "flips": flips}}
        out = tmp_path / f"flips-{flips}"
        study = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, out, metrics=metrics,
                                           explainers=["attention_mean", "saliency"], references=["loo_delete"]))
        assert run_study(study, progress=False, log=lambda _: None).complete
        rows = sum(json.loads(p.read_text())["forward_rows"] for p in (out / "done").glob("b*.json"))
        runs[flips] = (pd.read_parquet(out / "erasure.parquet"), rows)
    (full, full_rows), (without, without_rows) = runs[True], runs[False]
    # each of 12 examples has >= 2 scorable tokens, so each of its 3 rankings (with random) had >= 2 flip rows
    assert without_rows <= full_rows - 12 * 3 * 2
    assert without.flip.isna().all()
    keys = ["example", "ranking", "bin"]
    both = full.merge(without, on=keys, suffixes=("", "_without"))
    assert len(both) == len(full) == len(without) == 12 * 3 * 2
    for column in ("comprehensiveness", "sufficiency", "aopc", "aopc_sufficiency"):
        # differences of class probabilities (bounded by 1): absolute
        np.testing.assert_allclose(both[column + "_without"], both[column], rtol=1e-5, atol=1e-6)


def test_real_model_study_ceiling_beats_random(tmp_path):
    """builtin:minilm-rt on 16 held-out sentences: the two LOO references agree far above chance."""
    study = study_from_dict({
        "name": "real", "model": {"id": "builtin:minilm-rt"},
        "dataset": {"name": "builtin:rotten_tomatoes", "n": 16, "seed": 3},
        "explainers": ["attention_mean", "rollout", "saliency"], "references": ["loo_delete", "loo_mask"],
        "metrics": {"erasure": None, "counterfactual": None, "heads": None},
        "statistics": {"bootstrap": 500}, "engine": {"batch_size": 8}, "output": str(tmp_path / "real")})
    result = run_study(study, progress=False, log=lambda _: None)
    verdict = result.verdict
    assert verdict.ceiling["pair"] == ["loo_delete", "loo_mask"]
    assert verdict.ceiling["ci"][0] > verdict.random["ci"][1]
    # the headline counts the attention weights (attention_mean at each of 6 layers); rollout is its own family
    assert verdict.layer_units.total == 6 and verdict.data["headline_family"] == "attention weights"
    assert verdict.families["attention-derived"]["layer_units"]["total"] == 6
    prov = json.loads((tmp_path / "real" / "provenance.json").read_text())
    assert prov["accuracy"] >= 0.6 and prov["model"]["builtin"]


def test_paired_tests_compare_each_unit_with_the_best_gradient(full_run):
    study, _, out = full_run
    paired = pd.read_parquet(out / "paired.parquet")
    agreement = pd.read_parquet(out / "agreement.parquet")
    best = json.loads((out / "verdict.json").read_text())["best_gradient"]["explainer"]
    assert paired.diff_vs_gradient.notna().all() and (paired.vs_gradient == best).all()
    ref = agreement[agreement.reference == "loo_delete"]
    unit = ref[(ref.explainer == "attention_mean") & (ref.layer == 1)].set_index("example").kendall_tau
    grad = ref[(ref.explainer == best)].set_index("example").kendall_tau
    x, y = unit.align(grad, join="inner")
    diff = (x - y).dropna()
    row = paired[(paired.explainer == "attention_mean") & (paired.layer == 1)]
    assert row.diff_vs_gradient.item() == pytest.approx(diff.mean())
    method = wilcoxon_method(diff.to_numpy())
    assert row.wilcoxon_p.item() == pytest.approx(scipy.stats.wilcoxon(diff.to_numpy(), method=method).pvalue)
    assert row.above_chance.item() == (row.p_family.item() <= 0.05)
    # rule 2: non-inferiority, the one-sided bounds at alpha (the 1 - 2 alpha paired bootstrap interval)
    st = study.statistics
    low, high = paired_bootstrap_ci(x.to_numpy(), y.to_numpy(), n_boot=st.bootstrap, level=1 - 2 * st.alpha,
                                    seed=st.seed)
    assert row.rule2_low.item() == pytest.approx(low) and row.rule2_high.item() == pytest.approx(high)
    verdict = json.loads((out / "verdict.json").read_text())
    margin = st.margin * max(verdict["best_gradient"]["mean"] - verdict["random"]["mean"], 0.0)
    assert row.margin.item() == pytest.approx(margin)
    state = "not worse" if low > -margin else ("worse" if high < -margin else "undecided")
    assert row.rule2.item() == state and row.below_gradient.item() == (state == "worse")
    assert row.tracks.item() == (row.above_chance.item() and state == "not worse" and row.reliable.item())
    assert row.undecided.item() == (row.above_chance.item() and state == "undecided" and row.reliable.item())


def test_rule_1_is_rebuilt_from_the_stored_tables_exactly(full_run):
    """chance.parquet: every attention unit's observed statistic is the summary's mean (the permutation
    engine rebuilt each comparison from scores.parquet as agreement_rows did), its p-values lie in
    [1/(B+1), 1] and the family-wise one is never below the raw one."""
    study, result, out = full_run
    chance = pd.read_parquet(out / "chance.parquet")
    summary = pd.read_parquet(out / "summary.parquet")
    verdict = json.loads((out / "verdict.json").read_text())
    units = chance[chance.family != "ceiling"]
    assert len(units) and set(units.family) <= {"attention weights", "attention-derived", "context mixing",
                                                 "attention x gradient"}
    s = summary[(summary.role == "explainer") & (summary.reference == verdict["reference"])
                & (summary.measure == verdict["measure"])]
    merged = units.merge(s, on=["explainer", "layer", "head"])
    assert len(merged) == len(units)
    assert np.allclose(merged.observed, merged["mean"], atol=1e-9) and (merged.n_x == merged.n_y).all()
    b = study.statistics.permutations
    assert (units.p_chance >= 1 / (b + 1) - 1e-12).all() and (units.p_chance <= 1).all()
    assert (units.p_family >= units.p_chance - 1e-12).all()
    ceilings = chance[chance.family == "ceiling"]
    assert len(ceilings) and verdict["ceiling"]["p_chance"] in set(ceilings.p_chance)


@pytest.mark.parametrize("table", ["counterfactual", "heads"])
def test_out_of_memory_in_an_intervention_step_halves_the_examples(loaded, tiny_data, tmp_path, table, simulated_oom):
    """A counterfactual or head step that runs out of memory reruns on each half of the batch's
    examples: the same rows, in the same order, as an uninterrupted step."""
    from probe.rows.prepare import prepare
    from probe.study.tables import counterfactual_rows, head_rows

    pm = loaded("bert")
    study = study_from_dict(tiny_study(Path("unused"), tiny_data, tmp_path / "out"))
    examples = prepare(pm, ["the movie was good and fun", "bad film , not fun at all", "i loved the acting",
                            "slow plot"])
    step = counterfactual_rows if table == "counterfactual" else head_rows
    expected = step(pm, study, examples, 10)
    with simulated_oom(pm, lambda call, _: call == 1) as calls:  # the first model call fails
        got = step(pm, study, examples, 10)
    assert calls["failed"] == 1 and calls["calls"] > 2
    assert list(got["example"]) == list(expected["example"])
    # TVD, JSD, probability changes, normalised importances: bounded by 1 (TABLE_ATOL's reasoning)
    pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-4, atol=1e-5)


def test_out_of_memory_in_a_study_settles_the_sizes_and_records_them(loaded, tiny_data, tmp_path, simulated_oom):
    """Model calls over X tokens run out of memory: the study's tables are an uninterrupted run's (within
    rounding: the rows run in smaller batches), the first batch finds the sizes that fit, the batches
    after it start from them (no error there), and provenance.json records what the run settled on."""
    import probe

    pm = loaded("bert")
    # tokens: a batch's 5 examples fit one call (preparing them does not halve), the engine's default budget
    # (8192) does not
    limit = 60

    def study(out: Path) -> dict:
        return tiny_study(Path(pm.path), tiny_data, out, explainers=["attention_mean", "rollout", "saliency"],
                          references=["loo_delete"], metrics={"top_k": [1, 3], "erasure": None, "counterfactual": None,
                                                              "heads": None, "sanity": {"randomisation": False}})

    probe.run_study(study(tmp_path / "plain"), model=pm, report=False)
    with simulated_oom(pm, lambda _, ids: ids is not None and ids.numel() > limit) as calls:
        probe.run_study(study(tmp_path / "oom"), model=pm, report=False)
    assert calls["failed"] > 0
    plain, oom = read_tables(tmp_path / "plain"), read_tables(tmp_path / "oom")
    assert set(plain) == set(oom)
    for name in plain:
        pd.testing.assert_frame_equal(oom[name], plain[name], check_exact=False, rtol=0, atol=TABLE_ATOL, obj=name)
    engines = [json.loads(p.read_text())["engine"] for p in sorted((tmp_path / "oom" / "done").glob("b*.json"))]
    assert len(engines) == 3 and engines[0]["oom_splits"] > 0 and [e["oom_splits"] for e in engines[1:]] == [0, 0]
    assert all(e["token_budget_used"] is not None and e["token_budget_used"] <= limit for e in engines)
    sizes = json.loads((tmp_path / "oom" / "provenance.json").read_text())["batch_sizes"]
    assert sizes["token_budget"] == 8192 and sizes["token_budget_used"] <= limit
    assert sizes["oom_splits"] == engines[0]["oom_splits"]
    plain_sizes = json.loads((tmp_path / "plain" / "provenance.json").read_text())["batch_sizes"]
    assert plain_sizes == {"token_budget": 8192, "oom_splits": 0, "token_budget_used": None,
                           "examples_per_call_used": {}}


def test_a_study_runs_a_model_already_loaded(tiny_dirs, tiny_data, tmp_path, loaded):
    """probe.run_study(..., model=pm): no second load; the study records the model that ran."""
    import probe
    from probe.models import loading

    pm = loaded("bert")
    calls = []
    original = loading.load_model
    try:
        loading.load_model = lambda *a, **k: calls.append(a) or original(*a, **k)
        study = tiny_study(tiny_dirs["bert"], tiny_data, tmp_path / "out", metrics={"erasure": None,
                           "counterfactual": None, "heads": None})
        study["model"]["id"] = "some other name"
        result = probe.run_study(study, model=pm, report=False)
    finally:
        loading.load_model = original
    assert calls == [] and result.complete and result.verdict is not None
    assert result.spec.model.id == pm.name
    with pytest.raises(InputError, match="not a loaded model"):
        probe.run_study(study, model=str(tiny_dirs["bert"]))


def test_progress_names_every_phase_of_a_study(tiny_dirs, tiny_data, tmp_path, capsys):
    """With progress, the bar over the batches names the step under way, a second bar counts the sanity
    checks' randomised models and then the statistics, and a line comes before ``on_complete`` (the
    report): no phase of a study runs silently."""
    from probe.study import randomisation as S

    study = study_from_dict(tiny_study(tiny_dirs["bert"], tiny_data, tmp_path / "out",
                                       explainers=["attention_mean", "saliency"], references=["loo_delete"],
                                       metrics={"erasure": None, "counterfactual": None, "heads": None}))
    lines, completed = [], []
    result = run_study(study, progress=True, log=lines.append, on_complete=completed.append)
    err = capsys.readouterr().err
    assert result.complete and completed == [result.out]
    assert "batch 0: loo_delete" in err and "batch 2: agreement" in err  # batch_size 5: batches 0..2
    steps = 1 + S.RANDOM_DRAWS * (1 + 1) + 1  # the checks, the unit draws, the cascade's judged step, the stats
    assert "tiny: sanity checks" in err and "tiny: statistics: 100%" in err and f"{steps}/{steps}" in err
    assert lines[-1].startswith("study tiny: ") and lines[-1].endswith("; writing the report")
