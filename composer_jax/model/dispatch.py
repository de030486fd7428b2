"""MoE dispatch backends. All share one signature and agree wherever no token is dropped.

    dispatch(x, weights, idx, experts) -> y
    x: [tokens, embed]; weights: f32[tokens, k]; idx: int32[tokens, k];
    experts: ExpertWeights(gate [E, embed, f], up [E, embed, f], down [E, f, embed]); y: [tokens, embed]

- `dense`: every expert on every token, combined with a one-hot weight matrix. The reference.
- `ragged`: assignments sorted by expert, grouped matmuls with `jax.lax.ragged_dot`, unsorted and summed.
  Dropless; compute proportional to tokens * k.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [experts, embed, moe_mlp]
    up: jax.Array    # [experts, embed, moe_mlp]
    down: jax.Array  # [experts, moe_mlp, embed]


def dense(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights) -> jax.Array:
    num_experts = w.gate.shape[0]
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, num_experts, dtype=weights.dtype))
    h = jax.nn.silu(jnp.einsum("td,edf->etf", x, w.gate)) * jnp.einsum("td,edf->etf", x, w.up)
    out = jnp.einsum("etf,efd->etd", h, w.down)
    return jnp.einsum("te,etd->td", combine, out.astype(jnp.float32)).astype(x.dtype)


def ragged(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights) -> jax.Array:
    tokens, k = idx.shape
    num_experts = w.gate.shape[0]
    flat_expert = idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)              # assignments grouped by expert
    token_of = order // k                                      # source token of each sorted assignment
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, token_of, axis=0)                         # [tokens*k, embed]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w.gate, group_sizes)) * jax.lax.ragged_dot(xs, w.up, group_sizes)
    out = jax.lax.ragged_dot(h, w.down, group_sizes).astype(jnp.float32)
    out = out * jnp.take(weights.reshape(-1), order)[:, None]
    y = jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(out)
    return y.astype(x.dtype)


BACKENDS: dict[str, Callable[..., jax.Array]] = {"dense": dense, "ragged": ragged}
