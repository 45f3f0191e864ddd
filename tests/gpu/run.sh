#!/usr/bin/env bash
# The GPU check (issue 7): every test architecture, and the built-ins when PROBE_CACHE holds them,
# on CUDA against the CPU within stated tolerances, then the quickstart study's time on GPU vs CPU.
# Meant for one lent GPU machine, under 8 minutes. Packages the machine lacks (captum, pydantic,
# gguf, platformdirs, ...) travel as wheels in .whl/ (see the device tool's notes):
#     tests/gpu/run.sh            from the repository root
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export MPLCONFIGDIR="${MPLCONFIGDIR:-$(mktemp -d)}"
timeout 470 python3 tests/gpu/check_gpu.py
