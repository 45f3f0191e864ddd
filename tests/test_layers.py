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

ROOT = Path(__file__).resolve().parents[1] / "probe"

#: bottom to top; a package may import from its own rank or below. ``rows`` (prepared examples,
#: targets, token scores, the target query, OOM halving) sits below both users, explain and intervene.
RANKS = {
    "errors": 0, "names": 0, "registry": 0,
    "callable_module": 1, "data": 1, "planted_texts": 1, "spec": 1,
    "capture": 2,
    "models": 3,
    "rows": 4, "predict": 4,
    "intervene": 5,
    "explain": 6,
    "metrics": 7,
    "report": 8,
    "study": 9,
    "audit": 10, "terminal": 10,
    "api": 11, "cli": 11, "__main__": 12,
}
#: the one upward edge allowed: calling a subpackage (``probe.explain(...)``) runs probe.api
ALLOWED_UP = {("callable_module", "probe.api")}


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
            if there == "probe" or (here, ".".join(target.split(".")[:2])) in ALLOWED_UP:
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
            if w.endswith("callable_module") or v.endswith("callable_module"):
                continue
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


@pytest.mark.parametrize("package", ["capture", "models", "rows", "intervene", "explain", "metrics", "report"])
def test_importing_a_package_loads_nothing_above_it(package):
    code = ("import sys, importlib; importlib.import_module('probe.%s'); "
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules if m.startswith('probe.')})))" % package)
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT.parent).stdout.split()
    above = [p for p in loaded if RANKS.get(p, -1) > RANKS[package]]
    assert not above, f"importing probe.{package} loaded {above}"
