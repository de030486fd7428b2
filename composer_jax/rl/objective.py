"""The fused RL objective: group policy gradient + KL + entropy + targeted-feedback self-distillation
+ the MTP depths' self-distillation, from one student forward and one teacher forward per micro-batch
(composer_jax/rl/losses.py has each term):

    student  = model.forward(trajectory)                          -> log pi(y_t), H_t at every token
    teacher  = sg(model).forward([hint + flagged turn], prefix=sg(student latents before the turn))
    L        = L_pg + L_kl - L_H + lambda_sd * L_sd + beta_mtp * L_mtp

L_mtp keeps the MTP depths drafting the changing policy's tokens: the pretraining loss's distillation
term (train/losses.py: (beta / D) sum_k mean KL(sg(main head at i+k) || depth k at i)) with the tokens
the policy generated as targets. The depths see the trunk and the embeddings under stop-gradient and the
head is stop-gradient, so L_mtp trains the MTP depths only: the policy moves by the RL terms alone.

Normalisers (never the padded length of the batch): L_pg, L_kl and L_H divide their token sums by
N = B * max_tokens (Dr. GRPO's constant) or, with max_tokens = 0, by the step's generated-token count
(a token mean); L_sd by the step's distilled tokens; L_mtp by each depth's target count.

Micro-batching: `loss_and_grads` cuts the B rows into micro-batches of `cfg.micro_batch` rows and scans
over them, accumulating gradients in one jitted step (train/accumulate.py). Whatever spans rows (group
advantages, the normalisers) is fixed first on the whole batch (`StepTotals`), so the micro-batch terms
add up to the whole batch's objective.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model import CausalLM
from composer_jax.model.transformer import head_logits
from composer_jax.parallel.partitioning import gather_sequence, gather_whole
from composer_jax.rl import losses
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.config import RLConfig
from composer_jax.rl.rows import chunked, repeat_rows, take_rows
from composer_jax.rl.teacher import feedback_rows, teacher_predictions
from composer_jax.train import losses as lm_losses
from composer_jax.train.accumulate import accumulate
from composer_jax.train.state import TrainState

sg = jax.lax.stop_gradient


class StepTotals(NamedTuple):
    """Whole-step quantities fixed before the micro-batch scan."""

    advantages: jax.Array     # f32[B]: group-relative advantages (Dr. GRPO)
    tokens: jax.Array         # f32[]: generated tokens of the step
    normalizer: jax.Array     # f32[]: N of L_pg, L_kl, L_H
    sd_tokens: jax.Array      # f32[]: tokens of the flagged turns (self-distillation targets)
    mtp_targets: jax.Array    # f32[D]: generated tokens each MTP depth predicts (0 depths: MTP term off)


def _uses_feedback(batch: RolloutBatch, cfg: RLConfig) -> bool:
    return batch.teacher_tokens is not None and cfg.sd_coef > 0


def mtp_depths(model: CausalLM, cfg: RLConfig) -> int:
    """The MTP depths the objective distils (0 when the model has none or the term is off)."""
    return model.cfg.mtp.num_layers if model.mtp is not None and cfg.mtp_distill_weight > 0 else 0


def step_totals(batch: RolloutBatch, cfg: RLConfig, depths: int) -> StepTotals:
    """StepTotals of a whole batch ([B, ...] arrays)."""
    generated = batch.generated.astype(jnp.float32)
    tokens = generated.sum()
    rows = batch.tokens.shape[0]
    normalizer = jnp.float32(rows * cfg.max_tokens) if cfg.max_tokens else jnp.maximum(tokens, 1.0)
    sd_tokens = ((batch.teacher_map >= 0).sum().astype(jnp.float32) if _uses_feedback(batch, cfg)
                 else jnp.zeros((), jnp.float32))
    mtp_targets = (lm_losses.count_targets(batch.tokens, batch.segment_ids, batch.generated, depths)[1] if depths
                   else jnp.zeros((0,), jnp.float32))
    return StepTotals(losses.group_advantages(batch.rewards, batch.group_ids), tokens, normalizer, sd_tokens,
                      mtp_targets)


def _token_stats(model: CausalLM, hidden: jax.Array, tokens: jax.Array, chunk: int):
    """The student's log-probability of every token and its full-vocabulary entropy there, from the
    previous position's logits (hidden [b, S, embed], tokens int[b, S]): f32[b, S] each, 0 at slot 0,
    which has no context."""
    def stats(head, h, targets):
        logits = head_logits(head, h)                                                    # [b, chunk, V]
        return losses.token_logprobs(logits, targets), losses.token_entropy(logits)

    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
    return tuple(map(pad, chunked(stats, chunk, hidden[:, :-1], tokens[:, 1:], heads=(model.head(hidden.dtype),))))


def loss_terms(model: CausalLM, teacher: CausalLM, batch: RolloutBatch, advantages: jax.Array, totals: StepTotals,
               cfg: RLConfig):
    """One micro-batch's share of the objective, from one student forward and one teacher forward.

    `batch`: the micro-batch's rows [b, ...]; `advantages`: f32[b] (from the whole batch); `teacher`
    holds the same parameters under stop-gradient. Returns (terms: name -> f32[], whose sums over the
    micro-batches are the step's loss terms; sums: metric sums over generated tokens; maxes: metric
    maxima).
    """
    tokens = batch.tokens.astype(jnp.int32)
    feedback = _uses_feedback(batch, cfg)
    use_prefix = feedback and cfg.teacher_context == "prefix"
    depths = totals.mtp_targets.shape[0]
    out = model.forward(tokens, batch.segment_ids, batch.positions, with_mtp=depths > 0, return_latents=use_prefix,
                        detach_mtp_inputs=True, remat=cfg.remat)
    hidden = gather_sequence(out.hidden)       # per-row shifts and gathers below need whole rows

    logp, entropy = _token_stats(model, hidden, tokens, cfg.loss_chunk)
    mask = batch.generated.astype(jnp.float32)
    n = totals.normalizer

    weights, clipped = losses.importance_weights(logp, batch.behaviour_logprobs, cfg.is_cap)
    terms = {}
    if cfg.kl_coef and cfg.kl_estimator == "k1_reward":
        token_adv = losses.kl_reward_advantages(advantages, logp, batch.ref_logprobs, cfg.kl_coef)
    else:
        token_adv = advantages
    terms["pg"] = losses.policy_gradient_loss(logp, token_adv, weights, mask, n)
    if cfg.kl_coef and cfg.kl_estimator == "k2_loss":
        terms["kl"] = losses.k2_kl_loss(logp, batch.ref_logprobs, weights, mask, cfg.kl_coef, n)
    if cfg.entropy_coef:
        terms["entropy"] = -losses.entropy_bonus(entropy, mask, cfg.entropy_coef, n)

    token_sum = lambda x: jnp.sum(x * mask)  # noqa: E731
    # The learner's token log-probs against the engine's: the policy's lag behind, and with an INT4 engine
    # (rollout.weights=int4) over float experts the quantization's effect too.
    gap = sg(jnp.abs(logp - batch.behaviour_logprobs))
    sums = dict(entropy=token_sum(sg(entropy)), is_weight_mean=token_sum(weights),
                is_clip_frac=token_sum(clipped.astype(jnp.float32)),
                behaviour_kl_k3=token_sum(sg(losses.kl_estimate(batch.behaviour_logprobs, logp, "k3"))),
                behaviour_logp_gap=token_sum(gap))
    if batch.ref_logprobs is not None:
        sums["kl_k1"] = token_sum(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k1")))
        sums["kl_k3"] = token_sum(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k3")))
    maxes = dict(is_weight_max=jnp.max(jnp.where(mask > 0, weights, 0.0)),
                 behaviour_logp_gap_max=jnp.max(jnp.where(mask > 0, gap, 0.0)))
    # Expert assignments dropped by the dispatch's capacity (moe.capacity_factor) and all made.
    sums.update(moe_dropped=jnp.sum(out.dropped).astype(jnp.float32),
                moe_assigned=jnp.sum(out.expert_load).astype(jnp.float32))

    if feedback:
        terms["sd"] = _self_distillation(model, teacher, hidden, out.latents, batch, weights, totals, cfg)
    if depths:
        head = sg(model.head(hidden.dtype))
        _, kl, accept = lm_losses.mtp_loss_sums(hidden, out.mtp_hidden, head, tokens, batch.segment_ids,
                                                batch.generated, chunk=cfg.loss_chunk, with_ce=False, distill=True)
        terms["mtp"] = lm_losses.depth_mean(kl, totals.mtp_targets, cfg.mtp_distill_weight)
        sums["mtp_kl"], sums["mtp_accept"] = kl, accept
    return terms, sums, maxes


def _self_distillation(model: CausalLM, teacher: CausalLM, hidden: jax.Array, latents, batch: RolloutBatch,
                       weights: jax.Array, totals: StepTotals, cfg: RLConfig) -> jax.Array:
    """The targeted-feedback self-distillation term: on each flagged turn's tokens, the divergence of the
    student (hidden [b, S, embed]) from the hinted teacher; `weights`: f32[b, S] importance weights."""
    fb = feedback_rows(batch)
    k = batch.teacher_tokens.shape[1]
    teacher_h = teacher_predictions(teacher, hidden, latents, fb, batch, cfg.teacher_context)
    student_h = take_rows(repeat_rows(hidden, k, 0), fb.map - 1)                     # [N, T, embed]
    divergence, = chunked(lambda head_s, head_t, hs, ht, y: (losses.distill_divergence(
        head_logits(head_s, hs), head_logits(head_t, ht), y, cfg.sd_divergence, cfg.sd_jsd_beta),),
        cfg.loss_chunk, student_h, teacher_h, fb.tokens,
        heads=(model.head(hidden.dtype), teacher.head(teacher_h.dtype)))
    if cfg.sd_divergence == "sampled_token":  # a sampled-token estimate needs y ~ student: reweight
        divergence = divergence * take_rows(repeat_rows(weights, k, 0), fb.map)
    sd_mask = (fb.map >= 0).astype(jnp.float32)
    return cfg.sd_coef * losses.self_distillation_loss(divergence, sd_mask, totals.sd_tokens)


def _combine(acc, new):
    """Fold one micro-batch's (terms, sums, maxes) into the running ones."""
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
    return add(acc[0], new[0]), add(acc[1], new[1]), jax.tree.map(jnp.maximum, acc[2], new[2])


