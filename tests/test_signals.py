"""The signals Composer names, read from coding episodes: style, communication, effort (redundant_call) and
the wrong tool for the job; each fires on its scripted case, stays silent on a clean one, and its hint
reaches the teacher."""

import pytest

from composer_jax.config import ConfigError, from_dict
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs import (TOOL_NAMES, CodingEnv, CodingEnvConfig, PlainFormat, RewardConfig, TokenEpisode,
                               rollout_fields)
from tests.env_fixtures import example_task, no_leftover_workspaces, sandbox  # noqa: F401 (fixtures)

BYTES = ByteTokenizer()


FIX = {"path": "mathops.py", "old": "    raise NotImplementedError\n", "new": "    return 3 * a + b\n"}
TESTS = {"command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests"}
SUMMARY = "I made scaled_sum return 3 * a + b; the tests pass."


def _call(name, args=None, text=""):
    return text + PlainFormat().render_call(name, args or {})


def _play(sandbox, task, turns, config=CodingEnvConfig(), rewards=RewardConfig()):
    """A TokenEpisode of CodingEnv(config) through these assistant texts: (the episode, the env's stats,
    each turn's flag kinds)."""
    env = CodingEnv(sandbox, PlainFormat(), config)
    ep = TokenEpisode(env, BYTES, rewards=rewards)
    ep.start(task)
    for text in turns:
        ep.step(BYTES.encode(text + env.fmt.end_of_turn))
    env.close()
    return ep, env.stats, [[f.kind for f in t.flags] for t in ep.turns]


def test_style_flags_the_lint_findings_a_turns_own_edits_added(sandbox, example_task):
    unused = {**FIX, "new": "    x = a\n    return 3 * a + b\n"}
    turns = [_call("edit", unused),                                       # F841 at line 7
             _call("edit", {"path": "mathops.py", "old": "    x = a\n", "new": ""}),       # tidied: nothing added
             _call("write_file", {"path": "helper.py", "content": "import os\n"})       # a new file's finding
             + _call("write_file", {"path": "notes.txt", "content": "x = (\n"}),       # not Python: not linted
             _call("edit", {"path": "helper.py", "old": "import os\n", "new": "\n\nimport os\n"}),   # moved only
             _call("write_file", {"path": "link.py", "content": "x = 1\n"})     # a link now: the host never
             + _call("run", {"command": "ln -sf /etc/passwd link.py"}),          # follows it
             _call("submit", text="I made scaled_sum return 3 * a + b and added helper.py.")]
    ep, stats, kinds = _play(sandbox, example_task, turns, rewards=RewardConfig(style_weight=0.5))
    assert kinds == [["style"], [], ["style"], [], [], []]
    assert ep.turns[0].hint == ("Your edit added lint findings: mathops.py:7 F841 Local variable `x` is assigned to "
                                "but never used; fix them.")
    assert ep.turns[2].flags[0].detail == "helper.py:1 F401 `os` imported but unused"
    assert stats["style_findings"] == ep.info["style_findings"] == 2 and ep.info["task_reward"] == 1.0
    assert ep.reward_terms["style"] == -1.0 and ep.reward == 0.0
    # the lint off: neither counted nor flagged; the signal not among those that flag: counted only
    for config, count in ((CodingEnvConfig(lint_edits=False), 0), (CodingEnvConfig(signals=("effort",)), 1)):
        ep, stats, kinds = _play(sandbox, example_task, [_call("edit", unused)], config)
        assert kinds == [[]] and stats["style_findings"] == count


