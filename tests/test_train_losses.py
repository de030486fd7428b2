"""Losses against independent references: chunked CE vs plain CE, MTP CE vs the model's `mtp_loss`,
self-distillation KL vs numpy and finite differences; the WSD schedule; gradient clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composer_jax.train import losses
from composer_jax.train.config import OptimizerConfig
from composer_jax.train.optimizer import wsd_schedule
from composer_jax.train.update import clip_by_global_norm
from tests.reference_losses import cross_entropy, mtp_loss

B, S, D, V = 2, 11, 8, 37


def _inputs(seed=0, depths=2):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    mtp_hidden = jnp.asarray(rng.normal(size=(depths, B, S, D)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    segments = jnp.asarray([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2], jnp.int32)   # two docs; padding
    loss_mask = jnp.asarray(segments > 0, jnp.int32).at[0, 2].set(0)              # one non-target token
    return hidden, mtp_hidden, head, tokens, segments, loss_mask


def test_target_weights_respect_documents_padding_and_mask():
    _, _, _, tokens, segments, loss_mask = _inputs()
    labels, w = losses.target_weights(tokens, segments, loss_mask, 1)
    np.testing.assert_array_equal(labels[:, :-1], tokens[:, 1:])
    expected = np.zeros((B, S))
    expected[0, [0, 2, 3, 4, 6, 7, 8, 9]] = 1    # not 1 (target masked), not 5 (next doc), not 10 (row end)
    expected[0, 1] = 0
    expected[1, :8] = 1                            # positions 8.. predict padding
    np.testing.assert_array_equal(w, expected)


@pytest.mark.parametrize("chunk", [4, 64])  # 4 pads the 11 positions; 64 is one chunk
def test_chunked_cross_entropy_equals_plain(chunk):
    hidden, _, head, tokens, segments, loss_mask = _inputs()
    labels, w = losses.target_weights(tokens, segments, loss_mask, 1)

    def chunked(h, W):
        return losses.head_loss_sums(h, W, labels, w, chunk=chunk)[0] / w.sum()

    def plain(h, W):
        return cross_entropy(h @ W, labels, w > 0)

    np.testing.assert_allclose(chunked(hidden, head), plain(hidden, head), rtol=1e-6)
    for g_c, g_p in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(plain, (0, 1))(hidden, head)):
        np.testing.assert_allclose(g_c, g_p, rtol=1e-5, atol=1e-7)


def test_mtp_cross_entropy_matches_model_mtp_loss():
    hidden, mtp_hidden, head, tokens, segments, loss_mask = _inputs()
    sums = losses.lm_loss_sums(hidden, mtp_hidden, head, tokens, segments, loss_mask, chunk=4, distill=False)
    _, n_mtp = losses.count_targets(tokens, segments, loss_mask, depths=2)
    ours = 0.3 / 2 * jnp.sum(sums.mtp_ce / n_mtp)
    reference = mtp_loss(lambda h: h @ head, mtp_hidden, tokens, 0.3, segments, loss_mask)
    np.testing.assert_allclose(ours, reference, rtol=1e-6)


def _numpy_kl(student_h, teacher_h, head, weights):
    """sum_i w_i KL(softmax(t_i @ W) || softmax(s_i @ W)) in float64."""
    def logsoftmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    s = logsoftmax(np.asarray(student_h, np.float64) @ np.asarray(head, np.float64))
    t = logsoftmax(np.asarray(teacher_h, np.float64) @ np.asarray(head, np.float64))
    return float(np.sum(np.asarray(weights) * np.sum(np.exp(t) * (t - s), -1)))


def _numpy_acceptance(student_h, teacher_h, head, weights):
    """sum_i w_i P(speculative sampling keeps a token drafted from the student), by simulation in float64:
    the draft x ~ q is kept with probability min(1, p(x) / q(x)), summed exactly over x."""
    def softmax(h):
        x = np.asarray(h, np.float64) @ np.asarray(head, np.float64)
        x = np.exp(x - x.max(-1, keepdims=True))
        return x / x.sum(-1, keepdims=True)
    q, p = softmax(student_h), softmax(teacher_h)
    return float(np.sum(np.asarray(weights) * np.sum(q * np.minimum(1.0, p / q), -1)))


def test_self_distillation_kl_value_and_stop_gradient():
    hidden, mtp_hidden, head, tokens, segments, loss_mask = _inputs()
    sums = losses.lm_loss_sums(hidden, mtp_hidden, head, tokens, segments, loss_mask, chunk=3, distill=True)
    for k in (1, 2):
        _, w = losses.target_weights(tokens, segments, loss_mask, k + 1)
        teacher = losses.shift_hidden_left(hidden, k)  # the main head at i + k predicts t[i+k+1] too
        np.testing.assert_allclose(sums.mtp_kl[k - 1], _numpy_kl(mtp_hidden[k - 1], teacher, head, w), rtol=1e-5)
        np.testing.assert_allclose(sums.mtp_accept[k - 1], _numpy_acceptance(mtp_hidden[k - 1], teacher, head, w),
                                   rtol=1e-5)
    self_accept = losses.lm_loss_sums(hidden, jnp.stack([losses.shift_hidden_left(hidden, k) for k in (1, 2)]),
                                      head, tokens, segments, loss_mask, chunk=3, distill=True).mtp_accept
    np.testing.assert_allclose(self_accept, [losses.target_weights(tokens, segments, loss_mask, k + 1)[1].sum()
                                             for k in (1, 2)], rtol=1e-5)    # a draft from p itself: always kept
    # The teacher is stop-gradient: the KL does not move the main hidden states.
    kl_of_hidden = lambda h: losses.lm_loss_sums(h, mtp_hidden, head, tokens, segments, loss_mask,  # noqa: E731
                                                 chunk=3, distill=True).mtp_kl.sum()
    np.testing.assert_array_equal(jax.grad(kl_of_hidden)(hidden), 0.0)


def test_full_objective_gradient_matches_finite_differences():
    """Our gradient equals finite differences of a plain (unchunked) objective in which the
    self-distillation teacher is a constant: exactly what stop-gradient means."""
    hidden, mtp_hidden, head, tokens, segments, loss_mask = _inputs(seed=1)
    n_main, n_mtp = losses.count_targets(tokens, segments, loss_mask, depths=2)
    lam, beta = 0.3, 0.7

    @jax.jit
    def ours(h, m, W):
        sums = losses.lm_loss_sums(h, m, W, tokens, segments, loss_mask, chunk=4, distill=True)
        return losses.combine(sums, n_main, n_mtp, mtp_weight=lam, distill_weight=beta)

    teachers = [jax.nn.softmax(losses.shift_hidden_left(hidden, k) @ head) for k in (1, 2)]  # constants

    @jax.jit
    def reference(h, m, W):
        labels, w = losses.target_weights(tokens, segments, loss_mask, 1)
        total = cross_entropy(h @ W, labels, w > 0)
        for k in (1, 2):
            labels, w = losses.target_weights(tokens, segments, loss_mask, k + 1)
            logp = jax.nn.log_softmax(m[k - 1] @ W)
            total += lam / 2 * cross_entropy(m[k - 1] @ W, labels, w > 0)
            kl = jnp.sum(teachers[k - 1] * (jnp.log(teachers[k - 1]) - logp), -1)
            total += beta / 2 * jnp.sum(w * kl) / w.sum()
        return total

    args = (hidden, mtp_hidden, head)
    np.testing.assert_allclose(ours(*args), reference(*args), rtol=1e-5)
    grads = jax.grad(ours, (0, 1, 2))(*args)
    rng = np.random.default_rng(2)
    eps = 1e-2
    for arg, grad in enumerate(grads):
        for _ in range(4):
            direction = [jnp.zeros_like(x) for x in args]
            direction[arg] = jnp.asarray(rng.normal(size=grad.shape), jnp.float32)
            plus = reference(*[x + eps * d for x, d in zip(args, direction)])
            minus = reference(*[x - eps * d for x, d in zip(args, direction)])
            numeric = (plus - minus) / (2 * eps)
            np.testing.assert_allclose(jnp.vdot(grad, direction[arg]), numeric, rtol=2e-3, atol=2e-4)


def test_count_targets_over_micro_batches():
    _, _, _, tokens, segments, loss_mask = _inputs()
    stacked = [jnp.stack([x, x]) for x in (tokens, segments, loss_mask)]
    main, mtp = losses.count_targets(*stacked, depths=2)
    main1, mtp1 = losses.count_targets(tokens, segments, loss_mask, depths=2)
    assert main == 2 * main1 == 2 * losses.target_weights(tokens, segments, loss_mask, 1)[1].sum()
    np.testing.assert_array_equal(mtp, 2 * mtp1)


def test_wsd_schedule_shape():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    lr = wsd_schedule(cfg, total_steps=100)
    values = np.asarray([lr(s) for s in range(100)])
    np.testing.assert_allclose(values[:10], np.arange(1, 11) / 10, rtol=1e-6)   # linear warmup
    np.testing.assert_allclose(values[10:80], 1.0)                              # stable
    np.testing.assert_allclose(values[80], 1.0)
    np.testing.assert_allclose(values[90], 0.55, rtol=1e-6)                     # linear decay
    assert values[99] == pytest.approx(1.0 + (0.1 - 1.0) * 19 / 20)
    cosine = wsd_schedule(OptimizerConfig(lr=1.0, warmup_steps=0, decay_fraction=1.0, decay_shape="cosine",
                                          min_lr_ratio=0.0), total_steps=10)
    np.testing.assert_allclose([cosine(s) for s in (0, 5)], [1.0, 0.5], atol=1e-6)


@pytest.mark.parametrize("max_norm", [2.0, 20.0])
def test_clip_by_global_norm_matches_optax(max_norm):
    """Bitwise optax's clip_by_global_norm, clipping (2) and not (20); 0 disables."""
    grads = {"a": jnp.asarray([3.0, 4.0]), "b": jnp.asarray([[12.0]])}
    tx = optax.clip_by_global_norm(max_norm)
    clipped, _ = tx.update(grads, tx.init(grads))
    ours = clip_by_global_norm(grads, max_norm, optax.tree.norm(grads))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(clipped)):
        np.testing.assert_array_equal(a, b)
    assert clip_by_global_norm(grads, 0.0, optax.tree.norm(grads)) is grads


