"""Reward composition: task reward plus auxiliary terms whose weights may change by training step.

R = task_reward - w_fail * failed_calls + w_format * well_formed_fraction - w_len * C(x)
    - w_style * style_findings - w_communication * communication_issues - w_effort * redundant_calls
    - w_wrong_tool * wrong_tool_calls
with the concave length penalty C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)) (Composer 2 report, via
shared/reference/rl.md section 1.2; its q -> 1 limit is log(1 + k x) / k), where x weighs generated
tokens, tool calls and turns; the last four terms count the signals Composer names (envs.signals).
Weights are `Schedule`s: rules are adjusted as new behaviours appear, so a weight can switch on (or
change) at a given training step.

`RewardConfig` is a typed config like the others (`composer_jax.config.from_dict` reads it from YAML):
a weight is a number or a list of [step, value] pairs; an unknown component (`rewards.tone_weight`)
or a bad value is a `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from composer_jax.config import ConfigError


class RewardConfigError(ConfigError):
    """A reward setting is invalid; `key` names it (from_dict prefixes the section's path)."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A piecewise-constant weight: `points` = ((from_step, value), ...) sorted by step; before the first
    point the weight is 0. Schedule.constant(w) is w from step 0."""

    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        steps = [s for s, _ in self.points]
        if steps != sorted(set(steps)) or any(s < 0 for s in steps):
            raise RewardConfigError("", f"schedule steps must be distinct, sorted and >= 0, got {steps}")
        if not all(math.isfinite(v) for _, v in self.points):
            raise RewardConfigError("", f"schedule values must be finite, got {self.points}")

    @classmethod
    def constant(cls, value: float) -> Schedule:
        return cls(((0, float(value)),))

    @classmethod
    def from_config(cls, value, key: str) -> Schedule:
        """A number (constant from step 0), a list of [step, value] pairs, or the {"points": ...} form a
        saved config holds; RewardConfigError names `key`. (`composer_jax.config` reads Schedule
        fields through this.)"""
        if isinstance(value, Schedule):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls.constant(value)
        if isinstance(value, dict) and set(value) == {"points"}:
            value = value["points"]
        try:
            points = tuple((int(s), float(v)) for s, v in value)
        except (TypeError, ValueError):
            raise RewardConfigError(key, f"expected a number or [[step, value], ...], got {value!r}") from None
        try:
            return cls(points)
        except RewardConfigError as e:
            raise RewardConfigError(key, e.detail) from None

    def __call__(self, step: int) -> float:
        i = bisect.bisect_right([s for s, _ in self.points], step) - 1
        return self.points[i][1] if i >= 0 else 0.0


def length_penalty(x: float, k: float, q: float) -> float:
    """C_{k,q}(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); log(1 + k x) / k at q = 1. Concave in x for q > 0."""
    if k <= 0 or x < 0:
        raise ValueError(f"length penalty needs k > 0 and x >= 0, got k={k}, x={x}")
    if abs(1 - q) < 1e-12:
        return math.log1p(k * x) / k
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
    """What the auxiliary terms look at, counted over one episode."""

    turns: int = 0
    generated_tokens: int = 0
    tool_calls: int = 0
    failed_calls: int = 0        # calls that did not parse or validate, or that failed when carried out
    malformed_turns: int = 0     # turns with a call that did not parse or validate
    style_findings: int = 0      # lint findings the agent's edits added
    communication_issues: int = 0    # what is wrong with the final message
    redundant_calls: int = 0     # reads, listings and searches whose result the agent already had
    wrong_tool_calls: int = 0    # `run` commands doing a declared tool's job


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    failed_call_weight: Schedule = Schedule()
    format_weight: Schedule = Schedule()
    length_weight: Schedule = Schedule()
    style_weight: Schedule = Schedule()
    communication_weight: Schedule = Schedule()
    effort_weight: Schedule = Schedule()
    wrong_tool_weight: Schedule = Schedule()
    length_k: float = 1e-3
    length_q: float = 0.5
    # x = length_tokens * generated tokens + length_calls * tool calls + length_turns * turns
    length_tokens: float = 1.0
    length_calls: float = 0.0
    length_turns: float = 0.0

    def __post_init__(self):
        for name in ("failed_call_weight", "format_weight", "length_weight", "style_weight", "communication_weight",
                     "effort_weight", "wrong_tool_weight"):
            object.__setattr__(self, name, Schedule.from_config(getattr(self, name), name))
        if not self.length_k > 0:
            raise RewardConfigError("length_k", f"must be > 0, got {self.length_k}")
        if not self.length_q >= 0:
            raise RewardConfigError("length_q", f"must be >= 0, got {self.length_q}")
        for name in ("length_tokens", "length_calls", "length_turns"):
            if not getattr(self, name) >= 0:
                raise RewardConfigError(name, f"must be >= 0, got {getattr(self, name)}")


def compose_reward(task_reward: float, stats: EpisodeStats, config: RewardConfig, step: int = 0) -> dict[str, float]:
    """{'task', 'failed_calls', 'format', 'length', 'style', 'communication', 'effort', 'wrong_tool', 'total'}:
    each term as added to the total."""
    x = (config.length_tokens * stats.generated_tokens + config.length_calls * stats.tool_calls
         + config.length_turns * stats.turns)
    well_formed = 1.0 - stats.malformed_turns / stats.turns if stats.turns else 1.0
    terms = {
        "task": float(task_reward),
        "failed_calls": -config.failed_call_weight(step) * stats.failed_calls,
        "format": config.format_weight(step) * well_formed,
        "length": -config.length_weight(step) * length_penalty(x, config.length_k, config.length_q),
        "style": -config.style_weight(step) * stats.style_findings,
        "communication": -config.communication_weight(step) * stats.communication_issues,
        "effort": -config.effort_weight(step) * stats.redundant_calls,
        "wrong_tool": -config.wrong_tool_weight(step) * stats.wrong_tool_calls,
    }
    terms["total"] = sum(terms.values())
    return terms
