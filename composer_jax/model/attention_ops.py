"""Attention implementations behind one call, chosen by `model.attention`.

    reference   the dense form: f32 [batch, heads, q, k] scores and the [batch, q, k] mask materialised
                (the oracle the others are tested against; fastest for short sequences)
    blockwise   online softmax over key blocks with a recomputing custom VJP (`model.blockwise`): memory
                linear in the sequence, runs anywhere; the mask comes per block from `AttentionMask`
    cudnn       cuDNN's fused flash attention on NVIDIA GPUs (`model.cudnn_attention`): bf16, packed
                documents, causal; no latent prefix, no context-parallel order (those take blockwise)
    auto        cudnn where it applies on a GPU, else reference up to `REFERENCE_MAX_KEYS` keys on CPU
                and blockwise beyond (measured: tools/bench_attention.py)

Every implementation takes q [batch, q, heads, dk], k [batch, k, heads, dk], v [batch, k, heads, dv]
and an `AttentionMask`, and returns (out [batch, q, heads, dv], max_logits f32[heads]: each head's
largest scaled logit over visible pairs, for QK-clip, without gradient). On a DualMesh the kernels run
per device under `shard_map`: each device holds its batch rows and its queries (a context-parallel
shard) and every key of its rows; the max logits are reduced over the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.model import cudnn_attention
from composer_jax.model.attention_mask import AttentionMask
from composer_jax.model.blockwise import MASKED, blockwise_attention, varying
from composer_jax.parallel.mesh import DualMesh

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn")
REFERENCE_MAX_KEYS = 1024   # auto off GPU: the dense reference up to this many keys, blockwise beyond


def masked_softmax(scores: jax.Array, visible: jax.Array, scale: float, dtype) -> tuple[jax.Array, jax.Array]:
    """scores: f32[batch, heads, q, k] unscaled; visible: bool[batch, q, k] -> (probs in `dtype`, each
    head's largest scaled visible logit f32[heads], without gradient)."""
    scores = jnp.where(visible[:, None], scores * scale, MASKED)
    max_logits = jax.lax.stop_gradient(scores.max(axis=(0, 2, 3)))
    return jax.nn.softmax(scores, axis=-1).astype(dtype), max_logits


def reference_attention(q, k, v, mask: AttentionMask, scale: float):
    """The dense attention (global view: runs on sharded arrays as they are)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs, max_logits = masked_softmax(scores, mask.visible(), scale, v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v), max_logits


def choose(name: str, q: jax.Array, v: jax.Array, mask: AttentionMask, cp: int, device=None) -> str:
    """The implementation `name` ('auto' or one of IMPLEMENTATIONS) runs as, for these shapes on `device`
    (the mesh's; default the process's first device). An explicit 'cudnn' where it cannot run raises
    ValueError naming `model.attention`."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention={name!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    unsupported = cudnn_attention.unsupported(q, v, prefix=mask.k_open is not None, cp=cp, device=device)
    if name == "cudnn" and unsupported:
        raise ValueError(f"model.attention='cudnn' cannot run here: {unsupported}; use 'auto' (cuDNN where it "
                         "applies, blockwise elsewhere) or 'blockwise'")
    if name != "auto":
        return name
    if not unsupported:
        return "cudnn"
    return "reference" if mask.k_order.shape[1] <= REFERENCE_MAX_KEYS else "blockwise"


def attention(name: str, q, k, v, mask: AttentionMask, scale: float, dual: DualMesh | None = None):
    """Attention by implementation `name` (see the module docstring); `dual`: the layout the arrays
    live on (None: unsharded). Returns (out [batch, q, heads, dv], max_logits f32[heads])."""
    cp = dual.cp if dual is not None else 1
    chosen = choose(name, q, v, mask, cp, None if dual is None else dual.dense.devices.flat[0])
    if chosen == "reference":
        return reference_attention(q, k, v, mask, scale)
    kernel = blockwise_attention if chosen == "blockwise" else cudnn_attention.attention
    if dual is None:
        return kernel(q, k, v, mask, scale)
    return _per_device(kernel, dual, q, k, v, mask, scale)


def _per_device(kernel, dual: DualMesh, q, k, v, mask: AttentionMask, scale: float):
    """`kernel` under shard_map on the dense mesh: batch rows and queries as q is placed, keys whole."""
    spec = jax.typeof(q).sharding.spec
    batch, queries = (tuple(spec) + (None, None))[:2]
    q_spec, kv_spec = P(batch, queries, None, None), P(batch, None, None, None)
    q_vec, k_vec = P(batch, queries), P(batch, None)
    mask_specs = AttentionMask(q_vec, q_vec, k_vec, k_vec, None if mask.k_open is None else k_vec)
    place = lambda x, s: None if x is None else jax.sharding.reshard(x, s)  # noqa: E731
    q, k, v = place(q, q_spec), place(k, kv_spec), place(v, kv_spec)
    mask = AttentionMask(*map(place, mask, mask_specs))
    axes = dual.dense.axis_names

    def local(q, k, v, mask):
        # Keys are whole on every context-parallel shard, and each shard's gradient of them is partial:
        # typed varying like the queries, their cotangents are summed over the shards on the way out.
        k, v = varying(k, q), varying(v, q)
        mask = AttentionMask(*(None if x is None else varying(x, q) for x in mask))
        out, max_logits = kernel(q, k, v, mask, scale)
        return out, jax.lax.pmax(jax.lax.stop_gradient(max_logits), axes)

    return jax.shard_map(local, mesh=dual.dense, in_specs=(q_spec, kv_spec, kv_spec, mask_specs),
                         out_specs=(q_spec, P()))(q, k, v, mask)
