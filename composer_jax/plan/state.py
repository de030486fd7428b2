"""Per-device bytes of the training state (parameters, router biases, optimizer state, gradients), exact,
from the abstract model and the dual-grid placement rules for mesh sizes alone: no devices and nothing
allocated, so the 1T-parameter model on 256 devices plans in seconds on a laptop.

Each parameter leaf is placed by `parallel.partitioning.spec_for` (the rule the training layout uses),
so its per-device bytes are the product of its shard shape and its itemsize. The optimizer keeps, per
parameter leaf and in the parameter's dtype and sharding (optax's default `mu_dtype`):
- AdamW: two moments (mu, nu) of every parameter;
- Muon: one momentum of every Muon matrix (a Param with `reduction` / `output` metadata), AdamW's two
  moments of every other Param (embedding, head, norms).
Gradients are shaped, typed and sharded like the parameters; with `train.grad_accum` > 1 the step
holds the accumulated gradients and the current micro-batch's at once.
(tests/test_plan.py checks these rules against `jax.eval_shape` of the optimizer's init and against
the compiled step's argument bytes.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.accounting import COMPONENTS, abstract_model
from composer_jax.model.accounting import leaves as model_leaves
from composer_jax.model.layers import RouterBias
from composer_jax.parallel.partitioning import grid_of, spec_for


def shard_shape(shape: tuple[int, ...], spec, sizes: dict[str, int]) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` sharded by PartitionSpec `spec` over mesh `sizes`."""
    out = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(dim // math.prod(sizes[a] for a in axes))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    """One parameter (or router-bias) leaf as placed on a layout."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[str, ...]
    spec: object                 # PartitionSpec
    grid: str                    # 'dense' or 'expert'
    component: str               # model.accounting.COMPONENTS
    trainable: bool              # an nnx.Param (router biases are not)
    muon_matrix: bool            # carries reduction / output metadata
    local_shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.local_shape) * self.itemsize


@functools.lru_cache(maxsize=4)
def described_leaves(cfg: ModelConfig) -> tuple:
    """(accounting leaf, itemsize, axes, is a Param, is a Muon matrix) of every leaf of the abstract
    model (cached: building the 1T model's shapes takes about a second)."""
    model = abstract_model(cfg)
    variables = {tuple(str(p) for p in path): var for path, var in nnx.iter_graph(model)
                 if isinstance(var, (nnx.Param, RouterBias))}
    return tuple((leaf, variables[leaf.path].get_value().dtype.itemsize, tuple(variables[leaf.path].get_metadata("axes")),
                  isinstance(variables[leaf.path], nnx.Param), variables[leaf.path].has_metadata("reduction"))
                 for leaf in model_leaves(model))


def param_leaves(cfg: ModelConfig, sizes: dict[str, int]) -> tuple[ParamLeaf, ...]:
    """Every Param and RouterBias leaf of `cfg`'s model with its placement on a layout of `sizes`."""
    return _placed_leaves(cfg, tuple(sizes.items()))


@functools.lru_cache(maxsize=256)
def _placed_leaves(cfg: ModelConfig, sizes: tuple) -> tuple[ParamLeaf, ...]:
    """param_leaves, cached: a layout search places the same leaves on each grid many times."""
    sizes = dict(sizes)
    out = []
    for leaf, itemsize, axes, trainable, matrix in described_leaves(cfg):
        spec = spec_for(axes, leaf.shape, sizes)
        out.append(ParamLeaf(leaf.path, leaf.shape, itemsize, axes, spec, grid_of(axes), leaf.component, trainable,
                             matrix, shard_shape(leaf.shape, spec, sizes)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of the train state. `by_component`: parameter bytes per model component."""

    params: int
    biases: int
    optimizer: int
    gradients: int
    by_component: dict[str, int]

    @property
    def total(self) -> int:
        return self.params + self.biases + self.optimizer + self.gradients


def optimizer_copies(leaf: ParamLeaf, optimizer: str) -> int:
    """Parameter-sized optimizer moments the optimizer keeps for `leaf` (module docstring)."""
    if not leaf.trainable:
        return 0
    if optimizer == "muon" and leaf.muon_matrix:
        return 1
    return 2


def state_bytes(leaves: tuple[ParamLeaf, ...], optimizer: str, grad_accum: int = 1) -> StateBytes:
    """Per-device state bytes of `leaves` (`param_leaves`) with the optimizer named `optimizer`
    ('adamw' or 'muon') and `grad_accum` micro-batches per step."""
    params = sum(x.bytes for x in leaves if x.trainable)
    by_component = {c: sum(x.bytes for x in leaves if x.component == c) for c in COMPONENTS}
    return StateBytes(
        params=params,
        biases=sum(x.bytes for x in leaves if not x.trainable),
        optimizer=sum(optimizer_copies(x, optimizer) * x.bytes for x in leaves),
        gradients=params * (2 if grad_accum > 1 else 1),
        by_component={c: n for c, n in by_component.items() if n},
    )
