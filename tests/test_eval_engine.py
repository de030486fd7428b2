"""The engine-backed agent: `composer-jax eval RUN_DIR TASKS` end to end, transcripts independent of the
worker and slot counts, turns equal to `composer_jax.generate`, episodes batched in the engine's slots
with a bounded number of programs, weight versions, running out of context, the format and stops a
tokenizer implies, and one-line errors for models that do not load.

One tiny model (a training run with random weights) serves the module; engines of one shape share
their compiled programs, so the module compiles two shapes: the CLI's (a coding prompt is ~1,200
bytes) and SHAPE, a short context for the API tests."""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from composer_jax import cli
from composer_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from composer_jax.envs import HintContext, toy_tasks
from composer_jax.envs.protocol import KimiFormat, PlainFormat
from composer_jax.agents import AgentError, TurnRequest
from composer_jax.agents.engine_agent import EngineAgent, EngineAgentConfig, tool_format, turn_stops
from composer_jax.eval import EvalConfig, evaluate
from composer_jax.eval.store import FIELDS
from composer_jax.infer import GenerationError, generate
from composer_jax.infer.engine import attend_length
from composer_jax.source_weights import open_model
from composer_jax.tasks.examples import write_example_task
from tests.random_models import random_model, save_random_run
from tests.test_tasks import no_leftover_copies  # noqa: F401  (fixture)

