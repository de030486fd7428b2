"""Feature-deletion levels (tasks/levels.py): `definition` deletes a whole definition, `feature` every
definition only the target tests run, across modules, with the modules left empty and the imports
that named them. Generated on a small repository built here and checked with the task checker."""

import ast
import json
import os
from pathlib import Path

import pytest

from composer_jax.tasks import check_task, load_task
from composer_jax.tasks.candidates import _credit
from composer_jax.tasks.features import find_definitions, word_counts
from composer_jax.tasks.levels import RepoIndex, plan_level
from composer_jax.tasks.junit import PASSED
from composer_jax.tasks.tracing import Baseline
from tests.test_feature_deletion import TESTS_TEXT, TEXT, one_line_error, run_cli, write_repo
# the module's Sandbox, and the autouse check that no temporary copy is left behind
from tests.test_tasks import no_leftover_copies, sandbox  # noqa: F401

TABLES = '''"""Conversion tables (zebra-tables-module)."""


def factor_for(unit):
    """Metres per `unit` (zebra-factor-doc)."""
    factors = {"km": 1000.0, "m": 1.0, "cm": 0.01}
    if unit not in factors:
        raise KeyError(f"zebra: unknown unit {unit}")
    return factors[unit]
'''

CONVERT = '''"""Conversions."""
from zebrakit.tables import factor_for


def convert(value, unit_from, unit_to):
    """`value` in `unit_from`, expressed in `unit_to` (zebra-convert-doc)."""
    metres = value * factor_for(unit_from)
    converted = metres / factor_for(unit_to)
    return round(converted, 6)


def describe(value, unit):
    """'3 m'."""
    text = f"{value} {unit}"
    return text.strip()
'''

TESTS_CONVERT = '''from zebrakit import convert


def test_km_to_m():
    assert convert(2, "km", "m") == 2000.0


def test_cm_to_m():
    assert convert(50, "cm", "m") == 0.5
'''

TESTS_DESCRIBE = '''from zebrakit import describe


def test_describe():
    assert describe(3, "m") == "3 m"
'''

LEVEL_SOURCES = {"zebrakit/__init__.py": '"""zebrakit."""\nfrom zebrakit.convert import convert, describe\n',
                 "zebrakit/text.py": TEXT, "zebrakit/tables.py": TABLES, "zebrakit/convert.py": CONVERT,
                 "tests/test_text.py": TESTS_TEXT, "tests/test_convert.py": TESTS_CONVERT,
                 "tests/test_describe.py": TESTS_DESCRIBE}
INIT_WITHOUT_CONVERT = '"""zebrakit."""\nfrom zebrakit.convert import describe\n'
CONVERT_TESTS = ["tests/test_convert.py::test_km_to_m", "tests/test_convert.py::test_cm_to_m"]



def generate(level: str, root: Path) -> dict:
    repo = write_repo(root / "repo", LEVEL_SOURCES)
    code, out, err = run_cli("tasks", "feature-deletion", repo, root / "out", "--workers", "2", "--level", level)
    assert code == 0, err
    report = json.loads((root / "out" / "report.json").read_text())
    return {"level": level, "out": root / "out", "report": report, "stdout": out,
            "tasks": {t["id"]: load_task(root / "out" / t["id"]) for t in report["tasks"]}}


@pytest.fixture(scope="module")
def definition_run(tmp_path_factory):
    return generate("definition", tmp_path_factory.mktemp("definition"))


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory):
    return generate("feature", tmp_path_factory.mktemp("feature"))


def added_lines(task) -> list[str]:
    """The lines solution.patch adds back (stripped, not blank): what the task deleted."""
    return [line[1:].strip() for line in task.solution_patch.read_text().splitlines()
            if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]


@pytest.mark.parametrize("run, kept", [
    ("definition_run", {"zebrakit.tables.factor_for", "zebrakit.convert.convert"}),
    ("feature_run", {"zebrakit.convert.convert", "zebrakit.convert"})])
