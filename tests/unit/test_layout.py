"""The package's shape, read from its source: small modules, an engine core that composes its
features instead of inheriting them, and imports that never run in a circle (which would let
a lower layer depend on a higher one)."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_rlt

PACKAGE = Path(vllm_rlt.__file__).parent
MAX_MODULE_LINES = 500
MAX_ENGINE_CORE_LINES = 230


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, TYPE_CHECKING imports and function-level imports
    included: each is an edge of the layering."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_module_is_over_the_line_budget():
    over = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_the_engine_core_composes_its_features():
    tree = ast.parse((PACKAGE / "engine" / "engine_core.py").read_text())
    (core,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore"]
    assert not core.bases, "EngineCore holds its features; it inherits none"
    lines = core.end_lineno - core.lineno + 1
    assert lines <= MAX_ENGINE_CORE_LINES, f"EngineCore is {lines} lines"


def test_imports_never_run_in_a_circle():
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # A package's __init__ that hands names on imports its children; the children importing
    # a sibling through the package is not a circle of modules, so faces are left out.
    faces = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph = {name: deps - faces for name, deps in graph.items() if name not in faces}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name)
            assert circle is None, "import circle: " + " -> ".join(circle)
