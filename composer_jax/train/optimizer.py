"""The optimizer from config: AdamW (optax) or Muon (`composer_jax.optim.muon`), global-norm clipping
and a warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from composer_jax.config import ConfigError
from composer_jax.train.config import OptimizerConfig


def wsd_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Warmup-stable-decay: linear 0 -> lr over `warmup_steps`, constant, then the last
    `decay_fraction` of `total_steps` decays (linear or cosine) to lr * min_lr_ratio."""
    decay_steps = int(round(cfg.decay_fraction * total_steps))
    decay_start = max(total_steps - decay_steps, cfg.warmup_steps)
    decay_steps = max(total_steps - decay_start, 0)
    floor = cfg.lr * cfg.min_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.lr * jnp.minimum(1.0, (step + 1) / max(cfg.warmup_steps, 1)) if cfg.warmup_steps else cfg.lr
        frac = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
        if cfg.decay_shape == "cosine":
            decayed = floor + (cfg.lr - floor) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        else:
            decayed = cfg.lr + (floor - cfg.lr) * frac
        return jnp.where(step < decay_start, warm, decayed) if decay_steps else warm

    return schedule


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2) only: norms and other vectors are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _muon(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    try:
        module = importlib.import_module("composer_jax.optim.muon")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("composer_jax.optim"):
            raise ConfigError("optimizer.name", "'muon' needs composer_jax.optim.muon, which is not in this "
                                                "installation yet; use optimizer.name=adamw") from None
        raise
    try:
        # Muon for the matrices it plans from the params' metadata, AdamW (no decay) for the rest.
        return module.muon(learning_rate=schedule, weight_decay=cfg.weight_decay, eps=cfg.eps,
                           adam_b1=cfg.b1, adam_b2=cfg.b2, ns_dtype=cfg.ns_dtype)
    except TypeError as e:
        raise ConfigError("optimizer.name", f"composer_jax.optim.muon.muon rejected the arguments: {e}") from None


class Optimizer(NamedTuple):
    """tx, its learning-rate schedule, and how it meets the two meshes: `per_group` transformations
    (optax AdamW) run once per mesh group on a flat list of that group's leaves; the others (Muon)
    take the whole parameter State, metadata included, and keep each leaf on its own mesh themselves."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    per_group: bool


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> Optimizer:
    """The configured optimizer. Global-norm clipping, which needs every leaf, is done by the step
    before it (`clip_scale`)."""
    schedule = wsd_schedule(cfg, total_steps)
    if cfg.name == "muon":
        return Optimizer(_muon(cfg, schedule), schedule, per_group=False)
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    return Optimizer(tx, schedule, per_group=True)


def clip_scale(grad_norm: jax.Array, max_norm: float) -> jax.Array:
    """The factor that scales gradients to global norm <= max_norm (optax.clip_by_global_norm's rule)."""
    if not max_norm:
        return jnp.ones((), jnp.float32)
    return jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm).astype(jnp.float32)
