"""The package layers only point down, and no probe module imports itself round a circle.

Read from the source (every import statement, module-level or inside a function: a function-level
import is still a dependency) and checked again in fresh interpreters (importing a package loads
nothing from a layer above it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "probe"

#: bottom to top; a package may import from its own rank or below, never a sibling of its rank.
#: ``rows`` (prepared examples, targets, token scores, the target query, OOM halving) sits below both
#: of its users, the explainers and the interventions; ``methods`` (the dispatcher that runs any
#: registered method by name) sits above both.
RANKS = {
    "errors": 0, "names": 0, "registry": 0, "tasks": 0, "frozen": 0, "patterns": 0, "files": 0, "progress": 0,
    "data": 1, "spec": 1, "document": 1, "display": 1, "plots": 1,
    "hooks": 2,
    "models": 3,
    "rows": 4,
    "intervene": 5, "explainers": 5,
    "methods": 6,
    "metrics": 7,
    "study": 8,
    "report": 9, "claims": 9,  # siblings: the study report and the audit
    "explanation": 10,  # an explanation shows itself (display, plots) and is saved into its folder
    "api": 11, "cli": 12, "__main__": 13,  # the CLI (its options, terminal views, predictions) calls the Python API
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "probe"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported probe module or name's module, line) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "probe":
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "probe"]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target, _ in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def test_every_package_has_a_rank():
    packages = {_package(m) for m in _modules()} - {"probe"}
    assert packages <= set(RANKS), f"give these packages a rank in RANKS: {sorted(packages - set(RANKS))}"


def test_imports_only_point_down():
    wrong = []
    for name, path in _modules().items():
        here = _package(name)
        if here == "probe":  # probe/__init__.py: lazy names, loaded on first use
            continue
        for target, line in _imports(path):
            there = _package(target)
            if there == "probe":
                continue
            if RANKS[there] > RANKS[here] or (RANKS[there] == RANKS[here] and there != here and RANKS[here] > 1):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} {here} -> {target}")
    assert not wrong, "imports that point up (or sideways):\n" + "\n".join(wrong)


def test_no_module_imports_itself_round_a_circle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(_modules()):
        if module not in index:
            visit(module)
    assert not cycles, f"import circles: {cycles}"


@pytest.mark.parametrize("package", ["hooks", "models", "rows", "intervene", "explainers", "methods", "metrics", "report"])
def test_importing_a_package_loads_nothing_above_it(package):
    code = (f"import sys, importlib; importlib.import_module('probe.{package}'); "
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules if m.startswith('probe.')})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT.parent).stdout.split()
    above = [p for p in loaded if RANKS.get(p, -1) > RANKS[package]]
    assert not above, f"importing probe.{package} loaded {above}"


def _top_level_names(path: Path) -> tuple[set[str], set[str]]:
    """(names a module defines at top level, names it only imports there)."""
    defined, imported = set(), set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return defined, imported - defined


def _import_froms():
    """(file, line, module, name) for every ``from probe... import name`` in the package, tests and benchmarks."""
    for folder in ("probe", "tests", "benchmarks"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "probe":
                    for alias in node.names:
                        yield path.relative_to(ROOT.parent), node.lineno, node.module, alias.name


def test_no_private_name_is_imported_from_another_module():
    private = [f"{path}:{line} from {module} import {name}" for path, line, module, name in _import_froms()
               if name.startswith("_") and not name.startswith("__")]
    assert not private, "private names imported across modules (make them public where they are defined):\n" + \
        "\n".join(private)


def _face(path: Path) -> set[str]:
    """A package's face: the names its ``__init__``'s ``__all__`` lists (empty for a plain module)."""
    if path.name != "__init__.py":
        return set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets) \
                and isinstance(node.value, (ast.List, ast.Tuple)):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
def test_every_name_is_imported_from_the_module_that_defines_it():
    """The import rule (docs/design.md, house rule 4): a name comes from the module that defines it,
    or from a package's face, the names its ``__init__`` lists in ``__all__`` (issue 66): a package
    may present its public names without its importers knowing its files."""
    modules = _modules()
    wrong = []
    for path, line, module, name in _import_froms():
        if f"{module}.{name}" in modules or module == "probe":  # a submodule; probe's lazy top-level names
            continue
        if module not in modules:
            wrong.append(f"{path}:{line} from {module} import {name}: no such module")
            continue
        defined, imported = _top_level_names(modules[module])
        if name not in defined and name not in _face(modules[module]):
            where = "re-exported there, not on its face (__all__)" if name in imported else "not defined there"
            wrong.append(f"{path}:{line} from {module} import {name}: {where}")
    assert not wrong, "import every name from its defining module or a package's face:\n" + "\n".join(wrong)


def _face_problems(modules: dict[str, Path]) -> list[str]:
    """Each name a package's face (``__all__``) lists that is neither defined there nor imported there
    from a module that defines it (or from a face below it)."""
    wrong = []
    for module, path in modules.items():
        face = _face(path)
        defined, _ = _top_level_names(path)
        sources = {alias.asname or alias.name: node.module for node in ast.parse(path.read_text()).body
                   if isinstance(node, ast.ImportFrom) and node.level == 0 for alias in node.names}
        for name in sorted(face - defined):
            source = sources.get(name)
            if source is None or source not in modules:
                wrong.append(f"{module}.__all__ lists {name}, neither defined nor imported from a probe module there")
            elif name not in _top_level_names(modules[source])[0] and name not in _face(modules[source]):
                wrong.append(f"{module}.__all__ lists {name}, imported from {source}, which does not define it")
    return wrong


def test_a_package_face_lists_names_its_package_imports_from_their_defining_modules(tmp_path):
    """A face re-exports, it does not define anew: each name an ``__init__``'s ``__all__`` lists is
    defined there or imported there from the module that defines it; a face that lists a name its
    package does not hold, or holds from a module that only re-exports it, is named."""
    assert not _face_problems(_modules()), "\n".join(_face_problems(_modules()))
    package = tmp_path / "probe" / "faces"
    package.mkdir(parents=True)
    (package / "inner.py").write_text("from probe.faces.deep import Deep\n\n\ndef shown():\n    return 1\n")
    (package / "deep.py").write_text("class Deep:\n    pass\n")
    (package / "__init__.py").write_text('from probe.faces.inner import Deep, shown\n\n__all__ = ["shown", "Deep", "Gone"]\n')
    modules = {"probe.faces": package / "__init__.py", "probe.faces.inner": package / "inner.py",
               "probe.faces.deep": package / "deep.py"}
    assert _face_problems(modules) == [
        "probe.faces.__all__ lists Deep, imported from probe.faces.inner, which does not define it",
        "probe.faces.__all__ lists Gone, neither defined nor imported from a probe module there"]


def test_probe_top_level_names_point_at_their_defining_modules():
    import importlib

    import probe

    for name, module_name in probe._EXPORTS.items():
        module = importlib.import_module(module_name)
        if module_name == f"probe.{name}":
            continue
        defined, _ = _top_level_names(Path(module.__file__))
        assert name in defined, f"probe.{name} is re-exported by {module_name}, not defined there"
        value = getattr(probe, name)
        assert not isinstance(value, type(probe)), f"probe.{name} is a module, not the function or class"


def test_the_package_is_typed():
    assert (ROOT / "py.typed").is_file()
    assert "py.typed" in (ROOT.parent / "pyproject.toml").read_text()


def test_the_version_the_provenance_records_is_the_package_version():
    from importlib.metadata import version

    import probe

    assert version("probe") == probe.__version__


def test_a_type_checker_sees_every_top_level_name():
    """``probe/__init__``'s TYPE_CHECKING block imports each lazily loaded name from the module
    that defines it, so help() and type checkers see the real objects, not ``Any``."""
    import probe

    tree = ast.parse((ROOT / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {a.asname: f"{n.module}.{a.name}" if n.module != "probe" else f"probe.{a.name}"
            for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    expected = {name: (module if module == f"probe.{name}" else f"{module}.{name}")
                for name, module in probe._EXPORTS.items()}
    assert seen == expected
