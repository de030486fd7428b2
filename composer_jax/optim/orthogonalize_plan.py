"""The static plan of Muon's batched, sharded orthogonalization (executed by `optim.layout`).

A leaf `[*batch, *reduction, *output]` (any axis order, described by a `MatrixView`) holds
prod(batch) matrices. Its sharding is read from its type (`jax.typeof(x).sharding`), so leaves may
live on different meshes (the dense and the expert grid). For each leaf, the mesh axes fall in three
kinds:
- axes sharding a matrix dimension (e.g. FSDP on `embed`): devices along them hold slices of the same
  matrices; an all-to-all trades slices of many matrices for whole matrices;
- axes sharding a batch dimension (experts on `ep`, heads): devices already hold different matrices;
- all other axes: the leaf is replicated there, so each device takes its own slice of the stack (no
  communication) and the results are all-gathered back.
Leaves with the same matrix shape and the same kind of sharding form a `Bucket` (one all-to-all);
all buckets of one matrix shape form a `Group`, whichever mesh they live on, and share one batched
Newton-Schulz per chunk. After the exchange each device holds a bucket's matrices in layers (one
matrix per device per layer); only a bucket's last layer can be partly padding (zero matrices: NS maps
zero to zero), and the last layers of a group's buckets are packed, rotated onto disjoint devices, into
as few shared layers as fit, so a group costs each device about ceil(matrices / devices) NS. A shared
layer holding r < devices real matrices still costs every device one whole NS; when it is cheaper, the
layer is *split* instead (`SplitLayer`): each real matrix is cut into one column block per device
(an all-to-all), every device runs the NS steps on its blocks of all r matrices with the Gram matrices
summed over the devices (a psum of r m x m matrices per step), and the blocks go back. That costs
6 m^2 n r / devices FLOPs a step per device (the polynomial applied as aX + b(AX) + c(A(AX)), every
product m x m by m x n/devices) instead of 4 m^2 n + 2 m^3, so a few large matrices no longer leave most
devices idle. A group's other layers are cut into chunks: independent all-to-all -> NS -> all-to-all
chains, so XLA's scheduler can overlap one chunk's communication with another's compute.

Everything here is decided from shapes, shardings and meshes at trace time and is immutable once made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from composer_jax.optim.newton_schulz import ns_flops
from composer_jax.parallel.leafwise import abstract, mesh_of


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
class Leaf:
    """One leaf's static facts."""

    index: int                              # position in the caller's list
    shape: tuple[int, ...]
    dtype: jnp.dtype
    view: MatrixView
    mesh: object | None                     # Explicit AbstractMesh, or None for the global view
    placement: object | None                # the concrete Mesh of an eager leaf, else `mesh`
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


def describe_leaf(index: int, shape: Sequence[int], dtype, view: MatrixView, placement, spec: P | None) -> Leaf:
    """A leaf's facts from its shape, dtype, view, mesh (a concrete Mesh, an AbstractMesh or None) and
    PartitionSpec: what `plan_groups` needs, with or without arrays (e.g. to plan for a layout whose
    devices are not here)."""
    shape, mesh = tuple(shape), abstract(placement)
    if mesh is None or mesh.size == 1 or not all(t == AxisType.Explicit for t in mesh.axis_types):
        return Leaf(index, shape, jnp.dtype(dtype), view, None, None, P(), ((),) * len(shape))
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    dim_axes = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    return Leaf(index, shape, jnp.dtype(dtype), view, mesh, placement, spec, dim_axes)


