"""The audit report: ``audit.md`` and a self-contained ``audit.html`` from ``AuditResult.to_dict()``
(or from a stored ``audit.json``: ``render_html(json.load(f))``).

Only the audit's own sections are written here; the page, its tables and the escaping are the
report renderer's (:mod:`probe.document`), so every string that comes from the data
(claims, texts, tokens, ids, paths) goes through :func:`~probe.document.escape_html` or
:func:`~probe.document.md_escape`. Numbers are shown to 3 significant digits (effects of
any size side by side: :func:`probe.document.significant`), not the study report's 3 decimals; the
page's style is the report's, with the audit's badges and CI bars added.
"""

from __future__ import annotations

import math

from probe.document import CSS, html_page, html_table, md_table, significant
from probe.document import escape_html as _escape_html
from probe.document import md_escape as _md_escape
from probe.names import printable


def _e(text) -> str:
    """HTML text with control characters (ESC, NUL, bidi overrides) shown as escapes."""
    return _escape_html(printable(text))


def md_escape(text: object) -> str:
    """Markdown text with control characters (ESC, NUL, bidi overrides) shown as escapes."""
    return _md_escape(printable(text))

__all__ = ["claim_warnings", "render_html", "render_markdown", "why_undecided"]

TEXT_CHARS = 240
COLOURS = {"supported": "#1a7f37", "refuted": "#cf222e", "inconclusive": "#9a6700"}


def _ci(ci) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return "n/a"
    return f"[{significant(ci[0])}, {significant(ci[1])}]"


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"


def claim_warnings(evidence: dict) -> list[str]:
    """The warnings a claim's evidence carries (a ``warning`` entry, at the top or in one of its
    parts such as an edge claim's ``control``), shown on their own line above the evidence."""
    found = [evidence["warning"]] if isinstance(evidence.get("warning"), str) else []
    found += [v["warning"] for v in evidence.values() if isinstance(v, dict) and isinstance(v.get("warning"), str)]
    return found


def _evidence_lines(evidence: dict) -> list[tuple[str, str]]:
    """Scalar and summary entries of the evidence as (name, value) text pairs (example lists excluded)."""
    out = []
    for key, value in evidence.items():
        if key in ("for", "against", "warning"):
            continue
        if isinstance(value, dict):
            if "mean" in value and "ci" in value:
                out.append((key, f"{significant(value['mean'])} (CI {_ci(value['ci'])}, n = {significant(value.get('n'))})"))
            elif "verdict" in value:
                out.append((key, f"{value['verdict']}: {significant(value.get('effect'))} (CI {_ci(value.get('ci'))}, "
                                 f"n = {significant(value.get('n'))}"
                                 + (f", n_needed = {significant(value.get('n_needed'))}" if value.get("verdict") == "inconclusive" else "")
                                 + ")"))
            else:
                parts = []
                for k, v in value.items():
                    if k == "warning":  # shown on its own line (claim_warnings)
                        continue
                    if isinstance(v, dict) and "mean" in v:
                        parts.append(f"{k} {significant(v['mean'])} (CI {_ci(v.get('ci'))})")
                    elif not isinstance(v, (dict, list)):
                        parts.append(f"{k} {significant(v)}")
                out.append((key, ", ".join(parts)))
        elif isinstance(value, list):
            out.append((key, ", ".join(significant(v) for v in value)))
        else:
            out.append((key, significant(value)))
    return out


def _detail(entry: dict) -> str:
    """Per-example numbers besides id, text and effect, as one short text."""
    parts = []
    for key, value in entry.items():
        if key in ("id", "text", "effect"):
            continue
        if isinstance(value, list):
            parts.append(f"{key}: {' '.join(str(v) for v in value)}")
        else:
            parts.append(f"{key}: {significant(value)}")
    return "; ".join(parts)


def _model_line(data: dict) -> str:
    m, d, s = data["model"], data["data"], data["statistics"]
    source = d.get("dataset") or "texts"
    where = f"{source} ({d.get('split')}, seed {d.get('seed')})" if d.get("dataset") else "the listed texts"
    return (f"model {m['id']} ({m['task']}, {m['layers']} layers x {m['heads']} heads of {m['stack']} attention, "
            f"{m['dtype']}, {m['device']}); {d['n_examples']} examples from {where}; bootstrap "
            f"{s['bootstrap']} resamples, level {s['level']}, seed {s['seed']}"
            + (f"; RANDOM WEIGHTS, allowed explicitly (allow_random_weights): {', '.join(m['random_weights'])}"
               if m.get("random_weights") else ""))


