"""Sigmoid router with a selection-only correction bias and group-limited top-k (DeepSeek-V3 noaux_tc).

Semantics of transformers' `DeepseekV3TopkRouter` (shared/reference/kimi_arch.md section 2.3):
selection uses `sigmoid(logits) + bias`, restricted to the `topk_group` groups with the largest sum of
their top-2 biased scores; the combine weights are the *unbiased* sigmoid scores of the selected
experts, normalised to sum to one (optional) and multiplied by `routed_scaling_factor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig, MoEConfig
from composer_jax.model.layers import RouterBias, param, weight


def route(scores: jax.Array, bias: jax.Array, moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k expert choice from sigmoid scores.

    scores: f32[tokens, experts] (sigmoid of router logits); bias: f32[experts].
    Returns weights f32[tokens, k] and expert indices int32[tokens, k].
    """
    tokens, experts = scores.shape
    choice = scores + bias
    if moe.n_group > 1:
        grouped = choice.reshape(tokens, moe.n_group, experts // moe.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                     # [tokens, groups]
        _, kept = jax.lax.top_k(group_score, moe.topk_group)
        keep = (kept[:, :, None] == jnp.arange(moe.n_group)).any(axis=1)          # [tokens, groups]
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)
    _, idx = jax.lax.top_k(choice, moe.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, idx.astype(jnp.int32)


def expert_load(idx: jax.Array, num_experts: int) -> jax.Array:
    """f32[experts]: how many (token, slot) assignments each expert received. idx: int[tokens, k]."""
    return jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)


def updated_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.

    bias, load: f32[..., experts] (a leading layer axis is fine). b <- b + rate * sign(mean(load) - load).
    """
    return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)


class Router(nnx.Module):
    """x: [tokens, embed] -> (weights f32[tokens, k], idx int32[tokens, k])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.moe = cfg.moe
        e = cfg.moe.n_routed_experts
        # `router_experts`, not `experts`: the router is a dense weight; `experts` marks expert-grid weights.
        self.kernel = param(rngs, (cfg.hidden_size, e), ("embed", "router_experts"), cfg.param_dtype,
                            reduction=("embed",), output=("router_experts",))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=("router_experts",))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = x.astype(jnp.float32) @ weight(self.kernel, jnp.float32)   # router math in f32
        return route(jax.nn.sigmoid(logits), weight(self.bias, jnp.float32), self.moe)
