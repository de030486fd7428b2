"""One cgroup (v1 `pids` + `memory` controllers) per sandboxed command: limits that bind root.

`RLIMIT_NPROC` does not apply to uid 0 and `RLIMIT_AS` is per process, so the process count and the
memory of the whole tree are limited by a fresh cgroup that the launcher joins before it execs the
sandbox (every later process is born inside it). After the command, `kill_all` empties the group and
`remove` deletes it, so nothing is left behind.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from pathlib import Path

from composer_jax.sandbox.limits import SandboxUnavailable

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
PREFIX = "composer_jax-"


def check_available(root: Path = ROOT) -> None:
    """Raise SandboxUnavailable unless v1 `pids` and `memory` hierarchies exist and are writable."""
    for name in CONTROLLERS:
        base = root / name
        if not (base / "cgroup.procs").is_file():
            raise SandboxUnavailable(f"no cgroup v1 '{name}' hierarchy at {base} (the sandbox limits memory and "
                                     "processes with cgroup v1 pids + memory controllers)")
        if not os.access(base, os.W_OK):
            raise SandboxUnavailable(f"cannot create cgroups under {base}: run as root (uid {os.getuid()} here)")


class Cgroup:
    """A pair of sibling cgroups (one per controller) with the same fresh name."""

    def __init__(self, memory_bytes: int, processes: int, root: Path = ROOT):
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dirs = {c: root / c / self.name for c in CONTROLLERS}
        try:
            for path in self.dirs.values():
                path.mkdir()
            self._write("memory", "memory.limit_in_bytes", memory_bytes)
            if (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():  # swap counts too
                self._write("memory", "memory.memsw.limit_in_bytes", memory_bytes)
            self._write("pids", "pids.max", processes)
        except OSError as e:
            self.remove()
            raise SandboxUnavailable(f"cannot set up cgroup {self.name}: {e}") from None

    def _write(self, controller: str, key: str, value) -> None:
        (self.dirs[controller] / key).write_text(f"{value}\n")

    def _read(self, controller: str, key: str) -> str:
        try:
            return (self.dirs[controller] / key).read_text()
        except OSError:
            return ""

    @property
    def procs_files(self) -> list[str]:
        """The files a launcher writes its own pid to (one per controller)."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> set[int]:
        return {int(p) for c in CONTROLLERS for p in self._read(c, "cgroup.procs").split()}

    def _counter(self, controller: str, key: str, name: str) -> int:
        for line in self._read(controller, key).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return int(parts[1])
        return 0

    def limits_hit(self) -> list[str]:
        """Which cgroup limits refused something: 'memory' (an OOM kill), 'processes' (a refused fork)."""
        hit = []
        if self._counter("memory", "memory.oom_control", "oom_kill") > 0:
            hit.append("memory")
        if self._counter("pids", "pids.events", "max") > 0:
            hit.append("processes")
        return hit

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the group until it is empty (a fork bomb may race the first pass)."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup {self.name}: processes {sorted(pids)} survive SIGKILL")
            time.sleep(0.01)

    def remove(self) -> None:
        """Delete the (empty) cgroups; an exiting process may keep one busy for a moment, so retry."""
        for path in self.dirs.values():
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.01)
