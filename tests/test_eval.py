"""Evaluation: pass@k against enumeration, bootstrap coverage on synthetic data, exact scores of scripted
agents (toy and coding tasks), lint of the agent's changes, kill-and-restart equals uninterrupted, the
paired comparison, and one-line errors for bad input."""

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from composer_jax import cli
from composer_jax.envs import PlainFormat, ToyEnv, toy_tasks
from composer_jax.agents import AgentTurn, ScriptedAgent, load_task_set
from composer_jax.agents.lint import inspect_changes
from composer_jax.eval import EvalConfig, EvalError, compare_runs, evaluate, pass_at_k
from composer_jax.eval.scores import bootstrap, k_values, paired_difference, resample_rows
from composer_jax.tasks import load_task
from composer_jax.tasks.examples import write_example_task
from tests.test_tasks import no_leftover_copies, sandbox  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _scores(summary_json: dict) -> dict:
    """A summary without its timing (the one part that differs between runs)."""
    return {k: v for k, v in summary_json.items() if k != "timing"}


# ------------------------------------------------------------------------------------------------
# scores


def test_pass_at_k_equals_enumeration_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))   # attempts 0..c-1 are the solved ones
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - (100 * 99 * 98) / (200 * 199 * 198), rel=1e-12)
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(EvalError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("level", [0.90, 0.95])
def test_bootstrap_interval_covers_the_true_difference_at_its_nominal_rate(level):
    """200 seeded repetitions: 40 tasks of random difficulty p ~ U(0.1, 0.8), 4 attempts each by A and by a
    better B (solve probability p + 0.1). The true difference of pass@1 over the task distribution is 0.1,
    the true pass@1 of A 0.45; the intervals must cover them at the nominal rate within 3 binomial sigmas.
    The paired interval must also be as wide as normal theory says for the per-task difference, whose
    variance (E[p(1-p)] + E[p'(1-p')]) / 4 leaves out the task difficulty that an unpaired one would add."""
    rng = np.random.default_rng(1234)
    reps, tasks, samples, resamples = 200, 40, 4, 1000
    covered_diff = covered_a = 0
    widths = []
    ones = np.ones(tasks)
    for rep in range(reps):
        p_a = rng.uniform(0.1, 0.8, tasks)
        c_a, c_b = rng.binomial(samples, p_a), rng.binomial(samples, p_a + 0.1)
        rows = resample_rows(tasks, resamples, seed=rep)
        lo, hi = paired_difference((c_a / samples, ones), (c_b / samples, ones), rows, level).ci
        covered_diff += lo <= 0.1 <= hi
        widths.append(hi - lo)
        lo, hi = bootstrap(c_a / samples, ones, rows, level).ci
        covered_a += lo <= 0.45 <= hi
    tolerance = 3 * np.sqrt(level * (1 - level) / reps)
    assert abs(covered_diff / reps - level) <= tolerance, covered_diff / reps
    assert abs(covered_a / reps - level) <= tolerance, covered_a / reps

    def bernoulli_variance(lo, hi):   # E[p (1 - p)] for p ~ U(lo, hi)
        return (lo + hi) / 2 - (hi ** 3 - lo ** 3) / (3 * (hi - lo))

    sd = np.sqrt((bernoulli_variance(0.1, 0.8) + bernoulli_variance(0.2, 0.9)) / samples / tasks)
    normal_width = 2 * statistics.NormalDist().inv_cdf((1 + level) / 2) * sd
    assert np.mean(widths) == pytest.approx(normal_width, rel=0.1)


def test_ratio_scores_and_undefined_values():
    num, den = np.array([3.0, 0.0, 5.0]), np.array([1.0, 0.0, 4.0])
    rows = resample_rows(3, 500, seed=0)
    e = bootstrap(num, den, rows, 0.95)
    assert e.value == pytest.approx(8 / 5) and e.ci[0] <= e.value <= e.ci[1]
    nothing = bootstrap(np.zeros(3), np.zeros(3), rows, 0.95)           # e.g. tokens per solved, none solved
    assert nothing.value is None and nothing.ci is None


# ------------------------------------------------------------------------------------------------
# scripted agents on toy tasks (fast: no sandbox)


TOY_SOLVED = [4, 3, 0, 2, 1, 4, 0, 1, 2, 3]   # solved attempts out of 4, per task


def _toy_script(tmp_path: Path, fmt=PlainFormat()) -> tuple[list, Path, dict]:
    """Ten reverse tasks; task i is solved by TOY_SOLVED[i] of its 4 samples; the other samples submit a
    wrong answer, except that each task's sample 3, when unsolved, writes a malformed call."""
    tasks = toy_tasks("reverse", len(TOY_SOLVED), seed=3)
    scripts = {}
    for task, solved in zip(tasks, TOY_SOLVED):
        right = [[{"name": "submit", "arguments": {"answer": task.answer}}]]
        wrong = [[{"name": "submit", "arguments": {"answer": task.answer + "x"}}]]
        malformed = ['<tool_call>{"name": "submit", "arguments": {"answer": 5}}</tool_call>']   # wrong type
        scripts[task.id] = [right] * solved + [wrong] * (3 - solved) + ([] if solved == 4 else [malformed])
    path = tmp_path / "toy_scripts.json"
    path.write_text(json.dumps({"scripts": scripts}))
    return tasks, path, scripts


def _tokens(fmt, turn) -> int:
    call = turn[0] if isinstance(turn, str) else fmt.render_call("submit", turn[0]["arguments"])
    return len((call + fmt.end_of_turn).encode())


def test_scripted_agent_gets_exactly_the_pass_rate_it_was_written_for(tmp_path):
    tasks, path, scripts = _toy_script(tmp_path)
    agent = ScriptedAgent(path)
    summary = evaluate(agent, tasks, tmp_path / "run", EvalConfig(samples=4, workers=3),
                       make_env=lambda: ToyEnv(agent.fmt, use_tool=True))
    s = {name: e.value for name, e in summary.scores.items()}
    assert s["pass@1"] == pytest.approx(sum(TOY_SOLVED) / 40, abs=1e-12)
    assert s["pass@2"] == pytest.approx(np.mean([pass_at_k(4, c, 2) for c in TOY_SOLVED]), abs=1e-12)
    assert s["pass@4"] == pytest.approx(8 / 10, abs=1e-12)
    assert s["mean_reward"] == pytest.approx(sum(TOY_SOLVED) / 40, abs=1e-12)
    solved_tokens = [_tokens(agent.fmt, scripts[t.id][0][0]) for t, c in zip(tasks, TOY_SOLVED) for _ in range(c)]
    assert s["tokens_per_solved"] == pytest.approx(np.mean(solved_tokens), abs=1e-12)
    assert s["turns_per_solved"] == 1.0
    malformed = sum(c < 4 for c in TOY_SOLVED)
    assert s["tool_error_rate"] == pytest.approx(malformed / 40, abs=1e-12)   # one call per attempt
    assert s["lint_added_per_attempt"] is None                                  # no workspace to lint
    assert {t: v["solved"] for t, v in summary.per_task.items()} == {t.id: c for t, c in zip(tasks, TOY_SOLVED)}
    lo, hi = summary.scores["pass@1"].ci
    assert lo < s["pass@1"] < hi
    records = [json.loads(line) for line in (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()]
    assert len(records) == 40 and {(r["task"], r["sample"]) for r in records} == {
        (t.id, i) for t in tasks for i in range(4)}
    transcript = json.loads((tmp_path / "run" / records[0]["transcript"]).read_text())
    ids = transcript["tokens"]
    turn = transcript["turns"][0]
    assert agent.tokenizer.decode(ids[turn["start"]:turn["end"]]) == turn["text"]
    assert turn["end"] - turn["start"] == records[0]["generated_tokens"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary.to_json()


class _FailsAfter:
    """Passes turns through to `agent` and raises on call number `limit` + 1 (an injected crash)."""

    def __init__(self, agent, limit):
        self.agent, self.limit, self.calls = agent, limit, 0
        self.name, self.settings, self.fmt, self.tokenizer = agent.name, agent.settings, agent.fmt, agent.tokenizer

    def turn(self, request):
        self.calls += 1
        if self.calls > self.limit:
            raise RuntimeError("injected crash")
        return self.agent.turn(request)

    def end_episode(self, episode):
        self.agent.end_episode(episode)


def test_crash_and_restart_equals_an_uninterrupted_run(tmp_path):
    tasks, path, _ = _toy_script(tmp_path)
    agent = ScriptedAgent(path)
    env = lambda: ToyEnv(agent.fmt, use_tool=True)   # noqa: E731
    config = EvalConfig(samples=4)
    full = evaluate(agent, tasks, tmp_path / "full", config, make_env=env)

    crashing = _FailsAfter(agent, 13)
    with pytest.raises(RuntimeError, match="injected crash"):
        evaluate(crashing, tasks, tmp_path / "resumed", config, make_env=env)
    attempts = tmp_path / "resumed" / "attempts.jsonl"
    first = attempts.read_bytes()
    assert len(first.splitlines()) == 13 and not (tmp_path / "resumed" / "summary.json").exists()
    counting = _FailsAfter(agent, 10**6)
    resumed = evaluate(counting, tasks, tmp_path / "resumed", config, make_env=env)
    assert counting.calls == 40 - 13                                       # finished attempts were not redone
    assert attempts.read_bytes().startswith(first)
    assert _scores(resumed.to_json()) == _scores(full.to_json())
    for record in map(json.loads, attempts.read_text().splitlines()):       # same transcripts, byte for byte
        assert ((tmp_path / "resumed" / record["transcript"]).read_bytes()
                == (tmp_path / "full" / record["transcript"]).read_bytes())
    again = _FailsAfter(agent, 0)                                          # complete: nothing left to run
    assert _scores(evaluate(again, tasks, tmp_path / "resumed", config, make_env=env).to_json()) == _scores(
        full.to_json())


def test_a_torn_last_record_is_cut_off_and_redone(tmp_path):
    tasks, path, _ = _toy_script(tmp_path)
    agent = ScriptedAgent(path)
    env = lambda: ToyEnv(agent.fmt, use_tool=True)   # noqa: E731
    config = EvalConfig(samples=4)
    full = evaluate(agent, tasks[:2], tmp_path / "run", config, make_env=env)
    attempts = tmp_path / "run" / "attempts.jsonl"
    lines = attempts.read_bytes().splitlines(keepends=True)
    attempts.write_bytes(b"".join(lines[:5]) + lines[5][:30])              # killed in the middle of a write
    counting = _FailsAfter(agent, 10**6)
    assert _scores(evaluate(counting, tasks[:2], tmp_path / "run", config, make_env=env).to_json()) == _scores(
        full.to_json())
    assert counting.calls == 3 and len(attempts.read_bytes().splitlines()) == 8


# ------------------------------------------------------------------------------------------------
# coding tasks, lint, the CLI


def _solution(task_dir: Path, index: int, prefix: str = "") -> list:
    source = (task_dir / "repo" / "mathops.py").read_text()
    solved = prefix + source.replace("    raise NotImplementedError\n", f"    return {index + 2} * a + b\n")
    return [[{"name": "write_file", "arguments": {"path": "mathops.py", "content": solved}}],
            [{"name": "submit", "arguments": {}}]]


GIVE_UP = [[{"name": "read_file", "arguments": {"path": "missing.py"}}], [{"name": "submit", "arguments": {}}]]


@pytest.fixture(scope="module")
def coding(tmp_path_factory):
    """Four example tasks; agent A solves tasks 0, 1 (adding an unused import) and 3; agent B solves 0, 1
    and 2 (cleanly) and gives up on 3."""
    root = tmp_path_factory.mktemp("coding")
    dirs = [write_example_task(root / "tasks" / f"t{i}", i) for i in range(4)]
    ids = [load_task(d).id for d in dirs]
    a = {ids[0]: [_solution(dirs[0], 0)], ids[1]: [_solution(dirs[1], 1, "import os\n")], ids[2]: [GIVE_UP],
         ids[3]: [_solution(dirs[3], 3)]}
    b = {ids[0]: [_solution(dirs[0], 0)], ids[1]: [_solution(dirs[1], 1)], ids[2]: [_solution(dirs[2], 2)],
         ids[3]: [GIVE_UP]}
    for name, scripts in (("a", a), ("b", b)):
        (root / f"{name}.json").write_text(json.dumps({"scripts": scripts}))
    return root, ids


def test_cli_eval_on_coding_tasks_and_compare(coding, tmp_path, capsys):
    root, ids = coding
    for name in ("a", "b"):
        assert cli.main(["eval", f"scripted:{root / f'{name}.json'}", str(root / "tasks"), "--workers", "2",
                         "--out", str(tmp_path / name), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "run directory:" in out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["scores"]["pass@1"]["value"] == 0.75
    assert summary["scores"]["lint_added_per_attempt"]["value"] == 0.25           # the unused `os`
    assert summary["scores"]["tool_error_rate"]["value"] == pytest.approx(1 / 8)  # read of a missing file
    records = {r["task"]: r for r in map(json.loads, (tmp_path / "a" / "attempts.jsonl").read_text().splitlines())}
    assert [records[t]["lint_added"] for t in ids] == [0, 1, 0, 0]
    transcript = json.loads((tmp_path / "a" / records[ids[1]]["transcript"]).read_text())
    assert transcript["inspection"]["lint"]["added_findings"] == ["mathops.py: F401 `os` imported but unused"]
    assert "+import os\n" in transcript["inspection"]["diff"] and transcript["check"]["status"] == "ok"

    assert cli.main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--png",
                     str(tmp_path / "ab.png")]) == 0
    table = capsys.readouterr().out
    assert f"solved only by B (1): {ids[2]}" in table and f"solved only by A (1): {ids[3]}" in table
    lint_row = next(line for line in table.splitlines() if line.startswith("lint_added_per_attempt"))
    assert lint_row.split()[1:4] == ["0.250", "0.000", "-0.250"]
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = compare_runs(tmp_path / "a", tmp_path / "b")
    assert c.solved_only_by == ((ids[3],), (ids[2],))
    assert {r.score.name: r.diff.value for r in c.rows}["pass@1"] == 0.0


def test_lint_counts_added_findings_by_identity_not_line(sandbox, tmp_path):
    task = load_task(write_example_task(tmp_path / "task", 0))
    repo = task.repo
    (repo / "old.py").write_text("import os\n\n\ndef f():\n    return undefined_a\n")    # 2 findings before
    (repo / "gone.py").write_text("import sys\n")                                       # deleted: 1 before
    work = tmp_path / "work"
    subprocess.run(["cp", "-r", str(repo), str(work)], check=True)
    (work / "gone.py").unlink()
    (work / "old.py").write_text("import json\n\nimport os\n\n\ndef f():\n    return undefined_a + undefined_b\n")
    (work / "new.py").write_text("x = (\n")                                             # a syntax error
    (work / "link.py").symlink_to("/etc/passwd")                                        # never followed
    report = inspect_changes(sandbox, task, work)
    assert report["changed_files"] == ["gone.py", "link.py", "new.py", "old.py"]
    lint = report["lint"]
    assert (lint["before"], lint["after"]) == (3, 5)
    assert [(f.split(":")[0], f.split()[1]) for f in lint["added_findings"]] == [
        ("new.py", "invalid-syntax"), ("old.py", "F401"), ("old.py", "F821")]
    assert lint["added"] == 3 and "undefined_b" in lint["added_findings"][2]
    assert "Binary file or symlink link.py differs" in report["diff"] and "root:" not in report["diff"]
    assert "-import sys\n" in report["diff"] and "+x = (\n" in report["diff"]


def test_killed_cli_run_restarts_without_redoing_attempts(coding, tmp_path):
    """SIGKILL a `composer-jax eval` process after 3 of 8 attempts; the same command then finishes the
    other 5 and its summary equals an uninterrupted run's."""
    root, _ = coding
    argv = ["eval", f"scripted:{root / 'a.json'}", str(root / "tasks"), "--samples", "2", "--quiet"]
    assert cli.main(argv + ["--out", str(tmp_path / "full")]) == 0
    out = tmp_path / "killed"
    private_tmp = tmp_path / "tmp"           # where the killed run leaves its episode's workspace
    private_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(private_tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "composer_jax.cli", *argv, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    attempts = out / "attempts.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if attempts.exists() and attempts.read_bytes().count(b"\n") >= 3:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    first = attempts.read_bytes()
    first = first[:first.rfind(b"\n") + 1]
    done = len(first.splitlines())
    assert 3 <= done < 8 and not (out / "summary.json").exists()
    assert cli.main(argv + ["--out", str(out)]) == 0
    final = attempts.read_bytes()
    assert final.startswith(first) and len(final.splitlines()) == 8
    assert len({(r["task"], r["sample"]) for r in map(json.loads, final.splitlines())}) == 8
    assert _scores(json.loads((out / "summary.json").read_text())) == _scores(
        json.loads((tmp_path / "full" / "summary.json").read_text()))


# ------------------------------------------------------------------------------------------------
# bad input


def _task_dirs(tmp_path: Path, broken: bool = False) -> Path:
    root = tmp_path / "tasks"
    write_example_task(root / "t0", 0)
    if broken:
        (root / "t0" / "task.json").write_text('{"id": "x"')
    return root


@pytest.mark.parametrize("args, line", [
    (["--samples", "0"], "samples (K, attempts per task) must be an integer >= 1, got 0"),
    (["--workers", "0"], "workers must be an integer >= 1, got 0"),
    (["--max-turns", "-1"], "max turns must be an integer >= 1, got -1"),
    (["--temperature", "0.5"], "MODEL 'scripted:{scripts}': a scripted agent does not sample; --temperature does "
                               "not apply"),
])
def test_bad_settings_are_one_line_errors(tmp_path, capsys, args, line):
    scripts = tmp_path / "s.json"
    scripts.write_text(json.dumps({"scripts": {}}))
    assert cli.main(["eval", f"scripted:{scripts}", str(_task_dirs(tmp_path)), *args,
                     "--out", str(tmp_path / "out")]) == 2
    assert _one_line(capsys.readouterr().err) == "composer-jax eval: error: " + line.format(scripts=scripts)
    assert not (tmp_path / "out").exists()


def test_bad_task_sets_models_and_runs_are_one_line_errors(tmp_path, capsys):
    scripts = tmp_path / "s.json"
    scripts.write_text(json.dumps({"scripts": {"scaled-sum-0": [[[{"name": "submit", "arguments": {}}]]]}}))
    model = f"scripted:{scripts}"

    def error(*argv) -> str:
        assert cli.main(list(argv)) == 2
        return _one_line(capsys.readouterr().err).removeprefix("composer-jax eval: error: ").removeprefix(
            "composer-jax eval compare: error: ")

    (tmp_path / "empty").mkdir()
    assert error("eval", model, str(tmp_path / "empty")) == (
        f"TASKS_DIR {tmp_path / 'empty'}: no tasks in it (subdirectories holding a task.json)")
    assert error("eval", model, str(tmp_path / "missing")) == (
        f"TASKS_DIR {tmp_path / 'missing'}: does not exist or is not a directory")
    broken = _task_dirs(tmp_path / "b", broken=True)
    assert error("eval", model, str(broken)).startswith(f"task {broken / 't0'}: field 'task.json': is not valid JSON")
    tasks = _task_dirs(tmp_path)
    (tmp_path / "hf_model").mkdir()
    assert error("eval", str(tmp_path / "hf_model"), str(tasks)) == (
        f"MODEL '{tmp_path / 'hf_model'}': does not load: {tmp_path / 'hf_model'} is not a model: it has no config.json "
        "(a Hugging Face directory), model_config.yaml (a converted directory) or checkpoints/ (a run directory)")
    assert error("eval", model, str(tasks), "max_slots=2") == (
        f"MODEL '{model}': a scripted agent takes no settings, got max_slots=2")
    assert error("eval", "scripted:/nonexistent.json", str(tasks)) == (
        "scripted agent file /nonexistent.json: does not exist")
    bad_call = tmp_path / "bad_call.json"
    bad_call.write_text(json.dumps({"scripts": {"t": [[[{"tool": "submit"}]]]}}))
    assert error("eval", f"scripted:{bad_call}", str(tasks)) == (
        f'scripted agent file {bad_call}: scripts.t[0][0][0]: a tool call is {{"name": "<tool>", "arguments": '
        '{...}}, got {"tool": "submit"}')
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"scripts": {"scaled-sum-0": [[[{"name": "list_dir", "arguments": {}}]]]}}))
    assert error("eval", f"scripted:{short}", str(tasks), "--out", str(tmp_path / "short")) == (
        f"scripted:{short}: the script of task scaled-sum-0 sample 0 has 1 turns and the episode asks for turn 2 "
        "(end scripts with a submit call)")

    assert cli.main(["eval", model, str(tasks), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    capsys.readouterr()
    assert error("eval", model, str(tasks), "--out", str(tmp_path / "run"), "--samples", "2") == (
        f"{tmp_path / 'run'} holds an evaluation with a different 'samples' (1 in run.json, now 2): rerun with the "
        "same settings or use another output directory")
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run" / "notes.txt").write_text("mine")
    assert error("eval", model, str(tasks), "--out", str(tmp_path / "not_a_run")) == (
        f"{tmp_path / 'not_a_run'} exists and is not an evaluation run directory (no run.json): choose another "
        "output directory")
    assert error("eval", "compare", str(tmp_path / "run"), str(tmp_path / "not_a_run")) == (
        f"{tmp_path / 'not_a_run'}: no attempts.jsonl (not an evaluation run directory)")
    other = tmp_path / "other_tasks"
    write_example_task(other / "t5", 5)
    other_scripts = tmp_path / "other.json"
    other_scripts.write_text(json.dumps({"scripts": {"scaled-sum-5": [[[{"name": "submit", "arguments": {}}]]]}}))
    assert cli.main(["eval", f"scripted:{other_scripts}", str(other), "--out", str(tmp_path / "run5"), "--quiet"]) == 0
    capsys.readouterr()
    assert error("eval", "compare", str(tmp_path / "run"), str(tmp_path / "run5")) == (
        f"{tmp_path / 'run'} and {tmp_path / 'run5'} have no task in common: nothing to compare")
    with (tmp_path / "run" / "attempts.jsonl").open("a") as f:
        f.write('{"task": "scaled-sum-0"}\n')
    assert error("eval", "compare", str(tmp_path / "run"), str(tmp_path / "run5")) == (
        f"{tmp_path / 'run' / 'attempts.jsonl'}:2: not an attempt record (missing sample, seed, reward, solved, turns, "
        "generated_tokens, tool_calls, tool_errors, lint_added, status, wall_s, transcript)")


def test_the_api_checks_its_tasks(tmp_path):
    tasks, path, _ = _toy_script(tmp_path)
    agent = ScriptedAgent(path)
    with pytest.raises(EvalError, match="tasks other than coding tasks need make_env"):
        evaluate(agent, tasks, tmp_path / "x")
    with pytest.raises(EvalError, match="task id 'reverse-3-0' appears more than once"):
        evaluate(agent, [tasks[0], tasks[0]], tmp_path / "x", make_env=lambda: ToyEnv(agent.fmt, use_tool=True))
    with pytest.raises(EvalError, match="no tasks to evaluate"):
        evaluate(agent, [], tmp_path / "x")
    assert load_task_set(write_example_task(tmp_path / "one", 0))[0].id == "scaled-sum-0"   # one task directory
    assert AgentTurn([1, 2]).logprobs is None
