"""Leafwise work on trees whose leaves live on different meshes (the dual grid's dense and expert
meshes), and optax transformations that run once per mesh.

JAX rules this file encodes (Explicit axes; checked on jax 0.10.2):
- an op on arrays of mesh M must be traced with M (or no mesh) as the context mesh, so work on a leaf
  runs under `on_mesh(mesh_of(leaf))`, also inside `with dual_mesh:` (whose context is the dense mesh);
- no op may mix arrays of two meshes, replicated scalars included: a scalar computed on one mesh (a
  step count, the gradient norm, a hyperparameter that went through `jit`) is moved onto the leaf's
  mesh by `localize` (a replicated reshard over the same devices: no data moves) before they meet.
A leaf's mesh is read from the leaf itself: its type (`jax.typeof(x).sharding`) under a trace, its
concrete sharding in eager code (eager ops need a concrete context mesh); nothing here reads a
context variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.tree_paths import path_str


def mesh_of(x):
    """The mesh to run ops on `x` under: the concrete `Mesh` of a concrete array (eager code), the
    `AbstractMesh` of a traced one or of a ShapeDtypeStruct; None when `x` is on no mesh."""
    if isinstance(x, jax.ShapeDtypeStruct):
        mesh = getattr(x.sharding, "mesh", None)
    elif not isinstance(x, jax.Array):
        return None
    elif isinstance(x, jax.core.Tracer):
        # A traced array has no `.sharding`, only its type; asking for the attribute (`hasattr`) raises
        # an error whose message walks the whole trace so far: quadratic, most of a step's tracing time.
        mesh = jax.typeof(x).sharding.mesh
    else:
        mesh = getattr(x.sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def abstract(mesh):
    """A mesh's device-free description (what comparisons between meshes should use)."""
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh


def on_mesh(mesh):
    """The context for ops on arrays of `mesh`: the concrete mesh in eager code, the abstract one under
    a trace (nothing to do for None)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh) if isinstance(mesh, Mesh) else jax.sharding.use_abstract_mesh(mesh)


def localize(value, mesh):
    """`value` usable with arrays of `mesh`: a scalar array on another mesh is replicated onto `mesh`;
    Python numbers, NumPy values and mesh-less arrays are returned as they are."""
    source = mesh_of(value)
    if mesh is None or source is None or abstract(source) == abstract(mesh):
        return value
    if value.ndim:
        raise ValueError(f"cannot move a non-scalar {jax.typeof(value)} between meshes here")
    return jax.sharding.reshard(value, NamedSharding(mesh, P()))


def localize_tree(tree, mesh):
    """`localize` every scalar array of a pytree (e.g. the step counts of an optax state)."""
    return jax.tree.map(lambda v: localize(v, mesh) if isinstance(v, jax.Array) and not v.ndim else v, tree)


def tree_map(fn, tree, *rest):
    """jax.tree.map(fn, tree, *rest), each call traced on the mesh of `tree`'s leaf."""
    def one(x, *xs):
        with on_mesh(mesh_of(x)):
            return fn(x, *xs)

    return jax.tree.map(one, tree, *rest)


def where(ok: jax.Array, new, old):
    """jnp.where(ok, new, old) leafwise over any pytree (params, optimizer state); `ok` a bool scalar.
    Each result leaf lives where its `old` leaf does (a step count an update moved to another mesh comes
    back), so a state keeps its layout from step to step."""
    def one(a, b):
        mesh = mesh_of(b)
        with on_mesh(mesh):
            return jnp.where(localize(ok, mesh), localize(a, mesh), b)

    return jax.tree.map(one, new, old)


def scale(tree, factor: jax.Array):
    """Every leaf times the scalar `factor` (cast to the leaf's dtype), on the leaf's own mesh."""
    def one(x):
        mesh = mesh_of(x)
        with on_mesh(mesh):
            return x * localize(factor, mesh).astype(x.dtype)

    return jax.tree.map(one, tree)


