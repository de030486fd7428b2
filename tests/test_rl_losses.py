"""Oracles for the RL loss terms: closed forms and finite differences (no model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import ConfigError, from_dict
from composer_jax.rl import RLConfig, losses

RNG = np.random.default_rng(0)


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------
# Dr. GRPO vs GRPO


def test_group_advantages_closed_form():
    # Two groups of 4, members interleaved: group 7 = rows 0, 2, 4, 6; group 3 = rows 1, 3, 5, 7.
    rewards = jnp.array([1.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    groups = jnp.array([7, 3, 7, 3, 7, 3, 7, 3])
    dr = losses.group_advantages(rewards, groups)
    _close(dr, [0.75, 1.0, -0.25, -1.0, -0.25, 0.0, -0.25, 0.0])      # R - group mean, no std division
    grpo = losses.group_advantages(rewards, groups, scale_by_std=True, eps=0.0)
    std7, std3 = np.sqrt(0.1875), np.sqrt(0.5)                          # population std of each group
    _close(grpo, [0.75 / std7, 1 / std3, -0.25 / std7, -1 / std3, -0.25 / std7, 0, -0.25 / std7, 0])


def test_dr_grpo_token_weights_do_not_depend_on_length():
    """d L_pg / d logp_it is -A_i / N for every token under Dr. GRPO; GRPO's per-response mean gives
    -A_i / (B |o_i|), so a long response's tokens weigh less (the length bias Dr. GRPO removes)."""
    adv = jnp.array([1.0, 1.0, -2.0])
    mask = jnp.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], jnp.float32)
    lengths = mask.sum(-1)
    logp = jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32)
    ones = jnp.ones_like(logp)
    n = 3 * 4
    grad_dr = jax.grad(lambda lp: losses.policy_gradient_loss(lp, adv, ones, mask, n))(logp)
    _close(grad_dr, -adv[:, None] * mask / n)
    grad_grpo = jax.grad(lambda lp: -losses.sequence_mean(adv[:, None] * lp, mask))(logp)
    _close(grad_grpo, -adv[:, None] * mask / (3 * lengths[:, None]))
    # Values: an explicit double loop.
    values = np.asarray(adv[:, None] * logp)
    dr = sum(values[i, t] for i in range(3) for t in range(4) if mask[i, t]) / n
    grpo = np.mean([sum(values[i, t] for t in range(4) if mask[i, t]) / lengths[i] for i in range(3)])
    _close(losses.constant_sum(adv[:, None] * logp, mask, n), dr)
    _close(losses.sequence_mean(adv[:, None] * logp, mask), grpo)


# ------------------------------------------------------------------------------------------------
# Importance weights


def test_importance_weight_is_one_on_policy():
    logp = jnp.asarray(-RNG.exponential(size=(4, 6)), jnp.float32)
    w, clipped = losses.importance_weights(logp, logp, cap=2.0)
    _close(w, np.ones((4, 6)))
    assert not bool(clipped.any())


