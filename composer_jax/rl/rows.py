"""Per-row gathers along the sequence of [rows, seq, ...] arrays, sharding-safe: each device works on
the rows it holds (the indices follow the rows' sharding), so nothing crosses devices but the
sequence gather under context parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.partitioning import copy_per_row_shard, gather_sequence, merge_row_shards, split_by_row_shard


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """out[n, j] = x[n, idx[n, j]]: x [rows, seq, ...], idx int[rows, m] (clipped into range). Each
    device gathers within its own rows (the indices follow x's row sharding)."""
    x = gather_sequence(x)
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


def chunked(fn, chunk: int, *xs: jax.Array, heads: tuple[jax.Array, ...] = ()):
    """fn over [rows, seq, ...] arrays `chunk` positions at a time, each chunk rematerialised in the
    backward pass: only one [rows, chunk, vocab] block of logits exists at once. fn returns a tuple of
    [rows, chunk] arrays; returns them as [rows, seq].

    heads: whole arrays every chunk uses (output heads [embed, vocab]), passed to fn first. Each row shard
    uses its own copy (`copy_per_row_shard`), so a head's gradient adds up over the chunks on the shard's
    devices and is reduced across shards once, after the loop: not gathered and all-reduced per chunk."""
    rows, seq = xs[0].shape[:2]
    chunk = min(chunk, seq)
    n = -(-seq // chunk)

    def split(x):  # [rows, seq, ...] -> [n, rows, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, n * chunk - seq)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(rows, n, chunk, *x.shape[2:]), 1, 0)

    copies = tuple(copy_per_row_shard(head, xs[0]) for head in heads)
    per_shard = jax.vmap(jax.checkpoint(fn))

    def one(args):  # one chunk, [rows, chunk, ...] each; by shard: [shards, rows / shards, chunk, ...]
        outs = per_shard(*copies, *(split_by_row_shard(a, xs[0]) for a in args))
        return tuple(merge_row_shards(o) for o in outs)

    outs = jax.lax.map(one, tuple(split(x) for x in xs))
    return tuple(jnp.moveaxis(o, 0, 1).reshape(rows, n * chunk)[:, :seq] for o in outs)
