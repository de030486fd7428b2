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

Why huge pages: XLA:CPU allocates each execution's buffers anew, and glibc's malloc maps large blocks
from the kernel and returns them on free, so every step faults every page of its temporaries in again
(4 KiB at a time: 187,000 faults, 0.76 GB, per training step of the issue-41 held-out shape).
`restart_with_huge_pages` restarts an entry point with glibc's `glibc.malloc.hugetlb=1`, which asks for
transparent huge pages on malloc's blocks where the kernel gives them on request (THP `madvise`):
660 faults a step, and the step 1.27x (held-out) to 2x (tiny recipe) faster (docs/training.md).

Why fewer garbage collections: tracing and lowering a program allocate millions of small objects (jaxpr
equations, MLIR handles), and CPython's default thresholds (700, 10, 10) then run a full collection of a
heap full of long-lived cached programs every few hundred thousand allocations. Measured with
`gc.callbacks`, defaults against `GC_THRESHOLDS`: a test file of RL steps spent 4.4 s of its 40 in
collections against 1.5 s; a 2-step `composer-jax pretrain` 1.3-1.6 s against 0.4-0.5 s (a busy machine).
`collect_garbage_less_often` is an entry point's second step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
THREAD_VARS = ("PJRT_NPROC", "NPROC")  # XLA's CPU-client pool size, in the order XLA reads them
HUGE_PAGES = "glibc.malloc.hugetlb=1"   # glibc >= 2.35: madvise(MADV_HUGEPAGE) on malloc's blocks
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
CUDA_PLUGIN = "jax_plugins.xla_cuda12"    # the `cuda12` extra's (deviceless GPU compiles)
GC_THRESHOLDS = (20_000, 20, 20)          # CPython's generation thresholds (defaults: 700, 10, 10)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def count_for(rows: int, most: int = 8) -> int:
    """The fake device count a CPU run gets by default: one per usable core, at most `most`, rounded down
    to a power of two that divides `rows` (a step's micro-batch rows split over them). Measured on 2 cores
    (docs/training.md): 2 devices ran the held-out shape's step 1.8x faster than 8 (whose collectives wait
    on threads that share the cores) and 1.06x faster than 1 (whose ops leave a core idle)."""
    count = 1
    while count * 2 <= min(_usable_cores(), most) and rows % (count * 2) == 0:
        count *= 2
    return count


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
    already has two cores per device. An installed CUDA plugin without a driver is kept quiet first
    (`quiet_cuda_plugin_without_driver`): every entry point that starts JAX comes through here.
    """
    quiet_cuda_plugin_without_driver(environ)
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


def _glibc_version() -> tuple[int, ...]:
    """(major, minor) of the C library when it is glibc ("glibc 2.36"), else ()."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return ()
    return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else ()


def huge_pages_environment(environ: Mapping[str, str] = os.environ, thp_setting: Path = THP_SETTING,
                           glibc: tuple[int, ...] | None = None) -> dict[str, str] | None:
    """`environ` with HUGE_PAGES added to GLIBC_TUNABLES, or None where it would change nothing: a C library
    other than glibc >= 2.35, a kernel whose transparent huge pages are not given on request (`madvise`;
    `always` gives them without asking, `never` not at all), or GLIBC_TUNABLES already choosing
    (`glibc.malloc.hugetlb=0` there opts out)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or (glibc if glibc is not None else _glibc_version()) < (2, 35):
        return None
    try:
        if "[madvise]" not in thp_setting.read_text():
            return None
    except OSError:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """Replace this process (same pid, same command line, `sys.orig_argv`) with one that has
    `huge_pages_environment`, when that differs; the restarted process finds the tunable and goes on.
    For an entry point's first step, before it starts any work: what ran before runs again."""
    env = huge_pages_environment()
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def collect_garbage_less_often() -> None:
    """CPython's cyclic garbage collector at GC_THRESHOLDS: a young collection every 20,000 allocations
    instead of 700, each older generation after 20 of the younger's instead of 10 (the module docstring
    says why)."""
    gc.set_threshold(*GC_THRESHOLDS)


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for the block (what C++ libraries print as they load, too)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quiet_cuda_plugin_without_driver(environ: MutableMapping[str, str] = os.environ,
                                     driver: Path = NVIDIA_DRIVER) -> bool:
    """JAX's CUDA plugin installed (the `cuda12` extra, for `plan --compile-for`) on a machine without an
    NVIDIA driver: JAX would start CUDA first and print the traceback of its failure, and the plugin's
    libraries print "Could not find cuda drivers" lines as they load. Here JAX_PLATFORMS becomes `cpu`
    unless it is set (or a TPU runtime is installed), and the plugin's libraries are loaded once with
    stderr silenced (JAX then finds them loaded). Returns whether it did; nothing happens where a driver
    exists, the plugin is missing or already loaded."""
    if driver.exists() or CUDA_PLUGIN in sys.modules:   # a driver, or the plugin loaded already
        return False
    try:
        spec = importlib.util.find_spec(CUDA_PLUGIN)
    except ModuleNotFoundError:    # no jax_plugins namespace at all
        return False
    if spec is None or spec.origin is None:
        return False
    if "JAX_PLATFORMS" not in environ and importlib.util.find_spec("libtpu") is None:
        environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:   # imported already: its setting was read from the environment then
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    with _stderr_silenced():
        importlib.import_module(CUDA_PLUGIN)
        for library in Path(spec.origin).parent.glob("*.so"):
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return True
