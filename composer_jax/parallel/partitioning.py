"""Logical axis names -> PartitionSpecs: one rule table per grid, one for activations.

Every parameter carries logical `axes` metadata (composer_jax.model.layers). A parameter with an
`experts` axis lives on the expert grid; every other one on the dense grid. Within a grid, each
dimension takes the mesh axes its logical name lists, first fit in dimension order, each mesh axis at
most once per tensor and only where it divides the dimension. Vectors (norm scales, router bias) stay
replicated: they are tiny and read by every token. Optimizer state is sharded like its parameter.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.mesh import BATCH_AXES, DENSE_TOKEN_AXES, EXPERT_TOKEN_AXES, DualMesh

# FSDP: a dense weight is sharded on one dimension over `fsdp` (the first listed name that divides).
DENSE_PARAM_RULES: dict[str, tuple[str, ...]] = {
    name: ("fsdp",) for name in ("vocab", "embed", "embed_concat", "mlp", "moe_mlp", "q_lora", "kv_lora",
                                 "kv_lora_rope", "heads", "router_experts")
}
# Experts over `ep`; their embed dim over `efsdp` (expert FSDP, gathered inside the dispatch).
EXPERT_PARAM_RULES: dict[str, tuple[str, ...]] = {"experts": ("ep",), "embed": ("efsdp",)}
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,               # dense mesh
    "seq": ("cp",),                    # dense mesh
    "tokens": DENSE_TOKEN_AXES,        # flattened batch * seq, dense mesh
    "expert_tokens": EXPERT_TOKEN_AXES,
}


def grid_of(axes: tuple[str, ...]) -> str:
    return "expert" if "experts" in axes else "dense"


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], sizes: dict[str, int]) -> P:
    """The PartitionSpec of one parameter from its logical axes, shape and the mesh axis sizes."""
    if sum(a != "layers" for a in axes) < 2:
        return P(*([None] * len(shape)))
    rules = EXPERT_PARAM_RULES if grid_of(axes) == "expert" else DENSE_PARAM_RULES
    used, spec = set(), []
    for name, dim in zip(axes, shape):
        chosen, shards = [], 1
        for mesh_axis in rules.get(name, ()):
            size = sizes[mesh_axis]
            if size > 1 and mesh_axis not in used and dim % (shards * size) == 0:
                chosen.append(mesh_axis)
                shards *= size
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def activation_spec(*names: str | None) -> P:
    """PartitionSpec of an activation from logical names, e.g. activation_spec('batch', 'seq', None)."""
    return P(*(None if n is None else ACTIVATION_RULES[n] for n in names))


def _variables(state: nnx.State):
    for path, var in nnx.to_flat_state(state):
        yield tuple(str(p) for p in path), var


def sharding_dump(state: nnx.State, sizes: dict[str, int]) -> dict[str, dict]:
    """{'moe_layers/mlp/gate_proj': {'mesh': 'expert', 'spec': [None, 'ep', None, None]}, ...}."""
    out = {}
    for path, var in _variables(state):
        axes, shape = var.get_metadata("axes"), tuple(var.get_value().shape)
        spec = spec_for(axes, shape, sizes)
        out["/".join(path)] = {"mesh": grid_of(axes), "shape": list(shape),
                               "spec": [list(s) if isinstance(s, tuple) else s for s in spec]}
    return out


def param_shardings(state: nnx.State, dual: DualMesh) -> nnx.State:
    """A State of NamedShardings mirroring `state` (abstract or concrete)."""

    def sharding(var):
        axes = var.get_metadata("axes")
        mesh = dual.expert if grid_of(axes) == "expert" else dual.dense
        return var.replace(NamedSharding(mesh, spec_for(axes, tuple(var.get_value().shape), dual.sizes)))

    return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, dual: DualMesh) -> nnx.Module:
    """Place every variable of `model` on its grid with its spec (in place); returns the model."""
    state = nnx.state(model)
    shardings = param_shardings(state, dual)
    placed = jax.tree.map(lambda v, s: jax.device_put(v, s), nnx.to_pure_dict(state),
                          nnx.to_pure_dict(shardings))
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    return model


def like_params(tree, params: nnx.State, shardings: nnx.State, dual: DualMesh):
    """Shardings for an optimizer-state pytree: a leaf whose path ends with a parameter's path and has
    its shape gets that parameter's sharding; anything else (step counts, scalars) is replicated."""
    by_path = {}
    for (path, var), (_, sh) in zip(_variables(params), _variables(shardings)):
        by_path[path] = (tuple(var.get_value().shape), sh.get_value())
    replicated = NamedSharding(dual.dense, P())

    def leaf_sharding(path, leaf):
        keys = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        shape = tuple(np.shape(leaf))
        for n in range(len(keys)):
            hit = by_path.get(keys[n:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(leaf_sharding, tree)
