"""The teacher's cost follows the flagged turn, not the trajectory: FLOPs of the whole RL step (XLA cost
analysis) with one flagged turn per row minus the same step with none."""

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.rl import RLConfig, RLStep, RolloutBatch, teacher_slot

MODEL = load_config("tiny", ["rope.max_position_embeddings=512"])
HINT, TAIL, ROWS = 4, 8, 2


def _batch(prefix: int, turn: int, flagged: bool) -> RolloutBatch:
    """ROWS trajectories: `prefix` context tokens, one model turn of `turn` tokens, a tool output."""
    seq = prefix + turn + TAIL
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (ROWS, seq)).astype(np.int32)
    generated = np.zeros((ROWS, seq), bool)
    generated[:, prefix:prefix + turn] = True
    batch = RolloutBatch(tokens, np.tile(np.arange(seq, dtype=np.int32), (ROWS, 1)), np.ones((ROWS, seq), np.int32),
                         generated, np.where(generated, -1.0, 0.0).astype(np.float32),
                         np.arange(ROWS, dtype=np.float32), np.zeros(ROWS, np.int32))
    if not flagged:
        return batch
    slots = [teacher_slot(tokens[r], generated[r], prefix, np.arange(HINT), HINT + turn) for r in range(ROWS)]
    return batch._replace(teacher_tokens=np.stack([s[0] for s in slots])[:, None],
                          teacher_map=np.stack([s[1] for s in slots])[:, None])


def _step_flops(batch: RolloutBatch, context: str, stage: str) -> float:
    cfg = RLConfig(group_size=ROWS, teacher_context=context, mtp_distill_weight=0.0)   # the teacher's cost alone
    model = nnx.eval_shape(lambda: CausalLM(MODEL, rngs=nnx.Rngs(0)))
    rl_step = RLStep(model, cfg)
    rl_step.validate(batch)
    state = jax.eval_shape(lambda: rl_step.init_state(CausalLM(MODEL, rngs=nnx.Rngs(0))))
    lowered = rl_step.jitted.lower(state, batch)
    analysis = lowered.compile().cost_analysis() if stage == "compiled" else lowered.cost_analysis()
    return float(analysis["flops"])


def teacher_flops(prefix: int, turn: int, context: str = "prefix", stage: str = "compiled") -> tuple[float, float]:
    """(FLOPs the flagged turns add to the step, that as a share of the step's FLOPs)."""
    with_flags = _step_flops(_batch(prefix, turn, True), context, stage)
    teacher = with_flags - _step_flops(_batch(prefix, turn, False), context, stage)
    return teacher, teacher / with_flags


def test_teacher_cost_follows_the_turn_not_the_trajectory():
    """From the lowered step's HLO cost analysis (compiling 8 steps takes minutes on 2 cores; the slow
    test below checks these numbers against the compiled step's)."""
    base, base_share = teacher_flops(32, 16, stage="lowered")
    long_context, long_share = teacher_flops(128, 16, stage="lowered")    # 4x the trajectory before the turn
    long_turn, _ = teacher_flops(32, 32, stage="lowered")                  # 2x the flagged turn
    naive, _ = teacher_flops(32, 16, "full", "lowered")
    naive_long, _ = teacher_flops(128, 16, "full", "lowered")
    print(f"teacher FLOPs {base:.3e} (share {base_share:.3f}); 4x prefix {long_context:.3e} (share "
          f"{long_share:.3f}); 2x turn {long_turn:.3e}; naive teacher {naive:.3e} -> {naive_long:.3e}")
    # Flat in the prefix: what remains is attention to the prefix and decompressing its latents.
    assert long_context / base < 1.25
    assert long_share < base_share
    # Grows with the turn.
    assert long_turn / base > 1.6
    # The naive teacher over the whole hinted context grows with the prefix and costs more.
    assert naive_long / naive > 2.0 and naive > 2 * base


@pytest.mark.slow
def test_teacher_cost_in_the_compiled_step():
    """The compiled step (after XLA's optimisations) gives the same picture, within 10% of the lowered
    step's counts."""
    flops = {}
    for prefix in (32, 128):
        compiled, _ = teacher_flops(prefix, 16, stage="compiled")
        lowered, _ = teacher_flops(prefix, 16, stage="lowered")
        print(f"prefix {prefix}: teacher FLOPs compiled {compiled:.3e}, lowered {lowered:.3e}")
        assert abs(compiled - lowered) <= 0.1 * lowered
        flops[prefix] = compiled
    assert flops[128] / flops[32] < 1.25
