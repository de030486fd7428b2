"""Isolated command execution for generated code: namespaces (bubblewrap), cgroup and rlimit limits,
cleanup, and a worker pool. Knows only the operating system (no jax, nothing else of composer_jax)."""

from composer_jax.sandbox.limits import LIMIT_KINDS, Limits, RunResult, SandboxError, SandboxUnavailable
from composer_jax.sandbox.pool import run_parallel
from composer_jax.sandbox.runner import ENV_ALLOWLIST, SANDBOX_WORKSPACE, Sandbox

__all__ = ["ENV_ALLOWLIST", "LIMIT_KINDS", "Limits", "RunResult", "SANDBOX_WORKSPACE", "Sandbox", "SandboxError",
           "SandboxUnavailable", "run_parallel"]
