"""The train state, and where it lives.

`TrainState` is what pretraining, SFT and RL step and checkpoint. `StateLayout` decides, once per run,
where every leaf lives: params and router biases by the dual-grid rules, the optimizer state as the
optimizer's own init places it (built from the placed params), counters replicated; checkpoints
restore onto its shardings, so a run may resume on another mesh layout.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.checkpoint.manager import abstract_like
from composer_jax.model import CausalLM, split_model
from composer_jax.parallel import DualMesh, param_shardings, state_shardings
from composer_jax.train.config import RunConfig
from composer_jax.train.optimizer import Optimizer, make_optimizer


class TrainState(NamedTuple):
    step: jax.Array          # int32[]: steps taken (skipped ones included)
    params: nnx.State        # nnx.Param leaves (optimized)
    biases: nnx.State        # RouterBias leaves [layers, experts] (load-balancing, not optimized)
    opt_state: object        # the optimizer's state (its leaves on their parameters' meshes)
    skipped: jax.Array       # int32[]: steps skipped by the finite guard


def abstract_model_parts(cfg: RunConfig, dual: DualMesh | None = None):
    """(graphdef, abstract params, abstract biases, rest) without allocating anything; the graphdef
    records the layout `dual` (static: part of every trace's cache key)."""
    return split_model(nnx.eval_shape(lambda: CausalLM(cfg.model, rngs=nnx.Rngs(0), mesh=dual)))


def init_state(cfg: RunConfig, opt: Optimizer, shardings: TrainState | None = None) -> TrainState:
    """A fresh TrainState (traceable: run under `jax.jit`). With `shardings` (params and biases used),
    params and biases are placed first and the optimizer state is built from the placed params, so
    each moment is born on its parameter's mesh with its sharding."""
    _, params, biases, _ = split_model(CausalLM(cfg.model, rngs=nnx.Rngs(cfg.train.seed)))
    if shardings is not None:
        params = jax.tree.map(jax.sharding.reshard, params, shardings.params)
        biases = jax.tree.map(jax.sharding.reshard, biases, shardings.biases)
    zero = jnp.zeros((), jnp.int32)
    return TrainState(zero, params, biases, opt.tx.init(params), zero)


class StateLayout:
    """A run's model structure, optimizer and state placement on `dual`.

    graphdef, rest: the model's static structure (the layout recorded in it) and other variables;
    opt: the optimizer; shardings: a TrainState of NamedShardings; abstract: a TrainState of
    ShapeDtypeStructs carrying them (the target of checkpoint restores).
    """

    def __init__(self, cfg: RunConfig, dual: DualMesh):
        self.cfg, self.dual = cfg, dual
        self.graphdef, params, biases, self.rest = abstract_model_parts(cfg, dual)
        self.opt = make_optimizer(cfg.optimizer, cfg.train.steps, params, dual.meshes)
        placement = TrainState(None, param_shardings(params, dual), param_shardings(biases, dual), None, None)
        with dual:
            abstract = jax.eval_shape(lambda: init_state(cfg, self.opt, placement))
        self.shardings = state_shardings(abstract, dual)
        self.abstract = abstract_like(abstract, self.shardings)

    def fresh(self) -> TrainState:
        """A freshly initialised state, placed (jitted: each leaf is born on its device shard)."""
        def init():
            state = init_state(self.cfg, self.opt, self.shardings)
            return jax.tree.map(jax.sharding.reshard, state, self.shardings)

        with self.dual:
            return jax.jit(init)()

    def from_params(self, params: nnx.State, biases: nnx.State) -> TrainState:
        """Step 0 with these params and biases and a fresh optimizer state (phase 2, SFT, RL)."""
        def fresh(params, biases):
            zero = jnp.zeros((), jnp.int32)
            state = TrainState(zero, params, biases, self.opt.tx.init(params), zero)
            return jax.tree.map(jax.sharding.reshard, state, self.shardings)

        with self.dual:
            return jax.jit(fresh)(params, biases)
