"""The package's shape: layers without import cycles, small modules, no hidden state channels.

Every ``import`` counts, also those inside functions: an import deferred into a function still
ties two layers together. Each subpackage (or top-level module) of kvgate has a rank in
``LAYERS``; a module may import only from its own node or from nodes of lower rank. Every
``__main__`` module, wherever it sits, is a command-line entry point: it belongs to the top
layer (it may run ``kvgate.cli``) and nothing imports it. Inside a layer no two modules may
import each other either, directly or around a circle (``test_no_import_cycle_between_modules``).
"""

from __future__ import annotations

import ast
import re
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvgate"
MAX_LINES = 450

# lowest first; docs/ARCHITECTURE.md shows the same order
LAYERS = [
    "errors", "files", "hub", "progress",
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
    if rel.name == "__main__.py":  # an entry point: the command line's layer, wherever it sits
        return "__main__"
    return rel.parts[0].removesuffix(".py")


def _module_name(path: Path, root: Path) -> str:
    """``kvgate.eval.report`` for ROOT/eval/report.py (a package is named by its folder)."""
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, text: str | None = None) -> list[tuple[str, int]]:
    """(dotted name, line) of every import of ``root``'s package in a file, at any depth;
    ``from P import N`` gives ``P.N`` (which may be a module or a name in P)."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
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
            names = [f"{mod}.{a.name}" for a in node.names]
        out += [(name, node.lineno) for name in names
                if name.split(".")[0] == root.name and "." in name]
    return out


def _imported(path: Path, text: str | None = None) -> list[tuple[str, int]]:
    """(kvgate node, line) of every kvgate import in a file, at any depth."""
    return [(name.split(".")[1], line) for name, line in _imports(path, ROOT, text)]


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


def _module_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """module -> module it imports -> where (file:line), over every module under ``root``.
    ``from P import N`` is an edge to the module P.N when there is one, else to P (a package's
    ``__init__``); an edge to a module does not count its parent packages' ``__init__``."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, dict[str, list[str]]] = {}
    for src, path in paths.items():
        for name, line in _imports(path, root):
            while name not in paths:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != src:
                where = f"{path.relative_to(root.parent)}:{line}"
                edges.setdefault(src, {}).setdefault(name, []).append(where)
    return edges


def _cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Cycles found one after another, each search after removing the closing edge of the
    cycle before, until none is left: every circle of the graph shows at least one edge."""
    edges = {a: dict(b) for a, b in edges.items()}
    found = []
    while (cycle := _cycle(edges)) is not None:
        found.append(cycle)
        del edges[cycle[-2]][cycle[-1]]
    return found


def _named(cycle: list[str], edges: dict[str, dict[str, list[str]]]) -> str:
    return " -> ".join(f"{a} ({edges[a][b][0]})" for a, b in pairwise(cycle)) \
        + f" -> {cycle[-1]}"


def test_no_import_cycle_between_subpackages():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle between kvgate subpackages: " + " -> ".join(cycle)


def test_no_import_cycle_between_modules():
    edges = _module_graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles between kvgate modules:\n" + "\n".join(
        _named(c, edges) for c in cycles)


def test_a_planted_module_cycle_is_caught(tmp_path):
    # a circle hidden behind an import inside a function, and one through a package __init__
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("from toy.low import X\n\ndef f():\n    from toy import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "sub" / "__init__.py").write_text("from toy.sub.c import Y\n")
    (pkg / "sub" / "c.py").write_text("from toy.sub import Z\nY = 2\n")
    edges = _module_graph(pkg)
    cycles = _cycles(edges)
    assert sorted(sorted(c[:-1]) for c in cycles) == [["toy.a", "toy.b"],
                                                      ["toy.sub", "toy.sub.c"]]
    text = "\n".join(_named(c, edges) for c in cycles)
    assert "toy/a.py:4" in text and "toy/b.py:1" in text and "toy/sub/c.py:1" in text
    (pkg / "b.py").write_text("from toy.low import X\n")  # the circle broken: none left
    (pkg / "sub" / "c.py").write_text("Y = 2\n")
    assert _cycles(_module_graph(pkg)) == []


def test_nothing_imports_an_entry_point():
    found = [f"{src} imports {dst}" for src, targets in _module_graph().items()
             for dst in targets if dst.endswith("__main__")]
    assert not found, found


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
