"""MoE dispatch on the expert mesh of a DualMesh: `shard_map` over all expert-mesh axes.

Tokens arrive sharded on the dense mesh's token axes and cross to the expert mesh with a
collective-free `reshard` (same devices, same order). Inside the `shard_map` each device holds its
token shard and its slice of the experts (`experts / ep`, embed dim / efsdp):

- `dense`, `ragged`: the expert weights are all-gathered and every device runs the local backend on
  its own tokens (the replicated-experts reference).
  (Under the inference placement the experts' embed dim is whole: nothing to gather.)
- `ep_a2a`: each device packs its token copies into a fixed-capacity buffer per destination `ep` rank,
  `all_to_all`s them to the devices owning their experts, runs the grouped matmuls (`dispatch.grouped_swiglu`) on what it received, and
  `all_to_all`s the results back.
- `ep_ragged`: the same exchange with `jax.lax.ragged_all_to_all`: exact-size sends, one receive
  buffer per device. XLA:CPU does not implement it: GPU/TPU only, checked by tools/device_check.sh.

Drop policy (`moe.capacity_factor` = c; `dispatch_rows` gives the buffer sizes, which the memory
planner reports). A device with T local tokens and top-k routing sends T*k expert assignments and, on
average, receives as many. With c > 0 its buffers hold about c*T*k rows, whatever `ep` is:
- `ep_a2a`: ceil(c*T*k/ep) slots per (source, destination) pair; a source's copies beyond them are
  dropped, the latest tokens first.
- `ep_ragged`: ceil(c*T*k) receive rows; when more is sent to a device, every source's block to it is
  cut by the same fraction (rounded down), the latest tokens of each block first.
c = 0 sizes the buffers for the worst case, where nothing can drop: a token's k copies reach one rank
at most min(k, experts per rank) times, so ep*T*min(k, experts per rank) rows (ep_a2a: in each of
its send and receive buffers); at Kimi K2.5 scale (ep=64, k=8, 6 experts per rank) that is 48x the
assignments. A dropped copy contributes nothing to its token's output (as if its combine weight were
0); drops are counted and reported (`dropped`, summed over the mesh). Inference (decode, prefill) is
always dropless: its per-step token counts are small and a drop would change the sampled tokens.

Returns per device the combined output, and (summed over the mesh) the per-expert load and the
number of dropped assignments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.model import dispatch
from composer_jax.model.dispatch import ExpertWeights
from composer_jax.parallel.mesh import EXPERT_AXES, EXPERT_TOKEN_AXES, DualMesh
from composer_jax.parallel.partitioning import expert_dispatch_specs


def _gather_efsdp(w: ExpertWeights) -> ExpertWeights:
    """Inside shard_map: whole embed dims of the local experts (expert FSDP)."""
    gather = lambda x, axis: jax.lax.all_gather(x, "efsdp", axis=axis, tiled=True)  # noqa: E731
    return ExpertWeights(gather(w.gate, 1), gather(w.up, 1), gather(w.down, 2))


def _expert_ffn(x: jax.Array, local_expert: jax.Array, w: ExpertWeights) -> jax.Array:
    """SwiGLU of rows `x` [rows, embed] through local experts `local_expert` int[rows]; an id equal to
    the number of local experts marks an empty slot (output 0)."""
    num_local = w.gate.shape[0]
    order = jnp.argsort(local_expert, stable=True)
    sizes = jnp.bincount(local_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
    out = dispatch.grouped_swiglu(jnp.take(x, order, axis=0), sizes, w)   # rows past the groups: empty slots, 0
    return jnp.zeros_like(out).at[order].set(out)


def capacity(tokens: int, k: int, num_local: int, ep: int, factor: float) -> int:
    """ep_a2a slots per (source, destination) device pair for `tokens` local tokens with top-`k` routing:
    `factor` times the even share tokens*k/ep, or (factor 0) the `tokens * min(k, num_local)` slots
    that can never drop (a token picks k distinct experts, at most min(k, num_local) on one rank)."""
    dropless = tokens * min(k, num_local)
    if factor <= 0:
        return dropless
    return max(1, min(dropless, math.ceil(factor * tokens * k / ep)))


def receive_rows(tokens: int, k: int, num_local: int, ep: int, factor: float) -> int:
    """ep_ragged receive-buffer rows per device: `factor` times the expected tokens*k, or (factor 0) the
    worst case ep * tokens * min(k, num_local) (every source sends all it can to this device)."""
    dropless = ep * tokens * min(k, num_local)
    if factor <= 0:
        return dropless
    return max(1, min(dropless, math.ceil(factor * tokens * k)))


def dispatch_rows(kind: str, tokens: int, k: int, num_local: int, ep: int, factor: float) -> dict[str, int]:
    """Rows of the per-device exchange buffers of an expert-parallel backend (each row an embed-wide
    vector in the compute dtype): {'send': ..., 'receive': ...}; the experts' FFN runs over the
    received rows. Empty for the replicated-experts backends."""
    if kind == "ep_a2a":
        rows = ep * capacity(tokens, k, num_local, ep, factor)
        return {"send": rows, "receive": rows}
    if kind == "ep_ragged":
        return {"send": tokens * k, "receive": receive_rows(tokens, k, num_local, ep, factor)}
    return {}


def _a2a_local(x, weights, idx, w: ExpertWeights, ep: int, factor: float):
    """ep_a2a on one device. x: [T, embed]; weights: f32[T, k]; idx: int32[T, k] (global expert ids)."""
    tokens, k = idx.shape
    num_local = w.gate.shape[0]
    slots = capacity(tokens, k, num_local, ep, factor)
    flat = idx.reshape(-1)
    dest, local_expert = flat // num_local, flat % num_local
    # Rank of each assignment among those going to the same destination, in token order.
    rank = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0) - 1,
                               dest[:, None], axis=1)[:, 0]
    keep = rank < slots
    slot = jnp.where(keep, dest * slots + rank, ep * slots)  # dropped copies go to a scratch row
    source = jnp.arange(flat.size) // k
    send_x = jnp.zeros((ep * slots + 1, x.shape[1]), x.dtype).at[slot].set(jnp.take(x, source, axis=0))
    send_e = jnp.full((ep * slots + 1,), num_local, jnp.int32).at[slot].set(local_expert)
    a2a = lambda a: jax.lax.all_to_all(a, "ep", 0, 0, tiled=True)  # noqa: E731  block j <-> rank j
    recv_x, recv_e = a2a(send_x[:-1]), a2a(send_e[:-1])
    out = a2a(_expert_ffn(recv_x, recv_e, w))                     # results back at their send slots
    out = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
    contrib = jnp.take(out, slot, axis=0).astype(jnp.float32) * (weights.reshape(-1) * keep)[:, None]
    y = jnp.zeros((tokens, x.shape[1]), jnp.float32).at[source].add(contrib)
    return y.astype(x.dtype), jnp.sum(~keep)


def _kept_blocks(sizes: jax.Array, rows: int) -> jax.Array:
    """int32[src, dst]: how much of each block `sizes` [src, dst] fits in `rows` receive rows per
    destination: all of it when the column fits, else every block cut by the same fraction (rounded
    down; float math, then clamped so that a column never exceeds `rows`)."""
    total = sizes.sum(axis=0, keepdims=True)
    scale = jnp.minimum(1.0, rows / jnp.maximum(total, 1).astype(jnp.float32))
    kept = jnp.floor(sizes.astype(jnp.float32) * scale).astype(jnp.int32)
    before = jnp.cumsum(kept, axis=0) - kept
    return jnp.clip(jnp.minimum(kept, rows - before), 0, None)


def _ragged_a2a_local(x, weights, idx, w: ExpertWeights, ep: int, factor: float):
    """ep_ragged on one device: exact-size sends with ragged_all_to_all (GPU/TPU), `receive_rows` rows
    received (see the module docstring for what drops)."""
    tokens, k = idx.shape
    num_local = w.gate.shape[0]
    flat = idx.reshape(-1)
    dest = flat // num_local
    order = jnp.argsort(dest, stable=True)          # by destination rank, token order within a block
    send_sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    rows = receive_rows(tokens, k, num_local, ep, factor)
    kept = _kept_blocks(jax.lax.all_gather(send_sizes, "ep"), rows)   # [src, dst], the same everywhere
    me = jax.lax.axis_index("ep")
    sent, recv_sizes = kept[me], kept[:, me]
    # output_offsets[j]: where my block lands in rank j's receive buffer (sources in rank order).
    output_offsets = (jnp.cumsum(kept, axis=0) - kept)[me]
    source = order // k
    send_x = jnp.take(x, source, axis=0)
    send_e = jnp.take(flat % num_local, order)
    exchange = lambda a, fill: jax.lax.ragged_all_to_all(  # noqa: E731
        a, jnp.full((rows,) + a.shape[1:], fill, a.dtype), input_offsets, sent, output_offsets, recv_sizes,
        axis_name="ep")
    recv_x, recv_e = exchange(send_x, 0), exchange(send_e, num_local)
    out = _expert_ffn(recv_x, recv_e, w)
    # Send results back: the reverse exchange swaps the roles of the sizes and offsets; the dropped
    # tail of each block gets nothing back (zeros).
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    back_offsets = jax.lax.all_to_all(input_offsets, "ep", 0, 0, tiled=True)  # my block's place at each source
    back = jax.lax.ragged_all_to_all(out, jnp.zeros((tokens * k,) + out.shape[1:], out.dtype), recv_offsets,
                                     recv_sizes, back_offsets, sent, axis_name="ep")
    contrib = back.astype(jnp.float32) * jnp.take(weights.reshape(-1), order)[:, None]
    y = jnp.zeros((tokens, x.shape[1]), jnp.float32).at[source].add(contrib)
    return y.astype(x.dtype), jnp.sum(send_sizes - sent)


def sharded_dispatch(kind: str, dual: DualMesh, x, weights, idx, experts: ExpertWeights, factor: float):
    """Dispatch on the expert mesh. x: [tokens, embed], weights: f32[tokens, k], idx: int32[tokens, k],
    all sharded on the dense token axes; experts on the expert mesh; factor: the capacity factor of
    the expert-parallel backends (module docstring; 0 = dropless).

    Returns y [tokens, embed] (dense token sharding), load f32[experts] and dropped int32[] (replicated).
    """
    num_experts = experts.gate.shape[0]
    ep = dual.sizes["ep"]
    specs = expert_dispatch_specs(dual)
    embed_split = specs[0][1] is not None

    def local(x, weights, idx, gate, up, down):
        w = ExpertWeights(gate, up, down)
        w = _gather_efsdp(w) if embed_split else w
        if kind == "ep_a2a":
            y, dropped = _a2a_local(x, weights, idx, w, ep, factor)
        elif kind == "ep_ragged":
            y, dropped = _ragged_a2a_local(x, weights, idx, w, ep, factor)
        else:
            gather = lambda a: jax.lax.all_gather(a, "ep", axis=0, tiled=True)  # noqa: E731
            y = dispatch.BACKENDS[kind](x, weights, idx, ExpertWeights(*map(gather, w)))
            dropped = jnp.zeros((), jnp.int32)
        load = jax.lax.psum(jnp.bincount(idx.reshape(-1), length=num_experts).astype(jnp.float32), EXPERT_AXES)
        return y, load, jax.lax.psum(dropped.astype(jnp.int32), EXPERT_AXES)

    tokens_spec = P(EXPERT_TOKEN_AXES, None)
    with dual.expert_scope():
        args = [dual.to_expert(a) for a in (x, weights, idx)]
        args += [jax.sharding.reshard(w, NamedSharding(dual.expert, s)) for w, s in zip(experts, specs)]
        y, load, dropped = jax.shard_map(
            local, mesh=dual.expert, in_specs=(tokens_spec,) * 3 + specs,
            out_specs=(tokens_spec, P(), P()))(*args)
        replicated = lambda a: jax.sharding.reshard(a, NamedSharding(dual.dense, P()))  # noqa: E731
        return dual.to_dense(y), replicated(load), replicated(dropped)
