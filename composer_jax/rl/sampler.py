"""Task sampling by difficulty for the RL loop (host-side: no jax).

Composer 2.5 filters tasks as the policy learns to solve them ("as RL makes the model solve most
training tasks, harder tasks are filtered and generated dynamically throughout training",
shared/reference/composer.md; rl.md section 1.4 "task difficulty was raised dynamically"). The exact
rule is not published; this module's rule is our own:

- Pass rates. A rollout passes when its task reward is >= `pass_threshold` (1: every target test
  passes). Per task the sampler keeps discounted counts (each new sample first multiplies the old ones
  by `decay`, so the estimate follows the changing policy) and estimates p = (passes + 1) /
  (samples + 2) (1/2 before any sample). It also keeps lifetime counts: `write_pass_rates` records their
  share (the share of all sampled attempts that solved the task) as task.json's `difficulty.pass_rate`.
- Retirement. A task whose last `retire_after` samples all passed is retired: the policy always solves
  it, and its groups would carry no signal.
- Re-weighting. w = max(4 p (1 - p), min_weight): the variance of a pass/fail reward (scaled to 1 at
  p = 1/2), which is what a group-relative advantage learns from; a group that always passes or always
  fails has none (DAPO drops such groups, rl.md section 2.3). `min_weight` keeps tasks that are never
  solved in the mix: they may become solvable.
- Passes. Prompts are handed out in passes that hold each active task at most once: task i joins a new
  pass with probability w_i / max_j w_j, and the pass is shuffled. `draw(n)` hands out the next n
  prompts, starting a new pass when one is used up; retired tasks still in the pass are skipped. A
  drawn prompt is consumed: it is not handed out again in its pass, after a restore included.

`state_dict()` / `TaskSampler.from_state(...)` round-trip through JSON (counts, the pass, the draw
counter, the random generator's state), so a resumed run continues the same sequence. Groups of
rollouts are assembled by `composer_jax.rl.groups.GroupAssembler`, which feeds the pass rates back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from composer_jax.config import ConfigError
from composer_jax.tasks import write_pass_rate

STATE_VERSION = 1


class SamplerError(ValueError):
    """The task set or a saved sampler state cannot be used; the message names the culprit."""


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    pass_threshold: float = 1.0     # a rollout passes when its task reward is >= this
    decay: float = 0.95             # per-sample discount of a task's earlier pass counts (1: plain counts)
    retire_after: int = 16          # retire a task whose last N samples all passed (0: never retire)
    min_weight: float = 0.05        # floor of the difficulty weight 4 p (1 - p)
    seed: int = 0

    def __post_init__(self):
        checks = [("decay", 0 < self.decay <= 1, "must be in (0, 1]"),
                  ("retire_after", self.retire_after >= 0, "must be >= 0 (0: never retire)"),
                  ("min_weight", 0 < self.min_weight <= 1, "must be in (0, 1]"),
                  ("pass_threshold", np.isfinite(self.pass_threshold), "must be a finite number")]
        for key, ok, message in checks:
            if not ok:
                raise ConfigError(key, f"{message}, got {getattr(self, key)!r}")


class Prompt(NamedTuple):
    """One drawn prompt: the task, a unique draw number (the key of its group) and its pass."""

    task_id: str
    draw: int
    pass_index: int


@dataclasses.dataclass
class TaskStats:
    passes: float = 0.0             # discounted
    samples: float = 0.0            # discounted
    lifetime_passes: int = 0
    lifetime_samples: int = 0
    streak: int = 0                 # consecutive passes up to the latest sample
    retired: bool = False

    @property
    def pass_rate(self) -> float:
        """The smoothed recent pass rate (passes + 1) / (samples + 2)."""
        return (self.passes + 1.0) / (self.samples + 2.0)


class TaskSampler:
    """Draws prompts by difficulty, once per pass; `record` feeds back each rollout's task reward."""

    def __init__(self, task_ids: Iterable[str], cfg: SamplerConfig = SamplerConfig()):
        ids = list(task_ids)
        if not ids:
            raise SamplerError("no tasks to sample from: the task set is empty")
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise SamplerError(f"task id {duplicates[0]!r} appears more than once in the task set")
        self.cfg = cfg
        self.stats = {task_id: TaskStats() for task_id in ids}
        self.rng = np.random.default_rng(cfg.seed)
        self.pending: list[str] = []     # the rest of the current pass, in order
        self.draws = 0                   # prompts handed out so far
        self.passes = 0                  # passes started so far

    def add_tasks(self, task_ids: Iterable[str]) -> None:
        """New tasks (e.g. generated during the run): they start unsampled (p = 1/2, the top weight) and
        join from the next pass on."""
        for task_id in task_ids:
            if task_id in self.stats:
                raise SamplerError(f"task {task_id!r} is already in the task set")
            self.stats[task_id] = TaskStats()

    # -- difficulty -------------------------------------------------------------------------------

    def weight(self, task_id: str) -> float:
        p = self.stats[task_id].pass_rate
        return max(4.0 * p * (1.0 - p), self.cfg.min_weight)

    def active(self) -> list[str]:
        return [task_id for task_id, s in self.stats.items() if not s.retired]

    def record(self, task_id: str, task_rewards: Sequence[float]) -> None:
        """Count finished rollouts of `task_id` (their task rewards, in the order they finished)."""
        if task_id not in self.stats:
            raise SamplerError(f"task {task_id!r} is not in the sampler's task set")
        s = self.stats[task_id]
        for reward in task_rewards:
            passed = float(reward) >= self.cfg.pass_threshold
            s.passes = self.cfg.decay * s.passes + passed
            s.samples = self.cfg.decay * s.samples + 1.0
            s.lifetime_passes += passed
            s.lifetime_samples += 1
            s.streak = s.streak + 1 if passed else 0
        if self.cfg.retire_after and s.streak >= self.cfg.retire_after:
            s.retired = True

    # -- drawing ----------------------------------------------------------------------------------

    def _new_pass(self) -> None:
        active = self.active()
        if not active:
            raise SamplerError(f"all {len(self.stats)} tasks are retired (each passed its last "
                               f"{self.cfg.retire_after} samples): nothing left to train on")
        weights = np.array([self.weight(t) for t in active])
        keep = self.rng.random(len(active)) < weights / weights.max()
        chosen = [t for t, k in zip(active, keep) if k]
        self.pending = [chosen[i] for i in self.rng.permutation(len(chosen))]
        self.passes += 1

    def draw(self, n: int) -> list[Prompt]:
        """The next n prompts (a task may come twice only from two different passes)."""
        out = []
        while len(out) < n:
            if not self.pending:
                self._new_pass()
            task_id = self.pending.pop(0)
            if self.stats[task_id].retired:
                continue
            out.append(Prompt(task_id, self.draws, self.passes - 1))
            self.draws += 1
        return out

    # -- results ----------------------------------------------------------------------------------

    def lifetime_pass_rate(self, task_id: str) -> float | None:
        s = self.stats[task_id]
        return s.lifetime_passes / s.lifetime_samples if s.lifetime_samples else None

    def summary(self) -> dict[str, float]:
        """Metrics: active and retired task counts, passes started, mean lifetime pass rate of the
        sampled tasks."""
        rates = [r for r in map(self.lifetime_pass_rate, self.stats) if r is not None]
        return {"tasks_active": float(len(self.active())), "tasks_retired": float(len(self.stats) - len(self.active())),
                "task_passes": float(self.passes), "task_pass_rate": float(np.mean(rates)) if rates else 0.0}

    def write_pass_rates(self, task_dirs: Mapping[str, str | Path]) -> int:
        """Record each sampled task's lifetime pass rate in its task.json (`task_dirs`: id -> TASK_DIR);
        returns how many were written."""
        written = 0
        for task_id, task_dir in task_dirs.items():
            rate = self.lifetime_pass_rate(task_id) if task_id in self.stats else None
            if rate is not None:
                write_pass_rate(task_dir, rate)
                written += 1
        return written

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A JSON-serialisable snapshot of everything `draw` and `record` depend on."""
        return {"version": STATE_VERSION, "tasks": {t: dataclasses.asdict(s) for t, s in self.stats.items()},
                "pending": list(self.pending), "draws": self.draws, "passes": self.passes,
                "rng": self.rng.bit_generator.state}

    @classmethod
    def from_state(cls, state: dict, task_ids: Iterable[str], cfg: SamplerConfig = SamplerConfig()) -> TaskSampler:
        """The sampler saved in `state`, over `task_ids` (tasks new since the save start fresh; a saved
        task missing from `task_ids` is an error)."""
        sampler = cls(task_ids, cfg)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise SamplerError(f"sampler state: expected version {STATE_VERSION}, got "
                               f"{state.get('version') if isinstance(state, dict) else type(state).__name__!r}")
        missing = sorted(set(state["tasks"]) - set(sampler.stats))
        if missing:
            raise SamplerError(f"sampler state: task {missing[0]!r} is not in the task set "
                               f"({len(missing)} saved tasks missing)")
        for task_id, saved in state["tasks"].items():
            sampler.stats[task_id] = TaskStats(**saved)
        sampler.pending = list(state["pending"])
        sampler.draws, sampler.passes = int(state["draws"]), int(state["passes"])
        sampler.rng.bit_generator.state = state["rng"]
        return sampler
