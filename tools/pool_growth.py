"""The growing task pool in a real RL run (`RLTrainer`, the tiny model): does the learner's step slow down
while tasks are made in the background, and are the new tasks harder?

The policy solves every task at once: an environment scores every episode 1 (a scripted "solver"), so
each task retires after its first `sampler.retire_after` samples (two groups). The repository: a package's sdist
(`--package`, default webcolors==24.8.0, downloaded once into OUT/sdist as tools/feature_deletion_real.py
does) or `--repo PATH`. Base tasks: 4 made by feature deletion at level `body` (once, into OUT/base).
Two arms of the same run:

- `fixed`: the base tasks only (sampler.retire_after=0: nothing retires, the run has tasks to the end);
- `growing`: env.repos=[the repository] with the pool's levels definition then feature (the base is body).

Each arm runs `--repeats` times, the arms in turn (the machine's load shifts). Per run and per arm:
the learner's step time (`learner_s`, median and quartiles over the steps after the first, which
compiles); per run the wall time, and for `growing` the step time split by whether a generation job
was running when the step's batch was produced, the pool's metrics at the end, each job's result and
the mean recorded difficulty of the tasks per level. Writes OUT/pool_growth.json and prints it.

    python tools/pool_growth.py OUT [--package webcolors==24.8.0 | --repo PATH] [--steps 20] [--repeats 2]
        [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from feature_deletion_real import download_sdist   # tools/: the sdist's unpacked source tree

from composer_jax.cpu_devices import use_cpu_devices

RUN = ["init_from=", "model=tiny", "model.rope.factor=16", "model.rope.max_position_embeddings=256",
       "model.moe.dispatch=dense", "cpu_devices=2", "rollout.devices=0", "rl.group_size=4", "rl.max_tokens=6", "rollout.batch_size=8",
       "rollout.max_new_tokens=6", "rollout.max_len=128", "rollout.max_slots=8", "rollout.feedback_window=32",
       "rl.sd_coef=0", "eval.every=0", "checkpoint.every=1000", "checkpoint.async_save=false", "progress=false",
       "env.kind=coding"]
ARMS = {"fixed": ["sampler.retire_after=0"],
        "growing": ["sampler.retire_after=8", "env.pool.levels=[definition,feature]"]}


class SolvedEnv:
    """One turn; every answer solves the task (the coding task is shown by its id: a short prompt)."""

    tools = ()

    def __init__(self):
        from composer_jax.envs import HintContext, get_format

        self.fmt, self.hint_context = get_format("plain"), HintContext((), "")

    def reset(self, task):
        return [{"role": "user", "content": task.id[:40]}]

    def step(self, text):
        return [], True, {"turn": 1, "flags": [], "task_reward": 1.0, "turns": 1, "tool_calls": 0,
                          "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0}


def source_repo(out: Path, package: str) -> Path:
    """The unpacked sdist of `package` (downloaded once into OUT/sdist)."""
    sdist = out / "sdist"
    if not (sdist / "src").is_dir():
        shutil.rmtree(sdist, ignore_errors=True)
        sdist.mkdir(parents=True)
        download_sdist(package, sdist)
    (tree,) = (sdist / "src").iterdir()
    return tree


def base_tasks(out: Path, repo: Path) -> Path:
    from composer_jax.tasks import FeatureDeletionConfig, generate_tasks

    base = out / "base"
    if not (base / "report.json").is_file():
        shutil.rmtree(base, ignore_errors=True)
        generate_tasks(repo, base, FeatureDeletionConfig(max_tasks=4, level="body"))
    return base


def quartiles(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "n": len(values)}


def run_arm(out: Path, name: str, run_name: str, repo: Path, base: Path, steps: int, overrides: list[str]) -> dict:
    from composer_jax.agents import load_task_set
    from composer_jax.rl.loop import RLTrainer
    from composer_jax.rl.run_config import load_rl_config
    from composer_jax.rl.task_sets import TaskSets
    from composer_jax.train.metrics import read_metrics

    run_dir = out / run_name
    shutil.rmtree(run_dir, ignore_errors=True)
    repos = [f"env.repos=[{repo}]"] if name == "growing" else []
    cfg = load_rl_config("rl-tiny", [*RUN, *ARMS[name], *repos, f"env.tasks_dir={base}", f"rl.steps={steps}",
                                     f"run_dir={run_dir}", *overrides])
    tasks = TaskSets({t.id: t for t in load_task_set(base)}, [], SolvedEnv, "/workspace")
    start = time.perf_counter()
    RLTrainer(cfg, tasks).run()
    wall = time.perf_counter() - start
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    steps_s = [r["learner_s"] for r in records[1:]]
    result = {"steps": len(records), "wall_s": round(wall, 1), "learner_s": quartiles(steps_s),
              "learner_s_all": steps_s}
    if name == "growing":
        last = records[-1]
        result["pool"] = {k: v for k, v in last.items() if k.startswith("pool_")}
        for running, label in ((1.0, "learner_s_job_running"), (0.0, "learner_s_no_job")):
            steps_then = [r["learner_s"] for r in records[1:] if r["pool_job_running"] == running]
            result[label] = quartiles(steps_then) if steps_then else None
        state = json.loads((run_dir / "pool" / "state.json").read_text())
        result["difficulty"] = {"body (base)": _difficulty(load_task_set(base))}
        for level in ("definition", "feature"):
            made = [t for t in tasks.train.values() if getattr(t, "level", None) == level]
            if made:
                result["difficulty"][level] = _difficulty(made)
        result["jobs"] = [json.loads((run_dir / "pool" / "jobs" / str(n) / "result.json").read_text())
                          for n in range(state["jobs"])]
    return result


def _difficulty(tasks) -> dict:
    keys = ("deleted_lines", "deleted_definitions", "deleted_files", "target_tests")
    return {"tasks": len(tasks), **{k: round(statistics.mean(t.difficulty[k] for t in tasks), 2) for k in keys}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--package", default="webcolors==24.8.0", help="a requirement whose sdist is the repository")
    parser.add_argument("--repo", type=Path, help="a repository directory instead of --package")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, the arms in turn")
    parser.add_argument("overrides", nargs="*", help="key=value for both arms' RL configs")
    args = parser.parse_args()
    use_cpu_devices(2)
    args.out.mkdir(parents=True, exist_ok=True)
    repo = args.repo.absolute() if args.repo else source_repo(args.out, args.package)
    base = base_tasks(args.out, repo)
    runs = {f"{arm}-{r}": run_arm(args.out, arm, f"{arm}-{r}", repo, base, args.steps, args.overrides)
            for r in range(args.repeats) for arm in ARMS}       # arms in turn: the machine's load shifts
    summary = {"repo": str(repo), "runs": runs, **{f"{arm}_learner_s": quartiles(
        [s for name, run in runs.items() if name.startswith(arm) for s in run.pop("learner_s_all")]) for arm in ARMS}}
    (args.out / "pool_growth.json").write_text(json.dumps(summary, indent=2) + "\n")
    shown = {**summary, "runs": {name: {k: v for k, v in run.items() if k != "jobs"} for name, run in runs.items()}}
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    sys.exit(main())
