"""Muon as an optax GradientTransformation: momentum, then Newton-Schulz per matrix of each parameter
(per head, per expert, per stacked layer), batched across parameters and sharded so that every device
orthogonalizes its own whole matrices; AdamW for the rest.

Same numbers as `optax.contrib.muon` (0.2.8) with matching settings: EMA momentum with bias correction
and optax's Nesterov form, NS on the momentum, shape scaling (Jordan's sqrt(max(1, fan_out/fan_in)) or
Moonlight's consistent RMS `consistent_rms * sqrt(max(fan_in, fan_out))`), decoupled weight decay
-lr * wd * W, then -lr; non-Muon parameters get optax's (N)AdamW sharing `eps`. Differences: NS runs
in `ns_dtype` (bfloat16 by default; optax uses the momentum dtype), variables that are not Params are
never updated, and a coefficient schedule runs in order (first `ns_steps` rows, last row repeated).

Which parameters are matrices, and how: `muon_weight_dimension_numbers` (optax's meaning: a tree, a
prefix tree or a callable of `MuonDimensionNumbers` / None), or by default the model's metadata: an
`nnx.Param` with `reduction`/`output` axis names is a Muon matrix (all other axes are batch axes), any
other Param (embedding, head, norms) goes to AdamW, and a variable that is not a Param (the router's
correction bias) is frozen: its update is zero. A tree of plain arrays without dimension numbers
follows optax's rule (2-D -> Muon). The resolved views are stored in the state as static data, so
`update` works on the plain arrays `nnx.Optimizer` passes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from composer_jax.optim import layout
from composer_jax.optim.newton_schulz import coefficient_schedule, newton_schulz

MUON, ADAM, FROZEN = "muon", "adam", "frozen"


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path_str(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts) or "<root>"


def pure(tree):
    """The tree with every `nnx.Variable` replaced by its value (the structure `update` receives)."""
    return jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, tree, is_leaf=_is_variable)


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
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)
    dims = [_metadata_dims(_path_str(p), v) if isinstance(v, nnx.Param) else None for p, v in leaves]
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

    def label_tree(self):
        return jax.tree.unflatten(self.treedef, self.labels)

    def muon_leaves(self) -> list[int]:
        return [i for i, label in enumerate(self.labels) if label == MUON]


def make_plan(params, weight_dimension_numbers=None) -> MuonPlan:
    """Resolve every leaf's label and matrix view (see the module docstring for the rules)."""
    raw, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)
    values = pure(params)
    treedef = jax.tree.structure(values)
    paths = tuple(_path_str(p) for p, _ in raw)
    shapes = tuple(tuple(jnp.shape(v.get_value() if _is_variable(v) else v)) for _, v in raw)
    frozen = [_is_variable(v) and not isinstance(v, nnx.Param) for _, v in raw]  # e.g. the router bias

    if weight_dimension_numbers is None:
        if any(_is_variable(v) for _, v in raw):
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


class ScaleByMuonState(NamedTuple):
    count: jax.Array   # int32[]
    mu: Any            # momentum, sharded like the parameters


def _shape_scale(fan_in: int, fan_out: int, consistent_rms):
    """Jordan's width scaling, or Moonlight's consistent RMS (optax's scale_by_shape, per matrix)."""
    if consistent_rms is None:
        return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms


def scale_by_muon(plan: MuonPlan, *, ns_coeffs="standard", ns_steps: int = 5, beta=0.95, eps=1e-8,
                  mu_dtype=None, nesterov: bool = True, ns_dtype=jnp.bfloat16, consistent_rms=None,
                  chunks: int = 4) -> optax.GradientTransformation:
    """Momentum, sharded batched NS and shape scaling for the Muon leaves of `plan`.

    Acts on the Muon-only (masked) tree: its leaves are `plan`'s Muon leaves, in order.
    """
    schedule = coefficient_schedule(ns_coeffs, ns_steps)
    mu_dtype = jnp.dtype(mu_dtype) if mu_dtype is not None else None
    ids = plan.muon_leaves()
    views = [layout.matrix_view(plan.shapes[i], *plan.axes[i]) for i in ids]
    fans = [(math.prod(plan.shapes[i][a] for a in plan.axes[i][0]),
             math.prod(plan.shapes[i][a] for a in plan.axes[i][1])) for i in ids]

    def init_fn(params):
        return ScaleByMuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params, dtype=mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        leaves, treedef = jax.tree.flatten(mu_hat)
        compute = [x.astype(ns_dtype or x.dtype) for x in leaves]
        ortho = layout.orthogonalize(compute, views, lambda x: newton_schulz(x, schedule, eps), chunks)
        scaled = [o.astype(x.dtype) * _shape_scale(fi, fo, consistent_rms)
                  for o, x, (fi, fo) in zip(ortho, leaves, fans)]
        return jax.tree.unflatten(treedef, scaled), ScaleByMuonState(count, optax.tree.cast(mu, mu_dtype))

    return optax.GradientTransformation(init_fn, update_fn)


