"""Sandboxed commands scheduled on a Ray cluster (`--backend ray`; the optional extra `composer-jax[ray]`).

`RaySandbox` has `Sandbox`'s interface. Each `run` packs the workspace (a tar in memory), runs the command
in a Ray task on some machine of the cluster, in that machine's own bwrap `Sandbox` on an unpacked copy,
and brings the workspace back as the command left it: the local workspace is replaced by it. So all
that is written against `Sandbox.run` runs unchanged on Ray: task checks (`tasks.check`, whose worker
pool then only waits on Ray), tool executions (`envs.tools.WorkspaceTools`), patch application. The
local pool stays the default.

What comes back was written by untrusted code: members that would land outside the workspace (absolute
or `..` paths, links pointing out of it, devices) are dropped, as tarfile's `data` filter refuses them.
Ray workers import composer_jax: install it on every node of the cluster.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from composer_jax.sandbox.limits import Limits, RunResult, SandboxError, SandboxUnavailable
from composer_jax.sandbox.runner import SANDBOX_WORKSPACE, Sandbox

_worker_sandboxes: dict[Limits, Sandbox] = {}   # per Ray worker process: bwrap is probed once


def pack(directory: Path) -> bytes:
    """`directory`'s contents as an uncompressed tar (symlinks kept as links, modes kept)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in sorted(os.listdir(directory)):
            tar.add(directory / entry, arcname=entry)
    return buffer.getvalue()


def _inside_only(member: tarfile.TarInfo, destination: str) -> tarfile.TarInfo | None:
    try:
        return tarfile.data_filter(member, destination)
    except tarfile.FilterError:
        return None  # dropped: it would reach outside the workspace


def unpack(data: bytes, directory: Path) -> None:
    """Replace `directory`'s contents by the tar `data` (members reaching outside it are dropped)."""
    for entry in os.listdir(directory):
        path = directory / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(directory, filter=_inside_only)


def _run_on_worker(packed: bytes, command, limits: Limits, env, record_file_access: bool) -> tuple[RunResult, bytes]:
    """A Ray task: the command in this machine's bwrap sandbox on a copy of the workspace."""
    sandbox = _worker_sandboxes.get(limits)
    if sandbox is None:
        sandbox = _worker_sandboxes[limits] = Sandbox("bwrap", limits)
    with tempfile.TemporaryDirectory(prefix="composer_jax-ray-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        unpack(packed, workspace)
        result = sandbox.run(command, workspace, limits=limits, env=env, record_file_access=record_file_access)
        return result, pack(workspace)


class RaySandbox:
    """`Sandbox.run` on a Ray cluster (module docstring). Thread-safe: one serves a whole worker pool.

    address: the cluster (default: RAY_ADDRESS, else a Ray started on this machine); num_cpus: the CPUs
    one command reserves on its worker."""

    backend = "ray"
    workspace_path = SANDBOX_WORKSPACE   # the workers run bwrap

    def __init__(self, limits: Limits | None = None, *, address: str | None = None, num_cpus: float = 1.0):
        try:
            import ray
        except ImportError:
            raise SandboxUnavailable("sandbox backend 'ray' needs Ray: pip install 'composer-jax[ray]'") from None
        self.limits = limits or Limits()
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        self._ray = ray
        self._remote = ray.remote(_run_on_worker).options(num_cpus=num_cpus, max_retries=0)

    def run(self, command: str | Sequence[str], workspace: str | os.PathLike, *, limits: Limits | None = None,
            env: Mapping[str, str] | None = None, ro_binds: Mapping[str, str] | None = None,
            record_file_access: bool = False) -> RunResult:
        """As `Sandbox.run`, on a Ray worker (whose strace records the file accesses); afterwards
        `workspace` holds what the command left there."""
        if ro_binds:
            raise SandboxError("sandbox ro_binds name paths of this machine: the 'ray' backend cannot mount them")
        workspace = Path(workspace).resolve()
        if not workspace.is_dir():
            raise SandboxError(f"sandbox workspace {workspace} is not a directory")
        result, packed = self._ray.get(self._remote.remote(pack(workspace), command, limits or self.limits,
                                                           dict(env or {}), record_file_access))
        unpack(packed, workspace)
        return result
