"""Logical axis names -> PartitionSpecs: one rule table per grid, one for activations.

Every parameter carries logical `axes` metadata (composer_jax.model.layers). A parameter with an
`experts` axis lives on the expert grid; every other one on the dense grid. Within a grid, each
dimension takes the mesh axes its logical name lists, first fit in dimension order, each mesh axis at
most once per tensor and only where it divides the dimension. Vectors (norm scales, router bias) stay
replicated: they are tiny and read by every token. Optimizer state is sharded as the optimizer's init
places it (`state_shardings`), i.e. like its parameter.

Inference placement (`DualMesh.for_inference()`, what the decode engine runs on): a decode step reads
every dense weight for a handful of tokens, so FSDP would all-gather each weight once per token. Dense
weights are replicated instead (no collective in a step), routed experts stay split over `ep` (not
`efsdp`: no per-step gather either) and tokens reach them through the expert dispatch. Decode batches
(the engine's slots) are split over the data axes where they divide, and replicated otherwise, so a
batch of one works on any grid; the expert dispatch pads and spreads the tokens of a replicated batch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
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
# Inference: dense weights replicated, experts over `ep` only.
INFERENCE_DENSE_PARAM_RULES: dict[str, tuple[str, ...]] = {}
INFERENCE_EXPERT_PARAM_RULES: dict[str, tuple[str, ...]] = {"experts": ("ep",)}
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,               # dense mesh
    "seq": ("cp",),                    # dense mesh
    "tokens": DENSE_TOKEN_AXES,        # flattened batch * seq, dense mesh
    "expert_tokens": EXPERT_TOKEN_AXES,
}


def grid_of(axes: tuple[str, ...]) -> str:
    return "expert" if "experts" in axes else "dense"


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], sizes: dict[str, int], inference: bool = False) -> P:
    """The PartitionSpec of one parameter from its logical axes, shape and the mesh axis sizes
    (training rules, or the inference placement's)."""
    if sum(a != "layers" for a in axes) < 2:
        return P(*([None] * len(shape)))
    expert = grid_of(axes) == "expert"
    if inference:
        rules = INFERENCE_EXPERT_PARAM_RULES if expert else INFERENCE_DENSE_PARAM_RULES
    else:
        rules = EXPERT_PARAM_RULES if expert else DENSE_PARAM_RULES
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
        spec = spec_for(axes, tuple(var.get_value().shape), dual.sizes, dual.inference)
        return var.replace(NamedSharding(mesh, spec))

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
    record_layout(model, dual)
    return model


def record_layout(model: nnx.Module, dual: DualMesh | None) -> nnx.Module:
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


def row_shards(x: jax.Array) -> tuple[tuple[str, ...], int]:
    """The mesh axes that shard x's leading (row) dimension, and how many shards they make: ((), 1) when
    that dimension is whole."""
    sharding = jax.typeof(x).sharding
    first = sharding.spec[0] if not sharding.mesh.empty and len(sharding.spec) else None
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    n = 1
    for axis in axes:
        n *= sharding.mesh.shape[axis]
    return axes, n


def split_by_row_shard(x: jax.Array, like: jax.Array | None = None) -> jax.Array:
    """[rows, ...] -> [n, rows / n, ...]: the n row shards of x (or of `like`, whose rows x's follow) as a
    leading dimension, each on its devices."""
    axes, n = row_shards(x if like is None else like)
    shape = (n, x.shape[0] // n, *x.shape[1:])
    if not axes:
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=P(axes, *[None] * (x.ndim)))


def copy_per_row_shard(w: jax.Array, rows: jax.Array) -> jax.Array:
    """w (whole) -> [n, *w.shape]: one copy of w beside each of the n row shards of `rows`.

    For a loop over chunks of the rows that uses w whole (the output head in a chunked loss): used as a
    copy per shard, w's gradient is summed over the chunks on each shard's devices, and the copies'
    gradients meet in one all-reduce after the loop instead of an all-reduce of a w-sized gradient per
    chunk. (The backward sums the copies on their devices first; autodiff's own transpose would gather
    all n copies to every device, then sum.)"""
    axes, n = row_shards(rows)
    return _copies(w, n, P(axes, *[None] * w.ndim) if axes else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _copies(w, n: int, spec):
    copies = jnp.broadcast_to(w[None], (n, *w.shape))
    return jax.sharding.reshard(copies, spec) if spec is not None else copies


def _copies_fwd(w, n, spec):
    return _copies(w, n, spec), None


def _copies_bwd(n, spec, _, g):
    return (jnp.sum(g, axis=0),)


_copies.defvjp(_copies_fwd, _copies_bwd)


def merge_row_shards(x: jax.Array) -> jax.Array:
    """[n, rows / n, ...] -> [rows, ...], the inverse of `split_by_row_shard`."""
    axes, _ = row_shards(x)
    shape = (x.shape[0] * x.shape[1], *x.shape[2:])
    if not axes:
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=P(axes, *[None] * (x.ndim - 2)))


def expert_dispatch_specs(dual: DualMesh) -> tuple[P, P, P]:
    """PartitionSpecs of the stacked routed-expert weights (gate [E, embed, f], up, down [E, f, embed])
    inside the expert-mesh dispatch: experts over `ep`; in training also the embed dim over `efsdp`
    (expert FSDP, gathered per use), which the inference placement leaves whole."""
    embed = None if dual.inference else "efsdp"
    return P("ep", embed, None), P("ep", embed, None), P("ep", None, embed)


def inference_batch_axes(dual: DualMesh, batch: int) -> tuple[str, ...] | None:
    """The dense-mesh axes a decode batch of `batch` rows is split over: the data axes when they divide
    it, else none (replicated: every device runs the whole small batch through the replicated weights)."""
    data = 1
    for axis in BATCH_AXES:
        data *= dual.sizes[axis]
    return BATCH_AXES if batch % data == 0 else None


def inference_batch_sharding(dual: DualMesh, shape: tuple[int, ...], batch_dim: int = 0) -> NamedSharding:
    """Where an inference array of `shape` lives: its `batch_dim` split by `inference_batch_axes`."""
    spec = [None] * len(shape)
    spec[batch_dim] = inference_batch_axes(dual, shape[batch_dim])
    return NamedSharding(dual.dense, P(*spec))


def flatten_tokens(x: jax.Array, sizes: dict[str, int]) -> jax.Array:
    """x: [batch, seq, embed] in the training layout (batch over the batch axes, seq over cp) -> [batch *
    seq, embed] over every dense token axis, each device keeping its own tokens (its rows' slices of its
    sequence block, row-major). A plain reshape orders the tokens batch-major over the whole batch, which
    moves them between devices (an all-to-all each way, each layer) once a device holds two rows or more
    and cp > 1. The MoE is per token, so the order does not change its result; `unflatten_tokens` undoes it."""
    b, s, d = x.shape
    rows, cp = math.prod(sizes[a] for a in BATCH_AXES), sizes["cp"]
    x = jnp.reshape(x, (rows, b // rows, cp, s // cp, d), out_sharding=P(BATCH_AXES, None, "cp", None, None))
    return jnp.reshape(jnp.transpose(x, (0, 2, 1, 3, 4)), (b * s, d), out_sharding=P(DENSE_TOKEN_AXES, None))


def unflatten_tokens(y: jax.Array, shape: tuple[int, int, int], sizes: dict[str, int]) -> jax.Array:
    """The inverse of `flatten_tokens`: y [batch * seq, embed] -> [batch, seq, embed] (`shape`) in the
    training layout, without a collective."""
    b, s, d = shape
    rows, cp = math.prod(sizes[a] for a in BATCH_AXES), sizes["cp"]
    y = jnp.reshape(y, (rows, cp, b // rows, s // cp, d), out_sharding=P(BATCH_AXES, "cp", None, None, None))
    return jnp.reshape(jnp.transpose(y, (0, 2, 1, 3, 4)), shape, out_sharding=P(BATCH_AXES, "cp", None))


def spread_tokens(tokens: jax.Array, dual: DualMesh) -> jax.Array:
    """[tokens, ...] of an inference batch (split over the data axes or replicated) -> split over every
    dense token axis, as the expert dispatch takes them, zero-padded to a multiple of the device count."""
    count, devices = tokens.shape[0], dual.dense.size
    pad = -count % devices
    if pad:
        tokens = jnp.concatenate([tokens, jnp.zeros((pad,) + tokens.shape[1:], tokens.dtype)])
    return jax.sharding.reshard(tokens, P(DENSE_TOKEN_AXES, *([None] * (tokens.ndim - 1))))


def unspread_tokens(y: jax.Array, count: int, spec: P) -> jax.Array:
    """The first `count` rows of `spread_tokens` output `y`, back in their batch placement `spec`."""
    y = jax.sharding.reshard(y, spec)
    return y if y.shape[0] == count else y[:count]
