"""Tests run on CPU with 8 fake devices; reference libraries must be present when CI is set."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never reach the Hugging Face Hub: a model id resolves from a test's own cache or fails (read by
# huggingface_hub when imported, and inherited by the CLI runs tests start).
os.environ["HF_HUB_OFFLINE"] = "1"

import tempfile  # noqa: E402

# Under pytest-xdist (the suite runs on 2 workers) each worker gets its own temporary root, inherited by
# the subprocesses it starts: tests that check for leftover temporary files see only their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _root = os.path.join(tempfile.gettempdir(), f"cjtests-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(_root, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _root

import collections  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from composer_jax.cpu_devices import (collect_garbage_less_often, huge_pages_environment,  # noqa: E402
                                     quiet_cuda_plugin_without_driver, use_cpu_devices)

collect_garbage_less_often()   # as the CLI does: tracing's allocations trigger fewer full collections

quiet_cuda_plugin_without_driver()  # the cuda12 extra's plugin (tests/test_gpu_compile.py) without a GPU driver
use_cpu_devices(8)  # before jax starts its backend
# The xdist workers and every CLI run a test starts inherit glibc's huge pages for malloc, as the
# `composer-jax` script restarts itself with them (this process has started without them).
os.environ.update(huge_pages_environment() or {})
# The suite's time goes mostly to compiling many small programs: XLA:CPU's LLVM backend at -O0 compiles
# them ~35% faster (inherited by the CLI runs tests start). A test dominated by running one large step
# compiles it optimised (`.compile({"xla_backend_optimization_level": 2})`).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA checks the program after every HLO pass (the HLO verifier: 8% of a training step's compile by
# `perf`); a broken program still fails where it runs.
if "xla_disable_hlo_passes" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_disable_hlo_passes=hlo-verifier"
# XLA:CPU's older elemental emitters compile the suite's programs ~3x faster than its fusion emitters, for
# the same run time (measured on jaxlib 0.10.2). Only where the flag exists: XLA aborts on an unknown flag,
# and jaxlib 0.11 has none of this name.
if importlib.metadata.version("jaxlib").startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The test processes and the CLI runs they start (restarts, process groups, engines) compile the same
# programs again and again: they share one persistent compilation cache for the session (created by
# the controller, inherited by xdist workers and their subprocesses). Every program is kept, not only
# those over a second: most are small (eager ops, the checkpointer's per-device slices). A program read
# back from the cache reports the same memory and cost analysis; its HLO text differs only in source-line
# metadata. No size bound: with one, jax locks the directory for every read and write and stats every
# entry on each write (4,000 entries made one RL-loop test 4x slower). An entry read while another
# process still writes it fails to decompress, and jax then compiles the program itself.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cjtests-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

REFERENCE_PACKAGES = ("torch", "transformers", "ray", "mkdocs")
pytest_plugins = ["tests.compile_report"]   # --compile-report PATH: compiles and their seconds per test


def pytest_configure(config):
    missing = [p for p in REFERENCE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing and os.environ.get("CI"):
        raise pytest.UsageError(f"reference test dependencies missing in CI: {', '.join(missing)}; "
                                "install the test extras: pip install -e '.[test]'")


def pytest_unconfigure(config):
    if _OWN_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The longest files run first, by the seconds `tests/file_seconds.json` records for each (with
    `--dist loadfile` the two workers then start on the long files and end on short ones, not one of
    them on a long file alone; a file it does not list counts 20 s per slow test). Refresh it from a
    measured run: `python tools/compile_report.py /tmp/cr* --write-file-seconds tests/file_seconds.json`.
    GPU-only tests are exercised by tools/device_check.sh, not by the CPU suite."""
    recorded = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords)
    root = Path(config.rootpath)

    def seconds(item) -> float:
        return recorded.get(item.path.relative_to(root).as_posix(), 20 * slow[item.path])

    items.sort(key=lambda item: -seconds(item))   # stable: the order within a file is kept
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run tools/device_check.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
