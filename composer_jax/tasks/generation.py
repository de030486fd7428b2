"""What every task family's generator shares: the clean copy and the traced baseline, staging and
checking one candidate change in the sandbox, trying candidates `workers` at a time, the hold-out and
the report.

A family (feature_deletion.py, bug_injection.py) turns the baseline into candidates, each a set of
file edits with the passing tests that ran the changed code; `evaluate` stages one: the edits, the
leak scrub, solution.patch (the edits reversed), a measuring run (which tests fail now), then the
task.json the family describes from the failing targets, the solution check and the leak scan.
Rejections are counted by REJECTED reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from composer_jax.sandbox import Sandbox, run_parallel
from composer_jax.tasks.check import check_task
from composer_jax.tasks.features import FileEdit
from composer_jax.tasks.format import load_task
from composer_jax.tasks.scrub import (clean_copy, find_leaks, installed_copies, repo_texts, scrub_leaks,
                                      top_level_names)
from composer_jax.tasks.tracing import UNSTABLE_REASON, Baseline, FeatureDeletionError, run_baseline
from composer_jax.tasks.workspace import copy_repo, unified_diff

DEFAULT_TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q"
REJECTED = ("no_test_fails", "collateral_failures", "timeout", "run_error", "solution_fails", "leak")
MIN_TASK_TIMEOUT_S = 30.0
TASK_TIMEOUT_FACTOR = 3        # a task's time limit: this many times the (traced) baseline run
HELD_OUT = "held-out"


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Settings every family has; a family's config adds its own."""
    max_tasks: int = 20
    workers: int = 1
    seed: int = 0
    test_command: str | None = None      # default: DEFAULT_TEST_COMMAND, with PYTHONPATH=src for a src/ layout
    timeout_s: float = 600.0             # limit of the baseline run (a hanging suite stops there)
    max_target_fraction: float = 0.5     # run by more of the passing tests, a definition is not specific
    backend: str = "bwrap"
    held_out: int = 0                    # the last kept tasks (by id) go to OUT_DIR/held-out/: for evaluation only

    def __post_init__(self):
        for name in ("max_tasks", "workers", "timeout_s"):
            if not getattr(self, name) > 0:
                raise FeatureDeletionError(f"task generation setting '{name}' must be > 0, got {getattr(self, name)}")
        if not 0 <= self.held_out < self.max_tasks:
            raise FeatureDeletionError(f"task generation setting 'held_out' must be in [0, max_tasks={self.max_tasks}),"
                                       f" got {self.held_out}")
        if not 0 < self.max_target_fraction <= 1:
            raise FeatureDeletionError(f"task generation setting 'max_target_fraction' must be in (0, 1], got "
                                       f"{self.max_target_fraction}")


@dataclasses.dataclass(frozen=True)
class Outcome:
    candidate: object              # the family's candidate (with an `id`)
    reason: str | None             # None: kept; else one of REJECTED
    detail: str = ""
    stage: Path | None = None      # the staged task directory, when kept
    targets: int = 0
    removed_files: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Context:
    sandbox: Sandbox
    base: Path                     # the clean copy every task starts from
    stage: Path                    # where tasks are staged
    texts: dict[str, str]          # scrub.repo_texts of base
    baseline: Baseline
    command: str                   # the tasks' test command
    timeout_s: float               # the tasks' time limit


# describe(targets, failure messages {test: message}) -> (instruction, more task.json keys)
Describe = Callable[[list[str], dict[str, str]], tuple[str, dict]]


def default_test_command(repo: Path) -> str:
    src = repo / "src"
    src_layout = src.is_dir() and any(p.suffix == ".py" or (p / "__init__.py").is_file() for p in src.iterdir())
    return f"PYTHONPATH=src {DEFAULT_TEST_COMMAND}" if src_layout else DEFAULT_TEST_COMMAND


