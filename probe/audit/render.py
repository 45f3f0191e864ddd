"""The audit report: ``audit.md`` and a self-contained ``audit.html`` from ``AuditResult.to_dict()``.

The HTML has inline CSS only (no scripts, fonts or images from elsewhere), and every string that
comes from the data (claims, texts, tokens, ids, paths) goes through :func:`html.escape`.
"""

from __future__ import annotations

import html
import math

__all__ = ["render_html", "render_markdown"]

TEXT_CHARS = 240
COLOURS = {"supported": "#1a7f37", "refuted": "#cf222e", "inconclusive": "#9a6700"}


def _num(value, digits: int = 3) -> str:
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


def _ci(ci) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return "n/a"
    return f"[{_num(ci[0])}, {_num(ci[1])}]"


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"


def _evidence_lines(evidence: dict) -> list[tuple[str, str]]:
    """Scalar and summary entries of the evidence as (name, value) text pairs (example lists excluded)."""
    out = []
    for key, value in evidence.items():
        if key in ("for", "against"):
            continue
        if isinstance(value, dict):
            if "mean" in value and "ci" in value:
                out.append((key, f"{_num(value['mean'])} (CI {_ci(value['ci'])}, n = {_num(value.get('n'))})"))
            elif "verdict" in value:
                out.append((key, f"{value['verdict']}: {_num(value.get('effect'))} (CI {_ci(value.get('ci'))}, "
                                 f"n = {_num(value.get('n'))}"
                                 + (f", n_needed = {_num(value.get('n_needed'))}" if value.get("verdict") == "inconclusive" else "")
                                 + ")"))
            else:
                parts = []
                for k, v in value.items():
                    if isinstance(v, dict) and "mean" in v:
                        parts.append(f"{k} {_num(v['mean'])} (CI {_ci(v.get('ci'))})")
                    elif not isinstance(v, (dict, list)):
                        parts.append(f"{k} {_num(v)}")
                out.append((key, ", ".join(parts)))
        elif isinstance(value, list):
            out.append((key, ", ".join(_num(v) for v in value)))
        else:
            out.append((key, _num(value)))
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
            parts.append(f"{key}: {_num(value)}")
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
    data or the claim file gets through (:func:`probe.report.document.md_escape`); ``|`` is escaped
    too, so it may stand in a table cell."""
    from probe.report.document import md_escape

    return md_escape(" ".join(str(text).split()))


def render_markdown(data: dict) -> str:
    lines = [f"# Attention audit: {_md(data['source'])}", ""]
    if data.get("description"):
        lines += [_md(data["description"]), ""]
    lines += [_md(_model_line(data)), "",
             "| # | verdict | claim | kind | effect | 95% CI | threshold | n |",
             "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(data["claims"], 1):
        lines.append(f"| {i} | **{c['verdict']}** | {_md(c['claim'])} | {c['kind']} | {_num(c['effect'])} | "
                     f"{_ci(c['ci'])} | {_num(c['threshold'])} | {c['n']} |")
    for i, c in enumerate(data["claims"], 1):
        lines += ["", f"## {i}. {c['verdict'].upper()}: {_md(c['claim'])}", "",
                  f"- kind: `{c['kind']}`; effect {_num(c['effect'])}, 95% CI {_ci(c['ci'])}, n = {c['n']}"
                  + (f"; n_needed = {_num(c['evidence'].get('n_needed'))}" if c["verdict"] == "inconclusive" else ""),
                  f"- measure: {_md(c['measure'])}",
                  f"- rule: {_md(c['rule'])}",
                  f"- intervention: {_md(c['intervention'])}"]
        for key, value in _evidence_lines(c["evidence"]):
            lines.append(f"- {_md(key)}: {_md(value)}")
        for side in ("for", "against"):
            entries = c["evidence"].get(side) or []
            if not entries:
                continue
            lines += ["", f"Most {side}:", "", "| id | effect | text | details |", "|---|---|---|---|"]
            for e in entries:
                lines.append(f"| {_md(e['id'])} | {_num(e['effect'])} | {_md(_short(e['text']))} | "
                             f"{_md(_detail(e))} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ html

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:70em;
padding:0 1em;color:#1f2328;line-height:1.45}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;width:100%}th,td{border:1px solid #d0d7de;padding:.3em .5em;
vertical-align:top;text-align:left;font-size:.92em}th{background:#f6f8fa}
.v{color:#fff;border-radius:.3em;padding:.1em .45em;font-weight:600;font-size:.85em;white-space:nowrap}
.meta{color:#59636e;font-size:.92em}.num{font-variant-numeric:tabular-nums;white-space:nowrap}
.bar{position:relative;height:1.1em;background:#f6f8fa;border:1px solid #d0d7de;border-radius:.2em;width:16em}
.bar .ci{position:absolute;top:.25em;height:.6em;opacity:.55}
.bar .mean{position:absolute;top:0;height:100%;width:2px;background:#1f2328}
.bar .thr{position:absolute;top:-.2em;height:1.5em;border-left:2px dashed #59636e}
ul{margin:.3em 0 .6em 1.2em;padding:0}
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


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
        parts.append(f'<span class="thr" style="left:{at(t):.1f}%" title="threshold {_e(_num(t))}"></span>')
    title = f"effect {_num(mean)}, CI {_ci(c['ci'])}, threshold {_num(t)}; axis {_num(left)} to {_num(right)}"
    return f'<div class="bar" title="{_e(title)}">{"".join(parts)}</div>'


def render_html(data: dict) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>Attention audit: {_e(data['source'])}</title>", f"<style>{_CSS}</style></head><body>",
           f"<h1>Attention audit: {_e(data['source'])}</h1>",
           f"<p>{_e(data['description'])}</p>" if data.get("description") else "",
           f'<p class="meta">{_e(_model_line(data))}</p>',
           "<table><tr><th>#</th><th>verdict</th><th>claim</th><th>kind</th><th>effect</th><th>95% CI</th>"
           "<th>threshold</th><th>n</th><th>CI vs threshold</th></tr>"]
    for i, c in enumerate(data["claims"], 1):
        out.append(f'<tr><td>{i}</td><td>{_badge(c["verdict"])}</td><td><a href="#claim-{i}">{_e(c["claim"])}</a></td>'
                   f'<td>{_e(c["kind"])}</td><td class="num">{_e(_num(c["effect"]))}</td>'
                   f'<td class="num">{_e(_ci(c["ci"]))}</td><td class="num">{_e(_num(c["threshold"]))}</td>'
                   f'<td class="num">{_e(c["n"])}</td><td>{_bar(c)}</td></tr>')
    out.append("</table>")
    for i, c in enumerate(data["claims"], 1):
        needed = (f"; n_needed = {_e(_num(c['evidence'].get('n_needed')))}" if c["verdict"] == "inconclusive" else "")
        out += [f'<h2 id="claim-{i}">{i}. {_badge(c["verdict"])} {_e(c["claim"])}</h2>', "<ul>",
                f"<li>kind <code>{_e(c['kind'])}</code>; effect {_e(_num(c['effect']))}, 95% CI {_e(_ci(c['ci']))}, "
                f"n = {_e(c['n'])}{needed}</li>",
                f"<li>measure: {_e(c['measure'])}</li>", f"<li>rule: {_e(c['rule'])}</li>",
                f"<li>intervention: {_e(c['intervention'])}</li>"]
        out += [f"<li>{_e(key)}: {_e(value)}</li>" for key, value in _evidence_lines(c["evidence"])]
        out.append("</ul>")
        for side in ("for", "against"):
            entries = c["evidence"].get(side) or []
            if not entries:
                continue
            out.append(f"<p><b>Most {side}</b></p><table><tr><th>id</th><th>effect</th><th>text</th>"
                       "<th>details</th></tr>")
            out += [f'<tr><td>{_e(e["id"])}</td><td class="num">{_e(_num(e["effect"]))}</td>'
                    f'<td>{_e(_short(e["text"]))}</td><td>{_e(_detail(e))}</td></tr>' for e in entries]
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
