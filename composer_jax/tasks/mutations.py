"""Semantic mutations of Python source, found with `ast` and applied as minimal text edits.

A site is one node inside the body of a function or method (never its signature or decorators, which
run at import) and one MUTATIONS kind:

- `comparison`: one comparison operator flipped (`<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`,
  `in` <-> `not in`, `is` <-> `is not`);
- `arithmetic`: one arithmetic operator changed (`+` <-> `-`, `*` -> `/`, `/` -> `*`, `//` -> `/`,
  `%` -> `//`; also in `+=`-style assignments), not on string formatting or concatenation of literals;
- `off_by_one`: an integer bound one more (`x[:3]` -> `x[:4]`, `range(2, n)` -> `range(3, n)`,
  `i + 1` -> `i + 2`), or one less for a computed stop (`range(len(x))` -> `range(len(x) - 1)`);
- `swapped_arguments`: the first two positional arguments of a call exchanged (`f(a, b)` -> `f(b, a)`);
- `dropped_condition`: the last operand of an `and`/`or` removed, or a `not` dropped;
- `dropped_return`: an early-return guard (`if c: return x`, not the last statement of its block)
  removed whole;
- `wrong_constant`: another numeric or boolean constant (`n` -> `n + 1`, `x` -> `2 x`, `True` <-> `False`).

The edit replaces the exact source span of the node (or of the operator between its operands), so a
diff is one small hunk and formatting, comments and the rest of the line stay. Each edit is verified:
the edited module must parse to the AST the mutation means (the original tree with the one node
changed); a site where the text edit would mean something else (parentheses, comments between the
operands) is skipped (`edit_mismatch`).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re

from composer_jax import python_ast
from composer_jax.tasks.features import Definition
from composer_jax.tasks.format import MUTATIONS

__all__ = ["MUTATIONS", "Mutation", "find_mutations"]

COMPARISON_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                   ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
ARITHMETIC_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
                   ast.Mod: ast.FloorDiv}
OPERATOR_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
                 ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-",
                 ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}
# an operand that `... - 1` may follow without parentheses
BOUND_OPERANDS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript)
ADDITIVE_OR_TIGHTER = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
COMMUTATIVE_CALLS = {"max", "min", "print"}


@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str                       # one of MUTATIONS
    definition: Definition          # the function or method whose body holds the site
    line: int                       # the site's first line (1-based)
    original: str                   # the module's source
    modified: str                   # the module's source with the mutation

    @property
    def path(self) -> str:
        return self.definition.path

    def changed(self) -> tuple[list[str], list[str]]:
        """The lines the mutation replaces, and the lines it puts there (a run of whole lines)."""
        before, after = self.original.splitlines(True), self.modified.splitlines(True)
        head = 0
        while head < min(len(before), len(after)) and before[head] == after[head]:
            head += 1
        tail = 0
        while tail < min(len(before), len(after)) - head and before[-1 - tail] == after[-1 - tail]:
            tail += 1
        return before[head:len(before) - tail], after[head:len(after) - tail]

    @property
    def changed_lines(self) -> int:
        removed, added = self.changed()
        return max(len(removed), len(added))


class _Source:
    """Offsets into a module's text from ast positions (columns are UTF-8 byte offsets)."""

    def __init__(self, text: str):
        self.text = text
        self.starts = [0]
        for line in text.splitlines(True):
            self.starts.append(self.starts[-1] + len(line))
        self.lines = text.splitlines(True)

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + len(self.lines[line - 1].encode("utf-8")[:col].decode("utf-8", "replace"))

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        return self.text[self.start(node):self.end(node)]


# An edit: (start offset, end offset, replacement), and how the AST changes: a function of the copied
# tree's node (found at the same walk position) that mutates it in place.
Edit = tuple[int, int, str]


def _operator_edit(src: _Source, left: ast.AST, right: ast.AST, old: type, new: type) -> Edit | None:
    """Replace the operator `old` written between `left` and `right` (parentheses and spaces aside)."""
    lo, hi = src.end(left), src.start(right)
    words = OPERATOR_TEXT[old].split(" ")
    pattern = r"[\s()\\]*(" + r"\s+".join(re.escape(w) for w in words) + r")=?[\s()\\]*"
    match = re.fullmatch(pattern, src.text[lo:hi])
    if match is None:
        return None
    return lo + match.start(1), lo + match.end(1), OPERATOR_TEXT[new]


