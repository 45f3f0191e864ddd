"""What a study's numbers depend on beyond its study file: the examples, the weights, the code.

A result folder holds one study on one dataset with one set of weights (DESIGN rule 15). The study
file's fingerprint (:meth:`probe.spec.study.Study.fingerprint`) covers the settings; the
``identity`` kept beside it in ``study.json`` covers the rest, measured once the model is loaded
and the examples are selected:

- ``data_sha256``: the selected examples (id, text, label, in order), so an edited dataset file, or
  another file under the same name, is another dataset;
- ``weights_sha256``: the model's weight files (the digest ``provenance.json`` records), or, for a
  model without a folder, its parameters and buffers;
- ``code``: what computes the numbers: :data:`NUMBERS_VERSION` (raised by any change of probe that
  moves a stored number), the attention implementation the model runs, and the versions of torch,
  transformers and captum.

A resume against another identity is refused in one line naming what changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from probe.data import Example
    from probe.models.core import ProbeModel

__all__ = ["NUMBERS_VERSION", "data_digest", "describe_change", "study_identity", "weights_hash"]

#: raised by every change of probe that changes a number a study stores (a folder made before it is
#: then not continued with the new code)
NUMBERS_VERSION = 1


def data_digest(examples: Sequence[Example]) -> str:
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


def study_identity(pm: ProbeModel, examples: Sequence[Example]) -> dict:
    return {"data_sha256": data_digest(examples), "weights_sha256": weights_hash(pm),
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
    old_code, new_code = old.get("code") or {}, new.get("code") or {}
    moved = [f"{key} {old_code.get(key)} then, {new_code.get(key)} now" for key in sorted(set(old_code) | set(new_code))
             if old_code.get(key) != new_code.get(key)]
    if moved:
        changes.append(f"other code ({'; '.join(moved)})")
    return " and ".join(changes) or None


def weights_digest(path) -> str | None:
    """sha256 over the model folder's weight files (name and content), or None without a folder."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    if not files:
        return None
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
