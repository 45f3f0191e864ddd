"""Faults (issue 41, items 1 and 5): a result is one model, and a result folder is itself wherever it is.

A result's identity covers every file the model and tokenizer are loaded from (configuration,
generation configuration, tokenizer files, chat template, special tokens map) besides the weights:
a change between a kill and the resume is refused in one line naming the file (``--force-new`` the
fix), and so is a change after the study finished (refused, never recomputed into the old tables:
the folder keeps the earlier model's results and its ``complete.json``). Local folders, planted
and built-in models (their folder in the probe cache) and hub ids (their snapshot in the hub cache)
are covered alike.

A moved or copied finished folder rebuilds its own report and recomputes a damaged table; a report
whose files changed after they were written is not "up to date"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from probe.document import md_escape
from probe.errors import InputError

from test_faults import _cli, _dataset, _one_line, _run, _study


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    return tiny_dirs["bert"]


@pytest.fixture
def model(bert, tmp_path) -> Path:
    """A copy of the tiny BERT folder that a test may edit."""
    folder = tmp_path / "model"
    shutil.copytree(bert, folder)
    return folder


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _relu(folder: Path) -> str:
    def change(config):
        assert config["hidden_act"] == "gelu"
        config["hidden_act"] = "relu"

    _edit_json(folder / "config.json", change)
    return "config.json"


def _swap_good_and_bad(folder: Path) -> str:
    def change(tokenizer):
        vocab = tokenizer["model"]["vocab"]
        vocab["good"], vocab["bad"] = vocab["bad"], vocab["good"]

    _edit_json(folder / "tokenizer.json", change)
    return "tokenizer.json"


def _chat_template(folder: Path) -> str:
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return "chat_template.jinja"


def _special_tokens_map(folder: Path) -> str:
    (folder / "special_tokens_map.json").write_text(json.dumps({"unk_token": "good"}))
    return "special_tokens_map.json"


def _generation_config(folder: Path) -> str:
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    return "generation_config.json"


def _tokenizer_config(folder: Path) -> str:
    _edit_json(folder / "tokenizer_config.json", lambda config: config.update(model_max_length=4096))
    return "tokenizer_config.json"


EDITS = {"hidden_act gelu -> relu": _relu, "two token ids swapped": _swap_good_and_bad,
         "a chat template added": _chat_template, "a special tokens map added": _special_tokens_map,
         "a generation config added": _generation_config, "the tokenizer config changed": _tokenizer_config}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


# ------------------------------------------------------------------ 1. a resume after a model file changed


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_model_file_changed_between_kill_and_resume_is_refused_naming_it(model, tmp_path, edit):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    first = _run(_study(model, data, out), stop_after=2)
    assert first.computed == [0, 1] and not first.complete
    before = _snapshot(out)
    name = EDITS[edit](model)  # the weights are untouched
    with pytest.raises(InputError, match=rf"other model files \({name} (changed|added)") as refused:
        _run(_study(model, data, out))
    message = str(refused.value)
    assert "\n" not in message and "--force-new" in message
    assert _snapshot(out) == before  # nothing of the other model mixed in
    again = _run(_study(model, data, out), force_new=True)  # the fix the message names
    assert again.complete and again.computed == [0, 1, 2]
    record = json.loads((out / "study.json").read_text())
    assert name in record["identity"]["model_files"]


def test_the_cli_refuses_a_changed_config_in_one_line(model, tmp_path, monkeypatch, capsys):
    import yaml

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(model, data, out), stop_after=1)
    _relu(model)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(model, data, out)))
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 2
    _one_line(err, "config.json changed", "--force-new")


def test_a_reformatted_json_file_is_the_same_model(model, tmp_path):
    """What a loader reads counts, not the spacing or key order of a JSON file."""
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(model, data, out), stop_after=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(sorted(config.items(), reverse=True)), indent=7))
    assert _run(_study(model, data, out)).computed == [1, 2]


@pytest.mark.parametrize("edit", ["hidden_act gelu -> relu", "two token ids swapped"])
def test_a_model_file_changed_after_the_finish_is_refused_and_the_folder_kept(model, tmp_path, edit):
    """Consistently refused (never recomputed into the earlier model's tables, never re-stamped)."""
    import probe

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    probe.run_study(_study(model, data, out))
    before = _snapshot(out)
    name = EDITS[edit](model)
    with pytest.raises(InputError, match=rf"other model files \({name} changed.*--force-new"):
        probe.run_study(_study(model, data, out))
    assert _snapshot(out) == before  # tables, sanity checks, verdict and complete.json as they were
    again = probe.run_study(_study(model, data, out), force_new=True)
    assert again.computed == (0, 1, 2)
    assert json.loads((out / "complete.json").read_text())["stamp"] != json.loads(before["complete.json"])["stamp"]


def test_a_planted_model_is_covered_by_its_folder_in_the_cache(tmp_path, monkeypatch):
    """planted:NAME (and builtin:NAME, loaded the same way) is hashed in the folder it loads from."""
    from probe.models.planted import built_planted_folder, materialize_planted, planted_folder

    source = built_planted_folder("one-head") or materialize_planted("one-head")
    cache = tmp_path / "cache"
    target = planted_folder("one-head", cache)
    shutil.copytree(source, target)
    monkeypatch.setenv("PROBE_CACHE", str(cache))
    data, out = tmp_path / "d.jsonl", tmp_path / "out"
    shutil.copy(target / "data.jsonl", data)
    study = _study("planted:one-head", data, out)
    assert _run(study, stop_after=1).computed == [0]
    identity = json.loads((out / "study.json").read_text())["identity"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(identity["model_files"])
    _relu(target)
    with pytest.raises(InputError, match=r"other model files \(config.json changed"):
        _run(study)


def _hub_cache(cache: Path, repo: str, folder: Path) -> Path:
    """``folder`` laid out as the hub cache keeps a downloaded ``repo`` (refs/main -> a snapshot)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    return snapshot


def test_a_hub_model_is_covered_by_its_snapshot_in_the_hub_cache(bert, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, "probe-tests/tiny-bert", bert)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    study = _study("probe-tests/tiny-bert", data, out)
    assert _run(study, stop_after=1).computed == [0]
    identity = json.loads((out / "study.json").read_text())["identity"]
    assert {"config.json", "tokenizer.json"} <= set(identity["model_files"])
    _swap_good_and_bad(snapshot)
    with pytest.raises(InputError, match=r"other model files \(tokenizer.json changed"):
        _run(study)


def test_model_files_are_what_loads_and_not_the_weights_or_documents(model):
    from probe.study.identity import model_files

    (model / "README.md").write_text("# a model card")
    (model / "LICENSE").write_text("MIT")
    (model / ".gitattributes").write_text("*.safetensors filter=lfs")
    _chat_template(model)
    files = model_files(SimpleNamespace(path=str(model)))
    assert set(files) == {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_a_folder_from_before_model_files_is_continued(model, tmp_path):
    """A folder whose identity has no model_files (an older probe's) is continued, its weights still checked."""
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    _run(_study(model, data, out), stop_after=1)
    record = json.loads((out / "study.json").read_text())
    del record["identity"]["model_files"]
    from probe.study.store import folder_stamp, write_json

    write_json(out / "study.json", record)
    marker = out / "done" / "b00000.json"
    info = json.loads(marker.read_text())
    info["stamp"] = folder_stamp(record["fingerprint"], record["identity"])
    write_json(marker, info)
    assert _run(_study(model, data, out)).computed == [1, 2]


# ------------------------------------------------------------------ 5. moved and copied folders are themselves


@pytest.fixture
def finished(bert, tmp_path):
    """A finished study with its report (written as probe.run_study writes it), and its study dict."""
    import probe

    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "k24a"
    probe.run_study(_study(bert, data, out))
    return out, data


def test_a_moved_folder_rebuilds_its_own_report(bert, finished, tmp_path, monkeypatch, capsys):
    out, _ = finished
    moved = tmp_path / "k24"
    shutil.move(out, moved)  # mv k24a k24
    code, outs, err = _cli(monkeypatch, capsys, "report", moved)
    assert code == 0, err
    assert "another result folder" not in err
    assert (moved / "report" / ".probe-source").read_text().strip() == str(moved.resolve())
    assert f"result folder {md_escape(str(moved))}\n" in (moved / "report" / "report.md").read_text()


def test_a_moved_folder_rerun_renders_its_report_again(bert, finished, tmp_path):
    import probe
    from probe.report.build import report_is_current

    out, data = finished
    assert report_is_current(out)
    moved = tmp_path / "k24"
    shutil.move(out, moved)
    assert not report_is_current(moved)  # it names the folder it was rendered in
    logs: list[str] = []
    again = probe.run_study(_study(bert, data, moved), log=logs.append)
    assert again.computed == () and "nothing to run" in logs[0]
    assert not logs[-1].endswith("(up to date)") and report_is_current(moved)


def test_a_report_elsewhere_follows_its_moved_folder(bert, finished, tmp_path):
    from probe.report.build import build_report

    out, _ = finished
    elsewhere = tmp_path / "shared-report"
    build_report(out, elsewhere)
    moved = tmp_path / "k24"
    shutil.move(out, moved)
    assert build_report(moved, elsewhere).markdown.is_file()
    assert (elsewhere / ".probe-source").read_text().strip() == str(moved.resolve())


def test_a_copied_folder_recomputes_a_damaged_table(bert, finished, tmp_path):
    import probe

    out, data = finished
    original = _snapshot(out)
    copy = tmp_path / "k24-copy"
    shutil.copytree(out, copy)
    tokens = copy / "tokens.parquet"
    tokens.write_bytes(tokens.read_bytes()[:100])  # a damaged table in the copy
    again = probe.run_study(_study(bert, data, copy))
    assert again.computed == () and len(pd.read_parquet(tokens)) > 0
    assert tokens.read_bytes() == original["tokens.parquet"]
    assert (copy / "report" / ".probe-source").read_text().strip() == str(copy.resolve())
    assert f"result folder {md_escape(str(copy))}\n" in (copy / "report" / "report.md").read_text()
    assert _snapshot(out) == original  # the folder it was copied from is left alone


def test_an_edited_report_is_not_up_to_date(bert, finished):
    import probe
    from probe.report.build import report_is_current

    out, data = finished
    html = out / "report" / "report.html"
    written = html.read_text(encoding="utf-8")
    logs: list[str] = []
    probe.run_study(_study(bert, data, out), log=logs.append)
    assert logs[-1].endswith("(up to date)")
    html.write_text(written.replace("</h1>", " (verdict: yes, trust me)</h1>", 1), encoding="utf-8")
    assert not report_is_current(out)
    logs.clear()
    probe.run_study(_study(bert, data, out), log=logs.append)
    assert not any(line.endswith("(up to date)") for line in logs), logs
    assert html.read_text(encoding="utf-8") == written and report_is_current(out)


def test_a_report_without_its_recorded_digests_is_not_up_to_date(bert, finished):
    """A report written before the digests of its files were kept (only the inputs' stamp) is rendered again."""
    from probe.report.build import report_is_current

    out, _ = finished
    inputs = out / "report" / ".probe-inputs"
    inputs.write_text(inputs.read_text().splitlines()[0] + "\n")
    assert not report_is_current(out)


def test_what_complete_json_protects_against_is_said():
    from probe.study import identity

    for text in (identity.__doc__, identity.completion_record.__doc__):
        assert "accidental change" in text and "forge" in text
    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "studies.md"
    page = " ".join(guide.read_text(encoding="utf-8").split())
    assert "protect against accidental change" in page and "not against a forger" in page
