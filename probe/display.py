"""How a result shows itself in a notebook: readable tokens, short names for its parts, and the
HTML of its ``_repr_html_``: self-contained (inline styles only, no script, nothing fetched), every
string from data escaped with :func:`probe.document.escape_html`.

Torch-free and matplotlib-free; the figures of ``.plot()`` are :mod:`probe.plots`'.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import pandas as pd

from probe.document import escape_html, fmt, html_table, normalised_scores, token_colour

CONTINUATION_PREFIX = "##"  # WordPiece: this piece continues the previous word
WORD_START_PREFIXES = ("Ġ", "▁")  # byte-level BPE / sentencepiece: this piece starts a word
NEWLINE_MARKER = "Ċ"  # byte-level BPE's newline
MAX_EXAMPLES = 5  # examples an explanation's HTML shows
MAX_ROWS = 12  # table rows a result's HTML shows
SPECIAL_STYLE = "color:#9a9a9a;font-style:italic"
CELL_STYLE = "padding:1px 6px;text-align:right;font-variant-numeric:tabular-nums"
FLAG_COLOUR = "#b00000"  # a failed check's lines and marks


def clean_token(token: str) -> str:
    """``token`` as a reader writes it: the WordPiece ``##``, byte-level BPE ``Ġ`` and sentencepiece
    ``▁`` markers stripped, byte-level BPE's newline ``Ċ`` shown as ``⏎``. A token that would be left
    empty (a lone marker: a space) stays as it is."""
    text = str(token)
    if text.startswith(CONTINUATION_PREFIX) and len(text) > len(CONTINUATION_PREFIX):
        text = text[len(CONTINUATION_PREFIX):]
    for prefix in WORD_START_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    text = text.replace(NEWLINE_MARKER, "\u23ce")
    return text if text.strip() else str(token)


#: whitespace as a reader sees it in a token: a space, a newline, a tab, a carriage return
WHITESPACE_SIGNS = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}  # ␣ ↵ ⇥ ␍
#: byte-level BPE's stand-ins for whitespace bytes (GPT-2, Llama 3, SmolLM, ...) and sentencepiece's space
MARKED_WHITESPACE = {"\u0120": " ", "\u010a": "\n", "\u0109": "\t", "\u010d": "\r", "\u2581": " "}
#: sentencepiece's byte fallback: a whitespace byte as a token of its own (``<0x0A>``)
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def shown_token(token: str) -> str:
    """``token`` (a tokenizer's string such as ``Ġcapital``, ``##ing``, ``Ċ``, or decoded text such
    as ``" Paris"``, ``"\\n"``) as the HTML tables, the plots and the terminal show it: the space that
    starts a word (``Ġ``, ``▁``, a leading space) dropped, every other space, newline, tab and carriage
    return visible (``␣``, ``↵``, ``⇥``, ``␍``: a token that is only whitespace never shows blank), and
    a WordPiece continuation keeps its ``##`` (``play ##ing`` reads as one word in two pieces). Unlike
    :func:`clean_token` (the tables' ``clean_token`` column, words joined from pieces) it never strips
    ``##``."""
    text = str(token)
    fallback = BYTE_FALLBACK.fullmatch(text)
    if fallback and chr(int(fallback.group(1), 16)) in WHITESPACE_SIGNS:
        text = chr(int(fallback.group(1), 16))
    elif not text.startswith(CONTINUATION_PREFIX):
        text = "".join(MARKED_WHITESPACE.get(c, c) for c in text)
    if text.startswith(" ") and text.strip():
        text = text[1:]  # the space that starts a word: the word reads as itself
    return "".join(WHITESPACE_SIGNS.get(c, c) for c in text)


class _Prompt(Protocol):
    """What :func:`prompt_text` reads of an example (a :class:`probe.rows.target.PreparedExample` is one;
    a chat prompt's ``messages``, ``(start, end, role)`` in ``text``, are read where it has them)."""

    @property
    def text(self) -> str: ...


def prompt_text(example: _Prompt) -> str:
    """What a prompt says, for a header: a chat prompt's messages (``role: content``; a single user
    message as it is), not the template around them (whose system prompt comes first and would fill
    the header); any other example's text."""
    messages = getattr(example, "messages", ()) or ()
    if not messages:
        return str(example.text)
    if len(messages) == 1 and messages[0][2] == "user":
        return example.text[messages[0][0]:messages[0][1]]
    return " | ".join(f"{role}: {example.text[start:end]}" for start, end, role in messages)


def name_list(names: Iterable[str], limit: int = 4) -> str:
    """``a, b, c`` or ``a, b, c, ... (+2)``: at most ``limit`` names."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


def shape_text(shape: Sequence[int]) -> str:
    """``[2, 6, 12]`` as ``2x6x12``."""
    return "x".join(str(int(n)) for n in shape)


def clip(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    one_line = " ".join(str(text).split())
    return one_line if len(one_line) <= limit else one_line[: max(limit - 1, 0)] + "\u2026"


def unit_row(values: np.ndarray) -> tuple[np.ndarray, str]:
    """One ``[tokens]`` row from a method's scores for one example, and what it is: the scores of a
    token-level method as they are, a per-layer method's last layer, a per-head method's last layer
    averaged over its heads (NaN-aware)."""
    values = np.asarray(values, dtype=float)
    if values.ndim == 1:
        return values, ""
    if values.ndim == 2:  # [layer, tokens]
        return values[-1], "last layer"
    last = values[-1]  # [head, tokens]
    finite = np.isfinite(last)
    count = finite.sum(axis=0)
    mean = np.where(finite, last, 0.0).sum(axis=0) / np.maximum(count, 1)
    return np.where(count > 0, mean, np.nan), "last layer, head mean"


def frame_html(frame: pd.DataFrame, caption: str = "", max_rows: int = MAX_ROWS) -> str:
    """A table's first ``max_rows`` rows as HTML (numbers to 3 decimals), with a line saying how many
    more there are."""
    shown = frame.head(max_rows)
    rows = ("".join(f"<td>{escape_html(fmt(v))}</td>" for v in row) for row in shown.itertuples(index=False, name=None))
    out = html_table(rows, [str(c) for c in shown.columns], caption=caption)
    if len(frame) > len(shown):
        out += f"<p><i>{escape_html(f'first {len(shown)} of {len(frame)} rows')}</i></p>"
    return out


def score_cell(value: float, shade: float, plain: bool = False) -> str:
    """One score's ``<td>``: empty where ``value`` is not finite (not scored); the value in grey
    italics, unshaded, where ``plain`` (a special token, a faded method) or ``shade`` (the value over
    its scale, in [-1, 1]) is not finite; else its background shaded by ``shade``
    (:func:`probe.document.token_colour`: red positive, blue negative)."""
    if not np.isfinite(value):
        return f'<td style="{CELL_STYLE}"></td>'
    text = escape_html(f"{value:+.3g}")
    if plain or not np.isfinite(shade):
        return f'<td style="{CELL_STYLE};{SPECIAL_STYLE}">{text}</td>'
    return f'<td style="{CELL_STYLE};background:{token_colour(float(shade))}">{text}</td>'


def token_table_html(tokens: Sequence[str], special: Sequence[bool], columns: Mapping[str, np.ndarray],
                     faded: Mapping[str, str] | None = None) -> str:
    """A token x method table: one row per token (its readable text, the raw token on hover), one
    column per method.

    Each method is shaded against its own scale, and the scale is stated: a cell's background is
    its score divided by the method's largest |score| over the text's scored tokens (finite scores
    of non-special tokens; red positive, blue negative), and that largest |score| is written under
    the method's name (``max |s| 0.0033``), so two columns equally red are told apart by their
    scales. A method in ``faded`` (column label -> why: its scores are at the target's noise floor,
    its own check failed) is never shaded: its values are grey, and its header says why, so that
    noise never looks as strong as a real effect. Special tokens are greyed and never shaded;
    unscored cells are empty."""
    faded = dict(faded or {})
    special = np.asarray([bool(s) for s in special], dtype=bool)
    header = []
    for name, values in columns.items():
        values = np.asarray(values, dtype=float)
        scored = values[~special & np.isfinite(values)]
        scale = f"max |s| {float(np.abs(scored).max()):.2g}" if scored.size else "no scored token"
        note = f"{scale}; not shaded: {faded[name]}" if name in faded else scale
        header.append(f'<th style="{CELL_STYLE}">{escape_html(name)}<br>'
                      f'<span style="font-weight:normal;font-size:10px;color:#666">{escape_html(note)}</span></th>')
    shades = {name: normalised_scores(np.asarray(values, dtype=float), ~special) for name, values in columns.items()}
    lines = [(f'<table style="border-collapse:collapse;font-size:12px"><thead><tr><th>#</th><th>token</th>'
              f'{"".join(header)}</tr></thead><tbody>')]
    for i, token in enumerate(tokens):
        grey = f' style="{SPECIAL_STYLE}"' if special[i] else ""
        cells = [f"<td{grey}>{i}</td>", f'<td{grey} '
                                        f'title="{escape_html(token)}">{escape_html(shown_token(token))}</td>']
        cells += [score_cell(float(values[i]), float(shades[name][i]), bool(special[i]) or name in faded)
                  for name, values in columns.items()]
        lines.append("<tr>" + "".join(cells) + "</tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def matrix_table_html(values: np.ndarray, rows: Sequence[str], columns: Sequence[str],
                      special: Sequence[bool], written: int) -> str:
    """One prompt x output matrix (inseq's layout turned so that it reads down the output): a row
    per output token (``rows``: their text), a column per source token (``columns``: the tokenizer's
    strings, shown by :func:`shown_token`, the raw string on hover); the last ``written`` columns are
    output tokens (target-side steps), their headers underlined. ``values``: ``[output, source]``,
    NaN where a token is not scored (left empty). Cells shaded by their score over the matrix's
    largest |score| of non-special tokens; special tokens' columns greyed, never shaded."""
    values = np.asarray(values, dtype=float)  # [output, source]
    special = np.asarray([bool(s) for s in special], dtype=bool)
    shades = normalised_scores(values, np.broadcast_to(~special, values.shape))
    first_written = len(columns) - written
    header = []
    for p, token in enumerate(columns):
        style = CELL_STYLE + (";" + SPECIAL_STYLE if special[p] else "") + (
            ";text-decoration:underline" if p >= first_written else "")
        title = escape_html(f"{p}: {token}")
        header.append(f'<th style="{style}" title="{title}">{escape_html(shown_token(token))}</th>')
    lines = ['<div style="overflow-x:auto"><table style="border-collapse:collapse;font-size:12px"><thead><tr>'
             '<th style="text-align:left">output \u2193 / source \u2192</th>' + "".join(header)
             + "</tr></thead><tbody>"]
    for j, row in enumerate(rows):
        cells = [f'<th style="text-align:left;white-space:nowrap">{escape_html(row)}</th>']
        cells += [score_cell(float(values[j, p]), float(shades[j, p]), bool(special[p])) for p in range(len(columns))]
        lines.append("<tr>" + "".join(cells) + "</tr>")
    lines.append("</tbody></table></div>")
    return "".join(lines)


def block_html(title: str, body: str, note: str = "") -> str:
    """A titled block: ``title`` and ``note`` are text (escaped here), ``body`` is HTML."""
    out = f'<div style="margin:0 0 1em 0"><div><b>{escape_html(title)}</b></div>'
    if note:
        out += f'<div style="color:#555">{escape_html(note)}</div>'
    return out + body + "</div>"


def warning_html(lines: Sequence[str]) -> str:
    """Failed checks' lines as HTML, in the colour of a warning (each line escaped)."""
    return "".join(f'<div style="color:{FLAG_COLOUR}">{escape_html(line)}</div>' for line in lines)
