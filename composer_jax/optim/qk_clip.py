"""QK-clip (Kimi K2's MuonClip) for MLA: after the optimizer step, shrink the query/key weights of every
head whose largest attention logit exceeded a threshold.

For head h with S_max^h (the largest scaled logit q.k / sqrt(d) seen in the forward pass) above tau,
gamma_h = tau / S_max^h, and the head's logits must shrink by exactly gamma_h. In MLA the logit is
q_nope.k_nope + q_rope.k_rope, where k_rope is one key shared by all heads, so (Kimi K2 report, MLA
variant): the per-head q_nope and k_nope columns are scaled by sqrt(gamma_h), the per-head q_rope
columns by gamma_h, and the shared rope key (kv_a_proj[:, kv_lora:]) and the values are left alone.
Both parts of the logit then scale by gamma_h, so the recomputed max logit of that head is tau (given
the same inputs). Heads at or below tau are left bit-for-bit unchanged.

Weights, as the model stores them:
  q_b_proj  [..., q_lora, heads, qk_nope + qk_rope]   (per head: nope dims, then rope dims)
  kv_b_proj [..., kv_lora, heads, qk_nope + v]          (per head: k_nope dims, then v dims)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clip_factors(max_logits: jax.Array, threshold: float) -> jax.Array:
    """gamma f32[..., heads]: threshold / max_logit where the max logit exceeds the threshold, else 1."""
    if not threshold > 0:
        raise ValueError(f"qk_clip threshold must be > 0, got {threshold}")
    max_logits = max_logits.astype(jnp.float32)
    return jnp.where(max_logits > threshold, threshold / jnp.maximum(max_logits, threshold), 1.0)


def clip_mla(q_b_proj: jax.Array, kv_b_proj: jax.Array, max_logits: jax.Array, threshold: float,
             qk_nope_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """Rescale the query/key up-projections of clipped heads.

    q_b_proj: [..., q_lora, heads, qk_nope + qk_rope]; kv_b_proj: [..., kv_lora, heads, qk_nope + v];
    max_logits: f32[..., heads] (the leading `...` is the stacked-layer axis, if any). Returns both
    weights in their own dtype and sharding.
    """
    heads = q_b_proj.shape[-2]
    if kv_b_proj.shape[-2] != heads or max_logits.shape[-1] != heads:
        raise ValueError(f"qk_clip: heads differ: q_b_proj {q_b_proj.shape}, kv_b_proj {kv_b_proj.shape}, "
                         f"max_logits {max_logits.shape}")
    if q_b_proj.shape[:-3] != max_logits.shape[:-1] or kv_b_proj.shape[:-3] != max_logits.shape[:-1]:
        raise ValueError(f"qk_clip: stacked layer axes differ: q_b_proj {q_b_proj.shape}, kv_b_proj "
                         f"{kv_b_proj.shape}, max_logits {max_logits.shape}")
    if not 0 < qk_nope_head_dim < q_b_proj.shape[-1] or qk_nope_head_dim >= kv_b_proj.shape[-1]:
        raise ValueError(f"qk_clip: qk_nope_head_dim {qk_nope_head_dim} does not split q_b_proj {q_b_proj.shape} "
                         f"and kv_b_proj {kv_b_proj.shape}")
    gamma = clip_factors(max_logits, threshold)[..., None, :, None]          # [..., 1, heads, 1]
    root = jnp.sqrt(gamma)

    def scale(w, nope_scale, rest_scale):
        nope = jnp.arange(w.shape[-1]) < qk_nope_head_dim                     # [head_dim]
        return (w * jnp.where(nope, nope_scale, rest_scale)).astype(w.dtype)

    return scale(q_b_proj, root, gamma), scale(kv_b_proj, root, 1.0)


def _attention_stacks(model):
    """The model's MLA modules with stacked weights, in the row order of `Output.max_logits`."""
    return [stack.attn for stack in (model.dense_layers, model.moe_layers) if stack is not None]


def clip_model(model, max_logits: jax.Array, threshold: float, mtp_max_logits: jax.Array | None = None) -> int:
    """Apply QK-clip in place to a `CausalLM` after its optimizer step.

    max_logits: f32[layers, heads] from `CausalLM.forward(...).max_logits` (dense layers first, then MoE);
    mtp_max_logits: f32[depths, heads] from `Output.mtp_stats['max_logits']` (clips the MTP layers).
    Returns the number of clipped heads (a traced int32 under jit).
    """
    nope = model.cfg.mla.qk_nope_head_dim
    attns = _attention_stacks(model)
    rows = sum(a.q_b_proj.shape[0] for a in attns)
    if max_logits.shape != (rows, model.cfg.mla.num_heads):
        raise ValueError(f"qk_clip: max_logits has shape {max_logits.shape}, the model has {rows} layers of "
                         f"{model.cfg.mla.num_heads} heads")
    pairs, start = [], 0
    for attn in attns:
        count = attn.q_b_proj.shape[0]
        pairs.append((attn, max_logits[start:start + count]))
        start += count
    if mtp_max_logits is not None:
        if model.mtp is None:
            raise ValueError("qk_clip: mtp_max_logits given but the model has no MTP layers")
        pairs.append((model.mtp.depths.layer.attn, mtp_max_logits))
    clipped = jnp.zeros((), jnp.int32)
    for attn, logits in pairs:
        q, kv = clip_mla(attn.q_b_proj[...], attn.kv_b_proj[...], logits, threshold, nope)
        attn.q_b_proj[...] = q
        attn.kv_b_proj[...] = kv
        clipped += jnp.sum(logits > threshold, dtype=jnp.int32)
    return clipped