def _metrics(terms: dict, sums: dict, maxes: dict, totals: StepTotals, batch: RolloutBatch) -> dict:
    per_token = jnp.maximum(totals.tokens, 1.0)
    per_step = ("mtp_kl", "mtp_accept", "moe_dropped", "moe_assigned")
    metrics = {name: value / per_token for name, value in sums.items() if name not in per_step}
    metrics["moe_dropped_fraction"] = sums["moe_dropped"] / jnp.maximum(sums["moe_assigned"], 1.0)
    metrics.update(maxes)
    for k in range(totals.mtp_targets.shape[0]):
        metrics[f"mtp{k + 1}_kl"] = sums["mtp_kl"][k] / jnp.maximum(totals.mtp_targets[k], 1.0)
        # The expected acceptance of depth k's draft by speculative sampling of the rollouts (temperature 1).
        metrics[f"mtp{k + 1}_acceptance"] = sums["mtp_accept"][k] / jnp.maximum(totals.mtp_targets[k], 1.0)
    metrics.update(tokens=totals.tokens, reward_mean=jnp.mean(batch.rewards),
                   advantage_abs_mean=jnp.mean(jnp.abs(totals.advantages)))
    if "sd" in terms:
        metrics["sd_tokens"] = totals.sd_tokens
    metrics.update({f"loss_{name}": value for name, value in terms.items()})
    return metrics


