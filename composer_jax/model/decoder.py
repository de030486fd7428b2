"""The decoder layer and scanned layer stacks, shared by the main model and the MTP depths.

Layers of one kind are created stacked with `nnx.vmap`, so every parameter gains a leading `layers`
axis (the stacked leaves double as Muon batches), and run with `jax.lax.scan` (compile time does not
grow with depth) or, where that is faster, one layer after another (`model.layer_loop`, `unrolls`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.attention import MLA
from composer_jax.model.dispatch import platform, split_pays
from composer_jax.model.layers import MLP, RMSNorm, stack_axes
from composer_jax.model.moe import ROUTED_EXPERTS, MoE
from composer_jax.model.quant import entries, leading
from composer_jax.parallel import leafwise


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
# `layer_loop: auto` unrolls stacks of at most this many layers on CPU. The tiny model's training step
# (its stacks of 1 and 3 layers) compiles no slower unrolled; each unrolled MoE layer beyond adds about
# 0.4 s of compile at the suite's optimisation level (8 layers: 4.0 s against 2.6 s scanned, 16: 8.2 s
# against 2.2 s), which a run's faster steps pay back only over many steps.
MAX_UNROLLED_LAYERS = 8


def unrolls(layer_loop: str, layers: int, remat: str, on: str | None = None) -> bool:
    """Whether a stack of `layers` layers runs one layer after another rather than as a `lax.scan`.

    'auto': on CPU, for at most MAX_UNROLLED_LAYERS layers and without remat (which is asked for to
    bound memory: unrolled, XLA:CPU schedules the recomputation early and the tiny model's step kept
    97% of its temporaries under 'full', against 38% scanned). XLA:CPU runs a scan's body on slices of the
    stacked weights and writes every layer's residuals for the backward into zero-filled stacks
    (`dynamic_update_slice`), then reads them back: a fifth of issue 41's held-out training step. One
    after another, each layer's residuals are buffers of their own (the step 1.2x faster there, 1.06x
    on the tiny recipe's; docs/training.md). Accelerators and deeper stacks scan: XLA's GPU and TPU
    compilers update the stacks in place, and compile time stays flat in the depth. `on`: the platform
    ('cpu', 'gpu', ...; default: the traced program's), for a plan made without devices."""
    if layer_loop != "auto":
        return layer_loop == "unroll"
    return (on or platform()) == "cpu" and layers <= MAX_UNROLLED_LAYERS and remat == "none"


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


def _layer_entry(value, i: int):
    """Layer `i` of a stacked leaf (an array or an Int4Matrix, sliced on its own mesh) or of an
    `unstack_layers` tuple."""
    if isinstance(value, tuple):
        return value[i]
    with leafwise.on_mesh(leafwise.mesh_of(jax.tree.leaves(value)[0])):
        return leading(value, i)


def scan_stack(stack: nnx.Module, carry, *args, per_layer: dict | None = None, remat: str = "none",
               layer_loop: str = "auto", **kwargs):
    """Run `layer(carry, *args, **per_layer[i], **kwargs) -> (carry, out)` over a stacked module.

    per_layer: keyword inputs with a leading layers axis, sliced per layer. remat: what the backward
    pass keeps of each layer's forward (`REMAT_POLICIES`): with 'full' or 'dots' the layer body is
    recomputed per layer, so the stack keeps one layer's activations at a time plus each layer's input
    (and, for 'dots', its matmul outputs). layer_loop: 'scan', 'unroll' or 'auto' (`unrolls`); stacks
    split by `unstack_layers` always run one layer after another. Returns (carry, stacked outs).
    """
    if remat != "none" and remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: expected 'none' or one of {', '.join(REMAT_POLICIES)}")
    graphdef, state = nnx.split(stack)

    def body(carry, scanned):
        layer_state, sliced = scanned
        return nnx.merge(graphdef, layer_state)(carry, *args, **(sliced or {}), **kwargs)

    flat = list(nnx.to_flat_state(state))
    first = flat[0][1].get_value()
    layers = len(first) if isinstance(first, tuple) else jax.tree.leaves(first)[0].shape[0]
    scanned = not (isinstance(first, tuple) or unrolls(layer_loop, layers, remat))
    if remat != "none":
        # Outside a scan XLA would merge the backward's recomputation with the forward (CSE) and keep
        # every layer's activations after all: there the recomputation is fenced off.
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=not scanned)
    if scanned:
        return jax.lax.scan(body, carry, (state, per_layer))
    outs = []
    for i in range(layers):
        layer_state = nnx.from_flat_state([(p, v.replace(_layer_entry(v.get_value(), i))) for p, v in flat])
        carry, out = body(carry, (layer_state, jax.tree.map(lambda a: _layer_entry(a, i), per_layer)))
        outs.append(out)
    return carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)
