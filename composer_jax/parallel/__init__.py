"""Dual-grid HSDP: the dense and expert meshes, the logical-axis partitioning rules and leafwise work
across the two meshes."""

from composer_jax.parallel.mesh import DualMesh
from composer_jax.parallel.partitioning import param_shardings, record_layout, shard_model, state_shardings

__all__ = ["DualMesh", "param_shardings", "record_layout", "shard_model", "state_shardings"]
