"""Rooms sized to their jobs: the sizes are a smoke alarm, not a target.

A probe module over 600 lines is a question, not a failure: it either says why in its docstring, on a
line that starts with ``Size:`` (what it holds that one room should hold, e.g. the one table of
every method), or is split by job, the split naming the job in its commit, never its line count. A
function over 60 lines is cut into named steps (the list of exceptions records a deliberate one,
with the size it had when it was let in: it may shrink, never grow)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "probe"
MODULE_LINES = 600
FUNCTION_LINES = 60

#: "module:function" -> its lines when the limit was set
FUNCTIONS_OVER: dict[str, int] = {}


def size_reason(source: str) -> str | None:
    """The line of a module's docstring that says why it is as large as it is (``Size: ...``), or None."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    return next((line.strip() for line in doc.splitlines() if line.strip().lower().startswith("size:")), None)


def modules_over_without_a_reason(sources: dict[str, str], limit: int = MODULE_LINES) -> list[str]:
    """``name: N lines`` for every module over ``limit`` lines whose docstring does not say why."""
    return [f"{name}: {len(text.splitlines())} lines, over {limit}: say why in its docstring (a line 'Size: ...') "
            "or split it by job" for name, text in sources.items()
            if len(text.splitlines()) > limit and size_reason(text) is None]


def _function_sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(ROOT)}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def test_a_module_over_the_line_says_why():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert not modules_over_without_a_reason(sources)


def test_the_alarm_rings_for_a_large_module_that_does_not_say_why():
    body = "\n".join(f"X{i} = {i}" for i in range(MODULE_LINES))
    silent = f'"""A module."""\n{body}\n'
    said = f'"""A module.\n\nSize: the one table of every method, which one room should hold."""\n{body}\n'
    assert modules_over_without_a_reason({"silent.py": silent, "said.py": said}) == [
        f"silent.py: {MODULE_LINES + 1} lines, over {MODULE_LINES}: say why in its docstring (a line 'Size: ...') "
        "or split it by job"]
    assert size_reason(said) == "Size: the one table of every method, which one room should hold."


def test_no_function_outgrows_sixty_lines():
    over = [f"{name}: {size} lines, over {FUNCTIONS_OVER.get(name, FUNCTION_LINES)}"
            for name, size in _function_sizes().items() if size > FUNCTIONS_OVER.get(name, FUNCTION_LINES)]
    assert not over


def test_the_list_of_exceptions_holds_only_what_is_still_over():
    """An entry whose function is gone or back within the limit is deleted: the list only shrinks."""
    functions = _function_sizes()
    assert not [f for f in FUNCTIONS_OVER if functions.get(f, 0) <= FUNCTION_LINES]
