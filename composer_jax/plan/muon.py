"""Muon's Newton-Schulz work per device on a layout, from the exchange plan itself
(`optim.orthogonalize_plan.plan_groups` over leaf descriptions on abstract meshes): no devices needed."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from optax.contrib import MuonDimensionNumbers

from composer_jax.config import ModelConfig
from composer_jax.model.accounting import abstract_model
from composer_jax.optim.muon import DEFAULT_CHUNKS, DEFAULT_NS_STEPS
from composer_jax.optim.newton_schulz import ns_flops
from composer_jax.optim.orthogonalize_plan import describe_leaf, matrix_view, ns_flops_per_device, plan_groups
from composer_jax.optim.param_labels import dimension_numbers
from composer_jax.parallel.mesh import DENSE_AXES, EXPERT_AXES
from composer_jax.parallel.partitioning import grid_of, spec_for


@dataclasses.dataclass(frozen=True)
class NSShare:
    """Newton-Schulz FLOPs of one Muon step: per device as planned, and the even share total / devices."""

    devices: int
    matrices: int
    per_device: int
    total: int

    @property
    def even_share(self) -> float:
        return self.total / self.devices

    @property
    def ratio(self) -> float:
        return self.per_device / self.even_share


def abstract_meshes(sizes: dict[str, int]) -> dict[str, AbstractMesh]:
    """The dense and expert meshes of a layout as AbstractMeshes (Explicit axes, as DualMesh builds)."""
    def mesh(axes):
        return AbstractMesh(tuple(sizes[a] for a in axes), axes, axis_types=(AxisType.Explicit,) * len(axes))

    return {"dense": mesh(DENSE_AXES), "expert": mesh(EXPERT_AXES)}


def ns_share(cfg: ModelConfig, sizes: dict[str, int], steps: int = DEFAULT_NS_STEPS, chunks: int = DEFAULT_CHUNKS,
             ns_dtype: str = "float32") -> NSShare:
    """The planned NS FLOPs per device of `cfg`'s Muon matrices on a layout of `sizes` (split layers
    included, as `optim.muon` runs them)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    dims = jax.tree.leaves(dimension_numbers(state), is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    meshes = abstract_meshes(sizes)
    leaves, total, matrices = [], 0, 0
    for var, d in zip(variables, dims):
        if d is None:
            continue
        shape, axes = tuple(var.get_value().shape), tuple(var.get_metadata("axes"))
        view = matrix_view(shape, d.reduction_axis, d.output_axis)
        mesh = meshes[grid_of(axes)]
        leaves.append(describe_leaf(len(leaves), shape, jnp.dtype(ns_dtype), view, mesh, spec_for(axes, shape, sizes)))
        count = math.prod(shape[a] for a in view.batch)
        matrices += count
        total += count * ns_flops(math.prod(shape[a] for a in view.rows), math.prod(shape[a] for a in view.cols), steps)
    devices = meshes["dense"].size
    per_device = ns_flops_per_device(plan_groups(leaves, chunks, split=True), steps)
    return NSShare(devices, matrices, per_device, total)

