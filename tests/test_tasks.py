"""Task format validation, and rewards that agree with pytest's own outcomes (run in the sandbox)."""

import difflib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _pytest.junitxml import mangle_test_address

from composer_jax import cli
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import TaskError, check_task, load_task
from composer_jax.tasks.examples import write_example_task
from composer_jax.tasks.junit import junit_key

FAST_PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests"
MIXED_TESTS = '''import pytest


@pytest.fixture
def broken():
    raise RuntimeError("fixture error")


def test_pass():
    assert True


def test_fail():
    assert 1 == 2


def test_error(broken):
    pass


def test_skip():
    pytest.skip("not today")


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1
'''
MIXED = "tests/test_mixed.py"


def write_task(root: Path, files: dict, *, targets=(), keep=(), command=FAST_PYTEST, timeout_s=60, **extra) -> Path:
    (root / "repo").mkdir(parents=True)
    for rel, text in files.items():
        (root / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "repo" / rel).write_text(text)
    (root / "repo" / "NOTES.txt").write_text("notes\n")
    diff = difflib.unified_diff(["notes\n"], ["notes\n", "more\n"], "a/NOTES.txt", "b/NOTES.txt")
    (root / "solution.patch").write_text("".join(diff))
    meta = {"id": root.name, "instruction": "do it", "test_command": command, "target_tests": list(targets),
            "pass_to_pass": list(keep), "timeout_s": timeout_s, **extra}
    (root / "task.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


@pytest.fixture(autouse=True)
def no_leftover_copies():
    before = set(Path(tempfile.gettempdir()).glob("composer_jax-*"))
    yield
    assert set(Path(tempfile.gettempdir()).glob("composer_jax-*")) <= before


def tree_digest(root: Path) -> str:
    """Names, contents, symlink targets and modes of everything under root (hidden files included)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(f"{p.relative_to(root)} {p.lstat().st_mode:o}".encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# pytest's own outcomes, the reference: a plugin object sees every report of an in-process pytest.main

REFERENCE = '''
import json, sys, pytest
out = {}
class Collect:
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            outcome = "error" if report.failed and report.when != "call" else report.outcome
            out.setdefault(report.nodeid, outcome)
pytest.main(["-q", "-p", "no:cacheprovider", "tests"], plugins=[Collect()])
print("REFERENCE" + json.dumps(out))
'''


def pytest_outcomes(repo: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", REFERENCE], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                               "PYTHONDONTWRITEBYTECODE": "1"})
    return json.loads(done.stdout.split("REFERENCE", 1)[1])


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory):
    root = write_task(tmp_path_factory.mktemp("ref") / "mixed", {MIXED: MIXED_TESTS})
    ref = pytest_outcomes(root / "repo")
    assert ref == {f"{MIXED}::test_pass": "passed", f"{MIXED}::test_fail": "failed", f"{MIXED}::test_error": "error",
                   f"{MIXED}::test_skip": "skipped", f"{MIXED}::test_param[1]": "passed",
                   f"{MIXED}::test_param[2]": "failed"}
    return ref


@pytest.mark.parametrize("targets, keep", [
    (["test_pass"], []),
    (["test_pass", "test_fail"], []),
    (["test_pass", "test_error", "test_param[1]"], []),
    (["test_pass", "test_skip", "test_param[2]"], []),
    (["test_pass", "test_renamed"], []),          # a target that does not exist counts as failed
    (["test_pass"], ["test_fail"]),               # a failing pass-to-pass test zeroes the reward
    (["test_pass"], ["test_param[1]"]),
])
def test_reward_agrees_with_pytest(sandbox, tmp_path, mixed_reference, targets, keep):
    ids = lambda names: [f"{MIXED}::{n}" for n in names]  # noqa: E731
    task = load_task(write_task(tmp_path / "mixed", {MIXED: MIXED_TESTS}, targets=ids(targets), keep=ids(keep)))
    result = check_task(task, sandbox)
    passed = lambda n: mixed_reference.get(n) == "passed"  # noqa: E731
    expected = sum(map(passed, ids(targets))) / len(targets) * all(map(passed, ids(keep)))
    assert result.status == "ok"
    assert result.reward == pytest.approx(expected)
    assert set(result.passed) == {n for n in ids(targets) + ids(keep) if passed(n)}
    assert set(result.failed) == {n for n in ids(targets) + ids(keep) if not passed(n)}


def test_collection_error_counts_targets_as_failed(sandbox, tmp_path):
    files = {"tests/test_ok.py": "def test_ok():\n    assert True\n", "tests/test_broken.py": "def test_x(:\n"}
    task = load_task(write_task(tmp_path / "broken", files, targets=["tests/test_ok.py::test_ok"]))
    assert pytest_outcomes(task.repo) == {}            # pytest itself runs nothing after a collection error
    result = check_task(task, sandbox)
    assert (result.reward, result.status, result.failed) == (0.0, "ok", ("tests/test_ok.py::test_ok",))


def test_timeout_gives_zero_and_status_timeout(sandbox, tmp_path):
    files = {"tests/test_slow.py": "import time\n\n\ndef test_slow():\n    time.sleep(60)\n"}
    task = load_task(write_task(tmp_path / "slow", files, targets=["tests/test_slow.py::test_slow"], timeout_s=2))
    result = check_task(task, sandbox)
    assert (result.reward, result.status) == (0.0, "timeout") and result.seconds < 15


@pytest.mark.parametrize("command, reward", [("exit 0", 1.0), ("exit 3", 0.0)])
def test_without_targets_the_exit_code_decides(sandbox, tmp_path, command, reward):
    result = check_task(load_task(write_task(tmp_path / "plain", {}, command=command)), sandbox)
    assert (result.reward, result.status, result.exit_code) == (reward, "ok", int(command.split()[1]))


def test_solution_and_graded_workspaces(sandbox, tmp_path):
    task = load_task(write_example_task(tmp_path / "example", 5))
    before = tree_digest(task.root)
    assert check_task(task, sandbox).reward == 0.0
    assert check_task(task, sandbox, solution=True).reward == 1.0
    # An agent that rewrites the tests and adds a conftest.py earns nothing: the tests are restored.
    agent = tmp_path / "agent"
    subprocess.run(["cp", "-r", str(task.repo), str(agent)], check=True)
    (agent / "tests" / "test_mathops.py").write_text("".join(f"def test_{name}():\n    pass\n\n\n" for name in
                                                             ("double", "scaled_sum_small", "scaled_sum_negative")))
    (agent / "conftest.py").write_text("import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\n"
                                       "def pytest_runtest_call(item):\n    pass\n")
    os.mkfifo(agent / "pipe")        # special files are not copied (a FIFO would block a naive copy)
    agent_digest = tree_digest(agent)
    assert check_task(task, sandbox, workspace=agent).reward == 0.0
    # The same tampering plus the real fix: the task's own tests pass.
    (agent / "mathops.py").write_text((agent / "mathops.py").read_text().replace(
        "raise NotImplementedError", "return 7 * a + b"))
    assert check_task(task, sandbox, workspace=agent).reward == 1.0
    assert tree_digest(task.root) == before                     # task directories are never modified
    assert (agent / "conftest.py").exists() and tree_digest(agent) != agent_digest  # only our own edit


def test_patch_that_does_not_apply(sandbox, tmp_path):
    root = write_example_task(tmp_path / "stale", 1)
    (root / "repo" / "mathops.py").write_text("something else entirely\n")
    result = check_task(load_task(root), sandbox, solution=True)
    assert (result.reward, result.status) == (0.0, "patch_failed") and "git apply" in result.detail


@pytest.mark.parametrize("node_id", ["tests/test_a.py::test_x", "tests/sub/test_b.py::TestK::test_y[1-a]",
                                     "test_top.py::test_z[x.py::y]", "pkg/tests/test_c.py::TestA::TestB::test_w"])
def test_junit_key_matches_pytest(node_id):
    names = mangle_test_address(node_id)
    assert junit_key(node_id) == (".".join(names[:-1]), names[-1])


# ------------------------------------------------------------------------------------------------
# validation


def _break(root: Path, change):
    meta = json.loads((root / "task.json").read_text())
    change(meta, root)
    (root / "task.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("field, change", [
    ("id", lambda m, r: m.pop("id")),
    ("id", lambda m, r: m.update(id="has space")),
    ("instruction", lambda m, r: m.update(instruction="  ")),
    ("test_command", lambda m, r: m.update(test_command=5)),
    ("target_tests", lambda m, r: m.update(target_tests="tests/test_mathops.py::test_double")),
    ("target_tests", lambda m, r: m.update(target_tests=["tests/test_mathops.py"])),
    ("target_tests", lambda m, r: m.update(target_tests=["../outside.py::test_x"])),
    ("target_tests", lambda m, r: m.update(target_tests=["t.py::a", "t.py::a"])),
    ("pass_to_pass", lambda m, r: m.update(pass_to_pass=m["target_tests"][:1])),
    ("timeout_s", lambda m, r: m.update(timeout_s=-1)),
    ("timeout_s", lambda m, r: m.update(timeout_s=True)),
    ("timeout", lambda m, r: m.update(timeout=5)),
    ("repo", lambda m, r: (r / "repo").rename(r / "old")),
    ("solution.patch", lambda m, r: (r / "solution.patch").unlink()),
    ("solution.patch", lambda m, r: (r / "solution.patch").write_text("just text\n")),
    ("solution.patch", lambda m, r: (r / "solution.patch").write_text(
        "--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n")),
])
def test_malformed_fields_are_named(tmp_path, field, change):
    root = write_example_task(tmp_path / "t", 0)
    _break(root, change)
    with pytest.raises(TaskError) as info:
        load_task(root)
    assert info.value.field == field and f"task {root}: field '{field}'" in str(info.value)


def test_unreadable_task_json_is_named(tmp_path):
    root = write_example_task(tmp_path / "t", 0)
    (root / "task.json").write_text("{not json")
    with pytest.raises(TaskError, match="field 'task.json': is not valid JSON"):
        load_task(root)


def test_cli_tasks_check(tmp_path, capsys):
    dirs = [str(write_example_task(tmp_path / f"t{i}", i)) for i in range(2)]
    out = tmp_path / "results.jsonl"
    assert cli.main(["tasks", "check", *dirs, "--solution", "--json", str(out), "--workers", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["scaled-sum-0", "scaled-sum-1"]
    assert all(r["reward"] == 1.0 and r["status"] == "ok" and len(r["passed"]) == 3 for r in rows)
    assert {"task", "reward", "passed", "failed", "status", "seconds"} <= set(rows[0])
    assert capsys.readouterr().out.startswith("2 tasks: mean reward 1.000, 2 with reward 1; 2 ok;")
    assert cli.main(["tasks", "check", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"composer-jax tasks check: error: task {tmp_path / 'missing'}: field 'directory': "
                   "does not exist or is not a directory"]
