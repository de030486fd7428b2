"""YaRN rotary embeddings for MLA's decoupled rope dims, and the mscale-adjusted softmax scale.

Math follows transformers' `_compute_yarn_parameters` and DeepSeek-V3's `precompute_freqs_cis`
(shared/reference/kimi_arch.md section 2.2). YaRN is always on (as in HF) when `factor > 1`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from composer_jax.config import MLAConfig, RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term `0.1 * mscale * ln(factor) + 1` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rotary dim index whose wavelength completes `num_rotations` turns over `max_pos` tokens."""
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_bounds(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """(low, high) pair indices of the YaRN ramp: below `low` frequencies are kept, above `high` divided."""
    low = math.floor(_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position_embeddings))
    high = math.ceil(_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """float32[dim // 2]: per-pair inverse frequencies, YaRN-interpolated when factor > 1."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base = np.float32(rope.theta) ** exponent  # float32 like HF, so angles match it bit for bit
    extrapolated = 1.0 / base
    if rope.factor <= 1:
        return extrapolated.astype(np.float32)
    interpolated = 1.0 / (np.float32(rope.factor) * base)
    low, high = yarn_ramp_bounds(rope, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp  # 1: original frequency, 0: frequency / factor
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def attention_factor(rope: RopeConfig) -> float:
    """Multiplier HF applies to cos/sin (1.0 for Kimi and DeepSeek-V3, where mscale == mscale_all_dim)."""
    if rope.factor <= 1:
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (0.1446796 for K2.5)."""
    scale = mla.qk_head_dim ** -0.5
    if rope.factor > 1 and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rope_angles(rope: RopeConfig, dim: int, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin: float32[*positions.shape, dim // 2] for integer `positions`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(rope, dim))
    scale = attention_factor(rope)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim; output in "concatenated" layout.

    x: [batch, seq, heads, dim]; cos, sin: [batch, seq, dim // 2]. The output puts the rotated even
    members first and the odd members second, as HF does: attention scores are unchanged because q
    and k are permuted the same way.
    """
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    even, odd = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.astype(x.dtype)
