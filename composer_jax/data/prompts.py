"""Prompts for generation as token ids: one text, or a JSONL file of `{"prompt": text}`, `{"tokens": [ids]}`
or `{"messages": [...]}` lines (`composer-jax generate --prompts`), optionally rendered in a chat format."""

from __future__ import annotations

import json

from composer_jax.data.chat import render


class _Encoder:
    """Text (or messages, in chat format `fmt`; plain text is wrapped as one user message) -> token ids."""

    def __init__(self, tokenizer, fmt, chat: bool, model: str):
        self.tokenizer, self.fmt, self.chat, self.model = tokenizer, fmt, chat, model

    def text(self, text: str, where: str) -> list[int]:
        return self.messages([{"role": "user", "content": text}], where) if self.chat else self._encode(text, where)

    def messages(self, messages, where: str) -> list[int]:
        return self._encode("".join(piece for piece, _ in render(messages, self.fmt, generation_prompt=True)), where)

    def _encode(self, text: str, where: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{where}: text prompts need a tokenizer, and {self.model} has none (tokenizer.json / "
                             "tiktoken.model): give token ids ({\"tokens\": [...]} lines in --prompts)")
        return [int(i) for i in self.tokenizer.encode(text)]


def _record_ids(record, where: str, encoder: _Encoder) -> list[int]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'prompt', 'tokens' or 'messages'")
    if "tokens" in record:
        tokens = record["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{where}: 'tokens' must be a list of ints")
        return tokens
    if "messages" in record:
        return encoder.messages(record["messages"], where)
    if isinstance(record.get("prompt"), str):
        return encoder.text(record["prompt"], where)
    raise ValueError(f"{where}: expected a string 'prompt', a 'tokens' list or 'messages'")


def prompt_ids(*, prompt: str | None = None, path: str | None = None, tokenizer=None, fmt=None, chat: bool = False,
               model: str = "the model") -> list[tuple[str, list[int]]]:
    """(where it came from, token ids) per prompt, from one text `prompt` or the JSONL file at `path`;
    `chat` renders text in the chat format `fmt` (composer_jax.data.chat); `model` names the model in
    errors (text needs its `tokenizer`). ValueError naming the line at fault."""
    encoder = _Encoder(tokenizer, fmt, chat, model)
    if prompt is not None:
        return [("--prompt", encoder.text(prompt, "--prompt"))]
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            out.append((where, _record_ids(record, where, encoder)))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
