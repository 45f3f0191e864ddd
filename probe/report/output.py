"""Where a report goes: the output folder (made, or reused only when it holds this report), the
figures and CSV tables collected while the sections are built, and the files written atomically
(never a half-written report beside a finished one)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from probe.document import (
    Document,
    Figure,
    md_escape,
    render_html,
    render_markdown,
)
from probe.errors import InputError
from probe.files import commit_folder, new_staging, write_file


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
    """Collects figures and tables while sections are built. Everything is written into a staging
    folder beside ``out`` (``.NAME.new-PID-XXXX``) that :func:`write_report` swaps into place once the
    report is complete, so the earlier report stays whole until then."""

    def __init__(self, out: Path, source: Path | None = None):
        self.out = out
        #: the result folder the report is of (kept in ``.probe-source`` beside the report)
        self.source = source
        #: what the report was rendered from (kept in ``.probe-inputs``; None: not recorded)
        self.inputs: str | None = None
        self.figures: dict[str, bytes] = {}
        self.tables: list[Path] = []
        _remove_stale_staging(out)
        self.staging = new_staging(out, f".{out.name}.new-{os.getpid()}-", "write the report into")

    def figure(self, name: str, png: bytes, caption: str) -> Figure:
        self.figures[name] = png
        return Figure(name=name, png=png, caption=caption)

    def csv(self, name: str, frame: pd.DataFrame) -> str:
        write_file(self.staging / "tables" / f"{name}.csv", frame.to_csv(index=False, float_format="%.6g"))
        self.tables.append(self.out / "tables" / f"{name}.csv")
        return f"tables/{name}.csv"


def _remove_stale_staging(out: Path) -> None:
    """Staging folders of report writers that died (kill -9, a full disk) are removed."""
    import shutil

    if not out.parent.is_dir():
        return
    for entry in out.parent.glob(f".{out.name}.new-*"):
        pid = entry.name[len(out.name) + 6:].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            if int(pid) != os.getpid():
                continue  # another writer at work
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)


REPORT_ENTRIES = {"report.html", "report.md", "figures", "tables"}


def _incomplete_report(out: Path, entries: list[str], first: str) -> bool:
    """A report folder an earlier probe left half-written: only report entries, the CSVs and PNGs a
    report writes, and no titled report.md."""
    if not set(entries) <= REPORT_ENTRIES or first.startswith("# "):
        return False
    for folder, suffix in (("figures", ".png"), ("tables", ".csv")):
        path = out / folder
        if path.exists() and (not path.is_dir() or any(not p.name.startswith(".") and p.suffix != suffix
                                                       for p in path.iterdir())):
            return False
    return True


#: beside a study's report: the result folder it was rendered from
SOURCE_FILE = ".probe-source"
#: beside a study's report: the digest of the completion record (and probe version) it was rendered from,
#: then the sha256 of each report file as written (``SHA256  NAME`` lines)
INPUTS_FILE = ".probe-inputs"
#: the report files whose digests ``INPUTS_FILE`` keeps
RECORDED_FILES = ("report.html", "report.md")


def read_inputs(out: Path) -> tuple[str | None, dict[str, str]]:
    """(the inputs stamp, ``{report file: sha256 as written}``) kept beside the report in ``out``;
    (None, {}) where there is none (a partial report's, or one written before it was kept)."""
    try:
        lines = (Path(out) / INPUTS_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None, {}
    if not lines or not lines[0].strip():
        return None, {}
    written = {}
    for line in lines[1:]:
        digest, _, name = line.strip().partition("  ")
        if name:
            written[name] = digest
    return lines[0].strip(), written


def _own_report_folder(out: Path, source: Path) -> bool:
    """Whether ``out`` is the report folder inside the result folder ``source`` (``SOURCE/report``):
    it moves and is copied with its folder, so it is that folder's own whatever path it recorded."""
    try:
        return Path(out).resolve() == Path(source).resolve() / "report"
    except OSError:
        return False


def _moved_here(out: Path, recorded: str, inputs: str | None) -> bool:
    """Whether the report in ``out``, recorded as of the result folder ``recorded``, is of a folder
    since moved: ``recorded`` holds no result any more and the report was rendered from the very
    completion record (``inputs``) the folder now given holds."""
    if inputs is None or (Path(recorded) / "study.json").exists():
        return False
    return read_inputs(out)[0] == inputs


def prepare_out(out: Path, title: str, source: Path | None = None, inputs: str | None = None) -> None:
    """Create ``out``, or accept it when it is empty or holds a report with this ``title`` (this
    study's report, written before) of the result folder ``source``; anything else is refused, so
    no other report or file is overwritten (another result's report of a study with the same name
    included). A result folder that was moved or copied is still itself: the report folder inside it
    (``SOURCE/report``) is its own whatever path it recorded, and a report elsewhere recorded as of a
    folder that no longer exists is accepted when it was rendered from the completion record
    ``inputs`` that ``source`` holds now."""
    if out.exists() and not out.is_dir():
        raise InputError(f"the report folder {out} is a file; give a folder as --out")
    recorded = out / SOURCE_FILE
    if source is not None and recorded.is_file():
        other = recorded.read_text(encoding="utf-8", errors="replace").strip()
        if (other and other != str(Path(source).resolve()) and not _own_report_folder(out, source)
                and not _moved_here(out, other, inputs)):
            raise InputError(f"the report folder {out} holds the report of another result folder ({other}); give an "
                             "empty or new --out (or this result's own report folder)")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if entries:
            first = ""
            if (out / "report.md").is_file():
                with open(out / "report.md", encoding="utf-8", errors="replace") as f:
                    first = f.readline().rstrip("\n")
            if _incomplete_report(out, entries, first):
                first = f"# {md_escape(title)}"  # probe's own report, cut short (kill -9, a full disk): rebuilt
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
    """Write the report into the writer's staging folder, then swap it into ``out`` whole."""
    import shutil

    figure_paths, written = {}, []
    try:
        for name, png in w.figures.items():
            write_file(w.staging / "figures" / f"{name}.png", png)
            figure_paths[name] = f"figures/{name}.png"
            written.append(out / "figures" / f"{name}.png")
        rendered = {"report.html": render_html(doc).encode("utf-8"),
                    "report.md": render_markdown(doc, figure_paths).encode("utf-8")}
        for name, data in rendered.items():
            write_file(w.staging / name, data)
        if w.source is not None:
            write_file(w.staging / SOURCE_FILE, str(Path(w.source).resolve()) + "\n")
        if w.inputs is not None:  # what report_is_current checks: the inputs, and each file as written
            import hashlib

            write_file(w.staging / INPUTS_FILE, w.inputs + "\n" + "".join(
                f"{hashlib.sha256(rendered[name]).hexdigest()}  {name}\n" for name in RECORDED_FILES))
        commit_folder(w.staging, out)
    except BaseException:
        shutil.rmtree(w.staging, ignore_errors=True)
        raise
    html_path, md_path = out / "report.html", out / "report.md"
    return ReportFiles(out_dir=out, html=html_path, markdown=md_path, figures=written, tables=list(w.tables),
                       sections=[s.id for s in doc.sections], partial=partial)
