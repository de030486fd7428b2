"""Definitions a task can delete, and their deletion (AST-based: the module stays importable).

A feature is a module-level function, a method, or a class (all of its methods at once). Deleting it
keeps the interface: a function's body after its docstring becomes `raise NotImplementedError`
(decorators, signature and docstring stay, so callers and tests still import and call it). Private
helpers (`_name` functions and classes of the module, `_name` methods of the same class) go whole
when nothing but the deleted code names them anywhere in the repository; a name inside a string
counts as a use, so `getattr(obj, "_helper")` keeps a helper. That is the `body` level; levels.py
removes whole definitions (the `definition` and `feature` levels) with the same pieces.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from collections import Counter
from collections.abc import Iterable

from composer_jax import python_ast

STUB = "raise NotImplementedError"
NOT_DELETED_DECORATORS = {"abstractmethod", "abstractproperty", "overload"}
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True, eq=False)
class Definition:
    path: str                 # relative to the repository, posix
    qualname: str             # "parse_date", "Stats", "Stats.mean"
    kind: str                 # "function", "method" or "class"
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    owner: str | None         # qualname of the class it is defined in

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def start(self) -> int:
        """Its first line, decorators included (what a code object's co_firstlineno says)."""
        return min([self.node.lineno] + [d.lineno for d in self.node.decorator_list])

    @property
    def end(self) -> int:
        return self.node.end_lineno

    def contains(self, line: int) -> bool:
        return self.start <= line <= self.end


def find_definitions(path: str, source: str) -> list[Definition]:
    """Module-level functions and classes, and the methods and classes inside classes (not what is
    defined inside functions, or under `if`/`try`). SyntaxError propagates."""
    found = []

    def visit(body: list[ast.stmt], owner: str | None) -> None:
        for node in body:
            qualname = f"{owner}.{node.name}" if owner and hasattr(node, "name") else getattr(node, "name", "")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(Definition(path, qualname, "method" if owner else "function", node, owner))
            elif isinstance(node, ast.ClassDef):
                found.append(Definition(path, qualname, "class", node, owner))
                visit(node.body, qualname)

    visit(python_ast.parse(source).body, None)
    return found


def word_counts(texts: Iterable[str]) -> Counter:
    """How often each identifier-like word occurs in `texts` (strings and comments included)."""
    counts = Counter()
    for text in texts:
        counts.update(WORD.findall(text))
    return counts


def _decorator_names(node: ast.AST) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _has_docstring(node: ast.AST) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _is_placeholder(body: list[ast.stmt]) -> bool:
    """Already a stub: `pass`, `...` or `raise NotImplementedError[(...)]`."""
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value is Ellipsis
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return isinstance(stmt, ast.Pass)


def _blank_or_comment(line: str) -> bool:
    return not line.strip() or line.lstrip().startswith("#")


def _deleted_body(node: ast.AST) -> list[ast.stmt]:
    return node.body[1:] if _has_docstring(node) else node.body


def body_span(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[int, int] | str:
    """The 1-based lines (first, last) the stub replaces: all after the docstring, comments included;
    or why nothing can be deleted: 'abstract_or_overload', 'no_body' (already a stub) or
    'inline_body' (the body shares a line with the signature or docstring)."""
    if _decorator_names(node) & NOT_DELETED_DECORATORS:
        return "abstract_or_overload"
    body = _deleted_body(node)
    if not body or _is_placeholder(body):
        return "no_body"
    first = body[0]
    if lines[first.lineno - 1][:first.col_offset].strip():
        return "inline_body"
    if body is not node.body:
        return node.body[0].end_lineno + 1, node.end_lineno
    start = first.lineno
    while start - 1 > node.lineno and _blank_or_comment(lines[start - 2]):
        start -= 1
    return start, node.end_lineno


@dataclasses.dataclass(frozen=True)
class FileEdit:
    path: str
    original: str
    modified: str | None                 # None: the file is deleted


@dataclasses.dataclass(frozen=True, eq=False)
class Deletion:
    feature: Definition
    stubbed: tuple[Definition, ...]      # bodies replaced by the stub (the feature, or a class's methods)
    helpers: tuple[Definition, ...]      # definitions removed whole (level body: the private helpers only it used)
    files: tuple[FileEdit, ...]          # the changed files, the feature's module first
    removed: tuple[str, ...]             # the deleted lines, as they were
    strings: frozenset[str]              # string constants of the deleted code
    level: str = "body"                  # see levels.py
    imports_cleaned: tuple[str, ...] = ()   # modules whose imports of deleted code were removed

    @property
    def path(self) -> str:
        return self.feature.path

    @property
    def original(self) -> str:
        return self.files[0].original

    @property
    def modified(self) -> str | None:
        return self.files[0].modified

    @property
    def deleted_lines(self) -> int:
        return sum(1 for line in self.removed if line.strip())

    @property
    def code_lines(self) -> int:
        """Deleted lines that hold code (not blank, not only a comment)."""
        return sum(1 for line in self.removed if not _blank_or_comment(line))

    @property
    def definitions(self) -> int:
        """Stubbed and removed definitions; a class removed whole counts with the definitions inside it."""
        return len(self.stubbed) + sum(count_definitions(h.node) for h in self.helpers)

    @property
    def deleted_files(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files if f.modified is None)


def count_definitions(node: ast.AST) -> int:
    """1 for a function; for a class, 1 and the definitions in its body (as find_definitions counts them)."""
    if not isinstance(node, ast.ClassDef):
        return 1
    return 1 + sum(count_definitions(n) for n in node.body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def module_name(path: str) -> str:
    """'src/pkg/mod.py' -> 'pkg.mod'; 'pkg/__init__.py' -> 'pkg'."""
    return re.sub(r"^src/", "", path).removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def private_helpers(feature: Definition, definitions: list[Definition], lines: list[str],
                     removed: Counter, counts: Counter) -> list[Definition]:
    """Private definitions that only the removed code names (searched to a fixed point: a helper of a
    removed helper goes too). `removed`: word counts of the stubbed bodies; `counts`: the repository's."""
    scope = {None, feature.owner} if feature.kind == "method" else {None}
    pool = [d for d in definitions if d.name.startswith("_") and not d.name.endswith("__") and d.owner in scope
            and d is not feature and not d.contains(feature.start) and not feature.contains(d.start)]
    own = {d: word_counts(lines[d.start - 1:d.end]) for d in pool}
    chosen: list[Definition] = []
    grew = True
    while grew:
        grew = False
        for d in pool:
            inside = removed[d.name] + sum(own[h][d.name] for h in chosen)
            if d not in chosen and inside and counts[d.name] == inside + own[d][d.name]:
                chosen.append(d)
                grew = True
    return chosen


def whole_span(d: Definition, lines: list[str]) -> tuple[int, int]:
    """The lines of a definition removed whole: with the comment block right above it and the blank
    lines after it."""
    start, end = d.start, d.end
    while start > 1 and lines[start - 2].lstrip().startswith("#"):
        start -= 1
    while end < len(lines) and not lines[end].strip():
        end += 1
    if end == len(lines):  # at the end of the file: take the blank lines before it instead
        while start > 1 and not lines[start - 2].strip():
            start -= 1
    return start, end


def indent_of(lines: list[str], stmt: ast.stmt) -> str:
    """The whitespace before a statement, as written (tabs stay tabs)."""
    return lines[stmt.lineno - 1][:stmt.col_offset]


def strings_in(nodes: Iterable[ast.AST]) -> set[str]:
    return {n.value for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def plan_deletion(feature: Definition, definitions: list[Definition], source: str, counts: Counter) -> Deletion | str:
    """Delete `feature` from its module's `source` (`definitions`: that module's, from find_definitions;
    `counts`: word_counts of the repository's Python and test files). Returns the Deletion, or the
    reason it cannot be made (see body_span)."""
    lines = source.splitlines(True)
    targets = ([d for d in definitions if d.owner == feature.qualname and d.kind == "method"]
               if feature.kind == "class" else [feature])
    spans, reasons = {}, []
    for d in targets:
        span = body_span(d.node, lines)
        if isinstance(span, str):
            reasons.append(span)
        else:
            spans[d] = span
    if not spans:
        return reasons[0] if reasons else "no_body"
    removed_words = word_counts("".join(lines[s - 1:e]) for s, e in spans.values())
    helpers = private_helpers(feature, definitions, lines, removed_words, counts)
    edits = [(s, e, [indent_of(lines, _deleted_body(d.node)[0]) + STUB + "\n"]) for d, (s, e) in spans.items()]
    edits += [(*whole_span(h, lines), []) for h in helpers]
    new, removed = list(lines), []
    for start, end, replacement in sorted(edits, reverse=True):  # bottom-up: earlier line numbers stay valid
        removed[:0] = lines[start - 1:end]
        new[start - 1:end] = replacement
    modified = "".join(new)
    python_ast.parse(modified)  # stubs and whole removals keep the module valid: a SyntaxError here is a bug
    return Deletion(feature=feature, stubbed=tuple(spans), helpers=tuple(helpers),
                    files=(FileEdit(feature.path, source, modified),), removed=tuple(removed),
                    strings=frozenset(strings_in([s for d in spans for s in _deleted_body(d.node)] +
                                               [h.node for h in helpers])))


def signature(d: Definition) -> str:
    """Its decorators and `def`/`class` line as source, without the body."""
    node = copy.copy(d.node)
    node.body = [ast.Pass()]
    return ast.unparse(node).rsplit("\n", 1)[0]


def docstring(d: Definition) -> str | None:
    return ast.get_docstring(d.node)
