"""`RUN_DIR/rollouts.jsonl`: a few episodes of the RL run to read, what the policy actually writes.

Every `rl.log_rollouts_every` steps the loop appends three episodes of the step's batch, picked among
all its finished episodes (trained or not) by reward: the best (the highest reward; the last one of a
tie), the worst (the lowest; the first one of a tie, never the best one) and a random other one (from
the run's seed and the batch index, so a resumed run picks the same). The rollout side picks, decodes
and serializes them on the host while it produces the batch (`picked_lines`: in the producer thread or
the engine process, before the batch goes to the device), only for the batches of policy versions N-1,
2N-1, ... (trained at steps N, 2N, ...; a stale batch dropped before shifts them by one), so the
learner never waits for them: the loop only appends the lines (`RolloutLog`), and a resumed run first
cuts the lines after its checkpoint's step, as it cuts monitor.jsonl (`envs.cut_examples`). Each line
(one episode):

    step          the step that trained on the batch (its policy version)
    pick          'best', 'worst' or 'random'
    episode       'draw/sample': the prompt's draw number and the sample of its group
    task          the task id
    trained       whether its group was trained (groups with equal rewards and no hint are dropped)
    reward        the composed reward after the monitor (zeroed when flagged and monitor.zero_reward)
    reward_terms  its components as added to the total ('task', 'length', ...; 'total')
    task_reward   the environment's grade; context_full: the episode filled the context and was cut
    monitor       the reward-hacking monitor's report: {detectors, findings: [{detector, turn, tool,
                  evidence, source}]}
    text          the whole trajectory decoded with the run's tokenizer (its chat template included)
    tokens        its token ids, int[T]
    generated     1 where the policy sampled the token, 0 for prompt, template and tool output, int[T]
    versions      the policy version that sampled each token, -1 where none did (or the agent did
                  not say), int[T]
    conversation  the trajectory in pieces, in order: {by: 'environment' | 'policy', start, end (token
                  span), text (decoded)}; a policy piece is a turn: also turn (its index), flags
                  ([{kind, detail}]) and hint (the self-distillation teacher's; '' when not flagged)

`composer-jax rollouts RUN_DIR [--step N] [--best | --worst | --random] [--list]` shows them
(`render`, `summary_line`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from composer_jax.envs import cut_examples
from composer_jax.train.metrics import parse_lines

FILE = "rollouts.jsonl"


def pick(rewards: Sequence[float], seed: Sequence[int]) -> list[tuple[str, int]]:
    """(pick, index into `rewards`) of the best, the worst and a random other episode (fewer when there
    are fewer than three); `seed`: ints that fix the random one."""
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])     # stable: ties keep their order
    if not order:
        return []
    picks = [("best", order[-1])]
    if len(order) >= 2:
        picks.append(("worst", order[0]))
    if len(order) >= 3:
        rng = np.random.default_rng([x % 2**32 for x in seed])
        picks.append(("random", order[1 + int(rng.integers(len(order) - 2))]))
    return picks


def token_versions(generated: Sequence[bool], versions: Sequence[int]) -> list[int]:
    """Per token: the version that sampled it (`versions` holds one per generated token, in order), -1
    for a token not generated, or everywhere when `versions` does not cover every generated token."""
    out = [-1] * len(generated)
    if len(versions) == sum(map(bool, generated)):
        at = iter(versions)
        out = [int(next(at)) if g else -1 for g in generated]
    return out


def conversation(episode) -> list[dict]:
    """The pieces of a finished `envs.TokenEpisode`: environment spans between the policy's turns."""
    decode, tokens = episode.tokenizer.decode, episode.tokens

    def piece(by: str, start: int, end: int) -> dict:
        return {"by": by, "start": start, "end": end, "text": decode(tokens[start:end])}

    pieces, at = [], 0
    for index, turn in enumerate(episode.turns):
        if turn.start > at:
            pieces.append(piece("environment", at, turn.start))
        pieces.append({**piece("policy", turn.start, turn.end), "turn": index,
                       "flags": [f.to_json() for f in turn.flags], "hint": turn.hint})
        at = turn.end
    if at < len(tokens):
        pieces.append(piece("environment", at, len(tokens)))
    return pieces


def sample_record(pick_name: str, rollout, trained: bool) -> dict:
    """The line (without its step) of one `rl.rollout.Rollout`, decoded with its episode's tokenizer."""
    ep = rollout.episode
    tokens = [int(t) for t in ep.tokens]
    return {"pick": pick_name, "episode": rollout.key, "task": rollout.prompt.task_id, "trained": trained,
            "reward": float(rollout.reward), "reward_terms": {k: float(v) for k, v in ep.reward_terms.items()},
            "task_reward": float(ep.info.get("task_reward", 0.0)), "context_full": bool(ep.info.get("context_full")),
            "monitor": rollout.report.to_json(), "text": ep.tokenizer.decode(tokens), "tokens": tokens,
            "generated": [int(bool(g)) for g in ep.generated],
            "versions": token_versions(ep.generated, rollout.versions), "conversation": conversation(ep)}