class MuonState(NamedTuple):
    inner: Any          # optax.partition state: {'muon': ..., 'adam': ..., 'frozen': ...}
    plan: MuonPlan      # static


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs="standard",
    ns_steps: int = 5,
    beta=0.95,
    eps=1e-8,
    weight_decay=0.0,
    weight_decay_mask=None,
    mu_dtype=None,
    *,
    nesterov: bool = True,
    ns_dtype=jnp.bfloat16,
    consistent_rms=None,
    chunks: int = 4,
    adam_b1=0.9,
    adam_b2=0.999,
    adam_eps_root=0.0,
    adam_weight_decay=0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any | Callable | None = None,
) -> optax.GradientTransformation:
    """Muon for matrices (see the module docstring), AdamW for the rest; an optax GradientTransformation.

    learning_rate: scalar or schedule (Muon; also Adam unless `adam_learning_rate`).
    ns_coeffs: 'standard' (= 'jordan', Keller Jordan's quintic), 'dion', 'polar_express', an (a, b, c)
      triple or a schedule of triples; ns_steps: NS steps (static int).
    beta: momentum decay; eps: NS normalisation and Adam epsilon; nesterov: optax's Nesterov form.
    weight_decay, weight_decay_mask: decoupled decay of Muon matrices (update -= lr * wd * W).
    mu_dtype: momentum dtype (None: the gradient's); ns_dtype: NS compute and communication dtype
      (None: the momentum's, as optax).
    consistent_rms: None for Jordan's sqrt(max(1, fan_out/fan_in)), or a float (Moonlight: 0.2) for
      consistent_rms * sqrt(max(fan_in, fan_out)), fans per matrix (per head / per expert).
    chunks: pieces each same-shape batch is cut into so communication overlaps NS (>= 1).
    muon_weight_dimension_numbers: optax.contrib.muon's argument; None reads the model metadata.
    """
    coefficient_schedule(ns_coeffs, ns_steps)  # fail at construction on bad coefficients
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if ns_dtype is not None and not jnp.issubdtype(jnp.dtype(ns_dtype), jnp.floating):
        raise ValueError(f"ns_dtype must be a floating dtype or None, got {ns_dtype!r}")

    def inner(plan: MuonPlan) -> optax.GradientTransformation:
        transforms = {
            MUON: optax.chain(
                scale_by_muon(plan, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps, mu_dtype=mu_dtype,
                              nesterov=nesterov, ns_dtype=ns_dtype, consistent_rms=consistent_rms, chunks=chunks),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate),
            ),
            ADAM: optax.adamw(learning_rate=learning_rate if adam_learning_rate is None else adam_learning_rate,
                              b1=adam_b1, b2=adam_b2, eps=eps, eps_root=adam_eps_root,
                              weight_decay=adam_weight_decay, mu_dtype=mu_dtype, nesterov=nesterov),
            FROZEN: optax.set_to_zero(),
        }
        present = set(plan.labels)
        return optax.partition({k: v for k, v in transforms.items() if k in present}, plan.label_tree())

    def init_fn(params):
        plan = make_plan(params, muon_weight_dimension_numbers)
        return MuonState(inner(plan).init(pure(params)), plan)

    def update_fn(updates, state, params=None):
        if not isinstance(state, MuonState):
            raise TypeError(f"muon: expected the MuonState made by this transformation's init, got {type(state)}")
        plan = state.plan
        if jax.tree.structure(updates) != plan.treedef:
            raise ValueError("muon: the updates' tree differs from the parameters given to init (pass plain "
                             f"arrays, as nnx.Optimizer does):\n  init:   {plan.treedef}\n  update: "
                             f"{jax.tree.structure(updates)}")
        for path, shape, x in zip(plan.paths, plan.shapes, jax.tree.leaves(updates)):
            if tuple(x.shape) != shape:
                raise ValueError(f"muon: update for '{path}' has shape {tuple(x.shape)}, init saw {shape}")
        new_updates, new_inner = inner(plan).update(updates, state.inner, params)
        return new_updates, MuonState(new_inner, plan)

    return optax.GradientTransformation(init_fn, update_fn)
