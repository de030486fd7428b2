"""The MoE FFN block: a shared expert plus sigmoid-routed experts through a dispatch backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model import dispatch
from composer_jax.model.layers import MLP, param
from composer_jax.model.router import Router, expert_load


class MoE(nnx.Module):
    """x: [batch, seq, embed] -> (y [batch, seq, embed], load f32[experts])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe, d, pd = cfg.moe, cfg.hidden_size, cfg.param_dtype
        self.num_experts = moe.n_routed_experts
        self.dtype = jnp.dtype(cfg.dtype)
        self.dispatch = dispatch.BACKENDS[moe.dispatch]
        self.router = Router(cfg, rngs=rngs)
        e, f = moe.n_routed_experts, moe.moe_intermediate_size
        # Stacked expert weights: the expert axis is a batch axis (Muon orthogonalizes per expert).
        up = dict(reduction=("embed",), output=("moe_mlp",))
        self.gate_proj = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, **up)
        self.up_proj = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, **up)
        self.down_proj = param(rngs, (e, f, d), ("experts", "moe_mlp", "embed"), pd,
                               reduction=("moe_mlp",), output=("embed",))
        self.shared = (MLP(cfg, f * moe.n_shared_experts, rngs=rngs, mlp_axis="moe_mlp")
                       if moe.n_shared_experts else None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d).astype(self.dtype)
        weights, idx = self.router(tokens)
        experts = dispatch.ExpertWeights(*(w[...].astype(self.dtype)
                                           for w in (self.gate_proj, self.up_proj, self.down_proj)))
        y = self.dispatch(tokens, weights, idx, experts).reshape(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, expert_load(idx, self.num_experts)
