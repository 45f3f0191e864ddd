"""The folder :meth:`probe.explanation.Explanation.save` writes and
:func:`probe.explanation.load_explanation` reads: its format version, its files, the JSON form of
tensors and prepared examples, and the checks of a folder before it is written or read."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

__all__ = ["EXPLANATION_FILES", "EXPLANATION_FORMAT", "check_explanation_folder", "example_fields", "example_record",
           "from_json", "json_value", "read_explanation_folder", "saved_examples", "saved_scores"]

#: the version of the folder :meth:`probe.explanation.Explanation.save` writes
EXPLANATION_FORMAT = 1
_TENSOR = "__tensor__"


def json_value(value: Any) -> Any:
    """``value`` as JSON: tensors (and numpy arrays) as ``{"__tensor__": values, "dtype": ...}``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def from_json(value: Any) -> Any:
    if isinstance(value, dict) and _TENSOR in value:
        return torch.tensor(value[_TENSOR], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def example_record(example: PreparedExample) -> dict[str, Any]:
    import dataclasses

    return {f.name: json_value(getattr(example, f.name)) for f in dataclasses.fields(example)}


def example_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A saved example's fields as the example holds them (JSON keeps a chat prompt's messages as lists)."""
    if "messages" in fields:
        fields["messages"] = tuple(tuple(m) for m in fields["messages"])
    if "offsets" in fields:
        fields["offsets"] = tuple(tuple(o) for o in fields["offsets"])
    return fields


#: what a folder :meth:`probe.explanation.Explanation.save` may write into holds besides these: nothing
#: (hidden files aside)
EXPLANATION_FILES = ("explanation.json", "scores.parquet")


def check_explanation_folder(folder: Path) -> None:
    """Refuse, in one line, a folder :meth:`probe.explanation.Explanation.save` would overwrite
    something else in: a file, a study's result folder (its ``scores.parquet`` is the study's), any
    folder with other files; a new folder, an empty one and an earlier save's are fine."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} is a file; Explanation.save writes a folder: give a new or empty folder")
    if not folder.is_dir():
        return
    others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name not in EXPLANATION_FILES)
    earlier = (folder / "explanation.json").is_file()
    if others or ((folder / "scores.parquet").exists() and not earlier):
        what = ("a study's result folder" if (folder / "study.json").exists() or (folder / "complete.json").exists()
                else "other files")
        shown = ", ".join(others[:3] or ["scores.parquet"]) + (", ..." if len(others) > 3 else "")
        raise InputError(f"{folder} holds {what} ({shown}); Explanation.save would overwrite its scores.parquet: "
                         "give a new or empty folder (or one an earlier Explanation.save wrote)")


def read_explanation_folder(folder: Path) -> tuple[dict, pd.DataFrame]:
    """The record and the score table of a folder :meth:`probe.explanation.Explanation.save` wrote,
    refused in one line where a file is missing or unreadable or of another format."""
    import json

    files = [folder / "explanation.json", folder / "scores.parquet"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{folder} is not a saved explanation (it lacks {', '.join(missing)}): give the folder "
                         "Explanation.save(path) wrote")
    try:
        record = json.loads(files[0].read_text(encoding="utf-8"))
        table = pd.read_parquet(files[1], columns=["example", "method", "layer", "head", "position", "score"])
    except (OSError, ValueError) as err:
        raise InputError(f"{folder} holds an unreadable explanation ({' '.join(str(err).split())[:120]}); "
                         "save it again") from None
    if record.get("format") != EXPLANATION_FORMAT:
        raise InputError(f"{folder}: explanation format {record.get('format')!r} is not {EXPLANATION_FORMAT}, the one "
                         "this probe reads; save it again with this version")
    return record, table


def saved_examples(record: dict) -> tuple[PreparedExample, ...]:
    """The prepared examples of a saved explanation's record, as they were saved."""
    return tuple(PreparedExample(**example_fields(from_json(e))) for e in record["examples"])


def saved_scores(record: dict, table: pd.DataFrame) -> dict[str, TokenScores]:
    """Each method's scores of a saved explanation (its record and score table), every score exactly."""
    table = table.sort_values(["method", "example", "layer", "head", "position"], kind="stable")
    grouped = {key: part["score"].to_numpy() for key, part in table.groupby(["method", "example"], sort=False)}
    scores = {}
    for entry in record["methods"]:
        name = entry["name"]
        values = [torch.from_numpy(grouped[(name, i)].astype(np.float32)).reshape(shape)
                  for i, shape in enumerate(entry["shapes"])]
        scores[name] = TokenScores(method=name, scores=values, params=from_json(entry["params"]),
                                   per_head=entry["per_head"], per_layer=entry["per_layer"],
                                   extras=from_json(entry["extras"]))
    return scores