def test_communication_checks_the_final_message_against_what_the_env_saw(sandbox, example_task):
    fix, test = _call("edit", FIX), _call("run", TESTS)
    cases = {   # turns -> the final turn's flag detail
        "claims without a test run": ([fix, _call("submit", text=SUMMARY)],
                                      "says the tests pass, but no test was run: run them, or do not claim it"),
        "claims after a failing run": ([test, fix, _call("submit", text=SUMMARY)],
                                       ("says the tests pass, but the last test run failed (exit code 1): report "
                                        "what you saw")),
        "says nothing of the change": ([fix, test, _call("submit", text="Done.")],
                                       "does not say what you changed: sum up the change in a sentence or two"),
        "too long": ([fix, test, _call("submit", text=SUMMARY + " More detail." * 10)],
                     f"is {len(SUMMARY) + 130} characters long: keep it under 100"),
    }
    for name, (turns, detail) in cases.items():
        ep, stats, kinds = _play(sandbox, example_task, turns, CodingEnvConfig(max_final_chars=100),
                                 RewardConfig(communication_weight=[[0, 0.0], [5, 0.25]]))
        assert kinds == [[]] * (len(turns) - 1) + [["communication"]], name
        assert ep.turns[-1].flags[0].detail == detail and ep.turns[-1].hint == f"Your final message {detail}.", name
        assert ep.info["communication_issues"] == 1 and ep.reward_terms["communication"] == 0.0, name
    # two issues at once: one flag, both counted; the penalty from step 5 on
    env = CodingEnv(sandbox, PlainFormat(), CodingEnvConfig(max_final_chars=100))
    ep = TokenEpisode(env, BYTES, rewards=RewardConfig(communication_weight=[[0, 0.0], [5, 0.25]]), train_step=5)
    ep.start(example_task)
    ep.step(BYTES.encode(_call("submit", text="The tests pass. " * 10) + env.fmt.end_of_turn))
    assert ep.turns[0].flags[0].detail.startswith("says the tests pass, but no test was run: run them, or do not "
                                                  "claim it; it is 159 characters long")
    assert ep.info["communication_issues"] == 2 and ep.reward_terms["communication"] == -0.5
    # no change and nothing claimed: nothing to summarise; the clean episode of the test-driven loop is
    # test_failing_tests_are_information_not_a_failed_call
    _, stats, kinds = _play(sandbox, example_task, [_call("submit")])
    assert kinds == [[]] and stats["communication_issues"] == 0


def test_redundant_calls_are_results_the_agent_already_had(sandbox, example_task):
    read_top = _call("read_file", {"path": "mathops.py", "start_line": 1, "end_line": 3})
    read_all, listing = _call("read_file", {"path": "./mathops.py"}), _call("list_dir", {})
    search = _call("search", {"pattern": "scaled"})
    turns = [listing, read_top, read_all, read_top,         # 4: lines 1-3 again, not consecutive
             _call("edit", FIX), read_all,                  # 6: the file changed: not redundant
             search, listing, search,                       # 8, 9: the listing and the search again
             read_all, read_all, read_all,                  # 12: a loop: repeated_call, not both
             _call("read_file", {"path": "tests/test_mathops.py"}) * 2]
    ep, stats, kinds = _play(sandbox, example_task, turns)
    redundant = ["redundant_call"]
    assert kinds == [[], [], [], redundant, [], [], [], redundant, redundant, redundant, redundant,
                     ["repeated_call"], redundant]
    assert stats["redundant_calls"] == 7
    assert ep.turns[3].hint == ("You already read mathops.py lines 1-3 in turn 2 and it has not changed since: use "
                                "what you have instead of asking again.")
    assert [ep.turns[i].flags[0].detail for i in (7, 8, 9, 12)] == [
        "listed the repository root in turn 1 and it has not changed since",
        "searched the repository root for 'scaled' in turn 7 and the results have not changed since",
        "read mathops.py in turn 6 and it has not changed since",
        "read tests/test_mathops.py earlier in this turn and it has not changed since"]


