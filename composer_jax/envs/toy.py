"""Toy verifiable text tasks a tiny byte-level model can learn on a CPU, behind the env interface.

Short prompts and answers with an exact-match checker: `reverse` ("reverse abc" -> "cba"), `add`
("add 3 4" -> "7", single digits), `copy` ("copy abc" -> "abc"). `ToyEnv`: the answer is the whole
assistant message (one turn), or, with `use_tool=True`, the `answer` argument of a `submit` call (one
tool, to train the call format). With the tool and `max_turns > 1`, a turn without a valid `submit`
call gets the parser's errors back (or a reminder) and the agent may try again: a tool-use task whose
mistakes can be recovered from, so they barely move the final reward. Reward 1 for an exact match,
else 0.
"""

from __future__ import annotations

import dataclasses
import random

from composer_jax.envs.feedback import NO_ACTION, Flag, HintContext, flags_for_errors
from composer_jax.envs.protocol import Param, ToolFormat, ToolSpec, parse_turn
from composer_jax.envs.signals import SIGNAL_COUNTS

SUBMIT = ToolSpec("submit", "Give the final answer.", {"answer": Param("string", "the answer")})
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(frozen=True)
class ToyTask:
    id: str
    prompt: str
    answer: str


def _letters(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(length))


def _reverse(rng, length):
    word = _letters(rng, length)
    return f"reverse {word}", word[::-1]


def _copy(rng, length):
    word = _letters(rng, length)
    return f"copy {word}", word


def _add(rng, length):
    a, b = rng.randrange(10), rng.randrange(10)
    return f"add {a} {b}", str(a + b)


FAMILIES = {"reverse": _reverse, "copy": _copy, "add": _add}


def toy_tasks(family: str, count: int, *, seed: int = 0, length: int = 3) -> list[ToyTask]:
    """`count` tasks of a family, reproducible from `seed`; `length`: letters per word."""
    if family not in FAMILIES:
        raise ValueError(f"toy task family {family!r} is not one of {', '.join(FAMILIES)}")
    if count < 0 or length < 1:
        raise ValueError(f"toy tasks need count >= 0 and length >= 1, got count={count}, length={length}")
    rng = random.Random(f"{family}-{seed}-{length}")
    return [ToyTask(f"{family}-{seed}-{i}", *FAMILIES[family](rng, length)) for i in range(count)]


NO_ANSWER_MESSAGE = "No submit call found. Answer with the submit tool."


class ToyEnv:
    def __init__(self, fmt: ToolFormat, use_tool: bool = False, max_turns: int = 1):
        if max_turns < 1 or (max_turns > 1 and not use_tool):
            raise ValueError(f"toy env: max_turns must be 1, or > 1 with use_tool (a retry after a bad call), got "
                             f"{max_turns} with use_tool={use_tool}")
        self.fmt, self.use_tool, self.max_turns = fmt, use_tool, max_turns
        self.tools = (SUBMIT,) if use_tool else ()
        self.done = True

    @property
    def hint_context(self) -> HintContext:
        return HintContext(tuple(t.name for t in self.tools), self.fmt.render_call("submit", {"answer": "..."}))

    def demonstration(self, task: ToyTask) -> str:
        """The assistant message that solves `task` (a demonstration's answer: envs.demos.toy_demos)."""
        return self.fmt.render_call("submit", {"answer": task.answer}) if self.use_tool else task.answer

    def reset(self, task: ToyTask) -> list[dict]:
        self.task, self.done, self.turn = task, False, 0
        self.stats = {"tool_calls": 0, "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0,
                      **dict.fromkeys(SIGNAL_COUNTS.values(), 0)}
        messages = [self.fmt.tools_message(self.tools)] if self.use_tool else []
        return messages + [{"role": "user", "content": task.prompt}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool, dict]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(task) first")
        self.turn += 1
        flags, observation = [], []
        if self.use_tool:
            parsed = parse_turn(assistant_text, self.fmt, self.tools)
            flags = flags_for_errors(parsed.errors)
            self.stats["invalid_calls"] += len(parsed.errors)
            self.stats["failed_calls"] += len(parsed.errors)
            self.stats["malformed_turns"] += bool(parsed.errors)
            observation = [{"role": "tool", "name": e.call_id, "content": f"error: {e.message}"} for e in parsed.errors]
            answer = parsed.calls[0].arguments["answer"] if parsed.calls else None
        else:
            answer = assistant_text.strip() or None
        if answer is None and not flags:
            flags.append(Flag(NO_ACTION, "no answer"))
            observation.append({"role": "user", "content": NO_ANSWER_MESSAGE})
        self.stats["tool_calls"] += int(self.use_tool and answer is not None)
        self.done = answer is not None or self.turn >= self.max_turns
        info = {"turn": self.turn, "flags": flags}
        if self.done:
            reward = float(answer is not None and answer.strip() == self.task.answer)
            info.update(task_reward=reward, turns=self.turn, **self.stats)
        return ([] if self.done else observation), self.done, info
