"""The regular expressions a user gives, compiled and run with a bound on time.

A pattern a user gives (a study's ``spans`` and ``dataset.filters.contains``, a claim file's
``spans``, ``pattern`` and ``attends_to``, the Python API's ``spans=``) can backtrack
catastrophically: ``(a|aa)+$`` against sixty ``a`` and a ``!`` would run for ages in Python's
``re``, and a claim file is what an auditor receives from someone else. Every such pattern is
compiled and run here, and nowhere else, with the ``regex`` engine (Python's ``re`` syntax,
version 0), whose matching takes a timeout: one search over one text that runs past
:data:`MATCH_SECONDS` is stopped and refused in one line naming the pattern and the fix.

That engine spells out counted repeats when it compiles (``(a{1000}){1000}`` is a million
steps, a minute at ``{10000}``) and a compile cannot be stopped, so a pattern whose counted
repeats spell out more than :data:`MAX_REPEAT_SIZE` items is refused before it is compiled
(measured on the parse of Python's own ``re``; where ``re`` cannot parse it, every ``{m}`` of the
pattern is multiplied, which can only overcount).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from probe.errors import InputError

#: the longest one search of one user pattern over one text may run (seconds): no pattern without
#: catastrophic backtracking comes near it on any text a model reads
MATCH_SECONDS = 1.0

#: the most items a pattern's counted repeats may spell out (``x{m}`` counts m, nested repeats
#: multiply): compiling it then takes well under a second
MAX_REPEAT_SIZE = 100_000

#: how long a pattern may be shown in a message before it is cut
_SHOWN = 80


def _shown(source: str) -> str:
    text = source if len(source) <= _SHOWN else source[:_SHOWN] + "..."
    return repr(text)


def pattern_problem(source: str) -> str | None:
    """Why ``source`` cannot be a user pattern (its syntax error, or repeats too large to compile),
    as the end of a sentence that starts with the pattern; None when it can."""
    try:
        _compiled(source, False)
    except _Refused as refused:
        return refused.reason
    return None


def user_pattern(source: str, what: str = "pattern", *, ignore_case: bool = False) -> UserPattern:
    """``source`` compiled for bounded matching; refused in one line (``what`` names where it was given,
    e.g. ``"spans"`` or ``"dataset.filters.contains"``) when it is no regular expression or repeats too much."""
    if not isinstance(source, str):
        raise InputError(f"{what} {source!r} is a {type(source).__name__}, not a regular expression: give a string "
                         "(e.g. '\\w+')")
    try:
        compiled = _compiled(source, ignore_case)
    except _Refused as refused:
        raise InputError(f"{what} {_shown(source)} {refused.reason}") from None
    return UserPattern(source, what, compiled)


@dataclass(frozen=True, eq=False)
class UserPattern:
    """A compiled user pattern whose every search stops after :data:`MATCH_SECONDS`; one that runs
    longer is an :class:`~probe.errors.InputError` naming the pattern and the fix."""

    source: str
    what: str
    _compiled: Any

    def ranges(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` of each match in ``text``, in order (empty matches included)."""
        return self._bounded(text, lambda timeout: [m.span() for m in self._compiled.finditer(text, timeout=timeout)])

    def search(self, text: str) -> bool:
        """Whether the pattern matches somewhere in ``text``."""
        return self._bounded(text, lambda timeout: self._compiled.search(text, timeout=timeout) is not None)

    def fullmatch(self, text: str) -> bool:
        """Whether the pattern matches the whole of ``text``."""
        return self._bounded(text, lambda timeout: self._compiled.fullmatch(text, timeout=timeout) is not None)

    def _bounded(self, text: str, run):
        try:
            return run(MATCH_SECONDS)
        except TimeoutError:
            raise InputError(
                f"{self.what} {_shown(self.source)} ran past the {MATCH_SECONDS:g} s limit on one text of {len(text)} "
                "characters and was stopped: it backtracks catastrophically (a repeat inside a repeat, like (a+)+ or "
                "(a|aa)+); rewrite it so that each character can be matched one way only (e.g. a+ for (a+)+), or "
                "make the inner repeat atomic ((?>a+)+)") from None


class _Refused(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@lru_cache(maxsize=256)
def _compiled(source: str, ignore_case: bool):
    import regex

    size = _repeat_size(source)
    if size > MAX_REPEAT_SIZE:
        raise _Refused(f"repeats too much to be compiled: its counted repeats spell out {size:,} items (at most "
                       f"{MAX_REPEAT_SIZE:,}); use smaller counts, or + and {{1,n}} in place of large {{m}} or {{m,n}}")
    flags = regex.VERSION0 | (regex.IGNORECASE if ignore_case else 0)
    try:
        return regex.compile(source, flags)
    except regex.error as err:
        raise _Refused(f"is not a valid regular expression ({err}); fix it (escape special characters with \\)") from None
    except (RecursionError, OverflowError, MemoryError):
        raise _Refused("nests or repeats too deeply to be compiled; give a simpler pattern") from None


def _repeat_size(source: str) -> int:
    """How many items the counted repeats of ``source`` spell out: each item 1, a repeat its body
    times its least count (at least 1), a group or a branch the sum of its parts."""
    import sys
    import warnings

    if sys.version_info >= (3, 11):
        from re import _parser as parser
    else:  # Python 3.10
        import sre_parse as parser
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = parser.parse(source)
        return _items(parsed, parser)
    except RecursionError:
        raise _Refused("nests too deeply to be compiled; give a simpler pattern") from None
    except Exception:  # a syntax only the regex engine reads (\p{L}, ...): every {m} multiplied, an overcount
        import re

        size = 1
        for count in re.findall(r"\{(\d+)(?:,\d*)?\}", source):
            size *= max(int(count), 1)
            if size > MAX_REPEAT_SIZE:
                break
        return size


def _items(sequence, parser) -> int:
    repeats = {parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", parser.MAX_REPEAT)}
    total = 0
    for op, value in sequence:
        if op in repeats:
            least, _, body = value
            total += max(int(least), 1) * _items(body, parser) + 1
        else:
            total += 1 + sum(_items(part, parser) for part in _parts(value, parser))
        if total > MAX_REPEAT_SIZE:
            return total
    return total


def _parts(value, parser):
    """The sub-patterns inside one parsed item (a group's, an assertion's, a branch's alternatives)."""
    if isinstance(value, parser.SubPattern):
        yield value
    elif isinstance(value, (tuple, list)):
        for part in value:
            if isinstance(part, parser.SubPattern):
                yield part
            elif isinstance(part, list) and part and all(isinstance(p, parser.SubPattern) for p in part):
                yield from part
