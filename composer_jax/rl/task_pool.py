"""A task pool that grows during RL: new coding tasks are made from `env.repos` as the policy solves
the ones it has (Composer 2.5: "as RL makes the model solve most training tasks, harder tasks are ...
generated dynamically throughout training", shared/reference/composer.md).

    pool = TaskPool(cfg.env.pool, cfg.env.repos, RUN_DIR / "pool", seed, base_ids)
    tasks = pool.tasks()              # the tasks made so far (a resumed run trains on them again)
    new = pool.poll(sampler)          # between batches: never waits; the tasks of a finished job
    pool.close()

When to grow: when the sampler has retired tasks (each solved its last `retire_after` samples) since
the last job began, or when the share of open tasks among the live ones (open: a smoothed recent pass
rate below SOLVED_RATE, not yet solved) falls below `min_open_share`. One job runs at a time, in a
process of its own (`python -m composer_jax.tasks.families JOB_DIR`, niced, with the generator's
sandbox; no jax), so the learner and the rollouts never wait for it: `poll` only checks whether the
process has ended. The rollout producer polls before each batch, in its own thread (it owns the
sampler), and waits for the pool only when every task is retired: then there is nothing to train on.

What grows: each job makes new tasks from one repository (the repositories take turns) at its current
level; the levels go easiest first (feature deletion: body -> definition -> feature, which delete more
lines, definitions and files). A job asks the generator for the tasks already made at that level plus
as many new ones (at least `round_tasks`): the generator keeps candidates in a fixed order, so the
first ones are those already made, dropped as duplicates, and doubling keeps that redone work below
the new work. Fewer new tasks than asked means the level is used up, and the repository moves up a
level. A repository whose job fails stops growing (the error is logged and kept in the state). The
pool stops at `max_tasks` made.

RUN_DIR/pool/state.json holds the tasks made (id, directory, family, level, repository), each
repository's progress (level, tasks made at it) and the job counters; it is written before new tasks
reach the sampler, so a checkpoint's sampler never names a task the pool forgot. A job that was
running when the run stopped is made again on resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import composer_jax
from composer_jax.config import ConfigError
from composer_jax.tasks import Task, load_task
from composer_jax.tasks.families import GENERATORS, RESULT

STATE_VERSION = 1
SOLVED_RATE = 0.75     # a live task whose smoothed recent pass rate is at least this counts as solved
NICE = 19              # the generation process's niceness (the lowest): the learner and the rollouts go first


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How the pool of coding tasks grows (only with env.repos set)."""

    family: str = "feature_deletion"   # the task family that makes new tasks (tasks/families.py)
    levels: tuple[str, ...] = ()       # the family's levels to go through, in order (empty: all, easiest first)
    round_tasks: int = 4               # new tasks of a level's first job (then as many as made at the level)
    max_tasks: int = 200               # tasks the pool makes in all
    min_open_share: float = 0.25       # grow when fewer of the live tasks than this are open (not yet solved)

    def __post_init__(self):
        if self.family not in GENERATORS:
            raise ConfigError("family", f"must be one of {', '.join(GENERATORS)}, got {self.family!r}")
        known = GENERATORS[self.family].levels
        unknown = [level for level in self.levels if level not in known]
        if unknown:
            raise ConfigError("levels", f"{unknown[0]!r} is not a level of {self.family} "
                                        f"({', '.join(map(repr, known))})")
        for name in ("round_tasks", "max_tasks"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.min_open_share <= 1:
            raise ConfigError("min_open_share", f"must be in [0, 1], got {self.min_open_share}")

    @property
    def level_order(self) -> tuple[str, ...]:
        return self.levels or GENERATORS[self.family].levels


class PoolError(RuntimeError):
    """The pool's saved state cannot be used; the message names the file."""


def _write_json(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


class TaskPool:
    """See the module docstring. `base_ids`: the run's own training tasks (never made again);
    `log`: where a line goes when a job ends."""

    def __init__(self, cfg: PoolConfig, repos: Sequence[str], directory: str | Path, seed: int,
                 base_ids: Sequence[str], log: Callable[[str], None] = lambda line: None):
        self.cfg, self.repos, self.dir, self.seed, self.log = cfg, list(repos), Path(directory), seed, log
        self.base_ids = set(base_ids)
        self.state_path = self.dir / "state.json"
        self._job: tuple[subprocess.Popen, Path, dict] | None = None
        self._loaded: dict[str, Task] = {}
        if self.state_path.is_file():
            self.state = self._read_state()
        else:
            self.state = {"version": STATE_VERSION, "family": cfg.family, "seed": seed, "jobs": 0, "next_repo": 0,
                          "retired_at_start": 0, "generation_s": 0.0, "last_generation_s": 0.0,
                          "repos": {r: {"level": 0, "made": 0, "error": None} for r in self.repos}, "tasks": []}
        for record in self.state["tasks"]:
            self._loaded[record["id"]] = self._load(record)
        for left in (self.dir / "jobs").glob("running-*"):     # jobs a stopped run left
            shutil.rmtree(left, ignore_errors=True)

    def _read_state(self) -> dict:
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise PoolError(f"{self.state_path}: cannot be read ({e})") from None
        if state.get("version") != STATE_VERSION or state.get("family") != self.cfg.family:
            raise PoolError(f"{self.state_path}: made by family {state.get('family')!r} with state version "
                            f"{state.get('version')!r}, this run is {self.cfg.family!r}, version {STATE_VERSION}")
        for repo in self.repos:      # repositories added to the config since: they start at the first level
            state["repos"].setdefault(repo, {"level": 0, "made": 0, "error": None})
        return state

    def _load(self, record: dict) -> Task:
        try:
            return load_task(self.dir / record["dir"])
        except ValueError as e:
            raise PoolError(f"{self.state_path}: task {record['id']}: {e}") from None

    def tasks(self) -> list[Task]:
        """The tasks the pool has made, in the order they were made."""
        return list(self._loaded.values())

    # -- growing ----------------------------------------------------------------------------------

    def _open_repos(self) -> list[str]:
        """The configured repositories that can still make tasks (none once the pool has max_tasks)."""
        if len(self.state["tasks"]) >= self.cfg.max_tasks:
            return []
        levels = len(self.cfg.level_order)
        return [r for r in self.repos if self.state["repos"][r]["error"] is None and self.state["repos"][r]["level"]
                < levels]

    def _next_job(self) -> dict | None:
        """The next (repository, level) to make tasks from, repositories in turn; None when none is left."""
        open_repos = self._open_repos()
        if not open_repos:
            return None
        n = len(self.repos)
        repo = min(open_repos, key=lambda r: (self.repos.index(r) - self.state["next_repo"]) % n)
        self.state["next_repo"] = (self.repos.index(repo) + 1) % n
        progress = self.state["repos"][repo]
        wanted = min(max(self.cfg.round_tasks, progress["made"]), self.cfg.max_tasks - len(self.state["tasks"]))
        return {"family": self.cfg.family, "repo": repo, "level": self.cfg.level_order[progress["level"]],
                "seed": self.seed, "max_tasks": progress["made"] + wanted, "wanted": wanted,
                "skip_ids": sorted(self._loaded) + sorted(self.base_ids)}

    def _wants_tasks(self, stats: dict) -> bool:
        """Grow: tasks were retired since the last job began, or too few tasks are open."""
        live = [s for s in stats.values() if not s.retired]
        open_tasks = sum(s.pass_rate < SOLVED_RATE for s in live)
        return (len(stats) - len(live) > self.state["retired_at_start"] or not live
                or open_tasks < self.cfg.min_open_share * len(live))

    def _start(self, job: dict, retired: int) -> None:
        # named by this process: a job process a killed run left behind never writes into a later run's job
        job_dir = self.dir / "jobs" / f"running-{os.getpid()}-{self.state['jobs']}"
        job_dir.mkdir(parents=True)
        _write_json(job_dir / "job.json", job)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(composer_jax.__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)}
        with open(job_dir / "worker.log", "wb") as out:
            process = subprocess.Popen(["nice", "-n", str(NICE), sys.executable, "-m", "composer_jax.tasks.families",
                                        str(job_dir)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                       process_group=0)   # not a new session: that would be a scheduling
                                                          # group of its own (autogroup), where nice is moot
        self.state["retired_at_start"] = retired
        self._job = (process, job_dir, job)

    def _finish(self) -> list[Task]:
        """The running job's outcome: its tasks kept under jobs/<n>, the progress and the state saved."""
        process, job_dir, job = self._job
        self._job = None
        n = self.state["jobs"]
        self.state["jobs"] += 1
        progress = self.state["repos"][job["repo"]]
        final = self.dir / "jobs" / str(n)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(job_dir, final)
        result = (json.loads((final / RESULT).read_text(encoding="utf-8")) if (final / RESULT).is_file() else
                  {"tasks": [], "seconds": 0.0, "error": f"the generation process exited with code "
                                                         f"{process.returncode} (see {final / 'worker.log'})"})
        self.state["last_generation_s"] = result["seconds"]
        self.state["generation_s"] += result["seconds"]
        where = f"{job['family']} {job['level'] or ''} tasks from {job['repo']}".replace("  ", " ")
        if result["error"]:
            progress["error"] = result["error"]
            self.log(f"task pool: job {n} ({where}) failed, the repository stops growing: {result['error']}")
            _write_json(self.state_path, self.state)
            return []
        records = [{"id": task_id, "dir": f"jobs/{n}/tasks/{task_id}", "family": job["family"], "level": job["level"],
                    "repo": job["repo"], "job": n} for task_id in result["tasks"]]
        progress["made"] += len(records)
        if len(records) < job["wanted"]:      # the level is used up
            progress["level"], progress["made"] = progress["level"] + 1, 0
        new = [self._load(r) for r in records]
        self.state["tasks"] += records
        _write_json(self.state_path, self.state)
        self._loaded.update((t.id, t) for t in new)
        self.log(f"task pool: job {n} made {len(new)} {where} in {result['seconds']:.1f} s")
        return new

    def poll(self, stats: dict) -> list[Task]:
        """Between batches (never waits): the tasks of a job that has just ended (to add to the sampler),
        and a new job started when the sampler's `stats` (id -> TaskStats) call for one."""
        new = []
        if self._job is not None and self._job[0].poll() is not None:
            new = self._finish()
        if self._job is None and not new and self._wants_tasks(stats):
            job = self._next_job()
            if job is not None:
                self._start(job, sum(s.retired for s in stats.values()))
        return new

    @property
    def growing(self) -> bool:
        """Whether a job runs now or another one can still be made."""
        return self._job is not None or bool(self._open_repos())

    def close(self) -> None:
        """Stop a running job (a resumed run makes it again)."""
        if self._job is not None:
            process = self._job[0]
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(30)
            self._job = None

    # -- metrics ----------------------------------------------------------------------------------

    def metrics(self, stats: dict, tasks: dict) -> dict[str, float]:
        """Tasks made, live and retired, in all and by family and level (`pool_made/feature_deletion/body`;
        live and retired count every task of the sampler's `stats`, by its task.json family and level from
        `tasks`, id -> task, `-` where it has none), jobs ended, whether one runs now, and the generation
        time (seconds, the last job's and all jobs')."""
        made = Counter((r["family"], r["level"] or "-") for r in self.state["tasks"])
        live, retired = Counter(), Counter()
        for task_id, s in stats.items():
            task = tasks[task_id]
            key = (getattr(task, "family", None) or "-", getattr(task, "level", None) or "-")
            (retired if s.retired else live)[key] += 1
        out = {"pool_made": float(len(self.state["tasks"])), "pool_live": float(sum(live.values())),
               "pool_retired": float(sum(retired.values())), "pool_jobs": float(self.state["jobs"]),
               "pool_job_running": float(self._job is not None),
               "pool_generation_s": float(self.state["last_generation_s"]),
               "pool_generation_s_total": float(self.state["generation_s"])}
        for name, counts in (("made", made), ("live", live), ("retired", retired)):
            out.update({f"pool_{name}/{f}/{level}": float(n) for (f, level), n in sorted(counts.items())})
        return out
