"""Tool-call formats and parser, the coding and toy environments, flags and hints, rewards, and the
conversion of a token-level episode into a valid RolloutBatch."""

import json
import math
import subprocess
import sys
import types

import numpy as np
import pytest
import yaml

from composer_jax.config import ConfigError, from_dict, to_dict
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs import (FLAG_KINDS, HINT_BUILDERS, TOOL_NAMES, TOOLS, CodingEnv, CodingEnvConfig, EpisodeStats,
                               Flag, KimiFormat, PlainFormat, RewardConfig, Schedule, TokenEpisode, ToyEnv,
                               compose_reward, get_format, hint_for, length_penalty, parse_turn, rollout_fields,
                               teacher_windows,
                               toy_tasks)
from composer_jax.envs.rewards import RewardConfigError
from tests.env_fixtures import example_task, no_leftover_workspaces, sandbox  # noqa: F401 (fixtures)

BYTES = ByteTokenizer()


# ------------------------------------------------------------------------------------------------
# parser


def test_plain_format_parses_calls_and_reports_each_error_kind():
    fmt = PlainFormat()
    text = ("Let me look. " + fmt.render_call("read_file", {"path": "a.py", "start_line": 2})
            + '<tool_call>{"name": "grep", "arguments": {}}</tool_call>'
            + '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"</tool_call>'
            + '<tool_call>{"arguments": {}}</tool_call>'
            + '<tool_call>{"name": "read_file", "arguments": {}}</tool_call>'
            + '<tool_call>{"name": "submit", "arguments": {"now": true}}</tool_call>'
            + '<tool_call>{"name": "read_file", "arguments": {"path": "a.py", "end_line": "3"}}</tool_call>'
            + '<tool_call>{"name": "read_file", "arguments": {"path": "a.py", "end_line": true}}</tool_call>')
    parsed = parse_turn(text, fmt, TOOLS)
    assert parsed.text == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("read_file", {"path": "a.py", "start_line": 2})]
    assert [e.kind for e in parsed.errors] == ["unknown_tool", "malformed_json", "malformed_call", "missing_argument",
                                               "unexpected_argument", "wrong_type", "wrong_type"]
    assert "available: list_dir, read_file" in parsed.errors[0].message
    assert "argument end_line must be of type integer, got str" in parsed.errors[5].message
    assert "argument end_line must be of type integer, got bool" in parsed.errors[6].message


def test_kimi_format_special_tokens_and_tolerance():
    fmt = KimiFormat()
    call = fmt.render_call("edit", {"path": "x.py", "old": "a {", "new": "b }"}, index=3)
    assert call == ('<|tool_calls_section_begin|><|tool_call_begin|>functions.edit:3<|tool_call_argument_begin|>'
                    '{"path": "x.py", "old": "a {", "new": "b }"}<|tool_call_end|><|tool_calls_section_end|>')
    parsed = parse_turn("I will edit." + call, fmt, TOOLS)
    assert parsed.text == "I will edit." and parsed.calls[0].arguments["new"] == "b }"
    assert parsed.calls[0].call_id == "functions.edit:3"
    # singular section spelling, two calls, the section end lost to truncation
    text = ('<|tool_call_section_begin|><|tool_call_begin|>functions.list_dir:0<|tool_call_argument_begin|>{}'
            '<|tool_call_end|><|tool_call_begin|>run:1<|tool_call_argument_begin|>{"command": "ls"}')
    parsed = parse_turn(text, fmt, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("list_dir", {}), ("run", {"command": "ls"})]
    declared = fmt.message(**fmt.tools_message(TOOLS))
    assert declared.startswith("<|im_system|>tool_declare<|im_middle|>[{") and declared.endswith("}]<|im_end|>")
    assert [t["function"]["name"] for t in json.loads(declared.split("<|im_middle|>")[1][:-10])] == list(TOOL_NAMES)
    result = fmt.message("tool", "ok", "functions.run:2")
    assert result == "<|im_system|>tool<|im_middle|>## Return of functions.run:2\nok<|im_end|>"
    bad = parse_turn('<|tool_calls_section_begin|><|tool_call_begin|>no index here<|tool_call_argument_begin|>{}'
                     '<|tool_call_end|><|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>{"command": '
                     '<|tool_call_end|><|tool_calls_section_end|>', fmt, TOOLS)
    assert [e.kind for e in bad.errors] == ["malformed_call", "malformed_json"] and not bad.calls


