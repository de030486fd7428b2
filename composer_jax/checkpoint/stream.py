"""Parameters streamed from a checkpoint straight into their device shards, with host memory bounded.

A leaf is built from a *slice reader* (`read(index) -> np.ndarray`, index a tuple of slices of the
leaf's full shape) by `jax.make_array_from_callback`: each process reads exactly the slices its own
devices hold. A large stacked leaf (leading `layers` / `depths` axis, never sharded) is built one stack
index at a time and written into a donated buffer on the devices, so the host holds at most one stack
index of one leaf (this process's shards of it) at once: for Kimi K2.5, one layer of one expert weight.

Readers: `hf_reader` (a Hugging Face tensor plan, dequantizing INT4 / FP8 on read: checkpoint/hf.py)
and `orbax_reader` (any orbax PyTree checkpoint leaf: converted directories and training checkpoints).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np

from composer_jax.checkpoint.hf import Leaf, read_block
from composer_jax.checkpoint.quant import TensorReader

Reader = Callable[[tuple[slice, ...]], np.ndarray]
DEFAULT_CHUNK_BYTES = 64 << 20    # a stacked leaf larger than this is built one stack index at a time


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` with every slice made explicit (start, stop) within `shape`."""
    full = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(full, shape))


def hf_reader(reader: TensorReader, leaf: Leaf, dtype, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Reader:
    """Slices of `leaf` read from its HF tensors, as `dtype`: each tensor's rows in range only, at most
    `chunk_bytes` of them (counted as float32, as INT4 / FP8 dequantize) at a time."""
    n = leaf.plan.ndim

    def read(index):
        index = _bounds(index, leaf.shape)
        plan, inner = leaf.plan[index[:n] + (Ellipsis,)], index[n:]    # an array, also for no stack dims
        out = np.empty(plan.shape + tuple(s.stop - s.start for s in inner), dtype)
        for pos, t in np.ndenumerate(plan):
            k, (start, stop) = t.linear_in, (inner[t.linear_in].start, inner[t.linear_in].stop)
            step = max(1, chunk_bytes // (4 * math.prod(leaf.inner) // leaf.inner[k]))
            for a in range(start, stop, step):
                b = min(stop, a + step)
                block = read_block(reader, t, leaf.inner, a, b, dtype)
                keep = tuple(slice(None) if d == k else s for d, s in enumerate(inner))
                rows = tuple(slice(a - start, b - start) if d == k else slice(None) for d in range(len(inner)))
                out[pos + rows] = block[keep]
        return out

    return read


def orbax_reader(store, dtype) -> Reader:
    """Slices of an orbax leaf (a tensorstore, e.g. `OrbaxTree.open(path)`), as `dtype`."""
    return lambda index: np.asarray(store[index].read().result()).astype(dtype, copy=False)


def _cached(read: Reader, shape: tuple[int, ...]) -> Reader:
    """`read` of explicit slices within `shape`, once per distinct slice: replicated shards share it."""
    seen = {}

    def get(index):
        index = _bounds(index, shape)
        key = tuple((s.start, s.stop) for s in index)
        if key not in seen:
            seen[key] = read(index)
        return seen[key]

    return get


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _write_index(sharding):
    return jax.jit(lambda buf, part, i: jax.lax.dynamic_update_slice_in_dim(buf, part, i, 0),
                   donate_argnums=0, out_shardings=sharding)


def place(target: jax.ShapeDtypeStruct, read: Reader, stacked: bool = False,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> jax.Array:
    """The array `target` describes (shape, dtype, sharding), its shards filled by `read`; a `stacked`
    leaf of more than `chunk_bytes` one stack index at a time (smaller ones whole: no device program)."""
    shape, sharding = tuple(target.shape), target.sharding
    spec = getattr(sharding, "spec", ())
    small = math.prod(shape) * np.dtype(target.dtype).itemsize <= chunk_bytes
    if small or not stacked or len(shape) < 2 or shape[0] == 1 or (len(spec) and spec[0] is not None):
        return jax.make_array_from_callback(shape, sharding, _cached(read, shape))
    out = _zeros(shape, target.dtype, sharding)()
    part_shape = (1,) + shape[1:]
    for i in range(shape[0]):
        part = jax.make_array_from_callback(part_shape, sharding, _cached(
            lambda index, i=i: read((slice(i, i + 1),) + index[1:]), part_shape))
        out = _write_index(sharding)(out, part, i)
    return out
