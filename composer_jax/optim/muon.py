"""Muon as an optax GradientTransformation: momentum, then Newton-Schulz per matrix of each parameter
(per head, per expert, per stacked layer), batched across parameters and sharded so that every device
orthogonalizes its own whole matrices (`layout`); AdamW for the other parameters.

Same numbers as `optax.contrib.muon` (0.2.8) with matching settings, step by step:
  mu <- beta mu + (1 - beta) g;   mu_hat = bias-corrected mu, or with Nesterov (optax's form)
  beta mu/(1 - beta^(t+1)) + (1 - beta) g/(1 - beta^t);   O = NS(mu_hat) per matrix;
  O *= sqrt(max(1, fan_out/fan_in)) (Jordan) or consistent_rms * sqrt(max(fan_in, fan_out)) (Moonlight);
  update = -lr (O + wd W)   (decoupled weight decay with the base lr, as Moonlight and optax);
and optax's (N)AdamW, sharing `eps`, for the rest. Differences: NS runs in `ns_dtype` (bfloat16 by
default; optax uses the momentum dtype), variables that are not Params get a zero update, a coefficient
schedule runs in order (first `ns_steps` rows, last row repeated), and a weight-decay mask is a tree
over all parameters.

Which leaves are matrices and how is decided at `init` (`plan.make_plan`) and kept in the state as
static data, so `update` works on the plain arrays `nnx.Optimizer` passes. Every leaf's arithmetic
runs on the leaf's own mesh (`parallel.leafwise`), so parameters may be spread over the dense and the
expert grid; the NS exchange's `shard_map`s need those meshes concrete, so parameters on more than one
mesh need `meshes=` (e.g. `DualMesh.meshes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composer_jax.optim import layout
from composer_jax.optim.newton_schulz import coefficient_schedule, newton_schulz, normalize, split_steps
from composer_jax.optim.param_labels import ADAM, FROZEN, MUON, MuonPlan, is_variable, make_plan, pure
from composer_jax.parallel.leafwise import localize, mesh_of, on_mesh, per_mesh

DEFAULT_NS_STEPS = 5
DEFAULT_CHUNKS = 4


class MuonState(NamedTuple):
    count: jax.Array    # int32[]: steps taken
    mu: Any             # Muon momentum: the parameter tree, optax.MaskedNode outside Muon leaves
    adam: Any           # per mesh group (parallel.leafwise.per_mesh): optax.masked(adamw) over its AdamW leaves
    plan: MuonPlan      # static


def _shape_scale(fan_in: int, fan_out: int, consistent_rms):
    """Jordan's width scaling, or Moonlight's consistent RMS (optax's scale_by_shape, per matrix)."""
    if consistent_rms is None:
        return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms


def _masked(plan: MuonPlan, leaves: dict[int, Any]):
    """The parameter tree with `leaves` (index -> value) and optax.MaskedNode everywhere else."""
    return jax.tree.unflatten(plan.treedef, [leaves.get(i, optax.MaskedNode()) for i in range(len(plan.labels))])


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs="standard",
    ns_steps: int | None = None,
    beta=0.95,
    eps=1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask=None,
    mu_dtype=None,
    *,
    nesterov: bool = True,
    ns_dtype="bfloat16",
    consistent_rms=None,
    chunks: int | None = None,
    adam_b1=0.9,
    adam_b2=0.999,
    adam_eps_root=0.0,
    adam_weight_decay=0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any | Callable | None = None,
    meshes: tuple = (),
) -> optax.GradientTransformation:
    """Muon for matrices (see the module docstring), AdamW for the rest; an optax GradientTransformation.

    learning_rate: scalar or schedule (Muon; also AdamW unless `adam_learning_rate`).
    ns_coeffs: 'standard' (= 'jordan', Keller Jordan's quintic), 'dion', 'polar_express', an (a, b, c)
      triple or a schedule of triples; ns_steps: NS steps (static int; None: 5).
    beta: momentum decay; eps: NS normalisation and AdamW epsilon; nesterov: optax's Nesterov form.
    weight_decay (scalar or schedule), weight_decay_mask (bool tree over the parameters or a callable
      of them): decoupled decay of Muon matrices.
    mu_dtype: momentum dtype (None: the gradient's); ns_dtype: NS compute and communication dtype
      (None: the momentum's, as optax).
    consistent_rms: None for Jordan's sqrt(max(1, fan_out/fan_in)), or a float (Moonlight: 0.2) for
      consistent_rms * sqrt(max(fan_in, fan_out)), fans per matrix (per head / per expert).
    chunks: runs each same-shape batch is cut into so communication overlaps NS (static int; None: 4).
    muon_weight_dimension_numbers: optax.contrib.muon's argument; None reads the model metadata.
    meshes: the concrete `jax.sharding.Mesh`es the parameters live on (e.g. `DualMesh.meshes`); needed
      when Muon matrices live on more than one mesh (the exchange's shard_maps need each concrete mesh,
      which JAX does not expose under a trace). Parameters on one mesh or none need nothing.

    Under `optax.inject_hyperparams` the defaults work as they are; an explicit `ns_steps` or `chunks`
    (ints), a dtype class for `ns_dtype` (pass a string) or a callable for dimension numbers or masks
    must be listed in `static_args`.
    """
    schedule = coefficient_schedule(ns_coeffs, DEFAULT_NS_STEPS if ns_steps is None else ns_steps)
    chunks = DEFAULT_CHUNKS if chunks is None else chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a static int >= 1, got {chunks!r} (under optax.inject_hyperparams "
                         "pass static_args=('chunks',))")
    if ns_dtype is not None and (isinstance(ns_dtype, jax.Array)
                                 or not jnp.issubdtype(jnp.dtype(ns_dtype), jnp.floating)):
        raise ValueError(f"ns_dtype must be a floating dtype name or None, got {ns_dtype!r}")
    mu_dtype = jnp.dtype(mu_dtype) if mu_dtype is not None else None

    def adam_transform(plan: MuonPlan):
        """AdamW over the plan's AdamW leaves, once per mesh; hyperparameters moved onto each mesh."""
        adam_leaves = set(plan.indices(ADAM))

        def make(mesh, members):
            on = lambda v: v if callable(v) else localize(v, mesh)  # noqa: E731
            lr = learning_rate if adam_learning_rate is None else adam_learning_rate
            inner = optax.adamw(learning_rate=on(lr), b1=on(adam_b1), b2=on(adam_b2), eps=on(eps),
                                eps_root=on(adam_eps_root), weight_decay=on(adam_weight_decay), mu_dtype=mu_dtype,
                                nesterov=nesterov)
            return optax.masked(inner, [i in adam_leaves for i in members])

        return per_mesh(make)

    def init_fn(params):
        plan = make_plan(params, muon_weight_dimension_numbers)
        values = jax.tree.leaves(pure(params))
        layout.check_meshes([values[i] for i in plan.indices(MUON)], [plan.paths[i] for i in plan.indices(MUON)],
                            meshes)
        mu = {}
        for i in plan.indices(MUON):
            with on_mesh(mesh_of(values[i])):
                mu[i] = jnp.zeros_like(values[i], dtype=mu_dtype)
        adam = adam_transform(plan).init(pure(params))
        return MuonState(jnp.zeros([], jnp.int32), _masked(plan, mu), adam, plan)

    def orthogonalized(plan, grads, mus, count):
        """Momentum, NS and shape scaling of the Muon leaves: (directions, new momenta), in plan order."""
        ids = plan.indices(MUON)
        new_mu, mu_hat = [], []
        for i, g, m in zip(ids, grads, mus):
            mesh = mesh_of(g)
            with on_mesh(mesh):
                b, t = localize(beta, mesh), optax.safe_increment(localize(count, mesh))
                m = optax.tree.update_moment(g, m, b, 1)
                if nesterov:
                    hat = (b * optax.tree.bias_correction(m, b, optax.safe_increment(t))
                           + (1 - b) * optax.tree.bias_correction(g, b, t))
                else:
                    hat = optax.tree.bias_correction(m, b, t)
                new_mu.append(m.astype(mu_dtype or m.dtype))
                mu_hat.append(hat)
        views = [layout.matrix_view(plan.shapes[i], *plan.axes[i]) for i in ids]
        ns_inputs = []
        for h in mu_hat:
            with on_mesh(mesh_of(h)):  # the cast is an op on the leaf's own grid
                ns_inputs.append(h.astype(ns_dtype or h.dtype))
        split = layout.SplitNS(lambda x: normalize(x, localize(eps, mesh_of(x))),
                               lambda block, reduce: split_steps(block, schedule, reduce))
        ortho = layout.orthogonalize(ns_inputs, views,
                                     lambda x: newton_schulz(x, schedule, localize(eps, mesh_of(x))), chunks, meshes,
                                     split)
        directions = []
        for i, o, h in zip(ids, ortho, mu_hat):
            reduction, output = plan.axes[i]
            fans = (math.prod(plan.shapes[i][a] for a in reduction), math.prod(plan.shapes[i][a] for a in output))
            mesh = mesh_of(h)
            with on_mesh(mesh):
                rms = None if consistent_rms is None else localize(consistent_rms, mesh)
                directions.append(o.astype(h.dtype) * _shape_scale(*fans, rms))
        return directions, new_mu

    def update_fn(updates, state, params=None):
        if not isinstance(state, MuonState):
            raise TypeError(f"muon: expected the MuonState made by this transformation's init, got {type(state)}")
        plan = state.plan
        given, updates = updates, pure(updates)   # nnx.Variable leaves are accepted and given back
        params = pure(params) if params is not None else None
        if jax.tree.structure(updates) != plan.treedef:
            raise ValueError("muon: the updates' tree differs from the parameters given to init:\n  init:   "
                             f"{plan.treedef}\n  update: {jax.tree.structure(updates)}")
        grads = jax.tree.leaves(updates)
        for path, shape, g in zip(plan.paths, plan.shapes, grads):
            if tuple(g.shape) != shape:
                raise ValueError(f"muon: update for '{path}' has shape {tuple(g.shape)}, init saw {shape}")
        decays = not (isinstance(weight_decay, (int, float)) and weight_decay == 0)
        if params is None and decays:
            raise ValueError("muon: weight_decay needs the parameters: call update(updates, state, params)")
        values = jax.tree.leaves(params) if params is not None else [None] * len(grads)
        out: list[Any] = list(grads)

        muon_ids = plan.indices(MUON)
        directions, new_mu = orthogonalized(plan, [grads[i] for i in muon_ids], jax.tree.leaves(state.mu),
                                            state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        wd = weight_decay(state.count) if callable(weight_decay) else weight_decay
        decayed = [decays] * len(grads)
        if decays and weight_decay_mask is not None:
            mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
            decayed = jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, params))
        for i, d in zip(muon_ids, directions):
            mesh = mesh_of(d)
            with on_mesh(mesh):
                if decayed[i]:
                    d = d + localize(wd, mesh) * values[i]
                out[i] = jnp.asarray(-localize(lr, mesh), d.dtype) * d if isinstance(lr, jax.Array) else -lr * d

        adam_updates, new_adam = adam_transform(plan).update(updates, state.adam, params)
        adam_leaves = jax.tree.leaves(adam_updates)
        for i in plan.indices(ADAM):
            out[i] = adam_leaves[i]
        for i in plan.indices(FROZEN):
            with on_mesh(mesh_of(grads[i])):
                out[i] = jnp.zeros_like(grads[i])

        new_state = MuonState(optax.safe_increment(state.count), _masked(plan, dict(zip(muon_ids, new_mu))),
                              new_adam, plan)
        result = jax.tree.unflatten(plan.treedef, out)
        if any(is_variable(v) for v in jax.tree.leaves(given, is_leaf=is_variable)):
            result = jax.tree.map(lambda v, u: v.replace(u) if is_variable(v) else u, given, result,
                                  is_leaf=is_variable)
        return result, new_state

    return optax.GradientTransformation(init_fn, update_fn)
