"""What a study's numbers depend on beyond its study file: the examples, the weights, the code.

A result folder holds one study on one dataset with one set of weights (DESIGN rule 15). The study
file's fingerprint (:meth:`probe.spec.study.Study.fingerprint`) covers the settings; the
``identity`` kept beside it in ``study.json`` covers the rest, measured once the model is loaded
and the examples are selected:

- ``data_sha256``: the selected examples (id, text, label, in order), so an edited dataset file, or
  another file under the same name, is another dataset;
- ``weights_sha256``: the model's weight files (the digest ``provenance.json`` records), or, for a
  model without a folder, its parameters and buffers;
- ``model_files``: the sha256 of every other file the model and tokenizer are loaded from, by name
  (:func:`model_files`: ``config.json``, ``generation_config.json``, the tokenizer's files, the chat
  template, the special tokens map, ...), so a changed ``hidden_act`` or two swapped token ids are
  another model although the weights are the same;
- ``code``: what computes the numbers: :data:`NUMBERS_VERSION` (raised by any change of probe that
  moves a stored number), the attention implementation the model runs, and the versions of torch,
  transformers and captum.

A resume against another identity is refused in one line naming what changed (the file, for a model
file). So is a rerun of a finished study whose model files changed since: its tables are of the
earlier model, and nothing of the new one is mixed into them (``--force-new`` starts over). A folder
whose identity has no ``model_files`` (written by a probe before they were recorded) is continued
as before, its weights and data still checked.

A finished folder also keeps ``complete.json`` (:func:`completion_record`): the folder's stamp, a
:func:`quick_identity` that is measured without loading the model (every example of the dataset
before selection, every file of the model's folder, the code) and the digest of every result file.
A run of a study whose folder is complete and whose quick identity and files are unchanged returns
at once: nothing is loaded, nothing recomputed.

What these digests protect against: accidental change (an edited dataset or model file, a damaged,
truncated or foreign result file, a copy from another folder). They are kept in the folder they
describe, so whoever can write the folder can rewrite the results and their digests together; they
are not a signature, and a forged folder is not told from a real one. Keep the digests of a folder
that must be trusted elsewhere (``complete.json`` or its sha256) to check against.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from probe.names import COMPLETE_FILE

if TYPE_CHECKING:
    from probe.data import Example
    from probe.models.core import ProbeModel
    from probe.spec.study import Study

__all__ = ["NUMBERS_VERSION", "completion_record", "data_digest", "describe_change", "model_files",
           "quick_identity", "result_files", "study_identity", "weights_hash"]

#: raised by every change of probe that changes a number a study stores (a folder made before it is
#: then not continued with the new code)
NUMBERS_VERSION = 1


def data_digest(examples: Iterable[Example]) -> str:
    """sha256 of the selected examples: id, text and label of each, in order."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([str(e.id), e.text, e.label], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def weights_hash(pm: ProbeModel) -> str:
    """The weight files' digest (as the provenance records it), else the parameters' and buffers'."""

    digest = weights_digest(pm.path)
    if digest is not None:
        return digest
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(pm.model.state_dict().items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if tensor.numel() else b"")
    return h.hexdigest()


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


#: the weight files ``weights_digest`` hashes (``model_files`` leaves them to it)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: files of a model folder that no loader reads: other frameworks' weights, documentation, pictures
_NOT_LOADED_SUFFIXES = (".h5", ".msgpack", ".ot", ".onnx", ".pth", ".ckpt", ".md", ".png", ".jpg", ".jpeg", ".gif",
                        ".svg", ".pdf")
_NOT_LOADED_STEMS = ("readme", "license", "licence", "notice")


def model_folder(pm: ProbeModel) -> Path | None:
    """The local folder ``pm`` was loaded from: its path (a local folder, a built built-in or planted
    model), or a hub id's snapshot in the local hub cache; None for a model without one."""
    if pm.path and Path(pm.path).is_dir():
        return Path(pm.path)
    if not pm.path:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(str(pm.path), "config.json")
    except Exception:  # not a hub id (a wrapped model's free-form name): no folder
        return None
    return Path(config).parent if isinstance(config, str) and Path(config).is_file() else None


