"""Fake CPU devices under CPU contention: a sharded job with a collective per step, dispatched far
ahead of its execution on 8 devices pinned to 2 busy cores, finishes (XLA:CPU's pool deadlock, see
`composer_jax.cpu_devices`), and `use_cpu_devices` keeps the user's own settings."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from composer_jax import cpu_devices
from composer_jax.cpu_devices import use_cpu_devices

ROOT = Path(__file__).resolve().parents[1]
STEPS, ROWS, DIM, LR = 96, 64, 128, 1e-3
BUSY_LOOPS = 3
JOB_TIMEOUT_S = 50  # the job takes ~5-15 s on 2 loaded cores; a deadlock hangs until XLA aborts at 40 s

# Runs in a subprocess so that XLA's abort of a stuck collective cannot take pytest down. No sync
# inside the loop: every device gets more than 32 programs in flight, like an eval burst on a slow host.
JOB = f"""
import json, os, sys
os.sched_setaffinity(0, json.loads(os.environ["JOB_CORES"]))
from composer_jax.cpu_devices import use_cpu_devices
use_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

def step(w, x):  # w: [dim, dim] replicated, x: [rows, dim] sharded by row
    g = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), replicated)  # all-gather over the 8 devices
    return w - {LR} * (g.T @ g) / {ROWS}, jnp.mean(g)

step = jax.jit(step, donate_argnums=0)
w0, x = (np.asarray(a, np.float32) for a in json.loads(sys.stdin.read()))
w, x = jax.device_put(w0, replicated), jax.device_put(x, by_row)
means = []
for _ in range({STEPS}):
    w, m = step(w, x)
    means.append(m)
