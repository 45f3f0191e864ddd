"""The GPU check (tests/gpu/check_gpu.py) as a dry run on the CPU: its sections run end to end with the
"GPU" side on the CPU too, so the script a lent GPU machine runs cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_sections_as_a_dry_run(tmp_path):
    env = {**os.environ, "PROBE_GPU_CHECK_DEVICE": "cpu", "PROBE_GPU_OUT": str(tmp_path),
           "PROBE_GPU_SECTIONS": "tiny,implicit,generate,contrast,device_map,flash"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/check_gpu.py")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 check(s) failed" in proc.stdout
    for line in ("PASS  llama_gqa capture", "PASS  qwen3_next implicit matrices", "PASS  gpt2 generate=3 saliency",
                 "PASS  t5 contrast loo_delete", "PASS  llama_gqa device_map=auto vs cuda capture"):
        assert line in proc.stdout, line
    assert (tmp_path / "gpu_check.json").exists()
