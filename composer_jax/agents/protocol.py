"""The Agent protocol: what writes the assistant turns of an episode (evaluated, or an RL rollout).

An `Agent` is called once per assistant turn with the episode's token ids so far and returns the
turn's token ids (as a model would sample them, ending with the format's end-of-turn marker when it
stopped there). It owns the tokenizer and the tool-call format its turns are written in; the
environment renders prompts and observations with the same format and tokenizer (token-in,
token-out: composer_jax.envs.episode). Episodes run concurrently in worker threads, so `turn` must be
thread-safe; `end_episode` is called once per episode, however it ended.

An agent whose context is used up raises `ContextFull` from `turn`: the attempt ends there, unsolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs.protocol import ToolFormat


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    episode: str                 # unique within the evaluation: 'TASK/SAMPLE'
    task: str
    sample: int
    turn: int                    # 0 for the first assistant turn
    tokens: Sequence[int]        # the whole episode so far, ending where the assistant writes
    new_tokens: Sequence[int]    # its tail since this agent's last turn: the prompt, then each observation
    seed: int                    # the attempt's seed (the same for every turn of the episode)


@dataclasses.dataclass(frozen=True)
class AgentTurn:
    tokens: list[int]                   # the turn's ids as generated
    logprobs: list[float] | None = None  # behaviour log-probs, when the agent samples
    versions: list[int] | None = None   # per token, the version of the weights that produced it


class ContextFull(Exception):
    """Raised by `Agent.turn` when the episode has grown past the agent's context (no room left for a
    token): the attempt ends unsolved, recorded with status 'context_full'."""


class Agent(Protocol):
    name: str                    # what is evaluated (recorded in run.json, shown by `eval compare`)
    settings: dict               # how it generates (temperature, ...): recorded, must match on resume
    tokenizer: Tokenizer
    fmt: ToolFormat

    def turn(self, request: TurnRequest) -> AgentTurn: ...

    def end_episode(self, episode: str) -> None: ...
