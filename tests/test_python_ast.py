"""`composer_jax.python_ast`: one thread at a time in CPython's AST constructor (3.11 raises
"SystemError: AST constructor recursion depth mismatch" when two threads build trees at once, seen in
`tasks demos` under load), the same trees as `ast.parse`, and a nested parse on one thread is allowed."""

import ast
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from composer_jax import python_ast

SOURCE = "def f(x):\n    return [y * 2 for y in range(x) if y % 3]\n"


def test_parses_from_threads_never_overlap_and_give_ast_parse_trees(monkeypatch):
    inside, most, guard = [0], [0], threading.Lock()
    real = ast.parse

    def slow_parse(source, *args, **kwargs):
        if source != SOURCE:  # pytest's own parses
            return real(source, *args, **kwargs)
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)      # the GIL passes to the other threads here, as a collection's finalizer can
        tree = real(source, *args, **kwargs)
        with guard:
            inside[0] -= 1
        return tree

    monkeypatch.setattr(python_ast.ast, "parse", slow_parse)
    with ThreadPoolExecutor(8) as pool:
        trees = list(pool.map(python_ast.parse, [SOURCE] * 32))
    assert most[0] == 1
    assert all(ast.dump(t) == ast.dump(real(SOURCE)) for t in trees)


def test_a_parse_inside_a_parse_on_one_thread_does_not_wait():
    """A finalizer that parses, run by a collection during a parse, re-enters the lock."""
    class Parses:
        def __del__(self):
            python_ast.parse("y = 2")

    with python_ast._LOCK:       # as if inside a parse on this thread
        obj = Parses()
        del obj
        assert isinstance(python_ast.parse(SOURCE), ast.Module)
