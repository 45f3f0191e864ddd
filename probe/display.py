"""How a result shows itself in a notebook: readable tokens, short names for its parts, and the
HTML of its ``_repr_html_``: self-contained (inline styles only, no script, nothing fetched), every
string from data escaped with :func:`probe.document.escape_html`.

Torch-free and matplotlib-free; the figures of ``.plot()`` are :mod:`probe.plots`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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


def token_table_html(tokens: Sequence[str], special: Sequence[bool], columns: Mapping[str, np.ndarray]) -> str:
    """A token x method table: one row per token (its readable text, the raw token on hover), one
    column per method, each cell's background shaded by its score divided by the method's largest
    |score| over the text's scored tokens (red positive, blue negative; finite scores of non-special
    tokens); special tokens greyed and never shaded, unscored cells empty."""
    special = np.asarray([bool(s) for s in special], dtype=bool)
    shades = {name: normalised_scores(np.asarray(values, dtype=float), ~special) for name, values in columns.items()}
    header = "".join(f'<th style="{CELL_STYLE}">{escape_html(name)}</th>' for name in columns)
    lines = [(f'<table style="border-collapse:collapse;font-size:12px"><thead><tr><th>#</th><th>token</th>{header}'
              "</tr></thead><tbody>")]
    for i, token in enumerate(tokens):
        grey = f' style="{SPECIAL_STYLE}"' if special[i] else ""
        cells = [f"<td{grey}>{i}</td>", f'<td{grey} title="{escape_html(token)}">{escape_html(clean_token(token))}</td>']
        for name, values in columns.items():
            value = float(values[i])
            shade = shades[name][i]
            if not np.isfinite(value):
                cells.append(f'<td style="{CELL_STYLE}"></td>')
            elif special[i] or not np.isfinite(shade):
                cells.append(f'<td style="{CELL_STYLE};{SPECIAL_STYLE}">{escape_html(f"{value:+.3g}")}</td>')
            else:
                cells.append(f'<td style="{CELL_STYLE};background:{token_colour(float(shade))}">'
                             f'{escape_html(f"{value:+.3g}")}</td>')
        lines.append("<tr>" + "".join(cells) + "</tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def block_html(title: str, body: str, note: str = "") -> str:
    """A titled block: ``title`` and ``note`` are text (escaped here), ``body`` is HTML."""
    out = f'<div style="margin:0 0 1em 0"><div><b>{escape_html(title)}</b></div>'
    if note:
        out += f'<div style="color:#555">{escape_html(note)}</div>'
    return out + body + "</div>"
