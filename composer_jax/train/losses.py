"""Language-model losses over a large vocabulary without materialising [tokens, vocab] logits at once.

`head_loss_sums` runs the output head over the sequence chunk by chunk inside a `lax.scan`; each
chunk's backward rebuilds its logits (`_chunk_sums`' hand-written gradient), so forward and backward
hold one [batch, chunk, vocab] block of float32 logits at a time. The batch axis stays whole, so the chunks
keep the batch sharding of data / FSDP parallelism. It returns *sums* (of token cross-entropy and,
optionally, of the self-distillation KL) so callers normalise once over a whole step, however it is
split into micro-batches.

The training objective (per step, over all micro-batches; D = MTP depths):

    L = CE_main + (lambda / D) * sum_k CE_k + (beta / D) * sum_k KL_k
    CE_main = mean over target tokens of -log p(t[i+1] | t[<=i])
    CE_k    = mean over valid positions of -log P_k(t[i+k+1])            (MTP depth k)
    KL_k    = mean over the same positions of KL(sg(p_main(. | i+k)) || P_k(. | i))

The main head at position i+k predicts the same token t[i+k+1] as MTP depth k at position i, so its
(stop-gradient) distribution is the self-distillation teacher for that depth.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.model.mtp import shift_left
from composer_jax.model.transformer import head_logits
from composer_jax.parallel.partitioning import copy_per_row_shard, gather_sequence, split_by_row_shard


def mtp_target_mask(segment_ids: jax.Array, depth: int) -> jax.Array:
    """bool[batch, seq]: depth `depth` at position i has a target t[i+depth+1] in the same document
    (depth 0: the main head's next token)."""
    offset = depth + 1
    valid = jnp.arange(segment_ids.shape[1])[None] + offset < segment_ids.shape[1]
    return valid & (shift_left(segment_ids, offset, fill=-1) == segment_ids)


def target_weights(tokens, segment_ids, loss_mask, offset: int) -> tuple[jax.Array, jax.Array]:
    """Targets `offset` tokens ahead and where they count.

    tokens, segment_ids, loss_mask: int[batch, seq]. Returns labels int32[batch, seq] (t[i+offset]) and
    weights f32[batch, seq]: 1 where i+offset is inside the row, in the same document, and a training
    target (loss_mask; 0 in padding), else 0.
    """
    valid = mtp_target_mask(segment_ids, offset - 1) & shift_left(loss_mask, offset).astype(bool)
    return shift_left(tokens, offset).astype(jnp.int32), valid.astype(jnp.float32)


def shift_hidden_left(h: jax.Array, k: int) -> jax.Array:
    """h[:, i] <- h[:, i + k], zero-padded. h: [batch, seq, embed]."""
    return jnp.concatenate([h[:, k:], jnp.zeros_like(h[:, :k])], axis=1)[:, : h.shape[1]]


def _teacher_probs(head, teacher):
    """The teacher's log-probabilities and probabilities over the vocab, f32[batch, chunk, vocab] each."""
    t_logp = jax.nn.log_softmax(head_logits(head, teacher), axis=-1)
    return t_logp, jnp.exp(t_logp)


def _chunk_forward(head, h, labels, weights, teacher, with_ce: bool):
    """Sums over one chunk: [sum w * CE] (with_ce), then [sum w * KL(teacher || student), sum w * A]
    (a teacher), where A = sum_x min(p_teacher(x), p_student(x)) is the probability that speculative
    sampling keeps a token drafted from the student (kept with min(1, p/q)): a metric, no gradient.
    h: [batch, chunk, embed]. The label's logit is picked with a one-hot select, which fuses into the
    reduction (`take_along_axis` is a gather whose gradient is a scatter)."""
    logits = head_logits(head, h)                                             # [batch, chunk, vocab]
    lse = jax.nn.logsumexp(logits, axis=-1)
    sums = []
    if with_ce:
        picked = jnp.sum(jnp.where(_one_hot(labels, logits.shape[-1]), logits, 0.0), axis=-1)
        sums.append(jnp.sum(weights * (lse - picked)))
    if teacher is not None:
        t_logp, t_p = _teacher_probs(head, teacher)
        kl = jnp.sum(t_p * (t_logp - logits), axis=-1) + lse                  # sum_x t_p = 1
        sums.append(jnp.sum(weights * kl))
        accept = jnp.sum(jnp.minimum(t_p, jnp.exp(logits - lse[..., None])), axis=-1)
        sums.append(jnp.sum(weights * accept))
    return jnp.stack(sums)


def _one_hot(labels, vocab: int):
    return jnp.arange(vocab, dtype=labels.dtype) == labels[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunk_sums(head, h, labels, weights, teacher, with_ce: bool):
    """`_chunk_forward` with a hand-written backward: it rebuilds the chunk's logits from h and the head
    (nothing [batch, chunk, vocab] is kept between the passes) and forms the logits' gradient as one
    expression, d/dlogits = w * (ct_ce * (p - onehot) + ct_kl * (p - p_teacher)), which XLA fuses;
    autodiff through log-softmax and the label gather built it from several [batch, chunk, vocab]
    temporaries and a scatter (2.2x slower on CPU). Labels, weights and the teacher get no gradient."""
    return _chunk_forward(head, h, labels, weights, teacher, with_ce)


def _chunk_sums_fwd(head, h, labels, weights, teacher, with_ce):
    return _chunk_forward(head, h, labels, weights, teacher, with_ce), (head, h, labels, weights, teacher)


def _chunk_sums_bwd(with_ce, residuals, ct):
    head, h, labels, weights, teacher = residuals
    logits = head_logits(head, h)
    p = jax.nn.softmax(logits, axis=-1)
    ct_ce = ct[0] if with_ce else 0.0
    ct_kl = ct[int(with_ce)] if teacher is not None else 0.0
    g = p * (ct_ce + ct_kl)
    if with_ce:
        g = g - jnp.where(_one_hot(labels, logits.shape[-1]), ct_ce, 0.0)
    if teacher is not None:
        g = g - ct_kl * _teacher_probs(head, teacher)[1]
    g = (g * weights[..., None]).astype(h.dtype)                              # d sums / d logits
    d_h = jnp.einsum("bcv,dv->bcd", g, head.astype(h.dtype), preferred_element_type=jnp.float32)
    d_head = jnp.einsum("bcd,bcv->dv", h, g, preferred_element_type=jnp.float32)  # this shard's rows only
    return d_head.astype(head.dtype), d_h.astype(h.dtype), None, None, None


_chunk_sums.defvjp(_chunk_sums_fwd, _chunk_sums_bwd)


def head_loss_sums(hidden: jax.Array, head: jax.Array, labels: jax.Array, weights: jax.Array, *,
                   chunk: int, teacher: jax.Array | None = None, with_ce: bool = True) -> jax.Array:
    """Chunked cross-entropy (and KL) sums through the output head.

    hidden: [batch, seq, embed] (whole sequences); head: [embed, vocab] (whole); labels: int[batch, seq];
    weights: f32[batch, seq]; teacher: [batch, seq, embed] hidden states whose head distribution is the
    stop-gradient KL target. The sequence is cut into chunks of `chunk` positions, so one
    [batch, chunk, vocab] block of logits exists at a time (per device: its batch shard). Each batch shard
    works with its own copy of the head (`copy_per_row_shard`), so the head's gradient adds up over the
    chunks on each shard and is reduced across shards once, not once per chunk.
    Returns the CE sum (unless `with_ce=False`), then the KL and acceptance sums (with a teacher):
    f32[1], f32[2] or f32[3].
    """
    if not with_ce and teacher is None:
        raise ValueError("head_loss_sums: nothing to compute (with_ce=False and no teacher)")
    s = hidden.shape[1]
    chunk = min(chunk, s)
    pad = (-s) % chunk

    def chunks(x):  # [batch, seq, ...] -> [num_chunks, batch, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(x.shape[0], (s + pad) // chunk, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    xs = (chunks(hidden), chunks(labels), chunks(weights), None if teacher is None else chunks(teacher))
    heads = copy_per_row_shard(head, hidden)                                 # [shards, embed, vocab]
    per_shard = jax.vmap(lambda hd, h, y, w, t: _chunk_sums(hd, h, y, w, t, with_ce))

    def body(total, x):   # x: one chunk, [batch, chunk, ...] each; by shard: [shards, batch / shards, chunk, ...]
        by_shard = jax.tree.map(lambda a: split_by_row_shard(a, hidden), x)
        return total + per_shard(heads, *by_shard).sum(0), None

    init = jnp.zeros((int(with_ce) + 2 * int(teacher is not None),), jnp.float32)
    total, _ = jax.lax.scan(body, init, xs)
    return total


class LossSums(NamedTuple):
    """Per micro-batch sums: main CE f32[]; MTP CE, KL and speculative acceptance f32[depths]."""

    ce: jax.Array
    mtp_ce: jax.Array
    mtp_kl: jax.Array
    mtp_accept: jax.Array


def count_targets(tokens, segment_ids, loss_mask, depths: int) -> tuple[jax.Array, jax.Array]:
    """Target counts: main f32[] and per MTP depth f32[depths]. Arrays [batch, seq] or [n, batch, seq]."""
    def counts(t, s, m):
        return jnp.stack([target_weights(t, s, m, k)[1].sum() for k in range(1, depths + 2)])

    if tokens.ndim == 3:
        total = jax.vmap(counts)(tokens, segment_ids, loss_mask).sum(0)
    else:
        total = counts(tokens, segment_ids, loss_mask)
    return total[0], total[1:]


def count_target_bytes(tokens, segment_ids, loss_mask, token_bytes) -> jax.Array:
    """f32[]: the bytes of text the main targets stand for (what bits per byte divide by). token_bytes:
    int[vocab] (the tokenizer's `token_bytes`, 0 for special tokens); arrays [batch, seq] or [n, batch, seq]."""
    rows = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    labels, weights = target_weights(rows(tokens), rows(segment_ids), rows(loss_mask), 1)
    return (jnp.take(token_bytes, labels).astype(jnp.float32) * weights).sum()


def mtp_loss_sums(hidden, mtp_hidden, head, tokens, segment_ids, loss_mask, *, chunk: int, with_ce: bool = True,
                  distill: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-depth MTP sums (CE_k and KL_k of the module docstring, before normalisation, and the
    acceptance sums of `_chunk_sums`): f32[depths] each, zeros for a part not computed (`with_ce=False`:
    the self-distillation KL alone; `distill=False`: no KL, no acceptance).

    hidden: [batch, seq, embed] (main model, after the final norm; the KL teacher under stop-gradient);
    mtp_hidden: [depths, batch, seq, embed]; head: [embed, vocab] (whole); tokens, segment_ids,
    loss_mask: int[batch, seq] (loss_mask marks the tokens that count as targets).
    """
    hidden = gather_sequence(hidden)
    mtp_hidden = gather_sequence(mtp_hidden, axis=2)
    mtp_ce, mtp_kl, mtp_accept = [], [], []
    zero = jnp.zeros((), jnp.float32)
    for k in range(1, mtp_hidden.shape[0] + 1):
        labels, weights = target_weights(tokens, segment_ids, loss_mask, k + 1)
        teacher = shift_hidden_left(hidden, k) if distill else None
        sums = list(head_loss_sums(mtp_hidden[k - 1], head, labels, weights, chunk=chunk, teacher=teacher,
                                   with_ce=with_ce))
        mtp_ce.append(sums.pop(0) if with_ce else zero)
        mtp_kl.append(sums.pop(0) if distill else zero)
        mtp_accept.append(sums.pop(0) if distill else zero)
    stack = lambda xs: jnp.stack(xs) if xs else jnp.zeros((0,), jnp.float32)  # noqa: E731
    return stack(mtp_ce), stack(mtp_kl), stack(mtp_accept)


def lm_loss_sums(hidden, mtp_hidden, head, tokens, segment_ids, loss_mask, *, chunk: int,
                 distill: bool) -> LossSums:
    """Loss sums of one micro-batch.

    hidden: [batch, seq, embed] (main model, after the final norm); mtp_hidden: [depths, batch, seq,
    embed] or None; head: [embed, vocab] (whole); tokens, segment_ids, loss_mask: int[batch, seq].
    """
    hidden = gather_sequence(hidden)
    labels, weights = target_weights(tokens, segment_ids, loss_mask, 1)
    ce = head_loss_sums(hidden, head, labels, weights, chunk=chunk)[0]
    if mtp_hidden is None:
        none = jnp.zeros((0,), jnp.float32)
        return LossSums(ce, none, none, none)
    return LossSums(ce, *mtp_loss_sums(hidden, mtp_hidden, head, tokens, segment_ids, loss_mask, chunk=chunk,
                                       distill=distill))


def depth_mean(sums: jax.Array, n_mtp: jax.Array, weight: float) -> jax.Array:
    """(weight / D) * sum_k sums[k] / n_mtp[k]: a per-depth loss sum f32[D] as its term of the objective
    (0 without depths)."""
    depths = sums.shape[0]
    if not depths:
        return jnp.zeros((), jnp.float32)
    return weight / depths * jnp.sum(sums / jnp.maximum(n_mtp, 1.0))


def combine(sums: LossSums, n_main, n_mtp, mtp_weight: float, distill_weight: float) -> jax.Array:
    """The scalar objective from sums and (step-global) target counts; see the module docstring."""
    return (sums.ce / jnp.maximum(n_main, 1.0) + depth_mean(sums.mtp_ce, n_mtp, mtp_weight)
            + depth_mean(sums.mtp_kl, n_mtp, distill_weight))
