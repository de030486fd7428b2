"""The growing task pool (rl/task_pool.py, tasks/families.py): a scripted RL run on a pool it solves at
once makes new tasks in a background process, level after level, harder by their recorded features,
without the rollouts or a learner step waiting for it; the pool survives a restart; the worker imports
no jax; bad settings are one-line errors naming the key.

The run: the rollout producer (rl/rollout.py) with an agent and an environment that solve every task
at once (every task retires after its first group), a numpy stand-in for the learner's step between
batches, and feature-deletion tasks made from the small zebrakit repository of the level tests."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_jax.config import ConfigError
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs import toy_tasks
from composer_jax.agents import AgentTurn
from composer_jax.rl.rollout import RolloutProducer, group_assembler
from composer_jax.rl.run_config import EnvConfig, load_rl_config
from composer_jax.rl.sampler import SamplerConfig, TaskSampler
from composer_jax.rl.task_pool import PoolConfig, TaskPool
from composer_jax.rl.task_sets import TaskSets, grow_pool
from composer_jax.tasks.families import GENERATORS, Family, pool_id, run_job
from composer_jax.tasks.tracing import FeatureDeletionError
from tests.rl_parity import ParityEnv
from tests.test_feature_deletion import write_repo
from tests.test_feature_levels import LEVEL_SOURCES, TESTS_DESCRIBE

# zebrakit without its text module (fewer tests to run per candidate), one more test of `describe`
DESCRIBE_KM = '\n\ndef test_describe_km():\n    assert describe(2, "km") == "2 km"\n'
SOURCES = {**{path: text for path, text in LEVEL_SOURCES.items() if "text" not in path},
           "tests/test_describe.py": TESTS_DESCRIBE + DESCRIBE_KM}

REPO = Path(__file__).resolve().parents[1]
TINY = ["init_from=", "model=tiny", "rl.group_size=2", "rollout.batch_size=4", "rollout.max_new_tokens=6",
        "rollout.max_len=64", "rollout.feedback_window=32", "sampler.retire_after=2", "progress=false",
        "rollout.devices=0"]


class SolvingAgent:
    """Answers every turn with one token: the policy of a run that solves its pool at once."""

    tokenizer, version = ByteTokenizer(), 0

    def turn(self, request):
        return AgentTurn(self.tokenizer.encode("ok").tolist()[:1])

    def end_episode(self, episode):
        pass


class SolvedEnv(ParityEnv):
    """Every answer solves the task (reward 1); coding tasks are shown by id only (a short prompt)."""

    def reset(self, task):
        self.task = task
        return [{"role": "user", "content": task.id[:40]}]

    def step(self, text):
        return [], True, {"turn": 1, "flags": [], "task_reward": 1.0, "turns": 1, "tool_calls": 0,
                          "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0}


class TimedPool(TaskPool):
    """Records how long each poll took (it must never wait for the generation)."""

    polls: list

    def poll(self, stats):
        start = time.perf_counter()
        try:
            return super().poll(stats)
        finally:
            self.polls.append(time.perf_counter() - start)


def difficulty(tasks) -> dict:
    """Mean recorded difficulty features of `tasks`."""
    keys = ("deleted_lines", "deleted_definitions", "deleted_files")
    return {k: statistics.mean(t.difficulty[k] for t in tasks) for k in keys}


def test_a_run_that_solves_its_pool_grows_it_with_harder_tasks(tmp_path):
    repo = write_repo(tmp_path / "zebrakit", SOURCES)
    cfg = load_rl_config("rl-tiny", [*TINY, f"run_dir={tmp_path / 'run'}"])
    base = {t.id: t for t in toy_tasks("copy", 24, seed=1, length=2)}
    pool_cfg = PoolConfig(levels=("body", "feature"), round_tasks=4)
    pool = TimedPool(pool_cfg, [str(repo)], tmp_path / "run" / "pool", seed=0, base_ids=list(base))
    pool.polls = []
    sampler = TaskSampler(list(base), cfg.sampler)
    producer = RolloutProducer(SolvingAgent(), base, SolvedEnv, sampler, group_assembler(cfg, sampler), cfg,
                               pool=pool)
    during_job, records = 0, []
    deadline = time.monotonic() + 120
    try:
        for index in range(400):
            produced = producer.produce(index)      # waits for the pool only when every task is retired
            records.append(produced.metrics)
            during_job += pool._job is not None
            if not pool.growing or time.monotonic() > deadline:
                break
    finally:
        pool.close()
    made = pool.tasks()
    levels = [t.level for t in made]
    assert not pool.growing and levels == sorted(levels, key=("body", "feature").index), levels
    assert levels.count("body") == 2 and levels.count("feature") == 1, (levels, pool.state)   # what the levels keep
    assert set(base) | {t.id for t in made} == set(sampler.stats) == set(producer.tasks)
    # Harder by their recorded features: the feature level deletes more lines, definitions and files.
    body, feature = difficulty([t for t in made if t.level == "body"]), difficulty([t for t in made
                                                                                     if t.level == "feature"])
    assert all(feature[k] > body[k] for k in body), (body, feature)
    # Metrics: made by family and level, and every sampled task live or retired.
    last = records[-1]
    assert last["pool_made/feature_deletion/body"] == 2 and last["pool_made/feature_deletion/feature"] == 1
    assert last["pool_live"] + last["pool_retired"] == len(sampler.stats) and last["pool_retired/-/-"] == 24
    assert last["pool_jobs"] == 2 and last["pool_job_running"] == 0
    assert 0 < last["pool_generation_s"] <= last["pool_generation_s_total"]
    # Never waiting: a poll takes milliseconds while a job takes seconds, and batches were produced while a
    # job ran. (Whether the learner's step slows beside a job is a timing: tools/pool_growth.py measures it.)
    assert max(pool.polls) < min(0.25, last["pool_generation_s_total"] / 10), (max(pool.polls), last)
    assert during_job

    # A restart: the same tasks and progress from RUN_DIR/pool; the sampler's saved state names them all.
    again = TaskPool(pool_cfg, [str(repo)], tmp_path / "run" / "pool", seed=0, base_ids=list(base))
    assert [t.id for t in again.tasks()] == [t.id for t in made] and again.state == pool.state
    # What a resumed RLTrainer does: the pool's tasks join the run's own, and the saved sampler state loads.
    sets = TaskSets({t.id: t for t in toy_tasks("copy", 24, seed=1, length=2)}, [], SolvedEnv, "/workspace")
    env = EnvConfig(kind="coding", tasks_dir=str(tmp_path), repos=(str(repo),), pool=pool_cfg)
    grow_pool(env, sets, 0, tmp_path / "run").close()
    assert list(sets.train)[24:] == [t.id for t in made]
    restored = TaskSampler.from_state(sampler.state_dict(), list(sets.train), cfg.sampler)
    assert restored.state_dict() == sampler.state_dict()


def test_the_pool_grows_on_retirements_and_when_few_live_tasks_are_open(tmp_path):
    """A new retirement asks for tasks once (until the next job starts); so does a pool whose live tasks
    are mostly solved (recent pass rate >= 3/4), or one with none live."""
    pool = TaskPool(PoolConfig(min_open_share=0.5), [str(tmp_path)], tmp_path / "pool", seed=0, base_ids=[])
    sampler = TaskSampler(["a", "b", "c", "d"], SamplerConfig(retire_after=4))
    assert not pool._wants_tasks(sampler.stats)            # unsampled: p = 1/2, every task open
    sampler.record("a", [1.0] * 4)
    assert pool._wants_tasks(sampler.stats)                # a retirement
    pool.state["retired_at_start"] = 1                     # a job began since
    assert not pool._wants_tasks(sampler.stats)
    solved = [1.0, 1.0, 1.0, 0.0] * 3 + [1.0] * 3          # p ~ 0.755, never 4 passes running: not retired
    sampler.record("b", solved)                            # 2 of 3 live tasks solved
    sampler.record("c", solved)
    assert pool._wants_tasks(sampler.stats)
    sampler.record("b", [0.0] * 3)
    assert not pool._wants_tasks(sampler.stats)            # 2 of 3 open again
    for task in "bcd":
        sampler.record(task, [1.0] * 4)
    pool.state["retired_at_start"] = 4
    assert pool._wants_tasks(sampler.stats)                # nothing live


def test_a_job_running_at_a_stop_is_made_again(tmp_path):
    """close() stops the generation process; the pool reopened from its directory has no trace of that job
    and starts it again when asked."""
    repo = write_repo(tmp_path / "zebrakit", SOURCES)
    sampler = TaskSampler(["a"])
    sampler.record("a", [1.0] * 16)                # retired: the pool is asked to grow
    pool = TaskPool(PoolConfig(), [str(repo)], tmp_path / "pool", seed=0, base_ids=["a"])
    assert pool.poll(sampler.stats) == [] and pool._job is not None
    process = pool._job[0]
    pool.close()
    assert process.poll() is not None and not pool.tasks()
    again = TaskPool(PoolConfig(), [str(repo)], tmp_path / "pool", seed=0, base_ids=["a"])
    assert not list((tmp_path / "pool" / "jobs").iterdir()) and not again.tasks()
    assert again.poll(sampler.stats) == [] and again._job is not None and again._job[2]["level"] == "body"
    again.close()


def test_worker_imports_no_jax_and_reports_a_failing_generator(tmp_path):
    """The job process runs without jax; a generator's error ends the job with that error as one line."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = {"family": "feature_deletion", "repo": str(tmp_path / "missing"), "level": "body", "seed": 0,
           "max_tasks": 2, "skip_ids": []}
    (job_dir / "job.json").write_text(json.dumps(job))
    code = ("import runpy, sys; sys.argv = ['families', sys.argv[1]]; "
            "runpy.run_module('composer_jax.tasks.families', run_name='__main__'); "
            "assert 'jax' not in sys.modules, 'the worker imported jax'")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(job_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads((job_dir / "result.json").read_text())
    assert result["tasks"] == [] and result["error"].startswith("FeatureDeletionError: REPO_DIR ")


@pytest.mark.parametrize("family", sorted(GENERATORS))
def test_every_registered_family_resolves(tmp_path, family):
    """Each entry names a real generator and config: called, it reaches the generator's own input check."""
    generator = GENERATORS[family]
    with pytest.raises(FeatureDeletionError, match="^REPO_DIR .*missing: not a directory"):
        generator.make(tmp_path / "missing", tmp_path / "out", max_tasks=2, seed=0, level=generator.levels[-1])


def test_a_family_is_one_registry_entry(tmp_path, monkeypatch):
    """A family is a module, its generator and its config: the job calls it with max_tasks, seed (and
    level), renames its tasks to pool ids and drops those the pool has."""
    module = tmp_path / "fake_family.py"
    module.write_text(
        "import dataclasses, json, pathlib\n"
        "@dataclasses.dataclass\nclass Config:\n    max_tasks: int\n    seed: int\n"
        "def generate(repo_dir, out_dir, config):\n"
        "    ids = [f'bug{i}' for i in range(config.max_tasks)]\n"
        "    for i in ids:\n"
        "        (pathlib.Path(out_dir) / i).mkdir(parents=True)\n"
        "        (pathlib.Path(out_dir) / i / 'task.json').write_text(json.dumps({'id': i}))\n"
        "    return {'tasks': [{'id': i} for i in ids], 'kept': len(ids), 'tried': len(ids)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(GENERATORS, "fake", Family("fake_family", "generate", "Config"))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    skip = pool_id("fake", "/x/my repo", "", "bug0")
    (job_dir / "job.json").write_text(json.dumps({"family": "fake", "repo": "/x/my repo", "level": "", "seed": 3,
                                                  "max_tasks": 3, "skip_ids": [skip]}))
    result = run_job(job_dir)
    assert skip == "fake-my_repo-bug0" and result["tasks"] == ["fake-my_repo-bug1", "fake-my_repo-bug2"]
    assert result["duplicates"] == 1 and result["error"] is None
    assert json.loads((job_dir / "tasks" / "fake-my_repo-bug2" / "task.json").read_text())["id"] == "fake-my_repo-bug2"


@pytest.mark.parametrize("overrides, key", [
    (["env.repos=[{tmp}/missing]"], "env.repos[0]"),
    (["env.repos=[{tmp}, {tmp}]"], "env.repos[1]"),
    (["env.repos=[{tmp}]", "env.pool.levels=[whole]"], "env.pool.levels"),
    (["env.repos=[{tmp}]", "env.pool.family=bugs"], "env.pool.family"),
    (["env.repos=[{tmp}]", "env.pool.min_open_share=2"], "env.pool.min_open_share"),
    (["env.repos=[{tmp}]", "rollout.transport=directory"], "env.repos"),
    (["env.kind=toy", "env.repos=[{tmp}]"], "env.repos"),
])
def test_bad_pool_settings_name_the_key(tmp_path, overrides, key):
    coding = ["env.kind=coding", f"env.tasks_dir={tmp_path}"]
    with pytest.raises(ConfigError) as e:
        load_rl_config("rl-tiny", [*TINY, *coding, *(o.format(tmp=tmp_path) for o in overrides)])
    assert e.value.key == key, str(e.value)


def test_the_pool_is_off_by_default():
    cfg = load_rl_config("rl-tiny", TINY)
    assert cfg.env.repos == () and cfg.env.pool == PoolConfig()
