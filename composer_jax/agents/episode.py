"""One episode: an agent plays a task, token-in token-out, with its seed.

The episode is a composer_jax.envs.TokenEpisode: the agent's ids go in as generated, observations are
encoded once, and the history is never re-tokenized. An agent out of context (`ContextFull`) ends the
episode there, unsolved (`TokenEpisode.cut`). Evaluation records each attempt (composer_jax.eval.attempt);
an RL rollout turns it into training rows (composer_jax.rl.rollout).
"""

from __future__ import annotations

import hashlib

from composer_jax.agents.protocol import Agent, ContextFull, TurnRequest
from composer_jax.envs import TokenEpisode


def attempt_seed(seed: int, task: str, sample: int) -> int:
    """The attempt's sampling seed: a function of the run seed, the task and the sample only (not of
    which worker runs it, or when)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{task}/{sample}".encode()).digest()[:4], "little")


def play(agent: Agent, episode: TokenEpisode, task, key: str, sample: int, seed: int, versions: list) -> None:
    """Start `episode` on `task` and let `agent` write its turns (as episode `key`) until it ends, or until
    the agent's context runs out (`ContextFull`: the episode is cut, unsolved: `TokenEpisode.cut`);
    appends each turn's per-token weight versions to `versions`. The caller ends the agent's episode."""
    new = episode.start(task).tolist()
    try:
        while not episode.done:
            turn = agent.turn(TurnRequest(key, task.id, sample, len(episode.turns), tuple(episode.tokens), new, seed))
            versions.append(turn.versions)
            new = episode.step(turn.tokens, turn.logprobs)[0].tolist()
    except ContextFull:
        episode.cut()
