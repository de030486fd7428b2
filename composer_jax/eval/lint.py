"""The code-quality signal: lint findings the agent's changes added, and the changes as a diff.

After grading, before its workspace is deleted (CodingEnv's `inspect` hook), the files the agent
added, modified or deleted are compared with the task's repo/. The changed Python files, as they were
and as they are, are linted together in one sandboxed run of ruff with the pyflakes rules and syntax
errors (`--select F,E9`: unused imports and variables, undefined names, redefinitions, invalid
syntax...), ignoring any configuration in the repository (`--isolated`: an agent cannot silence it).
A finding is identified by (file, rule, message), not by line, so code that merely moved is not
counted; added = findings after minus those before, per identity. Symlinks are compared as links
and never followed: the workspace is the agent's, the host reads it.
"""

from __future__ import annotations

import collections
import json
import shutil
import tempfile
from pathlib import Path

from composer_jax.envs.tools import truncate
from composer_jax.eval.errors import EvalError
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import Task
from composer_jax.tasks.workspace import repo_files, same_file, unified_diff

RULES = "F,E9"
SIDES = ("before", "after")
MAX_DIFF_CHARS = 100_000


def changed_files(original: Path, workspace: Path) -> list[str]:
    """Repo-relative paths added, modified or deleted in `workspace` relative to `original`, sorted."""
    before, after = repo_files(original), repo_files(workspace)
    return sorted((before ^ after) | {p for p in before & after if not same_file(original / p, workspace / p)})


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _text(path: Path) -> str | None:
    """The file's text ('' when it is absent), or None when it is a symlink or not UTF-8."""
    if not path.exists() and not path.is_symlink():
        return ""
    if not _regular(path):
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def diff(original: Path, workspace: Path, files: list[str]) -> str:
    """A -p1 unified diff of the changed text files (others named), cut at MAX_DIFF_CHARS."""
    parts = []
    for rel in files:
        before, after = _text(original / rel), _text(workspace / rel)
        if before is None or after is None:
            parts.append(f"Binary file or symlink {rel} differs\n")
        else:
            parts.append(unified_diff(rel, before, after))
    return truncate("".join(parts), MAX_DIFF_CHARS)[0]


def _ruff(sandbox: Sandbox, root: Path) -> list[dict]:
    """ruff's JSON findings for the files under root/before and root/after."""
    command = ["python", "-m", "ruff", "check", "--isolated", "--no-cache", "--select", RULES,
               "--output-format", "json", "--exit-zero", *[s for s in SIDES if (root / s).is_dir()]]
    result = sandbox.run(command, root)
    if not result.ok:
        raise EvalError(f"lint: ruff failed ({result.describe()}): {(result.stderr or result.stdout).strip()[:300]}")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as e:
        raise EvalError(f"lint: ruff's output is not JSON ({e.msg}): {result.stdout[:200]!r}") from None


def lint_counts(sandbox: Sandbox, original: Path, workspace: Path, files: list[str]) -> dict[str, collections.Counter]:
    """{'before': Counter, 'after': Counter} of finding identities (file, rule, message) in the Python
    files among `files` (regular files only)."""
    counts = {side: collections.Counter() for side in SIDES}
    python = [f for f in files if f.endswith(".py")]
    if not python:
        return counts
    with tempfile.TemporaryDirectory(prefix="composer_jax-lint-") as tmp:
        root = Path(tmp)
        for side, base in zip(SIDES, (original, workspace)):
            for rel in python:
                if _regular(base / rel):
                    (root / side / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(base / rel, root / side / rel)
        inside = sandbox.workspace_path or str(root)
        for finding in _ruff(sandbox, root):
            side, rel = Path(finding["filename"]).relative_to(inside).as_posix().split("/", 1)
            counts[side][(rel, finding.get("code") or "invalid-syntax", finding["message"])] += 1
    return counts


def inspect_changes(sandbox: Sandbox, task: Task, workspace: Path) -> dict:
    """What the agent changed in `workspace` (a copy of task.repo): the files, the diff, and the lint
    findings before, after and added. CodingEnv(..., inspect=partial(inspect_changes, sandbox))."""
    files = changed_files(task.repo, workspace)
    counts = lint_counts(sandbox, task.repo, workspace, files)
    added = counts["after"] - counts["before"]
    return {"changed_files": files, "diff": diff(task.repo, workspace, files),
            "lint": {"before": sum(counts["before"].values()), "after": sum(counts["after"].values()),
                     "added": sum(added.values()),
                     "added_findings": [f"{rel}: {code} {message}" for rel, code, message in sorted(added.elements())]}}
