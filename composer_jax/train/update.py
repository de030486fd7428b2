"""The update after a gradient, shared by pretraining and RL (one copy of the sequence):

    grad_norm = sqrt(sum of squares over both meshes' leaves)
    finite    = isfinite(loss) & isfinite(grad_norm)
    grads     = clipped to global norm <= max_norm (optax.clip_by_global_norm's rule)
    params, opt_state = the optimizer's update, kept as they were where not `finite`

Every leaf is worked on its own mesh (`parallel.leafwise`); only scalars cross between meshes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.parallel import leafwise
from composer_jax.train.optimizer import Optimizer


class Updated(NamedTuple):
    params: object
    opt_state: object
    grad_norm: jax.Array   # f32[]: before clipping
    finite: jax.Array      # bool[]: False -> params and optimizer state were kept


def clip_by_global_norm(tree, max_norm: float, norm: jax.Array):
    """optax.clip_by_global_norm(max_norm) with the global `norm` given: optax's transformation sums
    the squares of every leaf in one op, which JAX refuses for leaves on two meshes."""
    if not max_norm:
        return tree

    def one(x):
        mesh = leafwise.mesh_of(x)
        with leafwise.on_mesh(mesh):
            g = leafwise.localize(norm, mesh)
            return jnp.where(g < max_norm, x, x / (g / max_norm).astype(x.dtype))

    return jax.tree.map(one, tree)


def apply_gradients(opt: Optimizer, params, opt_state, grads, loss: jax.Array, max_norm: float) -> Updated:
    """The sequence in the module docstring. params, grads: the same tree (nnx.State); loss: f32[]."""
    mesh = leafwise.mesh_of(loss) or next(filter(None, map(leafwise.mesh_of, jax.tree.leaves(grads))), None)
    grad_norm = jnp.sqrt(leafwise.sum_of_squares(grads, mesh))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = clip_by_global_norm(grads, max_norm, grad_norm)
    updates, new_opt_state = opt.tx.update(grads, opt_state, params)
    new_params = leafwise.tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    return Updated(leafwise.where(finite, new_params, params), leafwise.where(finite, new_opt_state, opt_state),
                   grad_norm, finite)
