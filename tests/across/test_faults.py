"""Faults (issue 25): results that cannot be silently mixed, truncated or lost.

A result folder holds one study on one dataset with one set of weights; every part is verified
when merged; every write is atomic and every fault one line; input is bounded and validated before
anything is written. Disk-full, read-only and permission faults are simulated by patched writers
(the tests run as root, where permissions do not stop a write)."""

from __future__ import annotations

import errno
import json
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from probe.errors import InputError, ProbeError, StorageError

WORDS = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting"]


def _dataset(path: Path, n: int = 8, labels=None, shift: int = 0) -> Path:
    texts = [" ".join(WORDS[(i * 5 + j + shift) % len(WORDS)] for j in range(4 + i % 3)) + f" {i}" for i in range(n)]
    pd.DataFrame({"text": texts, "label": labels if labels is not None else [i % 2 for i in range(n)]}).to_csv(
        path, index=False)
    return path


def _study(model, data, out, **overrides) -> dict:
    study = {"name": "faults", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": 6, "seed": 0},
             "explainers": ["attention_mean"], "references": ["loo_delete"],
             "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                         "sanity": {"randomisation": False, "examples": 2}},
             "statistics": {"bootstrap": 100}, "engine": {"batch_size": 2}, "output": str(out)}
    study.update(overrides)
    return study


def _run(study: dict, logs: list | None = None, report: bool = True, **kwargs):
    from probe.report.build import build_report
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    # the runner's own answer (RunResult), with the report written as probe.run_study writes it
    return run_study(study_from_dict(study), progress=False,
                     log=(logs.append if logs is not None else (lambda _: None)),
                     on_complete=build_report if report else None, **kwargs)


def _cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``probe ARGS`` in this process (so patched writers apply): (exit code, stdout, stderr)."""
    from probe import cli

    monkeypatch.setattr(sys, "argv", ["probe", *map(str, args)])
    capsys.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str, *needles) -> str:
    """The error is one line, the last (progress lines before it are the run's own), without a traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error") or line.startswith("  ")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    assert err.rstrip("\n").splitlines()[-1] == lines[0], err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    return tiny_dirs["bert"]


# ------------------------------------------------------------------ 1. a resume never mixes two studies


def test_a_resume_on_a_changed_dataset_is_refused_naming_it(bert, tmp_path):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    first = _run(_study(bert, data, out), stop_after=1)
    assert first.computed == [0] and not first.complete
    _dataset(data, shift=3)  # the file edited between the kill and the resume
    with pytest.raises(InputError, match=r"another dataset \(the selected examples' sha256.*--force-new.*new --out"):
        _run(_study(bert, data, out))
    assert sorted(p.name for p in (out / "done").iterdir()) == ["b00000.json"]  # left as it was
    again = _run(_study(bert, data, out), force_new=True)  # the fix the message names
    assert again.complete and again.computed == [0, 1, 2]
    provenance = json.loads((out / "provenance.json").read_text())
    record = json.loads((out / "study.json").read_text())
    assert provenance["dataset_sha256"] == record["identity"]["data_sha256"]
    assert provenance["model"]["weights_sha256"] == record["identity"]["weights_sha256"]


def test_a_resume_with_other_weights_is_refused_naming_them(bert, tmp_path):
    import torch

    model = tmp_path / "model"
    shutil.copytree(bert, model)
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(model, data, out), stop_after=1)
    weights = next(p for p in model.iterdir() if p.suffix in (".safetensors", ".bin"))
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] + 0.01
        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        state = torch.load(weights)
        first = sorted(state)[0]
        state[first] = state[first] + 0.01
        torch.save(state, weights)
    with pytest.raises(InputError, match=r"other model weights \(sha256 was .*--force-new"):
        _run(_study(model, data, out))


def test_a_resume_under_other_code_is_refused(bert, tmp_path, monkeypatch):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out), stop_after=1)
    monkeypatch.setattr("probe.study.identity.NUMBERS_VERSION", 999)
    with pytest.raises(InputError, match=r"other code \(numbers 1 then, 999 now\)"):
        _run(_study(bert, data, out))


