"""`--backend ray`: task checks and tool executions on a local Ray cluster started here give what the
local bubblewrap pool gives; the workspace comes back as the command left it, minus escapes."""

import json
import sys
from pathlib import Path

import pytest
import ray

from composer_jax import cli
from composer_jax.envs.protocol import ToolCall
from composer_jax.envs.tools import WorkspaceTools
from composer_jax.sandbox import FileAccess, Sandbox, SandboxError, SandboxUnavailable, make_sandbox
from composer_jax.sandbox.ray_sandbox import RaySandbox
from composer_jax.tasks import check_tasks, load_task
from tests.test_tasks import MIXED, MIXED_TESTS, tree_digest, write_task


@pytest.fixture(scope="module")
def ray_sandbox():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    try:
        yield make_sandbox("ray")
    finally:
        ray.shutdown()


def test_task_checks_on_ray_match_the_local_pool(ray_sandbox, tmp_path):
    ids = lambda names: [f"{MIXED}::{n}" for n in names]  # noqa: E731
    cases = [(["test_pass"], []), (["test_pass", "test_fail"], []), (["test_pass", "test_param[2]", "test_gone"], []),
             (["test_pass"], ["test_fail"]), (["test_pass", "test_param[1]"], ["test_skip"])]
    tasks = [load_task(write_task(tmp_path / f"t{i}", {MIXED: MIXED_TESTS}, targets=ids(t), keep=ids(k)))
             for i, (t, k) in enumerate(cases)]
    before = [tree_digest(task.repo) for task in tasks]
    local = check_tasks(tasks, Sandbox(), workers=2)
    remote = check_tasks(tasks, ray_sandbox, workers=4)
    assert [r.reward for r in local] == [1.0, 0.5, 1 / 3, 0.0, 0.0]   # as pytest's outcomes say (test_tasks.py)
    for ours, ref in zip(remote, local):
        assert (ours.task, ours.reward, ours.passed, ours.failed, ours.status) == \
               (ref.task, ref.reward, ref.passed, ref.failed, ref.status)
    assert [tree_digest(task.repo) for task in tasks] == before   # task directories untouched
    # The command line's `--backend ray` (on the Ray started above) reports the same rewards.
    out = tmp_path / "checks.jsonl"
    assert cli.main(["tasks", "check", *[str(t.root) for t in tasks], "--backend", "ray", "--workers", "3",
                     "--json", str(out)]) == 0
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == [r.reward for r in local]


def test_tool_run_on_ray_brings_the_workspace_back(ray_sandbox, tmp_path):
    """A `run` tool call executed on Ray: the same outcome as locally, and the files it wrote, changed
    and deleted show in the local workspace the same way; a symlink pointing out of the workspace does
    not come back."""
    command = ("echo made > new.txt && chmod +x new.txt && sed -i s/1/2/ pkg/a.py && rm gone.txt && "
               "ln -s /etc/passwd leak && mkdir -p deep/er && echo hi > deep/er/f && cat pkg/a.py && pwd")
    call = ToolCall("run", {"command": command}, "functions.run:0")
    outputs, digests, leaks = [], [], []
    for sandbox in (Sandbox(), ray_sandbox):
        workspace = tmp_path / sandbox.backend
        (workspace / "pkg").mkdir(parents=True)
        (workspace / "pkg" / "a.py").write_text("x = 1\n")
        (workspace / "gone.txt").write_text("bye\n")
        outcome = WorkspaceTools(workspace, sandbox).call(call)
        outputs.append((outcome.ok, outcome.output.split("\n", 1)[1]))   # after the status line (with its time)
        leaks.append((workspace / "leak").is_symlink())
        (workspace / "leak").unlink(missing_ok=True)
        digests.append(tree_digest(workspace))
    assert outputs[0] == outputs[1] and outputs[0][0] and "x = 2" in outputs[0][1], outputs
    assert digests[0] == digests[1]     # names, modes (new.txt executable) and contents, as bwrap left them
    assert leaks == [True, False]       # the link to /etc/passwd stays in bwrap's workspace, not on the way back
    assert (tmp_path / "ray" / "deep" / "er" / "f").read_text() == "hi\n"
    assert not (tmp_path / "ray" / "gone.txt").exists()


def test_file_accesses_are_recorded_on_the_ray_worker(ray_sandbox, tmp_path):
    (tmp_path / "data.txt").write_text("x")
    result = ray_sandbox.run("cat data.txt", tmp_path, record_file_access=True)
    assert result.ok and FileAccess("openat", "data.txt", "cat data.txt") in result.file_accesses
    assert ray_sandbox.run("true", tmp_path).file_accesses is None


def test_ray_sandbox_refuses_host_mounts(ray_sandbox, tmp_path):
    with pytest.raises(SandboxError, match="ro_binds name paths of this machine"):
        ray_sandbox.run("true", tmp_path, ro_binds={"/usr": "/opt/usr"})
    assert isinstance(ray_sandbox, RaySandbox)


def test_ray_backend_without_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # as if not installed: `import ray` raises ImportError
    with pytest.raises(SandboxUnavailable, match=r"needs Ray: pip install 'composer-jax\[ray\]'"):
        make_sandbox("ray")
