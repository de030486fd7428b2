"""Difficulty levels of feature deletion: how much of a feature a task takes away (`--level`).

- `body` (features.plan_deletion): one definition's body becomes `raise NotImplementedError`; its
  signature and docstring stay, and the instruction repeats them.
- `definition`: the whole definition goes (decorators, signature, docstring, body), with the private
  helpers only it used; the code that uses it and the failing tests are its specification.
- `feature`: every definition that the target tests (the passing tests that ran the candidate) run
  and no other passing test runs goes, across modules; a module left with nothing but imports, a
  docstring and `__all__` goes too.

At the `definition` and `feature` levels the repository's other modules stop importing deleted code
(`from m import gone`, `import pkg.gone_module`), to a fixed point: a package `__init__` that
re-exported a deleted name no longer does, so imports of that name from the package go as well.
Test files are never edited: they are the specification, and grading restores them. What still
breaks (a test module importing a deleted name next to tests that do not need it) the generator's
check rejects.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import textwrap
from collections import Counter, defaultdict

from composer_jax import python_ast
from composer_jax.tasks.features import (
    Definition,
    Deletion,
    FileEdit,
    indent_of,
    module_name,
    private_helpers,
    strings_in,
    whole_span,
    word_counts,
)
from composer_jax.tasks.format import LEVELS

__all__ = ["LEVELS", "RepoIndex", "level_instruction", "plan_level", "shown_tests", "target_list"]

MAX_LISTED_TESTS = 20
MAX_SHOWN_TESTS = 3          # target tests whose source the instruction quotes
MAX_SHOWN_LINES = 40
# pytest runs the other test modules when one of them cannot import deleted code
CONTINUE_ON_COLLECTION_ERRORS = "--continue-on-collection-errors"

Imports = list[tuple[ast.Import | ast.ImportFrom, bool]]   # import statements of a module; True: at module level


@dataclasses.dataclass(frozen=True)
class RepoIndex:
    """What the levels need to know about the repository, computed once for all candidates."""
    texts: dict[str, str]                         # scrub.repo_texts
    definitions: dict[str, list[Definition]]      # per module that is not a test file (and parses)
    tests_of: dict[Definition, set[str]]          # the passing tests that ran each definition
    at_import: set[Definition]                    # definitions that ran at import or collection
    counts: Counter                               # word_counts of texts
    imports: dict[str, Imports]                   # per module of `definitions`

    @classmethod
    def build(cls, texts, definitions, tests_of, at_import, counts) -> RepoIndex:
        return cls(texts, definitions, tests_of, at_import, counts,
                   {path: _import_statements(python_ast.parse(texts[path])) for path in definitions})


def _import_statements(tree: ast.Module) -> Imports:
    top = {id(s) for s in tree.body} | {id(s) for n in tree.body if isinstance(n, (ast.If, ast.Try))
                                        for s in ast.walk(n)}
    return [(n, id(n) in top) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def plan_level(level: str, feature: Definition, index: RepoIndex, targets: set[str] | None = None) -> Deletion | str:
    """The `definition` or `feature` level deletion of the candidate `feature` (see the module
    docstring), or why it cannot be made ('edit_breaks_syntax'). `targets` (level feature): the tests
    whose code goes; default: those that ran `feature`."""
    if level == "definition":
        lines = index.texts[feature.path].splitlines(True)
        used = word_counts(lines[feature.start - 1:feature.end])
        helpers = private_helpers(feature, index.definitions[feature.path], lines, used, index.counts)
        return _remove(level, feature, [feature, *helpers], index, drop_empty_modules=False)
    if level != "feature":
        raise ValueError(f"plan_level: level must be 'definition' or 'feature', got {level!r}")
    targets = index.tests_of[feature] if targets is None else targets
    reached = [d for defs in index.definitions.values() for d in defs
               if d not in index.at_import and index.tests_of.get(d) and index.tests_of[d] <= targets]
    # a class that goes takes its methods with it
    outermost = [d for d in reached if not any(c is not d and c.kind == "class" and c.path == d.path
                                               and c.contains(d.start) for c in reached)]
    return _remove(level, feature, outermost, index, drop_empty_modules=True)


def _lines_of(node: ast.AST) -> range:
    return range(node.lineno, node.end_lineno + 1)


def _only_imports(tree: ast.Module, dropped: set[int]) -> bool:
    """Is the module, without the `dropped` lines, nothing but imports, a docstring, `__all__` and `pass`?"""
    for stmt in tree.body:
        if set(_lines_of(stmt)) <= dropped or isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, (ast.Assign, ast.AugAssign)) and all(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])):
            continue
        return False
    return True


def _absolute(stmt: ast.ImportFrom, path: str) -> str | None:
    """The module a `from ... import` in the file `path` imports from."""
    if not stmt.level:
        return stmt.module
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    if stmt.level - 1 > len(package):
        return None
    base = package[:len(package) - (stmt.level - 1)]
    return ".".join(base + ([stmt.module] if stmt.module else [])) or None


def _names_gone(stmt: ast.Import | ast.ImportFrom, alias: ast.alias, path: str, gone: dict[str, set[str]],
                dead: set[str]) -> bool:
    if isinstance(stmt, ast.Import):
        return any(alias.name == m or alias.name.startswith(m + ".") for m in dead)
    source = _absolute(stmt, path)
    return source is not None and (source in dead or f"{source}.{alias.name}" in dead
                                   or alias.name in gone.get(source, ()))


def _clean_imports(index: RepoIndex, gone_defs: list[Definition], dropped: dict[str, set[int]],
                   dead_paths: set[str]) -> dict[str, dict[ast.stmt, list[ast.alias]]]:
    """{path: {import statement: the names it keeps}} for every import of deleted code in the modules
    that stay (to a fixed point through re-exports); test files are not among them."""
    gone: dict[str, set[str]] = defaultdict(set)      # module -> names it no longer has
    for d in gone_defs:
        if d.owner is None:
            gone[module_name(d.path)].add(d.name)
    dead = {module_name(p) for p in dead_paths}
    cleaned: dict[str, dict[ast.stmt, list[ast.alias]]] = defaultdict(dict)
    changed = True
    while changed:
        changed = False
        for path, statements in index.imports.items():
            if path in dead_paths:
                continue
            for stmt, at_module_level in statements:
                if set(_lines_of(stmt)) <= dropped.get(path, set()):
                    continue   # inside deleted code
                kept = [a for a in stmt.names if not _names_gone(stmt, a, path, gone, dead)]
                if len(kept) == len(stmt.names) or len(cleaned[path].get(stmt, stmt.names)) == len(kept):
                    continue
                cleaned[path][stmt] = kept
                changed = True
                if at_module_level and isinstance(stmt, ast.ImportFrom):
                    gone[module_name(path)].update(a.asname or a.name for a in stmt.names if a not in kept)
    return {path: stmts for path, stmts in cleaned.items() if stmts}


def _alone_on_its_lines(stmt: ast.stmt, lines: list[str]) -> bool:
    rest = lines[stmt.end_lineno - 1][stmt.end_col_offset:].strip()
    return not lines[stmt.lineno - 1][:stmt.col_offset].strip() and (not rest or rest.startswith("#"))


def _rewrite(source: str, dropped: set[int], imports: dict[ast.stmt, list[ast.alias]]) -> tuple[str, list[str]]:
    """`source` without the `dropped` lines and with `imports` reduced to the names they keep; a block
    left empty gets `pass`. Returns the text and the lines it lost."""
    lines = source.splitlines(True)
    drop, put = set(dropped), {}
    for stmt, kept in imports.items():
        if not _alone_on_its_lines(stmt, lines):
            continue   # `import a; import b`: left as it is (the generator's check judges the result)
        drop.update(_lines_of(stmt))
        if kept:
            put[stmt.lineno] = [indent_of(lines, stmt) + ast.unparse(_with_names(stmt, kept)) + "\n"]
    rewritten = set(put)

    def gone(node: ast.AST) -> bool:
        return set(_lines_of(node)) <= drop and node.lineno not in rewritten

    for node in ast.walk(python_ast.parse(source)):   # parents before children: a block inside removed code is skipped
        if isinstance(node, ast.Module) or hasattr(node, "end_lineno") and gone(node):
            continue
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and all(map(gone, block)):
                put[block[0].lineno] = [indent_of(lines, block[0]) + "pass\n"]
    out, lost = [], []
    for number, line in enumerate(lines, 1):
        out.extend(put.get(number, ()))
        (lost if number in drop else out).append(line)
    return "".join(out), lost


def _with_names(stmt: ast.Import | ast.ImportFrom, names: list[ast.alias]) -> ast.stmt:
    new = copy.copy(stmt)
    new.names = names
    return new


def _remove(level: str, feature: Definition, gone_defs: list[Definition], index: RepoIndex, *,
            drop_empty_modules: bool) -> Deletion | str:
    """Remove `gone_defs` whole (and, with `drop_empty_modules`, the modules they leave empty), and the
    imports of them elsewhere."""
    trees = {path: python_ast.parse(index.texts[path]) for path in {d.path for d in gone_defs}}
    dropped: dict[str, set[int]] = defaultdict(set)
    for d in gone_defs:
        start, end = whole_span(d, index.texts[d.path].splitlines(True))
        dropped[d.path].update(range(start, end + 1))
    dead_paths = {path for path in trees if drop_empty_modules and not path.endswith("__init__.py")
                  and _only_imports(trees[path], dropped[path])}
    imports = _clean_imports(index, gone_defs, dropped, dead_paths)
    files, removed, strings = [], [], strings_in(d.node for d in gone_defs)
    for path in sorted(set(trees) | set(imports), key=lambda p: (p != feature.path, p)):
        original = index.texts[path]
        if path in dead_paths:
            files.append(FileEdit(path, original, None))
            removed += original.splitlines(True)
            strings |= strings_in([trees[path]])
            continue
        modified, lost = _rewrite(original, dropped.get(path, set()), imports.get(path, {}))
        try:
            python_ast.parse(modified)
        except SyntaxError:
            return "edit_breaks_syntax"
        files.append(FileEdit(path, original, modified))
        removed += lost
    return Deletion(feature=feature, stubbed=(), helpers=tuple(gone_defs), files=tuple(files), removed=tuple(removed),
                    strings=frozenset(strings), level=level, imports_cleaned=tuple(sorted(imports)))


def target_list(targets: list[str]) -> str:
    listed = "\n".join(f"- {t}" for t in targets[:MAX_LISTED_TESTS])
    if len(targets) > MAX_LISTED_TESTS:
        listed += f"\n- ... and {len(targets) - MAX_LISTED_TESTS} more"
    return f"These tests fail now and must pass, and every other test must keep passing:\n{listed}"


def test_source(texts: dict[str, str], node_id: str) -> str | None:
    """The source of the test function a pytest node id names (parameters aside), or None."""
    path, *names = node_id.split("[", 1)[0].split("::")
    try:
        body = python_ast.parse(texts.get(path, "")).body
    except SyntaxError:
        return None
    node = None
    for name in names:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return None
        body = node.body
    if node is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = texts[path].splitlines()[start - 1:node.end_lineno]
    if len(lines) > MAX_SHOWN_LINES:
        lines = lines[:MAX_SHOWN_LINES] + ["    ..."]
    return textwrap.dedent("\n".join(lines))


def shown_tests(texts: dict[str, str], targets: list[str], hide: tuple[str, ...] = ()) -> str | None:
    """The source of the first MAX_SHOWN_TESTS distinct target tests, for an instruction; a test whose
    source holds one of `hide` is not shown."""
    shown, seen = [], set()
    for test in targets:
        source = test_source(texts, test)
        if source and source not in seen and len(shown) < MAX_SHOWN_TESTS and not any(h in source for h in hide):
            seen.add(source)
            shown.append(f"{test.split('[', 1)[0]}:\n{textwrap.indent(source, '    ')}")
    return "The failing tests include:\n\n" + "\n\n".join(shown) if shown else None


def level_instruction(deletion: Deletion, targets: list[str], command: str, texts: dict[str, str],
                      kept_words: Counter) -> str:
    """What is missing, from the names the kept code uses and the failing tests (their names and
    source), never from the deleted code. `texts`: the repository's (test files included);
    `kept_words`: word_counts of the code that stays."""
    f = deletion.feature
    if deletion.level == "definition":
        helpers = ", and so are private helpers that only it used" if len(deletion.helpers) > 1 else ""
        parts = [(f"The {f.kind} `{f.qualname}` of the module `{module_name(f.path)}` (`{f.path}`) has been deleted: "
                 f"its signature, docstring and code are gone{helpers}. The code that uses it and the tests "
                 "below are its specification: write it again, under the same name, so that they pass.")]
    else:
        files = sorted({d.path for d in deletion.helpers})
        parts = [(f"A feature of this repository has been deleted: {deletion.definitions} definitions in "
                 f"{len(files)} files ({', '.join(f'`{p}`' for p in files)}). The code that still uses it and the "
                 "tests below are its specification: write it again so that they pass.")]
        if deletion.deleted_files:
            parts.append("These modules were deleted whole: " + ", ".join(f"`{p}`" for p in deletion.deleted_files)
                         + ".")
        used = [f"`{module_name(d.path)}.{d.qualname}`" for d in deletion.helpers if kept_words[d.name]]
        if used:
            parts.append("Deleted names that the rest of the code or the tests use, and that must exist again: "
                         + ", ".join(used) + ".")
    if deletion.imports_cleaned:
        parts.append("Imports of the deleted code were removed from " +
                     ", ".join(f"`{p}`" for p in deletion.imports_cleaned) + ".")
    parts.append(target_list(targets))
    shown = shown_tests(texts, targets)
    if shown:
        parts.append(shown)
    parts.append(f"Run the tests with: {command}")
    return "\n\n".join(parts)
