"""The coding tools over one workspace: list_dir, read_file, write_file, edit, search, run, submit.

File tools run host-side on paths confined to the workspace (a path that resolves outside it, through
'..' or a symlink, is refused); `run` executes in the sandbox. Every output is cut to
`max_output_chars` with a visible marker, and the outcome says whether it was cut and whether the call
failed. A call fails when it cannot be carried out: a bad path or range, an `edit` whose text does not
occur once, a command that cannot start (exit code 126 or 127) or that a sandbox limit stopped. A
command that runs and exits non-zero, such as tests that fail, is a successful call: its output is
the information the agent asked for (`exit_code` keeps the status).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from composer_jax.envs.protocol import Param, ToolCall, ToolSpec
from composer_jax.sandbox import FileAccess, Limits, Sandbox
from composer_jax.tasks import is_test_file

TOOLS = (
    ToolSpec("list_dir", "List a directory of the repository (directories end with /).",
             {"path": Param("string", "directory relative to the repository root", required=False)}),
    ToolSpec("read_file", "Read a file with line numbers, optionally a line range (1-based, inclusive).",
             {"path": Param("string", "file relative to the repository root"),
              "start_line": Param("integer", "first line", required=False),
              "end_line": Param("integer", "last line", required=False)}),
    ToolSpec("write_file", "Create or overwrite a file with the given content.",
             {"path": Param("string", "file relative to the repository root"),
              "content": Param("string", "the full new content")}),
    ToolSpec("edit", "Replace one exact occurrence of old with new in a file (old must occur exactly once).",
             {"path": Param("string", "file relative to the repository root"),
              "old": Param("string", "the exact text to replace"), "new": Param("string", "the replacement")}),
    ToolSpec("search", "Search files for a regular expression (like grep -rn); prints path:line: text.",
             {"pattern": Param("string", "a Python regular expression"),
              "path": Param("string", "directory or file to search (default: the whole repository)",
                            required=False)}),
    ToolSpec("run", "Run a shell command in the repository (sandboxed, no network); prints exit code and output.",
             {"command": Param("string", "the shell command")}),
    ToolSpec("submit", "Finish: the work is graded by the task's tests.", {}),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    output: str
    ok: bool = True                     # False: the call could not be carried out (see the module's doc)
    truncated: bool = False             # the output was cut to the limit
    test_files: tuple[str, ...] = ()    # test files this call wrote to
    exit_code: int | None = None        # a `run` call's exit status (None: killed, or not a command)
    file_accesses: tuple[FileAccess, ...] = ()   # a `run` call's, when the sandbox records them


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One carried-out call as the episode keeps it (what the reward-hacking monitor reads)."""

    name: str
    arguments: dict
    output: str = ""
    ok: bool = True
    file_accesses: tuple[FileAccess, ...] = ()   # what a `run` call's command opened (record_file_access)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# A command that could not start (the shell's "cannot execute" and "not found"), and the limits that stop one.
CANNOT_START = (126, 127)
STOPPING_LIMITS = ("wall", "cpu", "memory", "processes", "file_size")


class ToolError(Exception):
    """A tool call that cannot be carried out; the message is the observation."""


