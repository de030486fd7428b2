"""Feature-deletion tasks: generated on a small repository built here, checked with the task checker,
scanned for leaks byte by byte; bad inputs; the AST deletion, the trace credit and `tasks list`."""

import contextlib
import io
import json
import os
import py_compile
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from composer_jax import cli
from composer_jax.tasks import check_task, load_task
from composer_jax.tasks.candidates import _credit, select_candidates
from composer_jax.tasks.feature_deletion import DEFAULT_TEST_COMMAND
from composer_jax.tasks.features import find_definitions, plan_deletion, word_counts
from composer_jax.tasks.format import TaskError, write_pass_rate
from composer_jax.tasks.junit import FAILED, PASSED
from composer_jax.tasks.tracing import UNSTABLE_REASON, Baseline
from composer_jax.tasks.workspace import unified_diff
# the module's Sandbox, and the autouse check that no temporary copy is left behind
from tests.test_tasks import no_leftover_copies, sandbox, tree_digest  # noqa: F401

TEXT = '''"""Text helpers."""
import re

_SEPARATORS = re.compile(r"[^a-z0-9]+")


# zebra-squash: collapse every run of other characters into one dash
def _squash_separators(text):
    """Collapse separator runs (zebra-helper-doc)."""
    squashed = _SEPARATORS.sub("-", text)
    return squashed.strip("-")


def slugify(title, max_length=40):
    """Lower-case `title` and join its words with dashes, at most `max_length` characters."""
    lowered = title.lower()
    slug = _squash_separators(lowered)
    if len(slug) > max_length:
        slug = slug[:max_length].rstrip("-")
    return slug or "zebra-empty-slug"


def parse_pair(text):
    """'key=value' -> ('key', 'value'); ValueError without '='."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"no '=' in {text!r}")
    return key.strip(), value.strip()


def build_defaults():
    table = {"sep": "-"}
    table["limit"] = 40
    return table


DEFAULTS = build_defaults()


def unused_formatter(value):
    text = str(value)
    text = text.strip()
    return f"<{text}>"
'''

NUMBERS = '''"""Numbers."""


def clamp(x, low, high):
    """`x` limited to [low, high]; ValueError if low > high."""
    if low > high:
        raise ValueError("clamp: low above high")
    return max(low, min(high, x))


def double(x):
    return 2 * x


def make_registry(names):
    """A set of the given names, lower-cased."""
    registry = set()
    for name in names:
        registry.add(name.lower())
    return registry


class Stats:
    """Summary statistics of numbers."""

    def __init__(self, values):
        self.values = [float(v) for v in values]
        self.count = len(self.values)

    def mean(self):
        """The arithmetic mean; 0.0 without values."""
        if not self.values:
            return 0.0
        total_of_values = sum(self.values)
        return total_of_values / self.count
'''

TESTS_TEXT = '''import pytest

from zebrakit.text import parse_pair, slugify


def test_slugify_words():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_limit():
    assert slugify("a b c d e", max_length=5) == "a-b-c"


def test_slugify_empty():
    assert slugify("!!!") == "zebra-empty-slug"


def test_known_bug_accents():
    assert slugify("Zoë") == "zoe"


def test_parse_pair_rejects_missing_equals():
    with pytest.raises(Exception):
        parse_pair("novalue")
'''

TESTS_NUMBERS = '''import pytest

from zebrakit.numbers import Stats, clamp, double, make_registry


@pytest.fixture(scope="module")
def registry():
    return make_registry(["A", "b"])


def test_registry_has_a(registry):
    assert "a" in registry


def test_registry_has_b(registry):
    assert "b" in registry


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0


def test_double():
    assert double(4) == 8


def test_mean():
    assert Stats([1, 2, 3, 6]).mean() == 3.0


def test_mean_empty():
    assert Stats([]).mean() == 0.0


def test_count():
    assert Stats([1, 2]).count == 2
'''

