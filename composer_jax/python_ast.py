"""`parse`: `ast.parse` that threads can share.

CPython 3.11 keeps the AST constructor's recursion depth in one per-interpreter counter. When two threads
build trees at once (a garbage collection inside one conversion runs Python code, and the GIL passes to
the other), the counter no longer matches at the end and `ast.parse` raises "SystemError: AST constructor
recursion depth mismatch (before=33, after=29)" (CPython issue 106905). The sandboxed commands run one
task per thread (`tasks demos`, `feature-deletion`, `gym`) and parse sources there: one lock serializes
the parses. Reentrant: a parse inside a collection inside a parse on the same thread is balanced.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.RLock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source, filename)`, one thread at a time."""
    with _LOCK:
        return ast.parse(source, filename)


def unparse(node: ast.AST) -> str:
    """`ast.unparse(node)` under the same lock (kept from the grain reader threads' first fix)."""
    with _LOCK:
        return ast.unparse(node)
