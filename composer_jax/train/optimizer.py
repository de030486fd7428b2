"""The optimizer from config: AdamW (optax, once per mesh of the dual grid) or Muon
(`composer_jax.optim.muon`), with a warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composer_jax.optim import muon
from composer_jax.parallel.leafwise import per_mesh
from composer_jax.train.config import OptimizerConfig


def wsd_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Warmup-stable-decay over the steps [cfg.schedule_start, cfg.schedule_end or total_steps]: linear
    0 -> lr over `warmup_steps`, constant, then the last `decay_fraction` decays (linear or cosine) to
    lr * min_lr_ratio, where it stays after the end. `step` counts from the start of the run."""
    offset = cfg.schedule_start
    total_steps = (cfg.schedule_end or total_steps) - offset
    decay_steps = int(round(cfg.decay_fraction * total_steps))
    decay_start = max(total_steps - decay_steps, cfg.warmup_steps)
    decay_steps = max(total_steps - decay_start, 0)
    floor = cfg.lr * cfg.min_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32) - offset
        warm = cfg.lr * jnp.minimum(1.0, (step + 1) / max(cfg.warmup_steps, 1)) if cfg.warmup_steps else cfg.lr
        frac = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
        if cfg.decay_shape == "cosine":
            decayed = floor + (cfg.lr - floor) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        else:
            decayed = cfg.lr + (floor - cfg.lr) * frac
        return jnp.where(step < decay_start, warm, decayed) if decay_steps else warm

    return schedule


def decay_mask(params) -> list[bool]:
    """Per parameter leaf (flattened order): decayed iff it is a matrix, i.e. carries `reduction` /
    `output` metadata (the rule Muon uses for its matrices). Norm scales, also when stacked to
    [layers, dim], the embedding, the output head and the router bias are not decayed.

    params: an nnx.State (or abstract State) whose leaves are nnx.Variables with metadata."""
    variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [isinstance(v, nnx.Variable) and v.has_metadata("reduction") for v in variables]


class Optimizer(NamedTuple):
    """An optax transformation over the whole parameter State (each leaf on its own mesh of the dual
    grid) and its learning-rate schedule."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params, meshes: tuple = ()) -> Optimizer:
    """The configured optimizer for `params` (an nnx.State, abstract or concrete: its metadata decides
    what is a matrix). `meshes`: the concrete meshes the parameters live on (`DualMesh.meshes`).
    Global-norm clipping, which needs every leaf of both meshes, is done by the update before it
    (`train.update.apply_gradients`)."""
    schedule = wsd_schedule(cfg, total_steps)
    if cfg.name == "muon":
        # Muon for the matrices it plans from the params' metadata, AdamW (no decay) for the rest.
        tx = muon(learning_rate=schedule, weight_decay=cfg.weight_decay, eps=cfg.eps, adam_b1=cfg.b1,
                  adam_b2=cfg.b2, ns_dtype=cfg.ns_dtype, meshes=meshes)
        return Optimizer(tx, schedule)
    decay = decay_mask(params)

    def adamw(mesh, members):
        return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=[decay[i] for i in members])

    return Optimizer(per_mesh(adamw), schedule)
