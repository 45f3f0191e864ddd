"""Rooms sized to their jobs: no probe module over 600 lines, no function over 60.

Nothing is over either limit now, and the lists of exceptions are empty. They stay as the way to
record a deliberate exception (with the size it had when it was let in: it may shrink, never grow);
otherwise a module that outgrows its job is split, a function that outgrows 60 lines is cut into
named steps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "probe"
MODULE_LINES = 600
FUNCTION_LINES = 60

#: module (relative to the repository) -> its lines when the limit was set
MODULES_OVER: dict[str, int] = {}

#: "module:function" -> its lines when the limit was set
FUNCTIONS_OVER: dict[str, int] = {}


def _module_sizes() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def _function_sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(ROOT)}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def _over(sizes: dict[str, int], listed: dict[str, int], limit: int) -> list[str]:
    problems = []
    for name, size in sizes.items():
        allowed = listed.get(name, limit)
        if size > allowed:
            problems.append(f"{name}: {size} lines, over {allowed}"
                            + (" (its size when the limit was set: it may shrink, not grow)" if name in listed else ""))
    return problems


def test_no_module_outgrows_its_room():
    assert not _over(_module_sizes(), MODULES_OVER, MODULE_LINES)


def test_no_function_outgrows_sixty_lines():
    assert not _over(_function_sizes(), FUNCTIONS_OVER, FUNCTION_LINES)


def test_the_lists_of_exceptions_hold_only_what_is_still_over():
    """An entry whose module or function is gone or back within the limit is deleted, so the lists
    only ever shrink towards empty."""
    modules, functions = _module_sizes(), _function_sizes()
    stale = [m for m in MODULES_OVER if modules.get(m, 0) <= MODULE_LINES]
    stale += [f for f in FUNCTIONS_OVER if functions.get(f, 0) <= FUNCTION_LINES]
    assert not stale
