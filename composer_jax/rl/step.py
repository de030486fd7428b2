"""The fused RL step: group policy gradient + KL + entropy + targeted-feedback self-distillation, one
`value_and_grad`, one optimizer update, in one jitted function with the state donated.

    student  = model.forward(trajectory)                          -> log pi(y_t), H_t at every token
    teacher  = sg(model).forward([hint + flagged turn], prefix=sg(student latents before the turn))
    L        = L_pg + L_kl - L_H + lambda_sd * L_sd               (composer_jax/rl/losses.py)

The teacher is the same parameters under stop-gradient, so it costs one forward over the feedback
windows (hint + turn tokens, attending to the student's MLA latents of the row before the turn), not a
forward over whole trajectories. `teacher_context="full"` instead runs the naive teacher over the whole
hinted context [row before the turn + hint + turn]; it is the reference the prefix path is tested against.

The prediction of window slot j's token is the teacher's hidden state at slot j-1; for j = 0 (an empty
hint) it is the hidden state of the last prefix token, which does not see the hint and therefore equals
the student's (taken from the student, under stop-gradient).

`RLStep(...)(state, batch)` validates the batch on the host (BatchError names the field) before the
jitted step is traced or run; nothing inside the step syncs with the host. The router's correction
biases and any other non-Param variables ride along unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.model import CausalLM
from composer_jax.model.attention import LatentCache
from composer_jax.rl import losses
from composer_jax.rl.batch import RolloutBatch, validate_batch
from composer_jax.rl.config import RLConfig, make_optimizer

sg = jax.lax.stop_gradient


class RLState(NamedTuple):
    step: jax.Array            # int32[]
    params: nnx.State          # the nnx.Param values (plain arrays; `nnx.merge` restores the metadata)
    frozen: nnx.State          # every other variable (router correction biases): carried unchanged
    opt_state: optax.OptState  # plain arrays, as optax updates see them


def init_state(model: CausalLM, tx: optax.GradientTransformation):
    """(graphdef, RLState) of a model, sharded like its variables (run under the DualMesh if any).
    The optimizer is initialised from the Params themselves: Muon reads matrix views from their
    metadata. The state shares the model's arrays, and the step donates its state: after the first
    step the model's own arrays are gone (copy the state first to keep them)."""
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    opt_state = nnx.as_pure(tx.init(params))
    return graphdef, RLState(jnp.zeros((), jnp.int32), nnx.as_pure(params), frozen, opt_state)


# ------------------------------------------------------------------------------------------------
# Gathers along the sequence (per row)


def _whole_sequence(x: jax.Array) -> jax.Array:
    """x: [rows, seq, ...] with the sequence unsharded (a no-op unless context parallelism shards it)."""
    spec = jax.typeof(x).sharding.spec
    if len(spec) < 2 or spec[1] is None:
        return x
    return jax.sharding.reshard(x, P(spec[0], None, *spec[2:]))


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """out[n, j] = x[n, idx[n, j]]: x [rows, seq, ...], idx int[rows, m] (clipped into range)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jax.vmap(lambda row, i: row[i])(_whole_sequence(x), idx)


def repeat_rows(x: jax.Array, k: int, axis: int) -> jax.Array:
    """Each row of `axis` repeated k times in place ([.., B, ..] -> [.., B*k, ..]): a flagged turn's
    prefix stays on the device that holds its row."""
    x = jnp.expand_dims(x, axis + 1)
    x = jnp.broadcast_to(x, x.shape[: axis + 1] + (k,) + x.shape[axis + 2:])
    return x.reshape(x.shape[:axis] + (x.shape[axis] * k,) + x.shape[axis + 2:])


# ------------------------------------------------------------------------------------------------
# The teacher


class Feedback(NamedTuple):
    """The feedback windows flattened to rows n = b * K + k (all [N, T] unless noted)."""

    tokens: jax.Array      # int32: hint + turn tokens + padding
    map: jax.Array         # int32: student position of each turn slot, -1 elsewhere
    row: jax.Array         # int32[N]: the student row
    start: jax.Array       # int32[N]: where the hint is inserted (first turn position); 1 when unused
    length: jax.Array      # int32[N]: hint + turn tokens (0 when unused)
    positions: jax.Array   # int32: rope positions continuing after the prefix


def feedback_rows(batch: RolloutBatch) -> Feedback:
    b, k, t = batch.teacher_tokens.shape
    tokens = batch.teacher_tokens.reshape(b * k, t).astype(jnp.int32)
    tmap = batch.teacher_map.reshape(b * k, t).astype(jnp.int32)
    mapped = tmap >= 0
    slot = jnp.arange(t, dtype=jnp.int32)
    first = jnp.argmax(mapped, axis=-1)
    start = jnp.where(mapped.any(-1), jnp.take_along_axis(tmap, first[:, None], axis=-1)[:, 0], 1)
    length = jnp.max(jnp.where(mapped, slot + 1, 0), axis=-1)
    row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), k)
    last_prefix_pos = take_rows(repeat_rows(batch.positions, k, 0), (start - 1)[:, None])
    return Feedback(tokens, tmap, row, start, length, last_prefix_pos + 1 + slot[None])


def _teacher_prefix(teacher: CausalLM, fb: Feedback, student_latents: LatentCache, k: int) -> jax.Array:
    """Teacher hidden [N, T, embed] over the windows, attending to the student's latents of [0, start)."""
    c_kv, k_rope = (sg(repeat_rows(x, k, 1)) for x in (student_latents.c_kv, student_latents.k_rope))
    seq = c_kv.shape[2]
    valid = repeat_rows(student_latents.valid, k, 0) & (jnp.arange(seq)[None] < fb.start[:, None])
    segments = (jnp.arange(fb.tokens.shape[1])[None] < fb.length[:, None]).astype(jnp.int32)
    out = teacher.forward(fb.tokens, segments, fb.positions, with_mtp=False,
                          prefix=LatentCache(c_kv, k_rope, valid))
    return out.hidden


