"""Rollout batches: the feedback-slot builder and rejection of bad batches before compilation."""

import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.rl import BatchError, RLConfig, RLStep, synthetic_batch, teacher_slot, validate_batch

VOCAB, G = 256, 2


def _batch(**kw):
    return synthetic_batch(0, batch=4, seq=32, vocab_size=VOCAB, group_size=G, slots=2, window=12, **kw)


def _check(batch, **kw):
    validate_batch(batch, group_size=G, vocab_size=VOCAB, **kw)


def test_synthetic_batch_is_valid():
    batch = _batch(with_ref=True)
    _check(batch, need_ref=True)
    assert (batch.teacher_map >= 0).any(-1).all(-1).any()          # some rows use both slots


def test_teacher_slot_layout():
    tokens = np.arange(10, 20)
    generated = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 0], bool)
    slot_tokens, slot_map = teacher_slot(tokens, generated, 2, [7, 8], window=6)
    np.testing.assert_array_equal(slot_tokens, [7, 8, 12, 13, 14, 0])
    np.testing.assert_array_equal(slot_map, [-1, -1, 2, 3, 4, -1])
    with pytest.raises(BatchError, match="exceed the window"):
        teacher_slot(tokens, generated, 2, [7, 8], window=4)
    with pytest.raises(BatchError, match="no generated token"):
        teacher_slot(tokens, generated, 5, [7], window=4)


def _replace(batch, field, fn):
    return batch._replace(**{field: fn(np.array(getattr(batch, field)))})


def _set(index, value):
    def fn(x):
        x[index] = value
        return x
    return fn


def _first_turn(batch):
    """(row, slot, index of the first turn slot, student start) of a used feedback slot."""
    row, slot = map(int, np.argwhere((batch.teacher_map >= 0).any(-1))[0])
    j = int(np.argmax(batch.teacher_map[row, slot] >= 0))
    return row, slot, j, int(batch.teacher_map[row, slot, j])


BAD = {
    "mismatched shape": ("positions", lambda b: _replace(b, "positions", lambda x: np.pad(x, ((0, 0), (0, 1)))),
                         "does not match"),
    "group not full": ("group_ids", lambda b: _replace(b, "group_ids", _set(0, 9)), "has 1 members"),
    "NaN reward": ("rewards", lambda b: _replace(b, "rewards", _set(2, np.nan)), "non-finite"),
    "token id": ("tokens", lambda b: _replace(b, "tokens", _set((1, 3), VOCAB)), "outside"),
    "NaN behaviour logprob": ("behaviour_logprobs", lambda b: _replace(
        b, "behaviour_logprobs", lambda x: np.where(b.generated, np.nan, x)), "non-finite"),
    "positive logprob": ("behaviour_logprobs", lambda b: _replace(
        b, "behaviour_logprobs", lambda x: np.where(b.generated, 0.5, x)), "> 0"),
    "generated padding": ("generated", lambda b: _replace(b, "generated", lambda x: x | (b.segment_ids == 0)),
                          "padding"),
    "two trajectories in a row": ("segment_ids", lambda b: _replace(b, "segment_ids", _set((0, 5), 2)),
                                  "one trajectory per row"),
    "map not contiguous": ("teacher_map", lambda b: _replace(
        b, "teacher_map", _set(_first_turn(b)[:2] + (_first_turn(b)[2] + 1,), -1)), "contiguous"),
    "teacher token differs": ("teacher_tokens", lambda b: _replace(
        b, "teacher_tokens", _set(_first_turn(b)[:3], (b.tokens[_first_turn(b)[0], _first_turn(b)[3]] + 1) % VOCAB)),
        "differ"),
    "map out of range": ("teacher_map", lambda b: _replace(b, "teacher_map", _set((0, 0, 0), 99)), "outside"),
    "tokens without map": ("teacher_map", lambda b: b._replace(teacher_map=None), "both or neither"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_batch_names_the_field(case):
    field, corrupt, message = BAD[case]
    with pytest.raises(BatchError, match=message) as err:
        _check(corrupt(_batch()))
    assert err.value.field == field
    assert f"'{field}'" in str(err.value)


def test_map_into_a_tool_output_is_outside_the_turn():
    batch = _batch()
    row, slot, j, start = _first_turn(batch)
    end = start
    while batch.generated[row, end]:
        end += 1
    n = int((batch.teacher_map[row, slot] >= 0).sum())
    shifted = np.array(batch.teacher_map)
    shifted[row, slot, j:j + n] += end - start      # the same number of slots, starting on the tool output
    tokens = np.array(batch.teacher_tokens)
    tokens[row, slot, j:j + n] = batch.tokens[row, shifted[row, slot, j:j + n]]
    with pytest.raises(BatchError, match="outside the flagged turn"):
        _check(batch._replace(teacher_map=shifted, teacher_tokens=tokens))


def test_missing_reference_logprobs():
    with pytest.raises(BatchError, match="ref_logprobs"):
        _check(_batch(), need_ref=True)


def test_rejected_before_compilation():
    """RLStep validates on the host first: a bad batch never reaches tracing or compilation."""
    rl_step = RLStep(nnx.eval_shape(lambda: CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))), RLConfig(group_size=G))
    with pytest.raises(BatchError, match="rewards"):
        rl_step(None, BAD["NaN reward"][1](_batch()))
    assert rl_step.jitted._cache_size() == 0


def test_group_size_that_does_not_divide_the_rows():
    batch = _batch()
    three = batch._replace(**{f: getattr(batch, f)[:3] for f in batch._fields if getattr(batch, f) is not None})
    with pytest.raises(BatchError, match=r"'group_ids': 3 rows are not a whole number of groups of group_size=2"):
        _check(three)
