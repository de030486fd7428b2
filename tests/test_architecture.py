"""The architecture rules of docs/architecture.md, read from the source with `ast` (tools/architecture.py;
no jax): imports follow the documented layer order, every package is placed in it, no import circle
between packages or between modules, no function over 60 lines in the agent-facing packages. Each check
also runs on a small synthetic package with a known violation, so it is seen to fail."""

from pathlib import Path

import pytest

from tools.architecture import (ROOT, all_imports, circles, documented_layers, layer_violations, long_functions,
                                module_graph, package_graph, package_of, undocumented)

MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_PACKAGES = ("rl", "eval", "agents", "cli")


def _listed(items) -> str:
    return "\n  " + "\n  ".join(str(i) for i in items)


@pytest.fixture(scope="module")
def found():
    """Every import of composer_jax in composer_jax/, read once."""
    return all_imports()


def test_imports_follow_the_documented_layer_order(found):
    layers = documented_layers()
    assert not (missing := undocumented(layers)), (
        f"packages not placed in docs/architecture.md's layer order: {missing}")
    bad = layer_violations(found, layers)
    assert not bad, "imports against docs/architecture.md's layer order (same or higher layer):" + _listed(
        f"{i}  [{source} (layer {layers[source]}) -> {target} (layer {layers[target]})]"
        for i in bad for source, target in [(package_of(i.source), package_of(i.target))])


def test_no_import_circle_between_packages_or_modules(found):
    package_circles, module_circles = circles(package_graph(found)), circles(module_graph(found))
    assert not package_circles and not module_circles, (
        f"import circles between packages: {package_circles}; between modules: {module_circles}")


def test_no_long_function_in_the_agent_facing_packages():
    long = long_functions([ROOT / p for p in SHORT_FUNCTION_PACKAGES], MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:" + _listed(long)


# ---- the checks can fail: a synthetic package `pkg` with one of each violation ----

DOCS = """# Architecture

## Layer order

0. **`low`** (the bottom) -> nothing;
   **`side`** -> nothing.
1. **`high`** -> low.

## Further rules

- **`notalayer`** is bold outside the list.
"""


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "architecture.md").write_text(DOCS)
    return root


def test_the_layer_list_is_read_from_the_docs(tmp_path):
    _package(tmp_path, {})
    assert documented_layers(tmp_path / "architecture.md") == {"low": 0, "side": 0, "high": 1}


def test_an_import_upwards_or_sideways_is_reported_with_file_and_line(tmp_path):
    root = _package(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "import os\n\n\ndef f():\n    from pkg.high import b  # inside a function\n",
        "low/c.py": "from ..side import thing\n",
        "side.py": "thing = 1\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low import a\nfrom . import d\n",
        "high/d.py": "",
    })
    layers = documented_layers(tmp_path / "architecture.md")
    bad = layer_violations(all_imports(root), layers)
    assert [(i.path.relative_to(root).as_posix(), i.line, i.text, i.target) for i in bad] == [
        ("low/a.py", 5, "from pkg.high import b", "pkg.high.b"),
        ("low/c.py", 1, "from ..side import thing", "pkg.side")]
    assert undocumented(layers, root) == ["pkg"]   # the root's own __init__ is a package to place too
    (root / "new").mkdir()
    (root / "new" / "__init__.py").write_text("")
    assert undocumented(layers, root) == ["new", "pkg"]


def test_circles_between_modules_and_packages_are_reported(tmp_path):
    root = _package(tmp_path, {
        "low/__init__.py": "from pkg.low.x import X\n",
        "low/x.py": "X = 1\n\n\ndef f():\n    from pkg.low import y\n",    # x -> y, inside a function
        "low/y.py": "from pkg.low.x import X\n",                            # y -> x
        "side.py": "def g():\n    import pkg.low\n",                        # side -> low (its __init__)
    })
    found = all_imports(root)
    assert circles(module_graph(found, root)) == [["pkg.low.x", "pkg.low.y"]]
    assert circles(package_graph(found, root)) == []
    (root / "low" / "y.py").write_text("import pkg.side\n")                # now low -> side -> low
    found = all_imports(root)
    assert circles(module_graph(found, root)) == [["pkg.low", "pkg.low.x", "pkg.low.y", "pkg.side"]]
    assert circles(package_graph(found, root)) == [["low", "side"]]


def _lines(count: int, indent: int) -> str:
    return "".join(" " * indent + f"x = {n}\n" for n in range(count))


def test_long_functions_are_reported_nested_ones_on_their_own(tmp_path):
    loop = ("def fits():\n" + _lines(59, 4)                          # lines 1-60: 60 lines, allowed
            + "\n\nclass Trainer:\n"                                 # line 63
            + "    async def run(self):\n" + _lines(10, 8)           # line 64
            + "        def inner():\n" + _lines(60, 12)              # lines 75-135: 61 lines
            + "        return inner\n")                              # run: lines 64-136, 73 lines
    root = _package(tmp_path, {"rl/__init__.py": "", "rl/loop.py": loop,
                               "other/long.py": "def elsewhere():\n" + _lines(100, 4)})
    long = long_functions([root / "rl", root / "agents"], 60)       # agents/ does not exist: skipped
    assert [(f.path.name, f.line, f.name, f.lines) for f in long] == [
        ("loop.py", 64, "Trainer.run", 73), ("loop.py", 75, "Trainer.run.<locals>.inner", 61)]
    assert str(long[1]).endswith("rl/loop.py:75 Trainer.run.<locals>.inner 61 lines")