print(json.dumps([float(m) for m in jax.device_get(means)]))
"""


def _reference_means(w: np.ndarray, x: np.ndarray) -> list[float]:
    means = []
    for _ in range(STEPS):
        g = np.tanh(x @ w)
        w = w - LR * (g.T @ g) / ROWS
        means.append(float(g.mean()))
    return means


@pytest.fixture
def busy_cores():
    """Two cores (at most) as JSON, loaded by BUSY_LOOPS Python busy loops pinned to them, killed afterwards.
    The job is pinned there too, so the contention and XLA's core count do not depend on the host."""
    cores = json.dumps(sorted(os.sched_getaffinity(0))[:2])
    loop = f"import os\nos.sched_setaffinity(0, {cores})\nwhile True: pass"
    loops = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(BUSY_LOOPS)]
    try:
        yield cores
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait(10)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to cores with sched_setaffinity")
def test_sharded_job_finishes_on_two_busy_cores(busy_cores):
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((DIM, DIM)) / np.sqrt(DIM)).astype(np.float32)
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    hidden = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", *cpu_devices.THREAD_VARS)  # the job sets up its own devices
    env = {k: v for k, v in os.environ.items() if k not in hidden} | {
        "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "JOB_CORES": busy_cores}
    try:
        proc = subprocess.run([sys.executable, "-c", JOB], input=json.dumps([w0.tolist(), x.tolist()]), env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"the sharded job hung for {JOB_TIMEOUT_S} s (killed): {stderr[-1500:]}")
    assert proc.returncode == 0, f"the sharded job exited {proc.returncode}: {proc.stderr[-1500:]}"
    np.testing.assert_allclose(json.loads(proc.stdout), _reference_means(w0.astype(np.float64), x), rtol=1e-4,
                               atol=1e-6)


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(cpu_devices, "_usable_cores", lambda: 2)


def test_fake_devices_get_two_pool_threads_each(two_cores):
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    use_cpu_devices(8, env)
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8", "PJRT_NPROC": "16"}


def test_a_count_the_environment_fixes_is_read_from_either_setting():
    """(A run's own count then wins: tests/test_layouts.py checks that in a process of its own.)"""
    assert cpu_devices.fixed_device_count({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == 4
    assert cpu_devices.fixed_device_count({"JAX_NUM_CPU_DEVICES": "6", "XLA_FLAGS": "--x=1"}) == 6
    assert cpu_devices.fixed_device_count({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}) is None


@pytest.mark.parametrize("env", [{"PJRT_NPROC": "3"}, {"NPROC": "2"}, {"JAX_PLATFORMS": "cuda"},
                                 {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}])
def test_the_pool_is_left_alone_when_the_user_sized_it_or_it_is_not_needed(two_cores, env):
    before = dict(env)
    use_cpu_devices(8, env)
    assert "PJRT_NPROC" not in env or env["PJRT_NPROC"] == before["PJRT_NPROC"]


def test_a_host_with_two_cores_per_device_keeps_its_pool(monkeypatch):
    monkeypatch.setattr(cpu_devices, "_usable_cores", lambda: 16)
    env = {}
    use_cpu_devices(8, env)
    assert "PJRT_NPROC" not in env


def test_a_child_process_gets_the_flags_less_the_device_count():
    flags = "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    assert cpu_devices.without_device_count(flags) == "--xla_dump_to=/tmp/x --xla_backend_optimization_level=0"
    assert cpu_devices.without_device_count("") == ""


@pytest.mark.parametrize("setting, glibc, tunables, expected", [
    ("always [madvise] never\n", (2, 36), None, "glibc.malloc.hugetlb=1"),
    ("always [madvise] never\n", (2, 36), "glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("always [madvise] never\n", (2, 36), "glibc.malloc.hugetlb=0", None),   # the user's choice stands
    ("always [madvise] never\n", (2, 31), None, None),                       # glibc without the tunable
    ("[always] madvise never\n", (2, 36), None, None),                       # the kernel gives them unasked
    ("always madvise [never]\n", (2, 36), None, None),
    (None, (2, 36), None, None),                                             # no THP at all
])
def test_huge_pages_are_asked_for_only_where_they_change_something(tmp_path, setting, glibc, tunables, expected):
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    environ = {"HOME": "/h"} | ({"GLIBC_TUNABLES": tunables} if tunables else {})
    env = cpu_devices.huge_pages_environment(environ, path, glibc)
    assert (env if env is None else env["GLIBC_TUNABLES"]) == expected
    assert env is None or env["HOME"] == "/h"


def test_an_entry_point_restarts_in_place_with_huge_pages():
    """The restarted process has the tunable, the same pid and the same arguments, and restarts once."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    script = ("import os, sys; from composer_jax.cpu_devices import restart_with_huge_pages; "
              "print('start', os.getpid(), flush=True); restart_with_huge_pages(); "
              "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:], os.getpid())")
    out = subprocess.run([sys.executable, "-c", script, "a", "b c"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    wanted = cpu_devices.huge_pages_environment(env)
    starts = [line for line in out if line.startswith("start")]
    pid = starts[0].split()[1]
    if wanted is None:    # this machine has nothing to gain: no restart
        assert out == [f"start {pid}", f"None ['a', 'b c'] {pid}"]
    else:
        assert out == [f"start {pid}", f"start {pid}", f"{wanted['GLIBC_TUNABLES']} ['a', 'b c'] {pid}"]


def test_the_cuda_plugin_without_a_driver_starts_quietly_on_cpu(tmp_path):
    """With the cuda12 extra's plugin installed and no NVIDIA driver, a CLI command and a tool's start
    (`use_cpu_devices`) print nothing from the plugin and run on CPU; with a driver file present nothing is changed (checked in-process on a fake path)."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 550\n")
    env = {}
    assert not cpu_devices.quiet_cuda_plugin_without_driver(env, driver) and env == {}
    if importlib.util.find_spec(cpu_devices.CUDA_PLUGIN.split(".")[0]) is None or \
            importlib.util.find_spec(cpu_devices.CUDA_PLUGIN) is None:
        if os.environ.get("CI"):
            pytest.fail("the cuda12 extra is not installed: pip install -e '.[test,cuda12]'")
        pytest.skip("the cuda12 extra is not installed")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-m", "composer_jax.cli", "config", "keys", "run"], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    assert proc.stderr == "" and proc.stdout.startswith("key ")
    # A tool's start (tools/*.py): use_cpu_devices, then JAX.
    script = "from composer_jax.cpu_devices import use_cpu_devices; use_cpu_devices(2); import jax; print(jax.devices())"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    assert proc.stderr == "" and proc.stdout.count("CpuDevice") == 2, (proc.stdout, proc.stderr[-2000:])


def test_the_cli_collects_garbage_less_often():
    """`python -m composer_jax.cli` (as the `composer-jax` script) runs with GC_THRESHOLDS, read as the
    process exits; Python's defaults before."""
    script = ("import atexit, gc, runpy, sys; print(gc.get_threshold()); "
              "atexit.register(lambda: print(gc.get_threshold())); sys.argv = ['composer-jax', '--help']; "
              "runpy.run_module('composer_jax.cli', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out[0] == "(700, 10, 10)" and out[-1] == str(cpu_devices.GC_THRESHOLDS)
