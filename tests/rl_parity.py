"""A test environment for the RL loop tests (in process, and run by the rollout engine process of
tests/test_rl_remote.py): a random byte-level model earns its reward about 1 time in 4, so groups carry
signal from the start; turns it does not reward are flagged (targeted feedback trains on them)."""

import dataclasses
import time

from composer_jax.envs import Flag, HintContext, get_format, toy_tasks
from composer_jax.envs.feedback import NO_ACTION, TEST_FILE_EDIT
from composer_jax.rl.task_sets import TaskSets


class ParityEnv:
    """Single turn: reward 1 when the answer's first character has an even code point (about 1 in 4
    for a random byte-level model), else 0 and the turn is flagged. Tasks whose id holds 'crash' raise in
    step(); 'hang' sleeps `hang_s` first (longer than the rollout timeout); 'cheat' edits a test file."""

    tools = ()

    def __init__(self, hang_s: float = 0.0):
        self.fmt, self.hang_s = get_format("plain"), hang_s

    @property
    def hint_context(self):
        return HintContext((), "")

    def reset(self, task):
        self.task = task
        return [{"role": "user", "content": task.prompt}]

    def step(self, text):
        if "crash" in self.task.id:
            raise RuntimeError("the environment crashed")
        if "hang" in self.task.id:
            time.sleep(self.hang_s)
        reward = float(bool(text) and ord(text[0]) % 2 == 0)
        flags = [] if reward else [Flag(NO_ACTION, "odd")]
        if "cheat" in self.task.id:       # what the reward-hacking monitor catches
            flags.append(Flag(TEST_FILE_EDIT, "tests/test_a.py"))
        return [], True, {"turn": 1, "flags": flags, "task_reward": reward, "turns": 1, "tool_calls": 0,
                          "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0}


def parity_tasks(crash_and_hang: bool = False, hang_s: float = 0.0) -> TaskSets:
    """Six tasks (`crash_and_hang`: the first three crash, hang and cheat)."""
    tasks = toy_tasks("copy", 6, seed=5, length=2)
    if crash_and_hang:
        tasks[0] = dataclasses.replace(tasks[0], id="crash-0")
        tasks[1] = dataclasses.replace(tasks[1], id="hang-1")
        tasks[2] = dataclasses.replace(tasks[2], id="cheat-2")
    return TaskSets({t.id: t for t in tasks}, [], lambda: ParityEnv(hang_s), "/workspace")
