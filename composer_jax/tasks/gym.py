"""The coding gym: thousands of small checked tasks from generated repositories (`make_gym`).

Each repository is one module of 3-5 functions drawn from the templates (gym_templates.py), each under
a name and with constants of its own, and a pytest file with one test per function whose expected
values come from running the rendered function itself. The project's own generators then make the
tasks: feature deletion at the body level (one function's body raises NotImplementedError) and bug
injection (one small mutation of one function). So every task carries their guarantees: it fails as
given, passes with solution.patch, keeps the other tests passing and leaks nothing; and the usual
task.json keys (`family`, `level`, `difficulty`) say how hard it is.

Held-out repositories are drawn from the held-out templates only, which no training repository ever
contains: OUT_DIR/held-out measures functions the model has not seen, not only other names or constants.

    OUT_DIR/<task id>/            training tasks (task ids: pool_id(family, repo, level, id))
    OUT_DIR/held-out/<task id>/   held-out tasks
    OUT_DIR/report.json           seed, templates per split, repositories, tasks per family, seconds

The result depends only on the seed (and the targets), not on `workers`: repositories are generated in
index order, and a split stops taking tasks at the first repository that reaches its target.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from composer_jax.sandbox import Sandbox, run_parallel
from composer_jax.tasks.bug_injection import BugInjectionConfig, generate_bug_tasks
from composer_jax.tasks.families import adopt_tasks
from composer_jax.tasks.feature_deletion import FeatureDeletionConfig, generate_tasks
from composer_jax.tasks.generation import HELD_OUT, prepare
from composer_jax.tasks.gym_templates import ARG_KINDS, TEMPLATES, Template
from composer_jax.tasks.tracing import FeatureDeletionError

FUNCTIONS_PER_REPO = (3, 5)     # inclusive range
CASES_PER_FUNCTION = 5
BUGS_PER_REPO = 2
MAX_REPOS = 10_000              # a split that cannot reach its target stops here


@dataclasses.dataclass(frozen=True)
class GymConfig:
    tasks: int = 1000            # training tasks, at least
    held_out: int = 64           # held-out tasks, at least
    seed: int = 0
    workers: int = 1             # repositories generated at once
    backend: str = "bwrap"

    def __post_init__(self):
        for name in ("tasks", "workers"):
            if not getattr(self, name) > 0:
                raise FeatureDeletionError(f"gym setting '{name}' must be > 0, got {getattr(self, name)}")
        if self.held_out < 0:
            raise FeatureDeletionError(f"gym setting 'held_out' must be >= 0, got {self.held_out}")


def split_templates(held_out: bool) -> list[Template]:
    return [t for t in TEMPLATES if t.held_out == held_out]


def _call(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def render_repo(name: str, templates: list[Template], rng: random.Random) -> dict[str, str]:
    """{relative path: text} of one repository: NAME.py with one function per template (names unique in
    the module) and tests/test_NAME.py with CASES_PER_FUNCTION distinct cases per function."""
    used, functions = set(), []
    for template in templates:
        fn = rng.choice([n for n in template.names if n not in used] or [f"{template.names[0]}_{len(used)}"])
        used.add(fn)
        functions.append((fn, template, template.render(fn, rng)))
    module = f'"""Small utilities ({name}): generated for the coding gym."""\n\n\n' + "\n\n".join(
        src for _, _, src in functions)
    namespace: dict = {}
    exec(compile(module, f"{name}.py", "exec"), namespace)   # the project's own templates, not user code
    tests = [f"from {name} import {', '.join(sorted(fn for fn, _, _ in functions))}\n"]
    for fn, template, _ in functions:
        cases = []
        for _ in range(4 * CASES_PER_FUNCTION):
            args = tuple(ARG_KINDS[kind](rng) for kind in template.args)
            if args not in cases:
                cases.append(args)
            if len(cases) == CASES_PER_FUNCTION:
                break
        lines = [f"    assert {fn}({_call(args)}) == {namespace[fn](*args)!r}" for args in cases]
        tests.append(f"\n\ndef test_{fn}():\n" + "\n".join(lines) + "\n")
    return {f"{name}.py": module, f"tests/test_{name}.py": "".join(tests)}


def write_repo(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")
    return root


def repo_plan(seed: int, held_out: bool, index: int) -> tuple[str, list[Template], random.Random]:
    """The name, templates and random state of repository `index` of a split (from the seed alone)."""
    rng = random.Random(f"gym:{seed}:{'held-out' if held_out else 'train'}:{index}")
    pool = split_templates(held_out)
    count = min(len(pool), rng.randint(*FUNCTIONS_PER_REPO))
    # the module's name tells nothing of its split: a model that copies it copies the same kind of name
    # in both (a split marker in it, as gymt/gymh once were, is a shift the held-out tasks should not test)
    name = "util_" + "".join(rng.choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(6))
    return name, rng.sample(pool, count), rng


def _one_repo(work: Path, seed: int, held_out: bool, index: int, sandbox: Sandbox) -> dict:
    """Generate repository `index` of a split and its tasks under WORK/<name>; {name, root, templates, outs}."""
    name, templates, rng = repo_plan(seed, held_out, index)
    root = work / name
    repo = write_repo(root / "repo" / name, render_repo(name, templates, rng))
    order = rng.randrange(1 << 30)     # the order each generator tries its candidates in
    body_config = FeatureDeletionConfig(max_tasks=len(templates), seed=order, level="body")
    # both families start from one clean copy and traced baseline (4 sandbox runs fewer per repository)
    prepared = prepare(repo, root, sandbox, body_config, lambda line: None)
    body = generate_tasks(repo, root / "body", body_config, sandbox=sandbox, prepared=prepared)
    bugs = generate_bug_tasks(repo, root / "bugs", BugInjectionConfig(max_tasks=BUGS_PER_REPO, seed=order),
                              sandbox=sandbox, prepared=prepared)
    return {"name": name, "root": root, "templates": [t.key for t in templates],
            "outs": [(root / "body", body, "feature_deletion", "body"), (root / "bugs", bugs, "bug_injection", "")]}


def _fill_split(out: Path, work: Path, config: GymConfig, held_out: bool, target: int, sandbox: Sandbox,
                log: Callable[[str], None]) -> dict:
    """Repositories of one split, `workers` at a time in index order, until `target` tasks are kept."""
    kept, index = 0, 0
    families, repos, rejected = Counter(), [], Counter()
    while kept < target and index < MAX_REPOS:
        batch = range(index, min(index + config.workers, MAX_REPOS))
        index = batch.stop
        for made in run_parallel(lambda i: _one_repo(work, config.seed, held_out, i, sandbox), batch, config.workers):
            if kept < target:
                new = 0
                for task_dir, report, family, level in made["outs"]:
                    adopted = len(adopt_tasks(report["tasks"], task_dir, out, family, made["name"], level, set()))
                    families[family] += adopted
                    rejected.update(report["rejected"])
                    new += adopted
                kept += new
                repos.append({"name": made["name"], "templates": made["templates"], "tasks": new})
                log(f"{'held-out' if held_out else 'train'} {made['name']}: {new} tasks ({kept}/{target})")
            shutil.rmtree(made["root"])    # also a repository past the target
    return {"repos": repos, "tasks": kept, "families": dict(families), "rejected": dict(rejected)}


def make_gym(out_dir: str | Path, config: GymConfig = GymConfig(), *, sandbox: Sandbox | None = None,
             log: Callable[[str], None] = lambda line: None) -> dict:
    """Write the gym's tasks into OUT_DIR (a new or empty directory; module docstring); returns the report
    (also OUT_DIR/report.json). FeatureDeletionError: unusable input, one line."""
    start = time.monotonic()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FeatureDeletionError(f"OUT_DIR {out}: exists and is not an empty directory")
    sandbox = sandbox or Sandbox(config.backend)
    out.mkdir(parents=True, exist_ok=True)
    report = {"seed": config.seed,
              "templates": {"train": [t.key for t in split_templates(False)],
                            "held_out": [t.key for t in split_templates(True)]}}
    with tempfile.TemporaryDirectory(prefix="composer_jax-gym-") as tmp:
        report["train"] = _fill_split(out, Path(tmp), config, False, config.tasks, sandbox, log)
        if config.held_out:
            (out / HELD_OUT).mkdir()
            report["held_out"] = _fill_split(out / HELD_OUT, Path(tmp), config, True, config.held_out, sandbox, log)
    report["seconds"] = round(time.monotonic() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def summary(report: dict) -> str:
    parts = []
    for split in ("train", "held_out"):
        if split in report:
            s = report[split]
            families = ", ".join(f"{k} {v}" for k, v in sorted(s["families"].items()))
            parts.append(f"{split.replace('_', '-')}: {s['tasks']} tasks from {len(s['repos'])} repositories "
                         f"({families}; {len(report['templates'][split])} templates)")
    return "\n".join(parts + [f"{report['seconds']} s"])
