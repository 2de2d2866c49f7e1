"""The package's import graph: no module imports another that imports it back (at any depth, imports inside
functions included), and fuselm/ reaches runtime_metal/ only through the API facade and the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fuselm": "fuselm", "fuselm.exporter": "exporter", "fuselm.passes": "passes",
            "fuselm.runtime_metal": "runtime_metal"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The fuselm modules `path` imports, anywhere in it (a package's own __init__ counts as that package)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how a package exposes them: not a circle by itself
    graph = {n: {m for m in deps if not n.startswith(m + ".") or modules[m].name != "__init__.py"}
             for n, deps in graph.items()}
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for m in sorted(graph[n]):
            visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:5])


def test_fuselm_reaches_the_runtime_only_through_its_facade_and_cli():
    modules = _modules()
    for name, path in modules.items():
        if name.count(".") == 1 and name.startswith("fuselm.") and name not in ("fuselm.cli",) and \
                not any(name.startswith(p) for p in ("fuselm.exporter", "fuselm.passes", "fuselm.runtime_metal")):
            reached = {m for m in _imports(name, path, modules) if m.startswith("fuselm.runtime_metal")}
            assert not reached, f"{name} imports {sorted(reached)}"


def test_passes_import_neither_the_exporter_nor_the_runtime():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("fuselm.passes"):
            reached = {m for m in _imports(name, path, modules)
                       if m.startswith(("fuselm.runtime_metal", "fuselm.exporter"))}
            assert not reached, f"{name} imports {sorted(reached)}"
