"""The result folder of a study: Parquet parts written batch by batch, merged at the end.

Layout of ``OUT/``::

    study.json            the resolved study and its fingerprint (a folder holds one study only)
    parts/TABLE/bNNNNN.parquet   one part per table and batch, written atomically
    done/bNNNNN.json      written after every part of batch NNNNN: the batch is complete
    TABLE.parquet         the merged tables (every batch, in batch order), written at the end
    summary.parquet       mean, std, bootstrap CI, Sig. Frac. per explainer x reference x layer x head x measure
    chance.parquet        each attention unit's permutation test against chance, raw and family-wise (rule 1)
    paired.parquet        each attention unit: rule 1's p-values, rule 2 (against the best gradient), whether it tracks
    comparisons.parquet   paired tests between every two explainers (token- and layer-level), Holm-adjusted
    verdict.json, provenance.json

Every file is written to a temporary name in the same folder and renamed into place
(:func:`probe.files.write_file`), so a run killed at any moment leaves either the old file or the
new one, never half of one. A batch without
its ``done`` marker is recomputed on the next run and its parts overwritten. Merged tables are the
concatenation of the parts in batch order, so an interrupted-and-resumed run gives the same tables
as an uninterrupted one.

A folder holds one study on one dataset with one set of weights (DESIGN rule 15): ``study.json``
keeps the study's fingerprint and its ``identity`` (:mod:`probe.study.identity`: the selected
examples' hash, the weights' hash, the code that makes the numbers), and every ``done`` marker
keeps the folder's ``stamp`` (a hash of both) and each part's byte size and sha256. A marker that
is unreadable, another folder's, or whose parts are missing, of another size or another checksum
is named in one line and its batch recomputed; the merge verifies every part again. Folders
written before identities existed (no ``identity``, markers without ``parts``) are still read and
continued: their parts are checked for presence and readability only.

Every failure to write (a full disk, a read-only file system, missing permissions) is one
:class:`~probe.errors.StorageError` line naming the path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from probe.errors import InputError, storage_error
from probe.files import write_file
from probe.names import FORMAT_VERSION, TABLES
from probe.study.identity import file_digest


def write_json(path: Path, data: object) -> None:
    write_file(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_table(path: Path, frame: pd.DataFrame) -> None:
    write_file(path, lambda f: frame.to_parquet(f, index=False))


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    """The Parquet file ``write_table`` writes for ``frame``, as bytes (to checksum what is written)."""
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def folder_stamp(fingerprint: str, identity: dict | None) -> str | None:
    """What every ``done`` marker of a folder carries: a hash of the study's fingerprint and identity
    (None for a folder written before identities existed)."""
    if identity is None:
        return None
    text = json.dumps({"fingerprint": fingerprint, "identity": identity}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _part_readable(path: Path) -> str | None:
    """Why a legacy part (no checksum on record) cannot be merged, or None."""
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception as err:  # pyarrow raises several kinds for a damaged file
        return f"{path} is not a readable Parquet file ({type(err).__name__})"
    return None


class ResultStore:
    """One study's result folder (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        #: the folder's stamp once :meth:`open` has run (None: a folder from before identities)
        self.stamp: str | None = None

    # ------------------------------------------------------------------ identity

    def check(self, study_record: dict) -> None:
        """Refuse, without writing anything, a folder that holds another study or something else,
        or one that cannot be created or written."""
        if not self.root.exists():
            parent = self.root.parent
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise InputError(f"the output folder {self.root} cannot be created ({parent} is not a writable "
                                 f"folder); "
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
                             "study with other settings); give another --out, or run with --force-new to start over")
        if existing is not None and study_record.get("identity") is not None and existing.get("identity") is not None:
            from probe.study.identity import describe_change

            change = describe_change(existing["identity"], study_record["identity"])
            if change:
                raise InputError(f"the output folder {self.root} holds this study's results on {change}; resuming "
                                 "would mix the two: run with --force-new to start over, or give a new --out")

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temporary files (``.NAME.*.tmp``) a killed writer left in the folder, its
        ``parts/TABLE/`` and ``done/``; returns them. Only for a caller that holds the folder
        exclusively (:mod:`probe.study.lock`): another run's write in progress looks the same."""
        folders = [self.root, self.root / "done", *sorted((self.root / "parts").glob("*"))]
        removed = []
        for folder in folders:
            if not folder.is_dir() or folder.is_symlink():
                continue
            for path in folder.glob(".*.tmp"):
                if path.is_file() and not path.is_symlink():
                    try:
                        path.unlink()
                    except OSError as err:
                        raise storage_error(err, path, "remove") from None
                    removed.append(path)
        return removed

    def is_result(self) -> bool:
        """Whether the folder holds a probe study (study.json), whatever its state."""
        return (self.root / "study.json").is_file()

    def clear(self) -> None:
        """Remove everything a run wrote (``--force-new``); the lock files stay (they are held)."""
        import shutil

        for entry in self.root.iterdir():
            if entry.name.startswith(".lock"):
                continue
            try:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except OSError as err:
                raise storage_error(err, entry, "remove") from None

    def open(self, study_record: dict) -> None:
        """Create the folder for this study, or check that it already holds this study.

        ``study_record`` holds at least ``fingerprint``, and ``identity`` for a run that computes. A
        folder holding another study's results, this study's on other data, weights or code, or
        anything that is not a probe result is refused.
        """
        self.check(study_record)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot create the output folder {self.root}: {err.strerror}; give a writable --out") from err
        if not os.access(self.root, os.W_OK):
            raise InputError(f"the output folder {self.root} is not writable; give a writable --out")
        existing = self.read_study()
        if existing is None:
            write_json(self.root / "study.json", {"format_version": FORMAT_VERSION, **study_record})
            existing = study_record
        self.stamp = folder_stamp(existing["fingerprint"], existing.get("identity"))

    def read_study(self) -> dict | None:
        path = self.root / "study.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{path} is unreadable ({err}); delete the folder to start over") from err
        if not isinstance(data, dict):
            raise InputError(f"{path} holds no study record; delete the folder to start over")
        return data

    # ------------------------------------------------------------------ batches

    def _marker(self, index: int) -> Path:
        return self.root / "done" / f"b{index:05d}.json"

    def _part(self, name: str, index: int) -> Path:
        return self.root / "parts" / name / f"b{index:05d}.parquet"

    def part_path(self, name: str, index: int) -> Path:
        """Where table ``name`` of batch ``index`` is kept (``parts/NAME/bIIIII.parquet``)."""
        return self._part(name, index)

    def done_batches(self) -> set[int]:
        folder = self.root / "done"
        if not folder.is_dir():
            return set()
        return {int(p.stem[1:]) for p in folder.glob("b*.json") if p.stem[1:].isdigit()}

    def write_batch(self, index: int, tables: dict[str, pd.DataFrame], info: dict) -> None:
        """Write a batch's parts, then its ``done`` marker (the commit point) with each part's size
        and checksum and the folder's stamp."""
        parts = {}
        for name, frame in tables.items():
            data = parquet_bytes(frame)
            write_file(self._part(name, index), data)
            parts[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        write_json(self._marker(index), {**info, "batch": index, "stamp": self.stamp, "parts": parts})

    def batch_info(self, index: int) -> dict:
        return json.loads(self._marker(index).read_text(encoding="utf-8"))

    def batch_problem(self, index: int) -> str | None:
        """Why batch ``index``'s marker or parts cannot be merged (one clause naming the file), or None."""
        marker = self._marker(index)
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"{marker} is unreadable ({type(err).__name__})"
        if not isinstance(info, dict):
            return f"{marker} is not a done marker"
        if info.get("batch", index) != index:
            return f"{marker} is batch {info.get('batch')}'s marker, copied"
        parts = info.get("parts")
        if parts is None:  # a marker from before checksums: only in a folder from before identities
            if self.stamp is not None:
                return f"{marker} has no checksums (another folder's, or an older probe's)"
            for name in ("examples", "agreement"):
                path = self._part(name, index)
                if not path.is_file():
                    return f"{path} is missing"
                problem = _part_readable(path)
                if problem:
                    return problem
            return None
        if info.get("stamp") != self.stamp:
            return f"{marker} belongs to another study, dataset or model (its stamp differs)"
        if not isinstance(parts, dict) or not {"examples", "agreement"} <= set(parts):
            return f"{marker} lists no examples/agreement parts"
        for name, meta in parts.items():
            path = self._part(name, index)
            if not path.is_file():
                return f"{path} is missing"
            try:
                size = path.stat().st_size
                if not isinstance(meta, dict) or size != meta.get("bytes"):
                    said = meta.get("bytes") if isinstance(meta, dict) else "?"
                    return (f"{path} is not the part its marker records ({size} bytes, the marker says {said}: "
                            "truncated, corrupt or another study's)")
                if file_digest(path) != meta.get("sha256"):
                    return f"{path} is not the part its marker records (checksum differs: corrupt or another study's)"
            except OSError as err:
                return f"{path} is unreadable ({err.strerror or err})"
        return None

    def discard(self, index: int) -> None:
        """Remove batch ``index``'s marker, so the next run recomputes it."""
        try:
            self._marker(index).unlink(missing_ok=True)
        except OSError as err:
            raise storage_error(err, self._marker(index), "remove") from None

    def verified_done(self, log: Callable[[str], None]) -> set[int]:
        """The done batches whose marker and parts verify; each other one is named in one line and
        its marker removed (the batch is then recomputed)."""
        good = set()
        for index in sorted(self.done_batches()):
            problem = self.batch_problem(index)
            if problem is None:
                good.add(index)
                continue
            log(f"batch {index}: {problem}; recomputing it")
            self.discard(index)
        return good

    def merge(self, n_batches: int) -> dict[str, pd.DataFrame]:
        """Verify every batch, then concatenate each table's parts in batch order and write
        ``TABLE.parquet``. A batch that does not verify is refused in one line and set to be
        recomputed by the next run."""
        bad = [(b, problem) for b in range(n_batches) if (problem := self.batch_problem(b)) is not None]
        if bad:
            for b, _ in bad:
                self.discard(b)
            more = f" (and {len(bad) - 1} more batch(es))" if len(bad) > 1 else ""
            raise InputError(f"batch {bad[0][0]}: {bad[0][1]}{more}; nothing was merged and the batch is set to be "
                             "recomputed: run the same command again")
        merged = {}
        for name in TABLES:
            parts = [self._part(name, i) for i in range(n_batches)]
            frames = []
            for path in parts:
                if not path.is_file():
                    continue
                try:
                    frames.append(pd.read_parquet(path))
                except OSError as err:
                    raise storage_error(err, path, "read") from None
                except Exception as err:  # pyarrow raises several kinds for a damaged file
                    raise InputError(f"{path} is unreadable ({type(err).__name__}); delete done/{path.name[:-8]}.json "
                                     "to recompute its batch, then run the same command again") from None
            frames = [f for f in frames if len(f)]
            if not frames:
                continue
            frame = pd.concat(frames, ignore_index=True)
            write_table(self.root / f"{name}.parquet", frame)
            merged[name] = frame
        return merged

    def table(self, name: str) -> pd.DataFrame:
        return pd.read_parquet(self.root / f"{name}.parquet")
