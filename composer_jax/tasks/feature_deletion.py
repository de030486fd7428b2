"""Synthetic coding tasks by feature deletion: `generate_tasks(REPO_DIR, OUT_DIR, config)`.

1. A clean copy of the repository (scrub.clean_copy); its packages must not be importable from an
   installed copy in the sandbox (scrub.installed_copies).
2. The baseline: the tests run once in the sandbox with tracing (tracing.run_baseline); tests that do
   not pass then, and tests whose node ids a second collection under another hash seed does not name
   (unstable ids), are left out of every task, and reported.
3. Candidates: functions, methods and classes that specific passing tests run (candidates.py), and
   what deleting each takes away at the `level` (levels.py: body, definition or feature).
4. In seed order, `workers` at a time, each candidate is deleted in a staged copy, leaks are scrubbed
   (scrub.py) and the tests run in the sandbox (check.check_task). A task is kept only if some tests
   now fail, all of them tests that ran the feature (the targets), every other passing test still
   passes (pass_to_pass), the task validates (format.load_task), solution.patch makes every test pass
   again (check_task with the solution) and no leak is left anywhere in its directory; until
   `max_tasks` are kept. The outcome does not depend on `workers`.
5. OUT_DIR/<id>/{repo/, task.json, solution.patch} per task, and OUT_DIR/report.json.

REPO_DIR is only ever read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from composer_jax.sandbox import Sandbox, run_parallel
from composer_jax.tasks.candidates import NOT_CANDIDATE, Candidate, select_candidates
from composer_jax.tasks.check import check_task
from composer_jax.tasks.features import Deletion, docstring, signature, word_counts
from composer_jax.tasks.format import load_task
from composer_jax.tasks.levels import CONTINUE_ON_COLLECTION_ERRORS, LEVELS, level_instruction, target_list
from composer_jax.tasks.scrub import (clean_copy, find_leaks, installed_copies, kept_code, leak_needles, repo_texts,
                                      scrub_leaks, top_level_names)
from composer_jax.tasks.tracing import UNSTABLE_REASON, Baseline, FeatureDeletionError, run_baseline
from composer_jax.tasks.workspace import copy_repo, unified_diff

DEFAULT_TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q"
REJECTED = ("no_test_fails", "collateral_failures", "timeout", "run_error", "solution_fails", "leak")
MIN_TASK_TIMEOUT_S = 30.0
TASK_TIMEOUT_FACTOR = 3        # a task's time limit: this many times the (traced) baseline run


@dataclasses.dataclass(frozen=True)
class FeatureDeletionConfig:
    max_tasks: int = 20
    workers: int = 1
    seed: int = 0
    test_command: str | None = None      # default: DEFAULT_TEST_COMMAND, with PYTHONPATH=src for a src/ layout
    timeout_s: float = 600.0             # limit of the baseline run (a hanging suite stops there)
    min_lines: int = 3                   # lines of code a deletion removes, at least
    max_target_fraction: float = 0.5     # run by more of the passing tests, a definition is not specific
    backend: str = "bwrap"
    held_out: int = 0                    # the last kept tasks (by id) go to OUT_DIR/held-out/: for evaluation only
    level: str = "body"                  # how much of a feature a task deletes: one of LEVELS (levels.py)

    def __post_init__(self):
        if self.level not in LEVELS:
            raise FeatureDeletionError(f"--level must be one of {', '.join(LEVELS)}, "
                                       f"got {self.level!r}")
        for name in ("max_tasks", "workers", "min_lines", "timeout_s"):
            if not getattr(self, name) > 0:
                raise FeatureDeletionError(f"feature deletion setting '{name}' must be > 0, got {getattr(self, name)}")
        if not 0 <= self.held_out < self.max_tasks:
            raise FeatureDeletionError(f"feature deletion setting 'held_out' must be in [0, max_tasks={self.max_tasks}), "
                                       f"got {self.held_out}")
        if not 0 < self.max_target_fraction <= 1:
            raise FeatureDeletionError(f"feature deletion setting 'max_target_fraction' must be in (0, 1], got "
                                       f"{self.max_target_fraction}")


@dataclasses.dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    reason: str | None             # None: kept; else one of REJECTED
    detail: str = ""
    stage: Path | None = None      # the staged task directory, when kept
    targets: int = 0
    removed_files: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Context:
    sandbox: Sandbox
    base: Path
    stage: Path
    texts: dict[str, str]
    baseline: Baseline
    command: str
    timeout_s: float


def default_test_command(repo: Path) -> str:
    src = repo / "src"
    src_layout = src.is_dir() and any(p.suffix == ".py" or (p / "__init__.py").is_file() for p in src.iterdir())
    return f"PYTHONPATH=src {DEFAULT_TEST_COMMAND}" if src_layout else DEFAULT_TEST_COMMAND


def instruction(deletion: Deletion, targets: list[str], command: str) -> str:
    """What is missing, from the feature's signature, docstring and tests (never its code)."""
    f = deletion.feature
    if f.kind == "class":
        methods = ", ".join(f"`{d.name}`" for d in deletion.stubbed)
        parts = [(f"The methods {methods} of the class `{f.qualname}` in `{deletion.path}` have lost their "
                  "implementation: their bodies now raise NotImplementedError. Implement them.")]
    else:
        parts = [(f"The {f.kind} `{f.qualname}` in `{deletion.path}` has lost its implementation: its body now "
                  "raises NotImplementedError. Implement it.")]
    if deletion.helpers:
        parts.append("Private helpers that only it used were removed too; write whatever helpers you need.")
    for d in ([f, *deletion.stubbed] if f.kind == "class" else [f]):
        doc = docstring(d)
        about = f"Its docstring:\n{textwrap.indent(doc, '    ')}" if doc else "It has no docstring."
        parts.append(f"{textwrap.indent(signature(d), '    ')}\n{about}")
    parts.append(target_list(targets))
    parts.append(f"Run the tests with: {command}")
    return "\n\n".join(parts)


