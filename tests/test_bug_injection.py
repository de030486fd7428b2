"""Bug-injection tasks (tasks/bug_injection.py, mutations.py): each mutation kind's text edit, and the
tasks generated on a small repository built here (one site of each kind), checked with `tasks check`,
scanned for the original lines, graded in the coding environment."""

import json
import subprocess

import pytest

from composer_jax.envs.coding import CodingEnv
from composer_jax.envs.protocol import PlainFormat
from composer_jax.tasks import load_task
from composer_jax.tasks.features import find_definitions
from composer_jax.tasks.format import MUTATIONS
from composer_jax.tasks.mutations import find_mutations
from tests.test_feature_deletion import run_cli, write_repo
# the module's Sandbox, and the autouse check that no temporary copy is left behind
from tests.test_tasks import no_leftover_copies, sandbox, tree_digest  # noqa: F401

WINDOW = '''import functools


@functools.lru_cache(maxsize=8)
def window(values, size=3):
    """Sliding windows of `size` values, when there are some."""
    total = 0
    for i in range(len(values)):
        total += values[i]
    if not values:
        return []
    keep = (size > 1) or (total == 0)
    return [values[j:j + size] for j in range(0, len(values) - size + 1)] if keep else None
'''
LAST = "return [values[j:j + size] for j in range(0, len(values) - size + 1)] if keep else None"
KEEP = "keep = (size > 1) or (total == 0)"
# Every mutation of WINDOW, as (kind, the changed lines before, after), written out by hand: not the
# decorator's or the default's constants, not the docstring; a parenthesised operand goes with its
# parentheses; a stop ending in `+ 1` is mutated through that constant only.
WINDOW_MUTATIONS = {
    ("wrong_constant", "total = 0", "total = 1"),
    ("arithmetic", "total += values[i]", "total -= values[i]"),
    ("off_by_one", "for i in range(len(values)):", "for i in range(len(values) - 1):"),
    ("dropped_return", "if not values:\n        return []", ""),
    ("dropped_condition", "if not values:", "if values:"),
    ("dropped_condition", KEEP, "keep = (size > 1)"),
    ("comparison", KEEP, "keep = (size >= 1) or (total == 0)"),
    ("comparison", KEEP, "keep = (size > 1) or (total != 0)"),
    ("wrong_constant", KEEP, "keep = (size > 2) or (total == 0)"),
    ("wrong_constant", KEEP, "keep = (size > 1) or (total == 1)"),
    ("swapped_arguments", LAST, LAST.replace("range(0, len(values) - size + 1)", "range(len(values) - size + 1, 0)")),
    ("arithmetic", LAST, LAST.replace("j + size", "j - size")),
    ("arithmetic", LAST, LAST.replace("- size + 1", "- size - 1")),
    ("arithmetic", LAST, LAST.replace("- size + 1", "+ size + 1")),
    ("off_by_one", LAST, LAST.replace("j + size]", "j + size - 1]")),
    ("off_by_one", LAST, LAST.replace("range(0,", "range(1,")),
    ("off_by_one", LAST, LAST.replace("+ 1)", "+ 2)")),
}


def test_each_kind_makes_its_edit_and_nothing_else():
    mutations, mismatched = find_mutations(WINDOW, find_definitions("m.py", WINDOW))
    found = set()
    for m in mutations:
        before, after = m.changed()
        found.add((m.kind, "".join(before).strip(), "".join(after).strip()))
        assert m.definition.qualname == "window" and m.changed_lines == len(before)
    assert found == WINDOW_MUTATIONS and len(mutations) == len(WINDOW_MUTATIONS) and mismatched == 0
    assert {k for k, _, _ in found} == set(MUTATIONS)
    only = find_mutations(WINDOW, find_definitions("m.py", WINDOW), kinds=("comparison",))[0]
    assert {m.kind for m in only} == {"comparison"} and len(only) == 2


