"""Faults of input, output and memory (issue 41: the input cases of items 6 to 9).

A study or claim file nested too deep, an unknown keyword of the Python API and a model name where a
loaded model is needed are one line each. Token text cannot end bertviz's ``<script>``; an
explanation never overwrites a study's tables; control characters reach the terminal as escapes.
A boolean is not a label, a file's labels are of one type, a text is a string, a CSV's huge cell is
read (or named), ``queries="last"`` never reads padding. Sampling n examples of a large file holds
those n, not the file; a run killed in the merge leaves no temporary file once the folder is opened
again."""

from __future__ import annotations

import csv
import json
import shutil
import sys
import tracemalloc
import types
from pathlib import Path

import pandas as pd
import pytest
import yaml

import probe
from probe.errors import InputError

from test_faults import _cli, _dataset, _one_line, _run, _study

#: what must never reach a terminal raw: ESC (a colour and a screen clear) and a right-to-left override
ESC, RLO = "\x1b", "\u202e"


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    return tiny_dirs["bert"]


@pytest.fixture(scope="module")
def bert_pm(bert):
    return probe.load_model(str(bert))


# ------------------------------------------------------------------ 6. tracebacks become one line


@pytest.mark.parametrize("nesting", ["[" * 10_000 + "]" * 10_000,
                                     "\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 3000)) + " " * 3000 + "v"])
def test_a_study_or_claim_file_nested_10000_deep_is_one_line(tmp_path, monkeypatch, capsys, nesting):
    path = tmp_path / "deep.yaml"
    path.write_text(f"name: deep\nmodel: {nesting}\n")
    for load in (probe.load_study, probe.load_claims):
        with pytest.raises(InputError, match=r"deep\.yaml line \d+: the YAML nests more than 100 levels deep"):
            load(path)
    for command in ("run", "audit"):
        code, _, err = _cli(monkeypatch, capsys, command, path, "--no-progress")
        assert code == 2
        _one_line(err, "nests more than 100 levels")


def test_a_file_nested_a_few_levels_still_reads(bert, tmp_path):
    """The bound is far above what a study needs: a shipped study file reads as before."""
    study = _study(bert, _dataset(tmp_path / "d.csv"), tmp_path / "out")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(study))
    assert probe.load_study(path).name == "faults"


def test_an_unknown_keyword_is_one_line_naming_it_and_the_accepted_ones(bert, bert_pm):
    with pytest.raises(InputError, match=r"probe\.load_model\(\) got an unknown keyword 'colour'; it accepts: name, "
                                         r"device, .*allow_random_weights"):
        probe.load_model(str(bert), colour=1)
    with pytest.raises(InputError, match=r"counterfactual_attention\(how='permuted'\) got an unknown keyword 'nn'; "
                                         r"it accepts: .*\bn, seed"):
        probe.counterfactual_attention(bert_pm, "a good film", "permuted", nn=1)
    with pytest.raises(InputError, match=r"unknown keyword 'nn'.*\bcandidates\b"):
        probe.counterfactual_attention(bert_pm, "a good film", "adversarial", nn=1)
    # every public function: a misspelt keyword, a missing argument, too many positional ones
    with pytest.raises(InputError, match=r"probe\.explain\(\) got an unknown keyword 'method'; it accepts: pm, texts, "
                                         r"methods"):
        probe.explain(bert_pm, "a good film", method="attention_mean")
    with pytest.raises(InputError, match=r"probe\.loo\(\): missing a required argument: 'texts'"):
        probe.loo(bert_pm)
    with pytest.raises(InputError, match=r"probe\.load_results\(\): too many positional arguments"):
        probe.load_results("a", "b")
    # the keywords that are accepted still work
    result = probe.counterfactual_attention(bert_pm, "a good film", "permuted", n=2, seed=1)
    assert result.output_tvd.shape == (1, 2)


def test_audit_with_a_model_name_is_one_line(tmp_path):
    claims = Path(__file__).resolve().parents[2] / "data" / "claims" / "minilm_rt.yaml"
    with pytest.raises(InputError, match=r"model is the name 'builtin:minilm-rt', not a loaded model: load it first, "
                                         r"pm = probe\.load_model\('builtin:minilm-rt'\)"):
        probe.audit(claims, model="builtin:minilm-rt")
    with pytest.raises(InputError, match="model must be a ProbeModel"):
        probe.audit(claims, model=3)


# ------------------------------------------------------------------ 7. injection and overwrites


def _fake_bertviz(monkeypatch):
    """bertviz as 1.4 writes its page: the tokens go through ``json.dumps`` into a ``<script>`` element."""
    try:
        import bertviz  # noqa: F401

        return
    except ImportError:
        pass

    class HTML:
        def __init__(self, data):
            self.data = data

    def view(attention, tokens, html_action="view", **_):
        assert html_action == "return"
        params = {"attention": [{"attn": [a.tolist() for a in attention], "left_text": tokens,
                                 "right_text": tokens}]}
        return HTML('<div id="vis"></div>\n<script type="text/javascript">\nconst params = '
                    + json.dumps(params) + ';\n</script>\n')

    monkeypatch.setitem(sys.modules, "bertviz", types.SimpleNamespace(head_view=view, model_view=view))


def test_bertviz_token_text_cannot_end_its_script(bert_pm, monkeypatch):
    _fake_bertviz(monkeypatch)
    batch = bert_pm.tokenizer(["a good film"], return_tensors="pt")
    with probe.capture(bert_pm) as cap:
        bert_pm.model(**batch)
    maps = cap.maps(next(iter(bert_pm.contract.stacks)))
    n = batch["input_ids"].shape[1]
    evil = ["</script><script>alert(document.cookie)</script>", "<!--", "a&b\u2028"] + ["x"] * (n - 3)
    for view in ("head", "model"):
        page = maps.to_bertviz(0, evil, view=view).data
        assert page.count("<script") == page.lower().count("</script>")  # only bertviz's own elements
        assert "alert(document.cookie)" in page  # the text is there, as text
        assert "<script>alert" not in page and "<!--" not in page and "\u2028" not in page
        assert "\\u003c/script\\u003e\\u003cscript\\u003ealert" in page
        assert "probe-token-" not in page


def test_an_explanation_never_overwrites_a_finished_study(bert, bert_pm, tmp_path):
    out = tmp_path / "out"
    _run(_study(bert, _dataset(tmp_path / "d.csv"), out))
    scores = (out / "scores.parquet").read_bytes() if (out / "scores.parquet").exists() else None
    before = sorted(p.name for p in out.iterdir())
    ex = probe.explain(bert_pm, "a good film", methods="attention_mean")
    with pytest.raises(InputError, match=r"holds a study's result folder \(.*\); Explanation\.save would overwrite"):
        ex.save(out)
    assert sorted(p.name for p in out.iterdir()) == before
    if scores is not None:
        assert (out / "scores.parquet").read_bytes() == scores
    other = tmp_path / "notes"
    other.mkdir()
    (other / "scores.parquet").write_bytes(b"someone else's")
    with pytest.raises(InputError, match="holds other files"):
        ex.save(other)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        ex.save(tmp_path / "file")
    saved = tmp_path / "saved"
    ex.save(saved)
    ex.save(saved)  # an earlier save is replaced
    assert probe.load_explanation(saved).methods == ["attention_mean"]


def test_control_characters_reach_the_terminal_as_escapes(bert, tmp_path, monkeypatch, capsys):
    """``probe run --out`` with ESC and a right-to-left override, and ``probe explain``'s tables with
    a label holding them: every line shows them as escapes."""
    data = _dataset(tmp_path / "d.csv")
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump(_study(bert, data, tmp_path / "unused")))
    out = tmp_path / f"out{ESC}[2J{ESC}[31m{RLO}txt"
    code, stdout, stderr = _cli(monkeypatch, capsys, "run", study, "--out", out, "--no-progress")
    assert code == 0, stderr
    for stream in (stdout, stderr):
        assert ESC not in stream and RLO not in stream
    assert "\\x1b[2J\\x1b[31m\\u202etxt" in stdout + stderr
    # a refusal naming the path too
    code, _, err = _cli(monkeypatch, capsys, "report", tmp_path / f"missing{ESC}[31m")
    assert code == 2 and ESC not in err and "\\x1b[31m" in err

    model = tmp_path / "model"
    shutil.copytree(bert, model)
    config = json.loads((model / "config.json").read_text())
    config["id2label"] = {"0": f"neg{ESC}[2J", "1": f"pos{RLO}"}
    config["label2id"] = {v: int(k) for k, v in config["id2label"].items()}
    (model / "config.json").write_text(json.dumps(config))
    for label in ("0", "1"):
        code, stdout, stderr = _cli(monkeypatch, capsys, "explain", model, f"a good film {ESC}[31m{RLO}",
                                    "--methods", "attention_mean,loo_delete", "--label", label)
        assert code == 0, stderr
        assert ESC not in stdout + stderr and RLO not in stdout + stderr
        assert ("\\x1b[2J" if label == "0" else "\\u202e") in stdout


