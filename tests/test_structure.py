"""The package's layering, read from its source: no import cycle between pagedserve's modules (imports
inside functions count too; `if TYPE_CHECKING:` blocks do not), and `core/` (requests, blocks, the
scheduler) never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedserve"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(path: Path) -> set[str]:
    """Every module name an import statement in the file names (outside TYPE_CHECKING blocks)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    def package() -> str:
        return module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package().split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def internal_edges() -> dict[str, set[str]]:
    """module -> the pagedserve modules it imports (a name that is not a module means its package)."""
    edges = {}
    for mod, path in MODULES.items():
        targets = set()
        for name in imported_names(path):
            if name in MODULES and name != mod:
                targets.add(name)
        edges[mod] = targets
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_checker_sees_cycles(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                     "def f():\n    import numpy\n")
    assert imported_names(probe) == {"typing", "typing.TYPE_CHECKING", "numpy"}


def test_no_import_cycle_in_the_package():
    edges = internal_edges()
    assert len(edges) > 40  # really read the package
    assert "pagedserve.engine.engine" in edges["pagedserve.entrypoints.llm"]
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if m.startswith("pagedserve.core")))
def test_core_never_imports_torch(mod):
    bad = {n for n in imported_names(MODULES[mod]) if n == "torch" or n.startswith("torch.")}
    assert not bad, f"{mod} imports {sorted(bad)}: core/ knows requests, token counts and block ids, not tensors"


def test_env_is_read_in_one_module():
    """Only envs.py reads the environment; everything else gets its settings from EngineConfig / ENV."""
    readers = sorted(mod for mod, path in MODULES.items() if "os.environ" in path.read_text()
                     or "getenv(" in path.read_text())
    assert readers == ["pagedserve.envs"]


def test_the_kernel_units_compile_every_source_once():
    """csrc/unit_*.cpp include the kernel sources (two translation units build faster than seven)."""
    import re

    from pagedserve.kernels.build import SOURCES, UNITS

    included = [name for unit in UNITS for name in re.findall(r'#include "(.+?\.cpp)"', unit.read_text())]
    assert sorted(included) == sorted(s.name for s in SOURCES)
