"""Quantized checkpoint formats and a dequantizing, row-streaming view of a checkpoint's tensors.

Formats (shared/reference/kimi_arch.md section 3):
- Kimi K2.5 INT4, compressed-tensors `pack-quantized` (symmetric, groups along the input dim):
  `X.weight_packed` int32[out, ceil(in/8)] holds inputs 8j..8j+7 of column j, low nibble first;
  `X.weight_scale` [out, ceil(in/group)]; `X.weight_shape` int32[2] = [out, in].
  W[o, i] = (nibble(o, i) - 8) * scale[o, i // group], in float32.
- DeepSeek-V3 / Kimi K2 FP8 blocks: `X.weight` float8_e4m3fn[out, in] with `X.weight_scale_inv`
  f32[ceil(out/bo), ceil(in/bi)] (blocks `weight_block_size` = [bo, bi], 128x128):
  W[o, i] = float32(w[o, i]) * scale_inv[o // bo, i // bi].
`quantize_int4` is the INT4 quantizer (compressed-tensors' symmetric groups), the inverse `dequant_int4` reads.
`TensorReader` presents every `X.weight` as one logical tensor whatever its storage, and reads any range
of its rows (output features): plain tensors keep their dtype, quantized ones come back as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from composer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from composer_jax.config import INT4_MAX_ABS

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
INT4_PARTS = ("_packed", "_scale", "_shape")  # suffixes on `X.weight`
FP8_SCALE = "_scale_inv"


@dataclass(frozen=True)
class QuantConfig:
    """`method`: None (unquantized), 'int4' (compressed-tensors pack-quantized) or 'fp8' (blocks)."""

    method: str | None = None
    group_size: int = 32          # int4: inputs per scale
    block: tuple[int, int] = (128, 128)  # fp8: [out, in] block of one scale

    @classmethod
    def from_hf(cls, hf: dict, where: str) -> "QuantConfig":
        """Parse `quantization_config` of a config.json (`where` names the file in errors)."""
        q = hf.get("quantization_config")
        if not q:
            return cls()

        def bad(key, value, why):
            return CheckpointError(f"{where}: quantization_config.{key}={value!r} is not supported: {why}")

        method = q.get("quant_method")
        if method == "compressed-tensors":
            if q.get("format") != "pack-quantized":
                raise bad("format", q.get("format"), "only 'pack-quantized' compressed-tensors is implemented")
            weights = [g["weights"] for g in (q.get("config_groups") or {}).values() if g.get("weights")]
            weights = weights or [q]  # a summarized form with num_bits / group_size at the top level
            if any(w != weights[0] for w in weights):
                raise bad("config_groups", q.get("config_groups"), "expected one weight quantization scheme")
            w = weights[0]
            for key, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group")):
                if key in w and w[key] != want:
                    raise bad(f"config_groups.*.weights.{key}", w[key], f"only {want!r} is implemented")
            group = w.get("group_size", 32)
            if not isinstance(group, int) or group <= 0:
                raise bad("group_size", group, "must be a positive integer")
            return cls("int4", group_size=group)
        if method == "fp8":
            if q.get("fmt", "e4m3") != "e4m3":
                raise bad("fmt", q.get("fmt"), "only e4m3 is implemented")
            block = q.get("weight_block_size")
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
                raise bad("weight_block_size", block, "block-scaled FP8 needs [out_block, in_block]")
            return cls("fp8", block=(int(block[0]), int(block[1])))
        raise bad("quant_method", method, "only 'compressed-tensors' (INT4) and 'fp8' (blocks) are implemented")


def _scale_columns(x: np.ndarray, scale: np.ndarray, width: int) -> np.ndarray:
    """In place: x[:, i] *= scale[:, i // width] (x: contiguous f32[rows, cols]); returns x."""
    rows, cols = x.shape
    scale = scale.astype(np.float32, copy=False)
    if cols % width == 0:
        x.reshape(rows, cols // width, width)[...] *= scale[:, : cols // width, None]
    else:
        for j in range(-(-cols // width)):
            x[:, j * width:(j + 1) * width] *= scale[:, j:j + 1]
    return x


def dequant_int4(packed: np.ndarray, scale: np.ndarray, in_features: int, group: int) -> np.ndarray:
    """int32[rows, ceil(in/8)] packed nibbles, scale [rows, ceil(in/group)] -> float32[rows, in]."""
    rows = packed.shape[0]
    b = np.ascontiguousarray(packed.astype("<i4", copy=False)).view(np.uint8)  # 4 bytes = 8 nibbles, LE
    q = np.stack([b & 0xF, b >> 4], axis=-1).reshape(rows, -1)[:, :in_features]  # low nibble first
    w = q.astype(np.float32)
    w -= 8.0
    return _scale_columns(w, scale, group)


def _int4_scales(w: np.ndarray, group: int) -> np.ndarray:
    """float32 [rows, in] -> bfloat16 [rows, ceil(in/group)]: max |w| of each group of `group` inputs / 7.5,
    at least float32's eps, rounded to bfloat16 as K2.5's `weight_scale` is stored."""
    rows, n = w.shape
    padded = np.zeros((rows, -(-n // group) * group), np.float32)
    padded[:, :n] = np.abs(w)
    amax = padded.reshape(rows, -1, group).max(axis=-1)
    return np.maximum(amax / np.float32(INT4_MAX_ABS), np.finfo(np.float32).eps).astype(ml_dtypes.bfloat16)


def quantize_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, in] -> (int32 [rows, ceil(in/8)] packed, bfloat16 [rows, ceil(in/group)] scale), the
    layout `dequant_int4` reads: q = clip(round-half-even(w / scale), -8, 7), stored as the nibble q + 8,
    inputs 8j..8j+7 in int32 column j, low nibble first."""
    w = np.asarray(w, np.float32)
    rows, n = w.shape
    scale = _int4_scales(w, group)
    per_input = np.repeat(scale.astype(np.float32), group, axis=1)[:, :n]
    q = np.clip(np.rint(w / per_input), -8, 7).astype(np.int64) + 8
    nibbles = np.zeros((rows, -(-n // 8) * 8), np.int64)
    nibbles[:, :n] = q
    packed = (nibbles.reshape(rows, -1, 8) << (4 * np.arange(8))).sum(axis=-1)   # < 2**32: no carries
    return packed.astype(np.uint32).view(np.int32), scale


def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, row0: int, block: tuple[int, int]) -> np.ndarray:
    """Rows `row0..` of an fp8 [rows, in] weight and the scale rows covering them -> float32[rows, in].

    `scale_inv[k]` is the scale row of block `row0 // bo + k`.
    """
    bo, bi = block
    rows = w.shape[0]
    s = scale_inv[np.arange(row0, row0 + rows) // bo - row0 // bo]  # [rows, ceil(in/bi)]
    return _scale_columns(w.astype(np.float32), s, bi)


class TensorReader:
    """Logical tensors of a checkpoint: each `X.weight` once, dequantized on read, in row ranges."""

    def __init__(self, st: SafetensorsDir, quant: QuantConfig):
        self.st, self.quant = st, quant
        self._kind: dict[str, str] = {}           # logical key -> 'plain' | 'int4' | 'fp8'
        self._shape: dict[str, tuple[int, ...]] = {}
        consumed = set()
        for key in st.keys():
            if key.endswith(".weight_packed"):
                stem = key[: -len("_packed")]
                self._add_int4(stem)
                consumed.update(stem + p for p in INT4_PARTS)
            elif st.dtype(key) in FP8_DTYPES and key + FP8_SCALE in st:
                self._add_fp8(key)
                consumed.add(key + FP8_SCALE)
        for key in st.keys():
            if key in self._kind or key in consumed:
                continue
            if st.dtype(key) in FP8_DTYPES:
                raise CheckpointError(f"{st.file(key)}: FP8 tensor '{key}' has no '{key}{FP8_SCALE}' block scales")
            if key.endswith(FP8_SCALE) or any(key.endswith(".weight" + p) for p in INT4_PARTS + ("_zero_point",)):
                raise CheckpointError(f"{st.file(key)}: quantization tensor '{key}' has no matching quantized weight")
            self._kind[key], self._shape[key] = "plain", st.shape(key)

    def _add_int4(self, stem: str) -> None:
        st = self.st
        missing = [stem + p for p in INT4_PARTS if stem + p not in st]
        if missing:
            raise CheckpointError(f"INT4 weight '{stem}' lacks tensor(s) {', '.join(repr(m) for m in missing)}")
        if stem + "_zero_point" in st:
            raise CheckpointError(f"INT4 weight '{stem}' is asymmetric (has '{stem}_zero_point'): not supported")
        if self.quant.method != "int4":
            raise CheckpointError(f"tensor '{stem}_packed' is INT4-packed but config.json has no compressed-tensors "
                                  "quantization_config (group size unknown)")
        packed, scale = st.shape(stem + "_packed"), st.shape(stem + "_scale")
        if st.shape(stem + "_shape") != (2,) or st.dtype(stem + "_packed") != np.int32:
            raise CheckpointError(f"INT4 weight '{stem}': expected int32 '{stem}_packed' and a 2-element '{stem}_shape'")
        out, inp = (int(v) for v in st.read(stem + "_shape"))
        g = self.quant.group_size
        for name, got, want in (("_packed", packed, (out, math.ceil(inp / 8))),
                                ("_scale", scale, (out, math.ceil(inp / g)))):
            if got != want:
                raise CheckpointError(f"tensor '{stem}{name}' has shape {list(got)}, expected {list(want)} for "
                                      f"weight_shape [{out}, {inp}] (group size {g})")
        self._kind[stem], self._shape[stem] = "int4", (out, inp)

    def _add_fp8(self, key: str) -> None:
        st, (bo, bi) = self.st, self.quant.block
        if self.quant.method != "fp8":
            raise CheckpointError(f"tensor '{key}' is FP8 with block scales but config.json has no fp8 "
                                  "quantization_config (block size unknown)")
        shape = st.shape(key)
        want = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi)) if len(shape) == 2 else None
        if st.shape(key + FP8_SCALE) != want:
            raise CheckpointError(f"tensor '{key}{FP8_SCALE}' has shape {list(st.shape(key + FP8_SCALE))}, expected "
                                  f"{list(want or ())} for weight {list(shape)} with blocks [{bo}, {bi}]")
        self._kind[key], self._shape[key] = "fp8", shape

    def keys(self) -> list[str]:
        return list(self._kind)

    def __contains__(self, key: str) -> bool:
        return key in self._kind

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def kind(self, key: str) -> str:
        return self._kind[key]

    def file(self, key: str):
        return self.st.file(key + "_packed" if self._kind[key] == "int4" else key)

    def nbytes(self, key: str, rows: tuple[int, int] | None = None) -> int:
        """Stored bytes behind `key` (or behind its rows), for progress reports."""
        kind, st = self._kind[key], self.st
        if kind == "int4":
            return sum(st.nbytes(key + p, rows) for p in ("_packed", "_scale"))
        return st.nbytes(key, rows)  # plain or fp8 (its block scales are negligible)

    def read(self, key: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `key` or its rows `[r0, r1)`: stored dtype if plain, float32 if dequantized."""
        kind, st = self._kind[key], self.st
        if kind == "plain":
            return st.read(key, rows)
        r0, r1 = rows if rows is not None else (0, self._shape[key][0])
        if kind == "int4":
            return dequant_int4(st.read(key + "_packed", (r0, r1)), st.read(key + "_scale", (r0, r1)),
                                self._shape[key][1], self.quant.group_size)
        bo = self.quant.block[0]
        scale = st.read(key + FP8_SCALE, (r0 // bo, -(-r1 // bo)))  # the block rows covering [r0, r1)
        return dequant_fp8(st.read(key, (r0, r1)), scale, r0, self.quant.block)