# ------------------------------------------------------------------ 8. silent acceptance and misleading words


def test_a_boolean_label_is_refused(bert_pm):
    for call in (lambda: probe.explain(bert_pm, "a good film", methods="attention_mean", label=True),
                 lambda: probe.prepare(bert_pm, ["a good film"], label=False),
                 lambda: probe.loo(bert_pm, "a good film", label=[True])):
        with pytest.raises(InputError, match=r"label=(True|False) is a boolean, not a class"):
            call()
    with pytest.raises(InputError, match=r"label=0\.5 is not a class index"):
        probe.prepare(bert_pm, ["a good film"], label=0.5)
    assert probe.prepare(bert_pm, ["a good film"], label=1)[0].label == 1


def test_jsonl_labels_of_mixed_types_are_refused_naming_the_line(tmp_path):
    from probe.data import load_dataset

    path = tmp_path / "mixed.jsonl"
    rows = [{"text": "a", "label": "1"}, {"text": "b", "label": None}, {"text": "c", "label": True},
            {"text": "d", "label": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"mixed\.jsonl: row 2 \(line 3\) has label=True, a boolean, but row 0 "
                                         r"\(line 1\) has '1', a class id: a file's labels are of one type"):
        load_dataset(str(path))

    path.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "positive"}\n')
    with pytest.raises(InputError, match=r"row 1 \(line 2\) has label='positive', a string, but row 0"):
        load_dataset(str(path))
    path.write_text('{"text": "a", "label": true}\n{"text": "b", "label": false}\n')
    with pytest.raises(InputError, match=r"row 0 \(line 1\) has label=true, a boolean; labels are integer class ids"):
        load_dataset(str(path))
    # ids written as numbers and as digit strings are one type; a missing label is no label
    path.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "0"}\n{"text": "c", "label": null}\n')
    assert [e.label for e in load_dataset(str(path))] == [1, 0, None]