def _drop_operand_edit(src: _Source, kept: ast.AST, dropped: ast.AST) -> Edit | None:
    """Remove ` and <dropped>` after `kept`, with the parentheses around `dropped` (not those that close
    around `kept`)."""
    lo, hi = src.end(kept), src.start(dropped)
    match = re.fullmatch(r"([\s)]*?)\s*\b(and|or)\b[\s\\]*((?:\([\s\\]*)*)", src.text[lo:hi])
    if match is None:
        return None
    end = src.end(dropped)
    for _ in range(match.group(3).count("(")):
        closing = re.match(r"[\s\\]*\)", src.text[end:])
        if closing is None:
            return None
        end += closing.end()
    return lo + len(match.group(1)), end, ""


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, (ast.JoinedStr, ast.List, ast.Tuple, ast.ListComp)) or \
        isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))


def _number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float, bool)


def _new_constant(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return value * 2 if value else 1.0


def _replace_in_parent(parent: ast.AST, child: ast.AST, new: ast.AST | None) -> None:
    """Put `new` where `child` is among `parent`'s fields (None: remove it from its list)."""
    for field, value in ast.iter_fields(parent):
        if value is child:
            setattr(parent, field, new)
            return
        if isinstance(value, list) and any(v is child for v in value):
            index = next(i for i, v in enumerate(value) if v is child)
            if new is None:
                del value[index]
            else:
                value[index] = new
            return
    raise ValueError("child not found in parent")


def _sites(body: list[ast.stmt], src: _Source):
    """(kind, node, edit, change) for every mutation site in the statements `body`; `change(node,
    parent)` applies the mutation to a copy of the tree."""
    parents = {}
    for stmt in body:
        for node in ast.walk(stmt):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
    bounds, plus_one = set(), set()   # off_by_one sites: bounds of slices and range(), `x + <int>`
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Slice):
                bounds.update((n, "upper" if n is node.upper else "lower") for n in (node.lower, node.upper) if n)
            elif isinstance(node, ast.Subscript) and _number(node.slice) and isinstance(node.slice.value, int):
                bounds.add((node.slice, "lower"))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range" and node.args:
                stop = node.args[0] if len(node.args) == 1 else node.args[1]
                bounds.update((a, "upper" if a is stop else "lower") for a in node.args[:2])
            elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and _number(node.right) \
                    and type(node.right.value) is int:
                plus_one.add(node.right)
    bound_nodes = {n for n, _ in bounds} | plus_one
    upper = {n for n, side in bounds if side == "upper"}
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    left = node.left if i == 0 else node.comparators[i - 1]
                    edit = _operator_edit(src, left, node.comparators[i], type(op), COMPARISON_SWAP[type(op)])
                    if edit:
                        yield "comparison", node, edit, _set_op(i, COMPARISON_SWAP[type(op)])
            elif isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC_SWAP and not (
                    _is_text(node.left) or _is_text(node.right)):
                new = ARITHMETIC_SWAP[type(node.op)]
                edit = _operator_edit(src, node.left, node.right, type(node.op), new)
                if edit:
                    yield "arithmetic", node, edit, _set_attr("op", new())
            elif isinstance(node, ast.AugAssign) and type(node.op) in ARITHMETIC_SWAP and not _is_text(node.value):
                new = ARITHMETIC_SWAP[type(node.op)]
                edit = _operator_edit(src, node.target, node.value, type(node.op), new)
                if edit:
                    yield "arithmetic", node, edit, _set_attr("op", new())
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and not any(
                    isinstance(a, ast.Starred) for a in node.args[:2]) \
                    and getattr(node.func, "id", None) not in COMMUTATIVE_CALLS:
                a, b = node.args[:2]
                if src.segment(a) != src.segment(b):
                    between = src.text[src.end(a):src.start(b)]
                    yield ("swapped_arguments", node, (src.start(a), src.end(b), src.segment(b) + between +
                                                       src.segment(a)), _swap_args)
            elif isinstance(node, ast.BoolOp):
                edit = _drop_operand_edit(src, node.values[-2], node.values[-1])
                if edit:
                    yield "dropped_condition", node, edit, _drop_last_operand
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                keyword = re.match(r"not\s*", src.text[src.start(node):src.start(node.operand)])
                if keyword:
                    yield "dropped_condition", node, (src.start(node), src.start(node) + keyword.end(), ""), _unwrap
            elif isinstance(node, ast.If) and not node.orelse and len(node.body) == 1 \
                    and isinstance(node.body[0], ast.Return):
                block = next(v for _, v in ast.iter_fields(parents.get(node, _Holder(body)))
                             if isinstance(v, list) and any(s is node for s in v))
                if block[-1] is not node and _alone_on_its_lines(src, node):
                    first = src.offset(node.lineno, 0)
                    yield "dropped_return", node, (first, src.offset(node.end_lineno + 1, 0), ""), _remove
            elif _number(node):
                if node in bound_nodes:
                    kind = "off_by_one" if type(node.value) is int else "wrong_constant"
                else:
                    kind = "wrong_constant"
                new_value = _new_constant(node.value)
                yield kind, node, (src.start(node), src.end(node), repr(new_value)), _set_attr("value", new_value)
            # (a stop that already ends in `+ <int>` has that constant as its off_by_one site)
            if node in upper and not _number(node) and (
                    isinstance(node, BOUND_OPERANDS) or isinstance(node, ast.BinOp)
                    and isinstance(node.op, ADDITIVE_OR_TIGHTER) and node.right not in plus_one):
                yield "off_by_one", node, (src.end(node), src.end(node), " - 1"), _minus_one


