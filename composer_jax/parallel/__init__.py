"""Dual-grid HSDP: the dense and expert meshes and the logical-axis partitioning rules."""

from composer_jax.parallel.mesh import DualMesh, current
from composer_jax.parallel.partitioning import param_shardings, shard_model

__all__ = ["DualMesh", "current", "param_shardings", "shard_model"]
