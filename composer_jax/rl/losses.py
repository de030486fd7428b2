"""RL loss terms as small pure functions (shared/reference/rl.md sections 2, 3 and 6).

Notation: B trajectories, S token slots, V vocabulary. Per-token arrays are aligned with the token
they score: `logp[b, t] = log pi(tokens[b, t] | tokens[b, <t])`. `mask` f32/bool[B, S] marks the tokens
the policy generated (prompt, tool and environment tokens are 0). `sg` is stop-gradient.

The fused objective (composer_jax/rl/step.py) is

    L = L_pg + L_kl - L_entropy + lambda_sd * L_sd   (+ the MTP depths' self-distillation, train/losses.py)

with every term below. Terms are *sums divided by a constant* N (Dr. GRPO; rl/config.py `max_tokens`),
except the self-distillation mean over the distilled tokens.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient

Divergence = Literal["reverse_kl", "forward_kl", "jsd", "sampled_token"]
KLEstimator = Literal["k1", "k2", "k3"]


# ------------------------------------------------------------------------------------------------
# Advantages and aggregation


def group_advantages(rewards: jax.Array, group_ids: jax.Array, *, scale_by_std: bool = False,
                     eps: float = 1e-6) -> jax.Array:
    """Group-relative advantages f32[B].

    Dr. GRPO (default):  A_i = R_i - mean_{j: g_j = g_i} R_j
    GRPO (scale_by_std): A_i = (R_i - mean_g R) / (std_g R + eps), std with ddof=0

    rewards: f32[B]; group_ids: int[B] (any ids; each group's members may sit anywhere in the batch).
    The group mean is a [B, B] same-group matrix product: no host sync, no static group count.
    """
    rewards = rewards.astype(jnp.float32)
    same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)     # [B, B]
    count = same.sum(-1)
    mean = same @ rewards / count
    adv = rewards - mean
    if scale_by_std:
        std = jnp.sqrt(same @ (adv * adv) / count)
        adv = adv / (std + eps)
    return adv


def constant_sum(values: jax.Array, mask: jax.Array, normalizer: float | jax.Array) -> jax.Array:
    """Dr. GRPO aggregation: sum_{i,t} m_it v_it / N with a constant N (e.g. B * max_tokens), never a
    response's own length. values, mask: [B, S]."""
    return jnp.sum(values * mask) / normalizer


def sequence_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """GRPO aggregation: (1/B) sum_i (1/|o_i|) sum_t m_it v_it (the length-biased form, for reference).
    values, mask: [B, S]."""
    per_seq = jnp.sum(values * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)
    return jnp.mean(per_seq)


# ------------------------------------------------------------------------------------------------
# Per-token log-probabilities and entropy


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[target]: logits f32[..., V], targets int[...] -> f32[...]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits: jax.Array) -> jax.Array:
    """Full-vocabulary entropy H = -sum_v p_v log p_v: logits f32[..., V] -> f32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# ------------------------------------------------------------------------------------------------
# Off-policy correction and the policy gradient


def importance_weights(logp: jax.Array, behaviour_logp: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    """Truncated importance sampling (TIS): w = sg(min(exp(logp - logp_behaviour), C)).

    Rollouts are asynchronous, so the sampler's policy lags the learner's. Returns the weights
    f32[...] (no gradient flows through them) and bool[...] where the cap was active.
    """
    ratio = jnp.exp(sg(logp) - behaviour_logp)
    return jnp.minimum(ratio, cap), ratio > cap


def policy_gradient_loss(logp: jax.Array, advantages: jax.Array, weights: jax.Array, mask: jax.Array,
                         normalizer: float | jax.Array) -> jax.Array:
    """L_pg = -(1/N) sum_{i,t} m_it w_it A_it log pi(y_it)    (single epoch: no PPO clip is needed)

    logp, weights, mask: [B, S]; advantages: [B] (broadcast over tokens) or [B, S] (per token, e.g.
    with k1 folded in). Gradient: -(1/N) sum m w A grad log pi, the truncated-IS REINFORCE estimator.
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return -constant_sum(weights * sg(advantages) * logp, mask, normalizer)


