"""The baseline of a repository's tests: which pass, and which code of the repository each one runs.

The tests run once in the sandbox, on a copy of the repository, with `trace_plugin.py` loaded into
pytest; outcomes come from pytest's JUnit report (as for grading), calls from the plugin's trace.
Then pytest collects them again under another hash seed: a test whose node id that collection does not
name (an id built from set order, an address, ...) is unstable, since grading could not find it by
name, and is left out like a test that does not pass.
Problems that make the repository unusable (not a pytest suite, no tests, a hanging suite, nothing
passing) raise FeatureDeletionError with a one-line reason.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from composer_jax.sandbox import TEST_HASH_SEED, RunResult, Sandbox
from composer_jax.tasks.check import limits_for, run_pytest, tail
from composer_jax.tasks.junit import PASSED, SKIPPED, outcomes_for
from composer_jax.tasks.workspace import copy_repo

PLUGIN_MODULE = "_composer_jax_trace"
TRACE_NAME = ".composer_jax_trace.json"
# pytest's exit codes that mean it did not get to run the tests
PYTEST_STOPPED = {2: "interrupted (e.g. a collection error)", 3: "internal error", 4: "usage error"}
PYTEST_NO_TESTS = 5
OTHER_HASH_SEED = "1"   # the second collection's PYTHONHASHSEED (every other test run has TEST_HASH_SEED)
UNSTABLE_REASON = (f"node ids that differ between two collections (PYTHONHASHSEED={TEST_HASH_SEED} and "
                   f"{OTHER_HASH_SEED}), and the other ids of their parametrized tests: built from set order, "
                   "addresses or the like, they would not name the same test in grading")

CodeKey = tuple[str, int, str]   # (path relative to the repository, first line, code name)


class FeatureDeletionError(ValueError):
    """The repository or the output directory cannot be used; the message says why, in one line."""


@dataclasses.dataclass(frozen=True)
class Baseline:
    tests: tuple[str, ...]                       # node ids in the order pytest ran them
    outcomes: dict[str, str]                     # node id -> junit outcome (PASSED, FAILED, ...)
    calls: dict[str, frozenset[CodeKey]]         # node id -> code of the repository it ran
    at_import: frozenset[CodeKey]                # code that ran outside any test (imports, collection)
    seconds: float                               # wall time of the traced run
    unstable: tuple[str, ...] = ()               # node ids another collection does not name (UNSTABLE_REASON)

    @property
    def stable(self) -> tuple[str, ...]:
        """The tests whose ids name them in every run, in run order: the only ones passed on to tasks."""
        unstable = set(self.unstable)
        return tuple(t for t in self.tests if t not in unstable)

    @property
    def passed(self) -> tuple[str, ...]:
        return tuple(t for t in self.stable if self.outcomes[t] == PASSED)

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(t for t in self.stable if self.outcomes[t] == SKIPPED)

    @property
    def failing(self) -> tuple[str, ...]:
        """Stable tests that fail, error or are missing from the report before anything is deleted."""
        return tuple(t for t in self.stable if self.outcomes[t] not in (PASSED, SKIPPED))


def _keys(entries) -> frozenset[CodeKey]:
    return frozenset((path, int(line), name) for path, line, name in entries)


def _run_traced(sandbox: Sandbox, repo: Path, command: str, timeout_s: float, *, addopts: str = "",
                extra_env: dict[str, str] | None = None) -> tuple[RunResult, dict | None, dict | None]:
    """Run `command` (pytest) on a copy of `repo` with the trace plugin; the run, its JUnit outcomes and
    the plugin's trace (None: not written). `repo` is not written to."""
    with tempfile.TemporaryDirectory(prefix="composer_jax-trace-") as tmp:
        work = copy_repo(repo, Path(tmp) / "repo")
        shutil.copyfile(Path(__file__).with_name("trace_plugin.py"), work / f"{PLUGIN_MODULE}.py")
        inside = sandbox.workspace_path or str(work)
        env = {"COMPOSER_JAX_TRACE_OUT": f"{inside}/{TRACE_NAME}", "PYTHONPATH": inside, **(extra_env or {})}
        result, report = run_pytest(sandbox, work, command, limits_for(timeout_s, sandbox),
                                    addopts=f"-p {PLUGIN_MODULE} {addopts}".strip(), env=env)
        try:
            trace = json.loads((work / TRACE_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            trace = None
    return result, report, trace


def unstable_ids(sandbox: Sandbox, repo: Path, command: str, timeout_s: float,
                 tests: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `tests` (ids of a run under TEST_HASH_SEED) that pytest does not collect again under
    OTHER_HASH_SEED, with every id of their parametrized families, in the order of `tests`. A test
    whose module fails to collect then counts too."""
    result, _, trace = _run_traced(sandbox, repo, command, timeout_s, addopts="--collect-only",
                                   extra_env={"PYTHONHASHSEED": OTHER_HASH_SEED})
    if trace is None:
        raise FeatureDeletionError(f"collecting the tests again with PYTHONHASHSEED={OTHER_HASH_SEED} failed "
                                   f"({result.describe()}): {tail(result.stdout + result.stderr, 3)}")
    again = set(trace["collected"])
    moved = {_family(t) for t in tests if t not in again}
    return tuple(t for t in tests if t not in again or ("[" in t and _family(t) in moved))


def _family(node_id: str) -> str:
    """A parametrized test's id without its parameters: once some of a family's ids move, the order they
    come from is not fixed (in Python 3.11 `hash(None)` is an address, whatever the hash seed), so an id
    that two collections happened to agree on may still move in a third."""
    return node_id.split("[", 1)[0]


def run_baseline(sandbox: Sandbox, repo: Path, command: str, timeout_s: float) -> Baseline:
    """Run `command` (pytest) on a copy of `repo` with the trace plugin, then find its unstable ids;
    `repo` is not written to."""
    start = time.monotonic()
    result, report, trace = _run_traced(sandbox, repo, command, timeout_s)
    seconds = time.monotonic() - start
    output = tail(result.stdout + result.stderr, 3)
    if result.timed_out:
        raise FeatureDeletionError(f"the tests did not finish within {timeout_s:g} s (a hanging test?): "
                                   f"{result.describe()}; raise --timeout if the suite is just slow")
    if result.exit_code in PYTEST_STOPPED:
        raise FeatureDeletionError(f"pytest stopped before running the tests: exit code {result.exit_code}, "
                                   f"{PYTEST_STOPPED[result.exit_code]}: {output}")
    if result.exit_code == PYTEST_NO_TESTS or (trace is not None and not trace["tests"]):
        raise FeatureDeletionError(f"no tests: `{command}` collected none")
    if report is None or trace is None:
        raise FeatureDeletionError(f"`{command}` did not run pytest with its reports ({result.describe()}): "
                                   f"{output}")
    tests = tuple(trace["tests"])
    baseline = Baseline(tests=tests, outcomes=outcomes_for(tests, report),
                        calls={t: _keys(trace["tests"][t]) for t in tests}, at_import=_keys(trace["import"]),
                        seconds=seconds, unstable=unstable_ids(sandbox, repo, command, timeout_s, tests))
    if not baseline.passed:
        raise FeatureDeletionError(f"no test passes before any change ({len(baseline.failing)} fail, "
                                   f"{len(baseline.skipped)} skipped, {len(baseline.unstable)} with unstable ids), "
                                   f"e.g. {(baseline.failing or baseline.unstable or tests)[0]}")
    return baseline
