"""The base install runs the commands: a fresh virtual environment gets `pip install .` alone (no extras,
no system site-packages), then checks a task in the sandbox (pytest and bubblewrap inside) and runs a
scripted `eval` (the sandboxed checks, ruff's lint score, the summary) with that environment's
`composer-jax`. A runtime dependency missing from `[project] dependencies` fails here.

The environment is made once per set of declared dependencies (and Python version) and kept under
~/.cache/composer-jax/test-venvs/; each run reinstalls the project itself into it (its code may have
changed), resolving its declared dependencies against what is there."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from filelock import FileLock

from composer_jax.tasks.examples import write_example_task
from tests.test_eval import coding  # noqa: F401  (fixture: four example tasks, two scripted agents)

REPO = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "composer-jax" / "test-venvs"


def _key() -> str:
    """The declared base dependencies and the Python version: a change makes a fresh environment."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return hashlib.sha256(json.dumps([sys.version, sorted(deps)]).encode()).hexdigest()[:16]


def _env() -> dict:
    """The test's environment without what would let the venv see this checkout or its packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(argv, cwd, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """bin/ of a virtual environment holding `pip install REPO` (no extras), installed from this checkout."""
    VENVS.mkdir(parents=True, exist_ok=True)
    root = VENVS / _key()
    with FileLock(str(VENVS / ".lock")):
        if not (root / "installed").exists():
            for old in VENVS.iterdir():           # environments of other dependency lists
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            _run([sys.executable, "-m", "venv", root], VENVS)
        # A copy of the tracked and untracked files (no build/ or egg-info of an editable install here).
        src = tmp_path_factory.mktemp("src")
        shutil.copytree(REPO, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "evals", "exported", "site", ".venv"))
        _run([root / "bin" / "python", "-m", "pip", "install", "--quiet", src], src, timeout=1500)
        (root / "installed").touch()
    return root / "bin"


@pytest.mark.slow
def test_base_install_checks_tasks_and_evaluates(venv, coding, tmp_path):  # noqa: F811
    where = _run([venv / "python", "-c", "import composer_jax, pytest; print(composer_jax.__file__)"], tmp_path)
    assert where.stdout.strip().startswith(str(venv.parent)), where.stdout   # the installed copy, not the checkout
    tasks = [write_example_task(tmp_path / f"t{i}", i) for i in range(2)]
    out = tmp_path / "check.jsonl"
    _run([venv / "composer-jax", "tasks", "check", *tasks, "--solution", "--json", out, "--workers", "2"], tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["status"], r["reward"], len(r["passed"])) for r in rows] == [("ok", 1.0, 3)] * 2

    root, _ = coding
    _run([venv / "composer-jax", "eval", f"scripted:{root / 'a.json'}", root / "tasks", "--workers", "2",
          "--out", tmp_path / "a", "--quiet"], tmp_path)
    scores = json.loads((tmp_path / "a" / "summary.json").read_text())["scores"]
    assert scores["pass@1"]["value"] == 0.75                      # tasks 0, 1 and 3 solved
    assert scores["lint_added_per_attempt"]["value"] == 0.25      # ruff finds the unused `import os`
