"""The coding gym (composer_jax/tasks/gym.py): templates that render and run, a small gym whose every task
fails as given and passes with its solution (checked again here, in the sandbox), a held-out split whose
code no training task contains, and a result that depends on the seed alone."""

import ast
import json
import random

import pytest

from composer_jax import cli
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import check_tasks, load_task
from composer_jax.tasks import gym as gym_lib
from composer_jax.tasks.gym_templates import ARG_KINDS, TEMPLATES

HELD_OUT_KEYS = {t.key for t in TEMPLATES if t.held_out}


def _plain(value) -> bool:
    """Ints, strings, bools, None and lists, tuples and dicts of them: values whose repr reads back equal."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (int, str, bool))


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.key)
def test_every_template_renders_runs_and_can_lose_its_body(template):
    """For many draws: valid Python, a docstring, no `while` loop, at least 3 lines of body (what body
    deletion takes by default), plain results on every argument kind it declares, read back equal from their repr."""
    for seed in range(12):
        rng = random.Random(seed)
        source = template.render(template.names[0], rng)
        (fn,) = ast.parse(source).body
        assert ast.get_docstring(fn), template.key
        assert not [n for n in ast.walk(fn) if isinstance(n, ast.While)], template.key   # a mutation could hang it
        assert fn.body[-1].end_lineno - fn.body[1].lineno + 1 >= 3, template.key
        namespace: dict = {}
        exec(source, namespace)
        for _ in range(10):
            result = namespace[template.names[0]](*(ARG_KINDS[kind](rng) for kind in template.args))
            assert _plain(result) and eval(repr(result)) == result, (template.key, result)


def test_the_splits_share_no_template_and_the_repositories_follow_the_seed():
    assert len(HELD_OUT_KEYS) >= 8 and len(TEMPLATES) - len(HELD_OUT_KEYS) >= 30
    assert len({t.key for t in TEMPLATES}) == len(TEMPLATES)
    for held_out in (False, True):
        for index in range(20):
            name, templates, rng = gym_lib.repo_plan(3, held_out, index)
            assert {t.held_out for t in templates} == {held_out}
            files = gym_lib.render_repo(name, templates, rng)
            again = gym_lib.render_repo(*gym_lib.repo_plan(3, held_out, index))
            assert files == again and set(files) == {f"{name}.py", f"tests/test_{name}.py"}
    assert gym_lib.render_repo(*gym_lib.repo_plan(3, False, 0)) != gym_lib.render_repo(*gym_lib.repo_plan(4, False, 0))
    names = {held_out: [gym_lib.repo_plan(0, held_out, i)[0] for i in range(200)] for held_out in (False, True)}
    assert len(set(names[False]) | set(names[True])) == 400          # no name repeats, within or across splits
    shapes = {held_out: {(n[:5], len(n)) for n in names[held_out]} for held_out in (False, True)}
    assert shapes[False] == shapes[True] == {("util_", 11)}            # and none tells its split


def test_a_split_fills_in_repository_order_whatever_the_workers(tmp_path, monkeypatch):
    """Repositories made `workers` at a time: a split takes tasks in index order and stops at the first
    repository that reaches its target, so the tasks are the same for 1 and 3 workers."""
    def fake_repo(work, seed, held_out, index, sandbox):
        made = work / f"r{index}"
        tasks = []
        for i in range(index % 3 + 1):
            (made / f"t{i}").mkdir(parents=True)
            (made / f"t{i}" / "task.json").write_text(json.dumps({"id": f"t{i}"}))
            tasks.append({"id": f"t{i}"})
        report = {"tasks": tasks, "rejected": {}}
        return {"name": f"r{index}", "root": made, "templates": [], "outs": [(made, report, "bug_injection", "")]}

    monkeypatch.setattr(gym_lib, "_one_repo", fake_repo)
    results = []
    for workers in (1, 3):
        out, work = tmp_path / f"out{workers}", tmp_path / f"work{workers}"
        out.mkdir(), work.mkdir()
        config = gym_lib.GymConfig(tasks=7, held_out=0, workers=workers)
        split = gym_lib._fill_split(out, work, config, False, config.tasks, None, lambda line: None)
        results.append((split, sorted(p.name for p in out.iterdir())))
        assert not list(work.iterdir())   # every repository's work is removed, also those past the target
    assert results[0] == results[1]
    split, ids = results[0]
    assert split["tasks"] == 7 and [r["name"] for r in split["repos"]] == ["r0", "r1", "r2", "r3"]   # 1 + 2 + 3 + 1
    assert ids[0] == "bug_injection-r0-t0" and json.loads((tmp_path / "out1" / ids[0] / "task.json").read_text()) == \
        {"id": ids[0]}


@pytest.fixture(scope="module")
def small_gym(tmp_path_factory):
    out = tmp_path_factory.mktemp("gym") / "gym"
    assert cli.main(["tasks", "gym", str(out), "--tasks", "3", "--held-out", "2", "--seed", "1", "--workers", "2"]) == 0
    return out


@pytest.mark.slow
def test_every_task_of_a_small_gym_fails_as_given_and_passes_with_its_solution(small_gym):
    train = [load_task(p) for p in sorted(small_gym.iterdir()) if (p / "task.json").is_file()]
    held = [load_task(p) for p in sorted((small_gym / "held-out").iterdir())]
    assert len(train) >= 3 and len(held) >= 2
    tasks = train + held
    assert {t.family for t in tasks} == {"feature_deletion", "bug_injection"}
    assert all(t.difficulty.get("target_tests", 0) >= 1 for t in tasks)
    assert all(t.level == "body" for t in tasks if t.family == "feature_deletion")
    as_given = check_tasks(tasks, Sandbox(), workers=2)
    solved = check_tasks(tasks, Sandbox(), solution=True, workers=2)
    assert [r.reward for r in as_given] == [0.0] * len(tasks)
    assert [r.reward for r in solved] == [1.0] * len(tasks)


@pytest.mark.slow
def test_no_training_task_holds_held_out_code(small_gym):
    """The report's templates, and the text itself: no held-out function body (what a held-out body
    deletion's solution adds) appears in any training task's files."""
    report = json.loads((small_gym / "report.json").read_text())
    assert set(report["templates"]["held_out"]) == HELD_OUT_KEYS
    for repo in report["train"]["repos"]:
        assert not set(repo["templates"]) & HELD_OUT_KEYS, repo
    for repo in report["held_out"]["repos"]:
        assert set(repo["templates"]) <= HELD_OUT_KEYS, repo
    bodies = ["\n".join(line[1:] for line in p.read_text().splitlines() if line.startswith("+") and
                        not line.startswith("+++")) for p in (small_gym / "held-out").glob("feature_deletion-*/solution.patch")]
    assert bodies and all(bodies)
    training_text = "\n".join(f.read_text() for f in small_gym.glob("[!h]*/**/*.py"))
    assert "def " in training_text and not [body for body in bodies if body in training_text]


def test_a_gym_into_a_directory_with_files_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "x").write_text("")
    assert cli.main(["tasks", "gym", str(tmp_path), "--tasks", "1"]) == 2
    assert capsys.readouterr().err.strip() == \
        f"composer-jax tasks gym: error: OUT_DIR {tmp_path}: exists and is not an empty directory"
