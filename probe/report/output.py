"""Where a report goes: the output folder (made, or reused only when it holds this report), the
figures and CSV tables collected while the sections are built, and the files written atomically
(never a half-written report beside a finished one)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from probe.errors import InputError
from probe.report.document import Document, Figure, md_escape, render_html, render_markdown


@dataclass
class ReportFiles:
    """What a report wrote: ``html`` (self-contained), ``markdown``, ``figures`` (PNG files next to
    the Markdown), ``tables`` (CSV), and the ids of the sections it holds, in order."""

    out_dir: Path
    html: Path
    markdown: Path
    figures: list[Path] = field(default_factory=list)
    tables: list[Path] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)
    partial: bool = False


class Writer:
    """Collects figures and tables while sections are built."""

    def __init__(self, out: Path):
        self.out = out
        self.figures: dict[str, bytes] = {}
        self.tables: list[Path] = []

    def figure(self, name: str, png: bytes, caption: str) -> Figure:
        self.figures[name] = png
        return Figure(name=name, png=png, caption=caption)

    def csv(self, name: str, frame: pd.DataFrame) -> str:
        path = self.out / "tables" / f"{name}.csv"
        atomic_text(path, frame.to_csv(index=False, float_format="%.6g"))
        self.tables.append(path)
        return f"tables/{name}.csv"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_text(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


REPORT_ENTRIES = {"report.html", "report.md", "figures", "tables"}


def prepare_out(out: Path, title: str) -> None:
    """Create ``out``, or accept it when it is empty or holds a report with this ``title`` (this
    study's report, written before); anything else is refused, so no other report or file is
    overwritten."""
    if out.exists() and not out.is_dir():
        raise InputError(f"the report folder {out} is a file; give a folder as --out")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if entries:
            first = ""
            if (out / "report.md").is_file():
                with open(out / "report.md", encoding="utf-8", errors="replace") as f:
                    first = f.readline().rstrip("\n")
            if not set(entries) <= REPORT_ENTRIES or first != f"# {md_escape(title)}":
                what = (f"the report {first[2:]!r}" if first.startswith("# ") and set(entries) <= REPORT_ENTRIES
                        else f"other files ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''})")
                raise InputError(f"the report folder {out} holds {what}; give an empty or new --out (or this "
                                 "study's own report folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot create the report folder {out}: {err.strerror}; give a writable --out") from err
    if not os.access(out, os.W_OK):
        raise InputError(f"the report folder {out} is not writable; give a writable --out")


def write_report(doc: Document, w: Writer, out: Path, partial: bool) -> ReportFiles:
    fig_dir = out / "figures"
    figure_paths, written = {}, []
    for name, png in w.figures.items():
        path = fig_dir / f"{name}.png"
        atomic_text(path, png)
        figure_paths[name] = f"figures/{name}.png"
        written.append(path)
    html_path, md_path = out / "report.html", out / "report.md"
    atomic_text(html_path, render_html(doc))
    atomic_text(md_path, render_markdown(doc, figure_paths))
    return ReportFiles(out_dir=out, html=html_path, markdown=md_path, figures=written, tables=list(w.tables),
                       sections=[s.id for s in doc.sections], partial=partial)
