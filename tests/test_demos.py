"""`tasks demos`: solve conversations that replay through a fresh CodingEnv to the same tool outputs and
reward 1, hints equal to what the env gives for the mistake at that turn, edits derived from the
solution, and the command's bad inputs."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from composer_jax import cli
from composer_jax.envs import CodingEnv, CodingEnvConfig, get_format, hint_for
from composer_jax.envs.coding import SYSTEM_PROMPT
from composer_jax.envs.demos import (NO_ACTION, UNKNOWN_TOOL, DemoConfig, DemoError, DemoSkip, edit_steps,
                                     hinted_records, mistake_text, play, solution_calls)
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import FeatureDeletionConfig, generate_tasks, load_task
from tests.test_tasks import no_leftover_copies  # noqa: F401  (autouse: no temporary copy is left behind)

TEXTKIT = Path(__file__).resolve().parents[1] / "configs" / "repos" / "textkit"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["tasks", "demos", *map(str, argv)])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos") / "tasks"
    generate_tasks(str(TEXTKIT), str(out), FeatureDeletionConfig(max_tasks=2))
    return out


@pytest.fixture(scope="module")
def written(tasks_dir):
    """The command run once for the module: (exit code, stdout, stderr, records)."""
    out = tasks_dir.parent / "demos.jsonl"
    rc, stdout, stderr = run_cli(tasks_dir, out, "--hinted-share", "0.5", "--workers", "2", "--seed", "3")
    return rc, stdout, stderr, [json.loads(line) for line in out.read_text().splitlines()]


def timeless(text: str) -> str:
    """A tool output without its wall times ('exit code 1 after 0.33 s', pytest's 'in 0.02s'): the only part
    of a replay that may differ."""
    return re.sub(r"\d+\.\d+ ?s\b", "<t>s", text)


def replay(record: dict, task, sandbox, fmt_name="plain", max_output_chars=4000, mistake_at=None, mistake=""):
    """Step a fresh CodingEnv through the record's assistant turns (text, then the tool call rendered by
    the format), independently of the builder; with `mistake_at`, send `mistake` first at that assistant
    turn. Returns (tool outputs seen, the final info, the hint the env gave for the mistake, the kinds of
    the flags of the record's turns)."""
    fmt = get_format(fmt_name)
    turns = [m for m in record["messages"] if m.get("tool_calls")]
    calls = [m["tool_calls"][0] for m in turns]
    tools = tuple(t["function"]["name"] for t in record["tools"])
    config = CodingEnvConfig(max_turns=len(calls) + 1, max_output_chars=max_output_chars, tools=tools)
    env = CodingEnv(sandbox, fmt, config)
    first = env.reset(task)
    assert first[1:] == record["messages"][:2] and first[1]["content"] == SYSTEM_PROMPT
    assert record["tools"] == [t.schema() for t in env.tools]
    outputs, hint, flags = [], None, []
    for k, (turn, call) in enumerate(zip(turns, calls)):
        if k == mistake_at:
            _, _, info = env.step(mistake)
            hint = hint_for(info["flags"], env.hint_context)
        assert call["id"] == f"call_{k}" and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], dict)
        text = turn["content"] + fmt.render_call(call["function"]["name"], call["function"]["arguments"], k)
        observation, done, info = env.step(text)
        flags += [f.kind for f in info["flags"]]
        assert done == (k == len(calls) - 1)
        if not done:
            assert [m["role"] for m in observation] == ["tool"]
            outputs.append(observation[0]["content"])
    return outputs, info, hint, flags


def check_replays(record, task, sandbox, **kw) -> list[str]:
    """The record's tool messages are what the env shows, each answering the call before it; reward 1;
    no turn flagged but for output cut at the limit. Returns the kinds of the flags."""
    messages = record["messages"]
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            assert messages[i - 1]["tool_calls"][0]["id"] == m["tool_call_id"]
    assert messages[-1]["tool_calls"][0]["function"] == {"name": "submit", "arguments": {}}
    outputs, info, _, flags = replay(record, task, sandbox, **kw)
    assert [timeless(o) for o in outputs] == [timeless(m["content"]) for m in messages if m["role"] == "tool"]
    assert info["task_reward"] == 1.0 and set(flags) <= {"output_limit"}
    return flags


