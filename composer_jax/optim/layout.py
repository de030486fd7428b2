"""Batched, sharded orthogonalization: every matrix of every Muon leaf is orthogonalized exactly once,
on one device, as part of a same-shape batch.

A leaf `[*batch, *reduction, *output]` (any axis order, described by a `MatrixView`) holds
prod(batch) matrices. Its sharding is read from the array itself (`jax.typeof(x).sharding`), so leaves
may live on different meshes (the dense and the expert grid). For each leaf, the mesh axes fall in
three kinds:
- axes sharding a matrix dimension (e.g. FSDP on `embed`): devices along them hold slices of the same
  matrices; an all-to-all trades slices of many matrices for whole matrices;
- axes sharding a batch dimension (experts on `ep`, heads): devices already hold different matrices;
- all other axes: the leaf is replicated there, so each device takes its own slice of the stack
  (no communication) and the results are all-gathered back.
Leaves with the same matrix shape and the same kind of sharding ("bucket") share one all-to-all; all
buckets of one matrix shape ("group"), whichever mesh they live on, share one batched Newton-Schulz per
chunk. Each device gets its bucket's matrices in layers (one matrix per device per layer); only a
bucket's last layer can be partly padding (zero matrices: NS maps zero to zero), and the last layers
of a group's buckets are packed, rotated onto disjoint devices, into as few shared layers as fit, so a
group costs each device about ceil(matrices / devices) NS. Chunks are independent
all-to-all -> NS -> all-to-all chains, so XLA's scheduler can overlap one chunk's communication with
another's compute.

Leaves on a mesh with non-Explicit axes, or without a mesh, are handled in the global view
(XLA partitions that).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.optim.grid import concrete, mesh_of, on_mesh


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """Which leaf axes index matrices (`batch`) and which form each matrix's rows and columns.

    Rows are the smaller side (the Gram matrix of NS is rows x rows): the reduction axes, or the output
    axes when the matrix has more inputs than outputs (then NS sees W^T, and f(W^T) = f(W)^T).
    """

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    @property
    def perm(self) -> tuple[int, ...]:
        return self.batch + self.rows + self.cols


def matrix_view(shape: Sequence[int], reduction: Sequence[int], output: Sequence[int]) -> MatrixView:
    """The view of a leaf of `shape` with the given (non-negative, disjoint) reduction and output axes."""
    batch = tuple(d for d in range(len(shape)) if d not in reduction and d not in output)
    fan_in = math.prod(shape[d] for d in reduction)
    fan_out = math.prod(shape[d] for d in output)
    if fan_in > fan_out:  # as optax: transpose when rows > cols of the (reduction, output) matrix
        return MatrixView(batch, tuple(output), tuple(reduction))
    return MatrixView(batch, tuple(reduction), tuple(output))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One leaf's static facts at trace time."""

    index: int                              # position in the caller's list
    shape: tuple[int, ...]
    view: MatrixView
    mesh: object | None                     # Explicit (abstract) mesh, or None for the global view
    spec: P
    dim_axes: tuple[tuple[str, ...], ...]   # mesh axes sharding each leaf dimension

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes) if self.mesh is not None else 1

    def local(self, dim: int) -> int:
        return self.shape[dim] // self.size(self.dim_axes[dim])

    @property
    def local_batch(self) -> int:
        return math.prod(self.local(d) for d in self.view.batch)

    @property
    def m(self) -> int:
        return math.prod(self.shape[d] for d in self.view.rows)

    @property
    def n(self) -> int:
        return math.prod(self.shape[d] for d in self.view.cols)


def _leaf(index: int, x: jax.Array, view: MatrixView) -> _Leaf:
    mesh = mesh_of(x)
    if mesh is None or mesh.size == 1 or not all(t == AxisType.Explicit for t in mesh.axis_types):
        return _Leaf(index, tuple(x.shape), view, None, P(), ((),) * x.ndim)
    spec = jax.typeof(x).sharding.spec
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    dim_axes = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    return _Leaf(index, tuple(x.shape), view, mesh, spec, dim_axes)


