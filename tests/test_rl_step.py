"""The fused RL step on the tiny model: prefix teacher == naive teacher, empty hint => no distillation,
fused gradient == sum of separately computed terms' gradients, on-policy weights, donation, Muon."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.config import ConfigError
from composer_jax.optim.param_labels import dimension_numbers, pure
from composer_jax.rl import RLConfig, RLStep, loss_and_grads, losses, synthetic_batch
from composer_jax.rl.config import rl_optimizer
from composer_jax.rl.objective import loss_terms, step_totals
from composer_jax.rl.teacher import feedback_rows, teacher_predictions
from composer_jax.train.state import split_model
from composer_jax.tree_paths import path_keys

G = 2


@pytest.fixture(scope="module")
def model():
    return CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))


def _batch(seed=0, hint_len=3, **kw):
    return synthetic_batch(seed, batch=4, seq=32, vocab_size=256, group_size=G, slots=2, window=12,
                           hint_len=hint_len, **kw)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_prefix_teacher_equals_full_context_teacher(model):
    """The teacher over [hint + turn] attending to the student's latents gives the same next-token
    distributions on the turn as the naive teacher over the whole hinted context."""
    batch = _batch()

    @nnx.jit
    def both(model, batch):
        out = model.forward(batch.tokens, batch.segment_ids, batch.positions, with_mtp=False, return_latents=True)
        fb = feedback_rows(batch)
        return tuple(model.logits(teacher_predictions(model, out.hidden, out.latents, fb, batch, context))
                     for context in ("prefix", "full")) + (fb.map >= 0,)

    prefix, full, turn = both(model, batch)
    turn = np.asarray(turn)
    assert turn.sum() >= 8
    assert _rel(np.asarray(prefix)[turn], np.asarray(full)[turn]) <= 1e-5


def test_self_distillation_vanishes_with_an_empty_hint(model):
    """With an empty hint the teacher sees the student's own context: the distillation loss and its
    gradient vanish (to float32 rounding: the prefix path sums attention in another order)."""
    cfg = RLConfig(group_size=G)
    graphdef, params, biases, rest = split_model(model)

    @jax.jit
    def sd(params, batch):
        def f(p):
            totals = step_totals(batch, cfg, depths=0)
            terms, _, _ = loss_terms(nnx.merge(graphdef, p, biases, rest),
                                     nnx.merge(graphdef, jax.lax.stop_gradient(p), biases, rest), batch,
                                     totals.advantages, totals, cfg)
            return terms["sd"]
        value, grads = jax.value_and_grad(f)(params)
        return value, jnp.max(jnp.stack([jnp.abs(g).max() for g in jax.tree.leaves(grads)]))

    empty_value, empty_grad = map(float, sd(params, _batch(hint_len=0)))
    value, grad = map(float, sd(params, _batch(hint_len=3)))
    assert value > 1e-3 and grad > 1e-3
    assert abs(empty_value) <= 1e-5 * value and empty_grad <= 1e-5 * grad


def _reference_terms(graphdef, biases, rest, batch, cfg, teacher_params=None):
    """Each term computed on its own, the plain way: full logits and, for the teacher (the student's own
    parameters under stop-gradient, or `teacher_params`), one numpy-built sequence [row before the turn +
    hint + turn] per used feedback slot."""
    tokens = np.asarray(batch.tokens)
    b, s = tokens.shape
    mask = jnp.asarray(batch.generated, jnp.float32)
    n = b * cfg.max_tokens if cfg.max_tokens else mask.sum()
    adv = losses.group_advantages(jnp.asarray(batch.rewards), jnp.asarray(batch.group_ids))
    contexts = []
    for row, slot in zip(*np.nonzero((batch.teacher_map >= 0).any(-1))):
        tmap, window = batch.teacher_map[row, slot], batch.teacher_tokens[row, slot]
        turn = np.flatnonzero(tmap >= 0)
        start, length = int(tmap[turn[0]]), int(turn[-1]) + 1
        contexts.append((row, start, np.concatenate([tokens[row, :start], window[:length]]), turn, tmap[turn]))
    width = max(len(c[2]) for c in contexts)

    def student(params):
        model = nnx.merge(graphdef, params, biases, rest)
        logits = model(jnp.asarray(tokens), jnp.asarray(batch.segment_ids), jnp.asarray(batch.positions))
        logp = jnp.pad(losses.token_logprobs(logits[:, :-1], jnp.asarray(tokens[:, 1:])), ((0, 0), (1, 0)))
        return logits, logp, jnp.pad(losses.token_entropy(logits[:, :-1]), ((0, 0), (1, 0)))

    def weights(logp):
        return losses.importance_weights(logp, jnp.asarray(batch.behaviour_logprobs), cfg.is_cap)[0]

    def pg(params):
        _, logp, _ = student(params)
        return losses.policy_gradient_loss(logp, adv, weights(logp), mask, n)

    def kl(params):
        _, logp, _ = student(params)
        return losses.k2_kl_loss(logp, jnp.asarray(batch.ref_logprobs), weights(logp), mask, cfg.kl_coef, n)

    def entropy(params):
        _, _, ent = student(params)
        return -losses.entropy_bonus(ent, mask, cfg.entropy_coef, n)

    padded = np.zeros((len(contexts), width), np.int32)
    for i, c in enumerate(contexts):
        padded[i, :len(c[2])] = c[2]

    def sd(params):
        logits, _, _ = student(params)
        teacher = nnx.merge(graphdef, jax.lax.stop_gradient(params) if teacher_params is None else teacher_params,
                            biases, rest)
        t_logits = teacher(jnp.asarray(padded))
        total = 0.0
        for i, (row, start, _, turn, pos) in enumerate(contexts):   # window slot j sits at column start + j
            total += jnp.sum(losses.distill_divergence(logits[row, pos - 1], t_logits[i, start + turn - 1],
                                                       jnp.asarray(tokens[row, pos]), cfg.sd_divergence))
        return cfg.sd_coef * total / sum(len(c[3]) for c in contexts)

    def mtp(params):
        # Gradients stop at the parameters here (everything but the MTP depths is a constant), not at
        # the activations as in the step; full logits; KL(main at i+k || depth k at i) on generated targets.
        depths_only = jax.tree_util.tree_map_with_path(
            lambda path, x: x if path_keys(path)[0] == "mtp" else jax.lax.stop_gradient(x), params)
        model = nnx.merge(graphdef, depths_only, biases, rest)
        out = model.forward(jnp.asarray(tokens), jnp.asarray(batch.segment_ids), jnp.asarray(batch.positions))
        main = jax.nn.log_softmax(model.logits(out.hidden))
        depths = out.mtp_hidden.shape[0]
        total = 0.0
        for k in range(1, depths + 1):
            draft = jax.nn.log_softmax(model.logits(out.mtp_hidden[k - 1]))[:, :s - k - 1]
            teacher = main[:, k:s - 1]
            kl = jnp.sum(jnp.exp(teacher) * (teacher - draft), -1)
            targets = mask[:, k + 1:]                      # depth k at i predicts token i + k + 1
            total += jnp.sum(targets * kl) / targets.sum()
        return cfg.mtp_distill_weight / depths * total

    return {"pg": pg, "kl": kl, "entropy": entropy, "sd": sd, "mtp": mtp}


@pytest.mark.slow
def test_fused_gradient_equals_sum_of_separate_terms(model):
    batch = _batch(seed=1, with_ref=True)
    # Behaviour log-probs below the policy's (about -log 256) on some tokens: stale samples hit the cap.
    stale = np.random.default_rng(2).random(batch.tokens.shape) < 0.3
    batch = batch._replace(behaviour_logprobs=np.where(batch.generated, np.where(stale, -7.0, -5.0), 0.0)
                           .astype(np.float32))
    # loss_chunk=8: the step's logits come in chunks of 8 positions (31 = 3 x 8 + 7), the reference's whole.
    cfg = RLConfig(group_size=G, kl_coef=0.2, kl_estimator="k2_loss", entropy_coef=0.05, sd_coef=0.5,
                   is_cap=1.5, loss_chunk=8, max_tokens=24, mtp_distill_weight=0.3)
    rl_step = RLStep(model, cfg)
    state = rl_step.init_state(model)
    (loss, metrics), fused = jax.jit(lambda st, b: loss_and_grads(rl_step.graphdef, rl_step.rest, st, b, cfg))(
        state, batch)
    terms = _reference_terms(rl_step.graphdef, state.biases, rl_step.rest, batch, cfg)
    separate = jax.jit(lambda p: {k: jax.value_and_grad(f)(p) for k, f in terms.items()})(state.params)
    for name, (value, _) in separate.items():
        assert abs(float(metrics[f"loss_{name}"]) - float(value)) <= 1e-5 * abs(float(value)), name
    assert abs(float(loss) - sum(float(v) for v, _ in separate.values())) <= 1e-5 * abs(float(loss))
    summed = jax.tree.map(lambda *g: sum(g), *(g for _, g in separate.values()))
    worst = max(_rel(a, b) for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(summed)))
    assert worst <= 1e-5, worst
    # Every term contributes, and some tokens hit the importance-weight cap.
    assert min(float(jnp.abs(v)) for v, _ in separate.values()) > 1e-4
    assert 0 < float(metrics["is_clip_frac"]) < 1


@pytest.mark.slow
@pytest.mark.parametrize("hint_len", [3, 0])
def test_fixed_teacher_is_the_initial_policy(model, hint_len):
    """sd_teacher=initial: once the policy has moved, the self-distillation term and the step's gradient
    are those of a teacher with the parameters the step began with and a student with the current ones
    (computed the plain way), not the live teacher's; with an empty hint too (the first turn token's
    prediction is then the teacher's own at the last prefix token). It needs the full teacher context."""
    batch = _batch(seed=3, hint_len=hint_len)
    cfg = RLConfig(group_size=G, sd_coef=1.0, teacher_context="full", sd_teacher="initial", mtp_distill_weight=0.0,
                   loss_chunk=8, max_tokens=24)
    rl_step = RLStep(model, cfg)
    state = rl_step.init_state(model)
    noise = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(state.params))))
    moved = jax.tree.map(lambda x: x + 0.3 * jnp.std(x) * jax.random.normal(next(noise), x.shape, x.dtype), state.params)
    state = state._replace(params=moved)
    run = jax.jit(lambda st, b, t: loss_and_grads(rl_step.graphdef, rl_step.rest, st, b, cfg, t))
    (loss, metrics), fused = run(state, batch, rl_step.teacher_params)
    terms = _reference_terms(rl_step.graphdef, state.biases, rl_step.rest, batch, cfg, rl_step.teacher_params)
    separate = jax.jit(lambda p: {k: jax.value_and_grad(terms[k])(p) for k in ("pg", "sd")})(moved)
    for name, (value, _) in separate.items():
        # sd is a small difference of O(1) log-probs (~7e-3 with an empty hint): float32 rounding of those
        # terms, ~1e-7, is the floor below the relative bound (seen: 1.1e-7 apart, 1.6e-5 relative).
        assert abs(float(metrics[f"loss_{name}"]) - float(value)) <= 1e-5 * abs(float(value)) + 3e-7, name
    assert abs(float(loss) - sum(float(v) for v, _ in separate.values())) <= 1e-5 * abs(float(loss)) + 3e-7
    summed = jax.tree.map(lambda a, b: a + b, separate["pg"][1], separate["sd"][1])
    worst = max(_rel(a, b) for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(summed)))
    assert worst <= 1e-5, worst
    (_, live), _ = run(state, batch, None)
    assert abs(float(live["loss_sd"]) - float(metrics["loss_sd"])) > 1e-3 * abs(float(metrics["loss_sd"]))
    with pytest.raises(ConfigError, match="sd_teacher"):
        RLConfig(group_size=G, sd_teacher="initial")