class _Holder:
    """Stands in as the parent of a function body's top-level statements."""

    def __init__(self, body):
        self.body = body

    _fields = ("body",)


def _alone_on_its_lines(src: _Source, stmt: ast.stmt) -> bool:
    lines = src.lines
    rest = lines[stmt.end_lineno - 1].encode("utf-8")[stmt.end_col_offset:].decode("utf-8", "replace").strip()
    return not lines[stmt.lineno - 1].encode("utf-8")[:stmt.col_offset].strip() and (not rest or rest.startswith("#"))


def _set_op(i: int, new: type):
    def change(node, parent):
        node.ops[i] = new()
    return change


def _set_attr(name: str, value):
    def change(node, parent):
        setattr(node, name, copy.copy(value))
    return change


def _swap_args(node, parent):
    node.args[0], node.args[1] = node.args[1], node.args[0]


def _drop_last_operand(node, parent):
    if len(node.values) == 2:
        _replace_in_parent(parent, node, node.values[0])
    else:
        node.values.pop()


def _unwrap(node, parent):
    _replace_in_parent(parent, node, node.operand)


def _remove(node, parent):
    _replace_in_parent(parent, node, None)


def _minus_one(node, parent):
    _replace_in_parent(parent, node, ast.BinOp(node, ast.Sub(), ast.Constant(1)))


def _parent_of(tree: ast.AST, target: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if any(child is target for child in ast.iter_child_nodes(node)):
            return node
    raise ValueError("node not in tree")


def find_mutations(source: str, definitions: list[Definition], kinds: tuple[str, ...] = MUTATIONS
                   ) -> tuple[list[Mutation], int]:
    """The mutations of `kinds` inside the bodies of `definitions` (functions and methods of the module
    `source`), in source order; and how many sites were skipped as edit_mismatch. A site nested in a
    function that is itself one of `definitions` belongs to the innermost one."""
    tree = python_ast.parse(source)
    src = _Source(source)
    functions = sorted((d for d in definitions if d.kind in ("function", "method")), key=lambda d: d.start)
    # the definitions' nodes come from their own parse of `source`: find them in this one
    here = {(n.lineno, n.col_offset): n for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    node_of = {d: here[d.node.lineno, d.node.col_offset] for d in functions}
    owned = {}   # id(node) -> the innermost definition whose body holds it (later, inner ones overwrite)
    for d in functions:
        for stmt in node_of[d].body:
            for node in ast.walk(stmt):
                owned[id(node)] = d
    mutations, mismatched, seen = [], 0, set()
    for d in functions:
        # the module-level statement that holds the definition: the edit is checked on it alone
        function = node_of[d]
        top = next(t for t in tree.body if t.lineno <= function.lineno and function.end_lineno <= t.end_lineno)
        first = min([top.lineno] + [x.lineno for x in getattr(top, "decorator_list", [])])
        top_lo, top_hi = src.offset(first, 0), src.offset(top.end_lineno, top.end_col_offset)
        nodes = list(ast.walk(top))
        position = {id(n): i for i, n in enumerate(nodes)}
        body = function.body[1:] if ast.get_docstring(function) is not None else function.body
        for kind, node, (lo, hi, text), change in _sites(body, src):
            if kind not in kinds or owned.get(id(node)) is not d or (kind, lo, hi) in seen:
                continue
            seen.add((kind, lo, hi))
            twin = copy.deepcopy(top)
            twin_node = list(ast.walk(twin))[position[id(node)]]
            change(twin_node, _parent_of(twin, twin_node))
            edited = source[top_lo:lo] + text + source[hi:top_hi]
            try:
                ok = ast.dump(python_ast.parse(edited).body[0]) == ast.dump(twin) != ast.dump(top)
            except SyntaxError:
                ok = False
            if ok:
                mutations.append(Mutation(kind, d, node.lineno, source, source[:lo] + text + source[hi:]))
            else:
                mismatched += 1
    return mutations, mismatched
