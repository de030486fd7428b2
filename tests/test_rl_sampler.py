"""Task sampling by difficulty and rollout groups: seeded sampling statistics against the documented
rule computed here from the counts, once-per-pass draws, retirement, resume equivalence through JSON,
group dropping rules, pass rates written to task.json."""

import json
import math
from collections import Counter

import pytest

from composer_jax.config import ConfigError
from composer_jax.rl.groups import GroupAssembler, Sample
from composer_jax.rl.sampler import SamplerConfig, SamplerError, TaskSampler
from composer_jax.tasks import load_task
from composer_jax.tasks.examples import write_example_task

IDS = [f"t{i}" for i in range(6)]


def _passes(sampler, n):
    """The next n passes (lists of task ids), drawn one pass at a time."""
    out = []
    for _ in range(n):
        first = sampler.draw(1)[0]
        rest = sampler.draw(len(sampler.pending))   # nothing retires here: the pass ends with `pending`
        assert {p.pass_index for p in rest} <= {first.pass_index}
        out.append([first.task_id] + [p.task_id for p in rest])
    return out


def test_inclusion_follows_the_difficulty_weight():
    """With plain counts (decay 1), task i joins a pass with probability w_i / max w, where
    w = max(4 p (1 - p), min_weight) and p = (passes + 1) / (samples + 2): checked over 3000 seeded
    passes to 4.5 standard deviations; no task comes twice in a pass."""
    cfg = SamplerConfig(decay=1.0, retire_after=0, min_weight=0.05, seed=3)
    sampler = TaskSampler(IDS, cfg)
    outcomes = {"t0": (4, 8), "t1": (7, 8), "t2": (0, 8), "t3": (0, 100), "t4": (1, 2), "t5": (0, 0)}
    for task_id, (passes, samples) in outcomes.items():
        sampler.record(task_id, [1.0] * passes + [0.0] * (samples - passes))
    weight = {}
    for task_id, (passes, samples) in outcomes.items():
        p = (passes + 1) / (samples + 2)
        weight[task_id] = max(4 * p * (1 - p), 0.05)
    top = max(weight.values())
    assert min(weight.values()) == 0.05 and top == 1.0     # t3 sits on the floor; t4, t5 at p = 1/2

    passes = _passes(sampler, 3000)
    assert all(len(p) == len(set(p)) for p in passes)
    seen = Counter(t for p in passes for t in p)
    for task_id, w in weight.items():
        q = w / top
        sd = math.sqrt(q * (1 - q) / len(passes))
        assert abs(seen[task_id] / len(passes) - q) <= 4.5 * sd + 1e-12, (task_id, seen[task_id], q)
    # The order within a pass is a shuffle: each always-included task leads about half the passes.
    leads = Counter(p[0] for p in passes if {"t4", "t5"} <= set(p))
    assert abs(leads["t4"] - leads["t5"]) <= 4.5 * math.sqrt(leads["t4"] + leads["t5"])


def test_discounted_counts_follow_the_recent_samples():
    sampler = TaskSampler(["a"], SamplerConfig(decay=0.5, retire_after=0))
    sampler.record("a", [0.0, 0.0, 0.0, 1.0, 1.0])
    passes = 0.5 + 1.0            # the two recent passes, the older one halved
    samples = sum(0.5 ** k for k in range(5))
    assert sampler.stats["a"].pass_rate == pytest.approx((passes + 1) / (samples + 2))
    assert sampler.lifetime_pass_rate("a") == pytest.approx(2 / 5)


def test_retirement_after_a_solve_streak():
    sampler = TaskSampler(["easy", "hard"], SamplerConfig(retire_after=4, seed=0))
    sampler.record("easy", [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])        # a failure resets the streak
    assert not sampler.stats["easy"].retired
    sampler.record("easy", [1.0])
    assert sampler.stats["easy"].retired and sampler.active() == ["hard"]
    assert {p.task_id for p in sampler.draw(20)} == {"hard"}
    sampler.record("hard", [0.99] * 3 + [1.0] * 4)                      # below pass_threshold=1 is a fail
    assert sampler.stats["hard"].retired
    with pytest.raises(SamplerError, match="all 2 tasks are retired"):
        sampler.draw(1)


