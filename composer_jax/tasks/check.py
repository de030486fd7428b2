"""Checking a task: run its tests in the sandbox on a copy of the workspace and turn them into a reward.

reward = passed target tests / target tests (a target that did not run counts as failed), or, with no
target tests, 1 if the test command exits 0; 0 if any pass-to-pass test does not pass; 0 with status
`timeout` when the time limit is hit; 0 with status `patch_failed` when --solution's patch does not
apply; status `error` when target tests were expected but pytest wrote no report.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from composer_jax.sandbox import Limits, RunResult, Sandbox, run_parallel
from composer_jax.tasks.format import Task
from composer_jax.tasks.junit import PASSED, junit_key, outcomes_for, read_report
from composer_jax.tasks.workspace import apply_patch, copy_repo, restore_tests

REPORT_NAME = ".composer_jax_junit.xml"
STATUSES = ("ok", "timeout", "error", "patch_failed")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    task: str
    reward: float
    passed: tuple[str, ...]      # target and pass-to-pass node ids that passed
    failed: tuple[str, ...]      # those that did not (failed, errored, skipped or did not run)
    status: str                  # one of STATUSES
    seconds: float
    exit_code: int | None = None
    detail: str = ""             # why, when status is not ok (or a limit was hit)
    messages: dict[str, str] = dataclasses.field(default_factory=dict)   # failed node id -> pytest's message

    def to_json(self) -> dict:
        return {"task": self.task, "reward": self.reward, "passed": list(self.passed), "failed": list(self.failed),
                "status": self.status, "seconds": round(self.seconds, 3), "exit_code": self.exit_code,
                "detail": self.detail}


def tail(text: str, lines: int = 5) -> str:
    """The last lines of a command's output on one line."""
    return " | ".join(text.strip().splitlines()[-lines:])


def limits_for(timeout_s: float, sandbox: Sandbox, limits: Limits | None = None) -> Limits:
    """`limits` (default: the sandbox's) with the wall time, and at least as much CPU time, of a test run."""
    limits = limits or sandbox.limits
    return dataclasses.replace(limits, wall_s=timeout_s, cpu_s=max(limits.cpu_s, math.ceil(timeout_s)))


def run_pytest(sandbox: Sandbox, repo: Path, command: str, limits: Limits, *, addopts: str = "",
               env: dict[str, str] | None = None,
               messages: dict[tuple[str, str], str] | None = None
               ) -> tuple[RunResult, dict[tuple[str, str], str] | None]:
    """Run a pytest `command` in the sandbox in `repo` (written to: pass a copy) with pytest writing its
    JUnit report there (and no cache); returns the run and the report's outcomes (None: no report).
    `addopts`: more pytest options; `env`: more environment variables; `messages`: see read_report."""
    (repo / REPORT_NAME).unlink(missing_ok=True)  # only pytest's own report counts
    inside = sandbox.workspace_path or str(repo)
    options = f"--junitxml={inside}/{REPORT_NAME} --rootdir={inside} -p no:cacheprovider {addopts}".strip()
    result = sandbox.run(command, repo, limits=limits, env={**(env or {}), "PYTEST_ADDOPTS": options})
    return result, read_report(repo / REPORT_NAME, messages)


def check_task(task: Task, sandbox: Sandbox, *, workspace: Path | None = None, solution: bool = False,
               limits: Limits | None = None) -> CheckResult:
    """Grade `workspace` (an agent's edited copy of task.repo; default: the task's own repo) against the
    task's tests. With a workspace, the task's test files are restored first. `solution`: apply
    solution.patch first. Nothing of the task directory or of `workspace` is modified."""
    start = time.monotonic()
    limits = limits_for(task.timeout_s, sandbox, limits)
    done = lambda reward, status, **kw: CheckResult(task.id, reward, status=status,  # noqa: E731
                                                    seconds=time.monotonic() - start, **kw)
    with tempfile.TemporaryDirectory(prefix=f"composer_jax-check-{task.id}-") as tmp:
        repo = copy_repo(workspace or task.repo, Path(tmp) / "repo")
        if workspace is not None:
            restore_tests(task.repo, repo, task.test_paths)
        if solution:
            applied = apply_patch(sandbox, repo, task.solution_patch, limits)
            if not applied.ok:
                return done(0.0, "patch_failed", passed=(), failed=task.target_tests + task.pass_to_pass,
                            exit_code=applied.exit_code, detail=f"git apply: {tail(applied.stderr)}")
        messages: dict[tuple[str, str], str] = {}
        result, report = run_pytest(sandbox, repo, task.test_command, limits, messages=messages)
    outcomes = outcomes_for(task.target_tests + task.pass_to_pass, report)
    said = {n: messages[junit_key(n)] for n in outcomes if junit_key(n) in messages}
    passed = tuple(n for n, o in outcomes.items() if o == PASSED)
    failed = tuple(n for n, o in outcomes.items() if o != PASSED)
    detail = result.describe() if result.limits_hit else ""
    if result.timed_out:
        return done(0.0, "timeout", passed=passed, failed=failed, exit_code=None, detail=detail)
    if task.target_tests:
        reward = sum(outcomes[n] == PASSED for n in task.target_tests) / len(task.target_tests)
    else:
        reward = float(result.exit_code == 0)
    if any(outcomes[n] != PASSED for n in task.pass_to_pass):
        reward = 0.0
    status = "ok"
    if report is None and (task.target_tests or task.pass_to_pass):
        status = "error"
        detail = f"pytest wrote no report ({result.describe()}): {tail(result.stdout + result.stderr)}"
    return done(reward, status, passed=passed, failed=failed, exit_code=result.exit_code, detail=detail,
                messages=said)


def check_tasks(tasks: Sequence[Task], sandbox: Sandbox, *, solution: bool = False,
                workers: int = 1) -> list[CheckResult]:
    """check_task over many tasks, `workers` sandboxes at a time; results in input order."""
    return run_parallel(lambda t: check_task(t, sandbox, solution=solution), tasks, workers)


def summary_line(results: Sequence[CheckResult], seconds: float) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    mean = sum(r.reward for r in results) / max(len(results), 1)
    solved = sum(r.reward == 1.0 for r in results)
    statuses = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return (f"{len(results)} tasks: mean reward {mean:.3f}, {solved} with reward 1; {statuses}; "
            f"{seconds:.1f} s")