SOURCES = {"zebrakit/__init__.py": '"""zebrakit: a repository for feature-deletion tests."""\n',
           "zebrakit/text.py": TEXT, "zebrakit/numbers.py": NUMBERS,
           "tests/test_text.py": TESTS_TEXT, "tests/test_numbers.py": TESTS_NUMBERS}
LEFT_OUT = "tests/test_text.py::test_known_bug_accents"
SLUGIFY_TESTS = ["tests/test_text.py::test_slugify_words", "tests/test_text.py::test_slugify_limit",
                 "tests/test_text.py::test_slugify_empty"]
MEAN_TESTS = ["tests/test_numbers.py::test_mean", "tests/test_numbers.py::test_mean_empty"]
# Strings that exist only in deleted code: a test below checks none survives anywhere in a task (bytecode too).
MARKERS = {"zebrakit.text.slugify": ["zebra-helper-doc", "_squash_separators", "zebra-squash"],
           "zebrakit.numbers.Stats.mean": ["total_of_values"], "zebrakit.numbers.Stats": ["total_of_values"],
           "zebrakit.numbers.clamp": ["clamp: low above high"]}
# What history, caches, build output and environments look like: every one must be gone from a task.
NEVER_IN_A_TASK = (".git", "__pycache__", ".mypy_cache", ".pytype", ".pyright", ".ruff_cache", ".pytest_cache",
                   ".tox", ".nox", "build", "dist", "zebrakit.egg-info", ".venv", "site-packages")


