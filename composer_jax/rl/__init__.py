"""RL: rollout batches, loss terms and the fused, jitted RL step (group policy gradient + KL +
entropy + targeted-feedback self-distillation + MTP self-distillation, accumulated over micro-batches),
batch ingestion onto the devices, task sampling by difficulty and rollout groups."""

from composer_jax.rl.batch import BatchError, RolloutBatch, synthetic_batch, teacher_slot, validate_batch
from composer_jax.rl.config import RLConfig
from composer_jax.rl.groups import Group, GroupAssembler, Sample
from composer_jax.rl.ingest import device_batch
from composer_jax.rl.objective import loss_and_grads
from composer_jax.rl.sampler import Prompt, SamplerConfig, SamplerError, TaskSampler
from composer_jax.rl.step import RLStep, make_step

__all__ = ["BatchError", "Group", "GroupAssembler", "Prompt", "RLConfig", "RLStep", "RolloutBatch", "Sample",
           "SamplerConfig", "SamplerError", "TaskSampler", "device_batch", "loss_and_grads", "make_step",
           "synthetic_batch", "teacher_slot", "validate_batch"]