def _on_policy(model, batch):
    """The batch with behaviour log-probs from the model itself."""
    @nnx.jit
    def logprobs(model, tokens):
        logits = model(tokens, jnp.asarray(batch.segment_ids), jnp.asarray(batch.positions))
        return jnp.pad(losses.token_logprobs(logits[:, :-1], tokens[:, 1:]), ((0, 0), (1, 0)))

    logp = np.asarray(logprobs(model, jnp.asarray(batch.tokens)))
    return batch._replace(behaviour_logprobs=np.where(batch.generated, logp, 0.0).astype(np.float32))


def _run_step(model, cfg, batch):
    rl_step = RLStep(model, cfg)
    state = jax.tree.map(jnp.copy, rl_step.init_state(model))   # the step donates its state: keep the fixture's
    before = jax.tree.map(lambda x: np.array(x, copy=True), state.params)   # no numpy view may pin a donated buffer
    new_state, metrics = rl_step(state, batch)
    return state, before, new_state, jax.tree.map(float, metrics)


def test_step_on_policy_adam(model):
    """One jitted, donated step with Adam: importance weights are exactly 1 on-policy, every metric is
    finite, the state advances and the old buffers are donated."""
    cfg = RLConfig(group_size=G, kl_coef=0.1, entropy_coef=0.01, optimizer=replace(rl_optimizer(), lr=1e-3))
    state, before, new_state, metrics = _run_step(model, cfg, _on_policy(model, _batch(with_ref=True)))
    assert abs(metrics["is_weight_mean"] - 1) <= 1e-5 and abs(metrics["is_weight_max"] - 1) <= 1e-5
    assert metrics["is_clip_frac"] == 0 and metrics["behaviour_kl_k3"] <= 1e-6
    expected = {"loss", "loss_pg", "loss_sd", "kl_k1", "kl_k3", "entropy", "grad_norm", "tokens", "sd_tokens"}
    assert expected <= set(metrics)
    assert metrics["moe_dropped_fraction"] == 0   # the local ragged dispatch never drops
    assert all(np.isfinite(v) for v in metrics.values())
    assert int(new_state.step) == 1
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(before),
                                                             strict=True)]
    assert max(moved) == pytest.approx(1e-3, rel=1e-2)     # Adam's first step moves by ~lr
    assert jax.tree.leaves(state.params)[0].is_deleted()     # donated


