"""Multi-head latent attention (MLA), training / prefill path.

Follows transformers' `DeepseekV3Attention` (shared/reference/kimi_arch.md section 2.2): low-rank
queries through `c_q`, keys and values decompressed from the latent `c_kv`, a decoupled rope key shared
by all heads, and the mscale-adjusted softmax scale. Scores and softmax run in float32.

Context parallelism: with the sequence sharded on the dense mesh's `cp` axis, each device keeps its
queries and all-gathers only the compressed latent (normalised `c_kv` plus the shared rope key:
kv_lora + rope values per token, 576 at full size, instead of full per-head K and V), then
decompresses keys and values for the whole sequence locally.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model import rope as rope_lib
from composer_jax.model.layers import RMSNorm, param, weight
from composer_jax.parallel.partitioning import gather_sequence


class LatentCache(NamedTuple):
    """The MLA latent that keys and values are decompressed from, per layer: what a decode cache holds
    and what a prefix passes to a later forward.

    c_kv: [layers, batch, len, kv_lora] (normalised); k_rope: [layers, batch, len, rope] (rotated at
    the tokens' positions); valid: bool[batch, len] (False marks padding slots).
    """

    c_kv: jax.Array
    k_rope: jax.Array
    valid: jax.Array


def attention_mask(segment_q: jax.Array, segment_k: jax.Array, order_q: jax.Array, order_k: jax.Array):
    """bool[batch, q, k]: causal and within one packed document.

    segment_q, order_q: int[batch, q]; segment_k, order_k: int[batch, k]. The orders are the tokens'
    indices in the original sequence (an arange, or a context-parallel chunk order).
    """
    causal = order_k[:, None, :] <= order_q[:, :, None]
    return causal & (segment_q[:, :, None] == segment_k[:, None, :])


def load_balanced_order(seq: int, cp: int) -> np.ndarray:
    """int[seq]: the causal load-balanced sequence order for `cp` context-parallel shards.

    The sequence is cut into 2*cp chunks; shard i holds chunks i and 2*cp-1-i, so every shard gets
    the same amount of causal attention work (early chunks are cheap, late ones expensive).
    """
    if seq % (2 * cp):
        raise ValueError(f"context parallelism cp={cp} needs a sequence length divisible by {2 * cp}, got {seq}")
    chunks = np.arange(seq).reshape(2 * cp, seq // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


class MLA(nnx.Module):
    """x: [batch, seq, embed] -> [batch, seq, embed]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        mla, d, pd = cfg.mla, cfg.hidden_size, cfg.param_dtype
        self.cfg = mla
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = rope_lib.softmax_scale(mla, cfg.rope)
        h = mla.num_heads
        self.q_a_proj = param(rngs, (d, mla.q_lora_rank), ("embed", "q_lora"), pd,
                              reduction=("embed",), output=("q_lora",))
        self.q_a_norm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps, "q_lora", pd, rngs=rngs)
        # Per-head projections keep the head axis separate: Muon orthogonalizes each head's matrix.
        self.q_b_proj = param(rngs, (mla.q_lora_rank, h, mla.qk_head_dim), ("q_lora", "heads", "qk_head"), pd,
                              reduction=("q_lora",), output=("qk_head",))
        kv_a_out = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv_a_proj = param(rngs, (d, kv_a_out), ("embed", "kv_lora_rope"), pd,
                               reduction=("embed",), output=("kv_lora_rope",))
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps, "kv_lora", pd, rngs=rngs)
        self.kv_b_proj = param(rngs, (mla.kv_lora_rank, h, mla.qk_nope_head_dim + mla.v_head_dim),
                               ("kv_lora", "heads", "kv_head"), pd, reduction=("kv_lora",), output=("kv_head",))
        self.o_proj = param(rngs, (h, mla.v_head_dim, d), ("heads", "v_head", "embed"), pd,
                            reduction=("v_head",), output=("embed",))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, prefix=None):
        """x: [batch, seq, embed]; cos, sin: f32[batch, seq, rope/2]; mask: bool[batch, seq, prefix + seq_k]
        (seq_k: the whole sequence; seq: this device's queries under context parallelism); prefix:
        optional (c_kv [batch, prefix, kv_lora], k_rope [batch, prefix, rope]) of earlier tokens that
        every query may attend to (their mask columns come first).

        Returns the output [batch, seq, embed], each head's largest scaled attention logit f32[heads]
        (tracked for QK-clip) and this layer's latent (c_kv, k_rope) of the input tokens.
        """
        mla, dt = self.cfg, self.dtype
        x = x.astype(dt)
        c_q = self.q_a_norm(x @ weight(self.q_a_proj, dt))                             # [b, s, r_q]
        q = jnp.einsum("bsr,rhk->bshk", c_q, weight(self.q_b_proj, dt))               # [b, s, h, nope+rope]
        q_nope, q_rope = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        q_rope = rope_lib.apply_rope(q_rope, cos, sin)
        kv_a = x @ weight(self.kv_a_proj, dt)                                          # [b, s, r_kv+rope]
        c_kv = self.kv_a_norm(kv_a[..., : mla.kv_lora_rank])
        k_rope = rope_lib.apply_rope(kv_a[:, :, None, mla.kv_lora_rank:], cos, sin)[:, :, 0]  # one shared head
        latent = (c_kv, k_rope)
        c_kv, k_rope = gather_sequence(c_kv), gather_sequence(k_rope)                 # keys: whole sequence
        if prefix is not None:
            c_kv = jnp.concatenate([prefix[0].astype(dt), c_kv], axis=1)
            k_rope = jnp.concatenate([prefix[1].astype(dt), k_rope], axis=1)
        kv = jnp.einsum("bsr,rhk->bshk", c_kv, weight(self.kv_b_proj, dt))
        k_nope, v = kv[..., : mla.qk_nope_head_dim], kv[..., mla.qk_nope_head_dim:]  # [b, s_k, h, *]

        f32 = jnp.float32
        scores = jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=f32)
        scores += jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=f32)
        scores = jnp.where(mask[:, None], scores * self.scale, jnp.finfo(f32).min)
        max_logits = jax.lax.stop_gradient(scores.max(axis=(0, 2, 3)))                 # [h]
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)                                 # [b, s, h, v]
        return jnp.einsum("bqhd,hde->bqe", out, weight(self.o_proj, dt)), max_logits, latent