def test_targets_fail_and_the_solution_restores_them(request, sandbox, run, kept):  # noqa: F811
    """Per level: the checker's verdicts (targets fail, pass-to-pass pass, solution.patch passes all),
    the level and the counts in task.json; test modules that import a deleted name next to tests that
    do not need it are rejected (test_text.py imports slugify and parse_pair)."""
    run = request.getfixturevalue(run)
    assert set(run["tasks"]) == kept
    assert run["report"]["level"] == run["level"] and f"(level {run['level']})" in run["stdout"]
    assert {r["id"]: r["reason"] for r in run["report"]["rejections"]}["zebrakit.text.slugify"] == \
        "collateral_failures"
    for task in run["tasks"].values():
        assert task.level == run["level"] and "--continue-on-collection-errors" in task.test_command
        assert task.difficulty["target_tests"] == len(task.target_tests)
        assert task.difficulty["deleted_lines"] == len(added_lines(task))
        assert len(task.target_tests) + len(task.pass_to_pass) == 7
        before = check_task(task, sandbox)
        assert before.status == "ok" and before.reward == 0.0
        assert set(before.failed) == set(task.target_tests) and set(before.passed) == set(task.pass_to_pass)
        after = check_task(task, sandbox, solution=True)
        assert after.status == "ok" and after.reward == 1.0 and not after.failed
    assert list(run["tasks"]["zebrakit.convert.convert"].target_tests) == CONVERT_TESTS


MARKERS = ["zebra-convert-doc", "zebra-factor-doc", "zebra-tables-module", "def convert(value, unit_from, unit_to):",
           "def factor_for(unit):"]


@pytest.mark.parametrize("run", ["definition_run", "feature_run"])
def test_no_line_of_a_deleted_definition_anywhere(request, run):
    """Signatures, docstrings and bodies of what a task deleted: in no file of its directory (task.json and
    its instruction included), byte by byte, but solution.patch."""
    sources = [line.strip() for text in LEVEL_SOURCES.values() for line in text.splitlines()]
    for task in request.getfixturevalue(run)["tasks"].values():
        deleted = added_lines(task)
        needles = {line for line in deleted if len(line) >= 10 and sources.count(line) == deleted.count(line)}
        needles |= {m for m in MARKERS if any(m in line for line in deleted)}
        assert len(needles) >= 3, task.id
        for dirpath, _, filenames in os.walk(task.root):
            for name in filenames:
                path = Path(dirpath) / name
                if path != task.solution_patch:
                    data = path.read_bytes()
                    assert not [n for n in needles if n.encode() in data], f"{task.id}: {path}"


def test_definition_level_deletes_the_whole_definition(definition_run):
    task = definition_run["tasks"]["zebrakit.convert.convert"]
    assert task.difficulty == {"deleted_lines": 6, "deleted_definitions": 1, "deleted_files": 0, "target_tests": 2,
                               "pass_rate": None}
    assert "def convert" not in (task.repo / "zebrakit/convert.py").read_text()
    assert "def describe(value, unit):" in (task.repo / "zebrakit/convert.py").read_text()
    # the package's re-export named it: cleaned, so `from zebrakit import describe` still works
    assert (task.repo / "zebrakit/__init__.py").read_text() == INIT_WITHOUT_CONVERT
    text = task.instruction
    assert "The function `convert` of the module `zebrakit.convert` (`zebrakit/convert.py`) has been deleted" in text
    assert all(f"- {t}" in text for t in CONVERT_TESTS)
    assert 'assert convert(2, "km", "m") == 2000.0' in text    # the failing tests' own source
    assert "unit_from" not in text and "expressed in" not in text
    helper = definition_run["tasks"]["zebrakit.tables.factor_for"]    # only convert calls it: no test imports it
    assert "def factor_for" not in (helper.repo / "zebrakit/tables.py").read_text()
    assert "from zebrakit.tables import factor_for" not in (helper.repo / "zebrakit/convert.py").read_text()


def test_feature_level_deletes_across_files_and_drops_the_emptied_module(feature_run):
    task = feature_run["tasks"]["zebrakit.convert.convert"]
    assert task.difficulty == {"deleted_lines": 14, "deleted_definitions": 2, "deleted_files": 1, "target_tests": 2,
                               "pass_rate": None}
    assert not (task.repo / "zebrakit/tables.py").exists()          # factor_for went, and its module with it
    assert (task.repo / "zebrakit/convert.py").read_text() == \
        '"""Conversions."""\n\n\n' + CONVERT.split("\n\n\n")[-1]  # only describe: the import of tables is gone
    assert (task.repo / "zebrakit/__init__.py").read_text() == INIT_WITHOUT_CONVERT
    entry = next(t for t in feature_run["report"]["tasks"] if t["id"] == task.id)
    assert entry["deleted_files"] == ["zebrakit/tables.py"] and entry["deleted_definitions"] == 2
    assert "These modules were deleted whole: `zebrakit/tables.py`." in task.instruction
    assert "must exist again: `zebrakit.convert.convert`." in task.instruction
    # factor_for's deletion is the same feature: one task
    assert feature_run["report"]["not_candidates"]["same_feature"] == 1
    tasks = feature_run["tasks"].values()
    assert sum(t.difficulty["deleted_definitions"] for t in tasks) / len(tasks) > 1
    # the module as the feature (its definitions' tests, test_convert.py and test_describe.py, as targets)
    module = feature_run["tasks"]["zebrakit.convert"]
    assert module.difficulty["deleted_files"] == 2 and module.difficulty["deleted_definitions"] == 3
    assert sorted(p.name for p in (module.repo / "zebrakit").iterdir()) == ["__init__.py", "text.py"]
    assert (module.repo / "zebrakit/__init__.py").read_text() == '"""zebrakit."""\n'
    assert list(module.target_tests) == [*CONVERT_TESTS, "tests/test_describe.py::test_describe"]


