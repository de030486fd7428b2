"""One attempt of an evaluation: an agent plays a task once (composer_jax.agents.episode); its record
and transcript.

The transcript keeps the episode's ids with each turn's span, flags, decoded text and weight versions,
the behaviour log-probs, the grading and, for coding tasks, the agent's diff and lint findings, and,
when the environment records what commands open (`record_file_access`), the reward-hacking monitor's
report. An agent out of context ends the attempt unsolved and ungraded: reward 0, status 'context_full'.
"""

from __future__ import annotations

import time
from pathlib import Path

from composer_jax.agents.episode import play
from composer_jax.agents.protocol import Agent
from composer_jax.envs import Monitor, TokenEpisode
from composer_jax.eval.store import AttemptRecord, transcript_path, write_json

CONTEXT_FULL = "context_full"


def _transcript(agent: Agent, episode: TokenEpisode, info: dict, record: AttemptRecord,
                versions: list[list[int] | None]) -> dict:
    decode = agent.tokenizer.decode
    return {
        "task": record.task, "sample": record.sample, "seed": record.seed, "agent": agent.name,
        "reward": record.reward, "status": record.status,
        "turns": [{"start": t.start, "end": t.end, "text": decode(episode.tokens[t.start:t.end]),
                   "flags": [f.to_json() for f in t.flags], "hint": t.hint,
                   "versions": None if v is None else sorted(set(v))} for t, v in zip(episode.turns, versions)],
        "check": info.get("check"), "inspection": info.get("inspection"),
        "text": decode(episode.tokens), "tokens": list(episode.tokens), "logprobs": list(episode.logprobs),
    }


def run_attempt(agent: Agent, env, task, sample: int, seed: int, run_dir: Path) -> AttemptRecord:
    """Play `task` once with `agent` in `env` (CodingEnv or ToyEnv, speaking agent.fmt); write the
    transcript under run_dir and return the attempt's record (not yet appended)."""
    start = time.monotonic()
    key = f"{task.id}/{sample}"
    episode = TokenEpisode(env, agent.tokenizer)
    versions = []       # per turn, the weight version of each token (None: the agent does not say)
    try:
        play(agent, episode, task, key, sample, seed, versions)
    finally:
        agent.end_episode(key)
        if hasattr(env, "close"):   # a CodingEnv left mid-episode (out of context, an error) deletes its workspace
            env.close()
    info = episode.info
    status = CONTEXT_FULL if info.get("context_full") else (info.get("check") or {}).get("status", "ok")
    reward, turns = float(info["task_reward"]), info["turns"]
    lint = (info.get("inspection") or {}).get("lint")
    record = AttemptRecord(
        task=task.id, sample=sample, seed=seed, reward=reward, solved=reward == 1.0, turns=turns,
        generated_tokens=int(sum(episode.generated)), tool_calls=info["tool_calls"] + info["invalid_calls"],
        tool_errors=info["failed_calls"], lint_added=None if lint is None else lint["added"],
        status=status, wall_s=round(time.monotonic() - start, 3), transcript=transcript_path(task.id, sample))
    transcript = _transcript(agent, episode, info, record, versions)
    if getattr(getattr(env, "config", None), "record_file_access", False):
        workspace = env.sandbox.workspace_path or str(env.workspace)
        transcript["monitor"] = Monitor().check(episode.turns, workspace=workspace, packages=env.packages).to_json()
    path = run_dir / record.transcript
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, transcript, indent=None)
    return record