@pytest.mark.slow
def test_step_with_muon_matches_optax(model):
    """One Muon RL step moves every parameter by optax's update: the step's own gradient, clipped by
    optax.clip_by_global_norm (the bound is half the gradient's norm, so clipping acts), then
    optax.contrib.muon with the same settings and the dimension numbers of the params' metadata."""
    batch = _batch()
    probe = RLStep(model, RLConfig(group_size=G))
    state = probe.init_state(model)
    (_, _), grads = jax.jit(lambda st, b: loss_and_grads(probe.graphdef, probe.rest, st, b, probe.cfg))(state, batch)
    grads = jax.tree.map(np.asarray, pure(grads))
    norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads))))
    # eps 1e-4: the reference's gradient comes from a separately compiled program, and Adam's first step
    # lr * g / (|g| + eps) amplifies the rounding differences of a g near 0 by up to lr / eps: 1e5 at eps
    # 1e-8, where an embedding entry of 8e-7 (a sum cancelling to 1e-4 of the leaf's largest) misses by 5e-4.
    opt = replace(rl_optimizer(), name="muon", lr=1e-3, weight_decay=0.1, max_grad_norm=norm / 2, eps=1e-4)
    _, before, new_state, metrics = _run_step(model, RLConfig(group_size=G, optimizer=opt), batch)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)

    params = pure(nnx.state(model, nnx.Param))
    ref = optax.chain(optax.clip_by_global_norm(opt.max_grad_norm),
                      optax.contrib.muon(opt.lr, weight_decay=opt.weight_decay, eps=opt.eps, adam_b1=opt.b1,
                                         adam_b2=opt.b2, muon_weight_dimension_numbers=pure(dimension_numbers(
                                             nnx.state(model, nnx.Param)))))
    updates_ref, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    moved = jax.tree_util.tree_flatten_with_path(pure(new_state.params))[0]
    assert len(moved) == len(jax.tree.leaves(updates_ref)) == len(jax.tree.leaves(before))
    for (path, new), old, want in zip(moved, jax.tree.leaves(before), jax.tree.leaves(updates_ref), strict=True):
        # New params = old + optax's update, to 1e-4 of the update plus float32 rounding of the sum (a
        # leaf with a tiny gradient moves by little more than weight decay: ~1e-6).
        want = np.asarray(want)
        error = np.abs(np.asarray(new) - (old + want)).max()
        assert error <= 1e-4 * np.abs(want).max() + 2 * np.spacing(np.abs(old).max()), jax.tree_util.keystr(path)
