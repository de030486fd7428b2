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

The state is pretraining's `composer_jax.train.step.TrainState` (RL resumes from its checkpoints), and
the update after the gradient is pretraining's too: global-norm clipping over both meshes, a finite
guard, the optimizer per mesh group of the dual grid. `RLStep(...)(state, batch)` validates the batch
on the host (BatchError names the field) before the jitted step is traced or run; nothing inside the
step syncs with the host.

Known gap: under a DualMesh the prefix teacher needs `CausalLM.forward(prefix=...)` to lay its prefix
mask out like its own attention mask (tests/test_rl_sharded.py is an expected failure until then);
`teacher_context="full"` runs sharded today.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.model import CausalLM
from composer_jax.model.attention import LatentCache
from composer_jax.parallel import DualMesh, current, param_shardings
from composer_jax.parallel.partitioning import activation_spec
from composer_jax.rl import losses
from composer_jax.rl.batch import RolloutBatch, validate_batch
from composer_jax.rl.config import RLConfig
from composer_jax.train.grids import Grids
from composer_jax.train.optimizer import Optimizer, clip_scale, make_optimizer
from composer_jax.train.step import TrainState, apply_optimizer, init_opt_state, split_model

sg = jax.lax.stop_gradient


# ------------------------------------------------------------------------------------------------
# Gathers along the sequence (per row)


def _whole_sequence(x: jax.Array) -> jax.Array:
    """x: [rows, seq, ...] with the sequence unsharded (a no-op unless context parallelism shards it)."""
    spec = jax.typeof(x).sharding.spec
    if len(spec) < 2 or spec[1] is None:
        return x
    return jax.sharding.reshard(x, P(spec[0], None, *spec[2:]))


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """out[n, j] = x[n, idx[n, j]]: x [rows, seq, ...], idx int[rows, m] (clipped into range). Each
    device gathers within its own rows (the indices follow x's row sharding)."""
    x = _whole_sequence(x)
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    sharding = jax.typeof(x).sharding
    if not sharding.mesh.empty:
        idx = jax.sharding.reshard(idx, P(sharding.spec[0] if sharding.spec else None, None))
    return jax.vmap(lambda row, i: row[i])(x, idx)


def repeat_rows(x: jax.Array, k: int, axis: int) -> jax.Array:
    """Each row of `axis` repeated k times in place ([.., B, ..] -> [.., B*k, ..]): a flagged turn's
    prefix stays on the device that holds its row."""
    x = jnp.expand_dims(x, axis + 1)
    x = jnp.broadcast_to(x, x.shape[: axis + 1] + (k,) + x.shape[axis + 2:])
    return x.reshape(x.shape[:axis] + (x.shape[axis] * k,) + x.shape[axis + 2:])


