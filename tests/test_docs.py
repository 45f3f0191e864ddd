"""The documentation's Python runs: every ```python block of the README and of every page under
docs/, each page's blocks in order in one namespace, from an empty folder (what a block writes, a
figure or a study's results, lands there). A block that imports a package the test extra does not
install (inseq) is skipped, and only such a block; the skip is reported.

Beside that, what the pages promise is there: the examples the "From Python" guide is meant to
show, the generated reference pages' sources, and a page for every committed report."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = ("_build", "_draft", "results", "tutorial", "reference/_generated")


def pages() -> list[Path]:
    """The README and every hand-written Markdown page of docs/ (generated ones are left out)."""
    found = [ROOT / "README.md"]
    for page in sorted(DOCS.rglob("*.md")):
        relative = page.relative_to(DOCS).as_posix()
        if not any(relative == g or relative.startswith(g + "/") for g in GENERATED):
            found.append(page)
    return found


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def missing_modules(block: str) -> list[str]:
    """Top-level packages the block imports that are not installed here."""
    names = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


PAGES_WITH_PYTHON = [p for p in pages() if python_blocks(p)]


def run_page(page: Path) -> tuple[dict, list[str]]:
    namespace: dict = {"__name__": "docs"}
    skipped, absent_here = [], set()
    for i, block in enumerate(python_blocks(page)):
        used = {node.id for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Name)}
        absent = set(missing_modules(block)) | (used & absent_here)  # imported here, or by a block skipped above
        if absent:
            absent_here |= absent
            skipped.append(f"block {i + 1} needs {', '.join(sorted(absent))}")
            continue
        exec(compile(block, f"{page.relative_to(ROOT)} python block {i + 1}", "exec"), namespace)
    return namespace, skipped


def test_the_pages_with_python_are_the_expected_ones():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_PYTHON}
    assert {"README.md", "docs/getting-started.md", "docs/guides/python.md", "docs/guides/coming-from.md"} <= names


@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["docs"])
    namespace, skipped = run_page(page)
    relative = page.relative_to(ROOT).as_posix()
    if relative in ("README.md", "docs/getting-started.md"):
        assert (tmp_path / "first_explanation.png").stat().st_size > 10_000
        top = namespace["ex"].top_tokens(1, method="loo_delete", example=0)
        assert top[0][1] == "not"  # what the README's sentence says the figure shows
    if relative == "docs/guides/python.md":
        ex, run, audit = namespace["ex"], namespace["run"], namespace["audit"]
        assert ex.methods == ["attention_mean", "rollout", "integrated_gradients", "loo_delete"]
        assert run.complete and (tmp_path / "results" / "readme" / "verdict.json").is_file()
        assert run.verdict.answer in ("yes", "heads only", "no", "undecidable")
        assert audit.claims[0].verdict in ("supported", "refuted", "inconclusive")
        assert namespace["maps"].weights.shape[3] == 1  # one query row: [CLS]
        assert "random" in set(namespace["curves"].ranking)
    if skipped:
        assert all("inseq" in s for s in skipped), skipped  # the only package the test extra leaves out
        pytest.skip(f"{relative}: ran every block but {'; '.join(skipped)} (not installed)")


def test_the_python_guide_has_its_examples():
    joined = "\n".join(python_blocks(DOCS / "guides" / "python.md"))
    for call in ("probe.load_model(", "probe.wrap(", "probe.explain(", ".to_pandas()", "probe.loo(", "probe.erasure(",
                 "probe.head_ablation(", "probe.counterfactual_attention(", "probe.capture(", "probe.run_study(",
                 "probe.audit("):
        assert call in joined, call


def test_every_committed_report_gets_a_page(tmp_path):
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import results_pages
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    sources = results_pages.report_sources(ROOT)
    folders = {p.name for p in (ROOT / "reports").iterdir() if p.is_dir()}
    assert set(sources) == folders  # a report folder without a report file would have no page
    # the links of a report page point back into its folder, figures as images, tables as downloads
    text = results_pages._rewrite("![a \\[n\\] b](figures/x.png) [t](tables/y.csv) [s](#verdict) [o](other.md)",
                                  "../../reports/q")
    assert text == ("![a \\[n\\] b](../../reports/q/figures/x.png) [t](path:../../reports/q/tables/y.csv) "
                    "[s](#verdict) [o](other.md)")


def excerpts() -> list[tuple[Path, str, str]]:
    """Code the pages quote rather than run: ```{code-block} python blocks captioned
    'PATH (excerpt)', as (page, PATH, the quoted code)."""
    found = []
    pattern = re.compile(r"^```\{code-block\} python\n:caption: (\S+) \(excerpt\)\n\n(.*?)^```", flags=re.S | re.M)
    for page in pages():
        for path, code in pattern.findall(page.read_text(encoding="utf-8")):
            found.append((page, path, code))
    return found


def test_quoted_code_is_the_code():
    """An excerpt is the named file's own text: every line of it that is not elided ("...") occurs
    in that file, whitespace aside, so the pages cannot quote code that has changed."""
    quoted = excerpts()
    assert quoted, "the contributing pages quote the registry and a method"
    for page, path, code in quoted:
        source = " ".join((ROOT / path).read_text(encoding="utf-8").split())
        for line in code.splitlines():
            words = " ".join(line.split())
            if words and "..." not in words:
                assert words in source, f"{page.relative_to(ROOT)} quotes {path}: {line.strip()!r} is not there"
