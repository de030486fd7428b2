"""The rollout batch of one RL step and its host-side validation.

A row is one trajectory: the prompt, the model's turns and the tool / environment outputs between
them, right-padded. Arrays per token are aligned with the token they describe.

Targeted feedback: each row has K feedback slots (K static; a slot is unused when its map is all -1).
A used slot (b, k) holds the teacher's *window* for one flagged turn of row b: the hint tokens, then
that turn's tokens, then padding. The teacher sees the student's own row before the turn (the prefix,
which the step takes from the student's forward pass) followed by this window, so its cost scales with
the window, not with the trajectory:

    student row b:   [ prompt ... tool output | y_s  y_s+1 ... y_e-1 | tool output ... ]
    teacher window:  [ h_0 ... h_H-1  y_s  y_s+1 ... y_e-1  pad ... ]       (after the prefix [0, s))
    teacher_map:     [ -1  ...  -1    s    s+1  ...  e-1    -1  ... ]

`teacher_map[b, k, j]` is the student position of the turn token in window slot j (-1 for hint and
padding). Slots per row (not a flat list of flagged turns with row indices) keep every flagged turn on
the device that holds its trajectory, so gathering the prefix needs no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class BatchError(ValueError):
    """A rollout batch is malformed; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"rollout batch field '{field}': {message}")


class RolloutBatch(NamedTuple):
    """B trajectories of S token slots, G samples per prompt, K feedback slots of T tokens per row."""

    tokens: np.ndarray               # int32[B, S]: prompt, model turns, tool outputs; 0 in padding
    positions: np.ndarray            # int32[B, S]: rope positions
    segment_ids: np.ndarray          # int32[B, S]: one id > 0 on the trajectory, 0 on right padding
    generated: np.ndarray            # bool[B, S]: tokens the policy sampled (the only ones with a gradient)
    behaviour_logprobs: np.ndarray   # f32[B, S]: sampler log pi_behaviour(token); read where `generated`
    rewards: np.ndarray              # f32[B]: composed scalar reward per trajectory
    group_ids: np.ndarray            # int32[B]: prompt group; each group has exactly group_size rows
    ref_logprobs: np.ndarray | None = None    # f32[B, S]: reference policy log-probs (needed when kl_coef > 0)
    teacher_tokens: np.ndarray | None = None  # int32[B, K, T]: hint + flagged turn tokens + padding
    teacher_map: np.ndarray | None = None     # int32[B, K, T]: student position of each turn slot, else -1


def turn_end(generated: np.ndarray, start: int) -> int:
    """The end (exclusive) of the model turn containing `start`: the run of generated tokens.
    generated: bool[S]."""
    end = start
    while end < len(generated) and generated[end]:
        end += 1
    return end