WRONG_TOOL_COMMANDS = {
    "sed -i 's/a/b/' mathops.py": "edit", "perl -pi -e 's/a/b/' mathops.py": "edit",
    "echo 'x = 1' > new.py": "write_file", "cat > new.py <<EOF\nx = 1\nEOF": "write_file",
    "printf 'x' >> notes.txt": "write_file", "echo x | tee new.py": "write_file",
    "cat mathops.py": "read_file", "head -n 20 mathops.py": "read_file", "timeout 5 tail -5 log.txt": "read_file",
    "cat mathops.py | grep def": "read_file", "ls -la tests": "list_dir", "grep -rn scaled .": "search",
    "grep scaled mathops.py": "search", "rg scaled": "search",
    # not a tool's job: reading a pipe, writing elsewhere than a file, running things
    "pytest -q | tail -n 5": None, "python -m pytest 2>&1 | tail -20": None, "pytest | grep FAILED": None,
    "pytest | rg FAILED": None, "pytest | tee log.txt": None, "echo done > /dev/null": None, "echo hi >&2": None,
    "sed -n '1,5p' mathops.py": None, "git diff | head": None, "python -m pytest -q tests": None,
    "rm -- old.py": None,
}


@pytest.mark.parametrize("command", WRONG_TOOL_COMMANDS)
def test_wrong_tool_reads_what_a_command_does(command):
    from composer_jax.envs.signals import JOBS, wrong_tool

    tool = WRONG_TOOL_COMMANDS[command]
    detail = wrong_tool(command, TOOL_NAMES)
    assert (detail.split("(")[0] if detail else None) == tool, detail
    if tool is not None:        # none of the tools for the job declared: run is the way
        job_tools = next(tools for tools, _ in JOBS.values() if tools[0] == tool)
        assert wrong_tool(command, [t for t in TOOL_NAMES if t not in job_tools]) is None


def test_wrong_tool_flags_run_doing_a_declared_tools_job(sandbox, example_task):
    sed = _call("run", {"command": "sed -i 's/raise NotImplementedError/return 3 * a + b/' mathops.py"})
    turns = [sed, _call("run", {"command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests | tail -n 3"}),
             _call("submit", text=SUMMARY)]
    ep, stats, kinds = _play(sandbox, example_task, turns, rewards=RewardConfig(wrong_tool_weight=[[0, 0.0], [1, 1.0]]))
    assert kinds == [["wrong_tool"], [], []] and stats["wrong_tool_calls"] == 1 and ep.info["task_reward"] == 1.0
    assert ep.turns[0].hint == "Use edit(path, old, new) to change files instead of `sed -i` in run."
    assert ep.reward_terms["wrong_tool"] == 0.0                  # the weight switches on at step 1
    fields = rollout_fields([ep], [0], seq_len=len(ep.tokens), slots=1, window=600)
    teacher = fields["teacher_tokens"][0, 0]
    assert ep.turns[0].hint in BYTES.decode(teacher[fields["teacher_map"][0, 0] == -1])
    # with write_file the only editing tool, the hint names it; with no editing tool, run is the way
    ep, _, _ = _play(sandbox, example_task, [sed], CodingEnvConfig(tools=("run", "write_file", "submit")))
    assert ep.turns[0].hint == "Use write_file(path, content) to change files instead of `sed -i` in run."
    _, stats, kinds = _play(sandbox, example_task, [sed], CodingEnvConfig(tools=("run", "submit")))
    assert kinds == [[]] and stats["wrong_tool_calls"] == 0


def test_signals_are_configured_by_name():
    from composer_jax.rl.run_config import EnvConfig

    with pytest.raises(ValueError, match="coding env setting 'signals': unknown signal 'tone'; the signals are style, "
                                         "communication, effort, wrong_tool"):
        CodingEnvConfig(signals=("style", "tone"))
    with pytest.raises(ValueError, match="'max_final_chars' must be > 0"):
        CodingEnvConfig(max_final_chars=0)
    env = from_dict(EnvConfig, {"signals": ["effort"], "max_final_chars": 300, "lint_edits": False}, prefix="env")
    coding = env.coding()
    assert (coding.signals, coding.max_final_chars, coding.lint_edits) == (("effort",), 300, False)
    with pytest.raises(ConfigError, match="config key 'env.signals': unknown signal 'tone'"):
        from_dict(EnvConfig, {"signals": ["tone"]}, prefix="env")


