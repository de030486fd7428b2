"""The decoder layer and scanned layer stacks, shared by the main model and the MTP depths.

Layers of one kind are created stacked with `nnx.vmap`, so every parameter gains a leading `layers`
axis, and run with `jax.lax.scan`: compile time does not grow with depth, and the stacked leaves double
as Muon batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.attention import MLA
from composer_jax.model.dispatch import split_pays
from composer_jax.model.layers import MLP, RMSNorm, stack_axes
from composer_jax.model.moe import ROUTED_EXPERTS, MoE
from composer_jax.model.quant import entries, leading


def _dots_outside_shard_map(prim, *avals, **params) -> bool:
    """'dots', but nothing inside a shard_map (values typed on a mesh with manual axes: the expert
    dispatch, the attention kernels) is kept: JAX checks such a residual's spec against the context mesh
    (the dense one) instead of the shard_map's own, and the expert mesh's axes are not in it. The matmuls
    there are recomputed."""
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is not None and jax.sharding.AxisType.Manual in getattr(mesh, "axis_types", ()):
            return False
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


# train.remat / rl.remat -> the jax.checkpoint policy of each layer: what its backward pass keeps besides
# the layer's input ('dots': the outputs of matmuls without batch dimensions, i.e. the weight
# projections, outside shard_maps; 'full': nothing, None being jax.checkpoint's default). 'none' keeps
# everything.
REMAT_POLICIES = {"dots": _dots_outside_shard_map, "full": None}


class DecoderLayer(nnx.Module):
    """Pre-norm block: h + MLA(norm(h)), then h + FFN(norm(h)); FFN is SwiGLU or MoE."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        pd = cfg.param_dtype
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", pd, rngs=rngs)
        self.attn = MLA(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", pd, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs=rngs)

    def __call__(self, h, cos, sin, mask, prefix=None, return_latents: bool = False, absorbed: bool = False):
        """h: [batch, seq, embed] -> (h, stats). `prefix`: this layer's (c_kv, k_rope) of earlier tokens
        (e.g. a decode cache); `absorbed`: attention in the absorbed (decode) form.

        stats: `max_logits` f32[heads] (per-head largest attention logit), with `return_latents` the
        layer's `latent` (c_kv, k_rope), and for an MoE layer the MoE stats (`expert_load`
        f32[experts] for the bias update, `dropped` int32[]).
        """
        attn, max_logits, latent = self.attn(self.input_norm(h), cos, sin, mask, prefix, absorbed)
        h = h + attn
        stats = {"max_logits": max_logits}
        if return_latents:
            stats["latent"] = latent
        ffn = self.mlp(self.post_attn_norm(h))
        if isinstance(ffn, tuple):
            ffn, moe_stats = ffn
            stats.update(moe_stats)
        return h + ffn, stats


def create_stack(make, num: int, rngs: nnx.Rngs) -> nnx.Module:
    """`num` copies of the module built by `make(rngs)`, stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs)

    stack = create(rngs)
    stack_axes(stack)
    return stack


STACKS = ("dense_layers", "moe_layers")   # the model's scanned layer stacks


def _unstacked(path, value):
    """Per-layer arrays (or Int4Matrix) of a stacked parameter; routed experts also per expert where that
    pays (`dispatch.split_pays`; see `unstack_layers`)."""
    routed = len(path) == 3 and tuple(path[:2]) == ("moe_layers", "mlp") and path[2] in ROUTED_EXPERTS
    if routed and split_pays(leading(leading(value, 0), 0).nbytes):
        return tuple(entries(layer) for layer in entries(value))
    return entries(value)


def unstack_layers(state: nnx.State) -> nnx.State:
    """The model's state with each layer stack's parameters split into a tuple of per-layer arrays
    (separate buffers), which `scan_stack` runs one layer after another, and each MoE layer's routed
    experts into a tuple of per-expert arrays (`dispatch`) where an expert matrix is large enough
    (`dispatch.split_pays`). For inference on one CPU device: a scan slices every layer's weights out of the stack, and
    XLA:CPU copies each slice it takes before a matmul reads it (a weight-bound decode step read its
    experts 5x slower through per-layer slices, and spent 40% of its time copying the experts a step
    used out of the per-layer stacks). Small experts stay stacked: copying them costs less than the
    expert `lax.switch` of per-expert arrays, which also compiles slower (the tiny model's engine: 2.5x
    faster decode calls and 10% less compile CPU with its 8 KiB experts stacked)."""
    return nnx.from_flat_state([(p, v.replace(_unstacked(p, v.get_value())) if p[0] in STACKS else v)
                                for p, v in nnx.to_flat_state(state)])


def scan_stack(stack: nnx.Module, carry, *args, per_layer: dict | None = None, remat: str = "none", **kwargs):
    """Run `layer(carry, *args, **per_layer[i], **kwargs) -> (carry, out)` over a stacked module.

    per_layer: keyword inputs with a leading layers axis, sliced per layer. remat: what the backward
    pass keeps of each layer's forward (`REMAT_POLICIES`): with 'full' or 'dots' the layer body is
    recomputed per layer, so the stack keeps one layer's activations at a time plus each layer's input
    (and, for 'dots', its matmul outputs). Returns (carry, stacked outs).
    """
    if remat != "none" and remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: expected 'none' or one of {', '.join(REMAT_POLICIES)}")
    graphdef, state = nnx.split(stack)
    flat = list(nnx.to_flat_state(state))
    if flat and isinstance(flat[0][1].get_value(), tuple):   # `unstack_layers`: one layer after another
        outs = []
        for i in range(len(flat[0][1].get_value())):
            layer = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(v.get_value()[i])) for p, v in flat]))
            carry, out = layer(carry, *args, **jax.tree.map(lambda a: a[i], per_layer or {}), **kwargs)
            outs.append(out)
        return carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)

    def body(carry, scanned):
        layer_state, sliced = scanned
        return nnx.merge(graphdef, layer_state)(carry, *args, **(sliced or {}), **kwargs)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, carry, (state, per_layer))
