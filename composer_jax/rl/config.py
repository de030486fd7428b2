"""`RLConfig`: the fused RL step's loss weights, estimators and optimizer (a typed, frozen dataclass
read with `composer_jax.config.from_dict` like every other config). The optimizer section is the
training one (`composer_jax.train.config.OptimizerConfig`), with RL defaults: Adam (AdamW without
decay, as Composer 2) at a constant learning rate."""

from __future__ import annotations

import dataclasses
from typing import Literal

from composer_jax.config import ConfigError
from composer_jax.envs.feedback import FLAG_KINDS
from composer_jax.train.config import OptimizerConfig


def rl_optimizer() -> OptimizerConfig:
    """Adam over all parameters (AdamW with no weight decay), constant learning rate, clipping at 1."""
    return OptimizerConfig(name="adamw", lr=1e-6, warmup_steps=0, decay_fraction=0.0, weight_decay=0.0)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Loss terms (shared/reference/rl.md section 6) and the optimizer of one RL update."""

    group_size: int = 8                 # samples per prompt; every group in a batch must be full
    # Dr. GRPO's constant: L_pg, L_kl, L_H divide token sums by B * max_tokens (set it to the rollouts'
    # generation budget per trajectory). 0: by the step's generated-token count instead (a token mean,
    # as DAPO). Never the padded length of the batch.
    max_tokens: int = 0
    micro_batch: int = 0                # rows per micro-batch (gradient accumulation in the step); 0 = all rows
    is_cap: float = 2.0                 # truncated importance sampling: w = min(pi / pi_behaviour, is_cap)
    kl_coef: float = 0.0                # beta; > 0 needs the batch's `ref_logprobs`
    kl_estimator: Literal["k1_reward", "k2_loss"] = "k1_reward"   # both have the reverse-KL gradient
    entropy_coef: float = 0.0           # alpha: full-vocabulary entropy bonus
    sd_coef: float = 1.0                # lambda_sd: self-distillation on flagged turns
    # forward KL (cross-entropy to the hinted teacher) raises a token the student gives ~0 probability; reverse
    # KL's gradient vanishes with that probability, so a confidently wrong first token is never corrected
    # (tests/test_rl_oracle.py, the oracle-hint check)
    sd_divergence: Literal["reverse_kl", "forward_kl", "jsd", "sampled_token"] = "forward_kl"
    sd_jsd_beta: float = 0.5
    # the flag kinds whose turns get a teacher window (their hint); other flags are still counted (flag_<kind>)
    # and left to the reward: e.g. [redundant_call, wrong_tool] teaches the behaviours the hints name, not markup
    sd_flags: tuple[str, ...] = FLAG_KINDS
    teacher_context: Literal["prefix", "full"] = "prefix"  # prefix: [hint + turn] over the student's latents
    # The teacher's parameters: the policy's own (live, under stop-gradient) or those it had when RL began
    # (initial: fixed, init_from's policy; OPSD's recommended teacher, rl.md 3.5); initial needs
    # teacher_context=full (the prefix path would read the live student's latents)
    sd_teacher: Literal["live", "initial"] = "live"
    mtp_distill_weight: float = 0.1     # MTP depths' self-distillation toward the policy (trains the depths only)
    loss_chunk: int = 512               # positions per logits block: [rows, chunk, vocab] f32 at a time
    remat: Literal["none", "full", "dots"] = "none"   # the student forward per layer, as train.remat
    optimizer: OptimizerConfig = dataclasses.field(default_factory=rl_optimizer)  # name=muon selects Muon
    steps: int = 1000                   # optimizer steps of the run (the learning-rate schedule's horizon)
    max_staleness: int = 1              # the RL loop trains no batch older than this many policy versions (0: synchronous)
    # every this many steps the loop appends the best, the worst and a random episode of the step's batch to
    # RUN_DIR/rollouts.jsonl (`composer-jax rollouts RUN_DIR` shows them); 0: none
    log_rollouts_every: int = 10

    def __post_init__(self):
        checks = [
            ("group_size", self.group_size >= 2, "must be >= 2 (a group baseline needs two samples)"),
            ("max_tokens", self.max_tokens >= 0,
             "must be >= 0 (> 0: Dr. GRPO's constant B * max_tokens; 0: the step's generated-token count)"),
            ("micro_batch", self.micro_batch >= 0, "must be >= 0 (rows per micro-batch; 0 = the whole batch)"),
            ("mtp_distill_weight", self.mtp_distill_weight >= 0, "must be >= 0"),
            ("is_cap", self.is_cap >= 1.0, "must be >= 1 (the weight is 1 on-policy)"),
            ("kl_coef", self.kl_coef >= 0, "must be >= 0"),
            ("kl_estimator", self.kl_estimator in ("k1_reward", "k2_loss"),
             (f"got {self.kl_estimator!r}: only 'k1_reward' (k1 in the reward) and 'k2_loss' have the "
              "reverse-KL gradient; k3 as a loss follows the forward KL(ref || policy) and is not offered")),
            ("entropy_coef", self.entropy_coef >= 0, "must be >= 0"),
            ("sd_coef", self.sd_coef >= 0, "must be >= 0"),
            ("sd_jsd_beta", 0 < self.sd_jsd_beta < 1, "must be in (0, 1)"),
            ("sd_flags", set(self.sd_flags) <= set(FLAG_KINDS),
             f"unknown flag kind {', '.join(repr(k) for k in self.sd_flags if k not in FLAG_KINDS)}; the kinds are "
             f"{', '.join(FLAG_KINDS)}"),
            ("sd_teacher", self.sd_teacher == "live" or self.teacher_context == "full",
             "initial needs teacher_context=full: the prefix teacher attends to the live student's latents"),
            ("loss_chunk", self.loss_chunk > 0, "must be > 0"),
            ("steps", self.steps > 0, "must be > 0"),
            ("max_staleness", self.max_staleness >= 0, "must be >= 0 (0: every batch is sampled by the current policy)"),
            ("log_rollouts_every", self.log_rollouts_every >= 0, "must be >= 0 (0: no RUN_DIR/rollouts.jsonl)"),
        ]
        for key, ok, message in checks:
            if not ok:
                raise ConfigError(key, message)

    def micro_batches(self, rows: int) -> int:
        """How many micro-batches a step of `rows` rows runs (ConfigError if they do not divide)."""
        if not self.micro_batch:
            return 1
        if rows % self.micro_batch:
            raise ConfigError("micro_batch", f"{rows} rows per step are not a whole number of micro-batches of "
                                             f"{self.micro_batch} rows")
        return rows // self.micro_batch