def loss_and_grads(graphdef, rest, state: TrainState, batch: RolloutBatch, cfg: RLConfig, teacher_params=None):
    """((loss, metrics), grads) of the fused objective over the whole batch ([B, ...] arrays, rows
    sharded over the data axes or not at all), accumulated over micro-batches of `cfg.micro_batch`
    rows; grads shaped like `state.params`. `teacher_params`: the self-distillation teacher's (fixed)
    parameters; None: the policy's own under stop-gradient."""
    batch = jax.tree.map(gather_whole, batch)   # the model places each micro-batch on the dense grid itself
    rows = batch.tokens.shape[0]
    count = cfg.micro_batches(rows)
    totals = step_totals(batch, cfg, mtp_depths(nnx.merge(graphdef, state.params, state.biases, rest), cfg))
    split = lambda x: x.reshape(count, rows // count, *x.shape[1:])  # noqa: E731
    micro = (jax.tree.map(split, batch), split(totals.advantages))

    def grad_fn(mb):
        mb_batch, mb_advantages = mb

        def loss_fn(params):
            model = nnx.merge(graphdef, params, state.biases, rest)
            teacher = nnx.merge(graphdef, sg(params) if teacher_params is None else teacher_params, state.biases, rest)
            terms, sums, maxes = loss_terms(model, teacher, mb_batch, mb_advantages, totals, cfg)
            return sum(terms.values()), (terms, sums, maxes)

        return jax.value_and_grad(loss_fn, has_aux=True)(state.params)

    (loss, (terms, sums, maxes)), grads = accumulate(grad_fn, micro, combine_aux=_combine)
    return (loss, _metrics(terms, sums, maxes, totals, batch)), grads
