"""Loading errors, text checks and the CLI's one-line errors and JSON outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from probe.errors import InputError, ModelLoadError
from probe.models.core import TruncationWarning
from probe.models.loading import load_model


def _cli(*args, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory):
    """A model with no attention at all, saved with a tokenizer borrowed from the tiny GPT-2."""
    from transformers import MambaConfig, MambaForCausalLM

    folder = tmp_path_factory.mktemp("mamba")
    MambaForCausalLM(MambaConfig(vocab_size=200, hidden_size=16, num_hidden_layers=1, state_size=4)).save_pretrained(folder)
    return folder


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))


def test_folder_with_a_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the config"):
        load_model(str(tmp_path))


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "model.bin"
    path.write_text("x")
    with pytest.raises(ModelLoadError, match="is a file, not a folder"):
        load_model(str(path))


def test_missing_folder():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./no/such/folder")


def test_unknown_builtin_lists_the_valid_ones():
    with pytest.raises(ModelLoadError, match="builtin:minilm-rt"):
        load_model("builtin:nope")


def test_unknown_hub_id_offline_fails_fast():
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="unreachable"):
        load_model("someone/some-model")
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "tpu"}, "unknown device"),
    ({"device": "cuda:7"}, "CUDA is not available|does not exist"),
    ({"dtype": "fp8"}, "unknown dtype"),
    ({"task": "translation"}, "unknown task"),
])
def test_bad_options(tiny_dirs, kwargs, message):
    with pytest.raises(InputError, match=message):
        load_model(str(tiny_dirs["bert"]), **kwargs)


def test_a_model_without_softmax_attention_is_read_through_its_mixers(mamba_dir, tiny_dirs):
    """A Mamba folder (refused before issue 29) loads, its maps the mixers' implicit matrices; a model
    with no mixer probe reads is refused in one line (tests/across/test_architectures.py, fnet)."""
    import shutil

    for name in os.listdir(tiny_dirs["gpt2"]):
        if "token" in name or name.endswith(".txt"):
            shutil.copy(tiny_dirs["gpt2"] / name, mamba_dir / name)
    pm = load_model(str(mamba_dir))
    info = pm.contract.stacks["decoder"]
    assert info.maps == "implicit" and not info.can_edit


def test_empty_and_too_long_text(tiny_dirs):
    pm = load_model(str(tiny_dirs["bert"]))
    with pytest.raises(InputError, match="empty"):
        pm.encode(["  "])
    long_text = " ".join(["good"] * 200)
    with pytest.warns(TruncationWarning, match="window of 64"):
        batch = pm.encode([long_text])
    assert batch["input_ids"].shape[1] == 64
    with pytest.raises(InputError, match="more than the model's window of 64"):
        pm.encode([long_text], strict_length=True)


def test_contract_of_every_tiny_model(tiny_dirs):
    expected = {"bert": ("classification", "bidirectional"), "gpt2": ("causal_lm", "causal"),
                "llama_gqa": ("causal_lm", "causal"), "bart": ("seq2seq", "bidirectional"), "t5": ("seq2seq", "bidirectional")}
    for kind, (task, mask) in expected.items():
        contract = load_model(str(tiny_dirs[kind])).contract
        info = contract.to_dict()
        assert (info["task"], info["mask_kind"], info["implementation"]) == (task, mask, "sdpa"), kind
        if task == "seq2seq":
            assert set(contract.stacks) == {"encoder", "decoder", "cross"}
            assert contract.stacks["decoder"].mask_kind == "causal"
            assert contract.stacks["cross"].mask_kind == "cross"
    llama = load_model(str(tiny_dirs["llama_gqa"]), attn_implementation="eager").contract
    assert (llama.n_heads, llama.n_kv_heads, llama.implementation) == (4, 2, "eager")


@pytest.mark.parametrize("args, message", [
    (["inspect", "./missing-model", "hello"], "does not exist"),
    (["contract", "builtin:unknown"], "unknown built-in model"),
    (["inspect", "{bert}", ""], "empty"),
    (["inspect", "{bert}", "good", "--device", "quantum"], "unknown device"),
    (["inspect", "{bert}", " ".join(["good"] * 100), "--strict-length"], "window of 64"),
])
def test_cli_errors_are_one_line(tiny_dirs, args, message):
    args = [a.replace("{bert}", str(tiny_dirs["bert"])) for a in args]
    result = _cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
@pytest.mark.parametrize("kind", ["bert", "llama_gqa", "t5"])
def test_cli_inspect_json(tiny_dirs, kind):
    result = _cli("inspect", str(tiny_dirs[kind]), "the movie was good", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= {"model_path", "tokens", "token_ids", "prediction", "attention"}
    pm = load_model(data["model_path"])
    info = pm.contract.stacks[data["stack"]]
    assert len(data["attention"]) == info.n_layers
    assert all(len(layer) == info.n_heads for layer in data["attention"])
    assert all(len(head) == len(data["tokens"]) for layer in data["attention"] for head in layer)
    row_sums = [sum(head) for layer in data["attention"] for head in layer]
    assert max(abs(s - 1) for s in row_sums) < 1e-5  # attention rows sum to 1: bounded, absolute


def test_cli_contract_json(tiny_dirs):
    result = _cli("contract", str(tiny_dirs["llama_gqa"]), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    contract = data["contract"]
    for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "implementation", "dtype", "device"):
        assert key in contract
    assert (contract["n_heads"], contract["n_kv_heads"]) == (4, 2)
    assert data["checks"] and all(check["passed"] for check in data["checks"])
    assert {"name", "passed", "detail"} == set(data["checks"][0])


def test_help_is_fast():
    started = time.perf_counter()
    result = _cli("--help")
    assert result.returncode == 0 and "contract" in result.stdout
    assert time.perf_counter() - started < 10


def test_explain_help_names_the_registry_methods_and_the_tasks():
    import re

    from probe import registry
    from probe.tasks import TASKS

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "400", "TERMINAL_WIDTH": "400"}
    result = subprocess.run([sys.executable, "-m", "probe.cli", "explain", "--help"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.stdout))
    listed = re.search(r"comma-separated method names \(([^)]*)\)", text)
    assert listed and [m.strip() for m in listed.group(1).split(",")] == list(registry.names())
    assert "load as " + ", ".join(list(TASKS)[:-1]) + " or encoder" in text


def test_moved_model_types_keep_their_old_import_paths():
    from probe.models import contract, core, loading

    assert loading.ProbeModel is core.ProbeModel
    assert (contract.AttentionContract, contract.StackContract) == (core.AttentionContract, core.StackContract)
    assert core.encode_texts is core.encode_texts and core.TruncationWarning is core.TruncationWarning


def test_task_inference_reads_the_causal_model_types_from_the_architecture_table(monkeypatch):
    from types import SimpleNamespace

    from probe.models import architectures
    from probe.models.tasks import infer_task

    config = SimpleNamespace(model_type="newlm", architectures=["NewLMModel"], is_decoder=False,
                             is_encoder_decoder=False)
    assert infer_task(config).name == "encoder"  # a bare *Model of an unknown type: a headless encoder
    monkeypatch.setattr(architectures, "CAUSAL_LM_TYPES", ("newlm",))
    assert infer_task(config).name == "causal_lm"


def test_attention_stacks_keep_the_module_order_in_every_process():
    """renumber keeps the stacks in the order first found: not a set's order, which follows the
    string hash seed of the process."""
    code = ("from probe.models.architectures import renumber; "
            "print(list(renumber({('encoder', 3): 'e3', ('encoder', 1): 'e1', ('decoder', 7): 'd7', "
            "('cross', 2): 'c2'})))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in range(6)}
    assert seen == {"[('encoder', 0), ('encoder', 1), ('decoder', 0), ('cross', 0)]"}