def test_kimi_markers_are_single_ids_of_a_tokenizer_that_registers_them(tmp_path):
    """With a real checkpoint's tokenizer each marker is one special token: the call survives ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from composer_jax.data.tokenizer import HFTokenizer

    fmt = KimiFormat()
    markers = [fmt.SECTION_BEGIN, fmt.CALL_BEGIN, fmt.ARG_BEGIN, fmt.CALL_END, fmt.SECTION_END, "<|im_end|>"]
    chars = sorted(set("".join(json.dumps({"path": "a.py"}) + "functions.read_file:0 ")))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(markers)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    ids = hf.encode(fmt.render_call("read_file", {"path": "a.py"}))
    special = {tok.token_to_id(m) for m in markers}
    assert sum(int(i) in special for i in ids) == 5
    assert parse_turn(hf.decode(ids), fmt, TOOLS).calls[0].arguments == {"path": "a.py"}


# ------------------------------------------------------------------------------------------------
# the coding environment, end to end


def _script(fmt, k):
    return [fmt.render_call("list_dir", {}),
            fmt.render_call("read_file", {"path": "mathops.py", "start_line": 5, "end_line": 7}),
            fmt.render_call("grep", {"pattern": "scaled_sum"}),                                # unknown tool
            fmt.render_call("edit", {"path": "mathops.py", "old": "    raise NotImplementedError\n",
                                     "new": f"    return {k} * a + b\n"}),
            fmt.render_call("run", {"command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests"}),
            f"I made scaled_sum return {k} * a + b; the tests pass." + fmt.render_call("submit", {})]


@pytest.mark.parametrize("fmt_name", ["plain", "kimi"])
def test_scripted_policy_solves_a_task_and_converts_to_a_rollout_batch(sandbox, example_task, fmt_name):
    from composer_jax.rl.batch import RolloutBatch, teacher_slot, validate_batch

    env = CodingEnv(sandbox, get_format(fmt_name))
    ep = TokenEpisode(env, BYTES)
    history = ep.start(example_task).tolist()
    assert example_task.instruction in BYTES.decode(history)
    observations = []
    for turn in _script(env.fmt, 3):
        sampled = BYTES.encode(turn + env.fmt.end_of_turn)
        new, done, info = ep.step(sampled, logprobs=-np.linspace(0.1, 1.0, len(sampled)))
        assert ep.tokens[:len(history)] == history                      # history only grows
        assert ep.tokens[len(history):len(history) + len(sampled)] == sampled.tolist()
        history = list(ep.tokens)
        observations.append((BYTES.decode(new), info["flags"]))
    assert done and info["task_reward"] == 1.0 and ep.reward == 1.0 and info["check"]["status"] == "ok"
    assert not env.workspace.exists()
    assert "mathops.py" in observations[0][0] and "6|     \"\"\"Return 3 * a + b.\"\"\"" in observations[1][0]
    unknown_obs, unknown_flags = observations[2]
    assert "error: unknown tool 'grep'" in unknown_obs
    assert [f.kind for f in unknown_flags] == ["unknown_tool"]
    assert "3 passed" in observations[4][0]
    assert [bool(t.flags) for t in ep.turns] == [False, False, True, False, False, False]
    hint = ep.turns[2].hint
    assert hint.startswith("Reminder: the available tools are list_dir, read_file, write_file, edit, search, run")

    # two rows of one group; one teacher slot each, on the unknown-tool turn
    fields = rollout_fields([ep, ep], [0, 0], seq_len=len(ep.tokens) + 7, slots=2, window=400)
    batch = RolloutBatch(**fields)
    validate_batch(batch, group_size=2, vocab_size=BYTES.vocab_size)
    turn = ep.turns[2]
    hint_ids = BYTES.encode(env.fmt.hint_insert(hint))
    ref_tokens, ref_map = teacher_slot(fields["tokens"][0], fields["generated"][0], turn.start, hint_ids, 400)
    np.testing.assert_array_equal(batch.teacher_tokens[0, 0], ref_tokens)
    np.testing.assert_array_equal(batch.teacher_map[0, 0], ref_map)
    window = len(hint_ids) + 16                                           # a long turn is cut to the window
    small = RolloutBatch(**rollout_fields([ep, ep], [0, 0], seq_len=len(ep.tokens), slots=1, window=window))
    validate_batch(small, group_size=2, vocab_size=BYTES.vocab_size)
    ref_tokens, _ = teacher_slot(small.tokens[1], small.generated[1], turn.start, hint_ids, window, end=turn.start + 16)
    np.testing.assert_array_equal(small.teacher_tokens[1, 0], ref_tokens)
    assert (batch.teacher_map[:, 1] == -1).all()                       # only one flagged turn
    assert hint in BYTES.decode(batch.teacher_tokens[0, 0][batch.teacher_map[0, 0] == -1])
    assert batch.generated.sum() == 2 * sum(len(BYTES.encode(t + env.fmt.end_of_turn)) for t in _script(env.fmt, 3))
    assert float(batch.rewards[0]) == 1.0


def test_sampled_ids_are_kept_even_when_they_do_not_survive_decoding(sandbox, example_task):
    with CodingEnv(sandbox, PlainFormat()) as env:
        ep = TokenEpisode(env, BYTES)
        ep.start(example_task)
        sampled = np.concatenate([BYTES.encode("thinking "), [0xFF, 0xFE], BYTES.encode("<|im_end|>")])
        assert BYTES.encode(BYTES.decode(sampled)).tolist() != sampled.tolist()  # re-tokenising changes them
        start = len(ep.tokens)
        new, done, info = ep.step(sampled)
        assert ep.tokens[start:start + len(sampled)] == sampled.tolist() and not done
        assert [f.kind for f in info["flags"]] == ["no_action"] and "No tool call found" in BYTES.decode(new)


def test_tool_failures_flags_and_limits(sandbox, example_task):
    fmt = PlainFormat()
    env = CodingEnv(sandbox, fmt, CodingEnvConfig(max_turns=12, max_output_chars=200))
    env.reset(example_task)
    (env.workspace / "twice.txt").write_text("x x\n")
    (env.workspace / "link").symlink_to("/etc")

    def step(name, args):
        obs, done, info = env.step(fmt.render_call(name, args))
        return obs[0]["content"], [f.kind for f in info["flags"]], done, info

    out, flags, *_ = step("edit", {"path": "twice.txt", "old": "x", "new": "y"})
    assert "found 2 times" in out and flags == []
    assert [step("edit", {"path": "twice.txt", "old": "x", "new": "y"})[1] for _ in range(3)] == \
        [[], ["repeated_call"], []]                  # the same failing call 3 times running: flagged once
    out, flags, *_ = step("run", {"command": "no_such_program"})         # cannot start (exit 127): failed
    assert "exit code 127" in out and flags == []
    out, flags, *_ = step("read_file", {"path": "link/passwd"})
    assert "outside the repository" in out
    out, flags, *_ = step("read_file", {"path": "../task.json"})
    assert "outside the repository" in out
    out, flags, *_ = step("run", {"command": "seq 1 1000"})
    assert flags == ["output_limit"] and "[output truncated:" in out
    out, flags, *_ = step("write_file", {"path": "tests/test_mathops.py", "content": "def test_x():\n    pass\n"})
    assert flags == ["test_file_edit"]
    out, flags, *_ = step("run", {"command": "echo '# edited' >> tests/test_extra_test.py"})
    assert flags == ["wrong_tool", "test_file_edit"]
    out, flags, *_ = step("search", {"pattern": "def (double|scaled)"})
    assert out.splitlines() == ["mathops.py:1: def double(x):", "mathops.py:5: def scaled_sum(a, b):"]
    out, flags, done, info = step("search", {"pattern": "("})
    assert "bad regular expression" in out and done                      # max_turns = 12 ends the episode
    assert info["task_reward"] == 0.0 and info["failed_calls"] == 8      # graded with the tests restored
    assert not env.workspace.exists()                                    # deleted once graded


def test_failing_tests_are_information_not_a_failed_call(sandbox, example_task):
    """The test-driven loop (run the failing tests, fix, rerun, submit) has no failed call and no flag; the
    failing run is counted apart. The same failing test run three times running is one loop flag (pytest's
    timings differ from run to run); a command killed by a sandbox limit is a failed call."""
    from composer_jax.rl.rollout import rollout_metrics

    fmt, test = PlainFormat(), {"command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests"}
    env = CodingEnv(sandbox, fmt)
    ep = TokenEpisode(env, BYTES)
    ep.start(example_task)
    fix = {"path": "mathops.py", "old": "    raise NotImplementedError\n", "new": "    return 3 * a + b\n"}
    outputs = []
    summary = "I made scaled_sum return 3 * a + b; the tests pass."
    for text, name, args in (("", "run", test), ("", "edit", fix), ("", "run", test), (summary, "submit", {})):
        new, done, info = ep.step(BYTES.encode(text + fmt.render_call(name, args) + fmt.end_of_turn))
        outputs.append(BYTES.decode(new))
    assert "exit code 1" in outputs[0] and "failed" in outputs[0] and "passed" in outputs[2]
    assert done and info["task_reward"] == 1.0 and not any(t.flags for t in ep.turns)
    assert info["failed_calls"] == 0 and info["tests_failed_runs"] == 1
    assert [info[k] for k in ("style_findings", "communication_issues", "redundant_calls", "wrong_tool_calls")] == \
        [0, 0, 0, 0]
    metrics = rollout_metrics([types.SimpleNamespace(episode=ep, reward=ep.reward)], 1.0, 1.0)
    assert metrics["tool_error_rate"] == 0.0 and metrics["tests_failed_runs"] == 1.0
    assert metrics["flag_repeated_call"] == 0.0

    env = CodingEnv(sandbox, fmt, CodingEnvConfig(run_wall_s=60))
    env.reset(example_task)
    flags = [env.step(fmt.render_call("run", test))[2]["flags"] for _ in range(4)]
    assert [[f.kind for f in x] for x in flags] == [[], [], ["repeated_call"], []] and env.stats["failed_calls"] == 0
    hint = hint_for(flags[2], env.hint_context)
    assert "run {'command': 'PYTEST_DISABLE" in hint and "3 times, each: exit code 1" in hint, hint
    env.close()
    env = CodingEnv(sandbox, fmt, CodingEnvConfig(run_wall_s=1))
    env.reset(example_task)
    obs, _, info = env.step(fmt.render_call("run", {"command": "sleep 30"}))
    assert "limits hit: wall" in obs[0]["content"] and env.stats["failed_calls"] == 1
    env.close()


def test_every_flagged_turn_teaches_up_to_the_slots_and_cut_windows_are_counted(sandbox, example_task):
    """Three flagged turns (an unknown tool each time): two slots take the first two whole, the third is
    left out; a window too short for the second turn cuts it; the RL metrics count both."""
    from composer_jax.rl.rollout import rollout_metrics

    fmt = PlainFormat()
    with CodingEnv(sandbox, fmt, CodingEnvConfig(max_turns=3)) as env:
        ep = TokenEpisode(env, BYTES)
        ep.start(example_task)
        for tool in ("grep", "find_the_definition_of_scaled_sum", "cat"):
            ep.step(BYTES.encode(fmt.render_call(tool, {"pattern": "scaled_sum"}) + fmt.end_of_turn))
    assert ep.done and all(t.flags for t in ep.turns)
    hints = [len(ep.hint_ids(t)) for t in ep.turns]
    whole = max(h + t.end - t.start for h, t in zip(hints, ep.turns))
    windows, left_out = teacher_windows(ep, 2, whole)
    assert [(turn, end) for turn, _, end in windows] == [(t, t.end) for t in ep.turns[:2]] and left_out == 1
    short = hints[1] + ep.turns[0].end - ep.turns[0].start       # the first turn fits, the longer second is cut
    windows, _ = teacher_windows(ep, 3, short)
    assert [end < turn.end for turn, _, end in windows] == [False, True, False]
    batch = rollout_fields([ep], [0], seq_len=len(ep.tokens), slots=3, window=short)
    assert [(m >= 0).sum() for m in batch["teacher_map"][0]] == [end - turn.start for turn, _, end in windows]
    metrics = rollout_metrics([types.SimpleNamespace(episode=ep, reward=ep.reward)], 1.0, 1.0, 2, short)
    assert (metrics["sd_windows"], metrics["sd_windows_cut"], metrics["sd_turns_left_out"]) == (2.0, 1.0, 1.0)


def test_only_the_selected_flag_kinds_teach_and_every_flag_is_counted(sandbox, example_task):
    """rl.sd_flags: an unknown tool, a malformed call and a `cat` through run (wrong_tool), with only
    wrong_tool selected: one teacher window, for the third turn, its hint naming read_file; the flag
    rates count all three kinds. An unknown kind is a config error naming it."""
    from composer_jax.config import ConfigError
    from composer_jax.rl.config import RLConfig
    from composer_jax.rl.rollout import rollout_metrics

    fmt = PlainFormat()
    with CodingEnv(sandbox, fmt, CodingEnvConfig(max_turns=3)) as env:
        ep = TokenEpisode(env, BYTES, teach=RLConfig(sd_flags=("wrong_tool",)).sd_flags)
        ep.start(example_task)
        for turn in (fmt.render_call("grep", {"pattern": "x"}), fmt.render_call("run", {"command": "ls"})[:-3],
                     fmt.render_call("run", {"command": "cat mathops.py"})):
            ep.step(BYTES.encode(turn + fmt.end_of_turn))
    assert [[f.kind for f in t.flags] for t in ep.turns] == [["unknown_tool"], ["malformed_call"], ["wrong_tool"]]
    windows, left_out = teacher_windows(ep, 3, 4096)
    assert [turn for turn, _, _ in windows] == [ep.turns[2]] and left_out == 0 and "read_file" in ep.turns[2].hint
    metrics = rollout_metrics([types.SimpleNamespace(episode=ep, reward=ep.reward)], 1.0, 1.0, 3, 4096)
    assert metrics["sd_windows"] == 1.0 and metrics["flagged_turns"] == 3.0
    assert metrics["flag_unknown_tool"] == metrics["flag_malformed_call"] == metrics["flag_wrong_tool"] == 1 / 3
    with pytest.raises(ConfigError, match="sd_flags.*unknown flag kind 'wrong_tools'; the kinds are unknown_tool"):
        RLConfig(sd_flags=("wrong_tools",))


def test_a_tool_subset_is_all_the_agent_sees_and_may_call(sandbox, example_task):
    fmt = PlainFormat()
    env = CodingEnv(sandbox, fmt, CodingEnvConfig(max_turns=3, tools=("run", "submit")))
    declared = env.reset(example_task)[0]["content"]
    assert "- run(command: string)" in declared and "- submit()" in declared
    assert not any(f"- {name}(" in declared for name in TOOL_NAMES if name not in ("run", "submit"))
    assert len(fmt.message(**fmt.tools_message(env.tools))) < len(fmt.message(**fmt.tools_message(TOOLS))) / 2
    obs, _, info = env.step(fmt.render_call("read_file", {"path": "mathops.py"}))
    assert obs[0]["content"] == "error: unknown tool 'read_file'; available: run, submit"
    assert [f.kind for f in info["flags"]] == ["unknown_tool"]
    hints = {k: hint_for([Flag(k, "detail")], env.hint_context) for k in ("unknown_tool", "no_action")}
    assert "the available tools are run, submit;" in hints["unknown_tool"]
    assert fmt.render_call("run", {"command": "ls"}) in hints["no_action"]      # the example is a declared tool
    obs, done, info = env.step(fmt.render_call("run", {"command": "cat mathops.py"}))
    assert "def double" in obs[0]["content"] and not done and info["flags"] == []
    env.close()
    for tools, message in ((("run",), "must include submit"), (("run", "grep", "submit"), "unknown tool 'grep'"),
                           (("run", "run", "submit"), "listed twice")):
        with pytest.raises(ValueError, match=message):
            CodingEnvConfig(tools=tools)


def test_special_files_do_not_block_the_tools(sandbox, example_task):
    fmt = PlainFormat()
    with CodingEnv(sandbox, fmt) as env:
        env.reset(example_task)
        obs, _, info = env.step(fmt.render_call("run", {"command": "mkfifo pipe && echo made"}))
        assert "made" in obs[0]["content"]
        obs, _, info = env.step(fmt.render_call("write_file", {"path": "pipe", "content": "x"}))
        assert "not a regular file" in obs[0]["content"] and info["flags"] == []
        obs, _, _ = env.step(fmt.render_call("search", {"pattern": "scaled"}))
        assert "mathops.py:5:" in obs[0]["content"]


def test_every_flag_kind_has_a_hint():
    assert set(HINT_BUILDERS) == set(FLAG_KINDS)
    ctx = CodingEnv(None, PlainFormat())
    hints = {k: hint_for([Flag(k, "detail")], ctx.hint_context) for k in FLAG_KINDS}
    assert all(hints.values()) and len(set(hints.values())) == len(FLAG_KINDS)
    assert hint_for([Flag("unknown_tool", "a"), Flag("unknown_tool", "b")], ctx.hint_context).count("\n") == 0
    assert hint_for([], ctx.hint_context) == ""
    assert ", ".join(TOOL_NAMES) in hints["unknown_tool"]


# ------------------------------------------------------------------------------------------------
# rewards


def test_length_penalty_closed_forms_and_shape():
    k = 0.01
    for x in (0.0, 3.0, 250.0):
        assert length_penalty(x, k, 0.0) == pytest.approx(x)                       # q = 0: linear
        assert length_penalty(x, k, 2.0) == pytest.approx(x / (1 + k * x))         # q = 2
        assert length_penalty(x, k, 1.0) == pytest.approx(math.log1p(k * x) / k)   # the q -> 1 limit
        assert length_penalty(x, k, 1 + 1e-7) == pytest.approx(length_penalty(x, k, 1.0), rel=1e-5)
    xs = np.linspace(0, 5000, 51)
    values = np.array([length_penalty(x, k, 0.5) for x in xs])
    assert (np.diff(values) > 0).all() and (np.diff(values, 2) < 0).all()        # increasing, concave


def test_reward_composition_with_step_schedules():
    cfg = RewardConfig(failed_call_weight=[[0, 0.0], [100, 0.1]], format_weight=0.2, length_weight=0.01,
                       length_k=0.01, length_q=0.5)
    stats = EpisodeStats(turns=4, generated_tokens=300, tool_calls=5, failed_calls=2, malformed_turns=1)
    early, late = compose_reward(1.0, stats, cfg, step=99), compose_reward(1.0, stats, cfg, step=100)
    c = ((1 + 0.01 * 300) ** 0.5 - 1) / (0.01 * 0.5)
    assert early["failed_calls"] == 0.0 and late["failed_calls"] == pytest.approx(-0.2)
    assert late["format"] == pytest.approx(0.2 * 0.75) and late["length"] == pytest.approx(-0.01 * c)
    assert late["total"] == pytest.approx(1.0 - 0.2 + 0.15 - 0.01 * c)
    assert Schedule.from_config([[10, 1.0]], "w")(9) == 0.0 and Schedule.from_config(2, "w")(0) == 2.0
    with pytest.raises(RewardConfigError, match="failed_call_weight"):
        RewardConfig(failed_call_weight="lots")
    with pytest.raises(RewardConfigError, match="sorted"):
        Schedule(((5, 1.0), (2, 0.0)))


def test_the_signals_reward_terms_switch_on_by_step():
    cfg = from_dict(RewardConfig, yaml.safe_load("style_weight: [[10, 0.1]]\ncommunication_weight: [[10, 0.2]]\n"
                                                 "effort_weight: [[0, 0.0], [10, 0.05]]\nwrong_tool_weight: 0.3\n"),
                    prefix="rewards")
    stats = EpisodeStats(turns=3, style_findings=2, communication_issues=1, redundant_calls=4, wrong_tool_calls=1)
    early, late = compose_reward(1.0, stats, cfg, step=9), compose_reward(1.0, stats, cfg, step=10)
    assert (early["style"], early["communication"], early["effort"]) == (0.0, 0.0, 0.0)
    assert early["wrong_tool"] == pytest.approx(-0.3) and early["total"] == pytest.approx(0.7)
    assert late["style"] == pytest.approx(-0.2) and late["communication"] == pytest.approx(-0.2)
    assert late["effort"] == pytest.approx(-0.2) and late["total"] == pytest.approx(1.0 - 0.2 - 0.2 - 0.2 - 0.3)
    assert compose_reward(1.0, stats, RewardConfig())["total"] == 1.0          # off by default


def test_reward_config_reads_from_yaml_and_names_a_bad_key():
    """The reward section of a run config: weights as numbers or [[step, value], ...]; a saved config
    reads back equal; an unknown component or a bad weight is a one-line error naming the dotted key."""
    data = yaml.safe_load("failed_call_weight: [[0, 0.0], [100, 0.1]]\nformat_weight: 0.2\nlength_k: 0.01\n")
    cfg = from_dict(RewardConfig, data, prefix="rewards")
    assert cfg.failed_call_weight(99) == 0.0 and cfg.failed_call_weight(100) == 0.1 and cfg.format_weight(0) == 0.2
    assert from_dict(RewardConfig, json.loads(json.dumps(to_dict(cfg))), prefix="rewards") == cfg
    bad = {"tone_weight": ("1.0", "config key 'rewards.tone_weight': unknown key for RewardConfig"),
           "format_weight": ("[[5, 1.0], [2, 0.0]]", "config key 'rewards.format_weight': schedule steps must be"),
           "length_weight": ("lots", "config key 'rewards.length_weight': expected a number or [[step, value]"),
           "length_k": ("0", "config key 'rewards.length_k': must be > 0")}
    for key, (value, message) in bad.items():
        with pytest.raises(ConfigError) as err:
            from_dict(RewardConfig, yaml.safe_load(f"{key}: {value}"), prefix="rewards")
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------------
# toy tasks


@pytest.mark.parametrize("family", ["reverse", "copy", "add"])
def test_toy_tasks_are_short_exact_and_reproducible(family):
    tasks = toy_tasks(family, 50, seed=3)
    assert tasks == toy_tasks(family, 50, seed=3) and tasks != toy_tasks(family, 50, seed=4)
    for t in tasks:
        verb, *args = t.prompt.split()
        expected = {"reverse": lambda w: w[::-1], "copy": lambda w: w,
                    "add": lambda a, b: str(int(a) + int(b))}[verb](*args)
        assert t.answer == expected and len(t.prompt) <= 12 and len(t.answer) <= 3
    env = ToyEnv(PlainFormat())
    ep = TokenEpisode(env, BYTES)
    prompt = ep.start(tasks[0])
    assert len(prompt) < 64                           # a tiny byte-level model sees short episodes
    _, done, info = ep.step(BYTES.encode(f" {tasks[0].answer}\n<|im_end|>"))
    assert done and ep.reward == 1.0 and info["flags"] == []
    ep.start(tasks[1])
    ep.step(BYTES.encode(tasks[1].answer + "x<|im_end|>"))
    assert ep.reward == 0.0


def test_toy_env_with_the_submit_tool():
    fmt = PlainFormat()
    env = ToyEnv(fmt, use_tool=True)
    task = toy_tasks("reverse", 1)[0]
    assert "submit(answer: string)" in env.reset(task)[0]["content"]
    assert env.step(fmt.render_call("submit", {"answer": task.answer}))[2]["task_reward"] == 1.0
    env.reset(task)
    _, _, info = env.step(task.answer)                 # an answer without the tool call
    assert info["task_reward"] == 0.0 and [f.kind for f in info["flags"]] == ["no_action"]
    env.reset(task)
    _, _, info = env.step(fmt.render_call("answer", {"answer": task.answer}))
    assert [f.kind for f in info["flags"]] == ["unknown_tool"] and info["failed_calls"] == 1


def test_toy_env_with_turns_to_recover_from_a_bad_call():
    """With max_turns > 1 a turn without a valid submit call gets the error back and the agent may retry:
    the mistake is flagged on its turn and the episode still earns its reward."""
    fmt = PlainFormat()
    env = ToyEnv(fmt, use_tool=True, max_turns=2)
    task = toy_tasks("add", 1, seed=4)[0]
    env.reset(task)
    observation, done, info = env.step(fmt.render_call("answer", {"answer": task.answer}))
    assert not done and [f.kind for f in info["flags"]] == ["unknown_tool"]
    assert observation == [{"role": "tool", "name": "call_0", "content": "error: unknown tool 'answer'; available: submit"}]
    observation, done, info = env.step(fmt.render_call("submit", {"answer": task.answer}))
    assert done and info["task_reward"] == 1.0 and info["turns"] == 2 and info["failed_calls"] == 1
    env.reset(task)
    assert env.step("no call")[0] == [{"role": "user", "content": "No submit call found. Answer with the submit tool."}]
    assert env.step("still none")[1] and env.stats["tool_calls"] == 0       # out of turns: ends unsolved
    with pytest.raises(ValueError, match="max_turns"):
        ToyEnv(fmt, use_tool=False, max_turns=2)


def test_host_side_packages_do_not_import_jax():
    code = ("import sys, composer_jax.sandbox, composer_jax.tasks, composer_jax.envs, composer_jax.agents, composer_jax.eval\n"
            "import composer_jax.cli\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax', 'optax'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
