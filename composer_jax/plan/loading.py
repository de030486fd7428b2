"""Host memory of starting a run from a model source (`train.init_from`, RL's `init_from`), per host, from
the configs alone: how `checkpoint/stream.py` streams the weights into their shards.

Each leaf is built from the slices this host's devices hold: a stacked leaf larger than the chunk size one
stack index (layer) at a time, any other leaf whole. While a leaf (or its stack index) is built the host
holds its distinct local shards in the run's parameter dtype, plus one source tensor's block being read:
rows along the tensor's row dimension, all columns, at most the chunk size (float32 once INT4 or FP8 is
dequantized). The peak is the largest such sum over the leaves (leaves are built one after another).
"""

from __future__ import annotations

import dataclasses
import math

from composer_jax.checkpoint.stream import DEFAULT_CHUNK_BYTES
from composer_jax.config import ModelConfig
from composer_jax.plan.state import param_leaves

STACKS = ("dense_layers", "moe_layers", "mtp")


@dataclasses.dataclass(frozen=True)
class LoadingPeak:
    bytes: int            # the peak, per host
    leaf: str             # the leaf being built at the peak
    held: int             # its distinct local shards (one stack index of a large stacked leaf)
    read: int             # one source tensor's block being read and converted

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def loading_peak(cfg: ModelConfig, sizes: dict[str, int], devices_per_host: int, read_itemsize: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LoadingPeak:
    """The host peak of loading `cfg`'s parameters onto a layout of mesh `sizes` with `devices_per_host`
    devices a host; `read_itemsize`: bytes per value of the source as read (4 for INT4 / FP8, dequantized)."""
    from composer_jax.checkpoint.hf import plan_leaves
    from composer_jax.model import abstract_params

    tensors = {leaf.path: leaf.plan for leaf in plan_leaves(abstract_params(cfg), cfg)}
    best = LoadingPeak(0, "", 0, 0)
    for leaf in param_leaves(cfg, sizes):
        stacked = leaf.path[0] in STACKS and len(leaf.shape) > 1
        one_index = stacked and math.prod(leaf.shape) * leaf.itemsize > chunk_bytes
        full, local = (leaf.shape[1:], leaf.local_shape[1:]) if one_index else (leaf.shape, leaf.local_shape)
        held = leaf.itemsize * min(math.prod(full), math.prod(local) * devices_per_host)
        plan = tensors[leaf.path]
        n, k = plan.ndim, next(iter(plan.flat)).linear_in
        inner, local_inner = leaf.shape[n:], leaf.local_shape[n:]
        row = read_itemsize * math.prod(inner) // inner[k]      # one index of the tensor's row dimension
        read = min(row * local_inner[k], max(row, chunk_bytes))
        if held + read > best.bytes:
            best = LoadingPeak(held + read, ".".join(leaf.path), held, read)
    return best
