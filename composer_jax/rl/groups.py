"""Rollout groups: G samples per drawn prompt, assembled as they finish (host-side: no jax).

    groups = GroupAssembler(group_size=G, sampler=sampler, on_lost="refill", max_refills=2)
    for prompt in sampler.draw(n):
        groups.open(prompt)                        # then start G rollouts of prompt.task_id
    ...
    group = groups.add(prompt, Sample(reward, task_reward, episode))   # a full group with signal, or None
    again = groups.lost(prompt)                    # an environment failure: True = run one more rollout

Rules:
- a group is complete with G samples; its task rewards go to the sampler (pass rates, retirement);
- a complete group whose rewards are all equal has zero advantage everywhere (no policy-gradient
  signal): it is dropped and counted (`dropped_zero_variance`), unless `feedback` is given and one of
  its samples carries targeted feedback (`feedback(sample)`: a flagged turn with a hint). Then it is
  returned with `feedback_only=True` and counted (`feedback_only`): the step's self-distillation term
  still trains on its flagged turns (its advantages are zero). A policy that always fails the same way
  gets its signal from the hints alone;
- a lost rollout (the environment crashed or hung) refills its group (`on_lost="refill"`: `lost`
  returns True and the caller runs one more rollout of the prompt), at most `max_refills` times per
  group; past that, or with `on_lost="drop"`, the group is dropped and counted (`dropped_lost`), the
  task rewards of its finished samples still go to the sampler, and its samples still in flight are
  ignored when they arrive. A lost rollout never raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from composer_jax.rl.sampler import Prompt, TaskSampler

COUNTS = ("complete", "trainable", "dropped_zero_variance", "dropped_lost", "lost_rollouts", "refills", "ignored",
          "feedback_only")


@dataclasses.dataclass(frozen=True)
class Sample:
    reward: float          # the composed reward (what the advantage uses)
    task_reward: float     # the environment's task reward (what the pass rate counts)
    rollout: Any = None    # the finished episode, for the batch builder


@dataclasses.dataclass(frozen=True)
class Group:
    prompt: Prompt
    samples: tuple[Sample, ...]
    feedback_only: bool = False    # equal rewards: trained for its self-distillation term alone

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclasses.dataclass
class _Open:
    prompt: Prompt
    samples: list[Sample] = dataclasses.field(default_factory=list)
    refills: int = 0
    outstanding: int = 0   # rollouts started and not yet returned (sample or loss)
    dropped: bool = False


class GroupAssembler:
    def __init__(self, group_size: int, sampler: TaskSampler | None = None, *,
                 on_lost: Literal["refill", "drop"] = "refill", max_refills: int = 2,
                 feedback: Callable[[Sample], bool] | None = None):
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {group_size}")
        if on_lost not in ("refill", "drop") or max_refills < 0:
            raise ValueError(f"on_lost must be 'refill' or 'drop' and max_refills >= 0, got {on_lost!r}, "
                             f"{max_refills}")
        self.group_size, self.sampler = group_size, sampler
        self.on_lost, self.max_refills, self.feedback = on_lost, max_refills, feedback
        self.open_groups: dict[int, _Open] = {}
        self.counts = dict.fromkeys(COUNTS, 0)

    def open(self, prompt: Prompt) -> None:
        """Expect `group_size` rollouts of `prompt` (keyed by its draw number)."""
        if prompt.draw in self.open_groups:
            raise ValueError(f"draw {prompt.draw} ({prompt.task_id}) is already open")
        self.open_groups[prompt.draw] = _Open(prompt, outstanding=self.group_size)

    def _entry(self, prompt: Prompt) -> _Open:
        entry = self.open_groups.get(prompt.draw)
        if entry is None:
            raise ValueError(f"draw {prompt.draw} ({prompt.task_id}) was never opened or has already finished")
        entry.outstanding -= 1
        return entry

    def _close(self, entry: _Open) -> None:
        if entry.outstanding <= 0:
            del self.open_groups[entry.prompt.draw]

    def _record(self, entry: _Open) -> None:
        if self.sampler is not None and entry.samples:
            self.sampler.record(entry.prompt.task_id, [s.task_reward for s in entry.samples])

    def add(self, prompt: Prompt, sample: Sample) -> Group | None:
        """One finished rollout; returns the group when this completes it with some reward spread (or
        with equal rewards and targeted feedback: `feedback_only`)."""
        entry = self._entry(prompt)
        if entry.dropped:
            self.counts["ignored"] += 1
            self._close(entry)
            return None
        entry.samples.append(sample)
        if len(entry.samples) < self.group_size:
            return None
        self._close(entry)
        self.counts["complete"] += 1
        self._record(entry)
        group = Group(prompt, tuple(entry.samples))
        if max(group.rewards) == min(group.rewards):
            if self.feedback is not None and any(self.feedback(s) for s in group.samples):
                self.counts["feedback_only"] += 1
                return dataclasses.replace(group, feedback_only=True)
            self.counts["dropped_zero_variance"] += 1
            return None
        self.counts["trainable"] += 1
        return group

    def lost(self, prompt: Prompt) -> bool:
        """One rollout lost to an environment failure; True: run one more rollout of `prompt`."""
        entry = self._entry(prompt)
        self.counts["lost_rollouts"] += 1
        if entry.dropped:
            self._close(entry)
            return False
        if self.on_lost == "refill" and entry.refills < self.max_refills:
            entry.refills += 1
            entry.outstanding += 1
            self.counts["refills"] += 1
            return True
        entry.dropped = True
        self.counts["dropped_lost"] += 1
        self._record(entry)
        self._close(entry)
        return False

    def state_dict(self) -> dict:
        """The cumulative counts (groups in flight are not saved: their prompts count as consumed)."""
        return {"counts": dict(self.counts)}

    def load_state(self, state: dict) -> None:
        self.counts.update({k: int(v) for k, v in state["counts"].items() if k in self.counts})