def test_cli_force_new_and_the_refusal_are_one_line(bert, tmp_path, monkeypatch, capsys):
    import yaml

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out), stop_after=1)
    _dataset(data, shift=5)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(bert, data, out)))
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 2
    _one_line(err, "another dataset", "--force-new")
    code, outs, err = _cli(monkeypatch, capsys, "run", path, "--no-progress", "--force-new")
    assert code == 0 and "results:" in outs, err


def test_a_finished_folder_returns_at_once_and_any_change_takes_the_full_path(bert, tmp_path, monkeypatch):
    """Rerunning a finished study loads nothing, computes nothing and keeps its report; a changed
    dataset, model file or result file is noticed before that shortcut is taken."""
    import probe
    from probe.study import runner

    model = tmp_path / "model"
    shutil.copytree(bert, model)
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    first = probe.run_study(_study(model, data, out))
    assert first.computed == (0, 1, 2) and (out / "complete.json").is_file()
    report = out / "report" / "report.html"
    written = report.stat().st_mtime_ns
    loads, logs = [], []
    real_load = runner._load
    monkeypatch.setattr(runner, "_load", lambda *args: loads.append(args) or real_load(*args))

    again = probe.run_study(_study(model, data, out), log=logs.append)
    assert again.computed == () and loads == [] and again.verdict.to_dict() == first.verdict.to_dict()
    assert "nothing to run" in logs[0] and logs[-1].endswith("(up to date)")
    assert report.stat().st_mtime_ns == written
    shutil.rmtree(out / "report")  # a missing report is written, still without a model
    probe.run_study(_study(model, data, out))
    assert report.is_file() and loads == []

    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n")
    assert probe.run_study(_study(model, data, out)).computed == () and len(loads) == 1  # checked by loading

    tokens = out / "tokens.parquet"
    tokens.write_bytes(tokens.read_bytes()[:100])  # a damaged result file: the full path merges it again
    assert probe.run_study(_study(model, data, out)).computed == () and len(loads) == 2
    assert len(pd.read_parquet(tokens)) > 0

    _dataset(data, shift=3)  # another dataset under the same name: refused, as a resume is
    with pytest.raises(InputError, match="another dataset"):
        probe.run_study(_study(model, data, out))


# ------------------------------------------------------------------ 2, 3. every part verified when merged


@pytest.fixture
def half(bert, tmp_path):
    """A study stopped after two of its three batches, and a finished other study (to copy parts from)."""
    data = _dataset(tmp_path / "d.csv")
    out = tmp_path / "out"
    _run(_study(bert, data, out), stop_after=2)
    other = tmp_path / "other"
    _run(_study(bert, _dataset(tmp_path / "e.csv", shift=7), other), stop_after=2)
    return data, out, other


def _damage(kind: str, out: Path, other: Path) -> str:
    part = out / "parts" / "agreement" / "b00001.parquet"
    marker = out / "done" / "b00001.json"
    if kind == "missing part":
        part.unlink()
        return "b00001.parquet is missing"
    if kind == "foreign part":
        shutil.copy(other / "parts" / "agreement" / "b00001.parquet", part)
        return "b00001.parquet is not the part its marker records"
    if kind == "foreign marker and parts":
        for name in ("examples", "agreement", "tokens", "scores"):
            shutil.copy(other / "parts" / name / "b00001.parquet", out / "parts" / name / "b00001.parquet")
        shutil.copy(other / "done" / "b00001.json", marker)
        return "belongs to another study"
    if kind == "corrupt part":
        part.write_bytes(b"PAR1 not really parquet")
        return "b00001.parquet is not the part its marker records"
    if kind == "corrupt marker":
        marker.write_text('{"examples": 2, "wal')
        return "b00001.json is unreadable"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing part", "foreign part", "foreign marker and parts", "corrupt part",
                                  "corrupt marker"])
def test_a_bad_done_batch_is_named_and_recomputed(bert, half, kind):
    data, out, other = half
    needle = _damage(kind, out, other)
    logs: list[str] = []
    result = _run(_study(bert, data, out), logs)
    assert result.complete and result.computed == [1, 2], logs
    assert any(line.startswith("batch 1: ") and needle in line and "recomputing it" in line for line in logs), logs
    examples = pd.read_parquet(out / "examples.parquet")
    assert len(examples) == 6 and sorted(examples["example"]) == list(range(6))  # the left-out count is true


