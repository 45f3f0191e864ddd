"""The one renderer of probe's reports: a study report (and a comparison) as a list of sections of
simple blocks, written out as one self-contained HTML file or as Markdown with PNG files beside it;
and the page, table and escaping writers that the audit report (``probe.claims.render``) builds on.

Every string that comes from data (dataset text, tokens, names from the study or claim file) is
escaped where it is written: :func:`escape_html` for HTML, :func:`md_escape` for Markdown. Blocks
hold plain text only, never markup.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from probe.names import printable

# --------------------------------------------------------------------------- blocks


@dataclass
class Para:
    text: str
    style: str = ""  # "", "note", "lead", "quote", "banner"


@dataclass
class Bullets:
    items: list[str]


@dataclass
class KeyValues:
    rows: list[tuple[str, str]]


@dataclass
class Table:
    frame: pd.DataFrame
    caption: str = ""
    csv: str | None = None  # the CSV file (relative to the report folder) holding the full table
    max_rows: int = 200


@dataclass
class Figure:
    name: str  # file name without extension
    png: bytes
    caption: str
    alt: str = ""


@dataclass
class TokenView:
    """Examples shown as coloured text, one line per method (see tokens.TokenExample)."""
    examples: list
    measure: str
    unit: str


@dataclass
class Section:
    id: str
    title: str
    blocks: list = field(default_factory=list)


@dataclass
class Document:
    title: str
    subtitle: str = ""
    banner: str | None = None
    sections: list[Section] = field(default_factory=list)


# --------------------------------------------------------------------------- formatting


def fmt(value: object) -> str:
    """A cell: floats to 3 decimals, integers as they are, missing values empty."""
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.3f}"
    try:
        if pd.isna(value):
            return ""
    except (TypeError, ValueError):
        pass
    return str(value)


def significant(value: object, digits: int = 3) -> str:
    """A number to ``digits`` significant digits, so that effects of any size read side by side (the
    audit's numbers; the study report's tables use :func:`fmt`'s 3 decimals): tiny values in
    exponent form, a bool as yes/no, an int as it is, "n/a" where missing or not finite."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#~])")
_MD_BLOCK_START = re.compile(r"^(\s*\d{0,9})([-+.)])(?=\s|$)")  # "- x", "+ x", "1. x", "1) x": a list item
_AUTOLINK = re.compile(r"(?i)(?<=[a-z])://|(?<![a-z0-9])(?=www\.)w")  # what GFM turns into links by itself


def md_escape(text: object) -> str:
    """Text that Markdown shows as written: HTML-significant characters as entities, Markdown
    punctuation (backslash, backtick, *, _, [, ], |, #, ~) backslash-escaped, a leading list or
    heading marker escaped, bare URLs broken with an entity so GFM does not link them, newlines as
    spaces. No HTML, image, link or emphasis in ``text`` survives; control characters (ESC, NUL,
    right-to-left overrides) are shown as escapes."""
    s = printable(text, keep_newlines=True)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    s = " ".join(s.splitlines()) if "\n" in s or "\r" in s else s
    s = _AUTOLINK.sub(lambda m: "&#58;//" if m.group().startswith(":") else "&#119;", s)
    return _MD_BLOCK_START.sub(r"\1\\\2", s, count=1)


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


# --------------------------------------------------------------------------- HTML

