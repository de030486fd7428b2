"""Per-leaf code on the dual grid, whichever mesh each leaf lives on.

JAX rules this file encodes (checked on jax 0.10.2 with Explicit axes):
- an op on arrays of mesh M must run with M (or no mesh) as the context mesh, so code on an
  expert-mesh leaf runs under `on_mesh(expert)` even inside `jax.set_mesh(dense)`;
- no op may mix arrays of two meshes, and that includes replicated scalars: a step count or a
  hyperparameter that went through `jit` comes back committed to some mesh, so it is moved onto the
  leaf's mesh (`localize`, a replicated reshard, no data moves) before it meets the leaf;
- under a concrete context mesh (`jax.set_mesh(dense)`, as DualMesh does), a `shard_map` over another
  mesh given only as an AbstractMesh lowers its collectives with the context mesh's axis sizes (wrong
  replica groups for a shared axis name such as 'fsdp'); `concrete` rebuilds the concrete mesh from the
  context's device list, valid because both grids enumerate one device list in one order.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_of(x):
    """The mesh of x's sharding: the concrete `Mesh` for a concrete array, the `AbstractMesh` under a
    trace, None for an unsharded / mesh-less value."""
    if not isinstance(x, jax.Array):
        return None
    concrete = getattr(getattr(x, "sharding", None), "mesh", None) if not isinstance(x, jax.core.Tracer) else None
    if isinstance(concrete, Mesh) and not concrete.empty:
        return concrete
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def abstract(mesh):
    """A mesh's device-free description (what equality between meshes should compare)."""
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh


def on_mesh(mesh):
    """Context for ops on arrays of `mesh`: the concrete mesh for eager code, the abstract one under a
    trace (nothing to do for None)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh) if isinstance(mesh, Mesh) else jax.sharding.use_abstract_mesh(mesh)


def _context_mesh():
    """The concrete context mesh set by `jax.set_mesh`, also inside `jit` (no public accessor there)."""
    try:
        from jax._src.mesh import get_concrete_mesh
    except ImportError:  # pragma: no cover - a JAX without it: rely on the jit's device assignment
        return None
    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def concrete(mesh):
    """A mesh to give `shard_map`: `mesh` itself, or under a concrete context mesh of other axes, the
    concrete mesh with `mesh`'s axes over the context's devices in the context's order."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    context = _context_mesh()
    if context is None:
        return mesh
    if context.abstract_mesh == mesh:
        return context
    if context.size != mesh.size:
        raise ValueError(f"a leaf on {mesh} under a context mesh of {context.size} devices: both grids must "
                         "span the same devices")
    return Mesh(context.devices.reshape(mesh.axis_sizes), mesh.axis_names, axis_types=mesh.axis_types)


def localize(value, mesh):
    """`value` usable with arrays of `mesh`: a scalar array committed to another mesh is replicated onto
    `mesh`; Python numbers, NumPy values and mesh-less arrays are returned as they are."""
    source = mesh_of(value)
    if mesh is None or source is None or abstract(source) == abstract(mesh):
        return value
    if value.ndim:
        raise ValueError(f"cannot move a non-scalar {jax.typeof(value)} between meshes here")
    return jax.sharding.reshard(value, NamedSharding(mesh, P()))


def localize_tree(tree, mesh):
    """`localize` every scalar array of a pytree (e.g. the counts of an optax state)."""
    return jax.tree.map(lambda v: localize(v, mesh) if isinstance(v, jax.Array) and not v.ndim else v, tree)