def logs_batch(every: int, index: int) -> bool:
    """Whether the batch for policy version `index` is one whose episodes are logged (rl.log_rollouts_every)."""
    return every > 0 and (index + 1) % every == 0


def picked_lines(rollouts: Sequence, trained_keys: Iterable[str], seed: Sequence[int]) -> list[str]:
    """The lines, as JSON objects without their step, of the best, the worst and a random one of a
    batch's finished `rollouts` (rl.rollout.Rollout); `trained_keys`: the episode keys of its trained groups."""
    trained = set(trained_keys)
    return [json.dumps(sample_record(name, rollouts[i], rollouts[i].key in trained))
            for name, i in pick([x.reward for x in rollouts], seed)]


class RolloutLog:
    """Appends a step's picked episodes to RUN_DIR/rollouts.jsonl. A run that continues from its
    checkpoint at step `keep_through` first drops the lines after it (a fresh run passes -1: none kept),
    so the file holds each step's picks once. Without a `run_dir` (the processes other than 0 of a
    group) it writes nothing."""

    def __init__(self, run_dir: str | Path | None, keep_through: int):
        self.path = None if run_dir is None else Path(run_dir) / FILE
        if self.path is not None:
            cut_examples(self.path, keep_through)

    def write(self, step: int, lines: Sequence[str]) -> int:
        """Append `lines` (picked_lines's: their JSON objects get `step` first); how many."""
        if self.path is None or not lines:
            return 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(f'{{"step": {int(step)}, {line[1:]}\n' for line in lines))
        return len(lines)


def read_rollouts(run_dir: str | Path) -> list[dict]:
    """The lines of RUN_DIR/rollouts.jsonl (a line a kill cut short is skipped), in file order."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} an RL run directory that logs rollouts "
                                "(rl.log_rollouts_every > 0)?")
    return parse_lines(path)


def _cut(text: str, max_chars: int) -> str:
    """`text`, its middle cut out past `max_chars` characters (0: whole)."""
    if not max_chars or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[len(text) - half:]}"


def _policy_label(record: dict, piece: dict) -> str:
    versions = sorted({v for v in record["versions"][piece["start"]:piece["end"]] if v >= 0})
    label = f"policy, turn {piece['turn']}, {piece['end'] - piece['start']} tokens"
    if versions:
        label += f", version {versions[0]}" + (f"-{versions[-1]}" if len(versions) > 1 else "")
    flags = "; ".join(f"{f['kind']}: {f['detail']}" if f["detail"] else f["kind"] for f in piece["flags"])
    return label + (f"; flags: {flags}" if flags else "")


def summary_line(record: dict) -> str:
    """One line of a record: step, pick, reward, episode, task, trained, flagged turns, monitor."""
    flagged = sum(bool(p.get("flags")) for p in record["conversation"])
    detectors = ",".join(record["monitor"]["detectors"]) or "-"
    return (f"step {record['step']:>5}  {record['pick']:<6}  reward {record['reward']:+.3f}  "
            f"episode {record['episode']:<8}  task {record['task']}  {'' if record['trained'] else 'not '}trained"
            f"  flagged turns {flagged}  monitor {detectors}")


def render(record: dict, max_chars: int = 2000) -> str:
    """A record for the terminal: its header (step, pick, reward and its nonzero terms, the monitor's
    findings), then the conversation, each piece under a rule naming who wrote it (the policy's turns
    with their versions, flags and hint); environment pieces are cut to `max_chars` (0: whole), blank
    ones left out, and the newlines around each piece dropped."""
    terms = ", ".join(f"{k} {v:+.3f}" for k, v in record["reward_terms"].items() if k != "total" and v)
    lines = [f"=== {summary_line(record)}", f"reward {record['reward']:+.3f} ({terms or 'every term 0'}), task reward "
             f"{record['task_reward']:.3f}" + ("; cut: the context was full" if record["context_full"] else "")]
    lines += [f"monitor: {f['detector']} at turn {f['turn']} ({f['tool'] or 'flag'}, {f['source']}): {f['evidence']}"
              for f in record["monitor"]["findings"]]
    for piece in record["conversation"]:
        text = piece["text"].strip("\n")
        if piece["by"] == "policy":
            lines += [f"--- {_policy_label(record, piece)}", text]
            lines += [f"--- hint: {piece['hint']}"] if piece["hint"] else []
        elif text.strip():
            lines += ["--- environment", _cut(text, max_chars)]
    return "\n".join(lines)
