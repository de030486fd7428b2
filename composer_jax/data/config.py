"""The data section of a training config (typed and validated like every config)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from composer_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes packed rows.

    kind: `text_tree` (every matching file of a directory is a document), `python_functions` (SFT
    coding conversations built from the functions of a Python tree), `jsonl`, `parquet`, `array_record`.
    path: a file or directory; `stdlib` means this Python's standard library sources.
    format: `text` (pretraining documents from `field`) or `chat` (conversations in `field`, loss on
    assistant tokens only).
    """

    # where records come from (see the class docstring)
    kind: Literal["text_tree", "python_functions", "jsonl", "parquet", "array_record"] = "text_tree"
    path: str = "stdlib"                 # a file or directory; "stdlib" = this Python's standard library
    glob: str = ""                       # file pattern under `path`; "" = the kind's default (*.py, *.jsonl...)
    exclude: str = "site-packages"       # comma-separated path components to leave out
    format: Literal["text", "chat"] = "text"   # text: documents; chat: conversations, loss on assistant tokens
    field: str = ""                      # record field: "" = "text" for text, "messages" for chat
    # "byte", a tokenizer.json or tiktoken file (or a directory holding one); "": train.init_from's, else byte
    tokenizer: str = ""
    # chat / tool-call format of conversations: plain, kimi; "": train.init_from's, else kimi when the
    # tokenizer has Kimi's markers as single tokens, else plain
    chat_format: Literal["", "plain", "kimi"] = ""
    append_eos: bool = False             # end each text document with the tokenizer's EOS id
    eval_fraction: float = 0.05          # held-out share of records (stable hash of the record key)
    shuffle: bool = True                 # shuffle the train records (anew each epoch)
    seed: int = 0                        # the shuffle's seed
    max_file_bytes: int = 1_000_000      # larger files of a tree are skipped (counted, listed)
    read_threads: int = 2                # grain reader threads
    prefetch: int = 64                   # grain prefetch buffer (records)

    def __post_init__(self):
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.kind == "python_functions" and self.format != "chat":
            raise ConfigError("format", "kind 'python_functions' yields conversations: set format: chat")
        if self.kind == "text_tree" and self.format == "chat":
            raise ConfigError("format", "a text_tree yields plain documents: use format: text")
        for name in ("max_file_bytes", "read_threads", "prefetch"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        if not self.path:
            raise ConfigError("path", "is empty")

    @property
    def record_field(self) -> str:
        return self.field or ("messages" if self.format == "chat" else "text")

    @property
    def exclude_parts(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.exclude.split(",") if p.strip())