def check_dirs(repo: Path, out: Path) -> None:
    if not repo.is_dir():
        raise FeatureDeletionError(f"REPO_DIR {repo}: not a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FeatureDeletionError(f"OUT_DIR {out}: exists and is not an empty directory")
    r, o = repo.resolve(), out.resolve()
    if o == r or r in o.parents:
        raise FeatureDeletionError(f"OUT_DIR {out} is inside REPO_DIR {repo}: REPO_DIR is never written to")


def prepare(repo: Path, tmp: Path, sandbox: Sandbox, config: GenerationConfig,
            log: Callable[[str], None]) -> tuple[Path, str, Baseline]:
    """The clean copy of REPO_DIR under `tmp`, its test command and its baseline (FeatureDeletionError:
    unusable, one line)."""
    try:
        base = clean_copy(repo, tmp / "base")
    except (OSError, shutil.Error) as e:
        raise FeatureDeletionError(f"REPO_DIR {repo}: cannot be copied: {str(e)[:300]}") from None
    installed = installed_copies(sandbox, top_level_names(base))
    if installed:
        name, where = next(iter(installed.items()))
        raise FeatureDeletionError(f"'{name}' is installed in the sandbox's Python ({where}): the agent could "
                                   "read the original code there and tests would not need the workspace; "
                                   "uninstall it")
    command = config.test_command or default_test_command(base)
    baseline = run_baseline(sandbox, base, command, config.timeout_s)
    if baseline.failing:
        log(f"{len(baseline.failing)} tests do not pass before any change and are left out, e.g. "
            f"{baseline.failing[0]}")
    if baseline.unstable:
        log(f"{len(baseline.unstable)} tests have unstable ids and are left out: {UNSTABLE_REASON}; e.g. "
            f"{baseline.unstable[0]}")
    return base, command, baseline


def _write_task(root: Path, name: str, ctx: Context, targets: list[str], keep: list[str], text: str,
                extra: dict) -> None:
    meta = {"id": name, "instruction": text, "test_command": ctx.command, "target_tests": targets,
            "pass_to_pass": keep, "timeout_s": ctx.timeout_s, **extra}
    (root / "task.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _first(tests, order: tuple[str, ...]) -> str:
    return min(tests, key=order.index)


def evaluate(candidate, files: Sequence[FileEdit], needles: set[str], describe: Describe, ctx: Context) -> Outcome:
    """Stage `candidate` (its `id`; its `tests`: the passing tests that ran the changed code) with the
    edits `files` and check it (module docstring); `needles`: what must not be left in the task."""
    stage = ctx.stage / candidate.id
    repo = copy_repo(ctx.base, stage / "repo")
    for edit in files:
        if edit.modified is None:
            (repo / edit.path).unlink()
        else:
            (repo / edit.path).write_text(edit.modified, encoding="utf-8")
    removed = tuple(scrub_leaks(repo, needles))
    (stage / "solution.patch").write_text("".join(unified_diff(e.path, e.modified, e.original) for e in files),
                                          encoding="utf-8")
    passed = list(ctx.baseline.passed)

    def reject(reason: str, detail: str) -> Outcome:
        shutil.rmtree(stage)
        return Outcome(candidate, reason, detail)

    # Every passing test as a target: the check then reports which of them fail after the change.
    _write_task(stage, candidate.id, ctx, passed, [], "Measuring which tests fail.", {})
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
    text, extra = describe(targets, {t: run.messages[t] for t in targets if t in run.messages})
    _write_task(stage, candidate.id, ctx, targets, [t for t in passed if t not in failing], text, extra)
    solved = check_task(load_task(stage), ctx.sandbox, solution=True)
    if solved.status != "ok" or solved.reward != 1.0:
        first = _first(solved.failed, ctx.baseline.tests) if solved.failed else ""
        why = solved.messages.get(first, "missing or skipped").strip().splitlines() or [""]
        return reject("solution_fails", solved.detail or f"{len(solved.failed)} tests fail with solution.patch, "
                                                         f"e.g. {first} ({why[0][:200]})")
    leaks = find_leaks(stage, needles, skip=[stage / "solution.patch"])
    if leaks:
        return reject("leak", "; ".join(f"{path}: {why}" for path, why in sorted(leaks.items())))
    return Outcome(candidate, None, stage=stage, targets=len(targets), removed_files=removed)


def try_all(candidates: list, check: Callable[[object], Outcome], config: GenerationConfig, out: Path,
            log: Callable[[str], None], kept_line: Callable[[Outcome], str]) -> list[Outcome]:
    """`check` candidates `workers` at a time until `max_tasks` are kept; kept tasks move to OUT_DIR.
    Outcomes past the last kept task of a batch are dropped, so the result does not depend on workers.
    `kept_line`: what the progress line says of a kept task."""
    outcomes: list[Outcome] = []
    kept = 0
    for first in range(0, len(candidates), config.workers):
        if kept >= config.max_tasks:
            break
        for outcome in run_parallel(check, candidates[first:first + config.workers], config.workers):
            if kept >= config.max_tasks:
                if outcome.stage is not None:
                    shutil.rmtree(outcome.stage)
                continue
            outcomes.append(outcome)
            name = outcome.candidate.id
            if outcome.reason is None:
                kept += 1
                shutil.move(outcome.stage, out / name)
                log(f"[{len(outcomes)}/{len(candidates)}] {name}: kept, {outcome.targets} target tests, "
                    f"{kept_line(outcome)}")
            else:
                log(f"[{len(outcomes)}/{len(candidates)}] {name}: rejected, {outcome.reason}: {outcome.detail}")
    return outcomes


def hold_out(out: Path, ids: list[str], count: int) -> list[str]:
    """Move the last `count` of the kept tasks `ids` into OUT_DIR/held-out/ (a task directory of its own,
    which loading OUT_DIR does not see: train on OUT_DIR, evaluate on OUT_DIR/held-out); their ids."""
    held = ids[len(ids) - count:] if count and len(ids) > count else []
    if held:
        (out / HELD_OUT).mkdir()
        for task_id in held:
            shutil.move(out / task_id, out / HELD_OUT / task_id)
    return held


def counts(counter: Counter) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a family makes of the baseline: its candidates in the order to try them, how to check one,
    what the progress line says of a kept one, and the family's keys of report.json."""
    candidates: list
    check: Callable[[object, Context], Outcome]
    kept_line: Callable[[Outcome], str]
    report: Callable[[list[Outcome]], dict]
    test_options: str = ""         # added to the tasks' test command


def generate(repo_dir: str | Path, out_dir: str | Path, config: GenerationConfig, sandbox: Sandbox | None,
             log: Callable[[str], None], make_plan: Callable[[dict[str, str], Baseline], Plan],
             prepared: tuple[Path, str, Baseline] | None = None) -> dict:
    """Write a family's tasks of REPO_DIR into OUT_DIR: the clean copy and the baseline (or `prepared`,
    `prepare`'s result for REPO_DIR, when several families share them), `make_plan(texts, baseline)`
    (texts: scrub.repo_texts of the copy), the candidates tried, the hold-out and the report (returned,
    and OUT_DIR/report.json). FeatureDeletionError: unusable input, one line."""
    start = time.monotonic()
    repo, out = Path(repo_dir), Path(out_dir)
    check_dirs(repo, out)
    sandbox = sandbox or Sandbox(config.backend)
    with tempfile.TemporaryDirectory(prefix="composer_jax-generate-") as tmp:
        base, command, baseline = prepared or prepare(repo, Path(tmp), sandbox, config, log)
        texts = repo_texts(base)
        plan = make_plan(texts, baseline)
        out.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / "stage").mkdir()
        ctx = Context(sandbox, base, Path(tmp) / "stage", texts, baseline, f"{command} {plan.test_options}".strip(),
                      max(MIN_TASK_TIMEOUT_S, math.ceil(TASK_TIMEOUT_FACTOR * baseline.seconds)))
        outcomes = try_all(plan.candidates, lambda c: plan.check(c, ctx), config, out, log, plan.kept_line)
    report = {**_report_head(repo, command, config, baseline, outcomes, time.monotonic() - start),
              **plan.report(outcomes)}
    report["held_out"] = hold_out(out, sorted(t["id"] for t in report["tasks"]), config.held_out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def _report_head(repo: Path, command: str, config: GenerationConfig, baseline: Baseline, outcomes: list[Outcome],
                 seconds: float) -> dict:
    """The report's keys every family has (the family adds its candidates and tasks)."""
    rejected = Counter(o.reason for o in outcomes if o.reason)
    return {
        "repo": str(repo), "test_command": command, "seed": config.seed, "seconds": round(seconds, 1),
        "baseline": {"tests": len(baseline.tests), "passed": len(baseline.passed), "skipped": len(baseline.skipped),
                     "left_out": list(baseline.failing),
                     "unstable_ids": {"tests": list(baseline.unstable), "reason": UNSTABLE_REASON},
                     "seconds": round(baseline.seconds, 1)},
        "tried": len(outcomes), "kept": sum(o.reason is None for o in outcomes),
        "rejected": {r: rejected[r] for r in REJECTED if rejected[r]},
        "rejections": [{"id": o.candidate.id, "reason": o.reason, "detail": o.detail} for o in outcomes if o.reason],
    }


def summary(report: dict, candidates_label: str = "candidates") -> str:
    """The report in a few lines, for the command line."""
    b = report["baseline"]
    rejected = sum(report["rejected"].values())
    unstable = len(b["unstable_ids"]["tests"])
    left_out = f"{len(b['left_out'])} left out (not passing)"
    if unstable:
        left_out += f", {unstable} left out (unstable ids)"
    baseline = (f"baseline: {b['tests']} tests, {b['passed']} pass, {b['skipped']} skipped, {left_out} "
                f"({b['seconds']} s)")
    candidates = (f"{candidates_label}: {report['candidates']} "
                  f"(not candidates: {counts(Counter(report['not_candidates']))})")
    tried = (f"tried {report['tried']}: kept {report['kept']}, rejected {rejected} "
             f"({counts(Counter(report['rejected']))}); {report['seconds']} s")
    held = report.get("held_out") or []
    return f"{baseline}\n{candidates}\n{tried}" + (f"\nheld out in {HELD_OUT}/: {', '.join(held)}" if held else "")
