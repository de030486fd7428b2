"""Models with random weights filled from NumPy (in well under a second; initialising through the
model's own per-parameter `jax.random` calls compiles one program per shape, ~10-20 s for the tiny
model on a busy 2-core machine). The spread follows tests/hf_reference.py: weights N(0, 0.08), norm
scales 1 + N(0, 0.2), router biases U(0, 0.5)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import CausalLM
from composer_jax.config import MeshConfig
from composer_jax.model.layers import RouterBias
from composer_jax.parallel import DualMesh


def random_model(cfg, seed: int = 0, mesh=None) -> CausalLM:
    """A CausalLM of `cfg` (laid out on `mesh`, if given) with random weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)))
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if isinstance(var, RouterBias):
            value = 0.5 * rng.random(shape)
        elif path[-1] == "scale":
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = 0.08 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_random_run(run: Path, overrides=(), *, seed: int = 4, step: int = 3) -> Path:
    """A training run directory `run` of pretrain-tiny made byte-level (a 256-id vocabulary; with
    `overrides`) holding one checkpoint, at `step`, of a pretraining state with random weights (one device)."""
    from composer_jax.train.checkpoints import RunCheckpoints
    from composer_jax.train.config import load_run_config, to_dict
    from composer_jax.train.state import StateLayout, split_model

    cfg = load_run_config("pretrain-tiny", [f"run_dir={run}", "model.vocab_size=256", "data.tokenizer=byte", *overrides])
    layout = StateLayout(cfg, DualMesh(MeshConfig(), jax.devices()[:1], model=cfg.model))
    _, params, biases, _ = split_model(random_model(cfg.model, seed))
    checkpoints = RunCheckpoints(run / "checkpoints", cfg.checkpoint)
    placed = jax.device_put((params, biases), (layout.shardings.params, layout.shardings.biases))
    checkpoints.save(step, layout.from_params(*placed), {}, to_dict(cfg))
    checkpoints.close()
    return run
