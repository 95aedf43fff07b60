"""The house's rules that a reader can check by hand and a change can break without noticing: no
import cycle among swarmgrad's modules, and no module past ~400 lines but the known ones (a
ratchet: a module that shrinks under the bound drops off the list; none may join it); no test,
benchmark or script past it either."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "node": "swarmgrad.node",
    "protocol": "swarmgrad.protocol",
    "compression": "swarmgrad.compression",
    "simulations": "swarmgrad.simulations",
}
#: ~400 lines, with room for a docstring's growth.
MAX_LINES = 430
#: Modules over it today, each with its count then: to be split by job (docs/architecture.md).
KNOWN_LONG: dict[str, int] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts or "v1" in path.parts:  # generated stubs
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The swarmgrad modules ``path`` imports when it is imported (not those imported only for
    type checking, or inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        body = node.body if isinstance(node, ast.Try) else [node]
        for statement in body:
            if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith(
                "swarmgrad"
            ):
                base = statement.module or ""
                out |= {
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in statement.names
                }
            elif isinstance(statement, ast.Import):
                out |= {a.name for a in statement.names if a.name in modules}
    return {m for m in out if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_among_swarmgrad_modules() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert len(graph) > 150  # the walk found the package, not an empty folder
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_grows_past_about_400_lines_but_the_known_ones() -> None:
    long = {}
    for path in _modules().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[path.relative_to(ROOT).as_posix()] = lines
    assert long.keys() <= KNOWN_LONG.keys(), {k: v for k, v in long.items() if k not in KNOWN_LONG}
    for name, lines in long.items():
        assert lines <= KNOWN_LONG[name], f"{name} grew from {KNOWN_LONG[name]} to {lines} lines"


def test_no_test_benchmark_or_script_grows_past_about_400_lines() -> None:
    """The same bound for what is not the package: tests, their helpers, benchmarks, scripts."""
    paths = [
        path
        for folder in ("tests", "benchmarks", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    ]
    assert len(paths) > 100  # the walk found the folders
    long = {
        path.relative_to(ROOT).as_posix(): lines
        for path in paths
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
