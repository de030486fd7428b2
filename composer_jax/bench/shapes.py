"""Shape-only checks of benchmark workloads: each section's `*_shapes` function traces what its run
builds at the given sizes without allocating weights, compiling or running anything, so that a size
that cannot run fails in seconds (`bench.suite.section_shapes`, before a run; tests/test_bench_shapes.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def forward_shapes(cfg, batch: int, length: int) -> None:
    """Trace the model of `cfg` (abstract weights) on int32[batch, length] tokens: sequence length
    against rope positions, head and block shapes, the MoE layout (a bad size raises here)."""
    from flax import nnx

    from composer_jax import CausalLM

    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    jax.eval_shape(lambda st, t: nnx.merge(graphdef, st)(t), state, jax.ShapeDtypeStruct((batch, length), jnp.int32))
