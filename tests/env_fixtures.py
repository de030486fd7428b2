"""Fixtures of the environment tests: one sandbox per module, the example coding task, and the check that
episodes leave no workspace behind."""

import tempfile
from pathlib import Path

import pytest

from composer_jax.sandbox import Sandbox
from composer_jax.tasks import load_task
from composer_jax.tasks.examples import write_example_task


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


@pytest.fixture(autouse=True)
def no_leftover_workspaces():
    """Episodes delete their workspaces (graded, closed or left through the context manager)."""
    before = set(Path(tempfile.gettempdir()).glob("composer_jax-*"))
    yield
    assert set(Path(tempfile.gettempdir()).glob("composer_jax-*")) <= before


@pytest.fixture
def example_task(tmp_path):
    return load_task(write_example_task(tmp_path / "task", 1))   # scaled_sum(a, b) = 3 * a + b
