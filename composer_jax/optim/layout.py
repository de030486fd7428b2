"""Muon's batched, sharded orthogonalization, executed from the static plan of `optim.orthogonalize_plan`:
every matrix of every Muon leaf is orthogonalized exactly once, on one device, as part of a same-shape
batch, and comes back in its leaf's own shape, axis order and sharding.

Per bucket, `_gather` (a `shard_map` over the bucket's mesh) turns the leaves' local blocks into whole
matrices with all-to-alls, one array per piece; per chunk, the group's pieces are moved onto the home
bucket's mesh (no data moves: the meshes enumerate the same devices in one order), stacked, run
through NS and split back; a split layer (`orthogonalize_plan.SplitLayer`) is normalised whole, cut into
column blocks over the devices and run through the split NS steps (`_orthogonalize_split`); `_scatter`
returns each bucket's matrices to its leaves. Leaves on a mesh with non-Explicit axes, or without a
mesh, are handled in the global view (XLA partitions that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.optim.orthogonalize_plan import (Bucket, MatrixView, check_meshes, leaf_info, matrix_view,
                                                   plan_groups, split_width)
from composer_jax.parallel.leafwise import on_mesh

__all__ = ["MatrixView", "SplitNS", "check_meshes", "matrix_view", "orthogonalize"]


class SplitNS(NamedTuple):
    """The two halves of NS that a split layer runs apart (`newton_schulz.normalize` and `split_steps`):
    normalize(x [..., m, n]) on whole matrices; steps(block [r, m, w], reduce) on column blocks."""

    normalize: Callable[[jax.Array], jax.Array]
    steps: Callable[[jax.Array, Callable[[jax.Array], jax.Array]], jax.Array]


def _shard_map(fn, bucket: Bucket, in_specs, out_specs, check_vma=True):
    if bucket.mesh is None:
        return fn
    mapped = jax.shard_map(fn, mesh=bucket.concrete, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def run(*args):
        with on_mesh(bucket.placement):
            return mapped(*args)

    return run


def _all_to_all(x: jax.Array, axes: tuple[str, ...], sizes: tuple[int, ...], split: int, concat: int) -> jax.Array:
    """`jax.lax.all_to_all(x, axes, split, concat, tiled=True)` as one single-axis all-to-all per mesh axis.

    XLA in jax 0.11 aborts (`Adjacent axes in dimension sharding can be merged`) on a collective over
    several axes of one mesh when the program also holds arrays of the other grid and those axes map to
    adjacent pieces of one of its axes; single-axis collectives are unaffected. Chunk g of the split
    dimension goes to the device of row-major coordinates g over `axes`; received chunks are
    concatenated in that order.
    """
    if len(axes) == 1:
        return jax.lax.all_to_all(x, axes[0], split, concat, tiled=True)
    k, group = len(axes), math.prod(sizes)
    shape = x.shape
    x = x.reshape(shape[:split] + tuple(sizes) + (shape[split] // group,) + shape[split + 1:])
    for i, name in enumerate(axes):  # destination coordinate i -> source coordinate i
        x = jax.lax.all_to_all(x, name, split + i, split + i, tiled=False)
    c = split + k if concat == split else concat if concat < split else concat + k
    c = c - k if c > split else c                                   # its index once the k dims move
    x = jnp.moveaxis(x, list(range(split, split + k)), [c + i for i in range(k)])
    return x.reshape(x.shape[:c] + (group * x.shape[c + k],) + x.shape[c + k + 1:])


def _all_gather(x: jax.Array, axes: tuple[str, ...], axis: int) -> jax.Array:
    """Tiled `jax.lax.all_gather` over several mesh axes (row-major), one axis at a time (see `_all_to_all`)."""
    for name in reversed(axes):
        x = jax.lax.all_gather(x, name, axis=axis, tiled=True)
    return x


def _sizes(bucket: Bucket, axes: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(bucket.mesh.shape[a] for a in axes)


def _stack_spec(bucket: Bucket):
    return P(tuple(bucket.mesh.axis_names)) if bucket.mesh is not None else None


def _rotate_last(x: jax.Array, shift: int) -> jax.Array:
    """x: [layers, slots, ...]; rotate the last layer's slots by `shift`."""
    if not shift:
        return x
    return jnp.concatenate([x[:-1], jnp.roll(x[-1:], shift, axis=1)])


