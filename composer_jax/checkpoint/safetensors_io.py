"""Dependency-light safetensors reading and streaming writing over directories of shards.

The format: an 8-byte little-endian header length, a JSON header `{key: {dtype, shape, data_offsets}}`,
then raw little-endian tensor data. Reading goes through plain `pread`s into numpy buffers, a whole
tensor or a range of its rows (dim 0) at a time, so every dtype a checkpoint may hold (bf16, fp8
e4m3/e5m2, ints) comes back via ml_dtypes without mapping or loading whole shards. Writing lays out a
shard's header first and then fills tensors (or row ranges of them) at their offsets from any thread,
so a shard never has to be held in memory. Corrupt or truncated files raise errors naming the file
and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not match the model."""


class _Entry:
    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: Path, dtype, shape, start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def _read_header(file: Path) -> dict[str, _Entry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors header ({n} header bytes, "
                                  f"file has {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            start, end = (8 + n + int(o) for o in offsets)
            shape = tuple(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor '{key}'") from None
        if code not in DTYPES:
            raise CheckpointError(f"{file}: tensor '{key}' has unsupported dtype {code!r}")
        dtype = np.dtype(DTYPES[code])
        if end > size:
            raise CheckpointError(f"{file}: truncated: tensor '{key}' needs bytes up to {end}, file has {size}")
        if end - start != dtype.itemsize * math.prod(shape):
            raise CheckpointError(f"{file}: tensor '{key}' byte range does not match shape {list(shape)}")
        entries[key] = _Entry(file, dtype, shape, start, end)
    return entries


def _pread_into(file: Path, offset: int, buf: np.ndarray, what: str) -> None:
    view = memoryview(buf.reshape(-1).view(np.uint8))
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{file}: truncated while reading {what} ({done} of {len(view)} bytes)")
            done += n


class SafetensorsDir:
    """All tensors of a checkpoint directory (`*.safetensors`, with or without an index file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
            except (json.JSONDecodeError, AttributeError) as e:
                raise CheckpointError(f"{index}: corrupt index: {e}") from None
            missing = sorted(name for name in listed if not (self.path / name).is_file())
            if missing:
                raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        self.files = files
        self._entries: dict[str, _Entry] = {}
        for file in files:
            for key, entry in _read_header(file).items():
                if key in self._entries:
                    raise CheckpointError(f"tensor '{key}' appears in both {self._entries[key].file.name} "
                                          f"and {file.name}")
                self._entries[key] = entry

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key].dtype

    def file(self, key: str) -> Path:
        return self._entries[key].file

    def nbytes(self, key: str, rows: tuple[int, int] | None = None) -> int:
        e = self._entries[key]
        if rows is None:
            return e.end - e.start
        return (rows[1] - rows[0]) * (e.end - e.start) // max(e.shape[0], 1)

    def read(self, key: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `key` (or its rows `[r0, r1)` along dim 0) as a fresh numpy array."""
        e = self._entries[key]
        if rows is None:
            shape, offset = e.shape, e.start
        else:
            r0, r1 = rows
            if not (e.shape and 0 <= r0 <= r1 <= e.shape[0]):
                raise IndexError(f"rows {rows} out of range for tensor '{key}' of shape {list(e.shape)}")
            row_bytes = e.dtype.itemsize * math.prod(e.shape[1:])
            shape, offset = (r1 - r0,) + e.shape[1:], e.start + r0 * row_bytes
        out = np.empty(shape, e.dtype)
        _pread_into(e.file, offset, out, f"tensor '{key}'")
        return out


class SafetensorsWriter:
    """One safetensors shard written in place: header at creation, tensor data at any time, any order.

    `tensors`: [(key, numpy dtype, shape)] in file order. Reopening an existing file with the same
    layout (a resumed job) keeps the data already written. Writes from several threads are safe.
    """

    def __init__(self, path: str | Path, tensors, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, offset, self.offsets = {}, 0, {}
        if metadata:
            header["__metadata__"] = metadata
        for key, dtype, shape in tensors:
            dtype, size = np.dtype(dtype), np.dtype(dtype).itemsize * math.prod(shape)
            header[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.offsets[key] = (offset, dtype, tuple(shape))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self._prefix = struct.pack("<Q", len(raw)) + raw
        self.size = len(self._prefix) + offset
        reuse = (self.path.is_file() and self.path.stat().st_size == self.size
                 and self.path.read_bytes()[: len(self._prefix)] == self._prefix)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT)
        if not reuse:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, self._prefix, 0)
            os.ftruncate(self._fd, self.size)  # sparse: unwritten data costs no disk until filled

    def write(self, key: str, array: np.ndarray, row0: int = 0) -> None:
        """Write `array` as tensor `key`, or as its rows starting at `row0`."""
        offset, dtype, shape = self.offsets[key]
        if array.dtype != dtype or array.shape[1:] != shape[1:] or row0 + (array.shape[0] if shape else 1) > (
                shape[0] if shape else 1):
            raise ValueError(f"{self.path.name}: cannot write {array.dtype}{list(array.shape)} at row {row0} of "
                             f"tensor '{key}' ({dtype}{list(shape)})")
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        pos = len(self._prefix) + offset + row0 * dtype.itemsize * math.prod(shape[1:])
        while len(data):
            n = os.pwrite(self._fd, data, pos)
            data, pos = data[n:], pos + n

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


def group_shards(sizes, max_bytes: int) -> list[list]:
    """[(item, nbytes)] in file order -> consecutive groups of at most `max_bytes` (an item larger than
    that gets a shard of its own), as Hugging Face shards a checkpoint."""
    shards, size = [[]], 0
    for item, nbytes in sizes:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    (Path(directory) / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_size},
                                                          "weight_map": weight_map}, indent=2))
