"""RUN_DIR/rollouts.jsonl (rl/rollout_log.py) and its viewer, `composer-jax rollouts`: which episodes
are picked, what a line holds (checked against a toy episode played here), the resume cut, and the
viewer's text (against hand-written output). A real RL run writing and resuming the file is checked
in tests/test_rl_loop.py."""

import json

import numpy as np
import pytest

from composer_jax import cli
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs import Report, TokenEpisode, ToyEnv, get_format, toy_tasks
from composer_jax.envs.monitor import Finding
from composer_jax.rl.rollout import Rollout
from composer_jax.rl.rollout_log import (RolloutLog, logs_batch, pick, picked_lines, read_rollouts, render,
                                         token_versions)
from composer_jax.rl.sampler import Prompt


def test_pick_best_worst_and_a_seeded_random_other():
    """Rewards [0.5, 1, 0, 1, 0]: best is the last 1 (index 3), worst the first 0 (index 2), the random
    one another episode, the same for the same seed; fewer episodes give fewer picks."""
    rewards = [0.5, 1.0, 0.0, 1.0, 0.0]
    picks = dict(pick(rewards, (7, 3)))
    assert picks["best"] == 3 and picks["worst"] == 2 and picks["random"] in (0, 1, 4)
    assert dict(pick(rewards, (7, 3))) == picks
    assert {dict(pick(rewards, (7, i)))["random"] for i in range(20)} == {0, 1, 4}    # each other one is drawn
    assert pick([2.0, 2.0], (0, 0)) == [("best", 1), ("worst", 0)]
    assert pick([2.0], (0, 0)) == [("best", 0)] and pick([], (0, 0)) == []
    assert token_versions([0, 1, 1, 0, 1], [4, 5, 5]) == [-1, 4, 5, -1, 5]
    assert token_versions([0, 1, 1], [4]) == [-1, -1, -1]        # versions not given for every token


def _toy_rollout(sample: int, turns: list[str], reward: float, report: Report | None = None) -> Rollout:
    """A toy addition played with the submit tool over `turns` (ANSWER: the right answer; a malformed call
    is flagged and retried), version 2 writing the first turn and 3 the second."""
    tokenizer, env = ByteTokenizer(), ToyEnv(get_format("plain"), use_tool=True, max_turns=2)
    task = toy_tasks("add", 1, seed=1)[0]
    episode = TokenEpisode(env, tokenizer)
    episode.start(task)
    versions = []
    for version, text in enumerate(turns):
        ids = tokenizer.encode(text.replace("ANSWER", task.answer) + env.fmt.end_of_turn)
        episode.step(ids, np.zeros(len(ids)))
        versions += [version + 2] * len(ids)
    return Rollout(Prompt(task.id, 5, 0), sample, episode, versions, report or Report(), reward)


def test_a_line_holds_the_episode_as_played():
    """A malformed call (flagged, with a hint), then the right submit: the line's tokens are the
    episode's and decode to its text; generated and versions mark the two turns' tokens; the
    conversation's pieces cover the trajectory in order, the policy's carrying the turn's flags and
    hint; the monitor's finding and the trained flag are kept; the line is JSON."""
    report = Report((Finding("vcs_history", 1, "run", "git log"),))
    good = get_format("plain").render_call("submit", {"answer": "ANSWER"})
    rollouts = [_toy_rollout(0, ["<tool_call>{not json</tool_call>", good], 0.9, report),
                _toy_rollout(1, ["<tool_call>{not json</tool_call>", "none"], 0.0)]
    lines = [json.loads(line) for line in picked_lines(rollouts, ["5/0"], (0, 0))]
    assert [(s["pick"], s["episode"], s["trained"]) for s in lines] == [("best", "5/0", True), ("worst", "5/1", False)]
    best, episode = lines[0], rollouts[0].episode
    assert best["tokens"] == episode.tokens and ByteTokenizer().decode(best["tokens"]) == best["text"]
    assert best["reward"] == 0.9 and best["task_reward"] == 1.0 and best["reward_terms"]["task"] == 1.0
    assert best["monitor"] == {"detectors": ["vcs_history"], "findings": [
        {"detector": "vcs_history", "turn": 1, "tool": "run", "evidence": "git log", "source": "call"}]}
    turns = episode.turns
    assert [i for i, g in enumerate(best["generated"]) if g] == [*range(turns[0].start, turns[0].end),
                                                                 *range(turns[1].start, turns[1].end)]
    assert {best["versions"][i] for i in range(turns[0].start, turns[0].end)} == {2}
    assert {best["versions"][i] for i in range(turns[1].start, turns[1].end)} == {3}
    assert all(v == -1 for v, g in zip(best["versions"], best["generated"]) if not g)
    pieces = best["conversation"]
    assert [p["by"] for p in pieces] == ["environment", "policy", "environment", "policy", "environment"]
    assert [(p["start"], p["end"]) for p in pieces] == list(zip([0] + [p["end"] for p in pieces[:-1]],
                                                                [p["end"] for p in pieces]))
    assert pieces[-1]["end"] == len(best["tokens"]) and "".join(p["text"] for p in pieces) == best["text"]
    assert pieces[1]["flags"] == [f.to_json() for f in turns[0].flags] and pieces[1]["flags"]
    assert pieces[1]["hint"] == turns[0].hint and turns[0].hint and pieces[3]["hint"] == "" == turns[1].hint
    assert pieces[3]["text"] == ByteTokenizer().decode(episode.tokens[turns[1].start:turns[1].end])


