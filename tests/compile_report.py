"""`--compile-report PATH`: where a test's time goes between running and compiling. For every test,
one JSON line in PATH (one file per xdist worker: PATH.gw0, ...) with its wall time (setup, call and
teardown), its CPU time (the test process and the subprocesses it waited for: on a busy machine a
steadier measure than wall time) and, from jax.monitoring's events in this process, how many programs it traced, lowered and
compiled and the seconds each took, and per program name (over 0.05 s) its compiles and seconds spent
tracing, lowering and compiling it. Programs compiled by the subprocesses a test starts (CLI runs) are
not seen; their time counts in the test's wall time only. `python tools/compile_report.py PATH*`
prints the table."""

from __future__ import annotations

import collections
import json
import os
import resource
import time

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CompileReport:
    def __init__(self, path: str):
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.path = f"{path}.{worker}" if worker else path
        self.counts: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.programs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])   # name: [compiles, seconds]
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        if event in EVENTS:
            self.counts[EVENTS[event]] += 1
            self.seconds[EVENTS[event]] += seconds
            program = self.programs[fun_name]
            program[0] += EVENTS[event] == "compile"
            program[1] += seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.counts.clear()
        self.seconds.clear()
        self.programs.clear()
        start, cpu = time.perf_counter(), _cpu_seconds()
        yield
        record = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                  "cpu_s": round(_cpu_seconds() - cpu, 3),
                  **{f"{kind}s": self.counts[kind] for kind in EVENTS.values()},
                  **{f"{kind}_s": round(self.seconds[kind], 3) for kind in EVENTS.values()},
                  "programs": {name: [n, round(s, 3)] for name, (n, s) in self.programs.items() if s >= 0.05}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_addoption(parser):
    parser.addoption("--compile-report", metavar="PATH", help="write each test's wall, trace, lowering and "
                     "compile times to PATH (PATH.gwN under xdist); tools/compile_report.py prints them")


def pytest_configure(config):
    path = config.getoption("--compile-report")
    if path:
        config.pluginmanager.register(CompileReport(path), "compile-report")
