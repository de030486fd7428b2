"""Which parameters are Muon matrices, and how: labels and matrix views resolved once, at `init`.

Rules (in order): a variable that is not an `nnx.Param` (the router's correction bias) is frozen;
explicit dimension numbers (optax's `muon_weight_dimension_numbers`: a tree, a prefix tree or a callable
of `MuonDimensionNumbers` / None) decide the rest; without them an `nnx.Param` with `reduction` /
`output` axis-name metadata is a Muon matrix (every other axis a batch axis) and any other Param goes to
AdamW; a tree of plain arrays follows optax's rule (2-D -> Muon).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from composer_jax.tree_paths import path_str

MUON, ADAM, FROZEN = "muon", "adam", "frozen"


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def pure(tree):
    """The tree with every `nnx.Variable` replaced by its value (the structure `update` receives)."""
    return jax.tree.map(lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable)


def _metadata_dims(path: str, var: nnx.Variable) -> MuonDimensionNumbers | None:
    """A variable's matrix view from its `axes`, `reduction` and `output` metadata."""
    if not var.has_metadata("reduction"):
        return None
    axes = tuple(var.get_metadata("axes")) if var.has_metadata("axes") else ()
    if len(axes) != var.get_value().ndim:
        raise ValueError(f"muon: parameter '{path}' has metadata axes {axes} for a value of rank "
                         f"{var.get_value().ndim}")
    out = []
    for kind in ("reduction", "output"):
        names = tuple(var.get_metadata(kind)) if var.has_metadata(kind) else ()
        missing = [n for n in names if axes.count(n) != 1]
        if not names or missing:
            raise ValueError(f"muon: parameter '{path}' has {kind} axes {names}, which must be non-empty and "
                             f"name axes that appear exactly once in its axes {axes}")
        out.append(tuple(axes.index(n) for n in names))
    return MuonDimensionNumbers(*out)


def dimension_numbers(params) -> Any:
    """A tree like `pure(params)` of `MuonDimensionNumbers` (Muon matrices) or None (everything else),
    read from each `nnx.Variable`'s metadata. Usable as optax.contrib.muon's dimension numbers."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)
    dims = [_metadata_dims(path_str(p), v) if isinstance(v, nnx.Param) else None for p, v in leaves]
    return jax.tree.unflatten(jax.tree.structure(pure(params)), dims)


def _normalize(path: str, shape: tuple[int, ...], dims: MuonDimensionNumbers) -> tuple[tuple, tuple]:
    """Non-negative reduction and output axes, checked against the leaf's shape."""
    def axes(value, kind):
        value = (value,) if isinstance(value, int) else tuple(value)
        if not value or any(not isinstance(a, int) or not -len(shape) <= a < len(shape) for a in value):
            raise ValueError(f"muon: parameter '{path}' of shape {shape} has {kind} axes {value}: need a "
                             f"non-empty set of axes in [-{len(shape)}, {len(shape)})")
        value = tuple(a % len(shape) for a in value)
        if len(set(value)) != len(value):
            raise ValueError(f"muon: parameter '{path}' repeats an axis in its {kind} axes {value}")
        return value

    if len(shape) < 2:
        raise ValueError(f"muon: parameter '{path}' has shape {shape}; Muon matrices need rank >= 2 "
                         "(give it None dimension numbers to send it to AdamW)")
    reduction, output = axes(dims.reduction_axis, "reduction"), axes(dims.output_axis, "output")
    if set(reduction) & set(output):
        raise ValueError(f"muon: parameter '{path}' has overlapping reduction {reduction} and output "
                         f"{output} axes")
    return reduction, output


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MuonPlan:
    """Static, per-leaf decisions made at `init` (in `jax.tree.leaves(pure(params))` order)."""

    treedef: Any
    paths: tuple[str, ...]
    labels: tuple[str, ...]                  # 'muon', 'adam' or 'frozen'
    shapes: tuple[tuple[int, ...], ...]
    axes: tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...]  # (reduction, output) of Muon leaves

    def indices(self, label: str) -> list[int]:
        return [i for i, kind in enumerate(self.labels) if kind == label]


def make_plan(params, weight_dimension_numbers=None) -> MuonPlan:
    """Resolve every leaf's label and matrix view (see the module docstring for the rules)."""
    raw, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)
    values = pure(params)
    treedef = jax.tree.structure(values)
    paths = tuple(path_str(p) for p, _ in raw)
    shapes = tuple(tuple(jnp.shape(v.get_value() if is_variable(v) else v)) for _, v in raw)
    frozen = [is_variable(v) and not isinstance(v, nnx.Param) for _, v in raw]  # e.g. the router bias

    if weight_dimension_numbers is None:
        if any(is_variable(v) for _, v in raw):
            dims = [_metadata_dims(path, v) if isinstance(v, nnx.Param) else None for path, (_, v) in zip(paths, raw)]
        else:  # optax's default rule for plain arrays
            dims = [MuonDimensionNumbers() if len(s) == 2 else None for s in shapes]
    else:
        spec = weight_dimension_numbers(values) if callable(weight_dimension_numbers) else weight_dimension_numbers
        is_spec = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
        try:  # broadcast a prefix tree of specs over the parameters, as optax does
            full = jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d, sub), spec, values, is_leaf=is_spec)
        except ValueError as e:
            raise ValueError("muon: muon_weight_dimension_numbers must be a prefix of the parameter tree "
                             f"{treedef}: {e}") from None
        dims = jax.tree.leaves(full, is_leaf=is_spec)
        for path, d in zip(paths, dims):
            if d is not None and not isinstance(d, MuonDimensionNumbers):
                raise TypeError(f"muon: dimension numbers for '{path}' must be MuonDimensionNumbers or None, got {d!r}")

    labels, axes = [], []
    for path, shape, d, fz in zip(paths, shapes, dims, frozen):
        labels.append(FROZEN if fz else MUON if d is not None else ADAM)
        axes.append(_normalize(path, shape, d) if labels[-1] == MUON else None)
    return MuonPlan(treedef, paths, tuple(labels), shapes, tuple(axes))
