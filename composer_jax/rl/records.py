"""The RL run's metrics, built in one place: one record per trained step (RUN_DIR/metrics.jsonl: policy
version, staleness, the rollout statistics of its batch, the step's loss terms, timings, the overlap
of rollout and learning, the prompts trained on) and the run's summary (`composer-jax rl` prints it)."""

from __future__ import annotations

import time

import numpy as np

from composer_jax.rl.rollout import ProducedBatch


PAIRED = ("rollout", "learner")     # the sides whose common time is the overlap
SIDES = (*PAIRED, "learner_wait")   # learner_wait: the learner blocked on the next batch


class Overlap:
    """Time during which rollout production and learning both ran, and the time each side was busy (the
    learner's waits for a batch too), from `origin` on (the end of the first learner step, which
    compiles: the steady state). Each interval is clipped to the origin; a rollout or learner interval
    is intersected with the other side's intervals known when it arrives, so every pair counts once."""

    def __init__(self):
        self.sides: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
        self.both, self.origin = 0.0, None

    def _clip(self, interval: tuple[float, float]) -> tuple[float, float]:
        start = interval[0] if self.origin is None else max(interval[0], self.origin)
        return start, max(start, interval[1])

    def add(self, side: str, interval: tuple[float, float]) -> None:
        a, b = self._clip(interval)
        if side in PAIRED:
            other = self.sides[PAIRED[side == "rollout"]]
            self.both += sum(max(0.0, min(b, d) - max(a, c)) for c, d in other)
        self.sides[side].append((a, b))

    def start(self, origin: float) -> None:
        """Count from `origin` on (what was recorded before is clipped to it)."""
        known, self.origin = self.sides, origin
        self.sides, self.both = {side: [] for side in SIDES}, 0.0
        for side, intervals in known.items():
            for interval in intervals:
                self.add(side, interval)

    def fractions(self, now: float) -> dict[str, float]:
        """Of the wall time since the origin: both busy, rollout busy, learner busy, learner waiting."""
        wall = max(now - (self.origin if self.origin is not None else now), 1e-9)
        busy = {side: sum(b - a for a, b in intervals) / wall for side, intervals in self.sides.items()}
        return {"overlap_fraction": self.both / wall, "rollout_busy_fraction": busy["rollout"],
                "learner_busy_fraction": busy["learner"], "learner_wait_fraction": busy["learner_wait"]}


def engine_rates(metrics: dict) -> dict[str, float]:
    """The batch's share of engine slots busy over its decode steps and, with speculative decoding, the
    share of drafted tokens accepted and the tokens a busy slot emitted per decode step (1 + its accepted
    drafts: the speed-up in decode steps over plain decoding), from the producer's counts (which they
    replace); nothing when the batch came from an agent without an engine."""
    if "engine_slot_steps" not in metrics:
        return {}
    busy, offered = metrics.pop("engine_busy_slot_steps"), metrics.pop("engine_slot_steps")
    rates = {"engine_occupancy": busy / offered if offered else 0.0}
    if "engine_drafted" in metrics:
        drafted, accepted = metrics.pop("engine_drafted"), metrics.pop("engine_accepted")
        rates.update(speculative_acceptance_rate=accepted / drafted if drafted else 0.0,
                     speculative_tokens_per_step=1 + accepted / busy if busy else 1.0)
    return rates


def staleness(produced: ProducedBatch, version: int) -> np.ndarray:
    """Per trained row: the policy version `version` minus the oldest version among its tokens."""
    oldest = produced.row_versions[0]
    return version - oldest[oldest >= 0]


class RunRecords:
    """The records of a run from policy version `start` to `steps`: batches arrive (`arrived`: too stale
    ones are counted and dropped), steps are trained (`record`), and `summary` sums the run up."""

    def __init__(self, start: int, steps: int):
        self.start, self.steps, self.t_begin = start, steps, time.perf_counter()
        self.overlap, self.rewards, self.dropped_stale = Overlap(), [], 0
        self.waited_s = 0.0     # the learner's waits for batches since the last recorded step

    def arrived(self, produced: ProducedBatch, version: int, max_staleness: int,
                waited: tuple[float, float]) -> np.ndarray | None:
        """The staleness of a batch arriving at policy version `version` after the learner waited for it
        over the time.time() interval `waited`, or None when a row is older than `max_staleness` versions
        (the batch is dropped, never trained on)."""
        self.overlap.add("rollout", produced.busy)
        self.overlap.add("learner_wait", waited)
        self.waited_s += waited[1] - waited[0]
        stale = staleness(produced, version)
        if stale.size and stale.max() > max_staleness:
            self.dropped_stale += 1
            return None
        return stale

    def record(self, step: int, produced: ProducedBatch, stale: np.ndarray, metrics: dict,
               learner_s: tuple[float, float]) -> dict:
        """The record of step `step` (policy version `step`: trained on `produced` at version step - 1),
        whose learner ran over the time.time() interval `learner_s` with the host `metrics`."""
        began, ended = learner_s
        self.overlap.add("learner", learner_s)
        if step - 1 == self.start:
            self.overlap.start(ended)
        metrics, rollout = dict(metrics), dict(produced.metrics)
        metrics["batch_reward_mean"] = metrics.pop("reward_mean")   # padding rows included
        rollout.update(engine_rates(rollout))
        oldest = produced.row_versions[0]
        record = {"step": step, "policy_version": step, **rollout, **metrics,
                  "staleness_mean": float(stale.mean()) if stale.size else 0.0,
                  "staleness_max": float(stale.max()) if stale.size else 0.0,
                  "batch_version_min": float(oldest[oldest >= 0].min(initial=step - 1)),
                  "learner_s": ended - began, "learner_wait_s": self.waited_s,
                  "learner_tokens_per_s": metrics["tokens"] / max(ended - began, 1e-9),
                  **self.overlap.fractions(ended),
                  "dropped_stale_batches": float(self.dropped_stale),
                  "batch_draws": produced.draws,
                  "trained_draws": [p.draw for p in produced.trained],
                  "trained_tasks": [p.task_id for p in produced.trained],
                  "feedback_only_draws": produced.feedback_only}
        self.rewards.append(record.get("reward_mean", 0.0))
        self.waited_s = 0.0
        return record

    def summary(self, end_step: int) -> dict:
        """start_step, steps, end_step, wall_s, dropped_stale_batches, overlap_fraction,
        learner_wait_fraction and the mean reward of the first and the last fifth of the steps."""
        shares = self.overlap.fractions(time.time())
        out = {"start_step": self.start, "steps": self.steps, "end_step": end_step,
               "wall_s": time.perf_counter() - self.t_begin, "dropped_stale_batches": self.dropped_stale,
               "overlap_fraction": shares["overlap_fraction"], "learner_wait_fraction": shares["learner_wait_fraction"]}
        if self.rewards:
            fifth = max(1, len(self.rewards) // 5)
            out.update(first_fifth_reward=float(np.mean(self.rewards[:fifth])),
                       last_fifth_reward=float(np.mean(self.rewards[-fifth:])))
        return out