def test_solve_conversations_replay_to_the_same_outputs_and_reward_1(written, tasks_dir, sandbox):
    rc, stdout, stderr, records = written
    assert rc == 0 and stderr == ""
    assert [r["task"] for r in records] == sorted(d.name for d in tasks_dir.iterdir() if d.is_dir())
    assert stdout.splitlines()[0] == "2 conversations written (1 hinted), 0 tasks skipped"
    for record in records:
        task = load_task(tasks_dir / record["task"])
        names = [m["tool_calls"][0]["function"]["name"] for m in record["messages"] if m.get("tool_calls")]
        assert names == ["run", "read_file", "edit", "run", "submit"]
        tool_outputs = [m["content"] for m in record["messages"] if m["role"] == "tool"]
        assert tool_outputs[0].startswith("exit code 1") and tool_outputs[-1].startswith("exit code 0")
        summary = record["messages"][-1]["content"]
        assert re.fullmatch(r"I implemented \w+ in textkit\.py; the tests pass\.", summary), summary
        assert check_replays(strip_hint(record), task, sandbox) == []          # no turn flagged


def strip_hint(record: dict) -> dict:
    """The solve conversation under a hinted one: without the untrained message and the hint after it."""
    messages = record["messages"]
    keep = [m for i, m in enumerate(messages)
            if m.get("weight") != 0 and (i == 0 or messages[i - 1].get("weight") != 0)]
    return {**record, "kind": "solve", "messages": keep}


def check_hint(record: dict, mistake: str, tasks_dir, sandbox) -> None:
    """The hinted record's inserted messages, and its hint equal to the env's for `mistake` sent there."""
    messages = record["messages"]
    assert record["kind"] == "hinted" and sum(m.get("weight") == 0 for m in messages) == 1
    at = next(i for i, m in enumerate(messages) if m.get("weight") == 0)
    assert messages[at] == {"role": "assistant", "content": "", "weight": 0}
    assert messages[at + 1]["role"] == "system" and messages[at + 2].get("tool_calls")
    turn = sum(m["role"] == "assistant" for m in messages[:at])
    _, info, hint, _ = replay(strip_hint(record), load_task(tasks_dir / record["task"]), sandbox, mistake_at=turn,
                              mistake=mistake_text(mistake, DemoConfig(), turn))
    assert hint and messages[at + 1]["content"] == hint
    assert info["task_reward"] == 1.0    # the mistake changes no tool output


def test_hints_are_what_the_env_gives_for_the_mistake_at_that_turn(written, tasks_dir, sandbox):
    records = written[3]
    (hinted,) = [r for r in records if r["kind"] == "hinted"]
    check_hint(hinted, NO_ACTION, tasks_dir, sandbox)      # the first hinted conversation: no tool call
    # every conversation hinted: the second one's mistake is an unknown tool
    solves = [strip_hint(r) for r in records]
    again = hinted_records(solves, DemoConfig(seed=3, hinted_share=1.0), sandbox)
    assert [strip_hint(r) for r in again] == solves and again[0] == hinted
    check_hint(again[1], UNKNOWN_TOOL, tasks_dir, sandbox)
    assert "the available tools are list_dir, read_file" in again[1]["messages"][
        next(i for i, m in enumerate(again[1]["messages"]) if m.get("weight") == 0) + 1]["content"]


def test_edit_steps_apply_one_unique_occurrence_at_a_time():
    before = "".join(f"def f{i}():\n    return 0\n\n" for i in range(4)) + "x = 1\n"
    after = "import os\n" + before.replace("def f1():\n    return 0", "def f1():\n    return 1").replace(
        "x = 1\n", "x = 2\ny = 3\n")
    steps = edit_steps(before, after)
    text = before
    for old, new in steps:
        assert text.count(old) == 1
        text = text.replace(old, new, 1)
    assert text == after and len(steps) == 3
    assert steps[1] == ("def f1():\n    return 0\n\n", "def f1():\n    return 1\n\n")   # context made it unique
    # no context of up to 10 lines makes the middle of 30 equal lines unique; an empty file has no `old`
    assert edit_steps("a\n" * 30, "a\n" * 15 + "b\n" + "a\n" * 14) is None
    assert edit_steps("", "new\n") is None


def test_write_file_when_edit_is_not_declared(tasks_dir, sandbox):
    task = load_task(next(d for d in sorted(tasks_dir.iterdir()) if d.is_dir()))
    calls, summary = solution_calls(task, sandbox, DemoConfig(tools=("run", "write_file", "submit")))
    assert [name for name, _ in calls] == ["run", "write_file", "run", "submit"]
    assert summary.startswith("I implemented ") and summary.endswith(" in textkit.py; the tests pass.")
    assert calls[1][1]["path"] == "textkit.py" and calls[1][1]["content"] == (TEXTKIT / "textkit.py").read_text()


