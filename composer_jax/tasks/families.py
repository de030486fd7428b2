"""Task families: the generators that make coding tasks from a repository, by name, behind one call.

    GENERATORS["feature_deletion"].make(repo_dir, out_dir, max_tasks=4, seed=0, level="body")   # -> report

Every family's generator has the shape `generate(repo_dir, out_dir, config) -> report` (report.json's
dict) with a config that takes `max_tasks` and `seed`, and `level` when the family has levels (listed
easiest first). Adding a family is one line in GENERATORS (its module is imported only when used).

`python -m composer_jax.tasks.families JOB_DIR` runs one generation job of the RL task pool
(`composer_jax.rl.task_pool`) in a process of its own: it reads JOB_DIR/job.json, makes the tasks into
JOB_DIR/out, moves each new one to JOB_DIR/tasks/<pool id> (its task.json id rewritten to that id;
tasks whose id the pool already has are dropped) and writes JOB_DIR/result.json last (atomically: its
presence means the job is over). No jax is imported here.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from composer_jax.tasks.format import LEVELS

RESULT = "result.json"


@dataclasses.dataclass(frozen=True)
class Family:
    module: str                       # where the generator lives
    generate: str                     # its function: (repo_dir, out_dir, config) -> report dict
    config: str                       # its config class: max_tasks=, seed= (and level= when levels)
    levels: tuple[str, ...] = ("",)   # easiest first; ("",): the family has no levels

    def make(self, repo_dir: str | Path, out_dir: str | Path, *, max_tasks: int, seed: int, level: str = "") -> dict:
        module = importlib.import_module(self.module)
        config = getattr(module, self.config)(max_tasks=max_tasks, seed=seed, **({"level": level} if level else {}))
        return getattr(module, self.generate)(repo_dir, out_dir, config)


GENERATORS = {
    "feature_deletion": Family("composer_jax.tasks.feature_deletion", "generate_tasks", "FeatureDeletionConfig",
                               LEVELS),
    "bug_injection": Family("composer_jax.tasks.bug_injection", "generate_bug_tasks", "BugInjectionConfig"),
}


def pool_id(family: str, repo: str | Path, level: str, task_id: str) -> str:
    """A task id unique across families, repositories and levels: 'feature_deletion-zebrakit-body-mod.f'."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(repo).name) or "repo"
    return "-".join(p for p in (family, name, level, task_id) if p)


def adopt_tasks(tasks: list[dict], made_dir: Path, dest: Path, family: str, repo: str | Path, level: str,
                skip: set[str]) -> list[str]:
    """Move a generator's `tasks` (report.json's entries) from MADE_DIR to DEST under their pool ids
    (task.json's id rewritten to it), leaving out those whose pool id is in `skip`; the ids moved, in order."""
    moved = []
    for task in tasks:
        new_id = pool_id(family, repo, level, task["id"])
        if new_id in skip:
            continue
        meta_path = made_dir / task["id"] / "task.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta_path.write_text(json.dumps({**meta, "id": new_id}, indent=2) + "\n", encoding="utf-8")
        shutil.move(made_dir / task["id"], dest / new_id)
        moved.append(new_id)
    return moved


def run_job(job_dir: Path) -> dict:
    """The job in JOB_DIR/job.json: {family, repo, level, seed, max_tasks, skip_ids}; returns (and writes)
    the result: {tasks: [pool ids, in the generator's order], duplicates, kept, tried, seconds, error}."""
    start = time.monotonic()
    job = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))
    result = {"tasks": [], "duplicates": 0, "kept": 0, "tried": 0, "error": None}
    try:
        report = GENERATORS[job["family"]].make(job["repo"], job_dir / "out", max_tasks=job["max_tasks"],
                                               seed=job["seed"], level=job["level"])
    except Exception as e:  # noqa: BLE001  (the generator's one-line input errors, and anything else: reported)
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    else:
        (job_dir / "tasks").mkdir()
        result["tasks"] = adopt_tasks(report["tasks"], job_dir / "out", job_dir / "tasks", job["family"], job["repo"],
                                      job["level"], set(job["skip_ids"]))
        result["duplicates"] = len(report["tasks"]) - len(result["tasks"])
        result.update(kept=report["kept"], tried=report["tried"], candidates=report.get("candidates", 0))
        shutil.rmtree(job_dir / "out")
    result["seconds"] = round(time.monotonic() - start, 2)
    partial = job_dir / f"{RESULT}.partial"
    partial.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, job_dir / RESULT)
    return result


if __name__ == "__main__":
    run_job(Path(sys.argv[1]))
