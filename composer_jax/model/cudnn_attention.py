"""cuDNN's fused flash attention (NVIDIA GPUs) for MLA training and prefill.

The public `jax.nn.dot_product_attention` needs equal query and value head dims (MLA has 192 vs 128)
and takes packed documents only as a dense mask, which cuDNN turns into an O(T^2) bias. JAX's own
cuDNN attention (`jax._src.cudnn.fused_attention_stablehlo`, private) takes different head dims and
packed documents natively: each row's documents are given as segment start offsets and lengths
(cuDNN's THD layout) with a causal mask inside each segment (shared/reference/performance.md section 1).

Preconditions, checked by `unsupported` for the device the program is built for (the mesh's, which
a deviceless compile gives from a GPU topology while the process runs on CPU): an NVIDIA GPU of
compute capability >= 9.0 (packed layout and MLA head dims), cuDNN >= 9.10, bf16 or fp16 inputs, head
dims <= 256 and multiples of 8, self-attention over the sequence in its natural order: no latent
prefix and no context-parallel chunk order. Documents are the runs of equal segment ids (a packed
row's documents are contiguous).

Why not JAX's `dot_product_attention` itself: its primitives lower through `custom_partitioning`, so
JAX registers them as needing devices while lowering, and then refuses any program that also holds
arrays of a second mesh ("mesh should be the same across the entire program", jax/_src/interpreters/
pxla.py). The dual grid's training step always holds both (dense and expert weights). Here the kernel
runs per device (under the dense mesh's shard_map, or unsharded), where custom_partitioning only
inlines JAX's per-device implementation anyway; so `_FORWARD` and `_BACKWARD` are primitives of our
own with JAX's shape rules and that same per-device implementation as their lowering, and no
partitioning, and `_packed_causal` wires them as JAX's custom VJP does (the forward's softmax
statistics kept for the backward). They check nothing against the process's own backend, so a
deviceless compile for a GPU topology builds them (tests/test_gpu_compile.py compiles them on the dual
grid; tests/test_attention.py checks the numbers on a GPU).

cuDNN does not report the largest logit; QK-clip's per-head statistic comes from a separate
logits-only pass (`blockwise_max_logits`: the QK^T half of the forward's FLOPs, no backward, skipped
blocks as in blockwise attention). Nothing in training reads it unless QK-clip is on, and XLA drops
the pass when its result is unused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from composer_jax.model.attention_mask import AttentionMask
from composer_jax.model.blockwise import blockwise_max_logits

try:  # private API: guarded so that a jax without it still imports this module
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - depends on the installed jax
    _cudnn = None

MIN_CUDNN = 91000          # cuDNN 9.10: query and value head dims may differ (MLA)
MIN_CAPABILITY = "9.0"     # Hopper: packed layout and MLA head dims


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _capability(device) -> tuple[int, ...]:
    return _version(getattr(device, "compute_capability", "0.0"))


def unsupported(q: jax.Array, v: jax.Array, *, prefix: bool, cp: int, device=None) -> str:
    """Why cuDNN attention cannot run on q [batch, q, heads, dk], v [batch, k, heads, dv] on `device`
    (default: the process's first device) ('' when it can)."""
    if _FORWARD is None or _BACKWARD is None:
        return "this jax has no cuDNN attention kernel (jax._src.cudnn.fused_attention_stablehlo)"
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return f"it needs an NVIDIA GPU (the devices are {device.platform})"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 activations (model.dtype), got {q.dtype}"
    dk, dv = q.shape[-1], v.shape[-1]
    if max(dk, dv) > 256 or dk % 8 or dv % 8:
        return f"head dims must be multiples of 8 up to 256, got query/key {dk} and value {dv}"
    if prefix:
        return "a latent prefix (chunked prefill, the RL teacher) is not a packed self-attention"
    if cp > 1:
        return f"context parallelism (cp={cp}) reorders the sequence"
    try:
        version = _cudnn.check_cudnn_version()
    except RuntimeError as e:
        return str(e)
    if version < MIN_CUDNN:
        return f"it needs cuDNN >= 9.10, found {version}"
    if _capability(device) < _version(MIN_CAPABILITY):
        return f"it needs compute capability >= {MIN_CAPABILITY}, {device.device_kind} has {device.compute_capability}"
    return ""


def segment_runs(segments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's documents (runs of equal ids in segments int[batch, seq]) as cuDNN's packed layout:
    (lengths int32[batch, seq], start offsets int32[batch, seq + 1]), runs first, padded with -1."""
    batch, seq = segments.shape
    index = jnp.arange(seq, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    first = jnp.sort(jnp.where(starts, index[None], seq), axis=1)          # run starts, then `seq`
    following = jnp.concatenate([first[:, 1:], jnp.full((batch, 1), seq, jnp.int32)], axis=1)
    real = first < seq
    lengths = jnp.where(real, following - first, -1)
    offsets = jnp.concatenate([jnp.where(real, first, -1), jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    return lengths.astype(jnp.int32), offsets.astype(jnp.int32)


def _primitive(name: str, kind: str) -> Primitive | None:
    """A primitive with JAX's shape rule for the cuDNN attention `kind` ('fwd' or 'bwd') that lowers
    (CUDA only) to JAX's per-device implementation, without custom_partitioning (the module docstring
    says why). None when this jax has no such rule."""
    abstract = getattr(_cudnn, f"_dot_product_attention_{kind}_abstract", None)
    per_device = getattr(_cudnn, f"_dot_product_attention_{kind}_impl", None)
    if abstract is None or per_device is None:
        return None
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract)
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))
    mlir.register_lowering(prim, mlir.lower_fun(per_device, multiple_results=True), platform="cuda")
    return prim


_FORWARD = _primitive("composer_cudnn_attention_fwd", "fwd")
_BACKWARD = _primitive("composer_cudnn_attention_bwd", "bwd")


def _params() -> dict:
    """The kernel's static parameters: causal within packed segments, [batch, seq, heads, dim], no dropout."""
    return {"seed": 42, "dropout_rate": 0.0, "variadic_args": (False, False), "mask_type": _cudnn.MaskType.PADDING_CAUSAL,
            "layout": _cudnn.AttentionLayout.BTNH.value, "sliding_window_length": None}


def _forward(q, k, v, lengths, offsets, scale: float, training: bool):
    none = jnp.zeros(0, q.dtype)   # no bias, no page tables
    return _FORWARD.bind(q, k, v, none, lengths, lengths, offsets, offsets, none, none, scale=scale,
                         is_training=training, **_params())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _packed_causal(q, k, v, lengths, offsets, scale: float):
    """cuDNN attention, causal within the documents given by lengths int32[batch, seq] and offsets
    int32[batch, seq + 1] (`segment_runs`). q, k: [batch, seq, heads, dk]; v: [batch, seq, heads, dv].
    Returns out [batch, seq, heads, dv]."""
    return _forward(q, k, v, lengths, offsets, scale, False)[0]


def _packed_causal_fwd(q, k, v, lengths, offsets, scale: float):
    out, stats = _forward(q, k, v, lengths, offsets, scale, True)
    return out, (q, k, v, lengths, offsets, stats, out)


def _packed_causal_bwd(scale: float, residuals, d_out):
    q, k, v, lengths, offsets, stats, out = residuals
    none = jnp.zeros(0, q.dtype)
    dq, dk, dv = _BACKWARD.bind(q, k, v, none, lengths, lengths, offsets, offsets, none, none, stats, out, d_out,
                                scale=scale, **_params())
    return dq, dk, dv, None, None


_packed_causal.defvjp(_packed_causal_fwd, _packed_causal_bwd)


def attention(q, k, v, mask: AttentionMask, scale: float):
    """q: [batch, seq, heads, dk]; k: [batch, seq, heads, dk]; v: [batch, seq, heads, dv]; mask: causal
    within the documents of `mask.q_segment` (natural order, no prefix). Per device: unsharded or inside
    a shard_map. Returns (out [batch, seq, heads, dv], max_logits f32[heads])."""
    lengths, offsets = segment_runs(mask.q_segment)
    return _packed_causal(q, k, v, lengths, offsets, scale), blockwise_max_logits(q, k, mask, scale)
