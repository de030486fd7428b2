"""`RLConfig`: the fused RL step's loss weights, estimators and optimizer (a typed, frozen dataclass
read with `composer_jax.config.from_dict` like every other config), and the optimizer it builds."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

import optax

from composer_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Loss terms (shared/reference/rl.md section 6) and the optimizer of one RL update."""

    group_size: int = 8                 # samples per prompt; every group in a batch must be full
    max_tokens: int = 0                 # Dr. GRPO constant: L_pg sums tokens / (B * max_tokens); 0 = seq len
    is_cap: float = 2.0                 # truncated importance sampling: w = min(pi / pi_behaviour, is_cap)
    kl_coef: float = 0.0                # beta; > 0 needs the batch's `ref_logprobs`
    kl_estimator: Literal["k1_reward", "k2_loss"] = "k1_reward"   # both have the reverse-KL gradient
    entropy_coef: float = 0.0           # alpha: full-vocabulary entropy bonus
    sd_coef: float = 1.0                # lambda_sd: self-distillation on flagged turns
    sd_divergence: Literal["reverse_kl", "forward_kl", "jsd", "sampled_token"] = "reverse_kl"
    sd_jsd_beta: float = 0.5
    teacher_context: Literal["prefix", "full"] = "prefix"  # prefix: [hint + turn] over the student's latents
    optimizer: Literal["adam", "adamw", "muon"] = "adam"    # Composer 2: Adam over all parameters
    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0           # adamw / muon only
    max_grad_norm: float = 1.0          # global-norm clipping before the optimizer; 0 disables

    def __post_init__(self):
        checks = [
            ("group_size", self.group_size >= 2, "must be >= 2 (a group baseline needs two samples)"),
            ("max_tokens", self.max_tokens >= 0, "must be >= 0 (0 = the batch's sequence length)"),
            ("is_cap", self.is_cap >= 1.0, "must be >= 1 (the weight is 1 on-policy)"),
            ("kl_coef", self.kl_coef >= 0, "must be >= 0"),
            ("kl_estimator", self.kl_estimator in ("k1_reward", "k2_loss"),
             f"got {self.kl_estimator!r}: only 'k1_reward' (k1 in the reward) and 'k2_loss' have the "
             "reverse-KL gradient; k3 as a loss follows the forward KL(ref || policy) and is not offered"),
            ("entropy_coef", self.entropy_coef >= 0, "must be >= 0"),
            ("sd_coef", self.sd_coef >= 0, "must be >= 0"),
            ("sd_jsd_beta", 0 < self.sd_jsd_beta < 1, "must be in (0, 1)"),
            ("learning_rate", self.learning_rate > 0, "must be > 0"),
            ("b1", 0 <= self.b1 < 1, "must be in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "must be in [0, 1)"),
            ("eps", self.eps > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be >= 0 (0 disables clipping)"),
        ]
        for key, ok, message in checks:
            if not ok:
                raise ConfigError(key, message)
        if self.optimizer == "adam" and self.weight_decay:
            raise ConfigError("weight_decay", "plain Adam has no weight decay; use optimizer=adamw")


def make_optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then Adam (default), AdamW or Muon (`composer_jax.optim.muon`, imported
    only when chosen). Muon reads the matrix views from the params' metadata: initialise it with the
    `nnx.State` of Params, not with plain arrays."""
    if cfg.optimizer == "muon":
        muon = importlib.import_module("composer_jax.optim.muon").muon
        tx = muon(learning_rate=cfg.learning_rate, beta=cfg.b1, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  adam_b1=cfg.b1, adam_b2=cfg.b2)
    elif cfg.optimizer == "adamw":
        tx = optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        tx = optax.adam(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if cfg.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
    return tx
