"""7B shapes (issue 64): the configurations of Llama-3-8B, Mistral-7B v0.1 and Qwen2-7B as probe writes them,
their parameter counts counted without building anything, and the GPU section (tests/gpu/seven_b.py) run
as a dry run on the CPU at a reduced size, so that its code path cannot rot between GPU runs.

What the reduced model keeps of Llama-3-8B: the head width (128), the grouped-query ratio (4 query heads per
key/value head), the layer layout (RMSNorm, rotary positions at theta 500,000, a gated SiLU MLP whose width
is the real 3.5 x hidden), bf16 and eager attention. What is cut: 1 of 32 layers, 8 of 32 query heads (so
hidden 1,024 of 4,096 and MLP 3,584 of 14,336) and the vocabulary (512 of 128,256)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probe.errors import InputError
from probe.models.shapes import SHAPES, parameter_count, shape_config, shape_label, shape_model, shape_texts

ROOT = Path(__file__).resolve().parents[1]
#: billions of parameters of each full shape, as the checkpoints' model cards give them (rounded)
BILLIONS = {"llama3-8b": 8.03, "mistral-7b": 7.24, "qwen2-7b": 7.62}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_full_shape_has_its_checkpoints_parameter_count(name):
    assert parameter_count(shape_config(name)) / 1e9 == pytest.approx(BILLIONS[name], abs=0.01)


def test_the_configurations_hold_the_checkpoints_numbers():
    llama, mistral, qwen = (shape_config(n) for n in ("llama3-8b", "mistral-7b", "qwen2-7b"))
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert llama.rope_parameters["rope_theta"] == 500000.0 and llama.head_dim == 128
    assert (mistral.hidden_size, mistral.num_key_value_heads, mistral.intermediate_size, mistral.vocab_size,
            mistral.sliding_window) == (4096, 8, 14336, 32000, 4096)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.intermediate_size, qwen.vocab_size, qwen.head_dim) == (3584, 28, 28, 4, 18944, 152064, 128)
    assert all(not c.tie_word_embeddings for c in (llama, mistral, qwen))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_count_equals_the_built_model_and_cuts_keep_the_head_geometry(name):
    shape = SHAPES[name]
    pm = shape_model(name, layers=1, heads=2 * shape.group, vocab=300)
    config = pm.model.config
    assert sum(p.numel() for p in pm.model.parameters()) == parameter_count(config) == pm.metadata["parameters"]
    assert config.head_dim == 128 and config.num_attention_heads // config.num_key_value_heads == shape.group
    assert pm.contract.n_kv_heads == 2 and str(pm.contract.dtype).endswith("bfloat16")
    assert pm.name == shape_label(name, layers=1, heads=2 * shape.group, vocab=300)
    assert "1 of" in pm.name and "vocab 300 of" in pm.name  # every cut is said
    assert pm.metadata["full_parameters"] == parameter_count(shape_config(name))
    assert all(len(pm.tokenizer(t)["input_ids"]) == 40 for t in shape_texts(pm, 40, n=3))


def test_a_bad_shape_or_cut_is_refused_in_one_line():
    with pytest.raises(InputError, match="valid are"):
        shape_config("llama-70b")
    with pytest.raises(InputError, match="grouped-query ratio 4"):
        shape_config("llama3-8b", heads=6)
    with pytest.raises(InputError, match="layers must be"):
        shape_config("qwen2-7b", layers=29)


def test_the_gpu_section_runs_every_method_as_a_dry_run(tmp_path):
    """seven_b.py on the CPU at the reduced size above, 16 tokens, with the predictions: every method
    that applies runs and returns one finite score per token (the script checks the shapes)."""
    out = tmp_path / "seven_b.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/seven_b.py"), "--device", "cpu", "--layers", "1",
                           "--heads", "8", "--vocab", "512", "--tokens", "16", "--threads", "1", "--predict",
                           "--predict-tokens", "32", "64", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    statuses = {r["method"]: r["status"] for r in data["measured"]}
    from probe import registry

    assert set(statuses) == {"forward", *registry.names()}
    left_out = {m for m, s in statuses.items() if s != "ok"}
    assert {statuses[m] for m in left_out} == {"not applicable"}  # every other method ran and passed its checks
    assert {"loo_mask", "loo_unk"} <= left_out <= {"loo_mask", "loo_unk", "flow"}  # no mask or unk token
    assert all(r["shape"][-1] == 16 for r in data["measured"] if r["status"] == "ok" and r["method"] != "forward")
    predicted = data["predictions"]
    assert predicted["layers"] == 32 and predicted["hidden"] == 1024  # the depth restored, the cut width kept
    rows = [r for r in predicted["rows"] if r["status"] == "prediction"]
    assert {r["method"] for r in rows} >= {"forward", "saliency", "loo_delete", "knockout"}
    assert all(r["cpu_seconds"] > 0 and r["gpu_seconds"] > 0 and r["peak_gib"] > predicted["weights_gib"] * 0.99
               for r in rows)
