"""RL: rollout batches, loss terms and the fused, jitted RL step (group policy gradient + KL +
entropy + targeted-feedback self-distillation)."""

from composer_jax.rl.batch import BatchError, RolloutBatch, synthetic_batch, teacher_slot, validate_batch
from composer_jax.rl.config import RLConfig, make_optimizer
from composer_jax.rl.step import RLState, RLStep, init_state, loss_and_grads, make_step

__all__ = ["BatchError", "RLConfig", "RLState", "RLStep", "RolloutBatch", "init_state", "loss_and_grads",
           "make_optimizer", "make_step", "synthetic_batch", "teacher_slot", "validate_batch"]
