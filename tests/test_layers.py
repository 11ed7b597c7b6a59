"""The package map, enforced: every module's imports point down the layer order, and no two
modules import each other, directly or round a longer loop.

The order is written once, here (``LAYERS``), and drawn in the design notes (``DESIGN.md``, kept beside the repository). Every import
counts, including those inside functions and under ``TYPE_CHECKING``: a lazy upward import is
still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bmoe

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds

# Lowest first. Packages in one tuple are peers that must not import each other
# (io and pipeline are both pure leaves; bench, server and inspect are separate applications).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "errors", "argtypes"),
    ("io", "pipeline"),
    ("metrics",),
    ("llama", "stages"),  # the llama.cpp seam and the pipeline stages: peers, meeting at the gate
    ("engine",),
    ("synth",),
    ("bench", "server", "inspect", "quality"),
    ("cli",),
    ("__main__",),  # python -m bmoe: the command line, run as a module
    ("",),  # the package root re-exports the public face
)
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (``from a import b`` counts b when b is a
    module of the package, else a)."""
    pkg = root.name
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in files else name for a in node.names]
            else:
                continue
            out.update(t for t in targets if t == pkg or t.startswith(pkg + "."))
        out.discard(mod)
        graph[mod] = out
    return graph


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        a = layer_of(mod)
        for t in sorted(targets):
            b = layer_of(t)
            if a == b:
                continue
            if a not in RANK or b not in RANK:
                bad.append(f"{mod} -> {t}: package not in LAYERS")
            elif RANK[b] >= RANK[a]:
                bad.append(f"{mod} -> {t}: {b or 'the root'} is not below {a or 'the root'}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


ROOT = Path(bmoe.__file__).parent


def test_imports_point_down_only() -> None:
    assert upward_edges(imports_of(ROOT)) == []


def test_no_import_cycles() -> None:
    assert cycles(imports_of(ROOT)) == []


def test_every_package_has_a_layer() -> None:
    assert {layer_of(m) for m in imports_of(ROOT)} <= set(RANK)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "bmoe"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_check_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "io/__init__.py": "",
        "io/layout.py": "def f():\n    from bmoe.engine.recipes import R  # lazy, still upward\n",
        "engine/__init__.py": "",
        "engine/recipes.py": "R = 1\n",
        "pipeline/__init__.py": "",
        "pipeline/cache.py": "from bmoe.pipeline import policies\n",
        "pipeline/policies.py": "from .cache import X\n",
        "pipeline/events.py": "from bmoe.io import layout\n",
    })
    graph = imports_of(root)
    bad = upward_edges(graph)
    assert any(b.startswith("bmoe.io.layout -> bmoe.engine.recipes") for b in bad)
    assert any(b.startswith("bmoe.pipeline.events -> bmoe.io.layout") for b in bad)  # peers
    assert cycles(graph) == [["bmoe.pipeline.cache", "bmoe.pipeline.policies"]]
