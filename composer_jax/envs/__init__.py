"""Agent environments: tool-call formats and parser, workspace tools, the coding env, toy text envs,
flags -> hints for targeted feedback, the signals Composer names (style, communication, effort, wrong
tool) and the lint they use, reward composition, token-level episodes, the reward-hacking monitor.
Host-side: uses `composer_jax.tasks` and `composer_jax.sandbox`, never jax."""

from composer_jax.envs.coding import CodingEnv, CodingEnvConfig
from composer_jax.envs.episode import TokenEpisode, Turn, rollout_fields, teacher_windows
from composer_jax.envs.feedback import FLAG_KINDS, HINT_BUILDERS, Flag, HintContext, hint_for
from composer_jax.envs.monitor import (DETECTORS, Monitor, MonitorConfig, Report, cut_examples, monitor_counts,
                                      write_examples)
from composer_jax.envs.protocol import (CallError, KimiFormat, ParsedTurn, PlainFormat, ToolCall, ToolFormat, ToolSpec,
                                        get_format, parse_turn)
from composer_jax.envs.rewards import EpisodeStats, RewardConfig, Schedule, compose_reward, length_penalty
from composer_jax.envs.tools import TOOL_NAMES, TOOLS, CallRecord, WorkspaceTools
from composer_jax.envs.toy import ToyEnv, ToyTask, toy_tasks

__all__ = ["DETECTORS", "FLAG_KINDS", "HINT_BUILDERS", "TOOLS", "TOOL_NAMES", "CallError", "CallRecord", "CodingEnv",
           "CodingEnvConfig", "EpisodeStats", "Flag", "HintContext", "KimiFormat", "Monitor", "MonitorConfig",
           "ParsedTurn", "PlainFormat", "Report", "RewardConfig", "Schedule", "TokenEpisode", "ToolCall", "ToolFormat",
           "ToolSpec", "ToyEnv", "ToyTask", "Turn", "WorkspaceTools", "compose_reward", "cut_examples", "get_format", "hint_for",
           "length_penalty", "monitor_counts", "parse_turn", "rollout_fields", "teacher_windows", "toy_tasks",
           "write_examples"]