def test_a_jsonl_text_that_is_not_a_string_says_so(tmp_path):
    from probe.data import load_dataset

    path = tmp_path / "numbers.jsonl"
    path.write_text('{"text": "fine", "label": 1}\n{"text": 123, "label": 0}\n')
    with pytest.raises(InputError, match=r"row 1 \(line 2\) has text=123, a int, not a string"):
        load_dataset(str(path))
    path.write_text('{"text": "fine", "label": 1}\n{"text": null, "label": 0}\n')
    with pytest.raises(InputError, match=r"row 1 \(line 2\) has no 'text' \(missing or null\)"):
        load_dataset(str(path))


def test_a_csv_with_a_huge_cell_is_read_or_named(tmp_path, monkeypatch):
    from probe import data
    from probe.data import user_files

    huge = "word " * 60_000  # 300,000 characters: past the csv module's own 131,072
    path = tmp_path / "huge.csv"
    pd.DataFrame({"text": ["a good film", huge, "a bad film"], "label": [1, 0, 0]}).to_csv(path, index=False)
    limit = csv.field_size_limit()
    examples = data.load_dataset(str(path))
    assert [len(e.text) for e in examples] == [11, len(huge), 10]
    assert csv.field_size_limit() == limit  # the process-wide limit is put back
    monkeypatch.setattr(user_files, "MAX_CSV_FIELD", 100_000)
    with pytest.raises(InputError, match=r"huge\.csv line 2: a field is longer than 100,000 characters, the most probe "
                                         r"reads from a CSV"):
        data.load_dataset(str(path))
    assert csv.field_size_limit() == limit


