"""Rollout batches onto the devices (after host-side validation, rl/batch.py `validate_batch`).

Each process hands over its own rows; `jax.make_array_from_process_local_data` assembles them into
global arrays with the rows sharded over the dense mesh's data-parallel axes (multi-host ready, as
train/batches.py does for pretraining). The step gathers the batch whole before the model places each
micro-batch on the dense grid itself (rl/objective.py). Every process must hand over the same number
of rows, in whole groups with globally unique group ids.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.parallel import DualMesh
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.rl.batch import BatchError, RolloutBatch


def global_rows(batch: RolloutBatch) -> int:
    """The step's rows over all processes (each hands over as many as this one)."""
    return int(np.shape(batch.tokens)[0]) * jax.process_count()


def process_rows(x, axis: int = 0) -> np.ndarray:
    """This process's share of an array every process holds whole: its contiguous block along `axis` (the
    rows its devices hold under a mesh ordered process by process, `parallel.distributed.process_major_devices`)."""
    x = np.asarray(x)
    n = jax.process_count()
    if x.shape[axis] % n:
        raise BatchError("tokens", f"{x.shape[axis]} rows do not split evenly over the {n} processes")
    return np.split(x, n, axis=axis)[jax.process_index()]


def data_shards(dual: DualMesh | None) -> int:
    """How many ways rows are split: the dense mesh's data-parallel size (1 without a DualMesh)."""
    return 1 if dual is None else math.prod(dual.dense.shape[axis] for axis in BATCH_AXES)


def device_batch(batch: RolloutBatch, dual: DualMesh | None) -> RolloutBatch:
    """This process's rows [B_local, ...] -> global arrays [B, ...] with rows sharded over the dense
    mesh's batch axes; unsharded arrays on the default device without a DualMesh."""
    if dual is None:
        return jax.tree.map(jax.device_put, batch)
    shards = data_shards(dual)
    rows = global_rows(batch)
    if rows % shards:
        raise BatchError("tokens", f"{rows} rows do not split evenly over the {shards} data-parallel shards "
                                   f"(dense mesh {' x '.join(BATCH_AXES)})")

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(NamedSharding(dual.dense, P(BATCH_AXES, *[None] * (x.ndim - 1))),
                                                      x)

    return jax.tree.map(place, batch)
