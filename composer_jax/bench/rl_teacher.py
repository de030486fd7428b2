"""The RL step's teacher share: the FLOPs that flagged turns add to the fused RL step (the targeted
feedback self-distillation teacher), from XLA's cost analysis of the step with flagged turns (one per
row, or `slots` per row) minus the same step with none. The reference is the naive teacher
(`teacher_context='full'`: the whole hinted trajectory run again) on the same batch."""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from flax import nnx

from composer_jax import CausalLM
from composer_jax.bench.shapes import forward_shapes
from composer_jax.bench.timing import flops_of, unrolled_loops
from composer_jax.config import ModelConfig, replace
from composer_jax.rl import RLConfig, RLStep, RolloutBatch, teacher_slot

TAIL, HINT, ROWS = 8, 4, 2   # tool-output tokens after each turn, hint tokens per flagged turn, rows per batch


def rollout_length(prefix: int, turn: int, tail: int, slots: int) -> int:
    """Tokens of one `rollout_batch` row."""
    return prefix + slots * (turn + tail)


def section_model(base: ModelConfig, prefix: int, turn: int, slots: tuple, tail: int = TAIL) -> ModelConfig:
    """`base` with rope positions for the longest rollout `teacher_section` builds (max(slots) turns)."""
    longest = rollout_length(prefix, turn, tail, max((1, *slots)))
    return replace(base, **{"rope.max_position_embeddings": longest})


def rollout_batch(model: ModelConfig, rows: int, prefix: int, turn: int, tail: int, hint: int | None,
                  slots: int = 1) -> RolloutBatch:
    """`rows` trajectories: `prefix` context tokens, then `slots` times a model turn of `turn` tokens and
    a `tail`-token tool output; with `hint` (tokens), each turn is flagged with a hint of that length."""
    seq = rollout_length(prefix, turn, tail, slots)
    starts = [prefix + k * (turn + tail) for k in range(slots)]
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (rows, seq)).astype(np.int32)
    generated = np.zeros((rows, seq), bool)
    for start in starts:
        generated[:, start:start + turn] = True
    batch = RolloutBatch(tokens, np.tile(np.arange(seq, dtype=np.int32), (rows, 1)), np.ones((rows, seq), np.int32),
                         generated, np.where(generated, -1.0, 0.0).astype(np.float32),
                         np.arange(rows, dtype=np.float32), np.zeros(rows, np.int32))
    if hint is None:
        return batch
    windows = [[teacher_slot(tokens[r], generated[r], start, np.arange(hint), hint + turn) for start in starts]
               for r in range(rows)]
    return batch._replace(teacher_tokens=np.asarray([[w[0] for w in row] for row in windows]),
                          teacher_map=np.asarray([[w[1] for w in row] for row in windows]))


def step_and_batch(model: ModelConfig, rows: int, prefix: int, turn: int, tail: int, hint: int | None,
                   context: str, slots: int) -> tuple[RLStep, RolloutBatch]:
    """(the RL step on abstract weights, `rollout_batch(model, rows, prefix, turn, tail, hint, slots)`
    validated against it): what `_lowered_step` lowers and `section_shapes` checks."""
    batch = rollout_batch(model, rows, prefix, turn, tail, hint, slots)
    cfg = RLConfig(group_size=rows, teacher_context=context, mtp_distill_weight=0.0)   # the teacher's cost alone
    rl_step = RLStep(nnx.eval_shape(lambda: CausalLM(model, rngs=nnx.Rngs(0))), cfg)
    rl_step.validate(batch)
    return rl_step, batch


@functools.lru_cache(maxsize=32)
def _lowered_step(model: ModelConfig, rows: int, prefix: int, turn: int, tail: int, hint: int | None, context: str,
                  unroll: bool, slots: int):
    """The RL step (shape-only state) lowered for `rollout_batch(model, rows, prefix, turn, tail, hint,
    slots)`; cached: tracing the step takes seconds, and a batch without a flagged turn is the same
    program whatever `context` is (pass "prefix" for it)."""
    rl_step, batch = step_and_batch(model, rows, prefix, turn, tail, hint, context, slots)
    state = jax.eval_shape(lambda: rl_step.init_state(CausalLM(model, rngs=nnx.Rngs(0))))
    with unrolled_loops() if unroll else contextlib.nullcontext():   # a fresh RLStep: a fresh trace
        return rl_step.jitted.lower(state, batch)


