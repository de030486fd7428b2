"""Logical axis names -> PartitionSpecs: one rule table per grid, one for activations.

Every parameter carries logical `axes` metadata (composer_jax.model.layers). A parameter with an
`experts` axis lives on the expert grid; every other one on the dense grid. Within a grid, each
dimension takes the mesh axes its logical name lists, first fit in dimension order, each mesh axis at
most once per tensor and only where it divides the dimension. Vectors (norm scales, router bias) stay
replicated: they are tiny and read by every token. Optimizer state is sharded as the optimizer's init
places it (`state_shardings`), i.e. like its parameter.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.leafwise import mesh_of
from composer_jax.parallel.mesh import BATCH_AXES, DENSE_TOKEN_AXES, EXPERT_TOKEN_AXES, DualMesh
from composer_jax.tree_paths import path_str

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


def sharding_dump(state: nnx.State, sizes: dict[str, int]) -> dict[str, dict]:
    """{'moe_layers/mlp/gate_proj': {'mesh': 'expert', 'spec': [None, 'ep', None, None]}, ...}."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        axes, shape = var.get_metadata("axes"), tuple(var.get_value().shape)
        spec = spec_for(axes, shape, sizes)
        out[path_str(path)] = {"mesh": grid_of(axes), "shape": list(shape),
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
    """Place every variable of `model` on its grid with its spec and record the layout (in place);
    returns the model.

    The layout is recorded on every submodule that declares a `mesh` attribute (the model's
    activation-placing modules): a static attribute, so it is part of the model's graphdef and of the
    cache key of every `nnx.jit` that takes the model.
    """
    state = nnx.state(model)
    shardings = param_shardings(state, dual)
    placed = jax.tree.map(lambda v, s: jax.device_put(v, s), nnx.to_pure_dict(state),
                          nnx.to_pure_dict(shardings))
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    set_mesh(model, dual)
    return model


def set_mesh(model: nnx.Module, dual: DualMesh | None) -> nnx.Module:
    """Record the layout `dual` (None: unsharded) on every submodule with a `mesh` attribute."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "mesh"):
            node.mesh = dual
    return model


def state_shardings(abstract, dual: DualMesh):
    """Concrete shardings for any pytree of arrays or ShapeDtypeStructs (e.g. `jax.eval_shape` of a train
    state's init with placed params): each leaf keeps the mesh and spec its type carries (the mesh made
    concrete from `dual`); a leaf on no mesh (a step count) is replicated on the dense mesh. This is the
    one rule for optimizer state: the optimizer's init decides, and checkpoints restore onto it."""
    def one(leaf):
        mesh = mesh_of(leaf)
        if mesh is None:
            return dual.replicated()
        spec = leaf.sharding.spec if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf).sharding.spec
        return NamedSharding(dual.concrete(mesh), spec)

    return jax.tree.map(one, abstract)


def gather_sequence(x: jax.Array, axis: int = 1) -> jax.Array:
    """x with dimension `axis` (the sequence) gathered whole, every other dimension kept as sharded: a
    no-op unless that dimension is sharded (context parallelism)."""
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty or len(sharding.spec) <= axis or sharding.spec[axis] is None:
        return x
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    spec[axis] = None
    return jax.sharding.reshard(x, P(*spec))


def gather_whole(x: jax.Array) -> jax.Array:
    """x replicated on its mesh (e.g. an FSDP-sharded weight before use); a no-op when unsharded."""
    if any(axis is not None for axis in jax.typeof(x).sharding.spec):
        return jax.sharding.reshard(x, P())
    return x
