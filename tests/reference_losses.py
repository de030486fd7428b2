"""Plain (unchunked, one-shot) reference losses for tests, written independently of
composer_jax.train.losses: the next-token CE and DeepSeek-V3's MTP loss from their definitions."""

import jax
import jax.numpy as jnp


def shift_left(x, k, fill=0):
    """x[:, i] <- x[:, i + k]; the last k columns become `fill`. x: [batch, seq]."""
    return jnp.concatenate([x[:, k:], jnp.full((x.shape[0], k), fill, x.dtype)], axis=1)


def cross_entropy(logits, labels, mask):
    """Mean token cross-entropy over `mask`. logits: f32[..., vocab]; labels: int[...]; mask: bool[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(mask.sum(), 1)


def mtp_loss(logits_fn, mtp_hidden, tokens, weight, segment_ids=None, loss_mask=None):
    """(weight / D) * sum_k CE(P_k, t[i+k+1]) over positions whose target t[i+k+1] exists and lies in
    the same packed document (and counts under `loss_mask`, which marks target tokens).

    logits_fn: [..., embed] -> f32[..., vocab]; mtp_hidden: [depths, batch, seq, embed];
    tokens, segment_ids, loss_mask: [batch, seq].
    """
    if segment_ids is None:
        segment_ids = jnp.zeros(tokens.shape, jnp.int32)
    seq = tokens.shape[1]
    total = 0.0
    for k in range(1, mtp_hidden.shape[0] + 1):
        inside = jnp.arange(seq)[None] + k + 1 < seq
        mask = inside & (shift_left(segment_ids, k + 1, -1) == segment_ids)
        if loss_mask is not None:
            mask &= shift_left(loss_mask.astype(bool), k + 1, False)
        total += cross_entropy(logits_fn(mtp_hidden[k - 1]), shift_left(tokens, k + 1), mask)
    return weight * total / mtp_hidden.shape[0]
