"""An explanation's notebook table at word level (``ex.word_table()``): the table an explanation shows of
itself, one row per word instead of per token, each method's scores of a word's tokens folded into
one (``to_pandas("word")`` holds the same numbers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from probe.explanation.views import Shown

    class _Worded(Shown, Protocol):
        """What :func:`word_level_table` reads of an explanation (:class:`probe.explanation.Explanation` is one)."""

        def columns(self, index: int) -> tuple[dict[str, np.ndarray], dict[str, str]]: ...


@dataclass(frozen=True)
class WordTable:
    """What ``ex.word_table()`` shows: per example its title, words, which are special, the folded
    columns (method label -> ``[words]``) and the columns left unshaded with why."""

    title: str
    agg: str
    tables: Sequence[tuple[str, list[str], list[bool], Mapping[str, np.ndarray], Mapping[str, str]]]
    more: int = 0

    def __repr__(self) -> str:
        return (f"<word table: {len(self.tables) + max(self.more, 0)} example(s), each word the {self.agg} of its "
                "tokens' scores; to_pandas('word') has the numbers>")

    def _repr_html_(self) -> str:
        from probe.display import block_html, token_table_html

        parts = [block_html(self.title, "", f"one row per word, each method's scores of its tokens folded by "
                                             f"{self.agg}; cells shaded as in the token table")]
        for title, words, special, columns, faded in self.tables:
            parts.append(block_html(title, token_table_html(words, special, columns, faded), ""))
        if self.more > 0:
            parts.append(block_html(f"... and {self.more} more example{'s' if self.more != 1 else ''} "
                                    "(ex.to_pandas('word') has them all)", ""))
        return "<div>" + "".join(parts) + "</div>"


def word_level_table(explanation: _Worded, agg: str = "sum") -> WordTable:
    """``explanation``'s notebook table at word level (:meth:`probe.explanation.Explanation.word_table`)."""
    from probe.display import MAX_EXAMPLES, clip, prompt_text
    from probe.errors import InputError
    from probe.explainers.words import word_rows

    groups = explanation.outputs()
    if groups and sum(len(g) for g in groups) == len(explanation.examples):  # every example an output token
        raise InputError("a generated text's table is output token x source token: use ex.to_pandas('word')")
    tables = []
    for i, example in enumerate(explanation.examples[:MAX_EXAMPLES]):
        rows, faded = explanation.columns(i)
        words, special, folded = word_rows("word", explanation.word_groups(i), example.special, rows, agg)
        tables.append((f"example {i}: {clip(prompt_text(example), 120)}", words, special, folded, faded))
    return WordTable(repr(explanation), agg, tables, len(explanation.examples) - MAX_EXAMPLES)
