"""RL: rollout batches, loss terms and the fused, jitted RL step (group policy gradient + KL +
entropy + targeted-feedback self-distillation)."""

from composer_jax.rl.batch import BatchError, RolloutBatch, synthetic_batch, teacher_slot, validate_batch
from composer_jax.rl.config import RLConfig
from composer_jax.rl.objective import loss_and_grads
from composer_jax.rl.step import RLStep, make_step

__all__ = ["BatchError", "RLConfig", "RLStep", "RolloutBatch", "loss_and_grads", "make_step", "synthetic_batch",
           "teacher_slot", "validate_batch"]
