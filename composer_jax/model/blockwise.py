"""Portable memory-efficient attention: an online softmax over key blocks (FlashAttention-2's
algorithm in plain JAX), with a custom VJP that recomputes each block in the backward pass.

Queries are cut into blocks of `q_block` rows, keys into blocks of `k_block` columns; a `lax.scan`
over query blocks runs an inner scan over key blocks carrying the running row max `m`, the softmax
denominator `l` and the unnormalised output. The mask of a block comes from the query and key vectors
of `AttentionMask` (segments, orders, open prefix keys): nothing of size [q, k] outside a block exists
in the forward or the backward, so memory is linear in the sequence length. A block no query of which
sees any of its keys (later keys under causality, other documents) is skipped with `lax.cond`.

The forward saves q, k, v, the output and each row's log-sum-exp; the backward re-forms each block's
probabilities from them and accumulates dq per query block and dk, dv per key block (one pass).
Returns the output and each head's largest scaled logit over visible pairs (QK-clip's statistic; it
has no gradient, like the reference's stop-gradient). Arrays are local (one device's shard): the
sharded wrapper lives in `attention_ops`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from composer_jax.model.attention_mask import NEVER, AttentionMask

F32 = jnp.float32
MASKED = jnp.finfo(F32).min     # the logit of a hidden pair (as the reference writes it)
Q_BLOCK = 512                   # query rows per block
K_BLOCK = 512                   # key columns per block


def _blocks(x: jax.Array, size: int, fill) -> jax.Array:
    """[batch, n, ...] -> [n / size, batch, size, ...], padding n up to a multiple of `size` with `fill`."""
    pad = -x.shape[1] % size
    if pad:
        x = jnp.concatenate([x, jnp.full((x.shape[0], pad) + x.shape[2:], fill, x.dtype)], axis=1)
    return jnp.moveaxis(x.reshape((x.shape[0], -1, size) + x.shape[2:]), 1, 0)


def _unblock(x: jax.Array, n: int) -> jax.Array:
    """[blocks, batch, size, ...] -> [batch, n, ...] (the padding cut off)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :n]


def _mask_blocks(mask: AttentionMask, qb: int, kb: int):
    """Per-block mask vectors: queries (segment, order) [nq, batch, qb]; keys (segment, order, open)
    [nk, batch, kb]. Padded queries see no sequence key; padded keys are seen by no query."""
    k_open = jnp.zeros_like(mask.k_segment, bool) if mask.k_open is None else mask.k_open
    queries = (_blocks(mask.q_segment, qb, -1), _blocks(mask.q_order, qb, -1))
    keys = (_blocks(mask.k_segment, kb, 0), _blocks(mask.k_order, kb, NEVER), _blocks(k_open, kb, False))
    return queries, keys


def _varying_axes(x: jax.Array) -> frozenset:
    return getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())


def varying(x: jax.Array, *like: jax.Array) -> jax.Array:
    """x typed as varying over every mesh axis any of `like` varies over (inside `shard_map`, where a
    loop carry or `cond` branch built from constants must match one computed from the inputs)."""
    axes = frozenset().union(*map(_varying_axes, like)) - _varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _block_sizes(q: jax.Array, k: jax.Array, q_block: int, k_block: int) -> tuple[int, int]:
    return min(q_block, q.shape[1]), min(k_block, k.shape[1])


def _scores(qi, kj, vis, scale):
    """Scaled f32 logits [batch, heads, qb, kb] of a block, hidden pairs at MASKED."""
    s = jnp.einsum("bqhd,bkhd->bhqk", qi, kj, preferred_element_type=F32) * scale
    return jnp.where(vis[:, None], s, MASKED)


