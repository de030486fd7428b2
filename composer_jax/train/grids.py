"""Leafwise work on a state that lives on two meshes (the dual grid's dense and expert meshes).

JAX traces an op on an Explicit-axes array under a context mesh that must be the array's own mesh,
and no op may mix arrays of both meshes (composer_jax.parallel.mesh). Parameters, gradients and
optimizer moments of routed experts live on the expert mesh, everything else on the dense mesh. So
leafwise work (gradient accumulation, the optimizer update, the finite guard) runs per group: the
leaves of each mesh as a flat list, traced under that mesh (`scope`), and only scalars cross between
meshes (`to_dense` / `to_group`). Without a DualMesh there is one group and no scoping.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

GROUPS = ("dense", "expert")


class Grids:
    """The static split of a params-shaped pytree into its dense-mesh and expert-mesh leaves."""

    def __init__(self, param_shardings, dual=None):
        """param_shardings: a pytree of jax.sharding.Sharding mirroring the params (or of anything, with
        dual=None: one group)."""
        self.dual = dual
        leaves, self.treedef = jax.tree.flatten(param_shardings)
        expert_names = None if dual is None else dual.expert.axis_names
        is_expert = [expert_names is not None and isinstance(s, NamedSharding) and s.mesh.axis_names == expert_names
                     for s in leaves]
        self.index = {"dense": [i for i, e in enumerate(is_expert) if not e],
                      "expert": [i for i, e in enumerate(is_expert) if e]}

    def split(self, tree) -> dict[str, list]:
        """params-shaped tree -> {"dense": [leaves], "expert": [leaves]}."""
        leaves = self.treedef.flatten_up_to(tree)
        return {g: [leaves[i] for i in idx] for g, idx in self.index.items()}

    def join(self, groups: dict[str, list]):
        """The inverse of `split`."""
        leaves = [None] * self.treedef.num_leaves
        for g, idx in self.index.items():
            for i, leaf in zip(idx, groups[g]):
                leaves[i] = leaf
        return self.treedef.unflatten(leaves)

    def scope(self, group: str):
        """The trace-time context for ops on `group`'s arrays."""
        if group == "expert" and self.dual is not None:
            return self.dual.expert_scope()
        return contextlib.nullcontext()

    def _replicated(self, group: str):
        return NamedSharding(self.dual.expert if group == "expert" else self.dual.dense, P())

    def to_dense(self, x: jax.Array, group: str) -> jax.Array:
        """A replicated array computed on `group`'s mesh, moved to the dense mesh."""
        if group == "dense" or self.dual is None:
            return x
        return jax.sharding.reshard(x, self._replicated("dense"))

    def to_group(self, x: jax.Array, group: str) -> jax.Array:
        """A replicated dense-mesh array moved to `group`'s mesh."""
        if group == "dense" or self.dual is None:
            return x
        return jax.sharding.reshard(x, self._replicated(group))

    def map(self, fn, *trees):
        """jax.tree.map(fn, *trees) over params-shaped trees, each leaf traced under its mesh."""
        split = [self.split(t) for t in trees]
        out = {}
        for g in GROUPS:
            with self.scope(g):
                out[g] = [fn(*leaves) for leaves in zip(*(s[g] for s in split))]
        return self.join(out)

    def mesh_group(self, x) -> str:
        """'expert' if the (traced) array lives on the expert mesh, else 'dense'."""
        if self.dual is None:
            return "dense"
        mesh = jax.typeof(x).sharding.mesh
        return "expert" if not mesh.empty and mesh.axis_names == self.dual.expert.axis_names else "dense"

    def select(self, ok: jax.Array, new, old):
        """jnp.where(ok, new, old) leafwise over any pytree (e.g. optimizer state), each leaf on its mesh;
        `ok` is a dense-mesh bool scalar."""
        flags = {g: self.to_group(ok, g) for g in GROUPS} if self.dual is not None else {"dense": ok}

        def one(a, b):
            g = self.mesh_group(a)
            with self.scope(g):
                return jnp.where(flags[g], a, b)

        return jax.tree.map(one, new, old)

    def scale(self, tree, factor: jax.Array):
        """Every leaf of a params-shaped tree times a dense-mesh scalar, on its own mesh."""
        groups = self.split(tree)
        out = {}
        for g in GROUPS:
            f = self.to_group(factor, g)
            with self.scope(g):
                out[g] = [x * f.astype(x.dtype) for x in groups[g]]
        return self.join(out)

    def sum_of_squares(self, tree) -> jax.Array:
        """f32[] on the dense mesh: the sum of squares of every leaf (the squared global norm)."""
        total = jnp.zeros((), jnp.float32)
        for g, leaves in self.split(tree).items():
            if not leaves:
                continue
            with self.scope(g):
                part = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
            total = total + self.to_dense(part, g)
        return total
