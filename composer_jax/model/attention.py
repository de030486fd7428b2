"""Multi-head latent attention (MLA), training / prefill path.

Follows transformers' `DeepseekV3Attention` (shared/reference/kimi_arch.md section 2.2): low-rank
queries through `c_q`, keys and values decompressed from the latent `c_kv`, a decoupled rope key shared
by all heads, and the mscale-adjusted softmax scale. Scores and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model import rope as rope_lib
from composer_jax.model.layers import RMSNorm, param


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[batch, q, k]: causal and within one packed document. segment_ids: int[batch, seq]."""
    seq = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_doc


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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array):
        """x: [batch, seq, embed]; cos, sin: f32[batch, seq, rope/2]; mask: bool[batch, seq, seq].

        Returns the output [batch, seq, embed] and each head's largest scaled attention logit f32[heads]
        (tracked for QK-clip).
        """
        mla, dt = self.cfg, self.dtype
        x = x.astype(dt)
        c_q = self.q_a_norm(x @ self.q_a_proj[...].astype(dt))                         # [b, s, r_q]
        q = jnp.einsum("bsr,rhk->bshk", c_q, self.q_b_proj[...].astype(dt))           # [b, s, h, nope+rope]
        q_nope, q_rope = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        kv_a = x @ self.kv_a_proj[...].astype(dt)                                      # [b, s, r_kv+rope]
        c_kv, k_rope = kv_a[..., : mla.kv_lora_rank], kv_a[..., mla.kv_lora_rank:]
        kv = jnp.einsum("bsr,rhk->bshk", self.kv_a_norm(c_kv), self.kv_b_proj[...].astype(dt))
        k_nope, v = kv[..., : mla.qk_nope_head_dim], kv[..., mla.qk_nope_head_dim:]  # [b, s, h, *]
        q_rope = rope_lib.apply_rope(q_rope, cos, sin)
        k_rope = rope_lib.apply_rope(k_rope[:, :, None, :], cos, sin)[:, :, 0]        # one head, shared

        f32 = jnp.float32
        scores = jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=f32)
        scores += jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=f32)
        scores = jnp.where(mask[:, None], scores * self.scale, jnp.finfo(f32).min)
        max_logits = jax.lax.stop_gradient(scores.max(axis=(0, 2, 3)))                 # [h]
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)                                 # [b, s, h, v]
        return jnp.einsum("bqhd,hde->bqe", out, self.o_proj[...].astype(dt)), max_logits
