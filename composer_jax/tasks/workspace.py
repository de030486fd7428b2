"""Workspaces: clean copies of a task's repo/, test-file restoration for grading, patch application.

A copy carries no history, caches or bytecode (`.git`, `__pycache__`, `*.pyc`, tool caches), so
deleted code cannot be recovered from them. Grading restores the task's own test files (and pytest's
configuration) over the agent's workspace and deletes test files the agent added, so editing the
tests earns nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from composer_jax.sandbox import Limits, RunResult, Sandbox

NEVER_COPIED = (".git", ".hg", ".svn", "__pycache__", "*.pyc", "*.pyo", ".pytest_cache", ".mypy_cache",
                ".ruff_cache", ".tox", ".nox", ".coverage", ".hypothesis")
TEST_DIRS = ("tests", "test", "testing")
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py", "conftest.py")
# Files that change how pytest collects and reports: part of the tests for grading purposes.
RUNNER_FILES = ("pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py",
                "*.pth")


_never_copied = shutil.ignore_patterns(*NEVER_COPIED)


def _not_copied(directory: str, names: list[str]) -> set[str]:
    """History, caches, bytecode, and special files (a FIFO would block the copy, a socket fails it)."""
    skip = set(_never_copied(directory, names))
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skip.add(name)
    return skip


def copy_repo(src: Path, dst: Path, *, exclude: tuple[str, ...] = (), exclude_at_root: tuple[str, ...] = ()) -> Path:
    """Copy repo `src` to a new directory `dst` without history, caches, bytecode or special files (symlinks
    are copied as links); returns dst. `exclude`: more name patterns left out at any depth;
    `exclude_at_root`: name patterns left out only directly under `src` (e.g. 'build', a package may
    have a `build` module deeper down)."""
    root = os.path.abspath(src)
    extra = shutil.ignore_patterns(*exclude)

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = _not_copied(directory, names) | set(extra(directory, names))
        if os.path.abspath(directory) == root:
            skip |= {n for n in names if any(fnmatch.fnmatch(n, pat) for pat in exclude_at_root)}
        return skip

    shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    return dst


def is_test_file(relpath: str, extra: set[str] = frozenset(), *, runner_files: bool = True) -> bool:
    """Does this repo-relative path hold tests or (with `runner_files`) test-runner configuration (see
    module docstring)?"""
    p = PurePosixPath(relpath)
    patterns = TEST_FILE_PATTERNS + (RUNNER_FILES if runner_files else ())
    return (relpath in extra or any(part in TEST_DIRS for part in p.parts[:-1])
            or any(fnmatch.fnmatch(p.name, pat) for pat in patterns))


def repo_files(root: Path) -> set[str]:
    """Repo-relative paths of the files (symlinks included, not followed) under root, outside
    history and cache directories."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in NEVER_COPIED]
        for name in filenames:
            out.add((Path(dirpath) / name).relative_to(root).as_posix())
    return out


def same_file(src: Path, dst: Path) -> bool:
    """Does dst hold what src holds (the same bytes, or a symlink to the same target)? src must exist."""
    if src.is_symlink() or dst.is_symlink():
        return src.is_symlink() and dst.is_symlink() and os.readlink(src) == os.readlink(dst)
    return dst.is_file() and dst.read_bytes() == src.read_bytes()


def _real_parents(workspace: Path, rel: str) -> None:
    """Make the directories above `rel` real directories: a symlink there (the agent's) could point
    the host-side restore outside the workspace."""
    current = workspace
    for part in PurePosixPath(rel).parts[:-1]:
        current = current / part
        if current.is_symlink() or current.exists() and not current.is_dir():
            current.unlink()
        current.mkdir(exist_ok=True)


def restore_tests(original: Path, workspace: Path, extra: set[str] = frozenset()) -> list[str]:
    """Make every test file of `workspace` equal to `original`'s (restoring edits and deletions,
    removing additions). `extra`: more repo-relative paths to treat as tests. Returns the paths that
    differed."""
    changed = []
    wanted = {p for p in repo_files(original) if is_test_file(p, extra)}
    for rel in sorted({p for p in repo_files(workspace) if is_test_file(p, extra)} - wanted):
        (workspace / rel).unlink()
        changed.append(rel)
    for rel in sorted(wanted):
        src, dst = original / rel, workspace / rel
        _real_parents(workspace, rel)
        if same_file(src, dst):
            continue
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.is_symlink() or dst.exists():
            dst.unlink()
        shutil.copy2(src, dst, follow_symlinks=False)
        changed.append(rel)
    return changed


def unified_diff(rel: str, before: str | None, after: str) -> str:
    """A -p1 unified diff of one file (a/rel -> b/rel; `before` None: the file is created, from /dev/null)
    as `git apply` reads it, with git's marker after a last line that has no newline."""
    out = []
    lines = difflib.unified_diff((before or "").splitlines(True), after.splitlines(True),
                                 "/dev/null" if before is None else f"a/{rel}", f"b/{rel}")
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


PATCH_MOUNT = "/patch/solution.patch"


def apply_patch(sandbox: Sandbox, workspace: Path, patch: Path, limits: Limits) -> RunResult:
    """`git apply -p1` the patch inside the sandbox (a patch cannot write outside the workspace)."""
    if sandbox.workspace_path is None:  # unsandboxed: keep git from finding a repository above
        env = {"GIT_CEILING_DIRECTORIES": str(workspace.resolve().parent)}
        return sandbox.run(["git", "apply", "-p1", "--whitespace=nowarn", str(patch.resolve())], workspace,
                           limits=limits, env=env)
    return sandbox.run(["git", "apply", "-p1", "--whitespace=nowarn", PATCH_MOUNT], workspace, limits=limits,
                       env={"GIT_CEILING_DIRECTORIES": "/"}, ro_binds={str(patch.resolve()): PATCH_MOUNT})