def _write_task(root: Path, candidate: Candidate, ctx: _Context, targets: list[str], keep: list[str],
                text: str) -> None:
    d = candidate.deletion
    meta = {"id": candidate.id, "instruction": text, "test_command": ctx.command, "target_tests": targets,
            "pass_to_pass": keep, "timeout_s": ctx.timeout_s, "level": d.level,
            "difficulty": {"deleted_lines": d.deleted_lines, "deleted_definitions": d.definitions,
                           "deleted_files": len(d.deleted_files), "target_tests": len(targets), "pass_rate": None}}
    (root / "task.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _first(tests, order: tuple[str, ...]) -> str:
    return min(tests, key=order.index)


def _evaluate(candidate: Candidate, ctx: _Context) -> Outcome:
    """Stage the task and run its checks (module docstring, step 4)."""
    stage = ctx.stage / candidate.id
    d = candidate.deletion
    repo = copy_repo(ctx.base, stage / "repo")
    for edit in d.files:
        if edit.modified is None:
            (repo / edit.path).unlink()
        else:
            (repo / edit.path).write_text(edit.modified, encoding="utf-8")
    kept = kept_code(ctx.texts, d)
    needles = leak_needles(d, kept)
    removed = tuple(scrub_leaks(repo, needles))
    (stage / "solution.patch").write_text("".join(unified_diff(e.path, e.modified, e.original) for e in d.files),
                                          encoding="utf-8")
    passed = list(ctx.baseline.passed)

    def reject(reason: str, detail: str) -> Outcome:
        shutil.rmtree(stage)
        return Outcome(candidate, reason, detail)

    # Every passing test as a target: the check then reports which of them fail after the deletion.
    _write_task(stage, candidate, ctx, passed, [], "Measuring which tests fail.")
    run = check_task(load_task(stage), ctx.sandbox)
    if run.status != "ok":
        return reject("timeout" if run.status == "timeout" else "run_error", run.detail)
    failing = set(run.failed)
    if not failing:
        return reject("no_test_fails", f"all {len(passed)} tests still pass")
    collateral = failing - candidate.tests
    if collateral:
        return reject("collateral_failures", f"{len(collateral)} tests that never ran it fail, e.g. "
                                             f"{_first(collateral, ctx.baseline.tests)}")
    targets = [t for t in passed if t in failing]
    text = (instruction(d, targets, ctx.command) if d.level == "body" else
            level_instruction(d, targets, ctx.command, ctx.texts, word_counts(kept)))
    _write_task(stage, candidate, ctx, targets, [t for t in passed if t not in failing], text)
    solved = check_task(load_task(stage), ctx.sandbox, solution=True)
    if solved.status != "ok" or solved.reward != 1.0:
        return reject("solution_fails", solved.detail or f"{len(solved.failed)} tests fail with solution.patch, "
                                                         f"e.g. {_first(solved.failed, ctx.baseline.tests)}")
    leaks = find_leaks(stage, needles, skip=[stage / "solution.patch"])
    if leaks:
        return reject("leak", "; ".join(f"{path}: {why}" for path, why in sorted(leaks.items())))
    return Outcome(candidate, None, stage=stage, targets=len(targets), removed_files=removed)


def _check_dirs(repo: Path, out: Path) -> None:
    if not repo.is_dir():
        raise FeatureDeletionError(f"REPO_DIR {repo}: not a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FeatureDeletionError(f"OUT_DIR {out}: exists and is not an empty directory")
    r, o = repo.resolve(), out.resolve()
    if o == r or r in o.parents:
        raise FeatureDeletionError(f"OUT_DIR {out} is inside REPO_DIR {repo}: REPO_DIR is never written to")


def _try_all(candidates: list[Candidate], ctx: _Context, config: FeatureDeletionConfig, out: Path,
             log: Callable[[str], None]) -> list[Outcome]:
    """Evaluate candidates `workers` at a time until `max_tasks` are kept; kept tasks move to OUT_DIR.
    Outcomes past the last kept task of a batch are dropped, so the result does not depend on workers."""
    outcomes: list[Outcome] = []
    kept = 0
    for first in range(0, len(candidates), config.workers):
        if kept >= config.max_tasks:
            break
        for outcome in run_parallel(lambda c: _evaluate(c, ctx), candidates[first:first + config.workers],
                                    config.workers):
            if kept >= config.max_tasks:
                if outcome.stage is not None:
                    shutil.rmtree(outcome.stage)
                continue
            outcomes.append(outcome)
            name = outcome.candidate.id
            if outcome.reason is None:
                kept += 1
                shutil.move(outcome.stage, out / name)
                d = outcome.candidate.deletion
                log(f"[{len(outcomes)}/{len(candidates)}] {name}: kept, {outcome.targets} target tests, "
                    f"{d.definitions} definitions and {len(d.deleted_files)} files deleted")
            else:
                log(f"[{len(outcomes)}/{len(candidates)}] {name}: rejected, {outcome.reason}: {outcome.detail}")
    return outcomes


def generate_tasks(repo_dir: str | Path, out_dir: str | Path, config: FeatureDeletionConfig = FeatureDeletionConfig(),
                   *, sandbox: Sandbox | None = None, log: Callable[[str], None] = lambda line: None) -> dict:
    """Write feature-deletion tasks of the repository REPO_DIR into OUT_DIR (see the module docstring);
    returns the report (also OUT_DIR/report.json). FeatureDeletionError: unusable input, one line."""
    start = time.monotonic()
    repo, out = Path(repo_dir), Path(out_dir)
    _check_dirs(repo, out)
    sandbox = sandbox or Sandbox(config.backend)
    with tempfile.TemporaryDirectory(prefix="composer_jax-features-") as tmp:
        try:
            base = clean_copy(repo, Path(tmp) / "base")
        except (OSError, shutil.Error) as e:
            raise FeatureDeletionError(f"REPO_DIR {repo}: cannot be copied: {str(e)[:300]}") from None
        installed = installed_copies(sandbox, top_level_names(base))
        if installed:
            name, where = next(iter(installed.items()))
            raise FeatureDeletionError(f"'{name}' is installed in the sandbox's Python ({where}): the agent could "
                                       "read the deleted code there and tests would not need the workspace; "
                                       "uninstall it")
        command = config.test_command or default_test_command(base)
        baseline = run_baseline(sandbox, base, command, config.timeout_s)
        if baseline.failing:
            log(f"{len(baseline.failing)} tests do not pass before any deletion and are left out, e.g. "
                f"{baseline.failing[0]}")
        if baseline.unstable:
            log(f"{len(baseline.unstable)} tests have unstable ids and are left out: {UNSTABLE_REASON}; e.g. "
                f"{baseline.unstable[0]}")
        texts = repo_texts(base)
        candidates, skipped = select_candidates(texts, baseline, min_lines=config.min_lines,
                                                max_target_fraction=config.max_target_fraction, seed=config.seed,
                                                level=config.level)
        log(f"{len(candidates)} candidates ({sum(skipped.values())} definitions are not: {_counts(skipped)})")
        out.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / "stage").mkdir()
        # at the levels that delete whole definitions, a test module may not import: the others still run
        task_command = command if config.level == "body" else f"{command} {CONTINUE_ON_COLLECTION_ERRORS}"
        ctx = _Context(sandbox, base, Path(tmp) / "stage", texts, baseline, task_command,
                       max(MIN_TASK_TIMEOUT_S, math.ceil(TASK_TIMEOUT_FACTOR * baseline.seconds)))
        outcomes = _try_all(candidates, ctx, config, out, log)
    report = _report(repo, command, config, baseline, candidates, skipped, outcomes, time.monotonic() - start)
    report["held_out"] = _hold_out(out, sorted(t["id"] for t in report["tasks"]), config.held_out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


HELD_OUT = "held-out"


def _hold_out(out: Path, ids: list[str], count: int) -> list[str]:
    """Move the last `count` of the kept tasks `ids` into OUT_DIR/held-out/ (a task directory of its own,
    which loading OUT_DIR does not see: train on OUT_DIR, evaluate on OUT_DIR/held-out); their ids."""
    held = ids[len(ids) - count:] if count and len(ids) > count else []
    if held:
        (out / HELD_OUT).mkdir()
        for task_id in held:
            shutil.move(out / task_id, out / HELD_OUT / task_id)
    return held


def _counts(counter: Counter) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _report(repo: Path, command: str, config: FeatureDeletionConfig, baseline: Baseline, candidates: list[Candidate],
            skipped: Counter, outcomes: list[Outcome], seconds: float) -> dict:
    rejected = Counter(o.reason for o in outcomes if o.reason)
    return {
        "repo": str(repo), "test_command": command, "level": config.level, "seed": config.seed,
        "seconds": round(seconds, 1),
        "baseline": {"tests": len(baseline.tests), "passed": len(baseline.passed), "skipped": len(baseline.skipped),
                     "left_out": list(baseline.failing),
                     "unstable_ids": {"tests": list(baseline.unstable), "reason": UNSTABLE_REASON},
                     "seconds": round(baseline.seconds, 1)},
        "candidates": len(candidates), "not_candidates": {r: skipped[r] for r in NOT_CANDIDATE if skipped[r]},
        "tried": len(outcomes), "kept": sum(o.reason is None for o in outcomes),
        "rejected": {r: rejected[r] for r in REJECTED if rejected[r]},
        "tasks": [{"id": o.candidate.id, "path": o.candidate.deletion.path,
                   "definition": o.candidate.deletion.feature.qualname, "kind": o.candidate.deletion.feature.kind,
                   "target_tests": o.targets, "deleted_lines": o.candidate.deletion.deleted_lines,
                   "deleted_definitions": o.candidate.deletion.definitions,
                   "deleted_files": list(o.candidate.deletion.deleted_files),
                   "removed_files": list(o.removed_files)} for o in outcomes if o.reason is None],
        "rejections": [{"id": o.candidate.id, "reason": o.reason, "detail": o.detail} for o in outcomes if o.reason],
    }


def summary(report: dict) -> str:
    """The report in a few lines, for the command line."""
    b = report["baseline"]
    rejected = sum(report["rejected"].values())
    unstable = len(b["unstable_ids"]["tests"])
    left_out = f"{len(b['left_out'])} left out (not passing)"
    if unstable:
        left_out += f", {unstable} left out (unstable ids)"
    baseline = (f"baseline: {b['tests']} tests, {b['passed']} pass, {b['skipped']} skipped, {left_out} "
                f"({b['seconds']} s)")
    level = report.get("level", "body")
    candidates = (f"candidates{'' if level == 'body' else f' (level {level})'}: {report['candidates']} "
                  f"(not candidates: {_counts(Counter(report['not_candidates']))})")
    tried = (f"tried {report['tried']}: kept {report['kept']}, rejected {rejected} "
             f"({_counts(Counter(report['rejected']))}); {report['seconds']} s")
    held = report.get("held_out") or []
    return f"{baseline}\n{candidates}\n{tried}" + (f"\nheld out in {HELD_OUT}/: {', '.join(held)}" if held else "")
