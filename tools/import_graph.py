"""Which of composer_jax's packages import which, read from the source (every import statement, also
those inside functions), and the layers that follow: each package after everything it imports.

    python tools/import_graph.py          # package -> the packages it imports; then the layers, low to high

docs/architecture.md's layer order was derived with it. A circle between packages is reported and
exits 1 (it has no layer order)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "composer_jax"


def package_of(path: Path) -> str:
    """`model` for composer_jax/model/mla.py; a top-level module is its own package; __init__.py is `composer_jax`."""
    parts = path.relative_to(ROOT).parts
    if len(parts) > 1:
        return parts[0]
    return "composer_jax" if parts[0] == "__init__.py" else parts[0].removesuffix(".py")


def imported_modules(path: Path) -> list[str]:
    """Dotted names of the composer_jax modules (or names) `path` imports, relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = path.relative_to(ROOT.parent).parts[:-node.level]
                base = ".".join([*package, *([node.module] if node.module else [])])
            names += [f"{base}.{a.name}" for a in node.names] if base == "composer_jax" else [base]
    return [n for n in names if n.startswith("composer_jax.")]


def package_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = package_of(path)
        graph.setdefault(source, set())
        for name in imported_modules(path):
            target = name.split(".")[1]
            target = target if (ROOT / target).is_dir() or (ROOT / f"{target}.py").exists() else "composer_jax"
            if target != source:
                graph[source].add(target)
    return graph


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Packages grouped by depth: layer 0 imports nothing of ours, layer n only from layers below it."""
    placed: dict[str, int] = {}
    while len(placed) < len(graph):
        ready = [p for p in graph if p not in placed and graph[p] <= placed.keys()]
        if not ready:
            raise ValueError(f"import circle among {sorted(set(graph) - placed.keys())}")
        for p in ready:
            placed[p] = max((placed[d] + 1 for d in graph[p]), default=0)
    return [sorted(p for p in placed if placed[p] == n) for n in range(max(placed.values()) + 1)]


def main() -> int:
    graph = package_imports()
    for package in sorted(graph):
        print(f"{package:16s} -> {', '.join(sorted(graph[package])) or '-'}")
    try:
        order = layers(graph)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print("\nlayers, low to high:")
    for n, members in enumerate(order):
        print(f"{n:2d}  {', '.join(members)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