@functools.lru_cache(maxsize=8)
def _compiled_flops(*key) -> float:
    return flops_of(_lowered_step(*key).compile())


def step_flops(model: ModelConfig, rows: int, prefix: int, turn: int, tail: int, hint: int | None, context: str,
               stage: str, unroll: bool = False, slots: int = 1) -> float:
    """FLOPs of the RL step on `rollout_batch(model, rows, prefix, turn, tail, hint, slots)` from the
    'lowered' or 'compiled' program's cost analysis; `unroll`: every loop counted per iteration (else a
    loop body counts once)."""
    key = (model, rows, prefix, turn, tail, hint, context if hint is not None else "prefix", unroll, slots)
    return _compiled_flops(*key) if stage == "compiled" else flops_of(_lowered_step(*key))


def teacher_flops(model: ModelConfig, prefix: int, turn: int, context: str = "prefix", stage: str = "compiled",
                  rows: int = ROWS, hint: int = HINT, tail: int = TAIL, unroll: bool = False,
                  slots: int = 1) -> tuple[float, float]:
    """(FLOPs the flagged turns add to the step, that as a share of the flagged step's FLOPs)."""
    flagged = step_flops(model, rows, prefix, turn, tail, hint, context, stage, unroll, slots)
    plain = step_flops(model, rows, prefix, turn, tail, None, context, stage, unroll, slots)
    return flagged - plain, (flagged - plain) / flagged


def section_cases(slots: tuple) -> list[tuple[str, int]]:
    """(teacher context, flagged turns per row) of every comparison `teacher_section` makes."""
    return [("prefix", 1), ("full", 1)] + [("prefix", k) for k in slots]


def section_shapes(base: ModelConfig, prefix: int, turn: int, slots: tuple, rows: int = ROWS) -> None:
    """The flagged batch of each case `teacher_section(base, prefix, turn, slots, rows)` lowers,
    validated against its RL step, and the model's forward over its tokens traced (shapes only: the
    whole step traces for seconds per case; the unflagged batch has the same tokens)."""
    model = section_model(base, prefix, turn, slots)
    for context, k in section_cases(slots):
        _, batch = step_and_batch(model, rows, prefix, turn, TAIL, HINT, context, k)
        forward_shapes(model, *batch.tokens.shape)


def teacher_section(base: ModelConfig, prefix: int, turn: int, slots: tuple = (2, 4), rows: int = ROWS) -> dict:
    """Our teacher (hint + turn over the student's latents) against the naive one, loops counted per
    iteration, from the lowered programs (the compiled ones agree within 10%: tests/test_rl_flops.py), on
    `base` with positions for the longest rollout (`section_model`).
    `per_slot_over_one`: with each of `slots` flagged turns per row, our teacher's FLOPs per flagged turn
    over those with one (1.0: the cost is proportional to the hinted windows)."""
    model = section_model(base, prefix, turn, slots)
    added = {case: teacher_flops(model, prefix, turn, case[0], "lowered", rows, unroll=True, slots=case[1])
             for case in section_cases(slots)}
    out = {"prefix_tokens": prefix, "turn_tokens": turn, "rows": rows, "positions": model.rope.max_position_embeddings}
    for context in ("prefix", "full"):
        flops, share = added[(context, 1)]
        out[context] = {"teacher_flops": flops, "share_of_step": share}
    out["naive_over_ours"] = out["full"]["teacher_flops"] / out["prefix"]["teacher_flops"]
    out["per_slot_over_one"] = {str(k): added[("prefix", k)][0] / (k * out["prefix"]["teacher_flops"]) for k in slots}
    return out
