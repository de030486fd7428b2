"""Node ids that depend on the hash seed (parametrize ids from a set's order, as in isodate's suite): every
test run hashes with one fixed seed, and the baseline leaves out and reports ids that another seed changes."""

import ast
import json
import os
import subprocess
import sys

from composer_jax.sandbox import TEST_HASH_SEED
from composer_jax.tasks import check_task, load_task
from composer_jax.tasks.feature_deletion import DEFAULT_TEST_COMMAND
from composer_jax.tasks.tracing import OTHER_HASH_SEED, UNSTABLE_REASON, run_baseline
from tests.test_feature_deletion import run_cli, write_repo

# the module's Sandbox, and the autouse check that no temporary copy is left behind
from tests.test_tasks import no_leftover_copies, sandbox, write_task  # noqa: F401

TAGS = '{"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}'
TAGS_MODULE = '''"""Tags."""


def normalize(tag):
    """`tag` stripped, lower-cased, with dashes for spaces."""
    cleaned = tag.strip()
    lowered = cleaned.lower()
    return lowered.replace(" ", "-")


def count_words(text):
    """The number of whitespace-separated words in `text`."""
    words = text.split()
    total = len(words)
    return total
'''
TESTS_TAGS = f'''import pytest

from tagkit.tags import count_words, normalize

TAGS = {TAGS}


@pytest.mark.parametrize("position, tag", list(enumerate(TAGS)))   # ids "0-zeta", ...: the set's order
def test_normalize_each(position, tag):
    assert normalize(f" {{tag.upper()}} ") == tag


def test_normalize_spaces():
    assert normalize(" Big Tag ") == "big-tag"


def test_count_words():
    assert count_words("a b  c") == 3
'''
SOURCES = {"tagkit/__init__.py": "", "tagkit/tags.py": TAGS_MODULE, "tests/test_tags.py": TESTS_TAGS}


def normalize_ids(seed: str) -> list[str]:
    """The ids of test_normalize_each in a Python with PYTHONHASHSEED=seed (this interpreter, as the sandbox's)."""
    order = subprocess.run([sys.executable, "-c", f"print(list(enumerate({TAGS})))"], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    return [f"tests/test_tags.py::test_normalize_each[{i}-{tag}]" for i, tag in ast.literal_eval(order)]


def test_baseline_and_grading_name_tests_alike(sandbox, tmp_path):
    """Every id the baseline ran, hash-ordered ones included, is a passing target when graded."""
    repo = write_repo(tmp_path / "repo", SOURCES)
    baseline = run_baseline(sandbox, repo, DEFAULT_TEST_COMMAND, timeout_s=60)
    task = load_task(write_task(tmp_path / "task", SOURCES, targets=baseline.tests, command=DEFAULT_TEST_COMMAND))
    result = check_task(task, sandbox)
    assert (result.status, result.reward, result.failed) == ("ok", 1.0, ())
    assert set(normalize_ids(TEST_HASH_SEED)) < set(baseline.tests)


def test_unstable_ids_are_left_out_and_reported(tmp_path):
    """On a suite with hash-ordered ids the generator keeps its tasks (none lost to collateral failures)
    and report.json lists the ids another hash seed changes, with the reason; no task names them."""
    moved = [t for t in normalize_ids(TEST_HASH_SEED) if t not in normalize_ids(OTHER_HASH_SEED)]
    assert 0 < len(moved) < 6, "the set's order is the same under both seeds, or no id stays: pick other strings"
    unstable = normalize_ids(TEST_HASH_SEED)     # the whole parametrized family, those that stayed too
    repo = write_repo(tmp_path / "repo", SOURCES)
    code, out, err = run_cli("tasks", "feature-deletion", repo, tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["baseline"]["unstable_ids"] == {"tests": unstable, "reason": UNSTABLE_REASON}
    assert report["baseline"]["passed"] == 8 - len(unstable) and report["baseline"]["left_out"] == []
    assert f", {len(unstable)} left out (unstable ids)" in out and f"{len(unstable)} tests have unstable ids" in err
    assert "tagkit.tags.count_words" in {t["id"] for t in report["tasks"]}
    assert "collateral_failures" not in report["rejected"]
    for task in (load_task(tmp_path / "out" / t["id"]) for t in report["tasks"]):
        assert not set(unstable) & set(task.target_tests + task.pass_to_pass)
        assert len(task.target_tests + task.pass_to_pass) == 8 - len(unstable)
