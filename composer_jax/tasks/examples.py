"""Small, valid example tasks (a function to implement, pytest tests, a reference patch), for smoke
tests, benchmarks and the README. Each is generated, so any number of distinct tasks can be made."""

from __future__ import annotations

import json
from pathlib import Path

from composer_jax.tasks.workspace import unified_diff

_HELPERS = '''def double(x):
    return 2 * x
'''

_TESTS = '''from mathops import double, scaled_sum


def test_double():
    assert double(21) == 42


def test_scaled_sum_small():
    assert scaled_sum(1, 2) == {small}


def test_scaled_sum_negative():
    assert scaled_sum(-3, 5) == {negative}
'''


def write_example_task(root: str | Path, index: int = 0, *, timeout_s: float = 60.0) -> Path:
    """TASK_DIR `root`: implement `scaled_sum(a, b) = (index + 2) * a + b` in mathops.py.

    Targets: the two scaled_sum tests (failing on the stub); pass-to-pass: test_double."""
    root = Path(root)
    k = index + 2
    stub = _HELPERS + '''

def scaled_sum(a, b):
    """Return {k} * a + b."""
    raise NotImplementedError
'''.format(k=k)
    solved = stub.replace("    raise NotImplementedError\n", f"    return {k} * a + b\n")
    (root / "repo" / "tests").mkdir(parents=True)
    (root / "repo" / "mathops.py").write_text(stub)
    (root / "repo" / "tests" / "test_mathops.py").write_text(_TESTS.format(small=k + 2, negative=-3 * k + 5))
    (root / "solution.patch").write_text(unified_diff("mathops.py", stub, solved))
    test_file = "tests/test_mathops.py"
    (root / "task.json").write_text(json.dumps({
        "id": f"scaled-sum-{index}",
        "instruction": f"Implement scaled_sum(a, b) in mathops.py: it returns {k} * a + b.",
        "test_command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests",  # no third-party plugins: fast
        "target_tests": [f"{test_file}::test_scaled_sum_small", f"{test_file}::test_scaled_sum_negative"],
        "pass_to_pass": [f"{test_file}::test_double"],
        "timeout_s": timeout_s,
    }, indent=2))
    return root
