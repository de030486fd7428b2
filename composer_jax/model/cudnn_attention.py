"""cuDNN's fused flash attention (NVIDIA GPUs) for MLA training and prefill.

The public `jax.nn.dot_product_attention` needs equal query and value head dims (MLA has 192 vs 128)
and takes packed documents only as a dense mask, which cuDNN turns into an O(T^2) bias. JAX's own
cuDNN entry point (`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, private: the same
signature on jax 0.10.2 and 0.11.2) takes different head dims and packed documents natively: each
row's documents are given as segment start offsets and lengths (cuDNN's THD layout) with a causal mask
inside each segment (shared/reference/performance.md section 1).

Preconditions, checked by `unsupported` for the device the program is built for (the mesh's, which
a deviceless compile gives from a GPU topology while the process runs on CPU): an NVIDIA GPU of compute capability >= 9.0 (packed layout and
MLA head dims), cuDNN >= 9.10, bf16 or fp16 inputs, head dims <= 256 and multiples of 8, self-attention
over the sequence in its natural order: no latent prefix and no context-parallel chunk order.
Documents are the runs of equal segment ids (a packed row's documents are contiguous).

cuDNN does not report the largest logit; QK-clip's per-head statistic comes from a separate
logits-only pass (`blockwise_max_logits`: the QK^T half of the forward's FLOPs, no backward, skipped
blocks as in blockwise attention). Nothing in training reads it unless QK-clip is on, and XLA drops
the pass when its result is unused.

JAX's entry point checks the compute capability of the process's own GPU backend while tracing; a
deviceless compile for a GPU topology has none, so `building_for(device)` answers those checks for the
target device while a program is traced (`plan.gpu_compile`; tests/test_gpu_compile.py compiles it).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

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
    if _cudnn is None:
        return "this jax has no cuDNN attention entry point"
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


@contextlib.contextmanager
def building_for(device):
    """While programs are traced inside, JAX's cuDNN entry point checks compute capabilities against
    `device` (a GPU topology's device) instead of the process's own GPU backend. Not thread-safe: one
    deviceless build at a time."""
    if _cudnn is None or device.platform != "gpu":
        yield
        return
    saved = _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal
    _cudnn.check_compute_capability = lambda c: _capability(device) >= _version(c)
    _cudnn.is_cuda_compute_capability_equal = lambda c: _capability(device) == _version(c)
    try:
        yield
    finally:
        _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal = saved


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


def attention(q, k, v, mask: AttentionMask, scale: float):
    """q: [batch, seq, heads, dk]; k: [batch, seq, heads, dk]; v: [batch, seq, heads, dv]; mask: causal
    within the documents of `mask.q_segment` (natural order, no prefix). Returns (out [batch, seq,
    heads, dv], max_logits f32[heads])."""
    lengths, offsets = segment_runs(mask.q_segment)
    out = _cudnn.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                       kv_offsets=offsets, scale=scale, mask_type=_cudnn.MaskType.PADDING_CAUSAL,
                                       qkv_layout="BTNH")
    return out, blockwise_max_logits(q, k, mask, scale)