def leaf_info(index: int, x: jax.Array, view: MatrixView) -> Leaf:
    placement = mesh_of(x)
    spec = jax.typeof(x).sharding.spec if placement is not None else None
    return describe_leaf(index, x.shape, x.dtype, view, placement, spec)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Layers [first, first + size) of a bucket's exchanged stack, orthogonalized in chunk `chunk`."""

    chunk: int
    first: int
    size: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves sharing a mesh, a dtype, the matrix shape and the way each matrix dimension is sharded.

    After the exchange each device holds `layers` matrices of the bucket: layer l of device slot s is
    the bucket's local matrix l * slots + s (layer-major, so only the last layer can be partly padding).
    The last layer is rotated by `offset` slots so that small buckets of a group fill different devices
    and can share one layer of NS work. `pieces` (in layer order) say which chunk handles which layers.
    """

    leaves: tuple[Leaf, ...]
    gathered: tuple[tuple[int, tuple[str, ...]], ...]   # (matrix dim position, mesh axes) to all-to-all
    replicated: tuple[str, ...]                          # mesh axes the leaves are replicated over
    concrete: Mesh | None                                # the mesh given to shard_map (None: global view)
    offset: int = 0
    pieces: tuple[Piece, ...] = ()

    @property
    def first(self) -> Leaf:
        return self.leaves[0]

    @property
    def mesh(self):
        return self.first.mesh

    @property
    def placement(self):  # the context for ops on the bucket's arrays (`parallel.leafwise.on_mesh`)
        return self.first.placement

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

    @property
    def needs_cpu_barrier(self) -> bool:
        """XLA:CPU splits an all-to-all into per-peer operands and rejects them when fusion gave them mixed
        layouts; an optimization barrier before each all-to-all prevents that. Decided by the devices the
        bucket runs on, not by the default backend."""
        if isinstance(self.concrete, Mesh):
            return self.concrete.devices.flat[0].platform == "cpu"
        device = getattr(self.mesh, "abstract_device", None)  # unknown: the barrier is harmless elsewhere
        return self.mesh is not None and getattr(device, "platform", "cpu") == "cpu"


@dataclasses.dataclass(frozen=True)
class Part:
    """One block of a chunk's NS batch: the piece of one bucket (full layers), or the last layers of
    several buckets that hold real matrices on disjoint devices (summed into one shared layer)."""

    owners: tuple[tuple[int, Piece], ...]   # (bucket index in the group, piece)


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """A shared layer orthogonalized split into column blocks across the devices (module docstring);
    `real`: the positions (in the stack's device order) that hold a real matrix."""

    part: Part
    real: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """Buckets of one matrix shape on one device count, orthogonalized together chunk by chunk, and the
    shared layers that run split."""

    buckets: tuple[Bucket, ...]
    chunks: tuple[tuple[Part, ...], ...]
    m: int
    n: int
    split: tuple[SplitLayer, ...] = ()

    @property
    def home(self) -> Bucket:  # the NS batch runs on the first bucket's mesh
        return self.buckets[0]

    def ns_flops(self, steps: int) -> int:
        """NS FLOPs per device: every device runs each chunk's whole layers and its blocks of the split
        layers (zero padding included: it costs as much as a real matrix)."""
        layers = sum(owners_size(part) for parts in self.chunks for part in parts)
        split = sum(split_ns_flops(self.m, self.n, len(layer.real), self.home.num_devices, steps)
                    for layer in self.split)
        return layers * ns_flops(self.m, self.n, steps) + split


def owners_size(part: Part) -> int:
    """Layers a part adds to its chunk's NS batch (the owners of a shared layer share one)."""
    return part.owners[0][1].size


def split_width(n: int, devices: int) -> int:
    """Columns per device of a split matrix of width n (zero columns pad it to a multiple of devices:
    they stay zero through NS and do not change the Gram matrix)."""
    return -(-n // devices)


def split_ns_flops(m: int, n: int, real: int, devices: int, steps: int) -> int:
    """Per-device NS FLOPs of a split layer of `real` m x n matrices (m <= n): 6 m^2 w a step per block."""
    return steps * real * 6 * m * m * split_width(n, devices)


def check_meshes(xs: Sequence[jax.Array], paths: Sequence[str], meshes: Sequence[Mesh]) -> None:
    """Leaves on more than one mesh need every mesh concrete among `meshes`: a `shard_map` over an
    AbstractMesh under another concrete context mesh would lower with the wrong replica groups."""
    found: dict = {}
    for x, path in zip(xs, paths):
        if mesh_of(x) is not None:
            found.setdefault(abstract(mesh_of(x)), path)
    if len(found) < 2:
        return
    known = {m.abstract_mesh for m in meshes}
    for mesh, path in found.items():
        if mesh not in known:
            raise ValueError(f"muon: parameter '{path}' lives on {mesh}, one of {len(found)} meshes, and none of "
                             "`meshes` is that mesh: pass the concrete meshes (e.g. meshes=DualMesh.meshes)")


def _concrete(leaf: Leaf, meshes: Sequence[Mesh]):
    for candidate in meshes:
        if candidate.abstract_mesh == leaf.mesh:
            return candidate
    # Eager: the leaf's own concrete mesh. Traced, one mesh in all (check_meshes): the abstract mesh,
    # which resolves against the context (that mesh, or none).
    return leaf.placement


def _buckets(leaves: Sequence[Leaf], meshes: Sequence[Mesh]) -> list[Bucket]:
    members: dict[tuple, list[Leaf]] = {}
    for leaf in leaves:
        used = {a for axes in leaf.dim_axes for a in axes}
        replicated = tuple(a for a in leaf.mesh.axis_names if a not in used) if leaf.mesh is not None else ()
        dims = leaf.view.rows + leaf.view.cols
        key = (leaf.mesh, leaf.dtype, len(leaf.view.rows), tuple((leaf.shape[d], leaf.dim_axes[d]) for d in dims),
               replicated)
        members.setdefault(key, []).append(leaf)
    out = []
    for key, group in members.items():
        first = group[0]
        dims = first.view.rows + first.view.cols
        gathered = tuple((pos, first.dim_axes[d]) for pos, d in enumerate(dims) if first.dim_axes[d])
        concrete = None if first.mesh is None else _concrete(first, meshes)
        out.append(Bucket(tuple(group), gathered, key[-1], concrete))
    return out


def _pack_partial_layers(buckets: Sequence[Bucket]) -> tuple[list[int], list[list[int]]]:
    """First-fit: put the partly padded last layers of a group's buckets into as few shared layers as
    possible, choosing each bucket's rotation so that no device holds two real matrices of one layer.
    Returns each bucket's rotation and, per shared layer, the indices of its buckets."""
    offsets = [0] * len(buckets)
    shared: list[tuple[np.ndarray, list[int]]] = []
    order = sorted((i for i, b in enumerate(buckets) if b.partial), key=lambda i: -buckets[i].real_devices(0).sum())
    for i in order:
        bucket = buckets[i]
        for used, members in shared:
            fit = next((o for o in range(bucket.slots) if not np.any(bucket.real_devices(o) & used)), None)
            if fit is not None:
                offsets[i] = fit
                used |= bucket.real_devices(fit)
                members.append(i)
                break
        else:
            shared.append((bucket.real_devices(0), [i]))
    return offsets, [members for _, members in shared]


def _real_positions(buckets: Sequence[Bucket], members: list[int]) -> tuple[int, ...]:
    """Positions of a shared layer that hold a real matrix (its members' disjoint last layers)."""
    real = np.zeros(buckets[members[0]].num_devices, bool)
    for i in members:
        real |= buckets[i].real_devices(buckets[i].offset)
    return tuple(int(p) for p in np.flatnonzero(real))


def _splits(buckets: Sequence[Bucket], shared: list[list[int]], m: int, n: int) -> list[bool]:
    """Per shared layer: whether splitting it into column blocks costs each device fewer FLOPs than one
    whole NS (the rule of the module docstring; one step's cost decides, every step costs the same)."""
    devices = buckets[0].num_devices
    whole = ns_flops(m, n, 1)
    return [devices > 1 and split_ns_flops(m, n, len(_real_positions(buckets, members)), devices, 1) < whole
            for members in shared]


def _plan_chunks(buckets: Sequence[Bucket], shared: list[list[int]], chunks: int, split: Sequence[bool] = ()):
    """Cut the group's layers (every bucket's full layers, then the shared layers that do not run split)
    into <= `chunks` near-equal runs. Returns the chunks' parts, the split layers (their pieces carry
    chunk index `len(chunks)`) and each bucket's pieces (in layer order)."""
    split = list(split) or [False] * len(shared)
    units = [(i, layer) for i, b in enumerate(buckets) for layer in range(b.full_layers)]
    units += [(None, s) for s in range(len(shared)) if not split[s]]
    num = min(chunks, len(units))           # 0 when every layer runs split
    bounds = [round(c * len(units) / num) for c in range(num + 1)] if num else []
    pieces: list[list[Piece]] = [[] for _ in buckets]
    plan = []
    for c in range(num):
        runs: list[list] = []    # [bucket or None, first layer or shared index, size]
        for i, layer in units[bounds[c]:bounds[c + 1]]:
            if i is not None and runs and runs[-1][0] == i:
                runs[-1][2] += 1
            else:
                runs.append([i, layer, 1])
        parts = []
        for i, first, size in runs:
            if i is None:  # a shared layer: the last layer of each member
                owners = tuple((b, Piece(c, buckets[b].full_layers, 1)) for b in shared[first])
            else:
                owners = ((i, Piece(c, first, size)),)
            for b, piece in owners:
                pieces[b].append(piece)
            parts.append(Part(owners))
        plan.append(tuple(parts))
    split_layers = []
    for s, members in enumerate(shared):
        if split[s]:
            owners = tuple((b, Piece(len(plan), buckets[b].full_layers, 1)) for b in members)
            for b, piece in owners:
                pieces[b].append(piece)
            split_layers.append(SplitLayer(Part(owners), _real_positions(buckets, members)))
    return tuple(plan), tuple(split_layers), [tuple(sorted(p, key=lambda piece: piece.first)) for p in pieces]


def plan_groups(leaves: Sequence[Leaf], chunks: int, meshes: Sequence[Mesh] = (), split: bool = False) -> list[Group]:
    """The whole exchange plan for `leaves` (`leaf_info` of arrays, or `describe_leaf`); `split`: whether
    shared layers may run split (the executor then needs the split NS steps)."""
    by_shape: dict[tuple, list[Bucket]] = {}
    for bucket in _buckets(leaves, meshes):
        key = (bucket.num_devices, bucket.first.m, bucket.first.n, bucket.first.dtype)
        by_shape.setdefault(key, []).append(bucket)
    groups = []
    for (_, m, n, _), buckets in by_shape.items():
        offsets, shared = _pack_partial_layers(buckets)
        buckets = [dataclasses.replace(b, offset=o) for b, o in zip(buckets, offsets)]
        communicates = any(b.gathered or b.replicated for b in buckets)  # else there is nothing to overlap
        splits = _splits(buckets, shared, m, n) if split else ()
        plan, split_layers, pieces = _plan_chunks(buckets, shared, chunks if communicates else 1, splits)
        buckets = tuple(dataclasses.replace(b, pieces=p) for b, p in zip(buckets, pieces))
        groups.append(Group(buckets, plan, m, n, split_layers))
    return groups


def ns_flops_per_device(groups: Sequence[Group], steps: int) -> int:
    """The plan's NS FLOPs per device (dense-GEMM count, `newton_schulz.ns_flops`'s convention)."""
    return sum(group.ns_flops(steps) for group in groups)
