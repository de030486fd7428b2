"""The asynchronous RL loop (`composer-jax rl`): staleness 0 equals a plain synchronous loop step for
step; with staleness k no trained batch is older than k versions (from the recorded token versions);
environments that crash or hang lose rollouts, the run counts them and goes on; SIGKILL then restart
continues the policy version and never trains a consumed prompt twice; bad inputs are one-line errors.

The tiny model with random weights and a test environment whose reward has a ~1/4 chance (the parity
of the answer's first character), so groups carry signal from a random policy; turns it does not
reward are flagged (targeted feedback trains on them)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import cli
from composer_jax.agents.engine_agent import EngineAgent, EngineAgentConfig
from composer_jax.config import to_dict
from composer_jax.envs import get_format, toy_tasks
from composer_jax.model import CausalLM
from composer_jax.model_dirs import run_chat
from composer_jax.parallel import shard_model
from composer_jax.rl.loop import RLTrainer
from composer_jax.rl.records import Overlap
from composer_jax.rl.rollout import RolloutProducer, engine_context, group_assembler
from composer_jax.rl.rollout_log import read_rollouts
from composer_jax.rl.run_config import load_rl_config
from composer_jax.rl.sampler import TaskSampler
from composer_jax.train.metrics import read_metrics
from tests.rl_parity import parity_tasks

REPO = Path(__file__).resolve().parents[1]
# A fresh tiny model (no init_from), byte-level. Small shapes: 8 rows (2 prompts x 4 samples) of 80 tokens,
# 6-token answers, one teacher slot of 128.
MODEL = ["model=tiny", "model.rope.factor=16", "model.rope.max_position_embeddings=256", "model.moe.dispatch=dense"]
TINY = ["init_from=", *MODEL, "rl.group_size=4", "rl.max_tokens=6", "rl.optimizer.lr=1e-3", "rollout.batch_size=8",
        "rollout.max_new_tokens=6", "rollout.max_len=80", "rollout.max_slots=8", "rollout.feedback_window=128",
        "progress=false", "checkpoint.async_save=false", "rollout.devices=0"]   # the engine on the 8 test devices


# pretrain-tiny's run of the same model (tests.random_models.save_random_run): a source for init_from.
BYTE_TINY = MODEL


def _config(run_dir, *overrides):
    return load_rl_config("rl-tiny", [*TINY, f"run_dir={run_dir}", *overrides])


def _records(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
def test_staleness_zero_equals_a_synchronous_loop(tmp_path):
    """rl.max_staleness=0: the asynchronous loop's losses, rewards and trained prompts equal those of a
    plain loop that samples a batch with the current weights, then trains on it, step after step. Its
    rollouts.jsonl (rl.log_rollouts_every=1) holds each step's best, worst and a random episode: their
    rewards are the max and min of the plain loop's episodes of that batch, their tokens those episodes',
    decoding with the run's tokenizer to the line's text, every generated token of version step - 1."""
    steps = 3
    cfg = _config(tmp_path / "async", "rl.max_staleness=0", f"rl.steps={steps}", "rl.log_rollouts_every=1")
    trainer = RLTrainer(cfg, parity_tasks())
    waits, next_batch = [], trainer.rollouts.next_batch

    def timed_next_batch():       # the learner's wait for each batch, measured here
        began = time.perf_counter()
        try:
            return next_batch()
        finally:
            waits.append(time.perf_counter() - began)

    trainer.rollouts.next_batch = timed_next_batch
    summary = trainer.run()
    records = _records(cfg.run_dir)
    assert summary["end_step"] == steps and [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 for r in records)
    assert all(0 < r["mtp1_acceptance"] <= 1 for r in records)
    assert [r["learner_wait_s"] for r in records] == pytest.approx(waits, abs=0.05)
    assert 0 < summary["learner_wait_fraction"] < 1 and all(0 < r["engine_occupancy"] <= 1 for r in records)

    # The synchronous reference: the same initial model, sampler and seeds; the compiled step is reused.
    model = CausalLM(cfg.model, rngs=nnx.Rngs(cfg.seed))
    tasks = parity_tasks()
    with trainer.learner.dual:
        shard_model(model, trainer.learner.dual)
        state = trainer.learner.rl_step.init_state(model)
        sampler = TaskSampler(list(tasks.train), cfg.sampler)
        r = cfg.rollout
        agent = EngineAgent(model, trainer.tokenizer, "reference", EngineAgentConfig(
            temperature=r.temperature, max_new_tokens=r.max_new_tokens, max_slots=r.max_slots,
            max_len=engine_context(cfg, trainer.tokenizer, get_format("plain")),
            steps_per_call=r.steps_per_call, format="plain"))
        producer = RolloutProducer(agent, tasks.train, tasks.make_env, sampler, group_assembler(cfg, sampler), cfg)
        played, episode = {i: {} for i in range(steps)}, producer._episode

        def recorded(prompt, sample, index, in_env):    # each episode the plain loop plays, by batch and key
            rollout = episode(prompt, sample, index, in_env)
            played[index][rollout.key] = rollout
            return rollout

        producer._episode = recorded
        try:
            for step in range(steps):
                policy = nnx.merge(trainer.learner.rl_step.graphdef, state.params, state.biases, trainer.learner.rl_step.rest)
                agent.update_weights(agent.engine.place_weights(policy), step)
                produced = producer.produce(step)
                state, metrics = trainer.learner.rl_step(state, produced.batch)
                metrics = jax.device_get(metrics)
                ours = records[step]
                assert ours["trained_draws"] == [p.draw for p in produced.trained]
                assert ours["reward_mean"] == produced.metrics["reward_mean"]
                # The same tokens, but their behaviour log-probs differ by ~1e-6 with which requests shared
                # an engine call (the attended length follows the batch, docs/inference.md), and the
                # policy-gradient loss is a small difference of them: in CI the loss moved 1.5e-5 relative.
                for name in ("loss", "loss_pg", "loss_sd", "grad_norm"):
                    assert ours[name] == pytest.approx(float(metrics[name]), rel=1e-4, abs=1e-7), (step, name)
        finally:
            agent.close()
    assert any(r["loss_sd"] > 0 for r in records) and any(r["groups_trainable"] > 0 for r in records)
    _check_rollout_lines(read_rollouts(cfg.run_dir), played, records, trainer.tokenizer)


def _check_rollout_lines(lines, played, records, tokenizer):
    """rollouts.jsonl against the episodes the plain loop played (`played`: batch -> key -> Rollout)."""
    assert [(r["step"], r["pick"]) for r in lines] == [(s, p) for s in (1, 2, 3) for p in ("best", "worst", "random")]
    for line in lines:
        batch = played[line["step"] - 1]
        rewards = [x.reward for x in batch.values()]
        reference = batch[line["episode"]]
        assert line["tokens"] == reference.episode.tokens and tokenizer.decode(line["tokens"]) == line["text"]
        assert line["reward"] == reference.reward
        assert line["reward"] == {"best": max(rewards), "worst": min(rewards)}.get(line["pick"], line["reward"])
        assert {v for v, g in zip(line["versions"], line["generated"]) if g} == {line["step"] - 1}
        trained = records[line["step"] - 1]["trained_draws"]
        assert line["trained"] == (int(line["episode"].split("/")[0]) in trained)
    assert len({r["episode"] for r in lines if r["step"] == 1}) == 3
    assert any(max(x.reward for x in b.values()) > min(x.reward for x in b.values()) for b in played.values())


@pytest.mark.slow
def test_staleness_bound_and_lost_rollouts(tmp_path):
    """rl.max_staleness=2 with the engine on its own 4 devices (the learner on the other 4): every trained row's tokens come from a
    version at most 2 behind the learner's (and the producer does run ahead); an environment that
    crashes and one that hangs past the timeout lose rollouts, which are counted, and every step still
    trains the rest; the monitor flags the episodes that edit a test file (monitor.jsonl, counts) and,
    with monitor.zero_reward, their groups carry no reward and train only their hinted turns."""
    steps = 4
    cfg = _config(tmp_path / "run", "rl.max_staleness=2", f"rl.steps={steps}", "rollout.devices=4",
                  "rollout.timeout_s=2", "rollout.max_refills=1", "monitor.zero_reward=true")
    summary = RLTrainer(cfg, parity_tasks(crash_and_hang=True, hang_s=6.0)).run()
    records = _records(cfg.run_dir)
    assert summary["end_step"] == steps and [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert 0 <= (r["step"] - 1) - r["batch_version_min"] == r["staleness_max"] <= 2
    assert max(r["staleness_max"] for r in records) >= 1, "the producer never ran ahead of the learner"
    assert sum(r["rollouts_crashed"] for r in records) > 0 and sum(r["rollouts_hung"] for r in records) > 0
    assert sum(r["groups_dropped_lost"] for r in records) > 0
    assert sum(r["rollouts"] for r in records) > 0 and all(np.isfinite(r["loss"]) for r in records)
    flagged = [json.loads(line) for line in (Path(cfg.run_dir) / "monitor.jsonl").read_text().splitlines()]
    assert flagged and all(f["detectors"] == ["test_files"] for f in flagged)
    assert sum(r["monitor_test_files"] for r in records) == len(flagged)
    # Zeroed rewards leave no policy-gradient signal: a cheating group trains only its hinted turns.
    assert any(r["feedback_only_draws"] for r in records)
    assert all(draw in r["feedback_only_draws"] for r in records
               for draw, task in zip(r["trained_draws"], r["trained_tasks"]) if task == "cheat-2")


@pytest.mark.slow
def test_sigkill_then_restart_continues(tmp_path):
    """`composer-jax rl` killed with SIGKILL after its checkpoint at step 2, then started again with the
    same command: it resumes from its last checkpoint, runs to the end (with the held-out evaluation
    at the last step), the policy versions continue, and the prompts drawn over the whole run
    (consumed whether trained or dropped) are each drawn once, in sequence. rollouts.jsonl holds each
    step's picks once: the lines the killed run wrote after its checkpoint (one is added here, as if it
    had reached the step after it) are cut, and each line's tokens decode with the run's tokenizer to its text."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "composer_jax.cli", "rl", *TINY, f"run_dir={run_dir}", "rl.steps=5",
            "checkpoint.every=2", "env.tasks=8", "rl.log_rollouts_every=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / "2").is_dir() and first.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL, first.stdout.read().decode()[-2000:]
    # Its last checkpoint: 2, or 4 where the run got there before the kill (a step takes under a second).
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    with open(run_dir / "rollouts.jsonl", "a") as f:     # what the killed run might have written past it
        f.write(json.dumps({"step": saved + 1, "pick": "best", "episode": "killed"}) + "\n")
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = re.search(r"steps (\d+) -> 5", second.stdout)
    assert resumed and int(resumed[1]) == saved, second.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5]
    draws = [d for r in records for d in r["batch_draws"]]
    assert draws == list(range(len(draws))), draws
    assert 0 <= records[-1]["eval_pass@1"] <= 1       # the held-out evaluation at the last step
    assert (run_dir / "eval" / "step-5" / "summary.json").is_file()
    lines, tokenizer = read_rollouts(run_dir), run_chat(run_dir).load_tokenizer()     # the run's own
    picks = [(s, p) for s in range(1, 6) for p in ("best", "random", "worst")]
    assert sorted((r["step"], r["pick"]) for r in lines) == picks
    assert all(tokenizer.decode(r["tokens"]) == r["text"] for r in lines)


