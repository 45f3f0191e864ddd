"""The README's "From Python" section runs: its ```python blocks, in order, in one namespace, on
the built-in model, from an empty folder (the study writes results/readme there)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## From Python\n")
    end = text.find("\n## ", start + 1)
    section = text[start: end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_its_examples():
    blocks = python_blocks()
    assert len(blocks) >= 4
    joined = "\n".join(blocks)
    for call in ("probe.load_model(", "probe.wrap(", "probe.explain(", ".to_pandas()", "probe.loo(", "probe.erasure(",
                 "probe.head_ablation(", "probe.counterfactual_attention(", "probe.capture(", "probe.run_study(",
                 "probe.audit("):
        assert call in joined, call


def test_the_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README.md From Python block {i + 1}", "exec"), namespace)
    # what the examples claim to show is there
    ex, run, audit = namespace["ex"], namespace["run"], namespace["audit"]
    assert ex.methods == ["attention_mean", "rollout", "integrated_gradients", "loo_delete"]
    assert run.complete and (tmp_path / "results" / "readme" / "verdict.json").is_file()
    assert run.verdict.answer in ("yes", "heads only", "no", "undecidable")
    assert audit.claims[0].verdict in ("supported", "refuted", "inconclusive")
    assert namespace["maps"].weights.shape[3] == 1  # one query row: [CLS]
    assert "random" in set(namespace["curves"].ranking)
