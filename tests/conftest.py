"""Tests run on CPU with 8 fake devices; reference libraries must be present when CI is set."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile  # noqa: E402

# Under pytest-xdist (the suite runs on 2 workers) each worker gets its own temporary root, inherited by
# the subprocesses it starts: tests that check for leftover temporary files see only their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _root = os.path.join(tempfile.gettempdir(), f"cjtests-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(_root, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _root

import importlib.util  # noqa: E402

from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(8)  # before jax starts its backend

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REFERENCE_PACKAGES = ("torch", "transformers", "ray")


def pytest_configure(config):
    missing = [p for p in REFERENCE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing and os.environ.get("CI"):
        raise pytest.UsageError(f"reference test dependencies missing in CI: {', '.join(missing)}; "
                                "install the test extras: pip install -e '.[test]'")


def pytest_collection_modifyitems(config, items):
    """GPU-only tests are exercised by tools/device_check.sh, not by the CPU suite."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run tools/device_check.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