def write_repo(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def plant_leaks(root: Path) -> None:
    """Everything a careless generator would leave: docs quoting the code, history, bytecode, caches,
    build output, an installed copy in a virtualenv, a symlink to the original."""
    write_repo(root, {
        "README.md": "```python\n    lowered = title.lower()\n    return slug or \"zebra-empty-slug\"\n```\n",
        "docs/api.rst": ".. code-block:: python\n\n    total_of_values = sum(self.values)\n",
        "CHANGELOG.md": "- 0.2: clamp raises ValueError(\"clamp: low above high\")\n",
        "notes/snippet.txt": "slug = _squash_separators(lowered)\n",
        ".mypy_cache/3.11/zebrakit/text.data.json": json.dumps({"def": "_squash_separators(text)"}),
        ".pytype/pyi/zebrakit/text.pyi": "def _squash_separators(text) -> str: ...\n",
        ".pyright/cache.json": json.dumps({"line": "total_of_values = sum(self.values)"}),
        ".ruff_cache/0.1/cache": "squashed = _SEPARATORS.sub(\"-\", text)\n",
        ".pytest_cache/v/cache/lastfailed": "zebra-helper-doc\n",
        ".tox/py311/log.txt": "zebra-squash\n",
        ".nox/session/log.txt": "clamp: low above high\n",
        "build/lib/zebrakit/text.py": TEXT, "build/lib/zebrakit/numbers.py": NUMBERS,
        "zebrakit.egg-info/PKG-INFO": "Description: return slug or \"zebra-empty-slug\"\n",
        ".venv/lib/python3.11/site-packages/zebrakit/text.py": TEXT,
    })
    for name in ("text", "numbers"):
        py_compile.compile(str(root / "zebrakit" / f"{name}.py"),
                           cfile=str(root / "zebrakit" / "__pycache__" / f"{name}.cpython-311.pyc"))
    (root / "dist").mkdir()
    with tarfile.open(root / "dist" / "zebrakit-0.1.tar.gz", "w:gz") as tar:
        tar.add(root / "zebrakit", arcname="zebrakit-0.1/zebrakit")
    os.symlink(root / "zebrakit" / "text.py", root / "original_text.txt")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run(git + ["init", "-q"], cwd=root, check=True)
    subprocess.run(git + ["add", "-A"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-qm", "all"], cwd=root, check=True)


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The zebrakit repository (with planted leaks), and the CLI's run of the generator on it."""
    root = tmp_path_factory.mktemp("fd")
    repo = write_repo(root / "repo", SOURCES)
    plant_leaks(repo)
    before = tree_digest(repo)
    code, out, err = run_cli("tasks", "feature-deletion", repo, root / "out", "--workers", "2", "--max-tasks", "10")
    assert code == 0, err
    return {"repo": repo, "out": root / "out", "stdout": out, "stderr": err, "digest_before": before,
            "digest_after": tree_digest(repo), "report": json.loads((root / "out" / "report.json").read_text())}


def tasks_of(generated):
    return [load_task(generated["out"] / t["id"]) for t in generated["report"]["tasks"]]


def test_report_counts_and_reasons(generated):
    report = generated["report"]
    assert report["baseline"] == {"tests": 12, "passed": 11, "skipped": 0, "left_out": [LEFT_OUT],
                                  "unstable_ids": {"tests": [], "reason": UNSTABLE_REASON},
                                  "seconds": report["baseline"]["seconds"]}
    assert {t["id"] for t in report["tasks"]} == {"zebrakit.text.slugify", "zebrakit.numbers.clamp",
                                                  "zebrakit.numbers.Stats", "zebrakit.numbers.Stats.mean"}
    assert {r["id"]: r["reason"] for r in report["rejections"]} == {
        "zebrakit.text.parse_pair": "no_test_fails",          # pytest.raises(Exception) accepts the stub
        "zebrakit.numbers.make_registry": "collateral_failures"}  # module fixture: one test ran it, two fail
    assert report["not_candidates"] == {"runs_at_import": 1,     # build_defaults
                                        "untested": 1,           # unused_formatter
                                        "too_small": 3}          # double, Stats.__init__, _squash_separators
    assert report["candidates"] == report["tried"] == 6 and report["kept"] == 4
    assert report["rejected"] == {"no_test_fails": 1, "collateral_failures": 1}
    assert "tried 6: kept 4, rejected 2 (collateral_failures 1, no_test_fails 1)" in generated["stdout"]
    assert f"1 tests do not pass before any change and are left out, e.g. {LEFT_OUT}" in generated["stderr"]


def test_max_tasks_and_the_same_tasks_with_any_number_of_workers(generated, tmp_path):
    """One worker and --max-tasks 2 keep the first two tasks the two-worker run kept, and stop there."""
    code, _, err = run_cli("tasks", "feature-deletion", generated["repo"], tmp_path / "out", "--max-tasks", "2")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [t["id"] for t in report["tasks"]] == [t["id"] for t in generated["report"]["tasks"][:2]]
    assert report["kept"] == 2 and report["tried"] < generated["report"]["tried"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*(t["id"] for t in report["tasks"]),
                                                                          "report.json"])


def test_repo_dir_is_never_written(generated):
    assert generated["digest_after"] == generated["digest_before"]


def test_targets_fail_and_the_solution_passes(generated, sandbox):
    """The task checker's own verdicts on every produced task: targets fail, pass-to-pass pass, and
    solution.patch makes everything pass; the targets are exactly the tests that call the feature."""
    tasks = {t.id: t for t in tasks_of(generated)}
    assert list(tasks["zebrakit.text.slugify"].target_tests) == SLUGIFY_TESTS
    assert list(tasks["zebrakit.numbers.Stats.mean"].target_tests) == MEAN_TESTS
    assert list(tasks["zebrakit.numbers.Stats"].target_tests) == [*MEAN_TESTS, "tests/test_numbers.py::test_count"]
    for task in tasks.values():
        assert LEFT_OUT not in task.target_tests + task.pass_to_pass
        assert len(task.target_tests) + len(task.pass_to_pass) == 11
        assert task.difficulty["target_tests"] == len(task.target_tests) and task.pass_rate is None
        assert task.level == "body" and task.difficulty["deleted_files"] == 0    # the default level
        plus = [line for line in task.solution_patch.read_text().splitlines()
                if line.startswith("+") and not line.startswith("+++")]
        assert task.difficulty["deleted_lines"] == sum(1 for line in plus if line[1:].strip())
        before = check_task(task, sandbox)
        assert before.status == "ok" and before.reward == 0.0
        assert set(before.failed) == set(task.target_tests) and set(before.passed) == set(task.pass_to_pass)
        after = check_task(task, sandbox, solution=True)
        assert after.status == "ok" and after.reward == 1.0 and not after.failed
    assert tasks["zebrakit.text.slugify"].difficulty["deleted_definitions"] == 2    # slugify and its helper
    assert tasks["zebrakit.numbers.Stats"].difficulty["deleted_definitions"] == 2   # __init__ and mean


def unique_deleted_lines(task, genuine: dict) -> set[str]:
    """Lines the solution adds back that occur in the original sources only as often as it adds them."""
    plus = [line[1:].strip() for line in task.solution_patch.read_text().splitlines()
            if line.startswith("+") and not line.startswith("+++")]
    sources = [line.strip() for text in genuine.values() for line in text.splitlines()]
    return {line for line in plus if len(line) >= 10 and sources.count(line) == plus.count(line)}


def test_no_trace_of_the_deleted_code_anywhere_in_a_task(generated):
    for task in tasks_of(generated):
        needles = unique_deleted_lines(task, SOURCES) | set(MARKERS.get(task.id, []))
        assert len(needles) >= 2, task.id
        for dirpath, dirnames, filenames in os.walk(task.root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                rel = path.relative_to(task.repo) if task.repo in path.parents else None
                assert not (rel and (name in NEVER_IN_A_TASK or name.endswith((".pyc", ".egg-info")))), path
                if path.is_symlink():
                    target = os.path.realpath(path)
                    assert target.startswith(str(task.root) + os.sep), f"{path} -> {target}"
                if path == task.solution_patch or not path.is_file():
                    continue
                data = path.read_bytes()
                leaked = [n for n in needles if n.encode() in data]
                assert not leaked, f"{task.id}: {path} holds {leaked}"
    slugify = next(t for t in generated["report"]["tasks"] if t["id"] == "zebrakit.text.slugify")
    assert sorted(slugify["removed_files"]) == ["README.md", "notes/snippet.txt", "original_text.txt"]


def test_instruction_describes_without_code(generated):
    task = load_task(generated["out"] / "zebrakit.text.slugify")
    assert "def slugify(title, max_length=40):" in task.instruction
    assert "Lower-case `title` and join its words with dashes" in task.instruction   # the docstring
    assert all(f"- {t}" in task.instruction for t in SLUGIFY_TESTS)
    assert "Private helpers that only it used were removed too" in task.instruction
    code = [line[1:].strip() for line in task.solution_patch.read_text().splitlines()
            if line.startswith("+") and not line.startswith("+++") and len(line.strip()) > 10]
    assert len(code) >= 5 and not any(line in task.instruction for line in code)


def test_tasks_list_and_pass_rate(generated, tmp_path):
    out = shutil.copytree(generated["out"], tmp_path / "out", symlinks=True)
    write_pass_rate(out / "zebrakit.numbers.clamp", 0.25)
    code, stdout, _ = run_cli("tasks", "list", out)
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in stdout.splitlines()[1:-1]}
    assert stdout.splitlines()[0].split() == ["id", "target", "tests", "deleted", "lines", "pass", "rate"]
    assert rows["zebrakit.numbers.clamp"] == ["1", "3", "0.25"]
    assert rows["zebrakit.text.slugify"] == ["3", str(load_task(out / "zebrakit.text.slugify")
                                                         .difficulty["deleted_lines"]), "-"]
    assert stdout.splitlines()[-1] == "4 tasks"
    with pytest.raises(TaskError, match="difficulty.pass_rate"):
        write_pass_rate(out / "zebrakit.numbers.clamp", 1.5)
    code, _, err = run_cli("tasks", "list", out / "missing")
    assert code == 2 and err.count("\n") == 1 and "does not exist or is not a directory" in err


# ------------------------------------------------------------------------------------------------
# bad inputs: one line on stderr, exit code 2, REPO_DIR untouched, OUT_DIR not created


def state(path: Path):
    return tree_digest(path) if path.is_dir() else path.read_bytes() if path.exists() else None


def one_line_error(repo: Path, out: Path, *extra) -> str:
    before = state(repo), state(out)
    code, stdout, err = run_cli("tasks", "feature-deletion", repo, out, *extra)
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert err.startswith("composer-jax tasks feature-deletion: error: ")
    assert (state(repo), state(out)) == before
    return err


def test_not_a_directory_and_bad_out_dir(tmp_path):
    (tmp_path / "file.py").write_text("x = 1\n")
    assert "REPO_DIR" in one_line_error(tmp_path / "file.py", tmp_path / "out") and "not a directory" in \
        one_line_error(tmp_path / "missing", tmp_path / "out")
    repo = write_repo(tmp_path / "repo", {"m.py": "x = 1\n"})
    assert "is inside REPO_DIR" in one_line_error(repo, repo / "tasks")
    write_repo(tmp_path / "full", {"old.txt": "x"})
    assert "not an empty directory" in one_line_error(repo, tmp_path / "full")


@pytest.mark.parametrize("files, extra, message", [
    ({"m.py": "def f():\n    return 1\n"}, (), f"no tests: `{DEFAULT_TEST_COMMAND}` collected none"),
    ({"m.py": "X = 1\n", "tests/test_m.py": "from m import X\n\n\ndef test_x():\n    assert X == 2\n"}, (),
     "no test passes before any change (1 fail, 0 skipped, 0 with unstable ids), e.g. tests/test_m.py::test_x"),
    ({"tests/test_slow.py": "import time\n\n\ndef test_hangs():\n    time.sleep(600)\n"}, ("--timeout", "3"),
     "the tests did not finish within 3 s (a hanging test?)"),
    ({"tests/test_broken.py": "def test_x(:\n"}, (), "pytest stopped before running the tests: exit code 2"),
    ({"pluggy/__init__.py": "X = 1\n", "tests/test_p.py": "def test_p():\n    pass\n"}, (),
     "'pluggy' is installed in the sandbox's Python"),
])
def test_unusable_repositories(tmp_path, files, extra, message):
    assert message in one_line_error(write_repo(tmp_path / "repo", files), tmp_path / "out", *extra)


# ------------------------------------------------------------------------------------------------
# the pieces, without the sandbox


def code_objects(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_firstlineno"):
            yield from code_objects(const)


def test_definition_lines_match_compiled_code():
    """Definition.start is what the trace keys by: the co_firstlineno of the compiled code objects."""
    decorated = ("import functools\n\n\nclass A:\n    @functools.lru_cache()\n    @staticmethod\n"
                 "    def f(\n        x,\n    ):\n        return [y for y in x]\n")
    for source in (TEXT, NUMBERS, decorated):
        defs = {d.qualname: d for d in find_definitions("m.py", source)}
        codes = [c for c in code_objects(compile(source, "m.py", "exec")) if c.co_qualname in defs]
        assert len(codes) == len(defs)
        for code in codes:
            assert defs[code.co_qualname].start == code.co_firstlineno


def test_deletion_keeps_the_module_importable_and_the_patch_restores_it(tmp_path):
    defs = find_definitions("zebrakit/text.py", TEXT)
    slugify = next(d for d in defs if d.qualname == "slugify")
    deletion = plan_deletion(slugify, defs, TEXT, word_counts(SOURCES.values()))
    assert [h.name for h in deletion.helpers] == ["_squash_separators"]
    module = {}
    exec(compile(deletion.modified, "text.py", "exec"), module)
    assert "_squash_separators" not in module and "zebra-squash" not in deletion.modified
    with pytest.raises(NotImplementedError):
        module["slugify"]("x")
    assert module["parse_pair"]("a=b") == ("a", "b") and module["slugify"].__doc__.startswith("Lower-case")
    # a helper something else names (here in a string) stays
    kept = plan_deletion(slugify, defs, TEXT, word_counts([*SOURCES.values(), 'getattr(m, "_squash_separators")']))
    assert kept.helpers == () and "def _squash_separators" in kept.modified
    # git applies the solution diff, also to a file without a final newline
    (tmp_path / "zebrakit").mkdir()
    for original in (TEXT, TEXT.rstrip("\n")):
        changed = plan_deletion(slugify, find_definitions("zebrakit/text.py", original), original,
                                word_counts([original])).modified
        (tmp_path / "zebrakit" / "text.py").write_text(changed)
        (tmp_path / "fix.patch").write_text(unified_diff("zebrakit/text.py", changed, original))
        subprocess.run(["git", "apply", "-p1", "fix.patch"], cwd=tmp_path, check=True, capture_output=True)
        assert (tmp_path / "zebrakit" / "text.py").read_text() == original


def test_tab_indented_bodies_keep_their_tabs():
    source = "class A:\n\tdef f(self, x):\n\t\ty = x + 1\n\t\treturn y\n"
    defs = find_definitions("m.py", source)
    deletion = plan_deletion(defs[-1], defs, source, word_counts([source]))
    assert deletion.modified == "class A:\n\tdef f(self, x):\n\t\traise NotImplementedError\n"
    compile(deletion.modified, "m.py", "exec")


@pytest.mark.parametrize("source, reason", [
    ("def f(x): return x + 1\n", "inline_body"),
    ('def f(x):\n    """Doc."""\n    raise NotImplementedError\n', "no_body"),
    ("import abc\n\n\nclass A:\n    @abc.abstractmethod\n    def f(self):\n        return 1\n", "abstract_or_overload"),
])
def test_what_cannot_be_deleted(source, reason):
    defs = find_definitions("m.py", source)
    assert plan_deletion(defs[-1], defs, source, word_counts([source])) == reason


def test_credit_from_trace_keys():
    """Closures credit their function, methods their class; a class body or module code at import does
    not make a definition run at import, a function called at import does."""
    texts = {"zebrakit/numbers.py": NUMBERS, "zebrakit/text.py": TEXT}
    defs = {p: find_definitions(p, t) for p, t in texts.items()}
    line = {d.qualname: d.start for d in defs["zebrakit/numbers.py"]}
    num = "zebrakit/numbers.py"
    build_defaults = next(d for d in defs["zebrakit/text.py"] if d.name == "build_defaults")
    baseline = Baseline(
        tests=("t::a", "t::b"), outcomes={"t::a": PASSED, "t::b": FAILED},
        calls={"t::a": frozenset({(num, line["Stats.mean"], "mean"), (num, line["clamp"] + 3, "<genexpr>")}),
               "t::b": frozenset({(num, line["double"], "double")})},
        at_import=frozenset({(num, 1, "<module>"), (num, line["Stats"], "Stats"),
                             ("zebrakit/text.py", build_defaults.start, "build_defaults")}), seconds=1.0)
    tests_of, at_import = _credit(defs, baseline)
    assert {d.qualname: sorted(t) for d, t in tests_of.items()} == {"Stats": ["t::a"], "Stats.mean": ["t::a"],
                                                                    "clamp": ["t::a"]}
    assert [d.qualname for d in at_import] == ["build_defaults"]
    candidates, skipped = select_candidates(texts, baseline, min_lines=3, max_target_fraction=1.0, seed=0)
    assert sorted(c.id for c in candidates) == ["zebrakit.numbers.Stats", "zebrakit.numbers.Stats.mean",
                                                "zebrakit.numbers.clamp"]
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", candidates[0].id)
    assert skipped == {"runs_at_import": 1, "untested": sum(map(len, defs.values())) - 4}