def test_a_part_that_changes_after_the_resume_check_is_refused_at_the_merge(bert, half):
    from probe.study.store import ResultStore

    data, out, _ = half
    _run(_study(bert, data, out), report=False)
    store = ResultStore(out)
    store.open(json.loads((out / "study.json").read_text()))
    (out / "parts" / "examples" / "b00002.parquet").unlink()
    with pytest.raises(InputError, match=r"batch 2: .*b00002.parquet is missing; nothing was merged.*run the same"):
        store.merge(3)
    assert 2 not in store.done_batches()  # set to be recomputed


# ------------------------------------------------------------------ 4. an incomplete report is rebuilt


def test_an_incomplete_report_folder_is_recognised_and_rebuilt(bert, tmp_path, monkeypatch, capsys):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out), report=False)
    report = out / "report"
    (report / "tables").mkdir(parents=True)
    (report / "tables" / "agreement_layers.csv").write_text("explainer,n\nattention_mean,")  # killed mid-write
    code, outs, err = _cli(monkeypatch, capsys, "report", out)
    assert code == 0 and (report / "report.md").read_text().startswith("# probe study report: faults"), err
    (report / "report.md").unlink()  # a report whose last file never came: probe run rebuilds it too
    from probe.report.build import build_report

    assert build_report(out).markdown.is_file()


def _full_disk_from(monkeypatch, nth: int):
    """The ``nth`` temporary file the atomic writer creates (``.NAME.XXXXXXXX.tmp``), and every one after it,
    fails as on a full disk; returns a function that undoes it."""
    import os

    real, made = os.open, []

    def full_disk(path, flags, *args, **kwargs):
        if str(path).endswith(".tmp"):
            made.append(path)
            if len(made) >= nth:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk)
    return lambda: monkeypatch.setattr(os, "open", real)


def test_a_failed_report_leaves_the_earlier_one_whole(bert, tmp_path, monkeypatch):
    from probe.report.build import build_report

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out))
    before = {p.relative_to(out / "report"): p.read_bytes() for p in (out / "report").rglob("*") if p.is_file()}
    _full_disk_from(monkeypatch, 4)
    with pytest.raises(StorageError, match=r"No space left on device; free some space"):
        build_report(out)
    after = {p.relative_to(out / "report"): p.read_bytes() for p in (out / "report").rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in out.iterdir() if p.name.startswith(".report.new-")]  # no staging left behind


# ------------------------------------------------------------------ 5. disk full, read-only: one line at every stage


def _full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_a_part_is_one_line_and_the_run_resumes(bert, tmp_path, monkeypatch, capsys):
    import yaml

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(bert, data, out)))
    import os

    real_open = os.open

    def disk_full_open(file, flags, *args, **kwargs):
        if flags & os.O_CREAT and "b00001" in str(file) and "parts" in str(file):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", disk_full_open)
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 2
    _one_line(err, "cannot write", "b00001.parquet", "No space left on device", "run the same command again")
    assert sorted(p.name for p in (out / "done").iterdir()) == ["b00000.json"]
    monkeypatch.setattr(os, "open", real_open)  # the cause is gone
    code, outs, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 0 and "results:" in outs, err


@pytest.mark.parametrize("stage", ["merge", "verdict"])
def test_a_full_disk_while_merging_is_one_line(bert, tmp_path, monkeypatch, stage):
    from probe.study import store

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out), stop_after=2)
    real = store.write_file
    target = "agreement.parquet" if stage == "merge" else "verdict.json"
    monkeypatch.setattr(store, "write_file",
                        lambda p, data: real(p, _full) if Path(p).name == target else real(p, data))
    with pytest.raises(StorageError, match=rf"cannot write .*{target}: No space left on device"):
        _run(_study(bert, data, out))
    monkeypatch.setattr(store, "write_file", real)
    assert _run(_study(bert, data, out)).complete


