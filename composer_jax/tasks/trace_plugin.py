"""pytest plugin that records which functions of the workspace each test runs.

Not imported by composer_jax: `tracing.py` copies this file into a copy of the workspace (as
PLUGIN_MODULE.py) and pytest loads it with `-p`. It only needs the standard library and pytest.

A profile hook (sys.setprofile and threading.setprofile: call events only, no per-line events, so
the tests run at a few times their speed at worst) keys every code object that starts running by its
file, relative to the workspace, its first line (the first decorator's line for a decorated
function) and its name: enough to find the definition it belongs to. Calls made while no test runs (imports,
collection) go to "import"; those made during a test's setup, call and teardown go to that test.
Code run in subprocesses the tests start is not seen.
At the end of the session it writes {"import": [[path, line, name], ...], "tests": {node id: [[path,
line, name], ...]}, "collected": [node id, ...]} to the file named by $COMPOSER_JAX_TRACE_OUT
("collected": the ids pytest collected, also with --collect-only, where no test runs).
"""

import json
import os
import sys
import threading

import pytest

_ROOT = os.path.realpath(os.getcwd())
_keys = {}          # code object -> (path relative to the workspace, first line, name), or None outside it
_at_import = set()
_per_test = {}
_collected = []
_current = _at_import


def _key(code):
    path = os.path.realpath(code.co_filename)
    if not path.startswith(_ROOT + os.sep):
        return None
    return os.path.relpath(path, _ROOT).replace(os.sep, "/"), code.co_firstlineno, code.co_name


def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    key = _keys.get(code, False)
    if key is False:
        key = _keys[code] = _key(code)
    if key is not None:
        _current.add(key)


sys.setprofile(_profile)
threading.setprofile(_profile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = _per_test.setdefault(item.nodeid, set())
    yield
    _current = _at_import


def pytest_collection_finish(session):
    _collected.extend(item.nodeid for item in session.items)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    sys.setprofile(None)
    threading.setprofile(None)
    out = os.environ.get("COMPOSER_JAX_TRACE_OUT")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"import": sorted(_at_import), "tests": {n: sorted(c) for n, c in _per_test.items()},
                       "collected": _collected}, f)