def _loaded_from(file: Path) -> bool:
    """Whether a model folder's file is one a model or tokenizer may be loaded from, weights aside."""
    from probe.models.builtins import METADATA_FILE

    name = file.name.lower()
    return not (name.startswith(".") or file.suffix.lower() in WEIGHT_SUFFIXES + _NOT_LOADED_SUFFIXES
                or name.split(".")[0] in _NOT_LOADED_STEMS or file.name == METADATA_FILE)


def _content_digest(file: Path) -> str:
    """sha256 of what a file says: a JSON file's canonical form (so spacing and key order, which no
    loader sees, do not count), any other file's bytes."""
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            return file_digest(file)
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    return file_digest(file)


def model_files(pm: ProbeModel) -> dict[str, str]:
    """``{file name: sha256}`` of every file besides the weights that ``pm``'s model and tokenizer are
    loaded from: every file of its folder (:func:`model_folder`) except the weights (in
    ``weights_sha256``), probe's own build record, documentation and other frameworks' weights.
    A model without a folder (one wrapped in memory) has its configuration and its tokenizer's
    vocabulary, special tokens and chat template instead."""
    folder = model_folder(pm)
    if folder is not None:
        return {file.name: _content_digest(file) for file in sorted(folder.iterdir())
                if file.is_file() and _loaded_from(file)}
    tokenizer = pm.tokenizer
    said = {"vocabulary": sorted(tokenizer.get_vocab().items()),
            "special tokens": {str(k): str(v) for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()},
            "chat template": getattr(tokenizer, "chat_template", None)}
    text = json.dumps(said, sort_keys=True, ensure_ascii=False, default=str)
    config = json.dumps(pm.model.config.to_dict(), sort_keys=True, ensure_ascii=False, default=str)
    return {"configuration (in memory)": hashlib.sha256(config.encode("utf-8")).hexdigest(),
            "tokenizer (in memory)": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def study_identity(pm: ProbeModel, examples: Sequence[Example]) -> dict:
    return {"data_sha256": data_digest(examples), "weights_sha256": weights_hash(pm), "model_files": model_files(pm),
            "code": {"numbers": NUMBERS_VERSION, "implementation": pm.contract.implementation,
                     "torch": _version("torch"), "transformers": _version("transformers"),
                     "captum": _version("captum")}}


def _short(value) -> str:
    return str(value)[:12] if isinstance(value, str) and len(value) == 64 else str(value)


def describe_change(old: dict, new: dict) -> str | None:
    """What differs between a folder's identity and this run's, as a clause ("another dataset
    (the selected examples' sha256 was ..., now ...)"), or None when they are the same."""
    changes = []
    if old.get("data_sha256") != new.get("data_sha256"):
        changes.append(f"another dataset (the selected examples' sha256 was {_short(old.get('data_sha256'))}..., "
                       f"now {_short(new.get('data_sha256'))}...)")
    if old.get("weights_sha256") != new.get("weights_sha256"):
        changes.append(f"other model weights (sha256 was {_short(old.get('weights_sha256'))}..., "
                       f"now {_short(new.get('weights_sha256'))}...)")
    if "model_files" in old and "model_files" in new and old["model_files"] != new["model_files"]:
        changes.append(f"other model files ({_files_change(old['model_files'] or {}, new['model_files'] or {})})")
    old_code, new_code = old.get("code") or {}, new.get("code") or {}
    moved = [f"{key} {old_code.get(key)} then, {new_code.get(key)} now" for key in sorted(set(old_code) | set(new_code))
             if old_code.get(key) != new_code.get(key)]
    if moved:
        changes.append(f"other code ({'; '.join(moved)})")
    return " and ".join(changes) or None


def _files_change(old: dict, new: dict) -> str:
    """Which model files differ, by name: "config.json changed (sha256 was ..., now ...); vocab.txt removed"."""
    said = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            said.append(f"{name} removed")
        elif name not in old:
            said.append(f"{name} added")
        elif old[name] != new[name]:
            said.append(f"{name} changed (sha256 was {_short(old[name])}..., now {_short(new[name])}...)")
    return "; ".join(said)


def weights_digest(path: str | Path | None) -> str | None:
    """sha256 over the model folder's weight files (name and content), or None without a folder."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ a finished folder, checked without the model

def _code() -> dict:
    return {"numbers": NUMBERS_VERSION, "torch": _version("torch"), "transformers": _version("transformers"),
            "captum": _version("captum")}


def _present_folder(model_id: str) -> Path | None:
    """The folder ``model_id`` loads from when it is on disk already (a built built-in or planted
    model, a local folder), else None: nothing is built or downloaded."""
    if model_id.startswith("builtin:"):
        from probe.models.builtins import built_folder

        return built_folder(model_id.split(":", 1)[1])
    if model_id.startswith("planted:"):
        from probe.models.planted import built_planted_folder

        return built_planted_folder(model_id.split(":", 1)[1])
    folder = Path(model_id).expanduser()
    return folder if (folder / "config.json").is_file() else None


def folder_digest(folder: Path) -> str:
    """sha256 over every file of a model folder (names and contents; hidden files and subfolders aside):
    weights, configuration and tokenizer alike."""
    h = hashlib.sha256()
    for file in sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _model_digest(study: Study, pm: ProbeModel | None) -> str | None:
    if pm is not None:
        if pm.path and Path(pm.path).is_dir():
            return folder_digest(Path(pm.path))
        vocab = json.dumps(sorted(pm.tokenizer.get_vocab().items()), ensure_ascii=False)
        return hashlib.sha256((weights_hash(pm) + vocab).encode("utf-8")).hexdigest()
    folder = _present_folder(study.model.id)
    return None if folder is None else folder_digest(folder)


def quick_identity(study: Study, pm: ProbeModel | None = None) -> dict | None:
    """What a finished folder is checked against before any model loads: the digest of every example of
    the study's dataset split (before filters, length limit and sampling, which the fingerprint
    covers), of the model's folder (or of ``pm``'s parameters and vocabulary when it has none), and
    the code's versions. None where it cannot be told without loading (a hub id, a dataset that does
    not read): such a run takes the ordinary path."""
    from probe.data import iter_dataset
    from probe.errors import ProbeError

    model = _model_digest(study, pm)
    if model is None:
        return None
    d = study.dataset
    try:  # the examples are digested as they are read, never held all at once
        digest = data_digest(iter_dataset(d.name, split=d.split, text_column=d.text_column, label_column=d.label_column))
    except (ProbeError, OSError):
        return None
    return {"model_sha256": model, "dataset_sha256": digest, "code": _code()}


def file_digest(path: Path) -> str:
    """sha256 of one file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def result_files(root: Path) -> dict[str, str]:
    """sha256 of every result file of a folder (its top level, hidden files and ``complete.json`` aside)."""
    return {p.name: file_digest(p) for p in sorted(Path(root).iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != COMPLETE_FILE}


def completion_record(root: Path, stamp: str | None, quick: dict | None, n_examples: int, n_batches: int) -> dict:
    """What ``complete.json`` holds: the folder's stamp, its quick identity, its size and the sha256 of
    every result file. A check against accidental change only: the record sits in the folder it
    describes, and whoever can write the folder can forge it with the files (see the module docstring)."""
    return {"stamp": stamp, "quick_identity": quick, "n_examples": n_examples, "n_batches": n_batches,
            "files": result_files(root)}


def finished_unchanged(root: Path, stamp: str | None, quick: dict | None) -> dict | None:
    """The folder's completion record when it is complete and nothing it was computed from or holds
    has changed since (same stamp, same quick identity, every result file as written), else None."""
    if quick is None or stamp is None:
        return None
    path = Path(root) / COMPLETE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("stamp") != stamp or record.get("quick_identity") != quick:
        return None
    try:
        if record.get("files") != result_files(root):
            return None
    except OSError:
        return None
    return record
