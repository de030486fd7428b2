"""Attention implementations side by side: compiled memory of the training step against sequence
length, training-step time, and one attention call's forward + backward per key length. The dense
`reference` is the baseline every ratio is taken against; `cudnn` joins where it can run (bf16 on an
NVIDIA GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.bench.timing import interleaved, medians
from composer_jax.bench.train_step import one_device, run_config, steps_side_by_side, train_step_shapes
from composer_jax.config import ModelConfig
from composer_jax.model import attention_ops, cudnn_attention
from composer_jax.model.attention_mask import causal_mask
from composer_jax.train import step as step_lib

PORTABLE = ("reference", "blockwise")


def implementations(dtype) -> tuple[str, ...]:
    """The implementations that run here for activations of `dtype`: cuDNN joins on a GPU in bf16."""
    probe = jnp.zeros((1, 8, 1, 64), dtype)
    return PORTABLE + (() if cudnn_attention.unsupported(probe, probe, prefix=False, cp=1) else ("cudnn",))


def temp_bytes(model: ModelConfig, seq: int, attention: str, remat: str = "none") -> int:
    """Compiled temporary bytes of the one-device training step, batch 1."""
    cfg = run_config(model, 1, seq, remat, attention=attention)
    return int(step_lib.lower_train_step(cfg, one_device()).compile().memory_analysis().temp_size_in_bytes)


def memory_section(model: ModelConfig, lengths, remat_length: int | None = None) -> dict:
    """Training-step temp bytes per length and implementation, with the growth between consecutive
    lengths (2 = linear, 4 = quadratic); with `remat_length`, blockwise under each remat policy."""
    rows = [{"seq": seq, **{impl: temp_bytes(model, seq, impl) for impl in PORTABLE}} for seq in lengths]
    for impl in PORTABLE:
        for before, after in zip(rows, rows[1:]):
            after[f"{impl}_growth"] = after[impl] / before[impl]
    out = {"train_step_temp_bytes": rows}
    if remat_length:
        out["remat_temp_bytes"] = {"seq": remat_length, **{policy: temp_bytes(model, remat_length, "blockwise", policy)
                                                           for policy in ("none", "dots", "full")}}
    return out


def step_time_section(model: ModelConfig, lengths, repeats: int) -> list[dict]:
    """Median seconds of the one-device training step (batch 1) per length and implementation."""
    rows = []
    for seq in lengths:
        cfgs = {impl: run_config(model, 1, seq, attention=impl) for impl in implementations(model.dtype)}
        row = {"seq": seq, **{f"{impl}_s": s for impl, s in medians(steps_side_by_side(cfgs, repeats)).items()}}
        for impl in cfgs:
            row[f"{impl}_over_reference"] = row[f"{impl}_s"] / row["reference_s"]
        rows.append(row)
    return rows


def memory_shapes(model: ModelConfig, lengths) -> None:
    """`train_step_shapes` of every training step `memory_section(model, lengths)` compiles."""
    for seq in lengths:
        for impl in PORTABLE:
            train_step_shapes(model, 1, seq, attention=impl)


def kernel_inputs(seq: int, heads: int, dk: int, dv: int, dtype, rng=None):
    """(q [1, seq, heads, dk], k, v [1, seq, heads, dv], mask): random from `rng`, two packed
    documents; with `rng` None, their ShapeDtypeStructs."""
    def mask():
        order = jnp.arange(seq, dtype=jnp.int32)[None]
        segments = (order >= seq // 3).astype(jnp.int32)
        return causal_mask(segments, order, segments, order)

    shapes = ((1, seq, heads, dk), (1, seq, heads, dk), (1, seq, heads, dv))
    if rng is None:
        return (*(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes), jax.eval_shape(mask))
    return (*(jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes), mask())


def kernel_grad(impl: str, scale: float):
    """The timed program: (q, k, v, mask) -> gradients of sum(attention ** 2) by `impl`."""
    def loss(q, k, v, mask):
        out = attention_ops.attention(impl, q, k, v, mask, scale)[0]
        return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def kernel_shapes(lengths, shapes: dict, dtype=jnp.float32) -> None:
    """Trace (shapes only) every program `kernel_section(lengths, shapes, ..., dtype)` times."""
    for heads, dk, dv in shapes.values():
        for seq in lengths:
            args = kernel_inputs(seq, heads, dk, dv, dtype)
            for impl in implementations(dtype):
                jax.eval_shape(kernel_grad(impl, dk ** -0.5), *args)


def kernel_section(lengths, shapes: dict, repeats: int, dtype=jnp.float32) -> list[dict]:
    """Median seconds of one attention call's forward + backward (batch 1, two packed documents) per
    head shape {name: (heads, dk, dv)}, key length and implementation."""
    rows = []
    rng = np.random.default_rng(1)
    impls = implementations(dtype)
    for name, (heads, dk, dv) in shapes.items():
        for seq in lengths:
            args = kernel_inputs(seq, heads, dk, dv, dtype, rng)
            fns = {impl: functools.partial(kernel_grad(impl, dk ** -0.5), *args) for impl in impls}
            row = {"shape": name, "heads": heads, "dk": dk, "dv": dv, "seq": seq, "dtype": jnp.dtype(dtype).name,
                   **{f"{impl}_s": s for impl, s in medians(interleaved(fns, repeats)).items()}}
            for impl in impls:
                row[f"{impl}_over_reference"] = row[f"{impl}_s"] / row["reference_s"]
            rows.append(row)
    return rows
