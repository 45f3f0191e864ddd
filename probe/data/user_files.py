"""The records of a user's dataset file (.csv, .jsonl or .json), read one at a time, and the checks
of a label's value: :mod:`probe.data` makes its examples from them. No record is read before it is
asked for, except a ``.json`` list: JSON cannot be read in part, so it is parsed whole. The seeded
shuffle a draw takes its rows from is read here a slice at a time, without the list of every row."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from probe.errors import InputError

__all__ = ["MAX_CSV_FIELD", "ShuffledOrder", "label_kind", "parse_label", "raw_records", "shuffled_positions"]

#: the longest CSV field probe reads (the csv module's own default is 128 KiB): a text this long is
#: far past any model's window, and is left out by the study's length limit
MAX_CSV_FIELD = 16 * 2**20


def raw_records(path: Path, header: list[str]) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` per row of a user file, in order (``where``: "line N" or "item N"); a CSV's
    header is appended to ``header`` as soon as it is read."""
    if path.suffix.lower() == ".csv":
        return _csv_records(path, header)
    return _json_records(path)


def _csv_records(path: Path, header: list[str]) -> Iterator[tuple[str, dict]]:
    import csv

    def read(step):
        # the csv module's field limit is process-wide: raised for each read only, then put back
        limit = csv.field_size_limit(MAX_CSV_FIELD)
        try:
            return step()
        except csv.Error as exc:
            if "field larger than field limit" in str(exc):
                raise InputError(f"{path} line {reader.line_num}: a field is longer than {MAX_CSV_FIELD:,} characters, "
                                 "the most probe reads from a CSV (a text that long is past any model's window): "
                                 "shorten or drop that row") from None
            raise InputError(f"{path} is not a readable CSV at line {reader.line_num} ({exc}); save it as UTF-8 CSV "
                             "with a header row") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"{path} is not a readable UTF-8 CSV ({exc}); save it as UTF-8 CSV with a header "
                             "row") from None
        finally:
            csv.field_size_limit(limit)

    # utf-8-sig: spreadsheet programs often write a byte-order mark before the header.
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        header.extend(read(lambda: reader.fieldnames) or [])
        previous_end = reader.line_num
        while True:
            record = read(lambda: next(reader, None))
            if record is None:
                return
            yield f"line {previous_end + 1}", record  # a quoted field may span several lines
            previous_end = reader.line_num


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    import io

    try:
        if path.suffix.lower() == ".json":
            content = path.read_text(encoding="utf-8-sig")
            stripped = content.lstrip()
            if stripped.startswith("{"):
                try:
                    whole = json.loads(content)
                except json.JSONDecodeError:
                    whole = None  # perhaps one object per line: read below
                if isinstance(whole, dict) and any(isinstance(v, (list, dict)) for v in whole.values()):  # a wrapper
                    keys = ", ".join(sorted(map(str, whole))[:5]) or "no keys"
                    raise InputError(f"{path} holds one JSON object ({keys}), not a list of examples; give a list like "
                                     '[{"text": "...", "label": 1}, ...] or one object per line')
            if stripped.startswith("["):
                try:
                    items = json.loads(content)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
                yield from ((f"item {i}", item) for i, item in enumerate(items))
                return
            lines: Iterable[str] = io.StringIO(content)
            yield from _json_lines(path, lines)
            return
        with path.open(encoding="utf-8-sig") as handle:
            yield from _json_lines(path, handle)
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 ({exc}); save it as UTF-8") from None


def _json_lines(path: Path, lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: line {line_number} is not valid JSON ({exc.msg}); one object per line") from None
        yield f"line {line_number}", record


def label_kind(value: Any) -> str | None:
    """What a label value is (None: no label): a class id (an integer, also written 1.0 or "1"), a
    boolean, a string, a non-integer number, ..."""
    if (value is None or (isinstance(value, str) and not value.strip())
            or (isinstance(value, float) and math.isnan(value))):
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return "string"
        return "class id" if number.is_integer() else "string"
    if isinstance(value, (int, float)):
        return "class id" if float(value).is_integer() else "non-integer number"
    return type(value).__name__



def parse_label(value: Any, path: Path, row: int, where: str, label_column: str) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, bool):
        raise InputError(f"{path}: row {row} ({where}) has {label_column}={json.dumps(value)}, a boolean; labels are "
                         "integer class ids: write 1 and 0 (0 = negative, 1 = positive for the built-in classifier)")
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


class ShuffledOrder(Sequence[int]):
    """``list(range(count))`` after ``random.Random(seed).shuffle``, read a slice at a time without the
    list: a draw of ``n`` of 10^6 rows holds memory for ``n`` and the random state, not 8 MB of order."""

    count: int  # the instance's number of positions (it hides Sequence.count)

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return shuffled_positions(self.count, self.seed, range(self.count)[index])
        return shuffled_positions(self.count, self.seed, [range(self.count)[index]])[0]


def shuffled_positions(count: int, seed: int, places: Sequence[int]) -> list[int]:
    """``order[p]`` for each ``p`` of ``places``, where ``order = list(range(count))`` shuffled in place by
    ``random.Random(seed).shuffle``: the same random draws, replayed twice instead of held. The shuffle
    swaps ``order[i]`` with ``order[j_i]`` for ``i`` from ``count - 1`` down to 1; undoing those swaps
    from ``i = 1`` up carries each place back to the position its value started at. The draws come
    out in the other order, so the first replay saves the generator's state every ``block`` steps and
    the second regenerates one block at a time (memory: a state per block and one block of draws)."""
    import array

    rng = random.Random(seed)
    # what Random.shuffle draws its j with (tested against shuffle itself)
    draw = rng._randbelow  # type: ignore[attr-defined]  # CPython's private method: typeshed does not declare it
    block = max(2**16, math.isqrt(count) * 64)
    starts = []  # (highest i of a block, the state before its draws)
    for top in range(count - 1, 0, -block):
        starts.append((top, rng.getstate()))
        for i in range(top, max(top - block, 0), -1):
            draw(i + 1)
    where = {p: p for p in places}  # a position now -> the place whose value it holds
    for top, state in reversed(starts):
        rng.setstate(state)
        draws = array.array("q", (draw(i + 1) for i in range(top, max(top - block, 0), -1)))
        for i, j in zip(range(top - len(draws) + 1, top + 1), reversed(draws)):
            if i != j:
                a, b = where.pop(i, None), where.pop(j, None)
                if a is not None:
                    where[j] = a
                if b is not None:
                    where[i] = b
    value = {p: v for v, p in where.items()}
    return [value[p] for p in places]
