"""Task sets an agent plays: coding tasks from a task directory, and the coding environment they are
played in (it lints the agent's changes after grading, composer_jax.agents.lint). Evaluation
(`composer-jax eval`) and the RL run's task sets (composer_jax.rl.task_sets) load them here."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from composer_jax.agents.errors import AgentError
from composer_jax.agents.lint import inspect_changes
from composer_jax.envs import CodingEnv, CodingEnvConfig
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import Task, load_task
from composer_jax.tasks.listing import find_tasks


def load_task_set(tasks_dir: str | Path) -> list[Task]:
    """The coding tasks of TASKS_DIR (its subdirectories holding a task.json; or TASKS_DIR itself when it
    is one task), validated, sorted by id."""
    root = Path(tasks_dir)
    if (root / "task.json").is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise AgentError(f"TASKS_DIR {root}: does not exist or is not a directory")
    tasks = find_tasks(root)
    if not tasks:
        raise AgentError(f"TASKS_DIR {root}: no tasks in it (subdirectories holding a task.json)")
    return tasks


def coding_env(sandbox: Sandbox, fmt, config: CodingEnvConfig) -> Callable[[], CodingEnv]:
    """Fresh CodingEnvs that lint the agent's changes after grading."""
    return lambda: CodingEnv(sandbox, fmt, config, inspect=functools.partial(inspect_changes, sandbox))