# ------------------------------------------------------------------------------------------------
# KL to the reference policy


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: KLEstimator) -> jax.Array:
    """Schulman's per-token estimators of KL(pi || pi_ref) on samples y ~ pi, with d = logp - ref_logp:

        k1 = d        k2 = d^2 / 2        k3 = exp(-d) - 1 + d

    As *values*: k1, k3 unbiased, k2 biased. As *losses* (gradient of the expectation over the
    sampled tokens): k2 gives the reverse-KL gradient, k3 the forward KL(pi_ref || pi) gradient, k1
    zero. So a reverse-KL regulariser uses k1 in the reward (`kl_reward_advantages`) or k2 as a loss
    (`k2_kl_loss`); k3 serves only as the reported value.
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return jnp.exp(-d) - 1.0 + d
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def kl_reward_advantages(advantages: jax.Array, logp: jax.Array, ref_logp: jax.Array, coef: float) -> jax.Array:
    """k1 in the reward, per token (no discounting into the future):

        A_it <- A_i - beta * sg(logp_it - ref_logp_it)

    advantages: f32[B]; logp, ref_logp: [B, S] -> f32[B, S]. Through `policy_gradient_loss` this adds
    (beta/N) sum m w sg(d) grad log pi: the reverse-KL gradient, identical per token to `k2_kl_loss`.
    """
    return advantages[:, None] - coef * sg(logp - ref_logp)


def k2_kl_loss(logp: jax.Array, ref_logp: jax.Array, weights: jax.Array, mask: jax.Array, coef: float,
               normalizer: float | jax.Array) -> jax.Array:
    """k2 as a loss: L_kl = (beta/N) sum m w (logp - ref_logp)^2 / 2; gradient (beta/N) sum m w d grad log pi.

    Weighted by the same TIS weights as the policy gradient (the tokens come from the behaviour
    policy), so it matches k1-in-the-reward exactly. All arrays [B, S].
    """
    return coef * constant_sum(weights * kl_estimate(logp, ref_logp, "k2"), mask, normalizer)


def entropy_bonus(entropy: jax.Array, mask: jax.Array, coef: float, normalizer: float | jax.Array) -> jax.Array:
    """L_H = (alpha/N) sum m H_t, subtracted from the loss (full-vocabulary entropy). Arrays [B, S]."""
    return coef * constant_sum(entropy, mask, normalizer)


# ------------------------------------------------------------------------------------------------
# Self-distillation toward the hinted teacher


def distill_divergence(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array,
                       kind: Divergence = "reverse_kl", beta: float = 0.5) -> jax.Array:
    """Per-token divergence D(s, t) between the student s = softmax(student_logits) and the teacher
    t = softmax(sg(teacher_logits)); logits f32[..., V], targets int[...] (the sampled tokens y).

        reverse_kl     sum_v s_v (log s_v - log t_v)              (default; mode-seeking)
        forward_kl     sum_v t_v (log t_v - log s_v)              (= CE to the soft teacher + const)
        jsd            beta KL(t || M) + (1 - beta) KL(s || M),   M = beta t + (1 - beta) s   (GKD/TRL)
        sampled_token  sg(log s(y) - log t(y)) log s(y)           (REINFORCE estimate of the reverse-KL
                                                                  gradient when y ~ s; value != KL)
    Returns f32[...].
    """
    log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    log_t = jax.nn.log_softmax(sg(teacher_logits).astype(jnp.float32), axis=-1)
    if kind == "reverse_kl":
        return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)
    if kind == "forward_kl":
        return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1 (use forward_kl / reverse_kl at the ends), got {beta}")
        log_m = jnp.logaddexp(log_t + jnp.log(beta), log_s + jnp.log1p(-beta))
        kl_t = jnp.sum(jnp.exp(log_t) * (log_t - log_m), axis=-1)
        kl_s = jnp.sum(jnp.exp(log_s) * (log_s - log_m), axis=-1)
        return beta * kl_t + (1.0 - beta) * kl_s
    if kind == "sampled_token":
        ls = jnp.take_along_axis(log_s, targets[..., None], axis=-1)[..., 0]
        lt = jnp.take_along_axis(log_t, targets[..., None], axis=-1)[..., 0]
        return sg(ls - lt) * ls
    raise ValueError(f"unknown divergence {kind!r}; expected reverse_kl, forward_kl, jsd or sampled_token")


def self_distillation_loss(divergence: jax.Array, mask: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """L_sd = sum_{i, t in T_i} D_it / sum_i |T_i|: the mean divergence over the flagged turns' tokens.

    divergence, mask: [...] (mask: the distilled tokens). `count`: the distilled tokens of the whole
    step when `mask` covers one micro-batch of it (default: mask.sum()). Zero when no turn is flagged.
    """
    count = jnp.sum(mask) if count is None else count
    return jnp.sum(divergence * mask) / jnp.maximum(count, 1.0)
