"""Reliability (issue 15): usage errors, Markdown escaping, label checks, folder safety, the result
folder lock, dataset warnings. Each test here failed on the code before the fix it guards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from probe.errors import InputError

REPO = Path(__file__).resolve().parents[2]
WORDS = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting"]
HOSTILE = ('<script>alert(1)</script> top token ![x](http://evil/x.png) <img src=x onerror=alert(2)> '
           '[click](javascript:alert(3)) <https://evil.example> www.evil.example')
SHORT = "<b>x</b> ![i](http://evil/i.png) [c](javascript:x) www.evil.example"  # fits a 64-token window


def _cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _dataset(path: Path, labels=None, n: int = 8) -> Path:
    texts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4 + i % 3)) + f" {i}" for i in range(n)]
    pd.DataFrame({"text": texts, "label": labels if labels is not None else [i % 2 for i in range(n)]}).to_csv(
        path, index=False)
    return path


def _study(model, data, out, **overrides) -> dict:
    study = {"name": "rel", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": 4, "seed": 0},
             "explainers": ["attention_mean"], "references": ["loo_delete"],
             "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None},
             "statistics": {"bootstrap": 100}, "engine": {"batch_size": 2}, "output": str(out)}
    study.update(overrides)
    return study


def _run(study: dict, report: bool = True, **kwargs):
    from probe.report.build import build_report
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    # the runner's own answer (RunResult), with the report written as probe.run_study writes it
    return run_study(study_from_dict(study), progress=False, log=lambda _: None,
                     on_complete=build_report if report else None, **kwargs)


# --------------------------------------------------------------------------- 1, 4: usage errors


@pytest.mark.parametrize("args, needles", [
    (["frobnicate"], ["No such command", "frobnicate"]),
    (["run", "X.yaml", "--bogus"], ["No such option: --bogus", "probe run --help"]),
    (["inspect", "builtin:minilm-rt"], ["Missing argument", "text"]),
    (["run", "X.yaml", "--n", "abc"], ["--n", "integer"]),
    (["inspect", "M", "good", "--top", "0"], ["--top", "greater than or equal to 1"]),
    (["explain", "M", "good", "--steps", "0"], ["--steps", "positive whole number"]),
    (["run", "X.yaml", "--threads", "-1"], ["--threads", "greater than or equal to 0"]),
    (["audit", "X.yaml", "--threads", "-2"], ["--threads", "greater than or equal to 0"]),
    (["report"], ["Missing argument"]),
    (["contract", "M", "--json", "extra"], ["unexpected extra argument", "extra"]),
])
def test_usage_errors_are_one_line_and_exit_2(args, needles):
    _one_line_error(_cli(*args), *needles)


def test_the_usage_error_classes_are_those_typer_raises():
    import typer

    from probe.cli import usage_error_classes

    with pytest.raises(usage_error_classes()):
        typer.main.get_command(__import__("probe.cli", fromlist=["app"]).app).main(["frobnicate"], standalone_mode=False)


def test_bare_probe_shows_the_help():
    proc = _cli()
    assert "Traceback" not in proc.stderr and "run" in proc.stdout + proc.stderr and "Usage" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- 2: Markdown escaping


def _assert_inert_markdown(md: str) -> None:
    """No raw HTML tag, image, link or autolink survives (CommonMark/GFM)."""
    assert not re.search(r"<[A-Za-z/!?]", md), re.search(r".{0,40}<[A-Za-z/!?].{0,40}", md).group()
    for target in re.findall(r"(?<!\\)\]\(([^)\n]*)\)", md):  # the report's own figures, tables and anchors only
        assert re.fullmatch(r"#[a-z0-9-]+|figures/[\w.-]+\.png|tables/[\w.-]+\.csv", target), target
    assert "javascript:alert" not in md or "\\[click\\]" in md
    assert "http://evil" not in md and "https://evil" not in md and "www.evil" not in md  # GFM autolinks


def test_audit_markdown_escapes_claims_and_data(tiny_dirs, loaded, tmp_path):
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit

    texts = [f"the film was good {SHORT}", "a bad movie", f"- {SHORT} boring film", "# great | movie"]
    spec = claims_from_dict({"model": {"id": str(tiny_dirs["bert"])}, "data": {"texts": texts},
                             "description": HOSTILE,
                             "claims": [{"claim": HOSTILE, "kind": "faithfulness", "threshold": 0.5},
                                        {"claim": "1. " + HOSTILE, "kind": "specific_tokens", "words": ["film"],
                                         "repeats": 2}]})
    run_audit(spec, out_dir=tmp_path, model=loaded("bert"))
    md = (tmp_path / "audit.md").read_text(encoding="utf-8")
    _assert_inert_markdown(md)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "\\[click\\](javascript:alert(3))" in md
    assert "&lt;b&gt;x&lt;/b&gt;" in md and "\\[c\\](javascript:x)" in md  # evidence rows: the data's texts
    assert "## 1. " in md and "# great" not in md.replace("\\# great", "")
    for block in md.split("\n\n"):  # every table keeps its column count
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            assert len({len(re.findall(r"(?<!\\)\|", row)) for row in rows}) == 1, block
    page = (tmp_path / "audit.html").read_text(encoding="utf-8")
    assert "<script" not in page and "<img" not in page and 'href="javascript' not in page


def test_md_escape_breaks_every_construct():
    from probe.document import md_escape

    for text in (HOSTILE, "- item", "1. item", "+ x", "`code`", "**bold** ~~gone~~", "a\nb\r\nc", "&lt;b&gt;"):
        out = md_escape(text)
        _assert_inert_markdown(out)
        assert "\n" not in out and not re.match(r"[-+] |\d+[.)] ", out), out
    assert md_escape("&lt;b&gt;") == "&amp;lt;b&amp;gt;"  # shown as written, not decoded
    assert md_escape("-0.25") == "-0.25" and md_escape("3.5 stars") == "3.5 stars"  # numbers stay as they are


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    """A finished tiny study whose dataset texts, study name and description carry markup."""
    root = tmp_path_factory.mktemp("reliability")
    data = root / "hostile.csv"
    texts = [f"good film {SHORT} {i}" if i % 2 else f"- bad {i} movie [x](http://evil/{i})" for i in range(6)]
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(6)]}).to_csv(data, index=False)
    out = root / "result"
    _run(_study(tiny_dirs["bert"], data, out, description=HOSTILE))
    return out


def test_study_report_and_comparison_markdown_are_inert(finished, tmp_path):
    import shutil

    from probe.report.build import build_comparison

    _assert_inert_markdown((finished / "report" / "report.md").read_text(encoding="utf-8"))
    other = tmp_path / "other"
    shutil.copytree(finished, other, ignore=shutil.ignore_patterns("report", ".lock*"))
    files = build_comparison([finished, other], tmp_path / "cmp")
    _assert_inert_markdown(files.markdown.read_text(encoding="utf-8"))
    html = files.html.read_text(encoding="utf-8")
    assert "<script" not in html and "<b>x" not in html and "<img src=x" not in html


# --------------------------------------------------------------------------- 3: labels


@pytest.mark.parametrize("bad", [7, -1])
def test_gold_labels_outside_the_classes_are_refused_before_anything_is_written(tiny_dirs, tmp_path, bad):
    data = _dataset(tmp_path / "d.csv", labels=[0, 1, bad, 1, 0, 1, 0, 1])
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"label {bad}.*labels 0\.\.1"):
        _run(_study(tiny_dirs["bert"], data, out, dataset={"name": str(data)}, target={"label": "gold"}))
    assert not out.exists()


def test_labels_outside_the_classes_without_gold_are_warned_about(tiny_dirs, tmp_path):
    data = _dataset(tmp_path / "d.csv", labels=[0, 1, 7, 1, 0, 1, 0, 1])
    with pytest.warns(UserWarning, match=r"1 of 8 examples .* label 7.*labels 0\.\.1"):
        _run(_study(tiny_dirs["bert"], data, tmp_path / "out", dataset={"name": str(data)}), stop_after=0)


@pytest.mark.parametrize("override, message", [
    ({"target": {"label": "no-such-label"}}, "target.label: unknown label 'no-such-label'"),
    ({"target": {"label": 5}}, "target.label: label 5 is out of range"),
    ({"dataset": {"name": "{data}", "filters": {"labels": [0, 3]}}}, r"filters.labels \[3\]"),
])
def test_study_labels_are_checked_against_the_model(tiny_dirs, tmp_path, override, message):
    data = _dataset(tmp_path / "d.csv")
    override = json.loads(json.dumps(override).replace("{data}", str(data)))
    out = tmp_path / "out"
    with pytest.raises(InputError, match=message):
        _run(_study(tiny_dirs["bert"], data, out, **override))
    assert not out.exists()


# --------------------------------------------------------------------------- 5: report --out


def test_report_out_refuses_another_reports_folder_and_other_files(finished, tmp_path):
    from probe.report.build import build_report

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "report.md").write_text("# probe study report: another study\n")
    (theirs / "report.html").write_text("<html>another</html>")
    with pytest.raises(InputError, match="another study"):
        build_report(finished, theirs)
    assert (theirs / "report.html").read_text() == "<html>another</html>"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep")
    proc = _cli("report", finished, "--out", notes)
    _one_line_error(proc, str(notes), "todo.txt")
    _one_line_error(_cli("report", finished, "--out", finished), "agreement.parquet")  # the result folder itself
    mine = build_report(finished, tmp_path / "mine")  # a new folder, then the same report again
    assert build_report(finished, tmp_path / "mine").html == mine.html
    assert build_report(finished).html.is_file()  # the default RESULT/report, written by run


def test_compare_needs_two_different_folders(finished, tmp_path):
    _one_line_error(_cli("compare", finished, cwd=tmp_path), "two or more")
    _one_line_error(_cli("compare", finished, str(finished) + "/", cwd=tmp_path), "two or more different")
    assert not (tmp_path / "comparison").exists()


# --------------------------------------------------------------------------- 6: the lock


def test_a_held_result_folder_is_refused_naming_its_holder(finished, tiny_dirs):
    import socket

    from probe.study.lock import folder_lock

    data = json.loads((finished / "study.json").read_text())["study"]["dataset"]["name"]
    study = _study(tiny_dirs["bert"], data, finished, description=HOSTILE)
    with folder_lock(finished):
        with pytest.raises(InputError, match=rf"in use by pid {os.getpid()} on {re.escape(socket.gethostname())}"):
            _run(study)
    result = _run(study)  # released: the finished study is found complete
    assert result.complete and result.computed == []


def test_wait_waits_for_the_holder(finished, tiny_dirs):
    from probe.study.lock import folder_lock

    data = json.loads((finished / "study.json").read_text())["study"]["dataset"]["name"]
    study = _study(tiny_dirs["bert"], data, finished, description=HOSTILE)
    held, released = threading.Event(), []

    def hold():
        with folder_lock(finished):
            held.set()
            time.sleep(1.5)
            released.append(time.monotonic())

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    _run(study, wait=True, report=False)
    done = time.monotonic()
    thread.join()
    assert released and done >= released[0]


def test_shards_lock_only_their_own_shard(tmp_path):
    from probe.study.lock import folder_lock

    with folder_lock(tmp_path, shard=(0, 2)):
        with folder_lock(tmp_path, shard=(1, 2)):  # the other shard runs beside it
            pass
        with pytest.raises(InputError, match="shard 0/2"):
            with folder_lock(tmp_path, shard=(0, 2)):
                pass
        with pytest.raises(InputError, match="in use by pid"):
            with folder_lock(tmp_path):  # a whole run waits for every shard
                pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from probe.study.lock import folder_lock\n"
            f"with folder_lock({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        from probe.study.lock import folder_lock

        with pytest.raises(InputError, match=f"pid {holder.pid}"):
            with folder_lock(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folder_lock(tmp_path):  # the kernel released the dead holder's lock
        pass


def test_cli_run_into_a_held_folder_exits_2(finished, tmp_path):
    import yaml

    from probe.study.lock import folder_lock

    record = json.loads((finished / "study.json").read_text())["study"]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(record))
    with folder_lock(finished):
        _one_line_error(_cli("run", path, "--no-progress"), "in use by pid", "--wait")


def test_cli_audit_into_a_held_or_foreign_folder_exits_2(tiny_dirs, tmp_path):
    from probe.study.lock import folder_lock

    claims = tmp_path / "claims.yaml"
    claims.write_text(f"model: {{id: {tiny_dirs['bert']}}}\ndata: {{texts: [the movie was not good, a film]}}\n"
                      "claims:\n  - claim: negation matters\n    kind: specific_tokens\n    words: [not]\n")
    out = tmp_path / "audit"
    out.mkdir()
    with folder_lock(out):
        _one_line_error(_cli("audit", claims, "--out", out, "--no-progress"), "in use by pid")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "report.html").write_text("keep")
    _one_line_error(_cli("audit", claims, "--out", foreign), "other files", "report.html")
    missing_model = tmp_path / "bad.yaml"
    missing_model.write_text(claims.read_text().replace(str(tiny_dirs["bert"]), str(tmp_path / "nomodel")))
    _one_line_error(_cli("audit", missing_model, "--out", tmp_path / "new", "--no-progress"), "does not exist")
    assert not (tmp_path / "new").exists()  # nothing left behind by an audit that could not start


# --------------------------------------------------------------------------- 7: smaller ones


def test_dataset_file_problems_are_said(tmp_path):
    from probe.data import load_dataset

    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(InputError, match="is empty: no examples and no columns; give a header row"):
        load_dataset(str(tmp_path / "empty.csv"))
    (tmp_path / "wrapped.json").write_text('{"data": [{"text": "good", "label": 1}]}')
    with pytest.raises(InputError, match=r"holds one JSON object \(data\), not a list"):
        load_dataset(str(tmp_path / "wrapped.json"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(InputError, match="is empty"):
        load_dataset(str(tmp_path / "empty.json"))
    (tmp_path / "dup.csv").write_text("text,label\ngood,1\nbad,0\ngood,1\ngood,0\n")
    with pytest.warns(UserWarning, match=r"2 rows repeat the text of an earlier row \(first: row 2 \(line 4\) = "
                                          r"row 0 \(line 2\)\); 1 of them with another label"):
        assert len(load_dataset(str(tmp_path / "dup.csv"))) == 4
    (tmp_path / "clean.csv").write_text("text,label\ngood,1\nbad,0\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_dataset(str(tmp_path / "clean.csv"))


def test_the_hint_after_a_shard_names_the_missing_shard(tiny_dirs, tmp_path):
    data = _dataset(tmp_path / "d.csv")
    said = []
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    run_study(study_from_dict(_study(tiny_dirs["bert"], data, tmp_path / "out")), shard=(0, 2), progress=False,
              log=said.append)
    assert "--shard 1/2" in said[-1] and "shard(s) 1/2" in said[-1], said[-1]


def test_many_exact_zero_references_get_a_note_about_ties(tmp_path):
    from probe.spec.study import study_from_dict
    from probe.study.runner import warn_about_ties

    spec = _study("m", tmp_path / "d.csv", tmp_path)
    spec["model"]["dtype"] = "bf16"
    study = study_from_dict(spec)
    scores = [0.0] * 11 + [0.1 * i for i in range(1, 9)] + [float("nan")] * 3
    pd.DataFrame({"method": "loo_delete", "score": scores}).to_parquet(tmp_path / "scores.parquet")
    with pytest.warns(UserWarning, match=r"loo_delete: 11 of 19 token scores are exactly 0 \(in bf16"):
        warn_about_ties(tmp_path, study)


# --------------------------------------------------------------------------- found by the adversarial pass


@pytest.mark.parametrize("args, needles", [
    (["explain", "{bert}", "good", "--seed", "-5", "--methods", "loo_random"], ["--seed -5", ">= 0"]),
    (["explain", "{bert}", "good", "--continuation", " x"], ["--continuation", "classifier", "--label"]),
    (["explain", "{bert}", "good", "--steps", "100000000", "--methods", "integrated_gradients"],
     ["100000000 is out of range", "integrated_gradients.steps"]),  # refused before any pass (the API's check)
    (["run", "{study}", "--threads", "100000"], ["--threads 100000", "CPUs"]),
])
@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_adversarial_values_are_one_line_errors(tiny_dirs, tmp_path, args, needles):
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_study(tiny_dirs["bert"], _dataset(tmp_path / "d.csv"), tmp_path / "out")))
    args = [a.replace("{bert}", str(tiny_dirs["bert"])).replace("{study}", str(study)) for a in args]
    _one_line_error(_cli(*args), *needles)


def test_markup_in_a_continuation_or_text_is_shown_as_written(tiny_dirs):
    proc = _cli("explain", tiny_dirs["llama_gqa"], "good [/] film [bold]", "--continuation", " [/]",
                "--methods", "attention_mean")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logprob of ' [/]'" in proc.stdout