def _forward(q, k, v, mask: AttentionMask, scale: float, q_block: int, k_block: int):
    """(out [batch, q, heads, dv] in v's dtype, lse f32[nq, batch, heads, qb], max_logits f32[heads])."""
    (b, tq, h, _), dv = q.shape, v.shape[-1]
    qb, kb = _block_sizes(q, k, q_block, k_block)
    (q_seg, q_ord), keys = _mask_blocks(mask, qb, kb)
    k_blocks, v_blocks = _blocks(k, kb, 0), _blocks(v, kb, 0)

    def query_block(_, xs):
        qi, seg_i, ord_i = xs

        def key_block(carry, ys):
            kj, vj, seg_j, ord_j, open_j = ys
            vis = AttentionMask(seg_i, ord_i, seg_j, ord_j, open_j).visible()           # [b, qb, kb]

            def update(carry):
                m, l, acc = carry
                s = _scores(qi, kj, vis, scale)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(vis[:, None], jnp.exp(s - m_new[..., None]), 0.0)
                correction = jnp.exp(m - m_new)
                pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(vj.dtype), vj, preferred_element_type=F32)
                return m_new, l * correction + p.sum(-1), acc * jnp.swapaxes(correction, 1, 2)[..., None] + pv

            return jax.lax.cond(vis.any(), update, lambda c: c, carry), None

        init = (jnp.full((b, h, qb), MASKED), jnp.zeros((b, h, qb), F32), jnp.zeros((b, qb, h, dv), F32))
        init = tuple(varying(x, qi, k, v, *keys, seg_i, ord_i) for x in init)
        (m, l, acc), _ = jax.lax.scan(key_block, init, (k_blocks, v_blocks) + keys)
        seen = l > 0                                   # padded query rows see nothing
        out = acc / jnp.swapaxes(jnp.where(seen, l, 1.0), 1, 2)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)   # inf: p = 0 in the backward
        return None, (out.astype(v.dtype), lse, m.max(axis=(0, 2)))

    _, (out, lse, row_max) = jax.lax.scan(query_block, None, (_blocks(q, qb, 0), q_seg, q_ord))
    return _unblock(out, tq), lse, row_max.max(0)


def _backward(q, k, v, mask: AttentionMask, out, lse, d_out, scale: float, q_block: int, k_block: int):
    """(dq, dk, dv) of the attention output's cotangent d_out [batch, q, heads, dv]."""
    (b, tq, h, dk), (tk, dv) = q.shape, (k.shape[1], v.shape[-1])
    qb, kb = _block_sizes(q, k, q_block, k_block)
    (q_seg, q_ord), keys = _mask_blocks(mask, qb, kb)
    k_blocks, v_blocks = _blocks(k, kb, 0), _blocks(v, kb, 0)
    nk = k_blocks.shape[0]
    # D_i = sum_d dO_i * O_i: the softmax backward's row term, [nq, b, h, qb].
    delta = jnp.swapaxes(_blocks(jnp.sum(d_out.astype(F32) * out.astype(F32), -1), qb, 0), 2, 3)
    dt = q.dtype

    def query_block(carry, xs):
        qi, do_i, lse_i, delta_i, seg_i, ord_i = xs

        def key_block(carry, ys):
            dq_i, dk_acc, dv_acc = carry
            j, kj, vj, seg_j, ord_j, open_j = ys
            vis = AttentionMask(seg_i, ord_i, seg_j, ord_j, open_j).visible()

            def grads(_):
                p = jnp.where(vis[:, None], jnp.exp(_scores(qi, kj, vis, scale) - lse_i[..., None]), 0.0)
                dv_j = jnp.einsum("bhqk,bqhd->bkhd", p.astype(dt), do_i, preferred_element_type=F32)
                dp = jnp.einsum("bqhd,bkhd->bhqk", do_i, vj, preferred_element_type=F32)
                ds = (p * (dp - delta_i[..., None]) * scale).astype(dt)
                return (jnp.einsum("bhqk,bkhd->bqhd", ds, kj, preferred_element_type=F32),
                        jnp.einsum("bhqk,bqhd->bkhd", ds, qi, preferred_element_type=F32), dv_j)

            def skip(_):
                zeros = (jnp.zeros((b, qb, h, dk), F32), jnp.zeros((b, kb, h, dk), F32), jnp.zeros((b, kb, h, dv), F32))
                return tuple(varying(z, qi, do_i, lse_i, kj, vj, vis) for z in zeros)

            dq_j, dk_j, dv_j = jax.lax.cond(vis.any(), grads, skip, None)
            return (dq_i + dq_j, dk_acc.at[j].add(dk_j), dv_acc.at[j].add(dv_j)), None

        dk_acc, dv_acc = carry
        dq_init = varying(jnp.zeros((b, qb, h, dk), F32), qi, do_i, k, v)
        (dq_i, dk_acc, dv_acc), _ = jax.lax.scan(
            key_block, (dq_init, dk_acc, dv_acc),
            (jnp.arange(nk), k_blocks, v_blocks) + keys)
        return (dk_acc, dv_acc), dq_i

    zeros = tuple(varying(jnp.zeros((nk, b, kb, h, d), F32), q, k, v, d_out) for d in (dk, dv))
    (dk_acc, dv_acc), dq = jax.lax.scan(
        query_block, zeros, (_blocks(q, qb, 0), _blocks(d_out.astype(dt), qb, 0), lse, delta, q_seg, q_ord))
    return (_unblock(dq, tq).astype(q.dtype), _unblock(dk_acc, tk).astype(k.dtype),
            _unblock(dv_acc, tk).astype(v.dtype))


