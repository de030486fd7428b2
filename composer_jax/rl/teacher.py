"""The self-distillation teacher: the same parameters under stop-gradient, seeing a short hint inserted
before each flagged turn (composer_jax/rl/batch.py documents the feedback windows).

`teacher_context="prefix"` runs one forward over the feedback windows (hint + turn tokens) attending to
the student's MLA latents of the row before the turn: its cost scales with the windows, not with the
trajectories. `"full"` runs the naive teacher over [row before the turn + hint + turn], the reference
the prefix path is tested against.

The prediction of window slot j's token is the teacher's hidden state at slot j-1; for j = 0 (an empty
hint) it is the hidden state of the last prefix token, which does not see the hint: the prefix path
takes it from the student (under stop-gradient; the same as the teacher's when the teacher is the live
policy), the full path from its own forward (a fixed teacher's differs: rl.sd_teacher=initial).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.model import CausalLM
from composer_jax.model.attention import LatentCache
from composer_jax.parallel.partitioning import activation_spec, gather_sequence
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.rows import repeat_rows, take_rows

sg = jax.lax.stop_gradient


class Feedback(NamedTuple):
    """The feedback windows flattened to rows n = b * K + k (all [N, T] unless noted)."""

    tokens: jax.Array      # int32: hint + turn tokens + padding
    map: jax.Array         # int32: student position of each turn slot, -1 elsewhere
    start: jax.Array       # int32[N]: where the hint is inserted (first turn position); 1 when unused
    length: jax.Array      # int32[N]: hint + turn tokens (0 when unused)
    positions: jax.Array   # int32: rope positions continuing after the prefix


def feedback_rows(batch: RolloutBatch) -> Feedback:
    b, k, t = batch.teacher_tokens.shape
    tokens = batch.teacher_tokens.reshape(b * k, t).astype(jnp.int32)
    tmap = batch.teacher_map.reshape(b * k, t).astype(jnp.int32)
    mapped = tmap >= 0
    slot = jnp.arange(t, dtype=jnp.int32)
    first = jnp.argmax(mapped, axis=-1)
    start = jnp.where(mapped.any(-1), jnp.take_along_axis(tmap, first[:, None], axis=-1)[:, 0], 1)
    length = jnp.max(jnp.where(mapped, slot + 1, 0), axis=-1)
    last_prefix_pos = take_rows(repeat_rows(batch.positions, k, 0), (start - 1)[:, None])
    return Feedback(tokens, tmap, start, length, last_prefix_pos + 1 + slot[None])


def _on_batch_axes(model: CausalLM, x: jax.Array, axis: int) -> jax.Array:
    """x with dimension `axis` on the dense mesh's batch axes (as the model's activations), the rest
    whole; a no-op for an unsharded model. The model concatenates the prefix with its activations."""
    if model.mesh is None:
        return x
    names = [None] * x.ndim
    names[axis] = "batch"
    return jax.sharding.reshard(x, activation_spec(*names))


def _teacher_prefix(teacher: CausalLM, fb: Feedback, student_latents: LatentCache, k: int) -> jax.Array:
    """Teacher hidden [N, T, embed] over the windows, attending to the student's latents of [0, start)."""
    c_kv, k_rope = (_on_batch_axes(teacher, sg(repeat_rows(x, k, 1)), 1)
                    for x in (student_latents.c_kv, student_latents.k_rope))
    seq = c_kv.shape[2]
    valid = _on_batch_axes(teacher, repeat_rows(student_latents.valid, k, 0)
                           & (jnp.arange(seq)[None] < fb.start[:, None]), 0)
    segments = (jnp.arange(fb.tokens.shape[1])[None] < fb.length[:, None]).astype(jnp.int32)
    out = teacher.forward(fb.tokens, segments, fb.positions, with_mtp=False,
                          prefix=LatentCache(c_kv, k_rope, valid))
    return out.hidden


def _teacher_full(teacher: CausalLM, fb: Feedback, batch: RolloutBatch, k: int) -> jax.Array:
    """The naive teacher: a forward over [row before the turn + hint + turn] per window; returns its
    hidden states predicting the window slots [N, T, embed] (slot j's from position start + j - 1)."""
    (n, window), seq = fb.tokens.shape, batch.tokens.shape[1]
    col = jnp.broadcast_to(jnp.arange(seq + window, dtype=jnp.int32)[None], (n, seq + window))
    in_prefix, rel = col < fb.start[:, None], col - fb.start[:, None]
    tokens = jnp.where(in_prefix, take_rows(repeat_rows(batch.tokens, k, 0), col), take_rows(fb.tokens, rel))
    tokens = jnp.where(rel < window, tokens, 0)
    positions = jnp.where(in_prefix, take_rows(repeat_rows(batch.positions, k, 0), col), take_rows(fb.positions, rel))
    segments = (rel < fb.length[:, None]).astype(jnp.int32)
    hidden = teacher.forward(tokens.astype(jnp.int32), segments, positions, with_mtp=False).hidden
    return take_rows(hidden, fb.start[:, None] - 1 + jnp.arange(window)[None])


def teacher_predictions(teacher: CausalLM, student_hidden: jax.Array, student_latents, fb: Feedback,
                        batch: RolloutBatch, context: str) -> jax.Array:
    """The teacher hidden state predicting each window slot's token, [N, T, embed], no gradient."""
    k = batch.teacher_tokens.shape[1]
    if context == "full":
        return sg(gather_sequence(_teacher_full(teacher, fb, batch, k)))
    hidden = gather_sequence(_teacher_prefix(teacher, fb, student_latents, k))
    last_prefix = take_rows(repeat_rows(student_hidden, k, 0), (fb.start - 1)[:, None])      # [N, 1, embed]
    return sg(jnp.concatenate([last_prefix.astype(hidden.dtype), hidden[:, :-1]], axis=1))