CSS = """
:root { --ink: #1d2430; --muted: #5b6573; --line: #d9dee5; --accent: #2b5fad; --bg: #ffffff; --soft: #f4f6f9; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
       font: 15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 36px 0 10px; padding-top: 10px; border-top: 2px solid var(--line); }
h3 { font-size: 16px; margin: 20px 0 8px; }
.subtitle { color: var(--muted); margin: 0 0 16px; }
nav.toc { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 10px 18px; margin: 14px 0; }
nav.toc ol { margin: 4px 0; padding-left: 20px; }
nav.toc a { color: var(--accent); text-decoration: none; }
.banner { background: #fff4d6; border: 2px solid #e0a400; border-radius: 6px; padding: 10px 14px; font-weight: 600; }
.lead { font-size: 17px; }
.note { color: var(--muted); font-size: 13px; }
.quote { border-left: 4px solid var(--line); padding: 4px 12px; color: #333; background: var(--soft); }
.answer { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 700; }
.answer-yes { background: #2e7d32; } .answer-no { background: #c62828; } .answer-heads-only { background: #b26a00; } .answer-undecidable { background: #546e7a; }
table { border-collapse: collapse; margin: 8px 0 4px; font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; vertical-align: top; }
th { background: var(--soft); text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv th { width: 260px; }
.tablewrap { overflow-x: auto; max-width: 100%; }
caption { caption-side: top; text-align: left; color: var(--muted); padding-bottom: 4px; }
figure { margin: 14px 0; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figcaption { color: var(--muted); font-size: 13px; }
.tokens { border: 1px solid var(--line); border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.tokens .head { font-size: 13px; color: var(--muted); margin-bottom: 4px; }
.tokens .text { margin: 0 0 6px; font-size: 14px; }
.tokens .row { display: grid; grid-template-columns: 250px 1fr; gap: 8px; margin: 3px 0; }
.tokens .label { font-size: 12px; color: var(--muted); }
.tok { padding: 1px 2px; margin: 1px 1px; border-radius: 3px; display: inline-block; line-height: 1.35; }
.tok.unscored { color: #9aa3ad; font-style: italic; }
"""


def escape_html(text: object) -> str:
    """``text`` (any value, as ``str``) safe as HTML text or as a quoted attribute value, control
    characters shown as escapes."""
    return html.escape(printable(text, keep_newlines=True), quote=True)


_h = escape_html