def test_a_flagged_turn_is_not_demonstrated(tasks_dir, tmp_path, sandbox):
    """A solution that leaves an unused variable solves the task, but its edit turn is flagged (style):
    SFT would teach what the hint corrects, so the task is skipped with the flag as the reason."""
    untidy = tmp_path / "untidy"
    shutil.copytree(next(d for d in sorted(tasks_dir.iterdir()) if d.is_dir()), untidy)
    patch = (untidy / "solution.patch").read_text()
    (untidy / "solution.patch").write_text(patch.replace("+    ", "+    unused = 0; ", 1))
    task, config = load_task(untidy), DemoConfig()
    with pytest.raises(DemoSkip, match=r"^turn 3 \(edit\) is flagged: style: textkit\.py:\d+ F841 Local variable "
                                       r"`unused` is assigned to but never used$"):
        play(task, *solution_calls(task, sandbox, config), sandbox, config)


def test_tools_that_cannot_express_a_solution_are_an_error(tasks_dir, tmp_path):
    rc, stdout, stderr = run_cli(tasks_dir, tmp_path / "d.jsonl", "--tools", "run,submit")
    assert rc == 2 and stdout == "" and not (tmp_path / "d.jsonl").exists()
    assert stderr.splitlines() == [("composer-jax tasks demos: error: --tools run,submit: cannot express a solution: "
                                    "declare edit or write_file")]
    with pytest.raises(DemoError, match="--tools read_file: must include submit"):
        DemoConfig(tools=("read_file",))


def test_kimi_format_skips_tasks_without_patch_or_reward(tasks_dir, tmp_path, sandbox):
    """One good task, one without solution.patch, one whose patch does not solve it: one conversation."""
    good, *_ = sorted(d for d in tasks_dir.iterdir() if d.is_dir())
    mixed = tmp_path / "mixed"
    for name in ("a-good", "b-nopatch", "c-wrong"):
        shutil.copytree(good, mixed / name)
        meta = json.loads((mixed / name / "task.json").read_text())
        (mixed / name / "task.json").write_text(json.dumps({**meta, "id": name}))
    (mixed / "b-nopatch" / "solution.patch").unlink()
    patch = (mixed / "c-wrong" / "solution.patch").read_text()
    (mixed / "c-wrong" / "solution.patch").write_text(patch.replace("+    ", "+    pass  # ", 1))
    out = tmp_path / "k.jsonl"
    rc, stdout, stderr = run_cli(mixed, out, "--format", "kimi", "--max-output-chars", "300", "--hinted-share", "0")
    assert rc == 0, stderr
    assert stderr.startswith("c-wrong: skipped: the solve trajectory earns reward 0.0")
    assert len(stderr.splitlines()) == 1
    reason = stderr.split("skipped: ", 1)[1].strip()
    assert stdout.splitlines() == [("1 conversations written (0 hinted), 2 tasks skipped: "
                                    f"b-nopatch (no solution.patch); c-wrong ({reason})"), f"conversations: {out}"]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["task"] == "a-good" and record["kind"] == "solve"
    check_replays(record, load_task(mixed / "a-good"), sandbox, fmt_name="kimi", max_output_chars=300)


