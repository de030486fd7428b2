"""Isolated command execution for generated code: namespaces (bubblewrap), cgroup and rlimit limits,
cleanup, a worker pool, and the same on a Ray cluster (`make_sandbox("ray")`). Knows only the operating system (no jax, nothing else of composer_jax)."""

from composer_jax.sandbox.limits import LIMIT_KINDS, FileAccess, Limits, RunResult, SandboxError, SandboxUnavailable
from composer_jax.sandbox.pool import run_parallel
from composer_jax.sandbox.runner import (ENV_ALLOWLIST, SANDBOX_BACKENDS, SANDBOX_WORKSPACE, TEST_HASH_SEED, Sandbox,
                                         make_sandbox)

__all__ = ["ENV_ALLOWLIST", "FileAccess", "LIMIT_KINDS", "Limits", "RunResult", "SANDBOX_BACKENDS", "SANDBOX_WORKSPACE",
           "Sandbox", "SandboxError", "SandboxUnavailable", "TEST_HASH_SEED", "make_sandbox", "run_parallel"]
