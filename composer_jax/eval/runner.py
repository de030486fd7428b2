"""`evaluate(agent, tasks, out_dir, EvalConfig(samples=K))`: K attempts per task, `workers` at once,
recorded as they finish, then scored. Called by `composer-jax eval` and by the RL loop's periodic
evaluation (with its own agent and a fresh out_dir per evaluation).

Resumable: out_dir/run.json pins what is evaluated; calling again with the same agent, tasks and
settings runs only the attempts attempts.jsonl does not list yet (composer_jax.eval.store), and the
summary is recomputed from all the records, so it equals an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

from composer_jax.agents.episode import attempt_seed
from composer_jax.agents.protocol import Agent
from composer_jax.agents.task_sets import coding_env
from composer_jax.envs import CodingEnvConfig
from composer_jax.eval.attempt import run_attempt
from composer_jax.eval.errors import EvalError
from composer_jax.eval.scores import DEFAULT_LEVEL, DEFAULT_RESAMPLES
from composer_jax.eval.store import SUMMARY, AttemptLog, AttemptRecord, open_run, read_attempts, write_json
from composer_jax.eval.summary import Summary, build_summary
from composer_jax.sandbox import Sandbox, run_parallel
from composer_jax.tasks import Task


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    samples: int = 1                  # K: attempts per task
    max_turns: int = 30               # assistant turns per coding episode
    tools: tuple[str, ...] = ()       # coding: the tools declared to the agent (empty: all)
    max_output_chars: int = 0         # coding: a tool result is cut to this many characters (0: the env's default)
    workers: int = 1                  # attempts at once (threads; each runs its commands in the sandbox)
    seed: int = 0                     # attempt seeds derive from it, the task and the sample
    level: float = DEFAULT_LEVEL      # of the bootstrap confidence intervals
    resamples: int = DEFAULT_RESAMPLES
    record_file_access: bool = False  # coding: record what commands open; transcripts get the monitor's report

    def coding(self) -> CodingEnvConfig:
        """The coding environment of an attempt."""
        default = CodingEnvConfig()
        return CodingEnvConfig(max_turns=self.max_turns, tools=self.tools or default.tools,
                               max_output_chars=self.max_output_chars or default.max_output_chars,
                               record_file_access=self.record_file_access)

    def __post_init__(self):
        for name, meaning in (("samples", "samples (K, attempts per task)"), ("max_turns", "max turns"),
                              ("workers", "workers"), ("resamples", "bootstrap resamples")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvalError(f"{meaning} must be an integer >= 1, got {value!r}")
        if not 0 < self.level < 1:
            raise EvalError(f"confidence level must be in (0, 1), got {self.level!r}")
        try:
            self.coding()
        except ValueError as e:   # an unknown tool, no submit, a bad output limit
            raise EvalError(str(e)) from None


def run_spec(agent: Agent, task_ids: Sequence[str], config: EvalConfig) -> dict:
    """What run.json pins: a restart must evaluate the same agent on the same tasks the same way."""
    spec = {"agent": agent.name, "agent_settings": agent.settings, "format": agent.fmt.name,
            "tokenizer": agent.tokenizer.name, "tasks": sorted(task_ids), "samples": config.samples,
            "max_turns": config.max_turns, "seed": config.seed}
    return spec | {k: list(v) if isinstance(v, tuple) else v
                   for k, v in (("tools", config.tools), ("max_output_chars", config.max_output_chars)) if v}


def evaluate(agent: Agent, tasks: Sequence, out_dir: str | Path, config: EvalConfig = EvalConfig(), *,
             make_env: Callable[[], object] | None = None, sandbox: Sandbox | None = None,
             log: Callable[[str], None] | None = None) -> Summary:
    """Run `config.samples` attempts of `agent` on each task, skipping those out_dir already records;
    write the summary to out_dir/summary.json and return it.

    tasks: coding tasks (composer_jax.tasks.Task), played in a CodingEnv over `sandbox` (default: a
    bubblewrap Sandbox) that also lints the agent's changes; or any tasks with `make_env` (e.g.
    `lambda: ToyEnv(agent.fmt)` for ToyTasks), which makes a fresh environment per attempt.
    log: called with one line per finished attempt."""
    ids = [t.id for t in tasks]
    if not ids:
        raise EvalError("no tasks to evaluate")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise EvalError(f"task id {repeated[0]!r} appears more than once in the task set")
    if make_env is None:
        if not all(isinstance(t, Task) for t in tasks):
            raise EvalError("tasks other than coding tasks need make_env (e.g. lambda: ToyEnv(agent.fmt))")
        make_env = coding_env(sandbox or Sandbox(), agent.fmt, config.coding())
    out_dir = Path(out_dir)
    finished = {(r["task"], r["sample"]) for r in open_run(out_dir, run_spec(agent, ids, config))}
    pending = [(t, s) for t in sorted(tasks, key=lambda t: t.id) for s in range(config.samples)
               if (t.id, s) not in finished]
    attempts = AttemptLog(out_dir)
    count = itertools.count(len(finished) + 1)   # next() is atomic: workers may share it
    total = len(ids) * config.samples

    def attempt(item) -> AttemptRecord:
        task, sample = item
        record = run_attempt(agent, make_env(), task, sample, attempt_seed(config.seed, task.id, sample), out_dir)
        attempts.append(record)
        if log is not None:
            log(f"[{next(count)}/{total}] {task.id} #{sample}: reward {record.reward:.2f}, {record.turns} turns, "
                f"{record.generated_tokens} tokens, {record.wall_s:.1f} s")
        return record

    run_parallel(attempt, pending, config.workers)
    summary = build_summary(agent.name, read_attempts(out_dir), level=config.level, resamples=config.resamples,
                            seed=config.seed)
    write_json(out_dir / SUMMARY, summary.to_json())
    return summary
