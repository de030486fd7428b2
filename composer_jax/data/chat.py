"""SFT conversations: the chat template, tokens and the assistant-only loss mask.

A conversation is a list of `{"role": ..., "content": ...}` messages (roles: system, user, assistant,
tool). It renders as ChatML, one block per message:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Each piece is tokenized on its own and concatenated, so the loss mask is exact whatever the tokenizer:
it marks the assistant's content and its closing `<|im_end|>` (the model learns when to stop), and
nothing else. With a tokenizer that registers `<|im_start|>` / `<|im_end|>` as special tokens they
become single ids; with the byte tokenizer they are spelled out in bytes.

`python_function_conversations` turns a Python source file into coding tasks (the user asks for a
documented function by signature and docstring, the assistant answers with its source), which gives an
SFT set from any code tree, e.g. the standard library.
"""

from __future__ import annotations

import ast
import threading

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
START, END = "<|im_start|>", "<|im_end|>"
TEMPLATE_CHARS = 2 * len(f"{START}assistant\n{END}\n")  # template text around one user + assistant turn
_AST_LOCK = threading.Lock()


class ConversationError(ValueError):
    """A record is not a usable conversation; the message says why."""


def validate(messages) -> list[dict]:
    """The messages as a list of {"role", "content"} dicts; ConversationError if malformed."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConversationError(f"message {i} needs a string 'content'")
        if m.get("role") not in ROLES:
            raise ConversationError(f"message {i} has role {m.get('role')!r}, not one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        raise ConversationError("no assistant message to train on")
    return out


def render(messages: list[dict]) -> list[tuple[str, bool]]:
    """The template as (text piece, trained) pairs; concatenated pieces are the full conversation text."""
    pieces = []
    for m in messages:
        trained = m["role"] == "assistant"
        pieces += [(f"{START}{m['role']}\n", False), (m["content"], trained), (f"{END}\n", trained)]
    return pieces


def tokenize_conversation(messages, encode) -> tuple[np.ndarray, np.ndarray]:
    """messages -> (tokens int32[n], loss_mask int32[n]): 1 on assistant content and its end marker.

    `encode`: str -> int32[k]. The mask marks tokens that are *targets* of training (the step predicts
    token i from tokens < i and counts it where loss_mask[i] is 1).
    """
    tokens, mask = [], []
    for text, trained in render(validate(messages)):
        ids = np.asarray(encode(text), np.int32) if text else np.zeros((0,), np.int32)
        tokens.append(ids)
        mask.append(np.full(ids.shape, int(trained), np.int32))
    return np.concatenate(tokens), np.concatenate(mask)


def python_function_conversations(source: str, path: str, max_turns: int = 3,
                                  max_chars: int = 4096) -> list[dict] | None:
    """A multi-turn coding conversation from one Python file, or None if it has no suitable function.

    Each turn: the user gives a function's signature and docstring, the assistant answers with the
    function's full source. Documented functions are taken outer definitions first (`ast.walk`
    order), at most `max_turns` of them, while the conversation stays under `max_chars` characters.
    """
    try:
        with _AST_LOCK:  # CPython 3.11's parser is not safe across grain's reader threads
            tree = ast.parse(source)
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
        with _AST_LOCK:
            signature = f"def {node.name}({ast.unparse(node.args)})"
        ask = f"In `{path}`, write `{signature}`:\n\n{doc}"
        if used + len(ask) + len(body) + TEMPLATE_CHARS > max_chars:
            continue
        used += len(ask) + len(body) + TEMPLATE_CHARS
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": body}]
    return messages if len(messages) > 1 else None