CONTEXT = 2048                      # the run's positions: a coding prompt and a few turns fit
SHAPE = dict(max_slots=4, max_len=512, steps_per_call=8)
SAMPLING = dict(temperature=0.8, top_p=0.95, top_k=40)
END = PlainFormat.end_of_turn


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run with one checkpoint (step 3) of the tiny byte-level model, random weights."""
    return save_random_run(tmp_path_factory.mktemp("run"), [f"model.rope.max_position_embeddings={CONTEXT}"])


@pytest.fixture(scope="module")
def opened(run_dir):
    return open_model(run_dir)


def _agent(opened, **settings) -> EngineAgent:
    config = EngineAgentConfig(**{**SHAPE, **SAMPLING, "max_new_tokens": 16, **settings})
    return EngineAgent(opened.model, ByteTokenizer(), opened.description, config)


class DialogueEnv:
    """A multi-turn text environment: the user answers each of the first len(replies) assistant turns
    with a message of replies[turn] characters (so prefills of several widths mix in the engine's steps);
    the episode ends after the next turn, rewarded 1 when that turn's text is the task's answer."""

    tools = ()

    def __init__(self, fmt, replies):
        self.fmt, self.replies = fmt, replies

    @property
    def hint_context(self):
        return HintContext((), "")

    def reset(self, task):
        self.task, self.turn = task, 0
        return [{"role": "user", "content": task.prompt}]

    def step(self, text):
        self.turn += 1
        done = self.turn > len(self.replies)
        info = {"turn": self.turn, "flags": [], "task_reward": float(text.strip() == self.task.answer),
                "turns": self.turn, "tool_calls": 0, "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0}
        length = 0 if done else self.replies[self.turn - 1]
        reply = [] if done else [{"role": "user", "content": ("more " * length)[:length]}]
        return reply, done, info


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_cli_evaluates_a_training_run_on_coding_tasks(run_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    for i in range(2):
        write_example_task(tasks / f"t{i}", i)
    out = tmp_path / "out"
    argv = ["eval", str(run_dir), str(tasks), "--max-turns", "2", "--workers", "2",
            "--temperature", "0.7", "max_new_tokens=24", f"max_len={CONTEXT}", "max_slots=4", "--quiet"]
    assert cli.main(argv + ["--out", str(out)]) == 0
    assert "pass@1" in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["agent"] == f"training run {run_dir}, step 3"
    assert run["agent_settings"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24,
                                     "max_len": CONTEXT, "format": "plain"}
    records = _records(out)
    assert sorted((r["task"], r["sample"]) for r in records) == [("scaled-sum-0", 0), ("scaled-sum-1", 0)]
    for r in records:   # random weights write no tool call: two full turns of text, then the tests grade the stub
        assert set(r) == set(FIELDS)
        assert (r["turns"], r["generated_tokens"], r["status"], r["reward"]) == (2, 48, "ok", 0.0), r
        transcript = json.loads((out / r["transcript"]).read_text())
        generated = np.zeros(len(transcript["tokens"]), bool)
        for turn in transcript["turns"]:
            generated[turn["start"]:turn["end"]] = True
            assert turn["versions"] == [0] and [f["kind"] for f in turn["flags"]] == ["no_action"]
        logprobs = np.array(transcript["logprobs"])
        assert (logprobs[generated] < 0).all() and (logprobs[~generated] == 0).all()
        assert transcript["check"]["status"] == "ok"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scores"]["pass@1"]["value"] == 0.0 and summary["scores"]["tool_error_rate"]["value"] is None
    assert summary["scores"]["turns_per_solved"]["value"] is None and summary["tasks"] == 2

    before = (out / "attempts.jsonl").read_bytes()        # slots are not pinned: a restart may change them
    assert cli.main([a if a != "max_slots=4" else "max_slots=2" for a in argv] + ["--out", str(out)]) == 0
    assert (out / "attempts.jsonl").read_bytes() == before
    capsys.readouterr()
    assert cli.main([a if a != "max_new_tokens=24" else "max_new_tokens=8" for a in argv] + ["--out", str(out)]) == 2
    assert "holds an evaluation with a different 'agent_settings'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# determinism, batching, equivalence


@pytest.fixture(scope="module")
def dialogue_runs(opened, tmp_path_factory):
    """The same evaluation of 3 tasks x 2 samples (4 turns each, user replies of 3, 40 and 90 characters)
    with 1 worker and with 5 workers (more than the 4 slots: one waits for a slot), on fresh engines of
    SHAPE; and the number of programs compiled for both."""
    root = tmp_path_factory.mktemp("dialogue")
    tasks = toy_tasks("copy", 3, seed=2)
    runs = {}
    for workers in (1, 5):
        agent = _agent(opened)
        try:
            evaluate(agent, tasks, root / f"w{workers}", EvalConfig(samples=2, workers=workers, seed=11),
                     make_env=lambda: DialogueEnv(agent.fmt, (3, 40, 90)))
        finally:
            agent.close()
        runs[workers] = (root / f"w{workers}", agent)
    return runs, sum(sum(agent.engine.traces.values()) for _, agent in runs.values())


def _assert_close(a, b, where: str) -> None:
    """JSON values equal, floats within 1e-5."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=1e-5), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_transcripts_do_not_depend_on_the_worker_count(dialogue_runs):
    """Tokens, turns and texts equal, behaviour log-probs within 1e-5: programs attend to the cache up
    to the longest slot they serve, rounded up, and the prompts read together set the chunks, so
    batch-mates change the rounding (as matmuls of another slot count do)."""
    (one, _), (five, _) = dialogue_runs[0][1], dialogue_runs[0][5]
    assert sorted((r["task"], r["sample"]) for r in _records(one)) == sorted(
        (r["task"], r["sample"]) for r in _records(five))
    texts = set()
    for r in _records(one):
        transcript, other = (json.loads((run / r["transcript"]).read_bytes()) for run in (one, five))
        _assert_close(transcript, other, r["transcript"])
        assert len(transcript["turns"]) == 4 and r["generated_tokens"] == 4 * 16
        texts.add(transcript["text"])
    assert len(texts) == 6          # every attempt drew its own tokens


@pytest.mark.slow
def test_episodes_share_engine_steps_with_a_bounded_number_of_programs(dialogue_runs):
    runs, traces = dialogue_runs
    alone, shared = runs[1][1], runs[5][1]
    assert alone.stats["max_requests_per_step"] == 1 and alone.stats["requests"] == 24
    assert 1 < shared.stats["max_requests_per_step"] <= 4 and shared.stats["requests"] == 24
    assert shared.stats["engine_steps"] < alone.stats["engine_steps"]
    # 48 requests of many prompt lengths: at most one decode program per attended length and one prefill
    # program per chunk width and attended length (none when an earlier test compiled this shape); the
    # second engine reuses the first's
    attended = {attend_length(n, SHAPE["max_len"]) for n in range(SHAPE["max_len"] + 1)}
    assert traces <= len(attended) * (1 + len(shared.engine.chunks)) and shared.engine.compiled == []
    assert alone.engine.kept == {} and shared.engine.kept == {}   # every episode's slot was released


def test_turns_equal_generate_on_the_same_prompt_and_seed(opened):
    """Turn 0 (a fresh request) and turn 1 (continued after new tokens in the kept slot) give the tokens
    and behaviour log-probs of `generate` on the whole episode so far with the turn's seed."""
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode(PlainFormat().message("user", "copy abc") + PlainFormat().generation_prompt()).tolist()
    reply = tokenizer.encode(END + "\n" + PlainFormat().message("user", "again, longer") + "<|im_start|>assistant\n")
    with _agent(opened, max_new_tokens=20) as agent:
        first = agent.turn(TurnRequest("t/0", "t", 0, 0, tuple(prompt), prompt, 1234))
        history = prompt + first.tokens + reply.tolist()
        second = agent.turn(TurnRequest("t/0", "t", 0, 1, tuple(history), reply.tolist(), 1234))
        agent.end_episode("t/0")
    for turn, tokens, seed in ((first, prompt, 1234), (second, history, 1235)):
        want = generate(opened.model, [tokens], max_new_tokens=20, seed=[seed], stop_strings=(END,),
                        detokenize=tokenizer.decode, **SHAPE, **SAMPLING)
        assert turn.tokens == want.tokens[0] and len(turn.tokens) == 20
        np.testing.assert_allclose(turn.logprobs, want.behaviour_logprobs[0], atol=1e-5)
        assert turn.versions == [0] * 20
    assert first.tokens != second.tokens


def test_weight_updates_set_the_version_of_later_tokens(opened, run_dir):
    other = random_model(opened.model.cfg, 9)
    prompt = ByteTokenizer().encode("<|im_start|>user\ncopy xyz<|im_end|>\n<|im_start|>assistant\n").tolist()
    with _agent(opened) as agent:
        with pytest.raises(GenerationError, match="structure differs"):
            agent.update_weights({}, 1)
        agent.update_weights(other, 7)
        assert agent.version == 7
        turn = agent.turn(TurnRequest("t/0", "t", 0, 0, tuple(prompt), prompt, 5))
        agent.end_episode("t/0")
    want = generate(other, [prompt], max_new_tokens=16, seed=[5], stop_strings=(END,),
                    detokenize=ByteTokenizer().decode, **SHAPE, **SAMPLING)
    assert turn.tokens == want.tokens[0] and turn.versions == [7] * 16
    assert turn.tokens != generate(opened.model, [prompt], max_new_tokens=16, seed=[5], stop_strings=(END,),
                                   detokenize=ByteTokenizer().decode, **SHAPE, **SAMPLING).tokens[0]


# ------------------------------------------------------------------------------------------------
# context, format, errors


def test_an_episode_past_the_context_ends_unsolved(opened, tmp_path):
    tasks = toy_tasks("copy", 1, seed=4)
    with _agent(opened) as agent:
        summary = evaluate(agent, tasks, tmp_path / "run", EvalConfig(),
                           make_env=lambda: DialogueEnv(agent.fmt, (600,)))
        # end_episode queues the release for the engine's driver thread; a weight update returns only once
        # the driver has run it, so every command queued before it has run too.
        agent.update_weights(opened.model, agent.version)
        assert agent.engine.kept == {}   # released although the episode did not finish
        prompt = list(range(256)) * 2
        with pytest.raises(AgentError, match="task t: its prompt of 512 tokens does not fit the agent's context "
                                            "\\(max_len=512\\); raise max_len"):
            agent.turn(TurnRequest("t/0", "t", 0, 0, tuple(prompt), prompt, 0))
    (record,) = _records(tmp_path / "run")
    assert (record["status"], record["reward"], record["turns"], record["generated_tokens"]) == (
        "context_full", 0.0, 1, 16)
    transcript = json.loads((tmp_path / "run" / record["transcript"]).read_text())
    assert transcript["status"] == "context_full" and transcript["check"] is None
    assert summary.scores["pass@1"].value == 0.0


def test_a_refused_turn_is_an_error_naming_the_episode_and_frees_its_slot(opened):
    prompt = ByteTokenizer().encode("<|im_start|>user\ncopy abc<|im_end|>\n<|im_start|>assistant\n").tolist()
    with _agent(opened) as agent:
        first = agent.turn(TurnRequest("t/0", "t", 0, 0, tuple(prompt), prompt, 3))
        new = [300]                                                    # outside the 256-id vocabulary
        history = tuple(prompt + first.tokens + new)
        with pytest.raises(AgentError, match="^episode t/0: prompt: token id 300 is out of the vocabulary"):
            agent.turn(TurnRequest("t/0", "t", 0, 1, history, new, 3))
        with pytest.raises(AgentError, match="episode t/0: 3 tokens before the new ones, the engine holds"):
            agent.turn(TurnRequest("t/0", "t", 0, 1, (1, 2, 3, 4), [4], 3))
        assert len(agent.engine.kept) == 1
        agent.end_episode("t/0")
        agent.turn(TurnRequest("t/1", "t", 1, 0, tuple(prompt), prompt, 3))   # the driver goes on
        agent.end_episode("t/1")
        agent.update_weights(opened.model, 0)                          # a barrier: the releases ran before it
        assert agent.engine.kept == {}


def test_a_turn_waiting_for_a_slot_does_not_spin_the_driver(opened):
    """Every slot kept by an episode between turns and one more episode's first turn queued: the driver
    waits (no engine steps) until an episode ends and frees a slot, then serves the waiting turn."""
    import threading
    import time

    prompt = ByteTokenizer().encode("<|im_start|>user\ncopy abc<|im_end|>\n<|im_start|>assistant\n").tolist()
    with _agent(opened) as agent:
        slots = agent.engine.max_slots
        for i in range(slots):
            agent.turn(TurnRequest(f"t/{i}", "t", i, 0, tuple(prompt), prompt, 3))
        assert len(agent.engine.kept) == slots
        done = threading.Event()
        threading.Thread(target=lambda: (agent.turn(TurnRequest("u/0", "u", 0, 0, tuple(prompt), prompt, 3)),
                                         done.set()), daemon=True).start()
        time.sleep(0.5)
        steps = agent.stats["engine_steps"]
        time.sleep(1.0)
        assert not done.is_set() and agent.stats["engine_steps"] == steps   # waiting, not stepping
        agent.end_episode("t/0")
        assert done.wait(120)


def _special_tokenizer(path: Path, specials) -> Path:
    """A byte-level BPE tokenizer.json (no merges) with `specials` added as single tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


def test_format_and_stops_follow_the_tokenizer(opened, tmp_path):
    with_markers = load_tokenizer(str(_special_tokenizer(tmp_path / "kimi.json", KimiFormat.markers)))
    end_id = with_markers.encode(END).tolist()
    assert len(end_id) == 1 and end_id[0] >= 256
    assert tool_format(with_markers).name == "kimi"
    assert turn_stops(with_markers, tool_format(with_markers), (3,)) == ((3, end_id[0]), ())
    only_end = load_tokenizer(str(_special_tokenizer(tmp_path / "end.json", [END])))
    assert tool_format(only_end).name == "plain"
    with pytest.raises(AgentError, match="chat format 'kimi' needs <.tool_calls_section_begin.>"):
        tool_format(only_end, "kimi")     # a format the tokenizer cannot express: one line, naming a marker
    assert turn_stops(only_end, PlainFormat()) == ((only_end.encode(END)[0],), ())
    assert tool_format(ByteTokenizer()).name == "plain"
    assert turn_stops(ByteTokenizer(), PlainFormat(), (7,)) == ((7,), (END,))
    with pytest.raises(AgentError, match=f"the tokenizer has {with_markers.vocab_size} ids, more than the model's "
                                        "vocabulary of 256"):
        EngineAgent(opened.model, with_markers, "m", EngineAgentConfig(**SHAPE))


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip().removeprefix("composer-jax eval: error: ")


def test_bad_models_and_settings_are_one_line_errors(run_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    write_example_task(tasks / "t0", 0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": ')

    def error(model, *settings) -> str:
        assert cli.main(["eval", str(model), str(tasks), *settings, "--out", str(tmp_path / "out")]) == 2
        assert not (tmp_path / "out").exists()
        return _one_line(capsys.readouterr().err)

    missing = tmp_path / "missing"
    assert error(missing) == f"MODEL '{missing}': does not load: {missing} does not exist"
    assert error(tmp_path / "empty") == (
        f"MODEL '{tmp_path / 'empty'}': does not load: {tmp_path / 'empty'} is not a model: it has no config.json "
        "(a Hugging Face directory), model_config.yaml (a converted directory) or checkpoints/ (a run directory)")
    assert error(tmp_path / "broken").startswith(
        f"MODEL '{tmp_path / 'broken'}': does not load: {tmp_path / 'broken' / 'config.json'}: not valid JSON")
    assert error(run_dir, "max_slot=4") == (
        f"MODEL '{run_dir}': agent setting: config key 'max_slot': unknown key for EngineAgentConfig; did you mean "
        "'max_slots'?")
    assert error(run_dir, "--temperature", "-1") == (
        f"MODEL '{run_dir}': agent setting: config key 'temperature': must be >= 0 (0: greedy), got -1.0")
    assert error(run_dir, "seed=3") == (
        f"MODEL '{run_dir}': agent setting: config key 'seed': does not apply to an agent (a turn draws from its "
        "attempt's seed (--seed)), got 3")
    assert error(run_dir, "model.moe.dispach=dense") == (
        f"MODEL '{run_dir}': agent setting: config key 'moe.dispach': unknown key for MoEConfig; did you mean "
        "'dispatch'?")
    assert error(run_dir, "max_len=4096") == (
        f"max_len=4096 exceeds the model's {CONTEXT} positions (rope.max_position_embeddings)")


def test_the_evaluations_workers_size_the_engines_slots(run_dir):
    """`eval --workers N` gives the engine N slots (at most the default 8) unless `max_slots` is set: an
    empty slot still decodes every step, so 8 slots for 1 worker made the tiny model's decode 5x slower."""
    from composer_jax.agents import load_agent

    for workers, overrides, slots in ((1, (), 1), (20, (), 8), (2, ("max_slots=3",), 3), (0, (), 8)):
        agent = load_agent(str(run_dir), overrides=overrides, episodes_at_once=workers)
        try:
            assert agent.engine.max_slots == slots, (workers, overrides)
        finally:
            agent.close()
