"""One page per committed report under reports/, written into docs/results/ before every build.

A report's Markdown links its own figures and tables by paths relative to its folder
(``figures/x.png``, ``tables/x.csv``); on the page those become paths from docs/results/ back to the
report's folder, tables as download links (MyST's ``path:`` scheme), so the rendered report shows
the committed figures and offers the committed CSVs. The pages are generated (git-ignored):
a report rerun and recommitted is what the next build shows.
"""

from __future__ import annotations

import re
from pathlib import Path

REPORT_FILES = ("report.md", "planted.md", "audit.md")
_LINK = re.compile(r"(!?)\[((?:\\.|[^\]\\\n])*)\]\(([^)\s]+)\)")  # a label may hold escaped brackets


def report_sources(root: Path) -> dict[str, Path]:
    """``{name: its Markdown file}`` for every folder of reports/ that holds one."""
    found = {}
    for folder in sorted(p for p in (root / "reports").iterdir() if p.is_dir()):
        for name in REPORT_FILES:
            if (folder / name).is_file():
                found[folder.name] = folder / name
                break
    return found


def _rewrite(text: str, up: str) -> str:
    def one(match: re.Match) -> str:
        bang, label, target = match.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#") or target.startswith("/"):
            return match.group(0)
        path = f"{up}/{target}"
        if bang:
            return f"![{label}]({path})"
        if target.split("#")[0].endswith(".md"):
            return match.group(0)
        return f"[{label}](path:{path})"

    return _LINK.sub(one, text)


def write_result_pages(docs: Path) -> list[str]:
    """Write docs/results/NAME.md for every report; returns the names written."""
    root = docs.parent
    out = docs / "results"
    out.mkdir(exist_ok=True)
    names = []
    for name, source in report_sources(root).items():
        up = "../../" + source.parent.relative_to(root).as_posix()
        text = _rewrite(source.read_text(encoding="utf-8"), up)
        page = out / f"{name}.md"
        if not page.is_file() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")
        names.append(name)
    for stale in out.glob("*.md"):
        if stale.stem not in names:
            stale.unlink()
    return names