def script_json(value: Any) -> str:
    """``value`` as JSON safe inside an HTML ``<script>`` element: ``<``, ``>`` and ``&`` as ``\\u``
    escapes (so no ``</script>`` or ``<!--`` can end or bend the element) and every non-ASCII
    character escaped too (U+2028 and U+2029 end a line in older JavaScript)."""
    import json

    text = json.dumps(value, ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def html_page(title: str, css: str, body: Iterable[str]) -> str:
    """One self-contained page: ``css`` inline, no script, font or image from elsewhere, and an empty
    icon so that a browser asks for none. ``title`` is text; ``body`` is HTML, one line per item."""
    return "\n".join(['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
                      '<meta name="viewport" content="width=device-width, initial-scale=1">',
                      '<link rel="icon" href="data:,">',
                      f"<title>{_h(title)}</title><style>{css}</style></head><body><main>",
                      *body, "</main></body></html>\n"])


def html_table(rows: Iterable[str], header: Sequence[str] | None = None, *, caption: str = "",
               css_class: str = "") -> str:
    """A table in a wrapper that scrolls sideways when it is wide. ``header``: column names (text);
    ``rows``: each row's cells as HTML (``<td>`` / ``<th>`` elements, their text escaped)."""
    cls = f' class="{_h(css_class)}"' if css_class else ""
    parts = [f'<div class="tablewrap"><table{cls}>']
    if caption:
        parts.append(f"<caption>{_h(caption)}</caption>")
    if header is not None:
        parts.append("<thead><tr>" + "".join(f"<th>{_h(c)}</th>" for c in header) + "</tr></thead>")
    parts.append("<tbody>" + "".join(f"<tr>{cells}</tr>" for cells in rows) + "</tbody></table></div>")
    return "".join(parts)


def _html_table(block: Table) -> str:
    frame = block.frame
    shown = frame.head(block.max_rows)
    numeric = [pd.api.types.is_numeric_dtype(shown[c]) and not pd.api.types.is_bool_dtype(shown[c])
               for c in shown.columns]
    rows = ("".join(_html_cell(value, is_num) for value, is_num in zip(row, numeric))
            for row in shown.itertuples(index=False, name=None))
    parts = [html_table(rows, list(shown.columns), caption=block.caption)]
    if len(frame) > len(shown):
        parts.append(f'<p class="note">{_h(f"first {len(shown)} of {len(frame)} rows")}'
                     + (f" (all in {_h(block.csv)})" if block.csv else "") + "</p>")
    elif block.csv:
        parts.append(f'<p class="note">as CSV: {_h(block.csv)}</p>')
    return "".join(parts)


def _html_cell(value, numeric: bool) -> str:
    cls = ' class="num"' if numeric or _looks_numeric(value) else ""
    return f"<td{cls}>{_h(fmt(value))}</td>"


def _looks_numeric(value) -> bool:
    return isinstance(value, str) and bool(re.fullmatch(r"[+-]?\d[\d.]*( \[[^\]]*\])?", value))


def token_colour(value: float) -> str:
    """Background for a normalised score in [-1, 1]: red for positive, blue for negative."""
    v = max(-1.0, min(1.0, value))
    alpha = round(abs(v) * 0.85, 3)
    return f"rgba(214, 69, 65, {alpha})" if v >= 0 else f"rgba(49, 110, 200, {alpha})"


def normalised_scores(values: np.ndarray, scored: np.ndarray) -> np.ndarray:
    """``values`` divided by their largest magnitude over the ``scored`` positions (finite ones), so
    that they lie in [-1, 1]; NaN where a position is not scored (or its value is not finite)."""
    v = np.where(scored & np.isfinite(values), values, np.nan)
    scale = np.nanmax(np.abs(v)) if np.isfinite(v).any() else 0.0
    return v / scale if scale > 0 else np.where(np.isfinite(v), 0.0, np.nan)


def _html_tokens(block: TokenView) -> str:
    parts = []
    for group in ("highest", "lowest"):
        examples = [e for e in block.examples if e.group == group]
        if not examples:
            continue
        parts.append(f"<h3>{_h(f'{len(examples)} examples with the {group} agreement of {block.unit}')}</h3>")
        for ex in examples:
            head = (f"example {ex.example} \u00b7 {block.measure} {ex.agreement:+.3f} \u00b7 explained: "
                    f"{ex.target}")
            parts.append(f'<div class="tokens"><div class="head">{_h(head)}</div><p class="text">{_h(ex.text)}</p>')
            for row in ex.rows:
                norm = normalised_scores(row.values[: len(ex.tokens)], ex.scored[: len(row.values)])
                spans = []
                for i, token in enumerate(ex.tokens):
                    value = norm[i] if i < len(norm) else np.nan
                    raw = row.values[i] if i < len(row.values) else np.nan
                    if not np.isfinite(value):
                        spans.append(f'<span class="tok unscored" title="not scored">{_h(token)}</span>')
                    else:
                        spans.append(f'<span class="tok" style="background: {token_colour(float(value))}" '
                                     f'title="{_h(f"{raw:.4g}")}">{_h(token)}</span>')
                parts.append(f'<div class="row"><div '
                             f'class="label">{_h(row.label)}</div><div>{"".join(spans)}</div></div>')
            parts.append("</div>")
    parts.append('<p class="note">Colour: each line\'s score divided by its largest |score| over the scored tokens '
                 '(red positive, blue negative; stronger = larger). Grey italics: not scored (special or template '
                 'tokens). Hover a token for its raw score.</p>')
    return "".join(parts)


def render_html(doc: Document) -> str:
    out = [f"<h1>{_h(doc.title)}</h1>"]
    if doc.subtitle:
        out.append(f'<p class="subtitle">{_h(doc.subtitle)}</p>')
    if doc.banner:
        out.append(f'<p class="banner" id="partial-banner">{_h(doc.banner)}</p>')
    out.append('<nav class="toc"><strong>Contents</strong><ol>')
    out += [f'<li><a href="#{_h(s.id)}">{_h(s.title)}</a></li>' for s in doc.sections]
    out.append("</ol></nav>")
    for section in doc.sections:
        out.append(f'<section id="{_h(section.id)}"><h2>{_h(section.title)}</h2>')
        for block in section.blocks:
            out.append(_html_block(block))
        out.append("</section>")
    return html_page(doc.title, CSS, out)


def _html_block(block) -> str:
    if isinstance(block, Para):
        if block.style == "answer":
            slug = _anchor(block.text)
            return f'<p class="lead">Answer: <span class="answer answer-{_h(slug)}">{_h(block.text.upper())}</span></p>'
        if block.style == "h3":
            return f"<h3>{_h(block.text)}</h3>"
        cls = f' class="{_h(block.style)}"' if block.style else ""
        return f"<p{cls}>{_h(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_h(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, KeyValues):
        return html_table((f"<th>{_h(k)}</th><td>{_h(v)}</td>" for k, v in block.rows), css_class="kv")
    if isinstance(block, Table):
        return _html_table(block)
    if isinstance(block, Figure):
        data = base64.b64encode(block.png).decode("ascii")
        return (f'<figure><img src="data:image/png;base64,{data}" alt="{_h(block.alt or block.caption)}">'
                f"<figcaption>{_h(block.caption)}</figcaption></figure>")
    if isinstance(block, TokenView):
        return _html_tokens(block)
    raise TypeError(f"unknown block {type(block).__name__}")


# --------------------------------------------------------------------------- Markdown


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines. ``header`` and ``rows``: cells as Markdown (escaped by the caller),
    each row as long as the header."""
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(cells) + " |" for cells in rows])


def _md_table(frame: pd.DataFrame, max_rows: int) -> list[str]:
    shown = frame.head(max_rows)
    return md_table([md_escape(c) for c in shown.columns],
                    ([md_escape(fmt(v)) for v in row] for row in shown.itertuples(index=False, name=None)))


def _md_tokens(block: TokenView) -> list[str]:
    lines = []
    for group in ("highest", "lowest"):
        examples = [e for e in block.examples if e.group == group]
        if not examples:
            continue
        lines += [f"### {len(examples)} examples with the {group} agreement of {md_escape(block.unit)}", ""]
        for ex in examples:
            lines.append(f"**example {ex.example}** ({md_escape(block.measure)} {ex.agreement:+.3f}, explained: "
                         f"{md_escape(ex.target)}): {md_escape(ex.text)}")
            lines.append("")
            lines += ["| method | top-5 tokens (score / largest abs score) |", "|---|---|"]
            for row in ex.rows:
                norm = normalised_scores(row.values[: len(ex.tokens)], ex.scored[: len(row.values)])
                finite = np.flatnonzero(np.isfinite(norm))
                top = finite[np.argsort(-norm[finite], kind="stable")][:5]
                cells = ", ".join(f"{md_escape(ex.tokens[i])} {norm[i]:+.2f}" for i in top)
                lines.append(f"| {md_escape(row.label)} | {cells} |")
            lines.append("")
    return lines


def render_markdown(doc: Document, figure_paths: dict[str, str]) -> str:
    """``figure_paths``: figure name -> path relative to the Markdown file."""
    lines = [f"# {md_escape(doc.title)}", ""]
    if doc.subtitle:
        lines += [md_escape(doc.subtitle), ""]
    if doc.banner:
        lines += [f"> **{md_escape(doc.banner)}**", ""]
    lines += ["## Contents", ""]
    lines += [f"{i}. [{md_escape(s.title)}](#{_anchor(s.title)})" for i, s in enumerate(doc.sections, 1)]
    lines.append("")
    for section in doc.sections:
        lines += [f"## {md_escape(section.title)}", ""]
        for block in section.blocks:
            lines += _md_block(block, figure_paths)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _md_block(block, figure_paths: dict[str, str]) -> list[str]:
    if isinstance(block, Para):
        text = md_escape(block.text)
        if block.style == "answer":
            return [f"**Answer: {text.upper()}**"]
        if block.style == "h3":
            return [f"### {text}"]
        if block.style in ("quote", "banner"):
            return [f"> {text}"]
        if block.style == "note":
            return [f"*{text}*"]
        return [text]
    if isinstance(block, Bullets):
        return [f"- {md_escape(item)}" for item in block.items]
    if isinstance(block, KeyValues):
        return _md_table(pd.DataFrame(block.rows, columns=["", "value"]), len(block.rows))
    if isinstance(block, Table):
        lines = [f"*{md_escape(block.caption)}*", ""] if block.caption else []
        lines += _md_table(block.frame, block.max_rows)
        if len(block.frame) > block.max_rows:
            lines += ["", f"*first {block.max_rows} of {len(block.frame)} rows"
                      + (f"; all in {md_escape(block.csv)}*" if block.csv else "*")]
        elif block.csv:
            lines += ["", f"*as CSV: [{md_escape(block.csv)}]({block.csv})*"]
        return lines
    if isinstance(block, Figure):
        return [f"![{md_escape(block.alt or block.caption)}]({figure_paths[block.name]})", "",
                f"*{md_escape(block.caption)}*"]
    if isinstance(block, TokenView):
        return _md_tokens(block)
    raise TypeError(f"unknown block {type(block).__name__}")
