"""Every `composer-jax bench` section builds at every preset's default sizes, shapes only (nothing
compiled or run), through `suite.section_shapes`, the check a bench run makes before measuring; a
default made invalid on purpose fails it."""

import dataclasses

import pytest

from composer_jax.bench import rl_teacher, suite
from composer_jax.config import replace


# The quick sizes are smaller than these (the CPU ones run in full in tests/test_bench.py).
@pytest.mark.parametrize("preset,quick", [("cpu", False), ("gpu", False)])
def test_every_section_builds_at_its_default_sizes(preset, quick):
    s = suite.sizes(preset, quick)
    for name in suite.SECTIONS:
        suite.section_shapes(name, s)


def test_rl_teacher_positions_cover_its_longest_rollout():
    """The section's positions are derived from what it builds: 4 flagged turns of 16 tokens with 8-token
    tool outputs after a 32-token prefix are 128 tokens (the bench once failed after 6 minutes here)."""
    prefix, turn, slots = suite.sizes("cpu", False).teacher
    model = rl_teacher.section_model(suite.section_model("rl_teacher", suite.sizes("cpu", False)), prefix, turn, slots)
    assert (prefix, turn, max(slots), rl_teacher.TAIL) == (32, 16, 4, 8)
    assert model.rope.max_position_embeddings == 32 + 4 * (16 + 8) == 128


def test_the_check_fails_on_a_default_that_cannot_run(monkeypatch):
    """The positions the rl_teacher section used to restate (prefix + turn + 64 = 112) and a token count
    that does not split over the 8 devices: each fails the check, naming the size at fault."""
    s = suite.sizes("cpu", False)
    monkeypatch.setattr(rl_teacher, "section_model", lambda base, prefix, turn, slots: replace(
        base, **{"rope.max_position_embeddings": prefix + turn + 64}))
    with pytest.raises(ValueError, match="sequence length 128 exceeds rope.max_position_embeddings=112"):
        suite.section_shapes("rl_teacher", s)
    with pytest.raises(ValueError, match="does not evenly divide the dimension size 2044"):
        suite.section_shapes("dispatch", dataclasses.replace(s, dispatch=(2044, *s.dispatch[1:])))
