"""Scores of an evaluation from its attempts, with bootstrap confidence intervals over tasks.

Every score is a ratio of per-task sums, value = sum_t num[t] / sum_t den[t] over the T tasks:
- mean-over-tasks scores (pass@k, mean reward) have den[t] = 1;
- efficiency and interaction scores pool attempts: generated tokens and turns per solved attempt
  (num: tokens of the task's solved attempts, den: how many were solved), the tool-error rate (failed
  / attempted tool calls) and the lint findings the agent's changes added per attempt.
So one resampling rule serves all of them: a bootstrap replicate draws T tasks with replacement and
recomputes the ratio; a paired comparison of two runs draws the same tasks for both. Tasks, not
attempts, are resampled: attempts on one task are correlated, and the question is how the score would
move on another draw of tasks.

pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for c solved of n
attempts, computed as a product to stay exact in floating point for large n.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from composer_jax.eval.errors import EvalError

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k attempts drawn without replacement from n (c of them solved) hold a solved one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise EvalError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(samples: int) -> list[int]:
    """The k reported for n samples per task: 1, powers of two below n, and n."""
    return sorted({1, samples} | {2 ** i for i in range(1, samples.bit_length()) if 2 ** i <= samples})


@dataclasses.dataclass(frozen=True)
class ScoreDef:
    name: str
    better: int          # +1: higher is better, -1: lower is better
    meaning: str


def score_defs(samples: int) -> list[ScoreDef]:
    return ([ScoreDef(f"pass@{k}", 1, f"share of tasks solved within {k} attempt{'s' * (k > 1)} (unbiased estimator)")
             for k in k_values(samples)] + [
        ScoreDef("mean_reward", 1, "task reward (share of target tests passing), mean over tasks"),
        ScoreDef("tokens_per_solved", -1, "generated tokens per solved attempt"),
        ScoreDef("turns_per_solved", -1, "assistant turns per solved attempt"),
        ScoreDef("tool_error_rate", -1, "failed tool calls / attempted tool calls"),
        ScoreDef("lint_added_per_attempt", -1, "lint findings (ruff F, E9) the agent's changes added, per attempt"),
    ])


@dataclasses.dataclass(frozen=True)
class TaskTable:
    """Per-task numerators and denominators of every score: num[name], den[name] float64[T]."""

    tasks: tuple[str, ...]
    samples: int
    num: Mapping[str, np.ndarray]
    den: Mapping[str, np.ndarray]
    solved: np.ndarray           # int[T]: solved attempts per task

    def take(self, tasks: Sequence[str]) -> TaskTable:
        """The rows of these tasks, in this order."""
        index = {t: i for i, t in enumerate(self.tasks)}
        rows = np.array([index[t] for t in tasks], dtype=np.int64)
        return TaskTable(tuple(tasks), self.samples, {n: v[rows] for n, v in self.num.items()},
                         {n: v[rows] for n, v in self.den.items()}, self.solved[rows])


def task_table(records: Sequence[Mapping]) -> TaskTable:
    """The TaskTable of attempt records (see composer_jax.eval.store.AttemptRecord), tasks sorted by id.
    Every task must have the same number of attempts."""
    by_task: dict[str, list[Mapping]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    if not by_task:
        raise EvalError("no attempts to score")
    counts = {len(v) for v in by_task.values()}
    if len(counts) != 1:
        fewest = min(by_task, key=lambda t: len(by_task[t]))
        raise EvalError(f"tasks have different numbers of attempts ({sorted(counts)}); e.g. {fewest} has "
                        f"{len(by_task[fewest])}: finish the evaluation first")
    samples = counts.pop()
    tasks = tuple(sorted(by_task))
    defs = score_defs(samples)
    num = {d.name: np.zeros(len(tasks)) for d in defs}
    den = {d.name: np.zeros(len(tasks)) for d in defs}
    solved = np.zeros(len(tasks), np.int64)
    for i, t in enumerate(tasks):
        attempts = by_task[t]
        good = [a for a in attempts if a["solved"]]
        solved[i] = len(good)
        for k in k_values(samples):
            num[f"pass@{k}"][i], den[f"pass@{k}"][i] = pass_at_k(samples, len(good), k), 1.0
        num["mean_reward"][i], den["mean_reward"][i] = np.mean([a["reward"] for a in attempts]), 1.0
        num["tokens_per_solved"][i] = sum(a["generated_tokens"] for a in good)
        num["turns_per_solved"][i] = sum(a["turns"] for a in good)
        den["tokens_per_solved"][i] = den["turns_per_solved"][i] = len(good)
        num["tool_error_rate"][i] = sum(a["tool_errors"] for a in attempts)
        den["tool_error_rate"][i] = sum(a["tool_calls"] for a in attempts)
        linted = [a["lint_added"] for a in attempts if a["lint_added"] is not None]
        num["lint_added_per_attempt"][i], den["lint_added_per_attempt"][i] = sum(linted), len(linted)
    return TaskTable(tasks, samples, num, den, solved)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """sum(num) / sum(den) over the last axis; nan where the denominator sums to 0."""
    n, d = num.sum(-1), den.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1), np.nan)


def resample_rows(tasks: int, resamples: int, seed: int) -> np.ndarray:
    """int[resamples, tasks]: task indices drawn with replacement, one row per bootstrap replicate."""
    return np.random.default_rng(seed).integers(0, tasks, size=(resamples, tasks))


def _interval(values: np.ndarray, level: float) -> tuple[float, float] | None:
    """The percentile interval of the finite replicate values (None when there are none)."""
    values = values[np.isfinite(values)]
    if not values.size:
        return None
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float | None                  # None: undefined (e.g. tokens per solved attempt, nothing solved)
    ci: tuple[float, float] | None       # bootstrap percentile interval at `level`

    def to_json(self) -> dict:
        return {"value": self.value, "ci": None if self.ci is None else list(self.ci)}


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def bootstrap(num: np.ndarray, den: np.ndarray, rows: np.ndarray, level: float) -> Estimate:
    """The ratio score with its bootstrap interval; rows: resample_rows(...)."""
    return Estimate(_finite(_ratio(num, den)), _interval(_ratio(num[rows], den[rows]), level))


def paired_difference(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], rows: np.ndarray,
                      level: float) -> Estimate:
    """B - A of a ratio score over the same tasks (aligned rows), each replicate drawing the same tasks
    for both runs."""
    value = _ratio(*b) - _ratio(*a)
    replicates = _ratio(b[0][rows], b[1][rows]) - _ratio(a[0][rows], a[1][rows])
    return Estimate(_finite(value), _interval(replicates, level))


def summarize(table: TaskTable, *, level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES,
              seed: int = 0) -> dict[str, Estimate]:
    """Every score of the table with its bootstrap interval (seeded: the same table gives the same
    intervals)."""
    rows = resample_rows(len(table.tasks), resamples, seed)
    return {d.name: bootstrap(table.num[d.name], table.den[d.name], rows, level) for d in score_defs(table.samples)}