@dataclasses.dataclass
class _Bucket:
    """Leaves sharing a mesh, a dtype, the matrix shape and the way each matrix dimension is sharded.

    After the exchange each device holds `layers` matrices of the bucket: layer l of device slot s is
    the bucket's local matrix l * slots + s (layer-major, so only the last layer can be partly padding).
    The last layer is rotated by `offset` slots so that small buckets of a group fill different devices
    and can share one layer of NS work.
    """

    leaves: list[_Leaf]
    gathered: tuple[tuple[int, tuple[str, ...]], ...]   # (matrix dim position, mesh axes) to all-to-all
    replicated: tuple[str, ...]                          # mesh axes the leaves are replicated over
    offset: int = 0
    pieces: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (chunk, layer, size)

    @property
    def first(self) -> _Leaf:
        return self.leaves[0]

    @property
    def mesh(self):
        return self.first.mesh

    @property
    def k(self) -> int:  # devices holding slices of the same matrices
        return math.prod(self.first.size(axes) for _, axes in self.gathered)

    @property
    def slots(self) -> int:  # devices sharing the bucket's matrices: k times the replicated copies
        return self.k * self.first.size(self.replicated)

    @property
    def num_devices(self) -> int:
        return self.mesh.size if self.mesh is not None else 1

    @property
    def total(self) -> int:  # local matrices (or slices of matrices) per device before the exchange
        return sum(leaf.local_batch for leaf in self.leaves)

    @property
    def layers(self) -> int:
        return -(-self.total // self.slots)

    @property
    def full_layers(self) -> int:
        return self.total // self.slots

    @property
    def partial(self) -> int:  # real slots of the last layer when it is partly padding, else 0
        return self.total % self.slots

    @property
    def matrix_dims(self) -> tuple[int, ...]:
        return self.first.view.rows + self.first.view.cols

    def local_matrix(self) -> tuple[int, ...]:
        return tuple(self.first.local(d) for d in self.matrix_dims)

    def global_matrix(self) -> tuple[int, ...]:
        return tuple(self.first.shape[d] for d in self.matrix_dims)

    def slot_of_device(self) -> np.ndarray:
        """int[num_devices]: the slot of each position of the exchanged stack (mesh-major device order)."""
        if self.mesh is None:
            return np.zeros(1, np.int64)
        names = tuple(self.mesh.axis_names)
        coords = dict(zip(names, np.unravel_index(np.arange(self.mesh.size), [self.mesh.shape[a] for a in names])))

        def linear(axes):
            index = np.zeros(self.mesh.size, np.int64)
            for a in axes:
                index = index * self.mesh.shape[a] + coords[a]
            return index

        # Must agree with all_to_all's and axis_index's row-major order over the named axes.
        return linear(self.replicated) * self.k + linear(tuple(a for _, axes in self.gathered for a in axes))

    def real_devices(self, offset: int) -> np.ndarray:
        """bool[num_devices]: positions where the last layer, rotated by `offset`, holds a real matrix."""
        return (self.slot_of_device() - offset) % self.slots < self.partial


def _bucket_key(leaf: _Leaf, dtype) -> tuple:
    dims = leaf.view.rows + leaf.view.cols
    used = {a for axes in leaf.dim_axes for a in axes}
    replicated = tuple(a for a in leaf.mesh.axis_names if a not in used) if leaf.mesh is not None else ()
    return (leaf.mesh, jnp.dtype(dtype), len(leaf.view.rows),
            tuple((leaf.shape[d], leaf.dim_axes[d]) for d in dims), replicated)


def _make_buckets(leaves: list[_Leaf], xs: Sequence[jax.Array]) -> list[_Bucket]:
    buckets: dict[tuple, _Bucket] = {}
    for leaf in leaves:
        key = _bucket_key(leaf, xs[leaf.index].dtype)
        if key not in buckets:
            dims = leaf.view.rows + leaf.view.cols
            gathered = tuple((pos, leaf.dim_axes[d]) for pos, d in enumerate(dims) if leaf.dim_axes[d])
            buckets[key] = _Bucket([], gathered, key[-1])
        buckets[key].leaves.append(leaf)
    return list(buckets.values())


def _pack_partial_layers(group: list[_Bucket]) -> list[list[int]]:
    """First-fit: put the partly padded last layers of a group's buckets into as few shared layers as
    possible, choosing each bucket's rotation so that no device holds two real matrices of one layer.
    Returns, per shared layer, the indices of its buckets."""
    shared: list[tuple[np.ndarray, list[int]]] = []
    order = sorted((i for i, b in enumerate(group) if b.partial), key=lambda i: -group[i].real_devices(0).sum())
    for i in order:
        bucket = group[i]
        for used, members in shared:
            fit = next((o for o in range(bucket.slots) if not np.any(bucket.real_devices(o) & used)), None)
            if fit is not None:
                bucket.offset = fit
                used |= bucket.real_devices(fit)
                members.append(i)
                break
        else:
            shared.append((bucket.real_devices(0), [i]))
    return [members for _, members in shared]


def _plan_chunks(group: list[_Bucket], shared: list[list[int]], chunks: int) -> list[list[tuple]]:
    """Cut the group's layers (every bucket's full layers, then the shared layers) into <= `chunks`
    near-equal runs. Returns, per chunk, its parts: ('full', bucket, first layer, size) or ('shared', i);
    records each bucket's exchange pieces (chunk, first layer, size), in layer order."""
    units = [("full", i, l) for i, b in enumerate(group) for l in range(b.full_layers)]
    units += [("shared", s, 0) for s in range(len(shared))]
    num = max(1, min(chunks, len(units)))
    bounds = [round(c * len(units) / num) for c in range(num + 1)]
    plan = []
    for c in range(num):
        parts = []
        for kind, i, layer in units[bounds[c]:bounds[c + 1]]:
            if kind == "full" and parts and parts[-1][0] == "full" and parts[-1][1] == i:
                parts[-1] = ("full", i, parts[-1][2], parts[-1][3] + 1)
            elif kind == "full":
                parts.append(("full", i, layer, 1))
            else:
                parts.append(("shared", i))
                for member in shared[i]:
                    group[member].pieces.append((c, group[member].full_layers, 1))
        for part in parts:
            if part[0] == "full":
                group[part[1]].pieces.append((c, part[2], part[3]))
        plan.append(parts)
    for bucket in group:
        bucket.pieces.sort(key=lambda piece: piece[1])
    return plan


def _shard_map(fn, bucket: _Bucket, in_specs, out_specs, check_vma=True):
    if bucket.mesh is None:
        return fn
    mapped = jax.shard_map(fn, mesh=concrete(bucket.mesh), in_specs=in_specs, out_specs=out_specs,
                           check_vma=check_vma)

    def run(*args):
        with on_mesh(bucket.mesh):
            return mapped(*args)

    return run


def _stack_spec(bucket: _Bucket):
    return P(tuple(bucket.mesh.axis_names)) if bucket.mesh is not None else None


def _rotate_last(x: jax.Array, shift: int) -> jax.Array:
    """x: [layers, slots, ...]; rotate the last layer's slots by `shift`."""
    if not shift:
        return x
    return jnp.concatenate([x[:-1], jnp.roll(x[-1:], shift, axis=1)])


def _gather(bucket: _Bucket, blocks: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
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
        for _, first, size in bucket.pieces:
            y = x[:, first:first + size].reshape((k * size,) + local_mat)
            for pos, axes in bucket.gathered:
                if jax.default_backend() == "cpu":  # XLA:CPU splits an all-to-all into per-peer operands
                    y = jax.lax.optimization_barrier(y)  # and rejects them when fusion gave them mixed layouts
                y = jax.lax.all_to_all(y, axes, 0, 1 + pos, tiled=True)
            out.append(y.reshape(size, m, n))
        return tuple(out)

    in_specs = tuple(leaf.spec for leaf in bucket.leaves)
    return _shard_map(local, bucket, in_specs, (_stack_spec(bucket),) * len(bucket.pieces))(*blocks)


def _scatter(bucket: _Bucket, pieces: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Inverse of `_gather`: whole matrices back to every leaf's own layout and sharding."""
    k, slots, layers = bucket.k, bucket.slots, bucket.layers
    local_mat, global_mat = bucket.local_matrix(), bucket.global_matrix()

    def local(*pieces):
        parts = []
        for y, (_, _, size) in zip(pieces, bucket.pieces):
            y = y.reshape((size,) + global_mat)
            for pos, axes in reversed(bucket.gathered):
                y = jax.lax.all_to_all(y, axes, 1 + pos, 0, tiled=True)
            parts.append(y.reshape((k, size) + local_mat))
        x = jnp.concatenate(parts, axis=1).reshape((k * layers,) + local_mat)
        if bucket.replicated:
            x = jax.lax.all_gather(x, bucket.replicated, axis=0, tiled=True)
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


def _to_mesh(x: jax.Array, src: _Bucket, dst: _Bucket) -> jax.Array:
    """Move a stack [devices * size, m, n] between meshes over the same devices (no data moves when
    both enumerate the devices in the same order)."""
    if src.mesh == dst.mesh:
        return x
    with on_mesh(dst.mesh):
        return jax.sharding.reshard(x, NamedSharding(dst.mesh, _stack_spec(dst)))


def orthogonalize(xs: Sequence[jax.Array], views: Sequence[MatrixView],
                  ns: Callable[[jax.Array], jax.Array], chunks: int = 1) -> list[jax.Array]:
    """Apply `ns` ([..., m, n] -> [..., m, n], independently per matrix, m <= n) to every matrix of
    every leaf; each leaf comes back in its own shape, axis order and sharding, in `ns`'s output dtype.

    xs: the leaves; views: their `MatrixView`s; chunks: runs each same-shape group is cut into.
    """
    leaves = [_leaf(i, x, view) for i, (x, view) in enumerate(zip(xs, views))]
    groups: dict[tuple, list[_Bucket]] = {}
    for bucket in _make_buckets(leaves, xs):
        key = (bucket.num_devices, bucket.first.m, bucket.first.n, jnp.dtype(xs[bucket.first.index].dtype))
        groups.setdefault(key, []).append(bucket)

    outputs: list[jax.Array | None] = [None] * len(xs)
    for (devices, m, n, _), group in groups.items():
        shared = _pack_partial_layers(group)
        communicates = any(b.gathered or b.replicated for b in group)  # else there is nothing to overlap
        plan = _plan_chunks(group, shared, chunks if communicates else 1)
        home = group[0]
        gathered = [dict(zip((p[:2] for p in b.pieces), _gather(b, [xs[leaf.index] for leaf in b.leaves])))
                    for b in group]
        results: list[dict] = [{} for _ in group]

        def stack(i, key):  # a bucket's piece on the home mesh: [devices, size, m, n]
            return _to_mesh(gathered[i][key], group[i], home).reshape(devices, -1, m, n)

        for c, parts in enumerate(plan):
            with on_mesh(home.mesh):
                inputs = []
                for part in parts:
                    if part[0] == "full":
                        inputs.append(stack(part[1], (c, part[2])))
                    else:  # members own disjoint devices, so their sum holds each one's real matrices
                        inputs.append(sum(stack(i, (c, group[i].full_layers)) for i in shared[part[1]]))
                out = ns(jnp.concatenate(inputs, axis=1))
                pieces, start = [], 0
                for x in inputs:
                    pieces.append(out[:, start:start + x.shape[1]].reshape(-1, m, n))
                    start += x.shape[1]
            for part, piece in zip(parts, pieces):
                owners = [(part[1], (c, part[2]))] if part[0] == "full" else \
                    [(i, (c, group[i].full_layers)) for i in shared[part[1]]]
                for i, key in owners:
                    results[i][key] = _to_mesh(piece, home, group[i])
        for bucket, res in zip(group, results):
            pieces = [res[p[:2]] for p in bucket.pieces]
            for leaf, y in zip(bucket.leaves, _scatter(bucket, pieces)):
                outputs[leaf.index] = y
    return outputs
