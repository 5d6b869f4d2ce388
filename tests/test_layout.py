"""The package's shape: layers without import cycles, small modules, no hidden state channels.

Every ``import`` counts, also those inside functions: an import deferred into a function still
ties two layers together. Each subpackage (or top-level module) of kvgate has a rank in
``LAYERS``; a module may import only from its own node or from nodes of lower rank.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvgate"
MAX_LINES = 450

# lowest first; docs/ARCHITECTURE.md shows the same order
LAYERS = [
    "errors", "files", "hub",
    "attention",
    "models",
    "gate",
    "policies",
    "cache",
    "checkpoint",
    "inference",
    "data",
    "recipes",
    "training",
    "eval",
    "integrations",
    "demo",
    "cli",
    "__main__",
]


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def _node(path: Path) -> str | None:
    """The layer a file belongs to (None for kvgate/__init__.py, the lazy facade on top)."""
    rel = path.relative_to(ROOT)
    if rel.parts == ("__init__.py",):
        return None
    return rel.parts[0].removesuffix(".py")


def _imported(path: Path, text: str | None = None) -> list[tuple[str, int]]:
    """(kvgate node, line) of every kvgate import in a file, at any depth."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    package = ".".join(("kvgate",) + path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.removesuffix(".__init__")
    else:
        package = package.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names] if mod == "kvgate" else [mod]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvgate" and len(parts) > 1:
                out.append((parts[1], node.lineno))
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    edges: dict[str, dict[str, list[str]]] = {}
    for path in _modules():
        src = _node(path)
        if src is None:
            continue
        for dst, line in _imported(path):
            if dst != src and not dst.startswith("__version__"):
                where = f"{path.relative_to(ROOT.parent)}:{line}"
                edges.setdefault(src, {}).setdefault(dst, []).append(where)
    return edges


def _cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the node graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in edges.get(n, {}):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in list(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_between_subpackages():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle between kvgate subpackages: " + " -> ".join(cycle)


def test_imports_follow_the_layer_order():
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for src, targets in _graph().items():
        assert src in rank, f"kvgate/{src} has no place in LAYERS (tests/test_layout.py)"
        for dst, where in targets.items():
            assert dst in rank, f"kvgate/{dst} has no place in LAYERS (tests/test_layout.py)"
            if rank[dst] > rank[src]:
                bad.append(f"{src} imports {dst} (above it) at {where[0]}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_deferred_and_relative_imports():
    # the rules would be toothless if imports inside functions slipped through
    probe = ROOT / "models" / "probe.py"
    text = ("def f():\n    from kvgate.eval import report\n    import kvgate.cache.ragged\n"
            "    from ..policies import base\n    from . import load\n")
    assert _imported(probe, text) == [("eval", 2), ("cache", 3), ("policies", 4), ("models", 5)]
    assert _cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": []}, "b": {"c": []}}) is None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines (> {MAX_LINES})"


def test_no_state_in_module_dicts():
    """Per-forward state travels in a ForwardContext, not in ``module.__dict__[...]``."""
    found = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"__dict__\s*\[", line):
                commented = "#" in line or (i and lines[i - 1].strip().startswith("#"))
                found.append((f"{path.relative_to(ROOT.parent)}:{i + 1}", commented))
    assert len(found) <= 2, f"__dict__[...] state channels: {found}"
    assert all(ok for _, ok in found), f"uncommented __dict__[...] access: {found}"
