"""The grain pipeline: source -> held-out split -> per-process shard -> shuffle/repeat -> tokenize ->
pack into fixed-length rows -> batch.

Rows (each a dict of `[seq_len]` arrays, batched to `[batch, seq_len]`):
- `tokens` int32: token ids, 0 in padding;
- `segment_ids` int32: 1, 2, ... per packed document within a row, 0 in padding;
- `positions` int32: position within the document, restarting at 0 with each segment;
- `loss_mask` int32: 1 where the token is a training *target* (every document token for text,
  assistant tokens for chat), 0 in padding.

Text documents are concatenated then split into rows: no padding, and a document longer than a row
continues as a new segment of the next row. Conversations are truncated to `seq_len` (counted) and
packed next-fit, never split (composer_jax.data.packing). Iteration is deterministic;
`iterator.get_state()` / `set_state()` resume it exactly (the state is a small JSON-able dict saved in
checkpoints).
"""

from __future__ import annotations

import collections
import dataclasses

import grain
import numpy as np

from composer_jax.data import chat, code_conversations
from composer_jax.data.config import DataConfig
from composer_jax.data.errors import DataError
from composer_jax.data.packing import PackIterDataset
from composer_jax.data.sources import (DEFAULT_GLOBS, ArrayRecordSource, JsonlSource, ParquetSource, SkipLog,
                                       TextTreeSource, resolve_root, split_indices)
from composer_jax.data.tokenizer import Tokenizer

FEATURES = ("tokens", "segment_ids", "positions", "loss_mask")
PROBE_RECORDS = 64  # records checked at build time: a pipeline that yields nothing fails fast, by name


def make_source(cfg: DataConfig, skips: SkipLog):
    """The random-access source for `cfg.kind`."""
    pattern, exclude = cfg.glob or DEFAULT_GLOBS[cfg.kind], cfg.exclude_parts
    if cfg.kind in ("text_tree", "python_functions"):
        return TextTreeSource(cfg.path, pattern, exclude, cfg.max_file_bytes, skips)
    if cfg.kind == "jsonl":
        return JsonlSource(cfg.path, pattern, exclude, skips)
    if cfg.kind == "parquet":
        return ParquetSource(cfg.path, pattern, exclude, (cfg.record_field,))
    return ArrayRecordSource(cfg.path, pattern, exclude, parse_json=cfg.format == "chat" or bool(cfg.field),
                             skips=skips)


class _Subset:
    """A random-access view of `source` at `indices` (the split), keeping keys for messages."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.source[int(self.indices[i])]


@dataclasses.dataclass(frozen=True)
class Example:
    """record -> {"tokens": int32[n], "loss_mask": int32[n]} or None (counted skip). Picklable."""

    cfg: DataConfig
    tokenizer: Tokenizer
    seq_len: int
    skips: SkipLog
    fmt: chat.ChatFormat = chat.PlainChat()     # how conversations render (the run's chat format)

    def __call__(self, record: dict):
        cfg, field = self.cfg, self.cfg.record_field
        where = record.get("path", f"record with keys {sorted(record)[:5]}")
        if cfg.kind == "python_functions":
            value = code_conversations.python_function_conversations(record["text"], record["path"], max_chars=self.seq_len)
            if value is None:
                return self.skips.skip("no_function", where)
        elif field not in record:
            return self.skips.skip(f"missing_field_{field}", where)
        else:
            value = record[field]
        if cfg.format == "chat":
            try:
                tools = record.get("tools") or ()      # declared tools, as chat datasets carry them
                if not isinstance(tools, list | tuple) or not all(isinstance(t, dict) for t in tools):
                    raise chat.ConversationError("'tools' must be a list of function schemas")
                tokens, mask = chat.tokenize_conversation(value, self.tokenizer.encode, self.fmt, tools)
            except chat.ConversationError as e:
                return self.skips.skip("bad_conversation", f"{where} ({e})")
            if len(tokens) > self.seq_len:
                self.skips.keep_truncated(f"{where} ({len(tokens)} tokens > seq_len {self.seq_len})")
                tokens, mask = tokens[: self.seq_len], mask[: self.seq_len]
            if not mask[1:].any():  # the first token is never a target
                return self.skips.skip("no_target_tokens", where)
        else:
            if not isinstance(value, str):
                return self.skips.skip("not_text", f"{where} (field {field!r} is {type(value).__name__})")
            tokens = self.tokenizer.encode(value)
            if cfg.append_eos:
                tokens = np.append(tokens, np.int32(self.tokenizer.eos_id))
            if len(tokens) < 2:
                return self.skips.skip("empty", where)
            mask = np.ones_like(tokens)
        return {"tokens": tokens.astype(np.int32), "loss_mask": mask.astype(np.int32)}


def _probe(subset: _Subset, example: Example, cfg: DataConfig, split: str) -> None:
    """Fail fast, by path, when the first records of a split all fail to yield an example. Probing
    neither logs nor counts skips (the pipeline reads these records again)."""
    skips = example.skips
    before, truncated = collections.Counter(skips.counts), skips.truncated
    skips.muted = True
    try:
        n = min(len(subset), PROBE_RECORDS)
        for i in range(n):
            record = subset[i]
            if record is not None and example(record) is not None:
                return
        reasons = ", ".join(f"{k} x{v}" for k, v in (skips.counts - before).items())
    finally:
        skips.counts, skips.truncated, skips.muted = before, truncated, False
    raise DataError(f"data path {resolve_root(cfg.path)}: none of the first {n} {split} records is usable "
                    f"({reasons or 'no records'}); check data.kind={cfg.kind!r}, data.field, data.format")


def build_dataset(cfg: DataConfig, tokenizer: Tokenizer, *, split: str, seq_len: int, batch_size: int,
                  repeat: bool, shard_index: int = 0, shard_count: int = 1, skips: SkipLog | None = None,
                  fmt: chat.ChatFormat | None = None) -> grain.IterDataset:
    """The batched grain IterDataset of `split` ('train' or 'eval'), rows of `seq_len` tokens.

    Yields dicts of FEATURES arrays shaped [batch_size, seq_len]; conversations render in `fmt` (default
    plain: composer_jax.data.chat). `repeat`: loop over epochs forever
    (each epoch reshuffled); otherwise one pass, dropping the last partial batch. Each of
    `shard_count` processes reads the disjoint shard `shard_index` of the split.
    """
    skips = skips if skips is not None else SkipLog()
    if cfg.append_eos and tokenizer.eos_id is None:
        raise DataError(f"data.append_eos is set but tokenizer {tokenizer.name!r} has no EOS token")
    source = make_source(cfg, skips)
    indices = split_indices(source.keys(), split, cfg.eval_fraction)
    if len(indices) < shard_count:
        raise DataError(f"the {split} split of data path {resolve_root(cfg.path)} has {len(indices)} records, "
                        f"fewer than the {shard_count} data shards (data.eval_fraction={cfg.eval_fraction})")
    subset = _Subset(source, indices)
    example = Example(cfg, tokenizer, seq_len, skips, fmt or chat.PlainChat())  # sharing `skips` with the source
    _probe(subset, example, cfg, split)
    ds = grain.MapDataset.source(subset)[shard_index::shard_count]
    if cfg.shuffle and split == "train":
        ds = ds.shuffle(seed=cfg.seed)
    if repeat:
        ds = ds.repeat(None)
    ds = ds.map(example).to_iter_dataset(
        grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch))
    return PackIterDataset(ds, seq_len, split=cfg.format != "chat").batch(batch_size, drop_remainder=True)