# ------------------------------------------------------------------------------------------ markdown


def _md(text) -> str:
    """One line of Markdown that shows ``text`` as written: no HTML, image, link or emphasis from the
    data or the claim file gets through; ``|`` is escaped too, so it may stand in a table cell."""
    return md_escape(" ".join(str(text).split()))


_SUMMARY_COLUMNS = ["#", "verdict", "claim", "kind", "effect", "95% CI", "threshold", "n"]
_EXAMPLE_COLUMNS = ["id", "effect", "text", "details"]


def why_undecided(c: dict) -> str:
    """Why a claim (``ClaimResult.to_dict()``) is inconclusive, in words, "" when it was decided: the
    judge's own reason where it gave one (``n = 2, at least 10 needed``; a CI the sign-flip test does
    not back), else the CI holding the threshold where the claim's own CI does (a two-part claim may
    be undecided by its other part), then the examples that would decide it (``n_needed``)."""
    if c["verdict"] != "inconclusive":
        return ""
    evidence, ci, threshold = c.get("evidence") or {}, c.get("ci") or [None, None], c.get("threshold")
    low, high = ci[0], ci[1]
    if evidence.get("why"):
        why = str(evidence["why"])
    elif None not in (low, high, threshold) and low <= threshold <= high:
        why = f"the 95% CI {_ci(ci)} holds the threshold {significant(threshold)}"
    else:
        why = "neither supported nor refuted by its rule"
    needed = evidence.get("n_needed")
    return why + (f"; n_needed = {significant(needed)}" if needed is not None else "")


def _needed(c: dict) -> str:
    if c["verdict"] != "inconclusive":
        return ""
    why = c["evidence"].get("why")
    return f"; n_needed = {significant(c['evidence'].get('n_needed'))}" + (f" ({_md(why)})" if why else "")


def _md_claim(i: int, c: dict) -> list[str]:
    lines = ["", f"## {i}. {c['verdict'].upper()}: {_md(c['claim'])}", "",
             f"- kind: `{c['kind']}`; effect {significant(c['effect'])}, 95% CI {_ci(c['ci'])}, n = {c['n']}{_needed(c)}",
             f"- measure: {_md(c['measure'])}",
             f"- rule: {_md(c['rule'])}",
             f"- intervention: {_md(c['intervention'])}"]
    lines[4:4] = [f"- **warning**: {_md(w)}" for w in claim_warnings(c["evidence"])]
    lines += [f"- {_md(key)}: {_md(value)}" for key, value in _evidence_lines(c["evidence"])]
    for side in ("for", "against"):
        entries = c["evidence"].get(side) or []
        if entries:
            lines += ["", f"Most {side}:", ""]
            lines += md_table(_EXAMPLE_COLUMNS, ([_md(e["id"]), significant(e["effect"]), _md(_short(e["text"])),
                                                 _md(_detail(e))] for e in entries))
    return lines


def render_markdown(data: dict) -> str:
    lines = [f"# Attention audit: {_md(data['source'])}", ""]
    if data.get("description"):
        lines += [_md(data["description"]), ""]
    lines += [_md(_model_line(data)), ""]
    lines += md_table(_SUMMARY_COLUMNS, ([str(i), f"**{c['verdict']}**", _md(c["claim"]), c["kind"], significant(c["effect"]),
                                          _ci(c["ci"]), significant(c["threshold"]), str(c["n"])]
                                         for i, c in enumerate(data["claims"], 1)))
    for i, c in enumerate(data["claims"], 1):
        lines += _md_claim(i, c)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ html

#: the audit's own components (verdict badges, CI bars); the page, its headings and its tables are the
#: study report's (:data:`probe.document.CSS`)
_AUDIT_CSS = """
.v{color:#fff;border-radius:.3em;padding:.1em .45em;font-weight:600;font-size:.85em;white-space:nowrap}
.meta{color:var(--muted);font-size:.92em}
.bar{position:relative;height:1.1em;background:var(--soft);border:1px solid var(--line);border-radius:.2em;width:16em}
.bar .ci{position:absolute;top:.25em;height:.6em;opacity:.55}
.bar .mean{position:absolute;top:0;height:100%;width:2px;background:var(--ink)}
.bar .thr{position:absolute;top:-.2em;height:1.5em;border-left:2px dashed var(--muted)}
ul{margin:.3em 0 .6em 1.2em;padding:0}
"""