def chunked(fn, chunk: int, *xs: jax.Array):
    """fn over [rows, seq, ...] arrays `chunk` positions at a time, each chunk rematerialised in the
    backward pass: only one [rows, chunk, vocab] block of logits exists at once. fn returns a tuple of
    [rows, chunk] arrays; returns them as [rows, seq]."""
    rows, seq = xs[0].shape[:2]
    chunk = min(chunk, seq)
    n = -(-seq // chunk)

    def split(x):  # [rows, seq, ...] -> [n, rows, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, n * chunk - seq)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(rows, n, chunk, *x.shape[2:]), 1, 0)

    outs = jax.lax.map(lambda args: jax.checkpoint(fn)(*args), tuple(split(x) for x in xs))
    return tuple(jnp.moveaxis(o, 0, 1).reshape(rows, n * chunk)[:, :seq] for o in outs)


# ------------------------------------------------------------------------------------------------
# The teacher


class Feedback(NamedTuple):
    """The feedback windows flattened to rows n = b * K + k (all [N, T] unless noted)."""

    tokens: jax.Array      # int32: hint + turn tokens + padding
    map: jax.Array         # int32: student position of each turn slot, -1 elsewhere
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
    last_prefix_pos = take_rows(repeat_rows(batch.positions, k, 0), (start - 1)[:, None])
    return Feedback(tokens, tmap, start, length, last_prefix_pos + 1 + slot[None])


def _on_batch_axes(x: jax.Array, axis: int) -> jax.Array:
    """x with dimension `axis` on the dense mesh's batch axes (as the model's activations), the rest
    whole; a no-op without an active DualMesh. The model concatenates the prefix with its activations."""
    if current() is None:
        return x
    names = [None] * x.ndim
    names[axis] = "batch"
    return jax.sharding.reshard(x, activation_spec(*names))


def _teacher_prefix(teacher: CausalLM, fb: Feedback, student_latents: LatentCache, k: int) -> jax.Array:
    """Teacher hidden [N, T, embed] over the windows, attending to the student's latents of [0, start)."""
    c_kv, k_rope = (_on_batch_axes(sg(repeat_rows(x, k, 1)), 1) for x in (student_latents.c_kv, student_latents.k_rope))
    seq = c_kv.shape[2]
    valid = _on_batch_axes(repeat_rows(student_latents.valid, k, 0) & (jnp.arange(seq)[None] < fb.start[:, None]), 0)
    segments = (jnp.arange(fb.tokens.shape[1])[None] < fb.length[:, None]).astype(jnp.int32)
    out = teacher.forward(fb.tokens, segments, fb.positions, with_mtp=False,
                          prefix=LatentCache(c_kv, k_rope, valid))
    return out.hidden


def _teacher_full(teacher: CausalLM, fb: Feedback, batch: RolloutBatch, k: int) -> jax.Array:
    """The naive teacher: a forward over [row before the turn + hint + turn] per window; returns its
    hidden states at the window slots [N, T, embed]."""
    (n, window), seq = fb.tokens.shape, batch.tokens.shape[1]
    col = jnp.broadcast_to(jnp.arange(seq + window, dtype=jnp.int32)[None], (n, seq + window))
    in_prefix, rel = col < fb.start[:, None], col - fb.start[:, None]
    tokens = jnp.where(in_prefix, take_rows(repeat_rows(batch.tokens, k, 0), col), take_rows(fb.tokens, rel))
    tokens = jnp.where(rel < window, tokens, 0)
    positions = jnp.where(in_prefix, take_rows(repeat_rows(batch.positions, k, 0), col), take_rows(fb.positions, rel))
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
    hidden = _whole_sequence(hidden)
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
    hidden = _whole_sequence(out.hidden)       # per-row shifts and gathers below need whole rows

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


def make_step(graphdef, rest, cfg: RLConfig, opt: Optimizer, grids: Grids):
    """The un-jitted step (TrainState, RolloutBatch) -> (TrainState, metrics of f32 scalars).

    After the gradient: the global norm over both meshes, clipping, a finite guard (a non-finite loss
    or gradient leaves params and optimizer state as they were and counts the step in `skipped`) and
    the optimizer update per mesh group (composer_jax.train). The router biases are left as they are:
    the RL update keeps the routing the sampler saw.
    """

    def step(state: TrainState, batch: RolloutBatch):
        (loss, metrics), grads = loss_and_grads(graphdef, rest, state, batch, cfg)
        grad_norm = jnp.sqrt(grids.sum_of_squares(grads))
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        grads = grids.scale(grads, clip_scale(grad_norm, cfg.optimizer.max_grad_norm))
        params, opt_state = apply_optimizer(opt, grids, grads, state.opt_state, state.params, finite)
        skipped = state.skipped + (~finite).astype(jnp.int32)
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=opt.schedule(state.step), finite=finite,
                       skipped=skipped)
        return TrainState(state.step + 1, params, state.biases, opt_state, skipped), metrics

    return step


class RLStep:
    """The jitted, donated RL step for one model structure, with host-side batch validation in front.

        rl_step = RLStep(model, rl_cfg, dual)       # dual: the DualMesh the model is sharded on, or None
        state = rl_step.init_state(model)           # shares the model's arrays (donated by the first step)
        state, metrics = rl_step(state, batch)
    """

    def __init__(self, model: CausalLM, cfg: RLConfig, dual: DualMesh | None = None):
        self.model_cfg, self.cfg, self.dual = model.cfg, cfg, dual
        self.graphdef, params, _, self.rest = split_model(model)
        self.grids = Grids(params if dual is None else param_shardings(params, dual), dual)
        self.opt = make_optimizer(cfg.optimizer, cfg.steps)
        self.jitted = jax.jit(make_step(self.graphdef, self.rest, cfg, self.opt, self.grids), donate_argnums=0)

    def init_state(self, model: CausalLM) -> TrainState:
        """Step 0 with a fresh optimizer state, each leaf on its parameter's mesh."""
        _, params, biases, _ = split_model(model)
        zero = lambda: jnp.zeros((), jnp.int32)
        return TrainState(zero(), params, biases, init_opt_state(self.opt, params, self.grids), zero())

    def validate(self, batch: RolloutBatch) -> None:
        validate_batch(batch, group_size=self.cfg.group_size, vocab_size=self.model_cfg.vocab_size,
                       need_ref=self.cfg.kl_coef > 0)

    def __call__(self, state: TrainState, batch: RolloutBatch):
        self.validate(batch)
        return self.jitted(state, batch)