def test_micro_batch_sums_with_step_counts_equal_the_full_batch_objective():
    """Gradient accumulation: summing per-micro-batch objectives normalised by the step's global target
    counts gives the full-batch objective and gradient."""
    hidden, mtp_hidden, head, tokens, segments, loss_mask = _inputs(seed=3)
    n_main, n_mtp = losses.count_targets(tokens, segments, loss_mask, depths=2)

    def objective(h, m, W, rows):
        sums = losses.lm_loss_sums(h[rows], m[:, rows], W, tokens[rows], segments[rows], loss_mask[rows],
                                   chunk=4, distill=True)
        return losses.combine(sums, n_main, n_mtp, mtp_weight=0.3, distill_weight=0.5)

    full = jax.value_and_grad(objective, (0, 1, 2))
    value, grads = full(hidden, mtp_hidden, head, slice(0, 2))
    parts = [full(hidden, mtp_hidden, head, slice(i, i + 1)) for i in range(2)]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], value, rtol=1e-6)
    for g, g0, g1 in zip(grads, parts[0][1], parts[1][1]):
        np.testing.assert_allclose(g0 + g1, g, rtol=1e-5, atol=1e-7)


def collective_bytes(compiled_text: str, devices: int, axis: str) -> float:
    """Bytes per device of the compiled program's all-reduces, reduce-scatters and all-gathers per call
    (result sizes; loop bodies counted by their trip counts)."""
    from composer_jax.plan import hlo

    summary = hlo.summarize(compiled_text, devices, (hlo.Grid("grid", (axis,), (devices,)),))
    return sum(summary.total(kind).bytes for kind in ("all-reduce", "reduce-scatter", "all-gather"))