def test_a_retired_task_left_in_the_pass_is_skipped():
    sampler = TaskSampler(IDS, SamplerConfig(retire_after=1, seed=1))
    first = sampler.draw(1)[0]
    victim = sampler.pending[0]
    sampler.record(victim, [1.0])
    rest = sampler.draw(len(sampler.pending) - 1)
    assert victim not in {p.task_id for p in rest} and {p.pass_index for p in rest} == {first.pass_index}


def test_resume_continues_the_same_sequence_without_redrawing():
    """Save mid-pass through JSON; the restored sampler draws exactly what the original draws next (with
    the same rollout results, retirements included), and no prompt consumed earlier in the pass comes
    back before the pass ends."""
    cfg = SamplerConfig(retire_after=3, seed=7)

    def run(sampler, n):
        out = []
        for _ in range(n):
            prompt = sampler.draw(1)[0]
            sampler.record(prompt.task_id, [float(prompt.draw % 3 != 0)] * 2)   # fixed outcomes per draw
            out.append(prompt)
        return out

    original = TaskSampler(IDS, cfg)
    consumed = run(original, 4)
    state = json.loads(json.dumps(original.state_dict()))
    restored = TaskSampler.from_state(state, IDS, cfg)
    ahead = run(original, 12)
    assert run(restored, 12) == ahead
    assert restored.state_dict() == original.state_dict()
    in_pass = {p.task_id for p in consumed if p.pass_index == consumed[-1].pass_index}
    assert in_pass and not in_pass & {p.task_id for p in ahead if p.pass_index == consumed[-1].pass_index}
    assert any(s.retired for s in original.stats.values())


def test_bad_sampler_inputs():
    with pytest.raises(SamplerError, match="task set is empty"):
        TaskSampler([])
    with pytest.raises(SamplerError, match="'a' appears more than once"):
        TaskSampler(["a", "b", "a"])
    with pytest.raises(ConfigError, match="config key 'decay'"):
        SamplerConfig(decay=0.0)
    state = TaskSampler(["a", "b"]).state_dict()
    with pytest.raises(SamplerError, match="task 'b' is not in the task set"):
        TaskSampler.from_state(state, ["a"])
    restored = TaskSampler.from_state(state, ["a", "b", "c"])          # a task added since the save
    assert restored.stats["c"].samples == 0
    with pytest.raises(SamplerError, match="'c' is already in the task set"):
        restored.add_tasks(["c"])


def test_tasks_added_during_the_run_join_the_next_pass():
    sampler = TaskSampler(["a"], SamplerConfig(retire_after=0, seed=2))
    sampler.record("a", [1.0] * 50)                                     # easy: rarely in a pass
    first = sampler.draw(1)[0]
    sampler.add_tasks(["new"])
    assert sampler.pending == [] and first.task_id == "a"              # the running pass is left as it was
    prompts = sampler.draw(6)
    complete = {p.pass_index for p in prompts} - {prompts[-1].pass_index}
    assert len(complete) >= 2                                            # passes of one or two tasks
    for index in complete:                                               # "new" once in every whole pass
        assert [p.task_id for p in prompts if p.pass_index == index].count("new") == 1


def test_groups_complete_drop_equal_rewards_and_feed_the_sampler():
    sampler = TaskSampler(["a", "b"], SamplerConfig(retire_after=0, seed=0))
    groups = GroupAssembler(3, sampler)
    pa, pb = sampler.draw(2)
    groups.open(pa)
    groups.open(pb)
    assert groups.add(pa, Sample(1.0, 1.0)) is None and groups.add(pb, Sample(0.5, 0.0)) is None
    assert groups.add(pa, Sample(0.0, 0.0)) is None
    group = groups.add(pa, Sample(1.0, 1.0))
    assert group.prompt == pa and group.rewards == [1.0, 0.0, 1.0]
    for _ in range(2):
        last = groups.add(pb, Sample(0.5, 0.0))
    assert last is None                                                  # all rewards equal: no signal
    assert groups.counts["complete"] == 2 and groups.counts["trainable"] == 1
    assert groups.counts["dropped_zero_variance"] == 1
    assert sampler.stats[pa.task_id].lifetime_samples == 3 and sampler.lifetime_pass_rate(pa.task_id) == 2 / 3
    assert sampler.stats[pb.task_id].lifetime_samples == 3 and sampler.lifetime_pass_rate(pb.task_id) == 0.0
    assert not groups.open_groups
    with pytest.raises(ValueError, match="already finished"):
        groups.add(pa, Sample(1.0, 1.0))


