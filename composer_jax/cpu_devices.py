"""Fake CPU devices for runs and tests without an accelerator. Call `use_cpu_devices` before JAX starts
its backend (the first `jax.devices()` or computation); importing jax earlier is fine.

Why the thread pool: XLA:CPU runs each device's part of a multi-device program on one thread of the
CPU client's pool, and a collective needs all N parts running at once. That pool has max(cores, N)
threads, and the same pool runs the per-device dispatch of the next program, which blocks its thread
once a device has 32 programs in flight (a fixed limit in XLA's CPU client). On a machine with fewer
than 2N cores, a dispatch that runs ahead (an eval burst, or any step loop on a busy machine) takes a
thread that the program in front of it needs: 7 of 8 parts wait at the collective forever and XLA
aborts after 40 s (`rendezvous.cc ... Termination timeout`). Two threads per device leave N for the
program and N for the dispatch that waits on it. XLA sizes the pool from PJRT_NPROC, then NPROC.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
THREAD_VARS = ("PJRT_NPROC", "NPROC")  # XLA's CPU-client pool size, in the order XLA reads them


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fixed_device_count(environ: Mapping[str, str] = os.environ) -> int | None:
    """The fake CPU device count the environment already fixes: JAX_NUM_CPU_DEVICES (jax's own, which wins
    over the flag) or the flag in XLA_FLAGS; None when neither does."""
    jax_count = int(environ.get("JAX_NUM_CPU_DEVICES", "-1"))
    if jax_count >= 0:
        return jax_count
    user_count = re.search(rf"{DEVICE_COUNT_FLAG}=(\d+)", environ.get("XLA_FLAGS", ""))
    return int(user_count[1]) if user_count else None


def use_cpu_devices(count: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Give this process `count` fake host devices and size the CPU client's pool at two threads per device.

    The count is the caller's (a run's `cpu_devices`): a different count that the environment already fixes
    (a shell's `XLA_FLAGS=--xla_force_host_platform_device_count=8` habit, or JAX_NUM_CPU_DEVICES) gives
    way to it through jax's own setting, which wins over both (an RL learner would otherwise get 7 of 8
    devices when its engine takes a ninth). The environment is left as it is then, for child processes.
    Once JAX's backend has started its devices are fixed and nothing changes. PJRT_NPROC or NPROC already
    set are left alone; nothing changes the pool when JAX_PLATFORMS leaves out the CPU or the machine
    already has two cores per device.
    """
    fixed = fixed_device_count(environ)
    if fixed is None:
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {DEVICE_COUNT_FLAG}={count}".strip()
    elif fixed != count and not _override_count(count):
        return   # JAX's backend has started: its devices are what they are
    platforms = environ.get("JAX_PLATFORMS", "")
    on_cpu = not platforms or "cpu" in platforms.lower().split(",")
    if count > 1 and on_cpu and not any(v in environ for v in THREAD_VARS) and _usable_cores() < 2 * count:
        environ["PJRT_NPROC"] = str(2 * count)


def _override_count(count: int) -> bool:
    """Set jax's `jax_num_cpu_devices` (it wins over XLA_FLAGS and is read when the backend starts); False
    when the backend has started already (jax then refuses a different count)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:    # "jax_num_cpu_devices config should be updated before backends are initialized"
        return False
    return True


def without_device_count(flags: str) -> str:
    """XLA_FLAGS less its fake device count: for a child process that chooses its own."""
    return " ".join(f for f in flags.split() if not f.startswith(f"{DEVICE_COUNT_FLAG}="))