def test_a_read_only_result_folder_is_one_line_on_the_lock(bert, tmp_path, monkeypatch, capsys):
    import yaml

    from probe.study import lock

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(bert, data, out), stop_after=1)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(bert, data, out)))

    def read_only(file, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(file))

    monkeypatch.setattr(lock, "open", read_only, raising=False)
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 2
    _one_line(err, "cannot lock", ".lock", "Read-only file system", "writable --out")


def test_an_unwrapped_os_error_is_still_one_line(monkeypatch, capsys, tmp_path):
    from probe import cli

    def permission(*_a, **_k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(cli, "app", permission)
    code, _, err = _cli(monkeypatch, capsys, "report", tmp_path)
    assert code == 2
    _one_line(err, "Permission denied", str(tmp_path / "x"))


# ------------------------------------------------------------------ 6. audits are written atomically


def test_a_failed_audit_rerun_keeps_the_earlier_audit(tiny_dirs, loaded, tmp_path, monkeypatch):
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit

    spec = claims_from_dict({"model": {"id": str(tiny_dirs["bert"])}, "data": {"texts": ["good film", "bad movie"]},
                             "claims": [{"claim": "faithful", "kind": "faithfulness", "threshold": 0.5}]})
    out = tmp_path / "audit"
    run_audit(spec, out_dir=out, model=loaded("bert"))
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert set(before) == {"audit.json", "audit.md", "audit.html"}
    result = run_audit(spec, model=loaded("bert"))
    undo = _full_disk_from(monkeypatch, 3)
    with pytest.raises(StorageError, match=r"audit.html: No space left on device"):
        result.write(out)
    undo()
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")} == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    result.write(out)  # the cause gone, the new audit replaces the earlier one whole
    assert json.loads((out / "audit.json").read_text())["claims"][0]["claim"] == "faithful"


# ------------------------------------------------------------------ 7. bounded input


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    from probe.spec.study import load_study

    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    lines.append("name: [" + ",".join(["*i"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    with pytest.raises(InputError, match=r"aliases .* expand to more than"):
        load_study(path)
    assert time.perf_counter() - started < 5
    (tmp_path / "rec.yaml").write_text("name: &x [*x]\n")
    with pytest.raises(InputError, match="recursive anchor"):
        load_study(tmp_path / "rec.yaml")


def test_the_duplicate_key_check_is_iterative():
    import yaml

    from probe.spec.validation import check_duplicate_keys

    node = yaml.ScalarNode("tag:yaml.org,2002:int", "1")
    for _ in range(5000):  # deeper than Python's recursion limit
        node = yaml.SequenceNode("tag:yaml.org,2002:seq", [node])
    check_duplicate_keys(node, "deep.yaml")
    dup = yaml.compose("a: 1\nb: {c: 1, c: 2}\n")
    with pytest.raises(InputError, match=r"deep.yaml line 2: duplicate key 'c' in b"):
        check_duplicate_keys(dup, "deep.yaml")


@pytest.mark.parametrize("bootstrap", [10**9, 1e9])
def test_a_bootstrap_larger_than_memory_is_refused(bert, tmp_path, bootstrap):
    from probe.spec.study import study_from_dict

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    with pytest.raises(InputError, match="statistics.bootstrap"):
        study_from_dict(_study(bert, data, out, statistics={"bootstrap": bootstrap}))
    assert not out.exists()


def test_a_bootstrap_that_does_not_fit_the_free_memory_is_refused_before_writing(bert, tmp_path, monkeypatch):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    monkeypatch.setattr("probe.rows.memory.available_memory", lambda: 10 * 2**20)
    with pytest.raises(InputError, match=r"statistics.bootstrap: 100000 resamples of 6 examples .* <= "):
        _run(_study(bert, data, out, statistics={"bootstrap": 100000}))
    assert not out.exists()


def test_claim_file_numbers_are_bounded():
    from probe.claims.file import claims_from_dict

    with pytest.raises(InputError, match="bootstrap"):
        claims_from_dict({"model": {"id": "x"}, "data": {"texts": ["a b"]}, "statistics": {"bootstrap": 10**9},
                          "claims": [{"claim": "c", "kind": "faithfulness", "threshold": 0.5}]})


# ------------------------------------------------------------------ 8. validated before anything is written


def test_unknown_method_params_are_refused_when_the_study_is_read(tmp_path):
    from probe.spec.study import study_from_dict

    study = _study("builtin:minilm-rt", "builtin:rotten_tomatoes", tmp_path / "out", explainers=["integrated_gradients"],
                   params={"integrated_gradients": {"stepz": 8}})
    with pytest.raises(InputError, match=r"params.integrated_gradients.stepz: unknown parameter 'stepz' of "
                                         r"integrated_gradients .*did you mean 'steps'"):
        study_from_dict(study)
    study["params"] = {"integrated_gradients": {"steps": [8]}}
    with pytest.raises(InputError, match=r"\[8\] is not valid for integrated_gradients.steps"):
        study_from_dict(study)
    study["params"] = {"integrated_gradients": 5}
    with pytest.raises(InputError, match=r"params.integrated_gradients"):
        study_from_dict(study)
    study["params"] = {"integrated_gradients": {"steps": 8}}
    study_from_dict(study)


def test_a_missing_gold_label_is_refused_before_anything_is_written(bert, tmp_path):
    data = tmp_path / "d.csv"
    pd.DataFrame({"text": [f"good film {i}" for i in range(6)], "label": [0, 1, None, 1, 0, 1]}).to_csv(data,
                                                                                                       index=False)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"target.label: gold .* 1 of 6 selected examples .* have none"):
        _run(_study(bert, data, out, target={"label": "gold"}))
    assert not out.exists()


def test_a_run_that_fails_in_its_first_batch_leaves_no_folder(bert, tmp_path, monkeypatch):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"

    def broken(*_a, **_k):
        raise InputError("broken on purpose")

    monkeypatch.setattr("probe.study.runner.run_batch", broken)
    with pytest.raises(InputError, match="broken on purpose"):
        _run(_study(bert, data, out))
    assert not out.exists()


# ------------------------------------------------------------------ 10. the Python API: ProbeError only, eval mode


@pytest.mark.parametrize("call, needle", [
    (lambda probe, pm: probe.explain(pm, None), "texts is None"),
    (lambda probe, pm: probe.explain(pm, 123), "texts=123 is not a string"),
    (lambda probe, pm: probe.explain(pm, [123]), "texts must be strings or examples from probe.prepare, got int"),
    (lambda probe, pm: probe.prepare(pm, [123]), "text #0 is int '123', not a string"),
    (lambda probe, pm: probe.explain(pm, "good film", methods=5), "methods=5 is not a method name"),
    (lambda probe, pm: probe.explain(pm, "good film", methods=[5]), "methods=[5]"),
    (lambda probe, pm: probe.explain(pm, "good film", params={"saliency": 5}), "params['saliency']"),
    (lambda probe, pm: probe.explain(pm, "good film", params=5), "params=5 is not a mapping"),
    (lambda probe, pm: probe.explain(pm, "good film", methods=["saliency"], params={"saliency": {"x": 1}}),
     "unknown parameter 'x' of saliency"),
    (lambda probe, pm: probe.explain(pm, "good film", params={"nope": {}}), "unknown method 'nope'"),
    (lambda probe, pm: probe.explain("builtin:minilm-rt", "good film"), "load it first"),
    (lambda probe, pm: probe.loo(42, "good film"), "must be a ProbeModel"),
    (lambda probe, pm: probe.head_ablation(pm, "good film", batch_size=0), "batch_size=0"),
    (lambda probe, pm: probe.run_study(42), "study must be a study file's path"),
    (lambda probe, pm: probe.study_from_dict(42), "data must be a dict"),
    (lambda probe, pm: probe.load_model(42), "got int '42': give builtin:NAME"),
])
def test_api_input_errors_are_probe_errors(loaded, call, needle):
    import probe

    pm = loaded("bert")
    with pytest.raises(ProbeError) as info:
        call(probe, pm)
    assert needle in str(info.value), str(info.value)


def test_examples_prepared_by_another_model_are_refused(loaded):
    import probe

    bert, gpt = loaded("bert"), loaded("llama_gqa")
    examples = probe.prepare(gpt, ["good film with a plot"])
    with pytest.raises(ProbeError, match="prepared by another model's tokenizer"):
        probe.explain(bert, examples, methods=["attention_mean"])


def test_a_model_in_train_mode_is_explained_in_eval_mode_and_restored(loaded):
    import probe

    pm = loaded("bert")
    expected = probe.explain(pm, ["good film", "bad plot"], methods=["saliency", "loo_delete"])
    pm.model.train()
    try:
        got = probe.explain(pm, ["good film", "bad plot"], methods=["saliency", "loo_delete"])
        assert pm.model.training  # restored
    finally:
        pm.model.eval()
    assert [e.original_value for e in got.examples] == [e.original_value for e in expected.examples]
    for method in ("saliency", "loo_delete"):
        for a, b in zip(got[method].scores, expected[method].scores):
            assert a.nan_to_num().equal(b.nan_to_num())


def test_methods_all_runs_every_method_that_applies(loaded):
    import probe

    pm = loaded("bert")
    everything = probe.explain(pm, "good film", methods="all")
    default = probe.explain(pm, "good film")
    assert everything.methods == default.methods and everything.skipped == default.skipped


def test_wrap_refuses_a_tokenizer_of_another_family(tiny_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import probe

    kind = "llama_gqa"
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[kind])
    bert_tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["bert"])
    with pytest.raises(ProbeError, match="tokenizer .* the model was trained with"):
        probe.wrap(model, bert_tokenizer)
    probe.wrap(model, AutoTokenizer.from_pretrained(tiny_dirs[kind]))  # its own is accepted


def test_report_out_into_another_results_report_of_the_same_name_is_refused(bert, tmp_path, monkeypatch, capsys):
    from probe.report.build import build_report

    a, b = tmp_path / "a", tmp_path / "b"
    _run(_study(bert, _dataset(tmp_path / "d.csv"), a))
    _run(_study(bert, _dataset(tmp_path / "e.csv", shift=2), b), report=False)
    before = (a / "report" / "report.md").read_bytes()
    with pytest.raises(InputError, match=r"holds the report of another result folder"):
        build_report(b, a / "report")
    assert (a / "report" / "report.md").read_bytes() == before
    assert build_report(a).markdown.is_file()  # its own result: rebuilt in place


# ------------------------------------------------------------------ 9. control characters never reach a terminal raw


HOSTILE_CONTROL = "film\x1b[2J\x00 \u202eevil\u202c \x07 done"


def test_printable_shows_control_characters_as_escapes():
    from probe.names import printable

    shown = printable(HOSTILE_CONTROL)
    assert shown == "film\\x1b[2J\\x00 \\u202eevil\\u202c \\x07 done"
    assert printable("a\nb\tc", keep_newlines=True) == "a\nb\tc" and printable("é ü 漢") == "é ü 漢"


def test_audit_terminal_output_and_reports_carry_no_control_characters(tiny_dirs, tmp_path, monkeypatch, capsys):
    import re

    import yaml

    claims = {"model": {"id": str(tiny_dirs["bert"])}, "description": HOSTILE_CONTROL,
              "data": {"texts": [f"good {HOSTILE_CONTROL}", "bad movie"]},
              "claims": [{"claim": HOSTILE_CONTROL, "kind": "faithfulness", "threshold": 0.5}]}
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump(claims, allow_unicode=True))
    out = tmp_path / "audit"
    code, outs, err = _cli(monkeypatch, capsys, "audit", path, "--out", out)
    assert code == 0, err
    control = re.compile("[\x00-\x08\x0b-\x1f\x7f\u202a-\u202e\u2066-\u2069]")
    assert not control.search(outs) and not control.search(err), (outs, err)
    assert "\\x1b[2J" in outs
    for name in ("audit.md", "audit.html"):
        assert not control.search((out / name).read_text(encoding="utf-8")), name


def test_study_report_text_shows_control_characters_as_escapes():
    """Text from the data reaches report.md and report.html through these two escapes only."""
    from probe.document import escape_html, md_escape

    for escape in (md_escape, escape_html):
        out = escape("a\x1b[2Jb\x00c\u202ed")
        assert not any(ch in out for ch in ("\x1b", "\x00", "\u202e")) and "\\x1b" in out and "\\u202e" in out
