"""INT4 routed experts, as Kimi K2.5 ships them (compressed-tensors' symmetric groups of 32 inputs:
scale = max |w| / 7.5 rounded to bfloat16, q = clip(round(w / scale), -8, 7)), in two forms:

- `fake_quant_int4` (`model.moe.expert_quant: int4` in training): each expert matrix passes through the
  quantizer and back in every forward, so training, RL and decoding run the policy an INT4 engine
  serves. The gradient passes straight through (the straight-through estimator of quantization-aware
  training): d(fake_quant(w))/dw = identity.
- `Int4Matrix` (what an INT4 engine holds, `quantize_int4_matrix`): the packed nibbles and the scales,
  dequantized by `dequantize` where a matmul reads them (`model.dispatch` dequantizes only the experts
  a decode step uses).

Both are `checkpoint.quant.quantize_int4` written in jnp with the same float32 operations: the values are
bit for bit those of a checkpoint quantized and read back (`dequant_int4`), and the packed words those
`quantize_int4` writes, transposed to this model's [in, out] layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import INT4_GROUP, INT4_MAX_ABS
from composer_jax.parallel import leafwise

NIBBLES = 8    # 4-bit values per int32 word, along the inputs, low nibble first


def _spec(x):
    """(`x`'s explicit sharding, its PartitionSpec padded to `x`'s rank), or None where it carries none."""
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty:
        return None
    return sharding, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def _split_sharding(x: jax.Array, axis: int, groups: int):
    """The out_sharding of `x` reshaped with dimension `axis` split in (groups, rest): the groups keep
    the dimension's mesh axes where each shard holds whole groups, else the dimension is gathered (None
    where `x` carries no explicit sharding)."""
    found = _spec(x)
    if found is None:
        return None
    sharding, spec = found
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],) if spec[axis] else ()
    shards = math.prod(sharding.mesh.shape[name] for name in names)
    return P(*spec[:axis], spec[axis] if groups % shards == 0 else None, None, *spec[axis + 1:])


def _merged_sharding(x: jax.Array, axis: int, count: int):
    """The out_sharding of `x` with dimensions axis..axis+count-1 merged into one (the first keeps its
    mesh axes; the others are unsharded)."""
    found = _spec(x)
    return None if found is None else P(*found[1][:axis + 1], *found[1][axis + count:])


def _quantize(w: jax.Array, group: int):
    """w: [..., in, out] -> (q f32[..., in/group, group, out] in [-8, 7], scale f32[..., in/group, 1, out])."""
    axis, n = w.ndim - 2, w.shape[-2]
    if n % group:
        raise ValueError(f"INT4 expert quantization: {n} inputs are not a multiple of the group size {group}")
    split = w.shape[:axis] + (n // group, group) + w.shape[axis + 1:]
    grouped = jnp.reshape(w.astype(jnp.float32), split, out_sharding=_split_sharding(w, axis, n // group))
    amax = jnp.max(jnp.abs(grouped), axis=axis + 1, keepdims=True)
    scale = jnp.maximum(amax / jnp.float32(INT4_MAX_ABS), jnp.finfo(jnp.float32).eps)
    scale = scale.astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.clip(jnp.round(grouped / scale), -8, 7), scale


def fake_quant_int4(w: jax.Array, group: int = INT4_GROUP) -> jax.Array:
    """w: [..., in, out] (an expert matrix, inputs on the second-to-last axis) -> the same shape and dtype:
    INT4-quantized in groups of `group` inputs and dequantized (float32 math); straight-through gradient."""
    q, scale = _quantize(w, group)
    quantized = jnp.reshape(q * scale, w.shape, out_sharding=jax.typeof(w).sharding).astype(w.dtype)
    # quantized + (w - w): the quantized values exactly, and the gradient of w.
    return jax.lax.stop_gradient(quantized) + (w - jax.lax.stop_gradient(w))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("packed", "scale"),
                   meta_fields=("source_dtype", "dtype"))
@dataclasses.dataclass(frozen=True)
class Int4Matrix:
    """An expert matrix (or a stack of them) [..., in, out] stored as INT4: K2.5's `weight_packed` and
    `weight_scale`, transposed to this model's [in, out] layout.

    packed: int32[..., in/8, out], inputs 8j..8j+7 of each output in word j, low nibble first, each the
        nibble q + 8; scale: bfloat16[..., in/group, out]. `dequantize` gives q * scale rounded to
        `source_dtype` (the quantized matrix's dtype, so the values equal `fake_quant_int4`'s), then cast
        to `dtype` (the compute dtype; the MoE sets it).
    """

    packed: jax.Array
    scale: jax.Array
    source_dtype: str = "float32"
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's logical shape [..., in, out]."""
        return (*self.packed.shape[:-2], self.packed.shape[-2] * NIBBLES, self.packed.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes


def quantize_int4_matrix(w: jax.Array, group: int = INT4_GROUP) -> Int4Matrix:
    """w: [..., in, out] -> its Int4Matrix (placed like `w`: the inputs' axis keeps its mesh axes where
    each shard holds whole groups)."""
    q, scale = _quantize(w, group)       # [..., groups, group, out], [..., groups, 1, out]
    axis = w.ndim - 2
    words_per_group = group // NIBBLES
    nibbles = (q + 8).astype(jnp.uint32)
    nibbles = jnp.reshape(nibbles, (*q.shape[:axis + 1], words_per_group, NIBBLES, q.shape[-1]),
                          out_sharding=_split_sharding(q, axis + 1, words_per_group))
    shifts = (jnp.arange(NIBBLES, dtype=jnp.uint32) * 4)[:, None]
    words = jnp.sum(nibbles << shifts, axis=axis + 2, dtype=jnp.uint32)        # [..., groups, words, out]
    packed = jnp.reshape(jax.lax.bitcast_convert_type(words, jnp.int32), (*w.shape[:axis], -1, w.shape[-1]),
                         out_sharding=_merged_sharding(words, axis, 2))
    dtype = np.dtype(w.dtype).name
    return Int4Matrix(packed, jnp.squeeze(scale, axis + 1).astype(jnp.bfloat16), dtype, dtype)


_quantize_jit = jax.jit(quantize_int4_matrix)


def quantize_experts(pairs, paths: frozenset) -> nnx.State:
    """Parameters as (path, Variable) pairs (`nnx.to_flat_state`; a generator is consumed one pair at a
    time) -> an nnx.State with the expert stacks at `paths` (`moe.routed_expert_paths`) as Int4Matrix,
    each quantized where it lives (on its own mesh) and one after another. Abstract parameters
    (ShapeDtypeStructs) give the Int4Matrix's ShapeDtypeStructs, placed as quantizing would place them."""

    def quantized(w):
        with leafwise.on_mesh(leafwise.mesh_of(w)):
            if not isinstance(w, jax.ShapeDtypeStruct):
                return _quantize_jit(w)
            out = jax.eval_shape(_quantize_jit, w)
        mesh = getattr(w.sharding, "mesh", None)
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=w.sharding if mesh is None
                                                           else NamedSharding(mesh, o.sharding.spec)), out)

    return nnx.from_flat_state([(path, var.replace(quantized(var.get_value())) if path in paths else var)
                                for path, var in pairs])


