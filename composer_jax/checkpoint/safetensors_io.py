"""A dependency-light safetensors reader over a directory of shards.

Reads the format directly (8-byte header length, JSON header, raw little-endian data) through
`numpy.memmap`, so every dtype a checkpoint may hold (bf16, fp8 e4m3/e5m2, ints) comes back as a numpy
array via ml_dtypes, one tensor at a time, without loading whole shards. Corrupt or truncated files
raise errors naming the file and tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


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
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise CheckpointError(f"{file}: tensor '{key}' has unsupported dtype {info.get('dtype')!r}")
        start, end = (8 + n + int(o) for o in info["data_offsets"])
        shape = tuple(int(s) for s in info["shape"])
        dtype = np.dtype(DTYPES[info["dtype"]])
        if end > size:
            raise CheckpointError(f"{file}: truncated: tensor '{key}' needs bytes up to {end}, file has {size}")
        if end - start != dtype.itemsize * int(np.prod(shape)):
            raise CheckpointError(f"{file}: tensor '{key}' byte range does not match shape {list(shape)}")
        entries[key] = _Entry(file, dtype, shape, start, end)
    return entries


class SafetensorsDir:
    """All tensors of a checkpoint directory (`*.safetensors`, with or without an index file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
            missing = sorted(name for name in listed if not (self.path / name).is_file())
            if missing:
                raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
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

    def read(self, key: str) -> np.ndarray:
        """The tensor `key` as a numpy array (a copy; the shard is memory-mapped, not loaded)."""
        e = self._entries[key]
        count = (e.end - e.start) // e.dtype.itemsize
        data = np.memmap(e.file, dtype=e.dtype, mode="r", offset=e.start, shape=(count,))
        return np.array(data).reshape(e.shape)
