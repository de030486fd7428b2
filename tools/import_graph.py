"""Which of composer_jax's packages import which, read from the source (every import statement, also
those inside functions), and the layers that follow: each package after everything it imports.

    python tools/import_graph.py          # package -> the packages it imports; then the layers, low to high

docs/architecture.md's layer order was derived with it. A circle between packages is reported and
exits 1 (it has no layer order). The reading of imports lives in tools/architecture.py, which
tests/test_architecture.py also uses to check the docs' layer order and that no circle exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.architecture import all_imports, circles, package_graph  # noqa: E402


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Packages grouped by depth: layer 0 imports nothing of ours, layer n only from layers below it."""
    placed: dict[str, int] = {}
    while len(placed) < len(graph):
        ready = [p for p in graph if p not in placed and graph[p] <= placed.keys()]
        if not ready:
            raise ValueError(f"import circles: {circles(graph)}")
        for p in ready:
            placed[p] = max((placed[d] + 1 for d in graph[p]), default=0)
    return [sorted(p for p in placed if placed[p] == n) for n in range(max(placed.values()) + 1)]


def main() -> int:
    graph = package_graph(all_imports())
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
