"""The fused RL objective: group policy gradient + KL + entropy + targeted-feedback self-distillation,
from one student forward and one teacher forward (composer_jax/rl/losses.py has each term):

    student  = model.forward(trajectory)                          -> log pi(y_t), H_t at every token
    teacher  = sg(model).forward([hint + flagged turn], prefix=sg(student latents before the turn))
    L        = L_pg + L_kl - L_H + lambda_sd * L_sd
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model import CausalLM
from composer_jax.parallel.partitioning import gather_sequence
from composer_jax.rl import losses
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.config import RLConfig
from composer_jax.rl.rows import chunked, repeat_rows, take_rows
from composer_jax.rl.teacher import feedback_rows, teacher_predictions
from composer_jax.train.state import TrainState

sg = jax.lax.stop_gradient


def loss_terms(model: CausalLM, teacher: CausalLM, batch: RolloutBatch, cfg: RLConfig):
    """The objective's terms (scalars, summed into the loss) and metrics, from one student forward and
    one teacher forward. `teacher` holds the same parameters under stop-gradient."""
    tokens = batch.tokens.astype(jnp.int32)
    b, s = tokens.shape
    feedback = batch.teacher_tokens is not None and cfg.sd_coef > 0
    use_prefix = feedback and cfg.teacher_context == "prefix"
    out = model.forward(tokens, batch.segment_ids, batch.positions, with_mtp=False, return_latents=use_prefix)
    hidden = gather_sequence(out.hidden)       # per-row shifts and gathers below need whole rows

    # Student statistics of every token from the previous position's logits; slot 0 has none.
    def stats(h, targets):
        logits = model.logits(h)                                                         # [B, chunk, V]
        return losses.token_logprobs(logits, targets), losses.token_entropy(logits)

    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)
    logp, entropy = map(pad, chunked(stats, cfg.loss_chunk, hidden[:, :-1], tokens[:, 1:]))
    mask = batch.generated.astype(jnp.float32)
    normalizer = b * (cfg.max_tokens or s)

    weights, clipped = losses.importance_weights(logp, batch.behaviour_logprobs, cfg.is_cap)
    advantages = losses.group_advantages(batch.rewards, batch.group_ids)
    terms, metrics = {}, {}
    if cfg.kl_coef and cfg.kl_estimator == "k1_reward":
        token_adv = losses.kl_reward_advantages(advantages, logp, batch.ref_logprobs, cfg.kl_coef)
    else:
        token_adv = advantages
    terms["pg"] = losses.policy_gradient_loss(logp, token_adv, weights, mask, normalizer)
    if cfg.kl_coef and cfg.kl_estimator == "k2_loss":
        terms["kl"] = losses.k2_kl_loss(logp, batch.ref_logprobs, weights, mask, cfg.kl_coef, normalizer)
    if cfg.entropy_coef:
        terms["entropy"] = -losses.entropy_bonus(entropy, mask, cfg.entropy_coef, normalizer)

    n_tokens = jnp.maximum(mask.sum(), 1.0)
    mean = lambda x: jnp.sum(x * mask) / n_tokens
    if batch.ref_logprobs is not None:
        metrics["kl_k1"] = mean(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k1")))
        metrics["kl_k3"] = mean(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k3")))
    metrics.update(entropy=mean(sg(entropy)), is_weight_mean=mean(weights),
                   is_weight_max=jnp.max(jnp.where(mask > 0, weights, 0.0)),
                   is_clip_frac=mean(clipped.astype(jnp.float32)),
                   behaviour_kl_k3=mean(sg(losses.kl_estimate(batch.behaviour_logprobs, logp, "k3"))),
                   tokens=mask.sum(), reward_mean=jnp.mean(batch.rewards),
                   moe_dropped_fraction=jnp.sum(out.dropped) / jnp.maximum(jnp.sum(out.expert_load), 1.0),
                   advantage_abs_mean=jnp.mean(jnp.abs(advantages)))

    if feedback:
        fb = feedback_rows(batch)
        k = batch.teacher_tokens.shape[1]
        teacher_h = teacher_predictions(teacher, hidden, out.latents, fb, batch, cfg.teacher_context)
        student_h = take_rows(repeat_rows(hidden, k, 0), fb.map - 1)                     # [N, T, embed]
        divergence, = chunked(lambda hs, ht, y: (losses.distill_divergence(
            model.logits(hs), teacher.logits(ht), y, cfg.sd_divergence, cfg.sd_jsd_beta),),
            cfg.loss_chunk, student_h, teacher_h, fb.tokens)
        if cfg.sd_divergence == "sampled_token":  # a sampled-token estimate needs y ~ student: reweight
            divergence = divergence * take_rows(repeat_rows(weights, k, 0), fb.map)
        sd_mask = (fb.map >= 0).astype(jnp.float32)
        terms["sd"] = cfg.sd_coef * losses.self_distillation_loss(divergence, sd_mask)
        metrics["sd_tokens"] = sd_mask.sum()
    metrics.update({f"loss_{name}": value for name, value in terms.items()})
    return terms, metrics


def loss_and_grads(graphdef, rest, state: TrainState, batch: RolloutBatch, cfg: RLConfig):
    """((loss, metrics), grads) of the fused objective; grads shaped like `state.params`."""

    def loss_fn(params):
        model = nnx.merge(graphdef, params, state.biases, rest)
        teacher = nnx.merge(graphdef, sg(params), state.biases, rest)
        terms, metrics = loss_terms(model, teacher, batch, cfg)
        return sum(terms.values()), metrics

    return jax.value_and_grad(loss_fn, has_aux=True)(state.params)