def sum_of_squares(tree, mesh) -> jax.Array:
    """f32[] on `mesh`: the sum of squares of every leaf (the squared global norm), summed per mesh
    first so that only one scalar per mesh crosses over."""
    parts: dict[Any, jax.Array] = {}
    for x in jax.tree.leaves(tree):
        source = mesh_of(x)
        with on_mesh(source):
            part = jnp.sum(jnp.square(x.astype(jnp.float32)))
            key = abstract(source)
            parts[key] = parts[key] + part if key in parts else part
    total = jnp.zeros((), jnp.float32)
    for part in parts.values():
        total = total + localize(part, mesh)
    return total


# ------------------------------------------------------------------------------------------------
# Optimizers per mesh


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MeshGroups:
    """The static split of a tree's leaves by mesh, decided from the parameters given to `init`."""

    treedef: Any
    paths: tuple[str, ...]
    meshes: tuple[Any, ...]                 # one AbstractMesh (or None) per group, as at init
    members: tuple[tuple[int, ...], ...]    # flat leaf indices per group

    @classmethod
    def of(cls, tree) -> "MeshGroups":
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        groups: dict[Any, list[int]] = {}
        for i, (_, leaf) in enumerate(flat):
            groups.setdefault(abstract(mesh_of(leaf)), []).append(i)
        return cls(treedef, tuple(path_str(p) for p, _ in flat), tuple(groups),
                   tuple(tuple(m) for m in groups.values()))

    def split(self, tree) -> list[list]:
        leaves = self.treedef.flatten_up_to(tree)
        return [[leaves[i] for i in members] for members in self.members]

    def join(self, groups: list[list]):
        leaves: list = [None] * self.treedef.num_leaves
        for members, values in zip(self.members, groups):
            for i, value in zip(members, values):
                leaves[i] = value
        return self.treedef.unflatten(leaves)

    def check(self, tree, what: str) -> None:
        """Raise if `tree` has another structure or a leaf moved to another mesh since `init`."""
        if jax.tree.structure(tree) != self.treedef:
            raise ValueError(f"{what}: the tree differs from the parameters given to init:\n  init:   "
                             f"{self.treedef}\n  update: {jax.tree.structure(tree)}")
        leaves = jax.tree.leaves(tree)
        for mesh, members in zip(self.meshes, self.members):
            for i in members:
                if abstract(mesh_of(leaves[i])) != mesh:
                    raise ValueError(f"{what}: '{self.paths[i]}' lives on {mesh_of(leaves[i])}, but was on {mesh} "
                                     "at init: initialize the optimizer with the parameters as sharded")


class PerMeshState(NamedTuple):
    inner: tuple          # one inner state per mesh group
    groups: MeshGroups    # static


def per_mesh(make: Callable[[Any, tuple[int, ...]], optax.GradientTransformation]) -> optax.GradientTransformation:
    """An optax transformation run separately on the leaves of each mesh.

    make(mesh, members) -> the transformation for one group: it receives flat lists of that group's
    leaves (`members`: their indices in the flattened parameters, e.g. to select a mask), runs on
    `mesh` (`mesh_of` its leaves), and its state's scalars are localized onto `mesh` before each update.
    """

    def init(params):
        groups = MeshGroups.of(params)
        inner = []
        for members, leaves in zip(groups.members, groups.split(params)):
            mesh = mesh_of(leaves[0])
            with on_mesh(mesh):
                inner.append(make(mesh, members).init(leaves))
        return PerMeshState(tuple(inner), groups)

    def update(updates, state, params=None):
        groups = state.groups
        groups.check(updates, "per-mesh optimizer update")
        param_groups = groups.split(params) if params is not None else [None] * len(groups.members)
        out, inner = [], []
        for members, ups, ps, st in zip(groups.members, groups.split(updates), param_groups, state.inner):
            mesh = mesh_of(ups[0])
            with on_mesh(mesh):
                new_ups, new_state = make(mesh, members).update(ups, localize_tree(st, mesh), ps)
            out.append(new_ups)
            inner.append(new_state)
        return groups.join(out), PerMeshState(tuple(inner), groups)

    return optax.GradientTransformation(init, update)
