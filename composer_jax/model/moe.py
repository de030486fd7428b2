"""The MoE FFN block: a shared expert plus sigmoid-routed experts through a dispatch backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.config import ModelConfig
from composer_jax.model import dispatch
from composer_jax.model.expert_parallel import sharded_dispatch
from composer_jax.model.layers import MLP, param
from composer_jax.model.quant import Int4Matrix, fake_quant_int4
from composer_jax.model.router import Router, expert_load
from composer_jax.parallel.partitioning import flatten_tokens, spread_tokens, unflatten_tokens, unspread_tokens


class MoE(nnx.Module):
    """x: [batch, seq, embed] -> (y [batch, seq, embed], stats).

    stats: `expert_load` f32[experts] (assignments per expert) and `dropped` int32[] (assignments
    dropped by an expert-parallel dispatch over its capacity, `moe.capacity_factor`; never under the
    inference placement). With `mesh` (a DualMesh, static; set by
    `parallel.shard_model`) the routed experts run on its expert mesh
    (composer_jax.model.expert_parallel); without one, on the local backend. Under the inference
    placement a small batch's tokens are zero-padded to the device count for the dispatch (the padding
    rows count in `expert_load`; decoding does not use it).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.mesh = None
        moe, d, pd = cfg.moe, cfg.hidden_size, cfg.param_dtype
        self.num_experts = moe.n_routed_experts
        self.dtype = jnp.dtype(cfg.dtype)
        self.dispatch, self.capacity_factor = moe.dispatch, moe.capacity_factor
        self.int4 = moe.expert_quant == "int4"
        self.router = Router(cfg, rngs=rngs)
        e, f = moe.n_routed_experts, moe.moe_intermediate_size
        # Stacked expert weights: the expert axis is a batch axis (Muon orthogonalizes per expert).
        up = dict(reduction=("embed",), output=("moe_mlp",))
        self.gate_proj = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, **up)
        self.up_proj = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, **up)
        self.down_proj = param(rngs, (e, f, d), ("experts", "moe_mlp", "embed"), pd,
                               reduction=("moe_mlp",), output=("embed",))
        self.expert_bytes = d * f * self.dtype.itemsize   # one expert matrix in the compute dtype
        self.shared = (MLP(cfg, f * moe.n_shared_experts, rngs=rngs, mlp_axis="moe_mlp")
                       if moe.n_shared_experts else None)

    def _compute(self, matrix):
        """An expert matrix (or stack) in the compute dtype, through the INT4 quantizer first with `int4`;
        an INT4 engine's Int4Matrix is dequantized where the dispatch reads it."""
        if isinstance(matrix, Int4Matrix):
            return dataclasses.replace(matrix, dtype=self.dtype.name)
        return (fake_quant_int4(matrix) if self.int4 else matrix).astype(self.dtype)

    def _local(self, var: nnx.Param):
        """An expert matrix in the compute dtype: stacked, or per-expert arrays as `unstack_layers` left them."""
        value = var.get_value()
        if isinstance(value, tuple):
            return tuple(self._compute(m) for m in value)
        return self._compute(value)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        b, s, d = x.shape
        dual = self.mesh
        experts = (self.gate_proj, self.up_proj, self.down_proj)
        if dual is None:
            if self.dispatch not in dispatch.BACKENDS:
                raise ValueError(f"moe.dispatch={self.dispatch!r} needs a DualMesh: place the model with "
                                 "`composer_jax.parallel.shard_model(model, dual_mesh)` or use 'ragged' / 'dense'")
            tokens = x.reshape(b * s, d).astype(self.dtype)
            weights, idx = self.router(tokens)
            w = dispatch.ExpertWeights(*(self._local(e) for e in experts))
            y = dispatch.BACKENDS[self.dispatch](tokens, weights, idx, w).reshape(b, s, d)
            stats = {"expert_load": expert_load(idx, self.num_experts), "dropped": jnp.zeros((), jnp.int32)}
        else:
            # Training: each device's tokens flattened where they are (no collective). Inference: the batch's
            # own placement (split over the data axes or replicated), spread over the devices and back.
            batch = jax.typeof(x).sharding.spec[0] if dual.inference else None
            tokens = (jnp.reshape(x.astype(self.dtype), (b * s, d), out_sharding=P(batch, None)) if dual.inference
                      else flatten_tokens(x.astype(self.dtype), dual.sizes))
            weights, idx = self.router(tokens)
            if dual.inference:
                tokens, weights, idx = (spread_tokens(a, dual) for a in (tokens, weights, idx))
            with dual.expert_scope():   # INT4 experts: the layer's whole stack dequantized (the dispatch shards it)
                w = dispatch.stacked(dispatch.ExpertWeights(*(self._compute(e.get_value()) for e in experts)))
            factor = 0.0 if dual.inference else self.capacity_factor  # decoding never drops
            y, load, dropped = sharded_dispatch(self.dispatch, dual, tokens, weights, idx, w, factor)
            y = (jnp.reshape(unspread_tokens(y, b * s, P(batch, None)), (b, s, d), out_sharding=P(batch, None, None))
                 if dual.inference else unflatten_tokens(y, (b, s, d), dual.sizes))
            stats = {"expert_load": load, "dropped": dropped}
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


ROUTED_EXPERTS = ("gate_proj", "up_proj", "down_proj")   # a MoE layer's stacked routed-expert weights


def routed_expert_paths(model: nnx.Module) -> frozenset[tuple]:
    """The state paths of the routed expert stacks of every MoE layer in `model` (the main stack's and
    the MTP depths')."""
    return frozenset(tuple(path) + (name,) for path, node in nnx.iter_graph(model) if isinstance(node, MoE)
                     for name in ROUTED_EXPERTS)