def _badge(verdict: str) -> str:
    return f'<span class="v" style="background:{COLOURS.get(verdict, "#59636e")}">{_e(verdict)}</span>'


def _bar(c: dict) -> str:
    """The CI as a band, the mean as a line, the threshold dashed, on an axis that holds all three."""
    lo, hi, mean, t = (c["ci"][0] if c["ci"] else None), (c["ci"][1] if c["ci"] else None), c["effect"], c["threshold"]
    points = [v for v in (lo, hi, mean, t, 0.0) if v is not None and math.isfinite(v)]
    left, right = min(points), max(points)
    if right - left < 1e-12:
        right = left + 1.0
    pad = 0.08 * (right - left)
    left, right = left - pad, right + pad

    def at(v):
        return 100.0 * (v - left) / (right - left)

    parts = []
    if lo is not None and hi is not None:
        parts.append(f'<span class="ci" style="left:{at(lo):.1f}%;width:{max(at(hi) - at(lo), 0.5):.1f}%;'
                     f'background:{COLOURS.get(c["verdict"], "#59636e")}"></span>')
    if mean is not None:
        parts.append(f'<span class="mean" style="left:{at(mean):.1f}%"></span>')
    if t is not None:
        parts.append(f'<span class="thr" style="left:{at(t):.1f}%" title="threshold {_e(significant(t))}"></span>')
    title = f"effect {significant(mean)}, CI {_ci(c['ci'])}, threshold {significant(t)}; axis {significant(left)} to {significant(right)}"
    return f'<div class="bar" title="{_e(title)}">{"".join(parts)}</div>'


def _num_cell(value) -> str:
    return f'<td class="num">{_e(value)}</td>'


def _html_claim(i: int, c: dict) -> list[str]:
    out = [f'<h2 id="claim-{i}">{i}. {_badge(c["verdict"])} {_e(c["claim"])}</h2>', "<ul>",
           f"<li>kind <code>{_e(c['kind'])}</code>; effect {_e(significant(c['effect']))}, 95% CI {_e(_ci(c['ci']))}, "
           f"n = {_e(c['n'])}{_e(_needed(c))}</li>",
           f"<li>measure: {_e(c['measure'])}</li>", f"<li>rule: {_e(c['rule'])}</li>",
           f"<li>intervention: {_e(c['intervention'])}</li>"]
    out[3:3] = [f"<li><b>warning</b>: {_e(w)}</li>" for w in claim_warnings(c["evidence"])]
    out += [f"<li>{_e(key)}: {_e(value)}</li>" for key, value in _evidence_lines(c["evidence"])]
    out.append("</ul>")
    for side in ("for", "against"):
        entries = c["evidence"].get(side) or []
        if entries:
            out.append(f"<p><b>Most {side}</b></p>")
            out.append(html_table((f'<td>{_e(e["id"])}</td>{_num_cell(significant(e["effect"]))}'
                                   f'<td>{_e(_short(e["text"]))}</td><td>{_e(_detail(e))}</td>' for e in entries),
                                  _EXAMPLE_COLUMNS))
    return out


def render_html(data: dict) -> str:
    title = f"Attention audit: {data['source']}"
    out = [f"<h1>{_e(title)}</h1>"]
    if data.get("description"):
        out.append(f"<p>{_e(' '.join(str(data['description']).split()))}</p>")  # YAML's folded text ends in a newline
    out.append(f'<p class="meta">{_e(_model_line(data))}</p>')
    out.append(html_table((f'<td>{i}</td><td>{_badge(c["verdict"])}</td><td><a '
                           f'href="#claim-{i}">{_e(c["claim"])}</a></td>'
                           f'<td>{_e(c["kind"])}</td>{_num_cell(significant(c["effect"]))}{_num_cell(_ci(c["ci"]))}'
                           f'{_num_cell(significant(c["threshold"]))}{_num_cell(c["n"])}<td>{_bar(c)}</td>'
                           for i, c in enumerate(data["claims"], 1)), _SUMMARY_COLUMNS + ["CI vs threshold"]))
    for i, c in enumerate(data["claims"], 1):
        out += _html_claim(i, c)
    return html_page(title, CSS + _AUDIT_CSS, out)