def _gather(bucket: Bucket, blocks: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Leaves -> this device's whole matrices: one array [size, m, n] per piece."""
    k, slots, layers = bucket.k, bucket.slots, bucket.layers
    local_mat, m, n = bucket.local_matrix(), bucket.first.m, bucket.first.n

    def local(*blocks):
        x = jnp.concatenate([blk.transpose(leaf.view.perm).reshape((-1,) + local_mat)
                             for leaf, blk in zip(bucket.leaves, blocks)])
        x = jnp.pad(x, [(0, layers * slots - x.shape[0])] + [(0, 0)] * len(local_mat))
        x = _rotate_last(x.reshape((layers, slots) + local_mat), bucket.offset)
        x = jnp.swapaxes(x, 0, 1).reshape((slots * layers,) + local_mat)  # slot-major
        if bucket.replicated:  # identical copies: each device keeps its own share, no communication
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(bucket.replicated) * (k * layers), k * layers)
        x = x.reshape((k, layers) + local_mat)  # row j goes to the j-th device of the all-to-all
        out = []
        for piece in bucket.pieces:
            y = x[:, piece.first:piece.first + piece.size].reshape((k * piece.size,) + local_mat)
            for pos, axes in bucket.gathered:
                if bucket.needs_cpu_barrier:
                    y = jax.lax.optimization_barrier(y)
                y = _all_to_all(y, axes, _sizes(bucket, axes), 0, 1 + pos)
            out.append(y.reshape(piece.size, m, n))
        return tuple(out)

    in_specs = tuple(leaf.spec for leaf in bucket.leaves)
    return _shard_map(local, bucket, in_specs, (_stack_spec(bucket),) * len(bucket.pieces))(*blocks)


