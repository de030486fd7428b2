"""The architecture rules of docs/architecture.md, read from the source with `ast` alone (no import of the
code, no jax): who imports whom (every import statement, also inside functions), the layer order the
docs write down, import circles between packages and between modules, and function lengths.

tools/import_graph.py prints the package graph with these functions; tests/test_architecture.py checks
the rules. Every function takes the package's root directory, so the tests also run them on small
synthetic packages with known violations.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "composer_jax"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _shown(path: Path) -> str:
    """`path` relative to the repository (the parent of the package's root) when it lies in it."""
    return str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)


@dataclass(frozen=True)
class Import:
    """One import of a module of ours: where it stands and the module it names."""

    path: Path        # the importing file
    line: int
    text: str         # the statement as written, e.g. "from composer_jax.eval.agent import Agent"
    source: str       # the importing module, e.g. "composer_jax.rl.loop"
    target: str       # the imported module, e.g. "composer_jax.eval.agent" (a package's __init__: "composer_jax.eval")

    def __str__(self) -> str:
        return f"{_shown(self.path)}:{self.line}: {self.text}"


def module_name(path: Path, root: Path) -> str:
    """`composer_jax.eval.agent` for composer_jax/eval/agent.py; `composer_jax.eval` for its __init__.py."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _existing_module(name: str, root: Path) -> str:
    """The longest prefix of dotted `name` that is a module (a name imported from a module is not one)."""
    parts = name.split(".")
    while len(parts) > 1 and not is_module(".".join(parts), root):
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in `path` of a module under `root` (relative imports resolved), with its line."""
    source, package = module_name(path, root), root.name
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = path.relative_to(root.parent).parts[:-node.level]
                base = ".".join([*here, *([node.module] if node.module else [])])
            # `from pkg import name`: the module pkg.name if there is one, else pkg itself
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        text = ast.unparse(node)
        for name in names:
            if name == package or name.startswith(package + "."):
                out.append(Import(path, node.lineno, text, source, _existing_module(name, root)))
    return out


def all_imports(root: Path = ROOT) -> list[Import]:
    return [i for path in sorted(root.rglob("*.py")) for i in imports(path, root)]


def package_of(module: str) -> str:
    """`model` for composer_jax.model.mla; a top-level module is its own package; the root is `composer_jax`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def packages(root: Path = ROOT) -> set[str]:
    """The packages (directories with an __init__.py) and top-level modules under `root`, and the root itself."""
    return {package_of(module_name(p, root)) for p in root.glob("*.py")} | {
        d.name for d in root.iterdir() if (d / "__init__.py").is_file()}


def module_graph(found: list[Import], root: Path = ROOT) -> dict[str, set[str]]:
    graph = {module_name(p, root): set() for p in root.rglob("*.py")}
    for i in found:
        if i.target != i.source:
            graph[i.source].add(i.target)
    return graph


def package_graph(found: list[Import], root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in packages(root)}
    for i in found:
        source, target = package_of(i.source), package_of(i.target)
        if target != source:
            graph[source].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one member, each
    sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return sorted(found)


def documented_layers(docs: Path = DOCS) -> dict[str, int]:
    """{package: layer} from the docs' "Layer order" list: each `N.` item's packages are its **`bold`** names."""
    text = docs.read_text()
    match = re.search(r"^## Layer order\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        raise ValueError(f"{docs}: no '## Layer order' section")
    layers = {}
    for number, body in re.findall(r"^(\d+)\.\s(.*?)(?=^\d+\.\s|\Z)", match[1], re.M | re.S):
        for name in re.findall(r"\*\*`([\w.]+)`\*\*", body):
            if name in layers:
                raise ValueError(f"{docs}: '{name}' is listed on layers {layers[name]} and {number}")
            layers[name] = int(number)
    if not layers:
        raise ValueError(f"{docs}: the 'Layer order' section lists no **`package`**")
    return layers


def layer_violations(found: list[Import], layers: dict[str, int]) -> list[Import]:
    """Imports from a package into one of the same or a higher layer (packages missing from `layers` are
    `undocumented`'s concern)."""
    out = []
    for i in found:
        source, target = package_of(i.source), package_of(i.target)
        if source != target and source in layers and target in layers and layers[target] >= layers[source]:
            out.append(i)
    return out


def undocumented(layers: dict[str, int], root: Path = ROOT) -> list[str]:
    """The packages under `root` that the layer list does not place."""
    return sorted(packages(root) - layers.keys())


@dataclass(frozen=True)
class Function:
    path: Path
    line: int
    name: str         # qualified within the file, e.g. "RLTrainer.run" or "main.<locals>.handler"
    lines: int

    def __str__(self) -> str:
        return f"{_shown(self.path)}:{self.line} {self.name} {self.lines} lines"


def functions(path: Path) -> list[Function]:
    """Every def and async def in `path` (nested ones too, each on its own) with its length in lines,
    from its `def` line to its last line."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append(Function(path, child.lineno, name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def long_functions(directories, limit: int) -> list[Function]:
    """The functions longer than `limit` lines in the .py files under `directories` (missing ones skipped)."""
    return [f for d in directories if Path(d).is_dir() for path in sorted(Path(d).rglob("*.py"))
            for f in functions(path) if f.lines > limit]
