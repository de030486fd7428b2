"""Parameters with logical-axis metadata, RMSNorm, embedding and the SwiGLU MLP.

Every parameter is an `nnx.Param` (or `RouterBias`) carrying metadata used by later stages:
- `axes`: one logical name per dimension (e.g. `("layers", "embed", "mlp")`); partitioning maps these to
  mesh axes, one rule table per grid.
- `reduction` / `output`: for matrices, the logical axes contracted with the input and the axes
  produced; every other axis is a batch axis (layers, heads, experts). Muon orthogonalizes one matrix
  per batch index. Embeddings, the output head, norms and biases carry no matrix view.
Weights are stored `[in, out]` (x @ W), the transpose of PyTorch's `[out, in]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.config import ModelConfig
from composer_jax.parallel.partitioning import gather_whole

INIT_STD = 0.02  # HF initializer_range


class RouterBias(nnx.Variable):
    """The router's selection-only correction bias: updated by load balancing, not by the optimizer."""


def param(rngs: nnx.Rngs, shape, axes, dtype, *, reduction=None, output=None, init="normal") -> nnx.Param:
    """A parameter of `shape` with its logical `axes` and, for matrices, its reduction/output axes."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and axes {axes} differ in rank")
    if init == "normal":
        value = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    meta = {"axes": tuple(axes)}
    if reduction is not None:
        meta.update(reduction=tuple(reduction), output=tuple(output))
    return nnx.Param(value.astype(dtype), **meta)


def weight(var: nnx.Variable, dtype) -> jax.Array:
    """A parameter's value in the compute `dtype`, gathered whole if it is sharded (Explicit-axes FSDP).

    Casting first halves the bytes gathered for bf16 compute; the backward pass reduce-scatters the
    gradient back to the parameter's sharding on its own.
    """
    return gather_whole(var[...].astype(dtype))


def stack_axes(module: nnx.Module, axis_name: str = "layers") -> None:
    """Prepend `axis_name` to the logical axes of every variable of a module created under `nnx.vmap`."""
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable) and var.has_metadata("axes"):
            var.set_metadata(axes=(axis_name,) + var.get_metadata("axes"))


class RMSNorm(nnx.Module):
    """w * x / sqrt(mean(x^2) + eps), statistics in float32 (x: [..., dim])."""

    def __init__(self, dim: int, eps: float, axis_name: str, param_dtype, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight(self.scale, x.dtype) * normed.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding table `embedding: [vocab, embed]` (no sqrt(d) scaling)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.embedding = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: int[..., seq] -> [..., seq, embed], sharded like the tokens."""
        table = weight(self.embedding, self.dtype)
        sharding = jax.typeof(tokens).sharding
        if sharding.mesh.empty:
            return jnp.take(table, tokens, axis=0)
        return table.at[tokens].get(out_sharding=P(*sharding.spec, None))


class MLP(nnx.Module):
    """SwiGLU FFN: down(silu(x @ gate) * (x @ up)). x: [..., embed]."""

    def __init__(self, cfg: ModelConfig, intermediate: int, *, rngs: nnx.Rngs, mlp_axis: str = "mlp"):
        d, pd = cfg.hidden_size, cfg.param_dtype
        self.dtype = jnp.dtype(cfg.dtype)
        proj = dict(reduction=("embed",), output=(mlp_axis,))
        self.gate_proj = param(rngs, (d, intermediate), ("embed", mlp_axis), pd, **proj)
        self.up_proj = param(rngs, (d, intermediate), ("embed", mlp_axis), pd, **proj)
        self.down_proj = param(rngs, (intermediate, d), (mlp_axis, "embed"), pd,
                               reduction=(mlp_axis,), output=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        x = x.astype(dt)
        gate, up = x @ weight(self.gate_proj, dt), x @ weight(self.up_proj, dt)
        return (jax.nn.silu(gate) * up) @ weight(self.down_proj, dt)
