"""The RL step: the fused objective's gradient (`rl.objective`), then pretraining's update
(`train.update.apply_gradients`: global-norm clipping over both meshes, a finite guard, the
optimizer), in one jitted function with the state donated.

The state is pretraining's `composer_jax.train.state.TrainState` (RL resumes from its checkpoints).
`RLStep(...)(state, batch)` validates the batch on the host (BatchError names the field), puts this
process's rows on the devices (rl/ingest.py) and runs the jitted step, which accumulates gradients
over micro-batches of `cfg.micro_batch` rows; nothing inside the step syncs with the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.config import ConfigError
from composer_jax.model import CausalLM
from composer_jax.rl.batch import RolloutBatch, validate_batch
from composer_jax.rl.config import RLConfig
from composer_jax.rl.ingest import data_shards, device_batch, global_rows
from composer_jax.rl.objective import loss_and_grads
from composer_jax.train.optimizer import Optimizer, make_optimizer
from composer_jax.train.state import TrainState, split_model
from composer_jax.train.update import apply_gradients


def make_step(graphdef, rest, cfg: RLConfig, opt: Optimizer):
    """The un-jitted step (TrainState, RolloutBatch, teacher parameters or None) -> (TrainState, metrics
    of f32 scalars). The router biases are left as they are: the RL update keeps the routing the sampler saw."""

    def step(state: TrainState, batch: RolloutBatch, teacher_params=None):
        (loss, metrics), grads = loss_and_grads(graphdef, rest, state, batch, cfg, teacher_params)
        new = apply_gradients(opt, state.params, state.opt_state, grads, loss, cfg.optimizer.max_grad_norm)
        skipped = state.skipped + (~new.finite).astype(jnp.int32)
        metrics = dict(metrics, loss=loss, grad_norm=new.grad_norm, lr=opt.schedule(state.step), finite=new.finite,
                       skipped=skipped)
        return TrainState(state.step + 1, new.params, state.biases, new.opt_state, skipped), metrics

    return step


class RLStep:
    """The jitted, donated RL step for one model structure, with host-side batch validation in front.

        rl_step = RLStep(model, rl_cfg)             # laid out as the model is (`model.mesh`: a DualMesh or None);
                                                    # sd_teacher=initial: the model's parameters are the teacher's
        state = rl_step.init_state(model)           # shares the model's arrays (donated by the first step)
        state, metrics = rl_step(state, batch)
    """

    def __init__(self, model: CausalLM, cfg: RLConfig):
        self.model_cfg, self.cfg, self.dual = model.cfg, cfg, model.mesh
        self.graphdef, params, _, self.rest = split_model(model)
        meshes = self.dual.meshes if self.dual is not None else ()
        self.opt = make_optimizer(cfg.optimizer, cfg.steps, params, meshes)
        self.jitted = jax.jit(make_step(self.graphdef, self.rest, cfg, self.opt), donate_argnums=0)
        # sd_teacher=initial: a copy of the parameters as they are now (the model's arrays are donated by the steps)
        self.teacher_params = jax.tree.map(jnp.copy, params) if cfg.sd_teacher == "initial" else None

    def init_state(self, model: CausalLM) -> TrainState:
        """Step 0 with a fresh optimizer state, each leaf on its parameter's mesh."""
        _, params, biases, _ = split_model(model)
        zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        return TrainState(zero(), params, biases, self.opt.tx.init(params), zero())

    def validate(self, batch: RolloutBatch) -> None:
        """BatchError naming the field (or ConfigError naming `micro_batch`) before anything is traced."""
        validate_batch(batch, group_size=self.cfg.group_size, vocab_size=self.model_cfg.vocab_size,
                       need_ref=self.cfg.kl_coef > 0)
        self.cfg.micro_batches(global_rows(batch))
        shards = data_shards(self.dual)
        if self.cfg.micro_batch % shards:   # the model lays each micro-batch's rows over the data axes
            raise ConfigError("micro_batch", f"micro-batches of {self.cfg.micro_batch} rows do not split over the "
                                             f"{shards} data-parallel shards (dense mesh replica x fsdp)")

    def __call__(self, state: TrainState, batch: RolloutBatch):
        """One step on this process's rows (a RolloutBatch of numpy arrays)."""
        self.validate(batch)
        return self.jitted(state, device_batch(batch, self.dual), self.teacher_params)