def test_equal_reward_groups_with_feedback_are_kept_for_self_distillation():
    sampler = TaskSampler(["a", "b"], SamplerConfig(retire_after=0, seed=0))
    groups = GroupAssembler(2, sampler, feedback=lambda sample: sample.rollout == "flagged")
    pa, pb = sampler.draw(2)
    groups.open(pa)
    groups.open(pb)
    assert groups.add(pa, Sample(0.0, 0.0, "flagged")) is None
    kept = groups.add(pa, Sample(0.0, 0.0, "clean"))                   # equal rewards, one flagged turn
    assert kept.feedback_only and kept.rewards == [0.0, 0.0]
    groups.add(pb, Sample(0.0, 0.0, "clean"))
    assert groups.add(pb, Sample(0.0, 0.0, "clean")) is None             # equal rewards, no feedback: dropped
    assert groups.counts["feedback_only"] == 1 and groups.counts["dropped_zero_variance"] == 1
    assert groups.counts["trainable"] == 0


def test_lost_rollouts_refill_then_drop():
    sampler = TaskSampler(["a", "b"], SamplerConfig(retire_after=0, seed=0))
    groups = GroupAssembler(3, sampler, on_lost="refill", max_refills=1)
    pa, pb = sampler.draw(2)
    groups.open(pa)
    assert groups.add(pa, Sample(1.0, 1.0)) is None
    assert groups.lost(pa) is True                                       # refill: one more rollout
    assert groups.add(pa, Sample(0.0, 0.0)) is None
    assert groups.add(pa, Sample(1.0, 1.0)).rewards == [1.0, 0.0, 1.0]
    groups.open(pb)
    assert groups.lost(pb) is True
    assert groups.add(pb, Sample(1.0, 1.0)) is None
    assert groups.lost(pb) is False                                      # past max_refills: dropped
    assert groups.add(pb, Sample(0.0, 0.0)) is None                      # its last rollout, ignored
    assert groups.counts == {"complete": 1, "trainable": 1, "dropped_zero_variance": 0, "dropped_lost": 1,
                             "lost_rollouts": 3, "refills": 2, "ignored": 1, "feedback_only": 0}
    assert sampler.stats[pb.task_id].lifetime_samples == 1               # the finished sample counts
    assert not groups.open_groups


def test_lost_rollout_with_drop_policy():
    sampler = TaskSampler(["a"], SamplerConfig(retire_after=0))
    groups = GroupAssembler(3, sampler, on_lost="drop")
    prompt = sampler.draw(1)[0]
    groups.open(prompt)
    assert groups.lost(prompt) is False
    assert groups.add(prompt, Sample(1.0, 1.0)) is None and groups.lost(prompt) is False
    assert groups.counts["dropped_lost"] == 1 and groups.counts["ignored"] == 1 and not groups.open_groups
    assert sampler.stats["a"].lifetime_samples == 0
    restored = GroupAssembler(3, sampler)
    restored.load_state(json.loads(json.dumps(groups.state_dict())))
    assert restored.counts == groups.counts


def test_pass_rates_written_to_task_json(tmp_path):
    dirs = {load_task(d).id: d for d in (write_example_task(tmp_path / f"task{i}", i) for i in range(3))}
    sampler = TaskSampler(dirs, SamplerConfig(retire_after=0))
    sampler.record("scaled-sum-0", [1.0, 0.0, 0.0, 1.0])
    sampler.record("scaled-sum-1", [0.0, 0.0])
    assert sampler.write_pass_rates(dirs) == 2
    assert load_task(dirs["scaled-sum-0"]).pass_rate == 0.5
    assert load_task(dirs["scaled-sum-1"]).pass_rate == 0.0
    assert load_task(dirs["scaled-sum-2"]).pass_rate is None             # never sampled: left as it was
