"""Synthetic SFT conversations from code: `python_function_conversations` turns a Python source file
into coding tasks (the user asks for a documented function by signature and docstring, the assistant
answers with its source), which gives an SFT set from any code tree, e.g. the standard library."""

from __future__ import annotations

import ast

from composer_jax import python_ast
from composer_jax.data.chat import TEMPLATE_CHARS


def python_function_conversations(source: str, path: str, max_turns: int = 3,
                                  max_chars: int = 4096) -> list[dict] | None:
    """A multi-turn coding conversation from one Python file, or None if it has no suitable function.

    Each turn: the user gives a function's signature and docstring, the assistant answers with the
    function's full source. Documented functions are taken outer definitions first (`ast.walk`
    order), at most `max_turns` of them, while the conversation stays under `max_chars` characters.
    """
    try:
        tree = python_ast.parse(source)   # grain's reader threads share the parser
    except (SyntaxError, ValueError, SystemError, RecursionError, MemoryError):
        return None
    lines = source.splitlines()
    messages = [{"role": "system", "content": "You write Python functions from their specification."}]
    used = len(messages[0]["content"])
    for node in ast.walk(tree):
        if len(messages) > 2 * max_turns:
            break
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        body = "\n".join(lines[start: node.end_lineno])
        if not doc:
            continue
        indent = len(lines[start]) - len(lines[start].lstrip())
        body = "\n".join(line[indent:] for line in body.splitlines())
        signature = f"def {node.name}({python_ast.unparse(node.args)})"
        ask = f"In `{path}`, write `{signature}`:\n\n{doc}"
        if used + len(ask) + len(body) + TEMPLATE_CHARS > max_chars:
            continue
        used += len(ask) + len(body) + TEMPLATE_CHARS
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": body}]
    return messages if len(messages) > 1 else None
