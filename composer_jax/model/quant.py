"""Quantization-aware training of the routed experts (`model.moe.expert_quant: int4`): each expert matrix
passes through Kimi K2.5's INT4 quantizer and back in every forward, so training, RL and decoding all run
the policy an INT4 engine serves.

The quantizer is `checkpoint.quant.quantize_int4` (compressed-tensors' symmetric groups of 32 inputs:
scale = max |w| / 7.5 rounded to bfloat16, q = clip(round(w / scale), -8, 7)) followed by `dequant_int4`,
written here in jnp with the same float32 operations, so the values are bit for bit those of a checkpoint
quantized and read back. The gradient passes straight through (the straight-through estimator of
quantization-aware training): d(fake_quant(w))/dw = identity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.config import INT4_GROUP, INT4_MAX_ABS


def _split_sharding(w: jax.Array, axis: int, groups: int):
    """The out_sharding of `w` reshaped with dimension `axis` split in (groups, group): the groups keep
    the dimension's mesh axes where each shard holds whole groups, else the dimension is gathered (None
    where `w` carries no explicit sharding)."""
    sharding = jax.typeof(w).sharding
    if sharding is None or sharding.mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],) if spec[axis] else ()
    shards = math.prod(sharding.mesh.shape[name] for name in names)
    return P(*spec[:axis], spec[axis] if groups % shards == 0 else None, None, *spec[axis + 1:])


def fake_quant_int4(w: jax.Array, group: int = INT4_GROUP) -> jax.Array:
    """w: [..., in, out] (an expert matrix, inputs on the second-to-last axis) -> the same shape and dtype:
    INT4-quantized in groups of `group` inputs and dequantized (float32 math); straight-through gradient."""
    axis, n = w.ndim - 2, w.shape[-2]
    if n % group:
        raise ValueError(f"INT4 expert quantization: {n} inputs are not a multiple of the group size {group}")
    wf = w.astype(jnp.float32)
    split = w.shape[:axis] + (n // group, group) + w.shape[axis + 1:]
    grouped = jnp.reshape(wf, split, out_sharding=_split_sharding(w, axis, n // group))
    amax = jnp.max(jnp.abs(grouped), axis=axis + 1, keepdims=True)
    scale = jnp.maximum(amax / jnp.float32(INT4_MAX_ABS), jnp.finfo(jnp.float32).eps)
    scale = scale.astype(jnp.bfloat16).astype(jnp.float32)
    q = jnp.clip(jnp.round(grouped / scale), -8, 7)
    quantized = jnp.reshape(q * scale, w.shape, out_sharding=jax.typeof(w).sharding).astype(w.dtype)
    # quantized + (w - w): the quantized values exactly, and the gradient of w.
    return jax.lax.stop_gradient(quantized) + (w - jax.lax.stop_gradient(w))
