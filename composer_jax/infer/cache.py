"""The engine's latent cache: what it holds, its shapes, and its size per token.

Per layer, slot and position the cache holds the MLA latent, never per-head keys or values: the
normalised c_kv (kv_lora_rank values) and the rotated rope key shared by all heads (qk_rope_head_dim):
576 values at Kimi K2.5 size, against heads x (qk_head_dim + v_head_dim) = 64 x 320 for a per-head K/V
cache (35.6x more). In speculative mode the MTP depths that draft keep their own latents the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig


class Latents(NamedTuple):
    """Latents per layer, slot and position: c_kv [layers, slots, len, kv_lora], k_rope [.., rope]."""

    c_kv: jax.Array
    k_rope: jax.Array


class Cache(NamedTuple):
    """What the programs carry from call to call (donated). The speculative fields are None in plain mode."""

    main: Latents                        # the main model's layers
    mtp: Latents | None                  # drafting MTP depths [depths, slots, len, ...]: (h[k-1, i], t[i+k])
    draft: jax.Array | None              # int32[slots, drafts]: each slot's drafts of the tokens after its pending one
    draft_logprobs: jax.Array | None     # f32[slots, drafts, vocab]: the distributions they were drawn from


def drafting_depths(cfg: ModelConfig, draft_tokens: int) -> int:
    """MTP depths a draft of `draft_tokens` chains (the last one repeats for the drafts beyond them)."""
    return min(draft_tokens, cfg.mtp.num_layers)


def cache_shapes(cfg: ModelConfig, slots: int, max_len: int, draft_tokens: int = 0) -> Cache:
    """ShapeDtypeStructs of an engine's cache (latents in the model's compute dtype); draft_tokens 0:
    plain decoding."""
    dtype = jnp.dtype(cfg.dtype)

    def latents(layers: int) -> Latents:
        return Latents(jax.ShapeDtypeStruct((layers, slots, max_len, cfg.mla.kv_lora_rank), dtype),
                       jax.ShapeDtypeStruct((layers, slots, max_len, cfg.mla.qk_rope_head_dim), dtype))

    if not draft_tokens:
        return Cache(latents(cfg.num_layers), None, None, None)
    return Cache(latents(cfg.num_layers), latents(drafting_depths(cfg, draft_tokens)),
                 jax.ShapeDtypeStruct((slots, draft_tokens), jnp.int32),
                 jax.ShapeDtypeStruct((slots, draft_tokens, cfg.vocab_size), jnp.float32))


def latent_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes the main model's latent cache holds per token: (kv_lora + rope) x layers x dtype size."""
    return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_layers * jnp.dtype(cfg.dtype).itemsize


def per_head_kv_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes a per-head K/V cache would hold per token: heads x (qk_head_dim + v_head_dim) x layers x
    dtype size (keys carry the rope dims, values do not)."""
    mla = cfg.mla
    return mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * cfg.num_layers * jnp.dtype(cfg.dtype).itemsize
