"""Rollout throughput in the RL loop's records, each against an independent count: the engine's busy
slots over its decode steps (requests of known lengths), the producer's tokens per second, engine
occupancy and speculative acceptance (an agent with known tokens, timings, slot use and drafts), and
the learner's wait for batches (known intervals)."""

import collections
import threading
import time

import numpy as np
import pytest

from composer_jax import load_config
from composer_jax.agents import AgentTurn
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.infer import Engine
from composer_jax.rl.records import RunRecords
from composer_jax.rl.rollout import ProducedBatch, RolloutProducer, group_assembler
from composer_jax.rl.run_config import load_rl_config
from composer_jax.rl.sampler import TaskSampler
from tests.random_models import random_model
from tests.rl_parity import parity_tasks
from tests.test_rl_loop import TINY


def test_engine_counts_the_busy_slots_of_each_decode_step():
    """Two requests of 3 and 6 new tokens, no stop token, in 4 slots: the first token of each comes from
    the prefill, then 2 and 5 decode steps: 5 steps offering 4 slots each, 2 + 5 of them busy."""
    engine = Engine(random_model(load_config("tiny"), 3), max_slots=4, max_len=64, chunk_sizes=(8, 32),
                    steps_per_call=4)
    prompt = list(range(1, 6))
    lengths = {engine.submit(prompt, max_new_tokens=n, stop_tokens=[]): n for n in (3, 6)}
    done = engine.run()
    assert {rid: len(c.tokens) for rid, c in done.items()} == lengths
    assert engine.stats["decode_steps"] == 5 and engine.stats["decode_busy_slot_steps"] == 2 + 5


class CountingAgent:
    """Answers each turn with TOKENS bytes after SLEEP_S, and plays an engine that ran STEPS decode steps
    with one busy slot of SLOTS for each turn; counts the tokens it gave."""

    TOKENS, SLEEP_S, STEPS, SLOTS = 3, 0.2, 2, 4
    tokenizer, version = ByteTokenizer(), 0

    def __init__(self, speculative: bool = False):
        self.engine = type("FakeEngine", (), {"stats": collections.Counter(), "max_slots": self.SLOTS,
                                              "speculative": speculative})()
        self.given, self.lock = 0, threading.Lock()

    def turn(self, request):
        time.sleep(self.SLEEP_S)
        tokens = self.tokenizer.encode("b" * self.TOKENS).tolist()
        with self.lock:
            self.given += len(tokens)
            self.engine.stats["decode_steps"] += self.STEPS
            self.engine.stats["decode_busy_slot_steps"] += 1
            self.engine.stats["drafted"] += 3       # a speculative engine: 3 drafts, 1 of them accepted
            self.engine.stats["accepted"] += 1
        return AgentTurn(tokens)

    def end_episode(self, episode):
        pass


def test_the_producer_reports_generated_tokens_per_busy_second_and_engine_occupancy():
    """8 episodes of one 3-token turn each, all sleeping 0.2 s at once: the batch's tokens per second are
    the agent's 24 tokens over the batch's busy time (at least the 0.2 s the turns took); occupancy 1 busy
    slot of 4 in each of 2 decode steps per turn: 1/8."""
    cfg = load_rl_config("rl-tiny", [*TINY, "run_dir=unused"])
    tasks = parity_tasks()
    sampler = TaskSampler(list(tasks.train), cfg.sampler)
    agent = CountingAgent()
    produced = RolloutProducer(agent, tasks.train, tasks.make_env, sampler, group_assembler(cfg, sampler),
                               cfg).produce(0)
    m = produced.metrics
    assert m["rollouts"] == cfg.rollout.batch_size and agent.given == CountingAgent.TOKENS * cfg.rollout.batch_size
    busy = produced.busy[1] - produced.busy[0]
    assert CountingAgent.SLEEP_S <= m["rollout_s"] <= busy + 1e-3
    assert m["rollout_tokens_per_s"] == pytest.approx(agent.given / m["rollout_s"])
    record = RunRecords(0, 1).record(1, produced, np.zeros(0), {"reward_mean": 0.0, "tokens": 1.0}, (0.0, 1.0))
    assert record["engine_occupancy"] == pytest.approx(1 / (CountingAgent.STEPS * CountingAgent.SLOTS))
    assert record["engine_decode_steps"] == CountingAgent.STEPS * cfg.rollout.batch_size
    assert "engine_slot_steps" not in record and "engine_busy_slot_steps" not in record
    assert "speculative_acceptance_rate" not in record      # a plain engine


def test_the_producer_reports_speculative_acceptance_and_tokens_per_decode_step():
    """A speculative engine that drafted 3 tokens and accepted 1 in each turn's one busy slot-step: 1/3
    accepted, 1 + 1 tokens per busy slot and step (the plain engine's 1)."""
    cfg = load_rl_config("rl-tiny", [*TINY, "run_dir=unused"])
    tasks = parity_tasks()
    sampler = TaskSampler(list(tasks.train), cfg.sampler)
    produced = RolloutProducer(CountingAgent(speculative=True), tasks.train, tasks.make_env, sampler,
                               group_assembler(cfg, sampler), cfg).produce(0)
    record = RunRecords(0, 1).record(1, produced, np.zeros(0), {"reward_mean": 0.0, "tokens": 1.0}, (0.0, 1.0))
    assert record["speculative_acceptance_rate"] == pytest.approx(1 / 3)
    assert record["speculative_tokens_per_step"] == pytest.approx(2.0)
    assert "engine_drafted" not in record and "engine_accepted" not in record


def _batch(index: int, busy: tuple[float, float]) -> ProducedBatch:
    versions = np.full((2, 1), index - 1)
    return ProducedBatch(index, None, [], [], [], versions, {}, [], {}, {}, busy)


def test_learner_wait_is_its_time_blocked_on_batches_after_the_first_step():
    """The learner waits 0-2 s for batch 1 and compiles its step until 3 (the origin); it waits 3-4 and
    5-6.5 for the next batches and trains 4-5 and 6.5-7.5: 1 + 1.5 s of the 4.5 s since the origin."""
    records = RunRecords(0, 3)
    learner = {1: (2.0, 3.0), 2: (4.0, 5.0), 3: (6.5, 7.5)}
    waits = {1: (0.0, 2.0), 2: (3.0, 4.0), 3: (5.0, 6.5)}
    for step in (1, 2, 3):
        produced = _batch(step - 1, (waits[step][0] - 1.0, waits[step][1]))
        stale = records.arrived(produced, step - 1, 1, waits[step])
        record = records.record(step, produced, stale, {"reward_mean": 0.0, "tokens": 1.0}, learner[step])
        assert record["learner_wait_s"] == pytest.approx(waits[step][1] - waits[step][0])
    assert record["learner_wait_fraction"] == pytest.approx(2.5 / 4.5)
    assert record["learner_busy_fraction"] == pytest.approx(2.0 / 4.5)
    assert "engine_occupancy" not in record       # no engine counts: an agent without an engine
