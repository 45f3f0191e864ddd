"""Type hints on every public function of probe/ (issue 66), and the read paths' view of a capture
session typed as a protocol that the session itself satisfies. mypy itself runs in CI (.ci/run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "probe"


def _unhinted(tree: ast.Module) -> list[str]:
    """Public functions and methods of public classes (``__init__`` and ``__call__`` included) with a
    parameter (not self or cls) or a return (not ``__init__``'s) left without its annotation."""
    found = []

    def visit(node: ast.AST, owner: str = "") -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
                if name.startswith("_") and name not in ("__init__", "__call__"):
                    continue
                args = child.args
                params = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
                params += [a for a in (args.vararg, args.kwarg) if a is not None]
                missing = [a.arg for a in params if a.annotation is None]
                if child.returns is None and name != "__init__":
                    missing.append("return")
                if missing:
                    found.append(f"{owner}{name} ({', '.join(missing)}) line {child.lineno}")

    visit(tree)
    return found


def test_every_public_function_has_type_hints():
    missing = {str(path.relative_to(ROOT.parent)): _unhinted(ast.parse(path.read_text()))
               for path in sorted(ROOT.rglob("*.py"))}
    missing = {path: names for path, names in missing.items() if names}
    assert not missing, f"{sum(map(len, missing.values()))} public functions lack hints: {missing}"


def test_the_counter_sees_a_missing_hint():
    """The alarm itself: it flags a parameter, a return and a method, and passes a private helper."""
    tree = ast.parse("def f(x: int): ...\ndef g(y) -> int: ...\ndef _h(z): ...\n"
                     "class C:\n    def m(self, v: int) -> None: ...\n    def n(self): ...\n")
    assert [entry.split(" line")[0] for entry in _unhinted(tree)] == ["f (return)", "g (y)", "C.n (return)"]


def test_the_capture_session_is_what_a_read_path_may_use():
    """Every attribute and method of ReaderSession exists on the capture's own session, and a read path's
    ``attach`` takes one: what readers may use of a session is declared, not read off a private class."""
    import inspect
    import typing

    from probe.hooks import capture, readers
    from probe.hooks.types import ReaderSession

    declared = set(typing.get_type_hints(ReaderSession)) | {
        name for name, _ in inspect.getmembers(ReaderSession, inspect.isfunction) if not name.startswith("_")}
    session_source = inspect.getsource(capture._Session)
    for name in declared:
        assert re.search(rf"self\.{name}(: [^=\n]+)? = |def {name}\(", session_source), name
    hints = typing.get_type_hints(readers.ReadPath.attach, {**vars(readers), "ReaderSession": ReaderSession})
    assert hints["session"] is ReaderSession
