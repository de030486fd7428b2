"""SFT conversations: the chat template, tokens and the assistant-only loss mask.

A conversation is a list of `{"role": ..., "content": ...}` messages (roles: system, user, assistant,
tool). It renders as ChatML, one block per message:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Each piece is tokenized on its own and concatenated, so the loss mask is exact whatever the tokenizer:
it marks the assistant's content and its closing `<|im_end|>` (the model learns when to stop), and
nothing else. With a tokenizer that registers `<|im_start|>` / `<|im_end|>` as special tokens they
become single ids; with the byte tokenizer they are spelled out in bytes.
"""

from __future__ import annotations

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
START, END = "<|im_start|>", "<|im_end|>"
TEMPLATE_CHARS = 2 * len(f"{START}assistant\n{END}\n")  # template text around one user + assistant turn


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