def _scatter(bucket: Bucket, pieces: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Inverse of `_gather`: whole matrices back to every leaf's own layout and sharding."""
    k, slots, layers = bucket.k, bucket.slots, bucket.layers
    local_mat, global_mat = bucket.local_matrix(), bucket.global_matrix()

    def local(*pieces):
        parts = []
        for y, piece in zip(pieces, bucket.pieces):
            y = y.reshape((piece.size,) + global_mat)
            for pos, axes in reversed(bucket.gathered):
                y = _all_to_all(y, axes, _sizes(bucket, axes), 1 + pos, 0)
            parts.append(y.reshape((k, piece.size) + local_mat))
        x = jnp.concatenate(parts, axis=1).reshape((k * layers,) + local_mat)
        if bucket.replicated:
            x = _all_gather(x, bucket.replicated, axis=0)
        x = _rotate_last(jnp.swapaxes(x.reshape((slots, layers) + local_mat), 0, 1), -bucket.offset)
        x = x.reshape((slots * layers,) + local_mat)
        out, start = [], 0
        for leaf in bucket.leaves:
            part = x[start:start + leaf.local_batch]
            start += leaf.local_batch
            perm_shape = tuple(leaf.local(d) for d in leaf.view.perm)
            inverse = sorted(range(len(perm_shape)), key=lambda i: leaf.view.perm[i])
            out.append(part.reshape(perm_shape).transpose(inverse))
        return tuple(out)

    out_specs = tuple(leaf.spec for leaf in bucket.leaves)
    # The all-gather makes the result identical over the replicated axes, which the vma check cannot see.
    return _shard_map(local, bucket, (_stack_spec(bucket),) * len(pieces), out_specs, check_vma=False)(*pieces)


def _to_mesh(x: jax.Array, src: Bucket, dst: Bucket) -> jax.Array:
    """Move a stack [devices * size, m, n] between meshes over the same devices (no data moves when
    both enumerate the devices in the same order)."""
    if src.mesh == dst.mesh:
        return x
    with on_mesh(dst.placement):
        return jax.sharding.reshard(x, NamedSharding(dst.mesh, _stack_spec(dst)))


def _orthogonalize_split(bucket: Bucket, x: jax.Array, real: tuple[int, ...], split: SplitNS) -> jax.Array:
    """One split layer: x [devices, m, n] on `bucket`'s mesh, one matrix per device (real ones at the
    positions `real`, zeros elsewhere) -> its NS, the same layout. Each matrix is normalised whole, then
    cut into one column block per device (an all-to-all); every device runs the steps on its blocks of
    the real matrices, with Gram matrices summed over all devices, and the blocks go back."""
    devices, (m, n) = bucket.num_devices, x.shape[-2:]
    width = split_width(n, devices)
    axes = tuple(bucket.mesh.axis_names)
    sizes, real = _sizes(bucket, axes), np.asarray(real)

    def reduce(a):  # one single-axis psum per mesh axis (see `_all_to_all`)
        for name in axes:
            a = jax.lax.psum(a, name)
        return a

    def exchange(a):
        if bucket.needs_cpu_barrier:
            a = jax.lax.optimization_barrier(a)
        return _all_to_all(a, axes, sizes, 0, 0)

    def local(x):  # x [1, m, n] -> its column blocks, block j to device j -> [devices, m, width]
        x = jnp.pad(x[0], [(0, 0), (0, devices * width - n)])
        blocks = exchange(jnp.swapaxes(x.reshape(m, devices, width), 0, 1))   # row s: my block of device s's
        out = jnp.zeros_like(blocks).at[real].set(split.steps(blocks[real], reduce))
        out = jnp.swapaxes(exchange(out), 0, 1).reshape(m, devices * width)   # my matrix, whole again
        return out[None, :, :n]

    x = split.normalize(x)
    with on_mesh(bucket.placement):
        return _shard_map(local, bucket, (_stack_spec(bucket),), _stack_spec(bucket))(x)


def orthogonalize(xs: Sequence[jax.Array], views: Sequence[MatrixView],
                  ns: Callable[[jax.Array], jax.Array], chunks: int = 1, meshes: Sequence[Mesh] = (),
                  split: SplitNS | None = None) -> list[jax.Array]:
    """Apply `ns` ([..., m, n] -> [..., m, n], independently per matrix, m <= n) to every matrix of
    every leaf; each leaf comes back in its own shape, axis order and sharding, in `ns`'s output dtype.

    xs: the leaves; views: their `MatrixView`s; chunks: runs each same-shape group is cut into;
    meshes: the concrete meshes of the leaves (needed when they live on more than one; `check_meshes`);
    split: `ns` in two halves (`SplitNS`), which lets the plan split a layer of a few matrices into
    column blocks over all devices where that costs less (`orthogonalize_plan`); None: never split.
    """
    check_meshes(xs, [f"leaf {i}" for i in range(len(xs))], meshes)
    outputs: list[jax.Array | None] = [None] * len(xs)
    leaves = [leaf_info(i, x, view) for i, (x, view) in enumerate(zip(xs, views))]
    for group in plan_groups(leaves, chunks, meshes, split=split is not None):
        home, m, n = group.home, group.m, group.n
        gathered = [dict(zip(b.pieces, _gather(b, [xs[leaf.index] for leaf in b.leaves]))) for b in group.buckets]
        results: list[dict] = [{} for _ in group.buckets]

        def stack(i, piece):  # a bucket's piece on the home mesh: [devices, size, m, n]
            return _to_mesh(gathered[i][piece], group.buckets[i], home).reshape(home.num_devices, -1, m, n)

        for parts in group.chunks:
            with on_mesh(home.placement):
                # Owners of a shared layer hold real matrices on disjoint devices: their sum holds each one's.
                inputs = [sum(stack(i, piece) for i, piece in part.owners) for part in parts]
                out = ns(jnp.concatenate(inputs, axis=1))
                blocks, start = [], 0
                for x in inputs:
                    blocks.append(out[:, start:start + x.shape[1]].reshape(-1, m, n))
                    start += x.shape[1]
            for part, block in zip(parts, blocks):
                for i, piece in part.owners:
                    results[i][piece] = _to_mesh(block, home, group.buckets[i])
        for layer in group.split:
            with on_mesh(home.placement):
                x = sum(stack(i, piece) for i, piece in layer.part.owners).reshape(home.num_devices, m, n)
                block = _orthogonalize_split(home, x, layer.real, split)
            for i, piece in layer.part.owners:
                results[i][piece] = _to_mesh(block, home, group.buckets[i])
        for bucket, res in zip(group.buckets, results):
            for leaf, y in zip(bucket.leaves, _scatter(bucket, [res[p] for p in bucket.pieces])):
                outputs[leaf.index] = y
    return outputs