def test_capture_last_never_reads_padding_without_a_mask(bert_pm):
    stack = next(iter(bert_pm.contract.stacks))
    batch = bert_pm.tokenizer(["a good film indeed", "bad"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert int(mask[1].sum()) < ids.shape[1]  # the second row is padded
    with pytest.raises(InputError, match=r"without an attention mask: the row ends in the pad token"):
        with probe.capture(bert_pm, queries="last"):
            bert_pm.model(input_ids=ids[1:])  # a padded row alone, its mask left behind
    with pytest.raises(InputError, match=r"has shape \[2, 3\], not \[batch 2, length"):
        with probe.capture(bert_pm, queries="last", attention_mask=mask[:, :3]):
            bert_pm.model(input_ids=ids, attention_mask=mask)
    with pytest.raises(InputError, match=r"has shape \[1, \d+\], not \[batch 2"):
        with probe.capture(bert_pm, queries="last", attention_mask=mask[:1]):
            bert_pm.model(input_ids=ids, attention_mask=mask)
    with pytest.raises(InputError, match="needs attention_mask"):
        with probe.capture(bert_pm, queries="last"):
            bert_pm.model(input_ids=ids)
    # a lone unpadded row needs no mask; a padded batch with its mask reads each row's last real token
    with probe.capture(bert_pm, queries="last") as cap:
        bert_pm.model(input_ids=ids[:1])
    assert cap.maps(stack).query_index.tolist() == [[ids.shape[1] - 1]]
    with probe.capture(bert_pm, queries="last") as cap:
        bert_pm.model(input_ids=ids, attention_mask=mask)
    assert cap.maps(stack).query_index.tolist() == [[int(m.sum()) - 1] for m in mask]


# ------------------------------------------------------------------ 9. memory and stale files


def _large_jsonl(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"review {i}: " + " ".join(["good", "bad", "film"][(i + j) % 3]
                                                                  for j in range(8)), "label": i % 2}) + "\n")
    return path


def test_sampling_a_large_jsonl_holds_the_selection_not_the_file(tmp_path):
    """n=4 of a 20,000-line JSONL: the same four examples as a shuffle of the whole list, with a peak
    of Python memory under half the file's size (the whole file as examples takes several times it)."""
    from probe.data import load_dataset, take

    path = _large_jsonl(tmp_path / "large.jsonl", 20_000)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        selected = load_dataset(str(path), n=4, seed=7)
        sampled_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        everything = load_dataset(str(path))
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert selected == take(everything, 4, 7, str(path))
    assert sampled_peak < size / 2 < whole_peak / 4, (sampled_peak, size, whole_peak)


def test_a_study_on_a_large_jsonl_makes_only_its_selected_examples(bert, bert_pm, tmp_path, monkeypatch):
    """A study's selection (filters, length limit, then a seeded n) makes Example objects for the
    rows it reads, but keeps only the n selected: no list of every row is built."""
    from probe import data
    from probe.spec.study import study_from_dict
    from probe.study.examples import select_examples

    path = _large_jsonl(tmp_path / "large.jsonl", 5_000)
    spec = study_from_dict(_study(bert, path, tmp_path / "out",
                                  dataset={"name": str(path), "n": 4, "seed": 0, "filters": {"labels": [1]}}))
    lists = []
    real_scan = data.scan_dataset

    def scan(*args, **kwargs):
        result = real_scan(*args, **kwargs)
        lists.append(result)
        return result

    monkeypatch.setattr("probe.study.examples.scan_dataset", scan)
    chosen, dropped = select_examples(bert_pm, spec.dataset, spec.target)
    assert len(chosen) == 4 and all(e.label == 1 for e in chosen) and dropped == {"filters": 2_500, "too_long": 0}
    assert lists[0].held is None and lists[0].positions is None and lists[0].count == 2_500  # a count, not rows
    everything = [e for e in data.load_dataset(str(path)) if e.label == 1]
    assert chosen == data.take(everything, 4, 0, str(path))  # the selection is what it was


def test_a_kill_during_the_merge_leaves_no_temporary_file_once_reopened(bert, tmp_path):
    data, out = _dataset(tmp_path / "d.csv"), tmp_path / "out"
    first = _run(_study(bert, data, out), report=False)
    assert first.complete
    stale = [out / ".agreement.parquet.k9x2m1.tmp", out / "parts" / "agreement" / ".b00001.parquet.q1w2e3.tmp",
             out / "done" / ".b00002.json.a1b2c3.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")  # what kill -9 in a write leaves
    logs = []
    again = _run(_study(bert, data, out), logs, report=False)
    assert again.complete and not any(p.exists() for p in stale)
    assert any("removed 3 temporary file(s)" in line for line in logs), logs
    assert not list(out.rglob("*.tmp"))
    # a shard shares the folder with other writers: it leaves their files alone
    stale[0].write_bytes(b"another shard's write in progress")
    _run(_study(bert, data, out), report=False, shard=(0, 2))
    assert stale[0].exists()