@pytest.mark.parametrize("overrides, key", [
    (["rollout.batch_size=10", "rl.group_size=4"], "rollout.batch_size"),
    (["rewards.tone_weight=1"], "rewards.tone_weight"),                 # no such reward term
    (["env.kind=coding", "env.tasks_dir={empty}"], "env.tasks_dir"),
    (["env.kind=coding", "env.tasks_dir={empty}", "env.tools=[run]"], "env.tools"),
    (["init_from={empty}"], "init_from"),                          # a source that is not a model
    (["model.vocab_size=128"], "tokenizer"),                        # bytes do not fit the vocabulary
    (["env.format=kimi"], "env.format"),                            # a format the tokenizer cannot express
])
def test_bad_input_is_one_line_naming_the_key(tmp_path, capsys, overrides, key):
    empty = tmp_path / "tasks"
    empty.mkdir()
    base = [] if any(o.startswith("init_from=") and o != "init_from=" for o in overrides) else ["init_from=", *MODEL]
    status = cli.main(["rl", f"run_dir={tmp_path / 'run'}", *base, *[o.format(empty=empty) for o in overrides]])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "run").exists()


def test_overlap_counts_each_pair_of_intervals_once():
    """Rollout [0, 2] and [2.5, 4] against learning [1, 3]: both ran 1 + 0.5 s; counted from 1.5 on,
    0.5 + 0.5 s of 2.5 s."""
    overlap = Overlap()
    overlap.add("rollout", (0.0, 2.0))
    overlap.add("learner", (1.0, 3.0))
    overlap.add("rollout", (2.5, 4.0))
    assert overlap.both == pytest.approx(1.5)
    overlap.start(1.5)
    fractions = overlap.fractions(4.0)
    assert fractions["overlap_fraction"] == pytest.approx(1.0 / 2.5)
    assert fractions["rollout_busy_fraction"] == pytest.approx(2.0 / 2.5)
    assert fractions["learner_busy_fraction"] == pytest.approx(1.5 / 2.5)


