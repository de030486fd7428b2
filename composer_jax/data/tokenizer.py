"""Tokenizers: byte-level by default, a Hugging Face `tokenizer.json`, or a tiktoken BPE file.

All three expose the same small interface (`Tokenizer`): `encode(text) -> int32[n]`, `decode(ids)`,
`vocab_size` (one past the largest id it can produce), `eos_id` (or None) and `token_bytes()` (the bytes
of text each id stands for: what bits per byte divide by). `load_tokenizer(spec)`
picks one from a config string: `byte`, a path ending in `.json` (HF `tokenizers`), or any other path
(a tiktoken BPE file: one `base64(token) rank` pair per line). A file that does not load is a
`TokenizerError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Protocol

import numpy as np

from composer_jax.data.errors import DataError


class TokenizerError(DataError):
    """A tokenizer spec or file cannot be used; the message names the file."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: lossless for any text, no vocabulary file, no EOS id."""

    name = "byte"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        """str -> int32[num_bytes]."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """int32[vocab_size]: the bytes of text each id stands for (one)."""
        return np.ones(self.vocab_size, np.int32)


def _byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level BPE maps each byte 0..255 to (its `bytes_to_unicode`)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def byte_tokenizer_json() -> str:
    """A Hugging Face tokenizer.json whose ids are the UTF-8 bytes, 0..255: what `ByteTokenizer` encodes,
    for transformers' AutoTokenizer (an export of a byte-level model)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    tok = _Tok(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (no special tokens added on encode)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise TokenizerError(f"{path}: loading a tokenizer.json needs the `tokenizers` package") from e
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"tokenizer file {path} does not load as a Hugging Face tokenizer.json: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = _find_eos(self._tok.token_to_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """int32[vocab_size]: the UTF-8 bytes of text each id stands for; 0 for added (special) tokens. A
        byte-level BPE piece has one character per byte (GPT-2's map); another piece counts what it decodes to."""
        byte_chars = set(_byte_chars())
        special = set(self._tok.get_added_tokens_decoder())
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            piece = None if i in special else self._tok.id_to_token(i)
            if piece is not None:
                out[i] = len(piece) if set(piece) <= byte_chars else len(self._tok.decode([i]).encode("utf-8"))
        return out


# tiktoken needs a pre-tokenization regex next to the ranks; this is cl100k_base's, which also suits code.
TIKTOKEN_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                    r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "[EOS]")


def _find_eos(token_to_id) -> int | None:
    for name in EOS_NAMES:
        if (i := token_to_id(name)) is not None:
            return int(i)
    return None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64(token) rank` per line) into {token bytes: rank}."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"tokenizer file {path} cannot be read: {e.strerror or e}") from None
    ranks = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, base64.binascii.Error):
            raise TokenizerError(f"tokenizer file {path} is neither a tokenizer.json nor a tiktoken BPE file: "
                                 f"line {n} is not `base64-token rank`: {line[:60]!r}") from None
    if not ranks:
        raise TokenizerError(f"tokenizer file {path} holds no tokens")
    return ranks


# Kimi K2's pre-tokenization regex (moonshotai's tokenization_kimi.py), used with its tiktoken.model.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])


def _token_name(value) -> str | None:
    """A token named in tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class TiktokenTokenizer:
    """A tiktoken BPE file. With a tokenizer_config.json beside it (a Hugging Face checkpoint's, e.g. Kimi
    K2's), its `added_tokens_decoder` are the special tokens, one id each also where they appear in text,
    its `eos_token` the EOS, and Kimi's tokenizer gets Kimi's pre-tokenization. A bare file gets
    `<|endoftext|>` right after the ranks (the EOS) and the cl100k_base pre-tokenization."""

    def __init__(self, path: Path):
        import tiktoken

        ranks = read_tiktoken_ranks(path)
        config = _read_tokenizer_config(path.parent / "tokenizer_config.json")
        specials = {_token_name(t): int(i) for i, t in (config.get("added_tokens_decoder") or {}).items()
                    if int(i) >= len(ranks) and _token_name(t)}
        eos_name = _token_name(config.get("eos_token"))
        if not specials:
            specials, eos_name = {"<|endoftext|>": max(ranks.values()) + 1}, "<|endoftext|>"
        kimi = "tokenization_kimi" in json.dumps(config.get("auto_map") or {})
        try:
            self._enc = tiktoken.Encoding(name=path.stem, pat_str=KIMI_PATTERN if kimi else TIKTOKEN_PATTERN,
                                          mergeable_ranks=ranks, special_tokens=specials)
        except Exception as e:
            raise TokenizerError(f"tokenizer file {path} does not load as a tiktoken BPE file: {e}") from None
        self._specials, self._ranks = set(specials), ranks
        self.name, self.vocab_size = str(path), max(specials.values()) + 1
        self.eos_id = specials.get(eos_name)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode(text, allowed_special=self._specials, disallowed_special=()), np.int32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """int32[vocab_size]: the bytes of each id's token; 0 for special tokens (and unused ids)."""
        out = np.zeros(self.vocab_size, np.int32)
        for token, rank in self._ranks.items():
            out[rank] = len(token)
        return out


def padded_token_bytes(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """int32[vocab_size]: `tokenizer.token_bytes()` over a model's vocabulary (its ids past the tokenizer's: 0)."""
    out = np.zeros(vocab_size, np.int32)
    own = tokenizer.token_bytes()[:vocab_size]
    out[:len(own)] = own
    return out


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, a tokenizer.json path, or a tiktoken BPE file path -> a Tokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise TokenizerError(f"tokenizer file {path} does not exist (use 'byte', a tokenizer.json or a "
                             "tiktoken BPE file)")
    if path.is_dir():
        found = [path / name for name in ("tokenizer.json", "tiktoken.model") if (path / name).is_file()]
        if not found:
            raise TokenizerError(f"tokenizer path {path} is a directory without a tokenizer.json or tiktoken.model")
        path = found[0]
    if path.suffix == ".json":
        try:  # a clearer message for JSON that is not a tokenizer at all
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"tokenizer file {path} is not valid JSON: {e}") from None
        return HFTokenizer(path)
    return TiktokenTokenizer(path)