def test_level_flag_is_checked(tmp_path):
    repo = write_repo(tmp_path / "repo", {"m.py": "x = 1\n"})
    assert "--level must be one of body, definition, feature, got 'whole'" in \
        one_line_error(repo, tmp_path / "out", "--level", "whole")


PKG = {
    "pkg/__init__.py": '"""pkg."""\nfrom .extra import extra_feature, EXTRA_NAME\nfrom . import extra\n',
    "pkg/extra.py": ('"""Extra."""\nimport os\n\nEXTRA_NAME = "x"\n\n\n'
                     'def extra_feature(x):\n    """Doubled."""\n    return os.fspath(x) * 2\n'),
    "pkg/lonely.py": ('"""Only a feature."""\nimport os\n\n__all__ = ["lonely"]\n\n\n'
                      'def lonely(x):\n    return os.fspath(x)\n'),
    "pkg/user.py": ('from pkg import extra_feature, EXTRA_NAME\ntry:\n    from pkg.lonely import lonely\n'
                    'except ImportError:\n    lonely = None\n\n\nclass Plugin:\n    def run(self):\n'
                    '        return 1\n\n\ndef use():\n    import pkg.lonely\n    return EXTRA_NAME\n'),
}


def plan(level: str, qualname: str, ran: dict[str, set[str]]):
    """plan_level on PKG, with `ran` {qualname: tests that ran it} as the baseline's trace."""
    definitions = {path: find_definitions(path, text) for path, text in PKG.items()}
    tests = sorted({t for ts in ran.values() for t in ts})
    calls = {t: frozenset((d.path, d.start, d.name) for defs in definitions.values() for d in defs
                          if t in ran.get(d.qualname, ())) for t in tests}
    baseline = Baseline(tests=tuple(tests), outcomes=dict.fromkeys(tests, PASSED), calls=calls,
                        at_import=frozenset(), seconds=1.0)
    tests_of, at_import = _credit(definitions, baseline)
    index = RepoIndex.build(PKG, definitions, tests_of, at_import, word_counts(PKG.values()))
    feature = next(d for defs in definitions.values() for d in defs if d.qualname == qualname)
    return plan_level(level, feature, index)


def test_imports_of_deleted_code_are_cleaned_to_a_fixed_point():
    """Relative imports, a package re-export and the import of it from the package, `import pkg.mod`
    inside a function, an import in a `try` block (which then needs `pass`); emptied modules go, but
    not a module that keeps a constant."""
    deletion = plan("feature", "extra_feature", {"extra_feature": {"t::a"}, "lonely": {"t::a"}, "use": {"t::b"}})
    files = {f.path: f.modified for f in deletion.files}
    assert deletion.deleted_files == ("pkg/lonely.py",) and "EXTRA_NAME" in files["pkg/extra.py"]
    assert files["pkg/__init__.py"] == '"""pkg."""\nfrom .extra import EXTRA_NAME\nfrom . import extra\n'
    assert files["pkg/user.py"].startswith("from pkg import EXTRA_NAME\ntry:\n    pass\nexcept ImportError:")
    assert "    import pkg.lonely" not in files["pkg/user.py"]
    for text in files.values():
        if text is not None:
            ast.parse(text)
    assert deletion.imports_cleaned == ("pkg/__init__.py", "pkg/user.py")
    # a method that was all of its class's body: the class keeps `pass`
    method = plan("definition", "Plugin.run", {"Plugin.run": {"t::a"}, "use": {"t::b"}})
    assert "class Plugin:\n    pass\n" in method.modified and method.definitions == 1