def _teacher_full(teacher: CausalLM, fb: Feedback, batch: RolloutBatch, k: int) -> jax.Array:
    """The naive teacher: a forward over [row before the turn + hint + turn] per window; returns its
    hidden states at the window slots [N, T, embed]."""
    seq, window = batch.tokens.shape[1], fb.tokens.shape[1]
    col = jnp.arange(seq + window, dtype=jnp.int32)[None]                     # [1, S + T]
    in_prefix, rel = col < fb.start[:, None], col - fb.start[:, None]
    tokens = jnp.where(in_prefix, take_rows(repeat_rows(batch.tokens, k, 0), col.repeat(len(fb.row), 0)),
                       take_rows(fb.tokens, rel))
    tokens = jnp.where(rel < window, tokens, 0)
    positions = jnp.where(in_prefix, take_rows(repeat_rows(batch.positions, k, 0), col.repeat(len(fb.row), 0)),
                          take_rows(fb.positions, rel))
    segments = (rel < fb.length[:, None]).astype(jnp.int32)
    hidden = teacher.forward(tokens.astype(jnp.int32), segments, positions, with_mtp=False).hidden
    return take_rows(hidden, fb.start[:, None] + jnp.arange(window)[None])


def teacher_predictions(teacher: CausalLM, student_hidden: jax.Array, student_latents, fb: Feedback,
                        batch: RolloutBatch, context: str) -> jax.Array:
    """The teacher hidden state predicting each window slot's token, [N, T, embed], no gradient."""
    k = batch.teacher_tokens.shape[1]
    if context == "prefix":
        hidden = _teacher_prefix(teacher, fb, student_latents, k)
    else:
        hidden = _teacher_full(teacher, fb, batch, k)
    last_prefix = take_rows(repeat_rows(student_hidden, k, 0), (fb.start - 1)[:, None])      # [N, 1, embed]
    return sg(jnp.concatenate([last_prefix.astype(hidden.dtype), hidden[:, :-1]], axis=1))


# ------------------------------------------------------------------------------------------------
# The loss