def teacher_slot(tokens: np.ndarray, generated: np.ndarray, start: int, hint: Sequence[int], window: int,
                 end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One feedback slot for the turn of row `tokens` (int[S]) starting at `start`: the hint inserted
    before it. `end` (exclusive) defaults to the end of the turn. Returns (teacher_tokens int32[window],
    teacher_map int32[window])."""
    end = turn_end(generated, start) if end is None else end
    hint = np.asarray(hint, np.int32).reshape(-1)
    need = len(hint) + end - start
    if end <= start:
        raise BatchError("teacher_map", f"no generated token at position {start}: a flagged turn starts on one")
    if need > window:
        raise BatchError("teacher_tokens", f"hint ({len(hint)}) + turn ({end - start}) = {need} tokens exceed "
                                           f"the window of {window}")
    slot_tokens = np.zeros(window, np.int32)
    slot_map = np.full(window, -1, np.int32)
    slot_tokens[:need] = np.concatenate([hint, np.asarray(tokens[start:end], np.int32)])
    slot_map[len(hint):need] = np.arange(start, end)
    return slot_tokens, slot_map


def empty_feedback(batch: int, slots: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(teacher_tokens, teacher_map) with every slot unused: int32[batch, slots, window] each."""
    return np.zeros((batch, slots, window), np.int32), np.full((batch, slots, window), -1, np.int32)


# ------------------------------------------------------------------------------------------------
# Validation (host side, before anything is traced or compiled)


def _array(batch: RolloutBatch, field: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    x = np.asarray(getattr(batch, field))
    if x.shape != shape:
        raise BatchError(field, f"shape {list(x.shape)} does not match {list(shape)} (from tokens [B, S] and, "
                                "for the teacher, teacher_tokens [B, K, T])")
    ok = {"int": np.issubdtype(x.dtype, np.integer), "bool": x.dtype == bool or np.issubdtype(x.dtype, np.integer),
          "float": np.issubdtype(x.dtype, np.floating)}[kind]
    if not ok:
        raise BatchError(field, f"dtype {x.dtype} is not {kind}")
    return x


def _first_bad(bad: np.ndarray) -> str:
    where = np.argwhere(bad)
    return f"at index {[int(i) for i in where[0]]} ({len(where)} in total)"


def _check_logprobs(field: str, logp: np.ndarray, generated: np.ndarray) -> None:
    bad = generated & ~np.isfinite(logp)
    if bad.any():
        raise BatchError(field, f"non-finite log-probability on a generated token {_first_bad(bad)}")
    bad = generated & (logp > 1e-3)
    if bad.any():
        raise BatchError(field, f"log-probability > 0 on a generated token {_first_bad(bad)}")


def validate_batch(batch: RolloutBatch, *, group_size: int, vocab_size: int, need_ref: bool = False) -> None:
    """Raise BatchError naming the first malformed field. Pure numpy: call it before the jitted step."""
    tokens = np.asarray(batch.tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise BatchError("tokens", f"must be int[B, S], got {tokens.dtype}{list(tokens.shape)}")
    b, s = tokens.shape
    if b == 0 or s < 2:
        raise BatchError("tokens", f"needs at least one row of >= 2 tokens, got shape {[b, s]}")
    positions = _array(batch, "positions", "int", (b, s))
    segments = _array(batch, "segment_ids", "int", (b, s))
    generated = _array(batch, "generated", "bool", (b, s)).astype(bool)
    behaviour = _array(batch, "behaviour_logprobs", "float", (b, s))
    rewards = _array(batch, "rewards", "float", (b,))
    groups = _array(batch, "group_ids", "int", (b,))

    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        raise BatchError("tokens", f"id outside [0, vocab_size={vocab_size}) {_first_bad(bad)}")
    if (positions < 0).any():
        raise BatchError("positions", f"negative position {_first_bad(positions < 0)}")
    real = segments > 0
    if (segments < 0).any():
        raise BatchError("segment_ids", f"negative id {_first_bad(segments < 0)}")
    if (~real[:, 0]).any() or (real[:, 1:] & ~real[:, :-1]).any():
        raise BatchError("segment_ids", "each row must be one trajectory starting at slot 0: ids > 0, then only "
                                        "0 (right padding)")
    second = real & (segments != segments[:, :1])
    if second.any():
        raise BatchError("segment_ids", f"one trajectory per row: a second id {_first_bad(second)}")
    if generated[:, 0].any():
        raise BatchError("generated", "slot 0 cannot be generated (it has no context to score it from)")
    if (generated & ~real).any():
        raise BatchError("generated", f"marks a padding slot {_first_bad(generated & ~real)}")
    _check_logprobs("behaviour_logprobs", behaviour, generated)
    if not np.isfinite(rewards).all():
        raise BatchError("rewards", f"non-finite reward {_first_bad(~np.isfinite(rewards))}")
    if b % group_size:
        raise BatchError("group_ids", f"{b} rows are not a whole number of groups of group_size={group_size}")
    ids, counts = np.unique(groups, return_counts=True)
    if (counts != group_size).any():
        i = int(np.argmax(counts != group_size))
        raise BatchError("group_ids", f"group {int(ids[i])} has {int(counts[i])} members; every group must be "
                                      f"full (group_size={group_size})")
    if batch.ref_logprobs is not None:
        _check_logprobs("ref_logprobs", _array(batch, "ref_logprobs", "float", (b, s)), generated)
    elif need_ref:
        raise BatchError("ref_logprobs", "required when kl_coef > 0")
    if (batch.teacher_tokens is None) != (batch.teacher_map is None):
        raise BatchError("teacher_map", "teacher_tokens and teacher_map come together (both or neither)")
    if batch.teacher_tokens is not None:
        _validate_feedback(batch, tokens, generated, vocab_size)


def _validate_feedback(batch: RolloutBatch, tokens: np.ndarray, generated: np.ndarray, vocab_size: int) -> None:
    t_tokens = np.asarray(batch.teacher_tokens)
    b, s = tokens.shape
    if t_tokens.ndim != 3 or t_tokens.shape[0] != b or 0 in t_tokens.shape:
        raise BatchError("teacher_tokens", f"must be int[B={b}, K, T] with K, T >= 1, got {list(t_tokens.shape)}")
    t_tokens = _array(batch, "teacher_tokens", "int", t_tokens.shape)
    t_map = _array(batch, "teacher_map", "int", t_tokens.shape)
    bad = (t_tokens < 0) | (t_tokens >= vocab_size)
    if bad.any():
        raise BatchError("teacher_tokens", f"id outside [0, vocab_size={vocab_size}) {_first_bad(bad)}")
    if ((t_map < -1) | (t_map >= s)).any():
        raise BatchError("teacher_map", f"entry outside [-1, S={s}) {_first_bad((t_map < -1) | (t_map >= s))}")
    for row, slot in zip(*np.nonzero((t_map >= 0).any(-1))):
        where = f"slot [{row}, {slot}]"
        m = t_map[row, slot]
        idx = np.flatnonzero(m >= 0)
        start = int(m[idx[0]])
        if (np.diff(idx) != 1).any() or (m[idx] != start + np.arange(len(idx))).any():
            raise BatchError("teacher_map", f"{where}: the turn's slots must be contiguous after the hint and map to "
                                            f"consecutive student positions, got {m[idx].tolist()}")
        end, last = turn_end(generated[row], start), int(m[idx[-1]])
        if start == end:
            raise BatchError("teacher_map", f"{where}: the turn's first token maps to position {start} of row {row}, "
                                            "which the policy did not generate: outside the flagged turn")
        if last >= end:
            raise BatchError("teacher_map", f"{where}: maps to student positions {start}..{last}, outside the "
                                            f"flagged turn (generated tokens {start}..{end - 1} of row {row})")
        if (t_tokens[row, slot, idx] != tokens[row, m[idx]]).any():
            raise BatchError("teacher_tokens", f"{where}: the turn's tokens differ from the student's at the mapped "
                                               "positions")


def synthetic_batch(seed: int, *, batch: int, seq: int, vocab_size: int, group_size: int, slots: int = 0,
                    window: int = 0, hint_len: int = 2, with_ref: bool = False) -> RolloutBatch:
    """A random, valid multi-turn rollout batch (for tests, demos and benchmarks).

    Each row: a prompt, then model turns alternating with tool outputs, then right padding; behaviour
    (and reference) log-probs are random negatives; binary rewards; groups of consecutive rows. With
    `slots` > 0 every row flags its first model turns that fit `window` with a random `hint_len`-token
    hint (fewer if the row has fewer turns; the rest of the slots stay unused).
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (batch, seq)).astype(np.int32)
    segments = np.zeros((batch, seq), np.int32)
    generated = np.zeros((batch, seq), bool)
    for row in range(batch):
        length = int(rng.integers(3 * seq // 4, seq + 1))
        segments[row, :length] = 1
        pos, model_turn = int(rng.integers(2, max(3, seq // 4))), True
        while pos < length:
            span = int(rng.integers(2, max(3, seq // 6)))
            generated[row, pos:min(pos + span, length)] = model_turn
            pos, model_turn = pos + span, not model_turn
    tokens[segments == 0] = 0
    positions = np.where(segments > 0, np.arange(seq)[None], 0).astype(np.int32)
    logp = lambda: np.where(generated, -rng.exponential(1.0, (batch, seq)), 0.0).astype(np.float32)
    out = RolloutBatch(tokens, positions, segments, generated, logp(),
                       rng.integers(0, 2, batch).astype(np.float32), (np.arange(batch) // group_size).astype(np.int32),
                       logp() if with_ref else None)
    if not slots:
        return out
    t_tokens, t_map = empty_feedback(batch, slots, window)
    for row in range(batch):
        starts = np.flatnonzero(generated[row] & ~np.roll(generated[row], 1))
        filled = 0
        for start in starts:
            end = min(turn_end(generated[row], start), start + window - hint_len)
            if filled == slots or end <= start:
                continue
            hint = rng.integers(0, vocab_size, hint_len)
            t_tokens[row, filled], t_map[row, filled] = teacher_slot(tokens[row], generated[row], start, hint,
                                                                     window, end)
            filled += 1
    return out._replace(teacher_tokens=t_tokens, teacher_map=t_map)
