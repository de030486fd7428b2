"""What a sandboxed command may use, and what came back: `Limits` in, `RunResult` out."""

from __future__ import annotations

import dataclasses


class SandboxError(ValueError):
    """A sandbox request is malformed; the message names the field at fault."""


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had on this machine; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-command limits. Memory and process counts are enforced by a cgroup (they bind root too)."""

    wall_s: float = 60.0                 # wall-clock seconds, then the whole process tree is killed
    cpu_s: int = 60                      # CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    memory_bytes: int = 4 << 30          # resident memory of all processes together (cgroup memory)
    processes: int = 256                 # live processes and threads together (cgroup pids)
    file_bytes: int = 256 << 20          # largest file a process may write (RLIMIT_FSIZE)
    output_bytes: int = 64 << 10         # captured bytes per stream (stdout, stderr); the rest is dropped
    tmp_bytes: int = 256 << 20           # size of the private /tmp (a tmpfs, charged to the memory limit)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SandboxError(f"sandbox limit '{field.name}' must be a positive number, got {value!r}")
        for name in ("cpu_s", "memory_bytes", "processes", "file_bytes", "output_bytes", "tmp_bytes"):
            if not isinstance(getattr(self, name), int):
                raise SandboxError(f"sandbox limit '{name}' must be an integer, got {getattr(self, name)!r}")


LIMIT_KINDS = ("wall", "cpu", "memory", "processes", "file_size", "output")


@dataclasses.dataclass(frozen=True)
class FileAccess:
    """A file a command opened or executed (sandbox.file_access records them, `record_file_access`)."""

    syscall: str    # open, openat, openat2, creat (the opened file), execve, execveat (the program)
    path: str       # the file itself, symlinks resolved: relative to the workspace when inside it, else
                    # absolute as the command saw it ('/usr/lib/...'); a directory opened to list it ends
                    # with '/' ('./' the workspace itself)
    process: str    # the command line that started the opening process (shell-quoted; strace cuts long words: ...)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One command's outcome. `limits_hit` names each limit that stopped or truncated it (LIMIT_KINDS)."""

    exit_code: int | None        # None when it was killed (wall time) before it exited on its own
    stdout: str                  # the first `output_bytes` bytes, decoded (invalid UTF-8 replaced)
    stderr: str
    stdout_dropped: int          # bytes produced past the capture limit and dropped
    stderr_dropped: int
    seconds: float
    limits_hit: tuple[str, ...] = ()
    file_accesses: tuple[FileAccess, ...] | None = None   # None: not recorded (Sandbox.run record_file_access)

    @property
    def timed_out(self) -> bool:
        return "wall" in self.limits_hit or "cpu" in self.limits_hit

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """One line: exit code or why it stopped, for logs and tool observations."""
        how = "killed" if self.exit_code is None else f"exit code {self.exit_code}"
        if self.limits_hit:
            how += f" (limits hit: {', '.join(self.limits_hit)})"
        return f"{how} after {self.seconds:.2f} s"