def loss_terms(model: CausalLM, teacher: CausalLM, batch: RolloutBatch, cfg: RLConfig):
    """The objective's terms (scalars, summed into the loss) and metrics, from one student forward and
    one teacher forward. `teacher` holds the same parameters under stop-gradient."""
    tokens = batch.tokens.astype(jnp.int32)
    b, s = tokens.shape
    feedback = batch.teacher_tokens is not None and cfg.sd_coef > 0
    use_prefix = feedback and cfg.teacher_context == "prefix"
    out = model.forward(tokens, batch.segment_ids, batch.positions, with_mtp=False, return_latents=use_prefix)
    hidden = out.hidden

    # Student statistics of every token from the previous position's logits; slot 0 has none.
    logits = model.logits(hidden[:, :-1])                                                 # [B, S-1, V]
    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
    logp = pad(losses.token_logprobs(logits, tokens[:, 1:]))
    entropy = pad(losses.token_entropy(logits))
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
    mean = lambda x: jnp.sum(x * mask) / n_tokens  # noqa: E731
    if batch.ref_logprobs is not None:
        metrics["kl_k1"] = mean(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k1")))
        metrics["kl_k3"] = mean(sg(losses.kl_estimate(logp, batch.ref_logprobs, "k3")))
    metrics.update(entropy=mean(sg(entropy)), is_weight_mean=mean(weights),
                   is_weight_max=jnp.max(jnp.where(mask > 0, weights, 0.0)),
                   is_clip_frac=mean(clipped.astype(jnp.float32)),
                   behaviour_kl_k3=mean(sg(losses.kl_estimate(batch.behaviour_logprobs, logp, "k3"))),
                   tokens=mask.sum(), reward_mean=jnp.mean(batch.rewards),
                   advantage_abs_mean=jnp.mean(jnp.abs(advantages)))

    if feedback:
        fb = feedback_rows(batch)
        k = batch.teacher_tokens.shape[1]
        teacher_h = teacher_predictions(teacher, hidden, out.latents, fb, batch, cfg.teacher_context)
        student_h = take_rows(repeat_rows(hidden, k, 0), fb.map - 1)                     # [N, T, embed]
        divergence = losses.distill_divergence(model.logits(student_h), teacher.logits(teacher_h), fb.tokens,
                                               cfg.sd_divergence, cfg.sd_jsd_beta)
        if cfg.sd_divergence == "sampled_token":  # a sampled-token estimate needs y ~ student: reweight
            divergence = divergence * take_rows(repeat_rows(weights, k, 0), fb.map)
        sd_mask = (fb.map >= 0).astype(jnp.float32)
        terms["sd"] = cfg.sd_coef * losses.self_distillation_loss(divergence, sd_mask)
        metrics["sd_tokens"] = sd_mask.sum()
    metrics.update({f"loss_{name}": value for name, value in terms.items()})
    return terms, metrics


def loss_and_grads(graphdef, state: RLState, batch: RolloutBatch, cfg: RLConfig):
    """((loss, metrics), grads) of the fused objective; grads shaped like `state.params`."""

    def loss_fn(params):
        model = nnx.merge(graphdef, params, state.frozen)
        teacher = nnx.merge(graphdef, sg(params), state.frozen)
        terms, metrics = loss_terms(model, teacher, batch, cfg)
        loss = sum(terms.values())
        return loss, metrics

    return jax.value_and_grad(loss_fn, has_aux=True)(state.params)


def make_step(graphdef, cfg: RLConfig, tx: optax.GradientTransformation):
    """The un-jitted step (state, batch) -> (state, metrics)."""

    def step(state: RLState, batch: RolloutBatch):
        (loss, metrics), grads = loss_and_grads(graphdef, state, batch, cfg)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return RLState(state.step + 1, params, state.frozen, opt_state), metrics

    return step


class RLStep:
    """The jitted, donated RL step with host-side batch validation in front of it.

        rl_step = RLStep(model_cfg, rl_cfg, graphdef)      # tx defaults to make_optimizer(rl_cfg)
        state, metrics = rl_step(state, batch)
    """

    def __init__(self, model_cfg, cfg: RLConfig, graphdef, tx: optax.GradientTransformation | None = None):
        self.model_cfg, self.cfg = model_cfg, cfg
        self.tx = make_optimizer(cfg) if tx is None else tx
        self.jitted = jax.jit(make_step(graphdef, cfg, self.tx), donate_argnums=0)

    def validate(self, batch: RolloutBatch) -> None:
        validate_batch(batch, group_size=self.cfg.group_size, vocab_size=self.model_cfg.vocab_size,
                       need_ref=self.cfg.kl_coef > 0)

    def __call__(self, state: RLState, batch: RolloutBatch):
        self.validate(batch)
        return self.jitted(state, batch)
