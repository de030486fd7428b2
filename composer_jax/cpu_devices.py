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
from collections.abc import MutableMapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
THREAD_VARS = ("PJRT_NPROC", "NPROC")  # XLA's CPU-client pool size, in the order XLA reads them


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_cpu_devices(count: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask XLA for `count` fake host devices and size the CPU client's pool at two threads per device.

    Settings the user made win: a device count already in XLA_FLAGS (or JAX_NUM_CPU_DEVICES) is kept
    and sizes the pool; PJRT_NPROC or NPROC already set are left alone; nothing changes the pool when
    JAX_PLATFORMS leaves out the CPU or the machine already has two cores per device.
    """
    flags = environ.get("XLA_FLAGS", "")
    user_count = re.search(rf"{DEVICE_COUNT_FLAG}=(\d+)", flags)
    if user_count is None:
        environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()
    jax_count = int(environ.get("JAX_NUM_CPU_DEVICES", "-1"))  # jax's own device count wins over the flag
    devices = jax_count if jax_count >= 0 else int(user_count[1]) if user_count else count
    platforms = environ.get("JAX_PLATFORMS", "")
    on_cpu = not platforms or "cpu" in platforms.lower().split(",")
    if devices > 1 and on_cpu and not any(v in environ for v in THREAD_VARS) and _usable_cores() < 2 * devices:
        environ["PJRT_NPROC"] = str(2 * devices)


def without_device_count(flags: str) -> str:
    """XLA_FLAGS less its fake device count: for a child process that chooses its own."""
    return " ".join(f for f in flags.split() if not f.startswith(f"{DEVICE_COUNT_FLAG}="))