def test_batch_assembly_pads_with_rows_that_train_nothing():
    """Two groups of 2 from played toy episodes, padded to 8 rows: the batch validates, the rows are
    ordered by draw then sample whatever order they finished in, rewards come from the rollouts (after
    the monitor), the padding rows generate nothing and sit in groups of their own, and each row's
    version range is that of its tokens."""
    from composer_jax.data.tokenizer import ByteTokenizer
    from composer_jax.envs import PlainFormat, Report, TokenEpisode, ToyEnv
    from composer_jax.rl.batch import validate_batch
    from composer_jax.rl.groups import Group, Sample
    from composer_jax.rl.rollout import Rollout, assemble
    from composer_jax.rl.sampler import Prompt

    cfg = _config("unused", "rl.group_size=2")
    tokenizer, env = ByteTokenizer(), ToyEnv(get_format("plain"))
    groups, tasks = [], toy_tasks("add", 2, seed=1)
    for draw, task in enumerate(tasks):
        prompt, samples = Prompt(task.id, draw, 0), []
        for sample, text in reversed(list(enumerate([task.answer, ""]))):     # finished in reverse order
            episode = TokenEpisode(env, tokenizer)
            episode.start(task)
            ids = tokenizer.encode(text + env.fmt.end_of_turn)
            episode.step(ids, np.full(len(ids), -0.5))
            rollout = Rollout(prompt, sample, episode, [draw] * len(ids), Report(), 0.25 + sample)
            samples.append(Sample(rollout.reward, episode.reward, rollout))
        groups.append(Group(prompt, tuple(samples)))
    batch, versions = assemble(groups, cfg)
    validate_batch(batch, group_size=2, vocab_size=256)
    assert batch.tokens.shape == (8, 80) and batch.teacher_tokens.shape == (8, 1, 128)
    assert batch.rewards.tolist() == [0.25, 1.25, 0.25, 1.25, 0, 0, 0, 0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    end = len(PlainFormat.end_of_turn)
    assert batch.generated[:4].sum(1).tolist() == [n for t in tasks for n in (len(t.answer) + end, end)]
    assert not batch.generated[4:].any()
    assert versions.tolist() == [[0, 0, 1, 1, -1, -1, -1, -1]] * 2
    # the empty answer is flagged (a teacher slot with its hint), the right one is not
    assert (batch.teacher_map[1] >= 0).sum() == end and (batch.teacher_map[0] < 0).all()


def test_rollout_metrics_count_calls_carried_out_and_failed():
    """Toy episodes answering through a `submit` call: a valid call, a malformed one and no call. Per
    episode 1/3 call carried out; 1 of the 2 attempted calls failed; 2 of the 3 turns used the tool
    wrongly (the one without a call counts there, though it failed no call)."""
    from composer_jax.data.tokenizer import ByteTokenizer
    from composer_jax.envs import Report, TokenEpisode, ToyEnv
    from composer_jax.rl.rollout import Rollout, rollout_metrics
    from composer_jax.rl.sampler import Prompt

    tokenizer, env = ByteTokenizer(), ToyEnv(get_format("plain"), use_tool=True)
    task = toy_tasks("add", 1, seed=3)[0]
    rollouts = []
    for sample, text in enumerate([env.fmt.render_call("submit", {"answer": task.answer}),
                                   "<tool_call>{not json</tool_call>", "no call at all"]):
        episode = TokenEpisode(env, tokenizer)
        episode.start(task)
        ids = tokenizer.encode(text + env.fmt.end_of_turn)
        episode.step(ids, np.zeros(len(ids)))
        rollouts.append(Rollout(Prompt(task.id, 0, 0), sample, episode, [0] * len(ids), Report(), episode.reward))
    metrics = rollout_metrics(rollouts, pass_threshold=1.0, wall_s=1.0)
    assert metrics["tool_calls_mean"] == pytest.approx(1 / 3)
    assert metrics["tool_error_rate"] == pytest.approx(1 / 2)
    assert metrics["tool_turn_error_rate"] == pytest.approx(2 / 3)
    assert metrics["pass_rate"] == pytest.approx(1 / 3)
    assert metrics["flag_malformed_call"] == metrics["flag_no_action"] == pytest.approx(1 / 3)
    assert metrics["flag_unknown_tool"] == metrics["tests_failed_runs"] == 0.0


def test_a_resumed_run_rebuilds_the_fixed_teacher_from_its_source(tmp_path):
    """rl.sd_teacher=initial and init_from a run: the fixed self-distillation teacher is the source's policy
    (its weights, bit for bit), and a resumed run loads it again, while its policy comes from the checkpoint."""
    from composer_jax.source_weights import open_model
    from tests.random_models import save_random_run

    source = save_random_run(tmp_path / "source", BYTE_TINY)
    cfg = _config(tmp_path / "run", f"init_from={source}", "rl.sd_teacher=initial", "rl.teacher_context=full",
                  "rollout.max_new_tokens=12", "rl.max_tokens=12",
                  "rollout.transport=directory")    # no in-process engine to build: none runs here
    first = RLTrainer(cfg)
    try:
        teacher = [np.asarray(x) for x in jax.tree.leaves(first.learner.rl_step.teacher_params)]
        source_params = nnx.state(open_model(source).model, nnx.Param)
        for want, got in zip(jax.tree.leaves(source_params), teacher):
            assert np.array_equal(np.asarray(want), got)
        state = first.learner.state
        moved = state._replace(step=state.step + 1, params=jax.tree.map(lambda x: x * 0.5, state.params))
        policy = [np.asarray(x) for x in jax.tree.leaves(moved.params)]
        first.checkpoints.save(1, moved, first.rollouts.checkpoint_data(), to_dict(cfg))
    finally:
        first.checkpoints.close()
    second = RLTrainer(cfg)
    try:
        assert second.life.resumed_from == 1 and second.learner.version == 1
        for want, got in zip(teacher, jax.tree.leaves(second.learner.rl_step.teacher_params)):
            assert np.array_equal(want, np.asarray(got))
        for want, got in zip(policy, jax.tree.leaves(second.learner.state.params)):
            assert np.array_equal(want, np.asarray(got))
    finally:
        second.checkpoints.close()