def truncate(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n[output truncated: {len(text) - limit} more characters]", True


def _walk(root: Path):
    """Files under root in sorted order (symlinked directories are not followed)."""
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            yield Path(directory) / name


class WorkspaceTools:
    """The tools bound to one workspace directory (a disposable copy of the task's repo)."""

    def __init__(self, workspace: Path, sandbox: Sandbox, *, max_output_chars: int = 4000,
                 run_limits: Limits | None = None, max_search_hits: int = 100, record_file_access: bool = False):
        self.root = Path(workspace).resolve()
        self.record_file_access = record_file_access      # `run` outcomes list the files the command opened
        self.sandbox, self.run_limits = sandbox, run_limits or Limits(wall_s=30, cpu_s=30)
        self.max_output_chars, self.max_search_hits = max_output_chars, max_search_hits

    def _path(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if path != self.root and self.root not in path.parents:
            raise ToolError(f"path {rel!r} is outside the repository")
        return path

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() or "."

    def call(self, call: ToolCall) -> ToolOutcome:
        """Carry out one validated call; failures become an outcome with ok=False."""
        try:
            outcome = getattr(self, f"_{call.name}")(**call.arguments)
        except ToolError as e:
            outcome = ToolOutcome(f"error: {e}", ok=False)
        except OSError as e:
            outcome = ToolOutcome(f"error: {e.strerror or e}", ok=False)
        text, cut = truncate(outcome.output, self.max_output_chars)
        return dataclasses.replace(outcome, output=text, truncated=cut or outcome.truncated)

    def _list_dir(self, path: str = ".") -> ToolOutcome:
        target = self._path(path)
        if not target.is_dir():
            raise ToolError(f"{path!r} is not a directory")
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
        return ToolOutcome("\n".join(names) if names else "(empty directory)")

    def _read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> ToolOutcome:
        target = self._path(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file")
        lines = target.read_text(encoding="utf-8", errors="replace").splitlines()
        end = len(lines) if end_line is None else end_line
        if start_line < 1 or end < start_line - 1:
            raise ToolError(f"bad line range {start_line}..{end} (the file has {len(lines)} lines)")
        width = len(str(max(end, 1)))
        shown = range(start_line, min(end, len(lines)) + 1)
        return ToolOutcome("\n".join(f"{i:>{width}}| {lines[i - 1]}" for i in shown) or "(no lines in range)")

    def _write_file(self, path: str, content: str) -> ToolOutcome:
        target = self._path(path)
        if target.exists() and not target.is_file():
            raise ToolError(f"{path!r} exists and is not a regular file")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        rel = self._rel(target)
        return ToolOutcome(f"wrote {len(content.encode())} bytes to {rel}",
                           test_files=(rel,) if is_test_file(rel) else ())

    def _edit(self, path: str, old: str, new: str) -> ToolOutcome:
        target = self._path(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file")
        text = target.read_text(encoding="utf-8")
        count = text.count(old) if old else 0
        if count != 1:
            raise ToolError(f"`old` must occur exactly once in {path}, found {count} times")
        target.write_text(text.replace(old, new, 1), encoding="utf-8")
        rel = self._rel(target)
        return ToolOutcome(f"edited {rel}", test_files=(rel,) if is_test_file(rel) else ())

    def _search(self, pattern: str, path: str = ".") -> ToolOutcome:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ToolError(f"bad regular expression {pattern!r}: {e}") from None
        target = self._path(path)
        hits, more = [], 0
        for file in [target] if target.is_file() else _walk(target):
            if file.is_symlink() or not file.is_file():
                continue
            try:
                lines = file.read_text(encoding="utf-8").splitlines()
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable: grep would skip it too
            for n, line in enumerate(lines, 1):
                if regex.search(line):
                    if len(hits) < self.max_search_hits:
                        hits.append(f"{self._rel(file)}:{n}: {line}")
                    else:
                        more += 1
        if more:
            hits.append(f"[{more} more matches not shown]")
        return ToolOutcome("\n".join(hits) if hits else "no matches")

    def _run(self, command: str) -> ToolOutcome:
        result = self.sandbox.run(command, self.root, limits=self.run_limits,
                                  record_file_access=self.record_file_access)
        parts = [result.describe()]
        if result.stdout:
            parts.append(result.stdout.rstrip("\n"))
        if result.stderr:
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        if result.truncated:
            parts.append(f"[output truncated: {result.stdout_dropped + result.stderr_dropped} more bytes]")
        failed = result.exit_code in CANNOT_START or any(k in STOPPING_LIMITS for k in result.limits_hit)
        return ToolOutcome("\n".join(parts), ok=not failed, truncated=result.truncated, exit_code=result.exit_code,
                           file_accesses=result.file_accesses or ())

    def _submit(self) -> ToolOutcome:
        return ToolOutcome("submitted")
