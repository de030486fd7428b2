"""Multi-head latent attention (MLA), training / prefill path.

Follows transformers' `DeepseekV3Attention` (shared/reference/kimi_arch.md section 2.2): low-rank
queries through `c_q`, keys and values decompressed from the latent `c_kv`, a decoupled rope key shared
by all heads, and the mscale-adjusted softmax scale. Scores and softmax run in float32.

The attention itself (`attend`) runs by the implementation `model.attention` selects
(composer_jax.model.attention_ops: dense reference, memory-efficient blockwise, cuDNN), with the mask
given as per-token vectors (`AttentionMask`), never as a [batch, q, k] array outside a block.

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
from composer_jax.model import attention_ops
from composer_jax.model import rope as rope_lib
from composer_jax.model.attention_mask import AttentionMask
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
    """x: [batch, seq, embed] -> [batch, seq, embed], in three parts shared by both attention forms:
    `query` (q-LoRA projection, rope on the rope dims), `latent` (the normalised c_kv and rotated shared
    rope key: what a decode cache holds) and `attend` (decompressed keys and values: training and
    prefill) or `attend_absorbed` (kv_b_proj folded into the query and the output: decode)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        mla, d, pd = cfg.mla, cfg.hidden_size, cfg.param_dtype
        self.cfg = mla
        self.implementation = cfg.attention
        self.mesh = None  # the DualMesh the attention kernels run on (static; set by parallel.shard_model)
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

    def query(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [batch, seq, embed] -> (q_nope [batch, seq, heads, nope], q_rope [batch, seq, heads, rope])."""
        mla, dt = self.cfg, self.dtype
        c_q = self.q_a_norm(x.astype(dt) @ weight(self.q_a_proj, dt))                  # [b, s, r_q]
        q = jnp.einsum("bsr,rhk->bshk", c_q, weight(self.q_b_proj, dt))               # [b, s, h, nope+rope]
        return q[..., : mla.qk_nope_head_dim], rope_lib.apply_rope(q[..., mla.qk_nope_head_dim:], cos, sin)

    def latent(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [batch, seq, embed] -> (c_kv [batch, seq, kv_lora] normalised, k_rope [batch, seq, rope]
        rotated at the tokens' positions): all that keys and values are made of."""
        mla, dt = self.cfg, self.dtype
        kv_a = x.astype(dt) @ weight(self.kv_a_proj, dt)                               # [b, s, r_kv+rope]
        c_kv = self.kv_a_norm(kv_a[..., : mla.kv_lora_rank])
        k_rope = rope_lib.apply_rope(kv_a[:, :, None, mla.kv_lora_rank:], cos, sin)[:, :, 0]  # one shared head
        return c_kv, k_rope

    def attend(self, q: tuple[jax.Array, jax.Array], keys: tuple[jax.Array, jax.Array], mask: AttentionMask):
        """Attention with keys and values decompressed from the latent (training / prefill), by the
        implementation `model.attention` names (composer_jax.model.attention_ops).

        q: (q_nope, q_rope) of `query`; keys: (c_kv [batch, k, kv_lora], k_rope [batch, k, rope]) of every
        key; mask: which keys each query sees. Returns ([batch, q, embed], max_logits f32[heads]).
        """
        mla, dt = self.cfg, self.dtype
        (q_nope, q_rope), (c_kv, k_rope) = q, keys
        kv = jnp.einsum("bsr,rhk->bshk", c_kv.astype(dt), weight(self.kv_b_proj, dt))
        k_nope, v = kv[..., : mla.qk_nope_head_dim], kv[..., mla.qk_nope_head_dim:]  # [b, s_k, h, *]
        # One head dim of nope + rope for every kernel; the shared rope key is repeated per head.
        k_rope = jnp.broadcast_to(k_rope.astype(dt)[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])
        out, max_logits = attention_ops.attention(
            self.implementation, jnp.concatenate([q_nope, q_rope], axis=-1),
            jnp.concatenate([k_nope, k_rope], axis=-1), v, mask, self.scale, self.mesh)  # [b, s, h, v]
        return jnp.einsum("bqhd,hde->bqe", out, weight(self.o_proj, dt)), max_logits

    def attend_absorbed(self, q: tuple[jax.Array, jax.Array], parts: list[tuple[jax.Array, jax.Array]],
                        mask: AttentionMask):
        """The same attention with kv_b_proj absorbed (DeepSeek-V3's `attn_impl="absorb"`): its key half
        folds into the query, its value half into the output, so keys are the 576-wide latent itself and
        the cost is O(keys x latent) per query, with nothing decompressed.

        parts: the keys as (c_kv [batch, k_i, kv_lora], k_rope [batch, k_i, rope]) blocks (e.g. a cache
        and the new tokens), concatenated in that order along the key axis of `mask` (sum k_i keys)
        without copying the blocks; the few decoded queries take the mask dense.
        Returns ([batch, q, embed], max_logits f32[heads]).
        """
        mla, dt, f32 = self.cfg, self.dtype, jnp.float32
        q_nope, q_rope = q
        # Heads first, as the batched matmuls want them: a transpose of the weights alone, which XLA
        # hoists out of a decode loop (left to layout assignment, it was a copy in every step).
        kv_b = jnp.transpose(weight(self.kv_b_proj, dt), (1, 0, 2))                   # [h, r, nope + v]
        w_uk, w_uv = kv_b[..., : mla.qk_nope_head_dim], kv_b[..., mla.qk_nope_head_dim:]  # [h, r, nope], [h, r, v]
        q_latent = jnp.einsum("bshd,hrd->bshr", q_nope, w_uk)                         # [b, s, h, r_kv]
        scores = jnp.concatenate([
            jnp.einsum("bqhr,bkr->bhqk", q_latent, c_kv.astype(dt), preferred_element_type=f32)
            + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope.astype(dt), preferred_element_type=f32)
            for c_kv, k_rope in parts], axis=-1)
        probs, max_logits = attention_ops.masked_softmax(scores, mask.visible(), self.scale, dt)
        bounds = np.cumsum([0] + [c.shape[1] for c, _ in parts])
        out_latent = sum(jnp.einsum("bhqk,bkr->bqhr", probs[..., lo:hi], c_kv.astype(dt))
                         for (c_kv, _), lo, hi in zip(parts, bounds[:-1], bounds[1:]))  # [b, s, h, r_kv]
        out = jnp.einsum("bqhr,hrd->bqhd", out_latent, w_uv)                          # [b, s, h, v]
        return self.project_out(out), max_logits

    def project_out(self, out: jax.Array) -> jax.Array:
        """out: [batch, seq, heads, v] -> [batch, seq, embed] through o_proj, as one matmul over (heads, v)
        flattened: an einsum over both let XLA:CPU pick a (v, heads) order and copy o_proj per call."""
        h, v, d = self.o_proj.shape
        return jnp.reshape(out, (*out.shape[:2], h * v)) @ jnp.reshape(weight(self.o_proj, self.dtype), (h * v, d))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask, prefix=None,
                 absorbed: bool = False):
        """x: [batch, seq, embed]; cos, sin: f32[batch, seq, rope/2]; mask: which of the prefix + seq_k keys
        each query sees (seq_k: the whole sequence; seq: this device's queries under context
        parallelism); prefix:
        optional (c_kv [batch, prefix, kv_lora], k_rope [batch, prefix, rope]) of earlier tokens that
        every query may attend to (their mask keys come first); absorbed: use `attend_absorbed`
        (decode) instead of `attend`.

        Returns the output [batch, seq, embed], each head's largest scaled attention logit f32[heads]
        (tracked for QK-clip) and this layer's latent (c_kv, k_rope) of the input tokens.
        """
        q, latent = self.query(x, cos, sin), self.latent(x, cos, sin)
        keys = (gather_sequence(latent[0]), gather_sequence(latent[1]))               # keys: whole sequence
        if absorbed:
            out, max_logits = self.attend_absorbed(q, ([prefix] if prefix is not None else []) + [keys], mask)
        else:
            if prefix is not None:
                keys = tuple(jnp.concatenate([p.astype(self.dtype), k], axis=1) for p, k in zip(prefix, keys))
            out, max_logits = self.attend(q, keys, mask)
        return out, max_logits, latent
