"""Models with random weights filled from NumPy (in well under a second; initialising through the
model's own per-parameter `jax.random` calls compiles one program per shape, ~10-20 s for the tiny
model on a busy 2-core machine). The spread follows tests/hf_reference.py: weights N(0, 0.08), norm
scales 1 + N(0, 0.2), router biases U(0, 0.5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import CausalLM
from composer_jax.model.layers import RouterBias


def random_model(cfg, seed: int = 0, mesh=None) -> CausalLM:
    """A CausalLM of `cfg` (laid out on `mesh`, if given) with random weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)))
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if isinstance(var, RouterBias):
            value = 0.5 * rng.random(shape)
        elif path[-1] == "scale":
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = 0.08 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
