"""The result folder of a study: Parquet parts written batch by batch, merged at the end.

Layout of ``OUT/``::

    study.json            the resolved study and its fingerprint (a folder holds one study only)
    parts/TABLE/bNNNNN.parquet   one part per table and batch, written atomically
    done/bNNNNN.json      written after every part of batch NNNNN: the batch is complete
    TABLE.parquet         the merged tables (every batch, in batch order), written at the end
    summary.parquet       mean, std, bootstrap CI, Sig. Frac. per explainer x reference x layer x head x measure
    paired.parquet        each attention unit against the best gradient explainer (the verdict's rule 2)
    comparisons.parquet   paired tests between every two explainers (token- and layer-level), Holm-adjusted
    verdict.json, provenance.json

Every file is written to a temporary name in the same folder and renamed into place, so a run
killed at any moment leaves either the old file or the new one, never half of one. A batch without
its ``done`` marker is recomputed on the next run and its parts overwritten; a batch with one is
never recomputed. Merged tables are the concatenation of the parts in batch order, so an
interrupted-and-resumed run gives the same tables as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from probe.errors import InputError
from probe.names import FORMAT_VERSION, TABLES  # noqa: F401  (the reading side, probe.report, needs them too)


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, data) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.write("\n")

    _atomic_write(Path(path), write)


def write_table(path: Path, frame: pd.DataFrame) -> None:
    _atomic_write(Path(path), lambda tmp: frame.to_parquet(tmp, index=False))


class ResultStore:
    """One study's result folder (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # ------------------------------------------------------------------ identity

    def check(self, study_record: dict) -> None:
        """Refuse, without writing anything, a folder that holds another study or something else,
        or one that cannot be created or written."""
        if not self.root.exists():
            parent = self.root.parent
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise InputError(f"the output folder {self.root} cannot be created ({parent} is not a writable folder); "
                                 "give a writable --out")
            return
        if not self.root.is_dir():
            raise InputError(f"the output path {self.root} is a file; give a folder as --out")
        existing = self.read_study()
        if existing is None:
            others = [p.name for p in self.root.iterdir() if not p.name.startswith(".")]
            if others:
                raise InputError(f"the output folder {self.root} is not empty and holds no probe study "
                                 f"({', '.join(sorted(others)[:3])}...); give an empty or new --out")
        elif existing.get("fingerprint") != study_record["fingerprint"]:
            name = existing.get("study", {}).get("name", "?")
            raise InputError(f"the output folder {self.root} holds results of another study ({name!r}, or the same "
                             "study with other settings); give another --out, or delete that folder to start over")

    def open(self, study_record: dict) -> None:
        """Create the folder for this study, or check that it already holds this study.

        ``study_record`` holds at least ``fingerprint``. A folder holding another study's results
        (or anything that is not a probe result) is refused.
        """
        self.check(study_record)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot create the output folder {self.root}: {err.strerror}; give a writable --out") from err
        if not os.access(self.root, os.W_OK):
            raise InputError(f"the output folder {self.root} is not writable; give a writable --out")
        if self.read_study() is None:
            write_json(self.root / "study.json", {"format_version": FORMAT_VERSION, **study_record})

    def read_study(self) -> dict | None:
        path = self.root / "study.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{path} is unreadable ({err}); delete the folder to start over") from err

    # ------------------------------------------------------------------ batches

    def done_batches(self) -> set[int]:
        folder = self.root / "done"
        if not folder.is_dir():
            return set()
        return {int(p.stem[1:]) for p in folder.glob("b*.json") if p.stem[1:].isdigit()}

    def write_batch(self, index: int, tables: dict[str, pd.DataFrame], info: dict) -> None:
        """Write a batch's parts, then its ``done`` marker (the commit point)."""
        for name, frame in tables.items():
            write_table(self.root / "parts" / name / f"b{index:05d}.parquet", frame)
        write_json(self.root / "done" / f"b{index:05d}.json", info)

    def batch_info(self, index: int) -> dict:
        return json.loads((self.root / "done" / f"b{index:05d}.json").read_text(encoding="utf-8"))

    def merge(self, n_batches: int) -> dict[str, pd.DataFrame]:
        """Concatenate each table's parts in batch order and write ``TABLE.parquet``."""
        merged = {}
        for name in TABLES:
            parts = [self.root / "parts" / name / f"b{i:05d}.parquet" for i in range(n_batches)]
            frames = [pd.read_parquet(p) for p in parts if p.is_file()]
            frames = [f for f in frames if len(f)]
            if not frames:
                continue
            frame = pd.concat(frames, ignore_index=True)
            write_table(self.root / f"{name}.parquet", frame)
            merged[name] = frame
        return merged

    def table(self, name: str) -> pd.DataFrame:
        return pd.read_parquet(self.root / f"{name}.parquet")
