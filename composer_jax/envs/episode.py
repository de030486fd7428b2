"""Token-in, token-out episodes and their conversion into the RL step's batch fields.

`TokenEpisode` drives an environment (CodingEnv, ToyEnv) with token ids: `start(task)` returns the
prompt ids; `step(sampled_ids, logprobs)` appends the sampled ids *as sampled*, decodes a copy only to
parse the tool calls, and appends the observation's ids (each observation is encoded once). The
history is never decoded and re-encoded, so the trajectory holds exactly the tokens the policy
produced (re-tokenising can merge or split them differently).

`rollout_fields(...)` turns finished episodes into numpy arrays named and laid out like
`composer_jax.rl.batch.RolloutBatch` (teacher slots included: see that module's docstring), without
importing it (envs stay free of jax): `RolloutBatch(**rollout_fields(...))`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import numpy as np

from composer_jax.envs.feedback import Flag, hint_for
from composer_jax.envs.rewards import EpisodeStats, RewardConfig, compose_reward
from composer_jax.envs.signals import SIGNAL_COUNTS
from composer_jax.envs.tools import CallRecord


@dataclasses.dataclass(frozen=True)
class Turn:
    start: int                  # first generated token of the turn in the trajectory
    end: int                    # one past its last generated token
    flags: tuple[Flag, ...]
    hint: str                   # '' when not flagged
    calls: tuple[CallRecord, ...] = ()   # the tool calls the environment carried out (when it reports them)


class TokenEpisode:
    """`teach`: the flag kinds a turn's hint is made of (None: all); a turn flagged only with others keeps its
    flags (counted) and gets no hint, so no teacher window (rl.sd_flags)."""

    def __init__(self, env, tokenizer, *, rewards: RewardConfig = RewardConfig(), train_step: int = 0,
                 teach: Collection[str] | None = None):
        self.env, self.tokenizer, self.rewards, self.train_step = env, tokenizer, rewards, train_step
        self.teach = None if teach is None else frozenset(teach)
        self.fmt = env.fmt
        self.done = True

    def _append(self, text: str) -> np.ndarray:
        ids = np.asarray(self.tokenizer.encode(text), np.int32) if text else np.zeros(0, np.int32)
        self.tokens += ids.tolist()
        self.generated += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        return ids

    def start(self, task) -> np.ndarray:
        """Reset the env on `task`; the prompt ids int32[n], ending where the model writes its turn."""
        self.tokens, self.generated, self.logprobs, self.turns = [], [], [], []
        self.done, self.info = False, {}
        messages = self.env.reset(task)
        return self._append("".join(self._render(m) for m in messages) + self.fmt.generation_prompt())

    def _render(self, m: dict) -> str:
        return self.fmt.message(m["role"], m["content"], m.get("name"))

    def step(self, sampled_ids, logprobs=None) -> tuple[np.ndarray, bool, dict]:
        """Append one model turn (ids as sampled; logprobs of the behaviour policy, 0 if not given).
        Returns (the new non-generated ids to prefill, done, the env's info)."""
        if self.done:
            raise RuntimeError("step() after the episode ended: call start(task) first")
        ids = [int(i) for i in np.asarray(sampled_ids).reshape(-1)]
        lp = [0.0] * len(ids) if logprobs is None else [float(x) for x in np.asarray(logprobs).reshape(-1)]
        if len(lp) != len(ids):
            raise ValueError(f"{len(lp)} logprobs for {len(ids)} sampled ids")
        start = len(self.tokens)
        self.tokens += ids
        self.generated += [True] * len(ids)
        self.logprobs += lp
        text = self.tokenizer.decode(ids)  # a copy, only to parse: the history keeps `ids`
        message, ended, _ = text.partition(self.fmt.end_of_turn)
        observation, done, info = self.env.step(message)
        flags = tuple(info["flags"])
        taught = flags if self.teach is None else [f for f in flags if f.kind in self.teach]
        self.turns.append(Turn(start, len(self.tokens), flags, hint_for(taught, self.env.hint_context),
                               tuple(info.get("calls", ()))))
        tail = ("" if ended else self.fmt.end_of_turn) + self.fmt.turn_suffix
        if not done:
            tail += "".join(self._render(m) for m in observation) + self.fmt.generation_prompt()
        new = self._append(tail)
        self.done, self.info = done, info
        if done:
            self._finish()
        return new, done, info

    def cut(self) -> None:
        """End an episode whose context ran out before it did: unsolved and ungraded (task reward 0), its
        turns kept as they were played; `info["context_full"]` says so, and the calls the environment
        carried out are counted (a coding env keeps them in `stats`)."""
        counts = {"tool_calls": 0, "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0, "tests_failed_runs": 0,
                  **dict.fromkeys(SIGNAL_COUNTS.values(), 0), **getattr(self.env, "stats", {})}
        self.done, self.info = True, {"turns": len(self.turns), "task_reward": 0.0, "context_full": True, **counts}
        self._finish()

    def _finish(self) -> None:
        info = self.info
        # the signals' counts: from an environment that reads them (the coding env), else none
        stats = EpisodeStats(turns=info["turns"], generated_tokens=sum(self.generated), tool_calls=info["tool_calls"],
                             failed_calls=info["failed_calls"], malformed_turns=info["malformed_turns"],
                             **{key: info.get(key, 0) for key in SIGNAL_COUNTS.values()})
        self.reward_terms = compose_reward(info["task_reward"], stats, self.rewards, self.train_step)
        info["reward"] = self.reward_terms["total"]

    @property
    def reward(self) -> float:
        if not self.done or not hasattr(self, "reward_terms"):
            raise RuntimeError("the episode has not finished")
        return self.reward_terms["total"]

    def hint_ids(self, turn: Turn) -> np.ndarray:
        """The teacher's inserted tokens for a flagged turn (see ToolFormat.hint_insert)."""
        return np.asarray(self.tokenizer.encode(self.fmt.hint_insert(turn.hint)), np.int32)


def teacher_windows(ep: TokenEpisode, slots: int, window: int) -> tuple[list[tuple[Turn, np.ndarray, int]], int]:
    """The teacher windows of a finished episode: its first `slots` flagged turns whose hint leaves room in
    a window of `window` tokens, each (turn, hint ids, end) with `end` the turn's end cut to fit (end <
    turn.end: a cut window); and how many flagged turns got no window (no slot left, or no room)."""
    windows, left_out = [], 0
    for turn in (t for t in ep.turns if t.hint):
        hint = ep.hint_ids(turn)
        end = min(turn.end, turn.start + window - len(hint))
        if len(windows) == slots or end <= turn.start:
            left_out += 1
        else:
            windows.append((turn, hint, end))
    return windows, left_out


def rollout_fields(episodes: Sequence[TokenEpisode], group_ids: Sequence[int], *, seq_len: int, slots: int = 0,
                   window: int = 0) -> dict[str, np.ndarray]:
    """Finished episodes -> RolloutBatch fields (B = len(episodes), S = seq_len, K = slots, T = window).

    Rows: the trajectory then right padding. The first `slots` flagged turns of each row get a teacher
    slot (`teacher_windows`): the hint tokens, then the turn's tokens (cut to fit the window), mapped to
    their student positions. With slots = 0 there are no teacher fields.
    """
    if len(group_ids) != len(episodes):
        raise ValueError(f"{len(group_ids)} group ids for {len(episodes)} episodes")
    b = len(episodes)
    tokens = np.zeros((b, seq_len), np.int32)
    segments = np.zeros((b, seq_len), np.int32)
    generated = np.zeros((b, seq_len), bool)
    logprobs = np.zeros((b, seq_len), np.float32)
    rewards = np.zeros(b, np.float32)
    t_tokens = np.zeros((b, slots, window), np.int32)
    t_map = np.full((b, slots, window), -1, np.int32)
    for row, ep in enumerate(episodes):
        if not ep.done:
            raise ValueError(f"episode {row} has not finished")
        n = len(ep.tokens)
        if ep.info.get("context_full"):     # cut: the observation that filled the context may run past the row
            n = min(n, seq_len)
        if n > seq_len or any(ep.generated[n:]):
            raise ValueError(f"episode {row} has {len(ep.tokens)} tokens, more than seq_len={seq_len}")
        tokens[row, :n], segments[row, :n] = ep.tokens[:n], 1
        generated[row, :n], logprobs[row, :n] = ep.generated[:n], ep.logprobs[:n]
        rewards[row] = ep.reward
        for slot, (turn, hint, end) in enumerate(teacher_windows(ep, slots, window)[0]):
            t_tokens[row, slot, :len(hint) + end - turn.start] = np.concatenate([hint, tokens[row, turn.start:end]])
            t_map[row, slot, len(hint):len(hint) + end - turn.start] = np.arange(turn.start, end)
    positions = np.where(segments > 0, np.arange(seq_len)[None], 0).astype(np.int32)
    fields = dict(tokens=tokens, positions=positions, segment_ids=segments, generated=generated,
                  behaviour_logprobs=logprobs, rewards=rewards, group_ids=np.asarray(group_ids, np.int32))
    if slots:
        fields.update(teacher_tokens=t_tokens, teacher_map=t_map)
    return fields
