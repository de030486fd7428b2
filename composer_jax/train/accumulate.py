"""Gradient accumulation inside one jitted step: a `lax.scan` over micro-batches summing
`value_and_grad` results, shared by pretraining and RL (one copy of the accumulator logic).

The accumulators start as zeros with the shardings the gradients will have (read off `jax.eval_shape`),
so each gradient leaf stays on its own mesh of the dual grid; the scan holds a single copy of the
forward and backward pass in the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from composer_jax.parallel import leafwise


def _type_sharding(s: jax.ShapeDtypeStruct):
    """The sharding of an abstract value as the type system sees it (None when not on a mesh)."""
    sharding = getattr(s, "sharding", None)
    if sharding is None or getattr(sharding, "mesh", None) is None or sharding.mesh.empty:
        return None
    return sharding


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def accumulate(grad_fn: Callable, micro_batches, *, combine_aux: Callable = _add):
    """Sum `grad_fn(mb) -> ((value, aux), grads)` over the leading axis of `micro_batches` (a pytree of
    [n, ...] arrays). Values and gradients add; `combine_aux(acc, aux)` folds the aux outputs (default:
    add leaf by leaf). Returns ((value, aux), grads) of the whole step."""
    if jax.tree.leaves(micro_batches)[0].shape[0] == 1:
        # One micro-batch: no accumulators, so `grad_fn` (the whole forward and backward pass) is traced
        # once, not also by the `eval_shape` that sizes them (a third of a step's tracing time).
        return grad_fn(jax.tree.map(lambda x: x[0], micro_batches))
    (value_s, aux_s), grads_s = jax.eval_shape(grad_fn, jax.tree.map(lambda x: x[0], micro_batches))
    zeros = lambda s: jnp.zeros(s.shape, s.dtype, out_sharding=_type_sharding(s))  # noqa: E731
    first = ((zeros(value_s), jax.tree.map(zeros, aux_s)), leafwise.tree_map(zeros, grads_s))

    def body(acc, mb):
        (value, aux), grads = grad_fn(mb)
        (acc_value, acc_aux), acc_grads = acc
        return ((acc_value + value, combine_aux(acc_aux, aux)), leafwise.tree_map(jnp.add, acc_grads, grads)), None

    total, _ = jax.lax.scan(body, first, micro_batches)
    return total