CALC = '''"""Small calculations (kit) for the bug-injection tests."""


def scale_total(prices, factor):
    """The sum of `prices` times `factor`."""
    subtotal_of_prices = sum(prices)
    return subtotal_of_prices * factor


def first_items(items, count):
    """The first `count` of `items`."""
    chosen_items = list(items)
    return chosen_items[:count]


def at_least(value, floor):
    """Is `value` at or above `floor`?"""
    comparison_result = value >= floor
    return comparison_result


def power_of(base_value, exponent_value):
    """`base_value` to the power `exponent_value`."""
    return pow(base_value, exponent_value)


def is_plain_name(name):
    """A lower-case identifier."""
    return name.isidentifier() and name.islower()


def resolve(value):
    """`value`, or what calling it returns when it is callable."""
    if callable(value):
        return value()
    return value


def rounded_price(amount):
    """`amount` rounded to cents."""
    return round(amount, ndigits=2)
'''

TESTS_CALC = '''from kit.calc import at_least, first_items, is_plain_name, power_of, resolve, rounded_price, scale_total


def test_scale_total():
    assert scale_total([1, 2, 3], 2) == 12


def test_first_items():
    assert first_items("abcdef", 3) == ["a", "b", "c"]


def test_at_least_on_the_floor():
    assert at_least(3, 3)


def test_at_least_below():
    assert not at_least(2, 5)


def test_power_of():
    assert power_of(2, 3) == 8


def test_is_plain_name():
    assert not is_plain_name("Abc")


def test_resolve_calls():
    assert resolve(lambda: 5) == 5


def test_rounded_price():
    assert rounded_price(1.23456) == 1.23
'''
T = "tests/test_calc.py::"
# per kind: the one line (stripped) it changes in CALC, what it becomes, and the tests that then fail
EXPECTED = {
    "arithmetic": ("return subtotal_of_prices * factor", "return subtotal_of_prices / factor", ["test_scale_total"]),
    "off_by_one": ("return chosen_items[:count]", "return chosen_items[:count - 1]", ["test_first_items"]),
    "comparison": ("comparison_result = value >= floor", "comparison_result = value > floor",
                   ["test_at_least_on_the_floor"]),
    "swapped_arguments": ("return pow(base_value, exponent_value)", "return pow(exponent_value, base_value)",
                          ["test_power_of"]),
    "dropped_condition": ("return name.isidentifier() and name.islower()", "return name.isidentifier()",
                          ["test_is_plain_name"]),
    "dropped_return": ("if callable(value):\n        return value()", "", ["test_resolve_calls"]),
    "wrong_constant": ("return round(amount, ndigits=2)", "return round(amount, ndigits=3)", ["test_rounded_price"]),
}
ALL_TESTS = [T + name for name in ("test_scale_total", "test_first_items", "test_at_least_on_the_floor",
                                   "test_at_least_below", "test_power_of", "test_is_plain_name",
                                   "test_resolve_calls", "test_rounded_price")]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The kit repository, with docs quoting two of the lines, bytecode and git history, and the CLI's run
    of the generator on it."""
    root = tmp_path_factory.mktemp("bugs")
    repo = write_repo(root / "repo", {"kit/__init__.py": '"""kit."""\n', "kit/calc.py": CALC,
                                      "tests/test_calc.py": TESTS_CALC,
                                      "README.md": "Total: `return subtotal_of_prices * factor`\n",
                                      "docs/notes.txt": "first_items does: return chosen_items[:count]\n"})
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "all"], cwd=repo, check=True)
    (repo / "kit" / "__pycache__").mkdir()
    (repo / "kit" / "__pycache__" / "calc.cpython-311.pyc").write_text(CALC)
    before = tree_digest(repo)
    code, out, err = run_cli("tasks", "bug-injection", repo, root / "out", "--workers", "2", "--seed", "3")
    assert code == 0, err
    assert tree_digest(repo) == before
    report = json.loads((root / "out" / "report.json").read_text())
    return {"out": root / "out", "stdout": out, "stderr": err, "report": report,
            "tasks": {t["mutation"]: load_task(root / "out" / t["id"]) for t in report["tasks"]}}


def test_one_task_per_kind_with_its_targets_and_difficulty(generated):
    report = generated["report"]
    assert report["family"] == "bug_injection" and report["candidates"] == 7
    assert report["tried"] == report["kept"] == 7 and report["rejected"] == {}
    assert report["kinds"] == {k: {"sites": 1, "tried": 1, "kept": 1, "rejected": {}} for k in MUTATIONS}
    assert "kept/tried per kind: " in generated["stdout"] and "[7/7]" in generated["stderr"]
    assert set(generated["tasks"]) == set(MUTATIONS)
    for kind, task in generated["tasks"].items():
        original, mutated, failing = EXPECTED[kind]
        assert task.family == "bug_injection" and task.level is None
        assert list(task.target_tests) == [T + name for name in failing]
        assert sorted(task.pass_to_pass) == sorted(t for t in ALL_TESTS if t not in task.target_tests)
        assert task.difficulty == {"mutation": kind, "changed_lines": original.count("\n") + 1,
                                   "target_tests": len(failing), "definitions": 1, "pass_rate": None}
        patch = task.solution_patch.read_text()
        assert patch.count("@@ ") == 1     # one hunk: the original line(s) back
        restored = [line[1:].strip() for line in patch.splitlines() if line.startswith("+") and line[1:].strip()]
        removed = [line[1:].strip() for line in patch.splitlines() if line.startswith("-") and line[1:].strip()]
        assert restored[1:] == [s.strip() for s in original.splitlines()] and removed[1:] == (
            [mutated] if mutated else [])
        # an issue report: the failing tests and what pytest says, never the line, before or after
        assert all(t in task.instruction for t in task.target_tests) and "What pytest reports:" in task.instruction
        for text in [*original.splitlines(), mutated]:
            assert not text.strip() or text.strip() not in task.instruction
        assert ".bug-" in task.id and "calc" not in task.id


def test_tasks_check_before_and_with_the_solution(generated):
    dirs = [generated["out"] / t["id"] for t in generated["report"]["tasks"]]
    for flags, reward in (((), 0.0), (("--solution",), 1.0)):
        code, out, err = run_cli("tasks", "check", *dirs, "--workers", "2", *flags)
        assert code == 0, err
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["status"] for r in results] == ["ok"] * 7 and [r["reward"] for r in results] == [reward] * 7
        for r in results:   # before: exactly the targets fail; with the solution: everything passes
            task = load_task(generated["out"] / r["task"])
            assert sorted(r["failed"]) == (sorted(task.target_tests) if not reward else [])


def test_no_original_line_anywhere_in_a_task(generated):
    removed = {t["mutation"]: set(t["removed_files"]) for t in generated["report"]["tasks"]}
    assert removed["arithmetic"] == {"README.md"} and removed["off_by_one"] == {"docs/notes.txt"}
    for kind, task in generated["tasks"].items():
        names = {p.relative_to(task.root).as_posix() for p in task.root.rglob("*")}
        assert not any(part in (".git", "__pycache__") or part.endswith(".pyc")
                       for name in names for part in name.split("/"))
        original = EXPECTED[kind][0].splitlines()[0].strip()
        for path in task.root.rglob("*"):
            if path.is_file() and path != task.solution_patch:
                assert original.encode() not in path.read_bytes(), (kind, path)


def test_a_task_grades_in_the_coding_environment(generated, sandbox):  # noqa: F811
    task = generated["tasks"]["swapped_arguments"]
    fmt = PlainFormat()
    with CodingEnv(sandbox, fmt) as env:
        env.reset(task)
        edit = fmt.render_call("edit", {"path": "kit/calc.py", "old": "pow(exponent_value, base_value)",
                                        "new": "pow(base_value, exponent_value)"})
        _, done, info = env.step(edit + fmt.render_call("submit", {}) + fmt.end_of_turn)
    assert done and info["task_reward"] == 1.0 and info["check"]["status"] == "ok"


def test_bad_input_is_one_line(tmp_path):
    code, out, err = run_cli("tasks", "bug-injection", tmp_path / "missing", tmp_path / "out")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("composer-jax tasks bug-injection: error: REPO_DIR ") and "missing: not a directory" in err
    code, out, err = run_cli("tasks", "bug-injection", tmp_path, tmp_path / "out", "--kinds", "comparison,typo")
    assert code == 2 and err.count("\n") == 1 and "'kinds' must be some of comparison," in err
    assert not (tmp_path / "out").exists()