def test_the_heads_gradient_crosses_devices_once_not_once_per_chunk():
    """The chunked loss (4 chunks) on rows sharded over 8 devices: the head's gradient is summed on each
    device over the chunks and reduced across devices once, after the loop; the compiled program's
    collectives move one head's bytes (an all-reduce per chunk moved four; gathering every device's copy
    to sum them, eight), and the gradients equal those computed without a mesh."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    b, s, e, v = 8, 64, 16, 512
    rng = np.random.default_rng(0)
    head = jnp.asarray(rng.normal(size=(e, v)) * 0.3, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(b, s, e)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    weights = jnp.asarray(rng.random((b, s)) > 0.2, jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(b, s, e)), jnp.float32)

    def loss(head, hidden, labels, weights, teacher):
        sums = losses.head_loss_sums(hidden, head, labels, weights, chunk=16, teacher=teacher)
        return sums[0] + 0.5 * sums[1]

    grad = jax.grad(loss, argnums=(0, 1))
    want = grad(head, hidden, labels, weights, teacher)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rows = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        args = (jax.device_put(head, NamedSharding(mesh, P())),
                *(jax.device_put(x, rows) for x in (hidden, labels, weights, teacher)))
        compiled = jax.jit(grad).lower(*args).compile()
        got = compiled(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
    moved = collective_bytes(compiled.as_text(), 8, "data")
    assert e * v * 4 <= moved < 1.5 * e * v * 4, moved
