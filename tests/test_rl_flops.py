"""The teacher's cost follows the flagged turn, not the trajectory: FLOPs of the whole RL step (XLA cost
analysis) with one flagged turn per row minus the same step with none."""

import pytest

from composer_jax import load_config
from composer_jax.bench.rl_teacher import teacher_flops

MODEL = load_config("tiny", ["rope.max_position_embeddings=512"])


@pytest.mark.slow
def test_teacher_cost_follows_the_turn_not_the_trajectory():
    """From the lowered step's HLO cost analysis (compiling takes minutes on 2 cores; the slow test
    below checks these numbers against the compiled step's). 8 traces: a step without a flagged turn
    is the same program for both teachers."""
    base, base_share = teacher_flops(MODEL, 32, 16, stage="lowered")
    long_context, long_share = teacher_flops(MODEL, 128, 16, stage="lowered")    # 4x the trajectory before the turn
    long_turn, _ = teacher_flops(MODEL, 32, 32, stage="lowered")                  # 2x the flagged turn
    naive, _ = teacher_flops(MODEL, 32, 16, "full", "lowered")
    naive_long, _ = teacher_flops(MODEL, 128, 16, "full", "lowered")
    print(f"teacher FLOPs {base:.3e} (share {base_share:.3f}); 4x prefix {long_context:.3e} (share "
          f"{long_share:.3f}); 2x turn {long_turn:.3e}; naive teacher {naive:.3e} -> {naive_long:.3e}")
    # Flat in the prefix: what remains is attention to the prefix and decompressing its latents (7.1e6
    # here, a third of the teacher at the short prefix now that CPU's grouped expert matmuls count only
    # their blocks), a small part of what the same prefix adds to the naive teacher (8.4e7).
    assert long_context / base < 1.5
    assert long_context - base < 0.2 * (naive_long - naive)
    assert long_share < base_share
    # Grows with the turn.
    assert long_turn / base > 1.6
    # The naive teacher over the whole hinted context grows with the prefix and costs more.
    assert naive_long / naive > 2.0 and naive > 2 * base


def test_teacher_cost_is_proportional_to_the_flagged_turns():
    """Every flagged turn of a row gets its own slot: 3 flagged turns per row (each followed by a tool
    output) cost 3x one, within what each later turn's longer context adds in attention (`composer-jax
    bench --sections rl_teacher` reports 2 and 4)."""
    one, _ = teacher_flops(MODEL, 32, 16, stage="lowered", slots=1)
    three, _ = teacher_flops(MODEL, 32, 16, stage="lowered", slots=3)
    print(f"teacher FLOPs 1 slot {one:.3e}, 3 slots {three:.3e} (x{three / one:.2f})")
    assert 2.7 < three / one < 3.6


@pytest.mark.slow
def test_teacher_cost_in_the_compiled_step():
    """The compiled step (after XLA's optimisations) gives the same count as the lowered one, within
    10%, at the longer prefix (the lowered programs are cached from the test above: only the two
    compiles are new)."""
    compiled, _ = teacher_flops(MODEL, 128, 16, stage="compiled")
    lowered, _ = teacher_flops(MODEL, 128, 16, stage="lowered")
    print(f"prefix 128: teacher FLOPs compiled {compiled:.3e}, lowered {lowered:.3e}")
    assert abs(compiled - lowered) <= 0.1 * lowered
