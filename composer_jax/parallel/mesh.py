"""DualMesh: a dense mesh and an expert mesh over one device list, in one order, Explicit axes.

    dense  ('replica', 'fsdp', 'cp')     dense weights on fsdp; batch on (replica, fsdp); sequence on cp
    expert ('ereplica', 'efsdp', 'ep')   routed-expert weights on ep (experts) and efsdp (embed dim)

Both meshes reshape the same flat device list row-major, so the token shard with flat index i lives on
the same device under `P(('replica', 'fsdp', 'cp'))` on the dense mesh and `P(('ereplica', 'efsdp',
'ep'))` on the expert mesh: moving tokens between grids is `jax.sharding.reshard` with no collective.
This file owns the JAX rules that bite with two meshes (shared/reference/frameworks.md section 2):
- no single op may mix arrays of both meshes: code on expert-mesh arrays runs under `expert_scope()`;
- `shard_map` inputs must already be on its mesh: `to_expert` / `to_dense` move token arrays;
- a different device order is silently wrong: both meshes are built here from one device array.

A DualMesh is hashable and compares by its two meshes (devices, order, axes), so code that is traced
for a layout can carry it as static data: the model holds it as a static attribute (part of its
graphdef, hence of every jit cache key) rather than reading it from a context at trace time.
`with dual_mesh:` makes the dense mesh JAX's context mesh for Explicit-axes ops. `for_inference()` gives
the same meshes with the decoding placement rules (a distinct, equally static layout).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import ConfigError, MeshConfig, ModelConfig

DENSE_AXES = ("replica", "fsdp", "cp")
EXPERT_AXES = ("ereplica", "efsdp", "ep")
BATCH_AXES = ("replica", "fsdp")       # dense-mesh batch sharding
DENSE_TOKEN_AXES = DENSE_AXES          # flattened [batch * seq] tokens on the dense mesh
EXPERT_TOKEN_AXES = EXPERT_AXES        # the same token shards on the expert mesh

def largest_ep(devices: int, experts: int | None) -> int:
    """The widest expert-parallel axis over `devices`: the largest size dividing both the devices and the
    routed experts (all the devices when the experts are not known)."""
    if experts is None:
        return devices
    return max(d for d in range(1, devices + 1) if devices % d == 0 and experts % d == 0)


def _settings(sizes: dict[str, int], changed: dict[str, int]) -> str:
    return " ".join(f"mesh.{a}={v}" for a, v in changed.items() if sizes.get(a) != v) or "the defaults"


def dense_hint(cfg: MeshConfig, num_devices: int) -> str:
    """A dense grid that works on `num_devices`: the given replica and cp if they fit, FSDP over the rest."""
    replica, cp = max(cfg.replica, 1), max(cfg.cp, 1)
    if num_devices % (replica * cp):
        replica, cp = 1, 1
    return _settings(dataclasses.asdict(cfg), {"replica": replica, "fsdp": num_devices // (replica * cp), "cp": cp})


def expert_hint(cfg: MeshConfig, num_devices: int, experts: int | None) -> str:
    """An expert grid that works on `num_devices` for `experts` routed experts: the given efsdp if it
    divides the devices, the widest expert parallelism, replicas over the rest."""
    efsdp = cfg.efsdp if cfg.efsdp > 0 and num_devices % cfg.efsdp == 0 else 1
    ep = largest_ep(num_devices // efsdp, experts)
    return _settings(dataclasses.asdict(cfg), {"ep": ep, "ereplica": num_devices // (efsdp * ep), "efsdp": efsdp})


def _fill(cfg: MeshConfig, grid: tuple[str, ...], num_devices: int, experts: int | None) -> dict[str, int]:
    """One grid's sizes with its -1 filled (module docstring of MeshConfig); ConfigError naming a layout
    that works when the given sizes cannot."""
    given = {a: getattr(cfg, a) for a in grid}

    def hint() -> str:
        return dense_hint(cfg, num_devices) if grid == DENSE_AXES else expert_hint(cfg, num_devices, experts)

    if given.get("ep") == -1 and given.get("ereplica") == -1 and num_devices % given["efsdp"] == 0:
        rest = num_devices // given["efsdp"]
        given["ep"] = largest_ep(rest, experts)
        given["ereplica"] = rest // given["ep"]
    known = math.prod(s for s in given.values() if s != -1)
    for axis, size in given.items():
        if size == -1:
            if num_devices % known:
                raise ConfigError(axis, f"cannot fill: the other {grid} sizes ({known}) do not divide the "
                                        f"{num_devices} devices: try {hint()}")
            given[axis] = num_devices // known
    product = math.prod(given.values())
    if product != num_devices:
        layout = " x ".join(f"{a}={given[a]}" for a in grid)
        raise ConfigError(grid[0], f"{layout} = {product} devices, but there are {num_devices}: try {hint()}")
    return given


def resolve_sizes(cfg: MeshConfig, num_devices: int, experts: int | None = None) -> dict[str, int]:
    """Axis sizes with -1 filled in (`experts`: the routed experts a -1 `ep` must divide); each grid must
    multiply to `num_devices`."""
    return {**_fill(cfg, DENSE_AXES, num_devices, experts), **_fill(cfg, EXPERT_AXES, num_devices, experts)}


def check_model(sizes: dict[str, int], model: ModelConfig) -> None:
    """Raise ConfigError when the model cannot run on this layout, naming a layout that can."""
    experts = model.moe.n_routed_experts
    if experts % sizes["ep"]:
        hint = expert_hint(MeshConfig(**sizes), math.prod(sizes[a] for a in EXPERT_AXES), experts)
        raise ConfigError("ep", f"ep={sizes['ep']} must divide n_routed_experts={experts}: try {hint}")
    if model.hidden_size % sizes["efsdp"]:
        raise ConfigError("efsdp", f"efsdp={sizes['efsdp']} must divide hidden_size={model.hidden_size}: "
                                   "try mesh.efsdp=1")


class DualMesh:
    """The dense and expert meshes over one device list (see module docstring)."""

    def __init__(self, cfg: MeshConfig, devices=None, model: ModelConfig | None = None):
        devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
        self.cfg = cfg
        self.sizes = resolve_sizes(cfg, devices.size, None if model is None else model.moe.n_routed_experts)
        if model is not None:
            check_model(self.sizes, model)
        explicit = lambda n: (AxisType.Explicit,) * n  # noqa: E731
        self.dense = Mesh(devices.reshape([self.sizes[a] for a in DENSE_AXES]), DENSE_AXES,
                          axis_types=explicit(3))
        self.expert = Mesh(devices.reshape([self.sizes[a] for a in EXPERT_AXES]), EXPERT_AXES,
                           axis_types=explicit(3))
        self.inference = False  # the placement rules: training (False) or decoding (see for_inference)
        self._contexts: list = []

    def for_inference(self) -> "DualMesh":
        """The same meshes with the inference placement (composer_jax.parallel.partitioning): dense
        weights replicated, routed experts on `ep` only, batches split over the data axes only where
        they divide. A different layout: it compares unequal to the training one."""
        if self.cp > 1:
            raise ConfigError("cp", f"decoding runs without context parallelism: need cp=1, got cp={self.cp}")
        twin = copy.copy(self)
        twin.inference, twin._contexts = True, []
        return twin

    def __eq__(self, other) -> bool:
        return (isinstance(other, DualMesh) and (self.dense, self.expert, self.inference)
                == (other.dense, other.expert, other.inference))

    def __hash__(self) -> int:
        return hash((self.dense, self.expert, self.inference))

    def __repr__(self) -> str:
        fmt = lambda axes: ", ".join(f"{a}={self.sizes[a]}" for a in axes)  # noqa: E731
        placement = ", inference placement" if self.inference else ""
        return f"DualMesh(dense=({fmt(DENSE_AXES)}), expert=({fmt(EXPERT_AXES)}){placement})"

    def __enter__(self) -> "DualMesh":
        context = jax.set_mesh(self.dense)
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc) -> None:
        self._contexts.pop().__exit__(*exc)

    @property
    def cp(self) -> int:
        return self.sizes["cp"]

    @property
    def meshes(self) -> tuple[Mesh, Mesh]:
        """(dense, expert): the concrete meshes, e.g. for `optim.muon(meshes=...)`."""
        return self.dense, self.expert

    def concrete(self, mesh) -> Mesh:
        """The concrete mesh (dense or expert) whose abstract mesh is `mesh` (a Mesh or AbstractMesh)."""
        for candidate in self.meshes:
            if candidate == mesh or candidate.abstract_mesh == mesh:
                return candidate
        raise ValueError(f"{mesh} is neither mesh of {self}")

    def replicated(self, mesh="dense") -> NamedSharding:
        """A replicated NamedSharding on the dense (default) or expert mesh."""
        return NamedSharding(self.dense if mesh == "dense" else self.expert, P())

    @contextlib.contextmanager
    def expert_scope(self):
        """Trace-time scope for ops on expert-mesh arrays (JAX checks the context mesh per op)."""
        with jax.sharding.use_abstract_mesh(self.expert.abstract_mesh):
            yield

    def to_expert(self, x: jax.Array) -> jax.Array:
        """[tokens, ...] sharded on the dense token axes -> the same shards on the expert mesh."""
        spec = P(EXPERT_TOKEN_AXES, *([None] * (x.ndim - 1)))
        return jax.sharding.reshard(x, NamedSharding(self.expert, spec))

    def to_dense(self, x: jax.Array) -> jax.Array:
        """[tokens, ...] sharded on the expert token axes -> the same shards on the dense mesh."""
        spec = P(DENSE_TOKEN_AXES, *([None] * (x.ndim - 1)))
        return jax.sharding.reshard(x, NamedSharding(self.dense, spec))