def dequantize(m: Int4Matrix) -> jax.Array:
    """The matrix [..., in, out] in `m.dtype`: (nibble - 8) * scale in float32, rounded to `m.source_dtype`."""
    axis, groups = m.packed.ndim - 2, m.scale.shape[-2]
    words = jax.lax.bitcast_convert_type(m.packed, jnp.uint32)
    words = jnp.reshape(words, (*words.shape[:axis], groups, -1, words.shape[-1]),
                        out_sharding=_split_sharding(words, axis, groups))          # [..., groups, words, out]
    shifts = (jnp.arange(NIBBLES, dtype=jnp.uint32) * 4)[:, None]
    nibbles = (words[..., None, :] >> shifts) & 0xF                                  # [..., groups, words, 8, out]
    values = (nibbles.astype(jnp.float32) - 8.0) * m.scale.astype(jnp.float32)[..., None, None, :]
    w = jnp.reshape(values, m.shape, out_sharding=_merged_sharding(values, axis, 3))
    return w.astype(m.source_dtype).astype(m.dtype)


def dense_matrix(m) -> jax.Array:
    """An expert matrix as an array: an Int4Matrix dequantized, an array as it is."""
    return dequantize(m) if isinstance(m, Int4Matrix) else m


def leading(m, i):
    """Entry `i` (an int or a traced int32[]) of the leading axis of an array or an Int4Matrix."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                        if isinstance(i, jax.Array) else a[i], m)


def entries(m) -> tuple:
    """The entries of the leading axis of an array or an Int4Matrix, as a tuple."""
    return tuple(leading(m, i) for i in range(m.shape[0]))