def test_importance_weight_truncated_and_stop_gradient():
    logp = jnp.log(jnp.array([0.5, 0.3, 0.9]))
    behaviour = jnp.log(jnp.array([0.5, 0.1, 0.3]))                   # ratios 1, 3, 3
    w, clipped = losses.importance_weights(logp, behaviour, cap=2.0)
    _close(w, [1.0, 2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(clipped), [False, True, True])
    _close(jax.grad(lambda lp: losses.importance_weights(lp, behaviour, 5.0)[0].sum())(logp), np.zeros(3))


# ------------------------------------------------------------------------------------------------
# KL estimators: value vs gradient


def _categorical():
    theta = jnp.asarray(RNG.normal(size=7), jnp.float32)
    ref = jax.nn.log_softmax(jnp.asarray(RNG.normal(size=7), jnp.float32))
    return theta, ref


def test_k1_in_reward_gradient_equals_k2_loss_per_sample():
    """Per token (with TIS weights and a mask), k1 folded into the advantage and k2 as a loss give the
    same gradient with respect to the logits, sample by sample."""
    b, s, v, beta = 3, 5, 11, 0.3
    logits = jnp.asarray(RNG.normal(size=(b, s, v)), jnp.float32)
    targets = jnp.asarray(RNG.integers(0, v, (b, s)))
    ref = jnp.asarray(-RNG.exponential(size=(b, s)) - 1.0, jnp.float32)
    w = jnp.asarray(RNG.uniform(0.2, 2.0, (b, s)), jnp.float32)
    mask = jnp.asarray(RNG.integers(0, 2, (b, s)), jnp.float32)
    zero_adv = jnp.zeros((b,))

    def k1(z):
        logp = losses.token_logprobs(z, targets)
        return losses.policy_gradient_loss(logp, losses.kl_reward_advantages(zero_adv, logp, ref, beta), w, mask, 15)

    def k2(z):
        return losses.k2_kl_loss(losses.token_logprobs(z, targets), ref, w, mask, beta, 15)

    g1, g2 = jax.grad(k1)(logits), jax.grad(k2)(logits)
    assert float(jnp.abs(g2).max()) > 1e-3
    _close(g1, g2)
    for i in range(b):  # each sample alone
        def one(f, i=i):
            return jax.grad(lambda zi: f(logits.at[i].set(zi)))(logits[i])
        _close(one(k1), one(k2))


def test_kl_estimator_expected_gradients():
    """Exact expectations over y ~ pi (enumerating the vocabulary, sampling weights under stop-gradient):
    k1-in-reward and k2-as-loss give grad KL(pi || ref) = pi * (d - KL); k3-as-loss gives the forward
    grad KL(ref || pi) = pi - ref; k1-as-loss gives 0."""
    theta, ref = _categorical()
    v = theta.shape[0]
    ys = jnp.arange(v)

    def expected(per_sample):  # theta -> sum_y sg(pi(y)) * per_sample(theta, y)
        def f(t):
            pi = jax.lax.stop_gradient(jax.nn.softmax(t))
            return jnp.sum(pi * jax.vmap(lambda y: per_sample(t, y))(ys))
        return jax.grad(f)(theta)

    logp = lambda t, y: jax.nn.log_softmax(t)[y]
    pi = jax.nn.softmax(theta)
    d = jnp.log(pi) - ref
    reverse = pi * (d - jnp.sum(pi * d))
    forward = pi - jnp.exp(ref)
    k1_reward = expected(lambda t, y: jax.lax.stop_gradient(logp(t, y) - ref[y]) * logp(t, y))
    k2_loss = expected(lambda t, y: losses.kl_estimate(logp(t, y), ref[y], "k2"))
    k3_loss = expected(lambda t, y: losses.kl_estimate(logp(t, y), ref[y], "k3"))
    k1_loss = expected(lambda t, y: losses.kl_estimate(logp(t, y), ref[y], "k1"))
    _close(k1_reward, reverse)
    _close(k2_loss, reverse)
    _close(k3_loss, forward)
    _close(k1_loss, np.zeros(v))
    assert float(jnp.abs(reverse - forward).max()) > 1e-2      # the two directions do differ here
    # As values, k1 and k3 are unbiased estimates of the reverse KL.
    kl = jnp.sum(pi * d)
    _close(jnp.sum(pi * losses.kl_estimate(jnp.log(pi), ref, "k1")), kl)
    _close(jnp.sum(pi * losses.kl_estimate(jnp.log(pi), ref, "k3")), kl)


def test_config_rejects_k3_as_a_loss():
    with pytest.raises(ConfigError, match="kl_estimator"):
        from_dict(RLConfig, {"kl_estimator": "k3_loss"})
    with pytest.raises(ConfigError, match="forward KL"):
        RLConfig(kl_estimator="k3")
    with pytest.raises(ConfigError, match="rl.is_cap"):
        from_dict(RLConfig, {"is_cap": 0.5}, prefix="rl")


# ------------------------------------------------------------------------------------------------
# Entropy and the self-distillation divergences


def _fd_grad(f, z, h=1e-3):
    """Central finite differences of scalar f at z (float64 numpy)."""
    z = np.asarray(z, np.float64)
    g = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        e = np.zeros_like(z)
        e[i] = h
        g[i] = (float(f(jnp.asarray(z + e, jnp.float32))) - float(f(jnp.asarray(z - e, jnp.float32)))) / (2 * h)
    return g


def test_entropy_closed_form():
    v = 9
    _close(losses.token_entropy(jnp.zeros((v,))), np.log(v))
    z = jnp.asarray(RNG.normal(size=v), jnp.float32)
    s = jax.nn.softmax(z)
    h = -jnp.sum(s * jnp.log(s))
    _close(losses.token_entropy(z), h)
    _close(jax.grad(losses.token_entropy)(z), -s * (jnp.log(s) + h))    # dH/dz = -s (log s + H)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd", "sampled_token"])
def test_divergence_zero_with_identical_teacher(kind):
    z = jnp.asarray(RNG.normal(size=(2, 3, 8)), jnp.float32)
    y = jnp.asarray(RNG.integers(0, 8, (2, 3)))
    f = lambda s: jnp.sum(losses.distill_divergence(s, z, y, kind))
    _close(f(z), 0.0)
    _close(jax.grad(f)(z), np.zeros(z.shape))


def test_divergence_gradients():
    v = 6
    zs = jnp.asarray(RNG.normal(size=v), jnp.float32)
    zt = jnp.asarray(RNG.normal(size=v), jnp.float32)
    s, t = jax.nn.softmax(zs), jax.nn.softmax(zt)
    y = jnp.array(2)
    div = lambda kind, beta=0.5: (lambda z: losses.distill_divergence(z, zt, y, kind, beta))
    # Closed forms.
    kl_rev = jnp.sum(s * (jnp.log(s) - jnp.log(t)))
    _close(div("reverse_kl")(zs), kl_rev)
    _close(jax.grad(div("reverse_kl"))(zs), s * (jnp.log(s) - jnp.log(t) - kl_rev))
    _close(div("forward_kl")(zs), jnp.sum(t * (jnp.log(t) - jnp.log(s))))
    _close(jax.grad(div("forward_kl"))(zs), s - t)
    # JSD(beta): value from its definition, gradient by finite differences.
    for beta in (0.2, 0.5):
        m = beta * t + (1 - beta) * s
        jsd = beta * jnp.sum(t * jnp.log(t / m)) + (1 - beta) * jnp.sum(s * jnp.log(s / m))
        _close(div("jsd", beta)(zs), jsd)
        _close(jax.grad(div("jsd", beta))(zs), _fd_grad(div("jsd", beta), zs), tol=2e-3)
    # The sampled-token estimator's expected gradient over y ~ s is the reverse-KL gradient.
    sampled = lambda z: jnp.sum(jax.lax.stop_gradient(jax.nn.softmax(z)) * jax.vmap(
        lambda yy: losses.distill_divergence(z, zt, yy, "sampled_token"))(jnp.arange(v)))
    _close(jax.grad(sampled)(zs), jax.grad(div("reverse_kl"))(zs))
    # No gradient reaches the teacher.
    _close(jax.grad(lambda t_: losses.distill_divergence(zs, t_, y, "reverse_kl"))(zt), np.zeros(v))


def test_self_distillation_mean_over_flagged_tokens():
    d = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = jnp.array([[0, 1, 1], [0, 0, 1]], jnp.float32)
    _close(losses.self_distillation_loss(d, mask), (2 + 3 + 6) / 3)
    _close(losses.self_distillation_loss(d, jnp.zeros_like(mask)), 0.0)


def test_chunked_heads_are_reduced_once_not_once_per_chunk():
    """`rows.chunked` with an output head, rows sharded over 8 devices, 4 chunks: log-probabilities and
    entropies, and their gradients for the head and the hidden states, equal one unchunked computation
    without a mesh; the head's gradient crosses devices once (one head's bytes reduced, not one per chunk)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.rl.rows import chunked
    from tests.test_train_losses import collective_bytes

    rows, seq, e, v = 8, 60, 16, 256    # 60 positions: the last of 4 chunks of 16 is padded
    rng = np.random.default_rng(1)
    head = jnp.asarray(rng.normal(size=(e, v)) * 0.3, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(rows, seq, e)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (rows, seq)), jnp.int32)
    coef = jnp.asarray(rng.normal(size=(rows, seq)), jnp.float32)

    def stats(head, h, y):
        logits = jnp.dot(h, head)
        return losses.token_logprobs(logits, y), losses.token_entropy(logits)

    def objective(fn):
        def f(head, hidden, targets):
            logp, entropy = fn(head, hidden, targets)
            return jnp.sum(coef * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)

    (_, want_stats), want_grads = objective(stats)(head, hidden, targets)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        args = (jax.device_put(head, NamedSharding(mesh, P())),
                *(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (hidden, targets)))
        program = jax.jit(objective(lambda hd, h, y: chunked(stats, 16, h, y, heads=(hd,))))
        compiled = program.lower(*args).compile()
        (_, got_stats), got_grads = compiled(*args)
    for got, want in zip((*got_stats, *got_grads), (*want_stats, *want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    moved = collective_bytes(compiled.as_text(), 8, "data")
    assert e * v * 4 <= moved < 1.5 * e * v * 4, moved