@pytest.mark.parametrize("case", ["missing", "empty", "no-patch", "out-dir"])
def test_bad_input_is_one_line_and_writes_nothing(case, tasks_dir, tmp_path):
    source, out = tmp_path / "tasks", tmp_path / "out.jsonl"
    if case == "empty":
        source.mkdir()
    elif case == "no-patch":
        shutil.copytree(next(d for d in tasks_dir.iterdir() if d.is_dir()), source / "t")
        (source / "t" / "solution.patch").unlink()
    elif case == "out-dir":         # a directory that cannot be made (a file is in the way)
        (tmp_path / "a_file").write_text("")
        source, out = tasks_dir, tmp_path / "a_file" / "data" / "out.jsonl"
    rc, stdout, stderr = run_cli(source, out)
    expected = {"missing": f"TASKS_DIR {source}: does not exist or is not a directory",
                "empty": f"TASKS_DIR {source}: no tasks in it (subdirectories holding a task.json)",
                "no-patch": f"TASKS_DIR {source}: none of its 1 tasks has a solution.patch",
                "out-dir": f"OUT {out}: {tmp_path / 'a_file'} is not a writable directory"}[case]
    assert (rc, stdout, stderr.splitlines()) == (2, "", [f"composer-jax tasks demos: error: {expected}"])
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_toy_recoveries_call_a_missing_tool_then_submit_as_the_env_answers():
    """`--wrong-tool-share 0.5`: half the conversations first call the undeclared `answer` tool, get the
    environment's own error and submit; played back through the env each earns its reward, with the first
    turn flagged unknown_tool. The flag needs --use-tool and a share in [0, 1]."""
    from composer_jax.envs import ToyEnv, toy_tasks
    from composer_jax.envs.demos import DemoError, toy_demos

    fmt = get_format("plain")
    tasks = toy_tasks("add", 6, seed=5)
    records = toy_demos(tasks, ToyEnv(fmt, use_tool=True, max_turns=2), wrong_tool_share=0.5, seed=1)
    recoveries = [(r, t) for r, t in zip(records, tasks) if r["kind"] == "recovery"]
    assert len(recoveries) == 3
    for record, task in recoveries:
        env = ToyEnv(fmt, use_tool=True, max_turns=2)
        env.reset(task)
        user, wrong, error, submit = record["messages"]
        call = lambda m: fmt.render_call(m["tool_calls"][0]["function"]["name"],  # noqa: E731
                                         m["tool_calls"][0]["function"]["arguments"])
        observation, done, info = env.step(call(wrong))
        assert observation[0]["content"] == error["content"] and [f.kind for f in info["flags"]] == ["unknown_tool"]
        assert env.step(call(submit))[2]["task_reward"] == 1.0
    # hinted ones then take the wrong call as their third mistake: the teacher has seen its hint
    env = ToyEnv(fmt, use_tool=True, max_turns=2)
    records = toy_demos(tasks, env, hinted_share=0.5, wrong_tool_share=0.5, seed=1)
    hinted = [(r, t) for r, t in zip(records, tasks) if r["kind"] == "hinted"]
    assert len(hinted) == 3 and [r["kind"] for r in records].count("recovery") == 3
    for rank, (record, task) in enumerate(hinted):
        env.reset(task)
        mistake = ["", env.demonstration(task)[:len(env.demonstration(task)) // 2],
                   fmt.render_call("answer", {"answer": task.answer})][rank]
        assert record["messages"][2] == {"role": "system", "content": hint_for(env.step(mistake)[2]["flags"],
                                                                               env.hint_context)}
    assert hinted[2][0]["messages"][2]["content"].startswith("Reminder: the available tools are")
    for env, share, message in ((ToyEnv(fmt), 0.5, "needs --use-tool"), (ToyEnv(fmt, use_tool=True), 1.5, r"in \[0, 1\]")):
        with pytest.raises(DemoError, match=message):
            toy_demos(tasks, env, wrong_tool_share=share)


def test_toy_demonstrations_show_the_prompt_and_the_teachers_hint_as_rl_sees_them():
    """`tasks demos toy:add --use-tool --hinted-share 0.5` on 4 tasks: a solve record renders as the toy
    env's RL prompt followed by its solving call (the only trained text); a hinted record's context before
    the call is exactly the teacher's context of an RL batch for the flagged turn (the trajectory up to the
    turn, then the slot's hint tokens from `rollout_fields`), the two mistakes made in turn."""
    from composer_jax.data import chat
    from composer_jax.data.tokenizer import ByteTokenizer
    from composer_jax.envs import TokenEpisode, ToyEnv, rollout_fields, toy_tasks
    from composer_jax.envs.demos import toy_demos

    tokenizer, env = ByteTokenizer(), ToyEnv(get_format("plain"), use_tool=True)
    tasks = toy_tasks("add", 4, seed=5)
    records = toy_demos(tasks, env, hinted_share=0.5, seed=0)
    assert [r["kind"] for r in records].count("hinted") == 2
    kinds = set()
    for record, task in zip(records, tasks):
        tokens, mask = chat.tokenize_conversation(record["messages"], tokenizer.encode, env.fmt, record["tools"])
        answer = env.demonstration(task) + env.fmt.end_of_turn
        end = len(tokens) - len(env.fmt.turn_suffix.encode())      # the template's text after the turn
        assert tokenizer.decode(tokens[mask == 1]) == answer and mask[end - len(answer.encode()):end].all()
        context = tokens[:end - len(answer.encode())]
        episode = TokenEpisode(env, tokenizer)
        prompt = episode.start(task)
        if record["kind"] == "solve":
            assert np.array_equal(context, prompt)
            continue
        mistake = "" if not kinds else env.demonstration(task)[:len(env.demonstration(task)) // 2]
        episode.step(np.asarray(tokenizer.encode(mistake + env.fmt.end_of_turn), np.int32))
        fields = rollout_fields([episode], [0], seq_len=512, slots=1, window=256)
        hint = fields["teacher_tokens"][0, 0][:int(np.argmax(fields["teacher_map"][0, 0] >= 0))]   # before the turn
        assert len(hint) and np.array_equal(context, np.concatenate([prompt, hint]))
        kinds.add(episode.turns[0].flags[0].kind)
    assert kinds == {"no_action", "malformed_call"}