def test_the_log_writes_due_steps_and_a_resume_cuts_what_follows_its_checkpoint(tmp_path):
    """With rl.log_rollouts_every=2 the batches for versions 1, 3, 5 (steps 2, 4, 6) are logged, with 0 none;
    a line gets its step first; a run resumed from step 4 drops the lines of step 6 and a line a kill cut
    short, keeps those up to 4, then appends again; a process other than 0 writes nothing."""
    assert [i for i in range(7) if logs_batch(2, i)] == [1, 3, 5] and not any(logs_batch(0, i) for i in range(7))
    log = RolloutLog(tmp_path, -1)
    for step in (2, 4, 6):
        log.write(step, ['{"pick": "best", "reward": 1.5}', '{"pick": "worst"}'])
    with open(tmp_path / "rollouts.jsonl", "a") as f:
        f.write('{"step": 7, "pick": "be')
    assert read_rollouts(tmp_path)[:2] == [{"step": 2, "pick": "best", "reward": 1.5}, {"step": 2, "pick": "worst"}]
    assert [r["step"] for r in read_rollouts(tmp_path)] == [2, 2, 4, 4, 6, 6]
    log = RolloutLog(tmp_path, 4)
    assert [r["step"] for r in read_rollouts(tmp_path)] == [2, 2, 4, 4]
    assert log.write(6, ['{"pick": "random"}']) == 1 and log.write(7, []) == 0
    assert [(r["step"], r["pick"]) for r in read_rollouts(tmp_path)][-1] == (6, "random")
    assert RolloutLog(None, -1).write(8, ['{"pick": "best"}']) == 0 and len(read_rollouts(tmp_path)) == 5


RECORD = {"step": 12, "pick": "worst", "episode": "40/3", "task": "fix-7", "trained": True, "reward": -0.25,
          "reward_terms": {"task": 0.0, "failed_calls": -0.25, "length": 0.0, "total": -0.25}, "task_reward": 0.0,
          "context_full": False,
          "monitor": {"detectors": ["vcs_history"], "findings": [
              {"detector": "vcs_history", "turn": 1, "tool": "run", "evidence": "git log -p", "source": "call"}]},
          "text": "", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "generated": [0, 0, 1, 1, 0, 1, 1, 1, 0],
          "versions": [-1, -1, 10, 11, -1, 11, 11, 11, -1],
          "conversation": [
              {"by": "environment", "start": 0, "end": 2, "text": "user: fix the bug\n"},
              {"by": "policy", "start": 2, "end": 4, "turn": 0, "text": "<call>\n",
               "flags": [{"kind": "malformed_call", "detail": "bad JSON"}], "hint": "Write valid JSON."},
              {"by": "environment", "start": 4, "end": 5, "text": "0123456789abcdef\n"},
              {"by": "policy", "start": 5, "end": 8, "turn": 1, "text": "git log -p", "flags": [], "hint": ""},
              {"by": "environment", "start": 8, "end": 9, "text": "\n"}]}

WORST_SHOWN = """\
=== step    12  worst   reward -0.250  episode 40/3      task fix-7  trained  flagged turns 1  monitor vcs_history
reward -0.250 (failed_calls -0.250), task reward 0.000
monitor: vcs_history at turn 1 (run, call): git log -p
--- environment
user
[... 9 characters cut ...]
 bug
--- policy, turn 0, 2 tokens, version 10-11; flags: malformed_call: bad JSON
<call>
--- hint: Write valid JSON.
--- environment
0123
[... 8 characters cut ...]
cdef
--- policy, turn 1, 3 tokens, version 11
git log -p"""


def test_the_viewer_shows_the_conversation_reward_and_flags(tmp_path, capsys):
    """`composer-jax rollouts RUN_DIR`: the last step's episodes (or --step N's, filtered by --best /
    --worst / --random), as hand-written here, environment pieces cut to --max-chars; --list one line
    each; a missing file or step is one line and exit 2."""
    assert render(RECORD, max_chars=8) == WORST_SHOWN
    best = {**RECORD, "pick": "best", "episode": "40/0", "reward": 1.0}
    later = {**RECORD, "step": 14}
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (best, RECORD, later)))
    assert cli.main(["rollouts", str(tmp_path), "--step", "12", "--worst", "--max-chars", "8"]) == 0
    assert capsys.readouterr().out == WORST_SHOWN + "\n"
    assert cli.main(["rollouts", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("=== step    14  worst")
    assert cli.main(["rollouts", str(tmp_path), "--list", "--best"]) == 0
    assert capsys.readouterr().out == ("step    12  best    reward +1.000  episode 40/0      task fix-7  trained  "
                                       "flagged turns 1  monitor vcs_history\n")
    assert cli.main(["rollouts", str(tmp_path), "--step", "13"]) == 2
    err = capsys.readouterr().err
    assert err == ("composer-jax rollouts: error: step 13 has no logged episodes (2 steps logged, 12 to 14: "
                   "see --list)\n")
    assert cli.main(["rollouts", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollouts.jsonl does not exist" in err


def test_a_negative_period_is_a_config_error():
    from composer_jax.config import ConfigError
    from composer_jax.rl.run_config import load_rl_config

    with pytest.raises(ConfigError, match="rl.log_rollouts_every"):
        load_rl_config("rl-tiny", ["init_from=", "model=tiny", "rl.log_rollouts_every=-1"])
