"""The code-quality signal: lint findings the agent's changes added, and the changes as a diff.

After grading, before its workspace is deleted (CodingEnv's `inspect` hook), the files the agent
added, modified or deleted are compared with the task's repo/. The changed Python files, as they were
and as they are, are linted together in one sandboxed ruff run (composer_jax.envs.lint: the rules, and
findings identified by (file, rule, message), not by line, so code that merely moved is not counted).
Symlinks are compared as links and never followed: the workspace is the agent's, the host reads it.
"""

from __future__ import annotations

from pathlib import Path

from composer_jax.envs.lint import LintError, added, changed_files, lint
from composer_jax.envs.tools import truncate
from composer_jax.agents.errors import AgentError
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import Task
from composer_jax.tasks.workspace import unified_diff

MAX_DIFF_CHARS = 100_000


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


def lint_findings(sandbox: Sandbox, original: Path, workspace: Path, files: list[str]) -> dict:
    """Lint counts before and after, added, and the added findings ('file: rule message', sorted) of the
    Python files among `files` (regular files only)."""
    sides = {side: {rel: (base / rel).read_bytes() for rel in files if rel.endswith(".py") and _regular(base / rel)}
             for side, base in (("before", original), ("after", workspace))}
    try:
        found = lint(sandbox, sides)
    except LintError as e:
        raise AgentError(f"lint: {e}") from None
    new = added(found["before"], found["after"])
    return {"before": len(found["before"]), "after": len(found["after"]), "added": len(new),
            "added_findings": sorted(f"{f.file}: {f.rule} {f.message}" for f in new)}


def inspect_changes(sandbox: Sandbox, task: Task, workspace: Path) -> dict:
    """What the agent changed in `workspace` (a copy of task.repo): the files, the diff, and the lint
    findings before, after and added. CodingEnv(..., inspect=partial(inspect_changes, sandbox))."""
    files = changed_files(task.repo, workspace)
    return {"changed_files": files, "diff": diff(task.repo, workspace, files),
            "lint": lint_findings(sandbox, task.repo, workspace, files)}
