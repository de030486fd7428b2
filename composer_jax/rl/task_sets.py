"""The RL run's environment and task sets: training tasks (by id, for the sampler), held-out tasks (for
the periodic pass@1, run by `composer_jax.eval.evaluate`) and a factory of fresh environments. Coding
tasks come from a task directory, or are made once from a repository by feature deletion
(`composer-jax tasks feature-deletion`) into RUN_DIR/tasks; with `env.repos`, more are made while
training (`grow_pool`: RUN_DIR/pool, rl/task_pool.py)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from composer_jax.agents.task_sets import coding_env, load_task_set
from composer_jax.config import ConfigError
from composer_jax.envs import ToyEnv, get_format, toy_tasks
from composer_jax.rl.run_config import EnvConfig
from composer_jax.rl.task_pool import TaskPool


@dataclasses.dataclass
class TaskSets:
    train: dict[str, object]            # id -> task
    held_out: list                      # tasks for the periodic evaluation (may be empty)
    make_env: Callable[[], object]      # a fresh environment for one episode
    workspace: str                      # where the environment's commands see the repository (monitor)


def toy_task_sets(cfg: EnvConfig, seed: int) -> TaskSets:
    fmt = get_format(cfg.format)
    train = toy_tasks(cfg.family, cfg.tasks, seed=seed, length=cfg.length)
    seen = {t.prompt for t in train}
    held_out = [t for t in toy_tasks(cfg.family, 4 * cfg.eval_tasks, seed=seed + 1, length=cfg.length)
                if t.prompt not in seen][:cfg.eval_tasks]
    unique = {}
    for task in train:                  # the same prompt drawn twice is one task
        unique.setdefault(task.prompt, task)
    turns = cfg.max_turns if cfg.use_tool else 1
    return TaskSets({t.id: t for t in unique.values()}, held_out, lambda: ToyEnv(fmt, cfg.use_tool, turns), "/workspace")


def _coding_tasks(directory: str, key: str) -> list:
    try:
        return load_task_set(directory)
    except (ValueError, OSError) as e:     # AgentError, TaskError
        raise ConfigError(key, str(e).splitlines()[0]) from None


def make_coding_tasks(cfg: EnvConfig, out_dir: Path, seed: int) -> None:
    """Feature-deletion tasks from `cfg.repo` into `out_dir` (once: a run that resumes reuses them)."""
    from composer_jax.tasks.feature_deletion import FeatureDeletionConfig, FeatureDeletionError, generate_tasks

    if (out_dir / "report.json").is_file():
        return
    if out_dir.exists():                      # an attempt that did not finish
        shutil.rmtree(out_dir)
    try:
        generate_tasks(cfg.repo, out_dir, FeatureDeletionConfig(max_tasks=cfg.max_tasks, seed=seed))
    except FeatureDeletionError as e:
        raise ConfigError("env.repo", str(e).splitlines()[0]) from None


def coding_task_sets(cfg: EnvConfig, run_dir: Path, seed: int) -> TaskSets:
    from composer_jax.sandbox import Sandbox

    if cfg.tasks_dir:
        train = _coding_tasks(cfg.tasks_dir, "env.tasks_dir")
        held_out = _coding_tasks(cfg.eval_dir, "env.eval_dir") if cfg.eval_dir else []
    else:
        make_coding_tasks(cfg, run_dir / "tasks", seed)
        made = _coding_tasks(str(run_dir / "tasks"), "env.repo")
        split = max(1, len(made) - cfg.eval_tasks)
        train, held_out = made[:split], made[split:]
    sandbox = Sandbox()
    make_env = coding_env(sandbox, get_format(cfg.format), cfg.coding())
    return TaskSets({t.id: t for t in train}, held_out, make_env, sandbox.workspace_path or "/workspace")


def task_sets(cfg: EnvConfig, seed: int, run_dir: str | Path) -> TaskSets:
    """The task sets `cfg` describes; a coding task directory without tasks is a ConfigError naming it."""
    if cfg.kind == "coding":
        if cfg.tasks_dir and not Path(cfg.tasks_dir).is_dir():
            raise ConfigError("env.tasks_dir", f"{cfg.tasks_dir}: does not exist or is not a directory")
        return coding_task_sets(cfg, Path(run_dir), seed)
    return toy_task_sets(cfg, seed)


def grow_pool(cfg: EnvConfig, tasks: TaskSets, seed: int, run_dir: str | Path) -> TaskPool | None:
    """The run's growing task pool (None without env.repos); the tasks it made before (a resumed run)
    join `tasks.train`."""
    if not cfg.repos:
        return None
    pool = TaskPool(cfg.pool, cfg.repos, Path(run_dir) / "pool", seed, list(tasks.train))
    tasks.train.update((t.id, t) for t in pool.tasks())
    return pool
