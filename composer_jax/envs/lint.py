"""Lint findings of Python files as they were and as they are, from one sandboxed ruff run.

The files of every side (e.g. `before` and `after`: repo-relative path -> content) are written to a
temporary tree and linted together with the pyflakes rules and syntax errors (`--select F,E9`: unused
imports and variables, undefined names, redefinitions, invalid syntax...), ignoring any configuration
in the repository (`--isolated`: an agent cannot silence it). A finding is identified by (file, rule,
message), not by line, so code that merely moved is not counted: `added(before, after)` is the findings
after beyond the count of the same identity before. The coding environment's style flag (a turn's
edits) and evaluation's code-quality signal (an episode's changes, composer_jax.agents.lint) count here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks.workspace import repo_files, same_file

RULES = "F,E9"


class LintError(RuntimeError):
    """ruff could not lint the files (it failed, or its output is not JSON)."""


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    file: str           # repo-relative
    line: int
    rule: str           # ruff's code, e.g. F841; 'invalid-syntax' for a syntax error
    message: str

    @property
    def identity(self) -> tuple[str, str, str]:
        return self.file, self.rule, self.message

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.rule} {self.message}"


def changed_files(original: Path, workspace: Path) -> list[str]:
    """Repo-relative paths added, modified or deleted in `workspace` relative to `original`, sorted."""
    before, after = repo_files(original), repo_files(workspace)
    return sorted((before ^ after) | {p for p in before & after if not same_file(original / p, workspace / p)})


def lint(sandbox: Sandbox, sides: Mapping[str, Mapping[str, bytes]]) -> dict[str, list[Finding]]:
    """{side: its findings, sorted} for the Python files (`*.py`) of each side (path -> content)."""
    python = {side: {rel: data for rel, data in files.items() if rel.endswith(".py")} for side, files in sides.items()}
    findings: dict[str, list[Finding]] = {side: [] for side in sides}
    if not any(python.values()):
        return findings
    with tempfile.TemporaryDirectory(prefix="composer_jax-lint-") as tmp:
        root = Path(tmp)
        for side, files in python.items():
            for rel, data in files.items():
                (root / side / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / side / rel).write_bytes(data)
        inside = sandbox.workspace_path or str(root)
        for item in _ruff(sandbox, root, [side for side, files in python.items() if files]):
            side, rel = Path(item["filename"]).relative_to(inside).as_posix().split("/", 1)
            findings[side].append(Finding(rel, item["location"]["row"], item.get("code") or "invalid-syntax",
                                          item["message"]))
    return {side: sorted(found) for side, found in findings.items()}


def added(before: list[Finding], after: list[Finding]) -> list[Finding]:
    """The findings of `after` beyond the count of their identity in `before` (of several with one
    identity, the later lines count as the added ones)."""
    left = collections.Counter(f.identity for f in before)
    out = []
    for finding in sorted(after):
        if left[finding.identity]:
            left[finding.identity] -= 1
        else:
            out.append(finding)
    return out


def _ruff(sandbox: Sandbox, root: Path, sides: list[str]) -> list[dict]:
    """ruff's JSON findings for the files under root/<side> for each side."""
    command = ["python", "-m", "ruff", "check", "--isolated", "--no-cache", "--select", RULES,
               "--output-format", "json", "--exit-zero", *sides]
    result = sandbox.run(command, root)
    if not result.ok:
        raise LintError(f"ruff failed ({result.describe()}): {(result.stderr or result.stdout).strip()[:300]}")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as e:
        raise LintError(f"ruff's output is not JSON ({e.msg}): {result.stdout[:200]!r}") from None
