"""Synthetic Hugging Face checkpoints of any size, written in bounded memory (benchmarks, smoke tests).

`write_synthetic_hf(path, cfg, fmt, params_of=model.abstract_params)` writes config.json, sharded
safetensors and an index for the parameters of `cfg`'s model with uniform random weights: all bf16, or
K2.5-style INT4 routed experts (random packed nibbles, bf16 group scales), or DeepSeek-style FP8 linear
weights with 128x128 block scales. Tensors are generated and written a row block at a time, so a
multi-GB checkpoint needs only a few MB of memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

from composer_jax.checkpoint.hf import ParamsOf, plan_leaves
from composer_jax.checkpoint.hf_config import hf_config_from
from composer_jax.checkpoint.safetensors_io import SafetensorsWriter, group_shards, shard_name, write_index
from composer_jax.config import ModelConfig

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
QUANT_CONFIGS = {
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}


def _tensors(cfg: ModelConfig, fmt: str, params_of: ParamsOf):
    """[(key, dtype, shape, kind)]: kind says how to fill it (normal / bias / packed / scale / shape)."""
    out = []
    for leaf in plan_leaves(params_of(cfg), cfg):
        for t in leaf.plan.flat:
            dtype = np.dtype(np.float32) if t.key.endswith("e_score_correction_bias") else BF16
            rows, cols = (t.hf_shape + (1,))[:2]
            if fmt == "int4" and ".mlp.experts." in t.key:
                stem = t.key
                out += [(stem + "_packed", np.dtype(np.int32), (rows, -(-cols // 8)), "packed"),
                        (stem + "_scale", BF16, (rows, -(-cols // 32)), "scale"),
                        (stem + "_shape", np.dtype(np.int32), (2,), ("shape", t.hf_shape))]
            elif fmt == "fp8" and t.linear_in and not t.key.endswith(("lm_head.weight", "mlp.gate.weight")):
                out += [(t.key, FP8, t.hf_shape, "normal"),
                        (t.key + "_scale_inv", np.dtype(np.float32), (-(-rows // 128), -(-cols // 128)), "scale")]
            else:
                out.append((t.key, dtype, t.hf_shape, "normal"))
    return out


def _fill(writer: SafetensorsWriter, key, dtype, shape, kind, rng, block_bytes: int) -> None:
    if isinstance(kind, tuple):  # weight_shape of an INT4 tensor
        writer.write(key, np.asarray(kind[1], np.int32))
        return
    row = dtype.itemsize * math.prod(shape[1:])
    step = max(1, block_bytes // row)
    for a in range(0, shape[0], step):
        block = (min(step, shape[0] - a),) + tuple(shape[1:])
        if kind == "packed":
            data = rng.integers(-2**31, 2**31, size=block, dtype=np.int64).astype(np.int32)
        elif kind == "scale":
            data = (0.001 + 0.01 * rng.random(block, dtype=np.float32)).astype(dtype)
        else:
            data = (rng.random(block, dtype=np.float32) - 0.5).astype(dtype)
        writer.write(key, data, a)


def write_synthetic_hf(path: str | Path, cfg: ModelConfig, fmt: str = "bf16", *, params_of: ParamsOf,
                       shard_bytes: int = 1 << 30, seed: int = 0, block_bytes: int = 16 << 20) -> int:
    """Write a random HF checkpoint of `cfg` in `fmt` ('bf16', 'int4' or 'fp8') to `path`; returns bytes.
    `params_of`: the parameter tree of a config (`composer_jax.model.abstract_params`)."""
    if fmt not in ("bf16", "int4", "fp8"):
        raise ValueError(f"fmt must be bf16, int4 or fp8, got {fmt!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = hf_config_from(cfg, "bfloat16")
    if fmt in QUANT_CONFIGS:
        hf["quantization_config"] = QUANT_CONFIGS[fmt]
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    tensors = _tensors(cfg, fmt, params_of)
    shards = group_shards([(t, t[1].itemsize * math.prod(t[2])) for t in tensors], shard_bytes)
    rng, total, weight_map = np.random.default_rng(seed), 0, {}
    for i, group in enumerate(shards):
        name = shard_name(i, len(shards))
        writer = SafetensorsWriter(path / name, [t[:3] for t in group], {"format": "pt"})
        for key, dtype, shape, kind in group:
            _fill(writer, key, dtype, shape, kind, rng, block_bytes)
            weight_map[key] = name
        writer.close()
        total += writer.size
    write_index(path, weight_map, total)
    return total