def blockwise_attention(q, k, v, mask: AttentionMask, scale: float, q_block: int | None = None,
                        k_block: int | None = None):
    """q: [batch, q, heads, dk]; k: [batch, k, heads, dk]; v: [batch, k, heads, dv]; mask: which keys each
    query sees (every query must see at least one key); block sizes default to Q_BLOCK and K_BLOCK.
    Returns (out [batch, q, heads, dv] in v's dtype, max_logits f32[heads]: each head's largest
    `scale * q.k` over visible pairs, without gradient)."""
    return _attention(q, k, v, _tied_to(mask, q), scale, q_block or Q_BLOCK, k_block or K_BLOCK)


def _tied_to(mask: AttentionMask, x: jax.Array) -> AttentionMask:
    """`mask` made to depend on `x` (an optimization barrier, free at run time). Under a `lax.scan` over
    layers the mask is loop-invariant, and differentiating the scan hoists everything computed from
    loop-invariant values alone out of the loop: the per-block visibility and masked-score arrays of
    every (query block, key block) pair, [nq, nk, batch, heads, qb, kb] -- quadratic in the sequence.
    Tied to the layer's queries, the mask is no longer invariant and the blocks stay inside the loop."""
    return jax.lax.optimization_barrier((mask, x))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, mask: AttentionMask, scale: float, q_block: int, k_block: int):
    out, _, max_logits = _forward(q, k, v, mask, scale, q_block, k_block)
    return out, max_logits


def _fwd(q, k, v, mask, scale, q_block, k_block):
    out, lse, max_logits = _forward(q, k, v, mask, scale, q_block, k_block)
    return (out, max_logits), (q, k, v, mask, out, lse)


def _bwd(scale, q_block, k_block, residuals, cotangents):
    q, k, v, mask, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, mask, out, lse, cotangents[0], scale, q_block, k_block)
    return dq, dk, dv, jax.tree.map(lambda _: None, mask)


_attention.defvjp(_fwd, _bwd)


def blockwise_max_logits(q, k, mask: AttentionMask, scale: float, q_block: int | None = None,
                         k_block: int | None = None) -> jax.Array:
    """f32[heads]: each head's largest `scale * q.k` over visible pairs, block by block (logits only:
    for kernels that do not report it), without gradient. Shapes as `blockwise_attention`."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    mask = _tied_to(mask, q)
    (b, _, h, _) = q.shape
    qb, kb = _block_sizes(q, k, q_block or Q_BLOCK, k_block or K_BLOCK)
    (q_seg, q_ord), keys = _mask_blocks(mask, qb, kb)
    k_blocks = _blocks(k, kb, 0)

    def query_block(_, xs):
        qi, seg_i, ord_i = xs

        def key_block(m, ys):
            kj, seg_j, ord_j, open_j = ys
            vis = AttentionMask(seg_i, ord_i, seg_j, ord_j, open_j).visible()
            return jax.lax.cond(vis.any(), lambda m: jnp.maximum(m, _scores(qi, kj, vis, scale).max(axis=(0, 2, 3))),
                                lambda m: m, m), None

        m, _ = jax.lax.scan(key_block, varying(jnp.full((h,), MASKED), qi, k, *keys, seg_i), (k_blocks,) + keys)
        return None, m

    _, m = jax.lax.scan(query_block, None, (_blocks(q, qb, 0), q_seg, q_ord))
    return m.max(0)
