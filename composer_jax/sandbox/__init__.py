"""Isolated command execution for generated code: namespaces (bubblewrap), cgroup and rlimit limits,
cleanup, a worker pool, and the same on a Ray cluster (`make_sandbox("ray")`). Knows only the operating system (no jax, nothing else of composer_jax)."""

from composer_jax.sandbox.limits import LIMIT_KINDS, FileAccess, Limits, RunResult, SandboxError, SandboxUnavailable
from composer_jax.sandbox.pool import default_workers, run_parallel
from composer_jax.sandbox.ray_sandbox import RaySandbox
from composer_jax.sandbox.runner import ENV_ALLOWLIST, SANDBOX_BACKENDS, SANDBOX_WORKSPACE, TEST_HASH_SEED, Sandbox

__all__ = ["ENV_ALLOWLIST", "FileAccess", "LIMIT_KINDS", "Limits", "RunResult", "SANDBOX_BACKENDS", "SANDBOX_WORKSPACE",
           "Sandbox", "SandboxError", "SandboxUnavailable", "TEST_HASH_SEED", "default_workers", "make_sandbox",
           "run_parallel"]


def make_sandbox(backend: str = "bwrap", limits: Limits | None = None) -> Sandbox | RaySandbox:
    """A Sandbox ('bwrap', 'none') or, for 'ray', a RaySandbox: the same interface, run on a Ray cluster.
    (Here rather than in runner.py, which ray_sandbox.py imports: no circle.)"""
    if backend == "ray":
        return RaySandbox(limits)
    return Sandbox(backend, limits)
