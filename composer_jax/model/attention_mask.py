"""Which keys each query may see, kept in O(queries + keys) form.

A query sees a key when the key is *open* (a valid slot of a latent prefix: every query sees it), or
when both belong to the same packed document (segment id) and the key comes no later in the original
sequence (order: the token's index before any context-parallel reordering). Attention
implementations build the boolean mask per block from these vectors (`visible` on slices), so no
[batch, q, k] mask exists outside a block; the dense form is for the reference attention and decode.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The order of a key no query reaches causally: prefix slots (open or hidden) and padded key slots.
NEVER = jnp.iinfo(jnp.int32).max


class AttentionMask(NamedTuple):
    """q_segment, q_order: int32[batch, q]; k_segment, k_order: int32[batch, k]; k_open: bool[batch, k]
    (keys every query sees) or None when there are none. Under context parallelism the query vectors
    are this device's (sharded like the queries), the key vectors the whole sequence's."""

    q_segment: jax.Array
    q_order: jax.Array
    k_segment: jax.Array
    k_order: jax.Array
    k_open: jax.Array | None = None

    def visible(self) -> jax.Array:
        """bool[batch, q, k]: the dense mask (of a whole mask, or of block slices of one)."""
        seen = ((self.q_segment[:, :, None] == self.k_segment[:, None, :])
                & (self.k_order[:, None, :] <= self.q_order[:, :, None]))
        return seen if self.k_open is None else seen | self.k_open[:, None, :]

    def with_prefix(self, valid: jax.Array) -> "AttentionMask":
        """This mask with `valid.shape[1]` prefix key columns first, open where `valid` bool[batch, prefix]
        (hidden elsewhere: their order is NEVER), laid out like the key vectors."""
        sharding = jax.typeof(self.k_segment).sharding
        if not sharding.mesh.empty:
            valid = jax.sharding.reshard(valid, sharding.spec)
        open_ = jnp.zeros_like(self.k_segment, bool) if self.k_open is None else self.k_open
        join = lambda prefix, keys: jnp.concatenate([prefix, keys], axis=1)  # noqa: E731
        return self._replace(k_segment=join(jnp.zeros_like(valid, jnp.int32), self.k_segment),
                             k_order=join(jnp.full_like(valid, NEVER, jnp.int32), self.k_order),
                             k_open=join(valid, open_))


def causal_mask(segment_q: jax.Array, order_q: jax.Array, segment_k: jax.Array, order_k: jax.Array) -> AttentionMask:
    """Causal attention within packed documents: int[batch, q] query and int[batch, k] key vectors."""
    i32 = jnp.int32
    return AttentionMask(segment_q.astype(i32), order_q.astype(i32), segment_k.astype(i32), order_k.astype(i32))
