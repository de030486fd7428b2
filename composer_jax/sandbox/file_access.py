"""Which files a sandboxed command opens: `strace` follows the command's whole process tree.

strace runs on the host side, outside the sandbox (for bwrap it traces bwrap itself, whose setup is
left out of the record): the command cannot see the tracer (its PID namespace hides it) nor its log (a
host directory, read back and deleted after the command), so it can neither read, forge nor stop the
record. Only calls that succeeded are recorded (`-z`), and each opened file by the path the kernel
resolved (`-y`: a symlink in the workspace pointing elsewhere is recorded as its target), as the
command saw it (/workspace/... for bwrap). strace filters with seccomp-bpf, so the other system calls
run untraced; the cost per command is measured by tools/bench_file_access.py (README, "Monitor").
With backend 'none' the command runs unisolated on the host and could reach the log: no guarantee there.
Not seen: a file opened without a system call of its own (io_uring's IORING_OP_OPENAT).
"""

from __future__ import annotations

import posixpath
import re
import shlex
import shutil
import subprocess
import threading

from composer_jax.sandbox.limits import FileAccess, SandboxUnavailable

OPENS = ("open", "openat", "openat2", "creat")
EXECS = ("execve", "execveat")
FORKS = ("clone", "clone3", "fork", "vfork")   # traced only to know which process a child belongs to
STRACE_OPTIONS = ("-f", "-qq", "-z", "-y", "--pidns-translation", "-s", "256", "--seccomp-bpf", "-e", "signal=none",
                  "-e", "trace=" + ",".join(OPENS + EXECS + FORKS))
PROCESS_CHARS = 200                             # of a process's command line in a FileAccess

_LINE = re.compile(r"(\d+) +(.*)")
# name(arguments) = result, the opened file's path (-y), a child's pid as the tracer sees it (--pidns-translation)
_CALL = re.compile(r"(\w+)\((.*)\) += (-?\d+)(?:<(.*)>)?(?: /\* (\d+) in strace's PID NS \*/)?")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"(\.\.\.)?')
_UNFINISHED = " <unfinished ...>"
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)", re.DOTALL)
_C_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"v": b"\v", b"f": b"\f", b"a": b"\a", b"b": b"\b"}


def find_strace() -> str:
    """The strace binary, checked once per process to trace a command here; SandboxUnavailable if not."""
    binary = shutil.which("strace")
    if binary is None:
        raise SandboxUnavailable("sandbox record_file_access: no `strace` on PATH (install it, e.g. "
                                 "`apt-get install strace`), or turn record_file_access off")
    with _probe_lock:
        if binary not in _probed:
            try:
                done = subprocess.run([binary, *STRACE_OPTIONS, "-o", "/dev/null", "true"], capture_output=True,
                                      timeout=30, env={"PATH": "/usr/bin:/bin"})
                _probed[binary] = "" if done.returncode == 0 else (done.stderr.decode(errors="replace").strip() or
                                                                   f"exit code {done.returncode}")
            except (OSError, subprocess.TimeoutExpired) as e:
                _probed[binary] = str(e)
    if _probed[binary]:
        raise SandboxUnavailable(f"sandbox record_file_access: {binary} cannot trace a command here "
                                 f"(ptrace or seccomp-bpf refused?): {_probed[binary]}")
    return binary


_probe_lock = threading.Lock()
_probed: dict[str, str] = {}


def strace_argv(binary: str, log: str) -> list[str]:
    """The prefix that runs a command under strace, recording into `log`."""
    return [binary, *STRACE_OPTIONS, "-o", log, "--"]


def _unescape(match: re.Match) -> bytes:
    code = match.group(1)
    if code[:1] == b"x":
        return bytes([int(code[1:], 16)])
    if code[:1].isdigit():
        return bytes([int(code, 8) & 0xFF])
    return _C_ESCAPES.get(code, code)


def _unquote(text: str) -> str:
    """A string as strace prints it (C escapes for quotes, backslashes and unprintable bytes) -> its text."""
    return _ESCAPE.sub(_unescape, text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")


def _normalize(path: str, workspace: str) -> str:
    path = posixpath.normpath(posixpath.join(workspace, path))
    root = workspace.rstrip("/")
    return "." if path == root else path[len(root) + 1:] if path.startswith(root + "/") else path


def parse_trace(text: str, workspace: str, *, wrapped: bool) -> tuple[FileAccess, ...]:
    """The distinct files opened and programs executed in strace's log `text`, in order of first
    access. `workspace`: the command's working directory as it saw it (relative paths resolve there,
    paths inside it come back relative). `wrapped`: the traced program is a wrapper (bwrap) whose own
    calls, before the command's first exec, are left out."""
    calls, pending = [], {}
    for raw in text.splitlines():
        line = _LINE.fullmatch(raw)
        if not line:
            continue
        pid, rest = line.groups()
        if rest.endswith(_UNFINISHED):      # another process's call came between its start and its end
            pending[pid] = rest[:-len(_UNFINISHED)]
            continue
        if rest.startswith("<... "):
            rest = pending.pop(pid, "") + rest.split(" resumed>", 1)[-1]
        call = _CALL.fullmatch(rest)
        if call:
            name, args, ret, fd_path, child = call.groups()
            calls.append((pid, name, args, child or ret, fd_path))
    parent = {ret: pid for pid, name, _, ret, _ in calls if name in FORKS}
    process: dict[str, str] = {}
    wrapper: set[str] = set()
    started, first = not wrapped, calls[0][0] if calls else ""
    found: dict[FileAccess, None] = {}
    for pid, name, args, _, fd_path in calls:
        if not started:     # the wrapper's first process execs only itself; the command is the next exec
            if name in EXECS and pid != first:
                started = True
                wrapper.discard(pid)
            else:
                wrapper.add(pid)
                continue
        if pid in wrapper or name in FORKS:
            continue
        strings = _STRING.findall(args)
        if name in EXECS:
            argv = [_unquote(s) + more for s, more in strings[1:]]
            process[pid] = shlex.join(argv)[:PROCESS_CHARS]
            path = _unquote(strings[0][0]) if strings else ""
        else:
            path = _unquote(fd_path) if fd_path else _unquote(strings[0][0]) if strings else ""
        if not path:
            continue
        path = _normalize(path, workspace) + ("/" if "O_DIRECTORY" in args else "")   # a directory, to list
        owner = pid
        while owner not in process and owner in parent:
            owner = parent[owner]
        found[FileAccess(name, path, process.get(owner, "?"))] = None
    return tuple(found)
