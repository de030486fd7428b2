"""Toy verifiable text tasks a tiny byte-level model can learn on a CPU, behind the env interface.

Short prompts and answers with an exact-match checker: `reverse` ("reverse abc" -> "cba"), `add`
("add 3 4" -> "7", single digits), `copy` ("copy abc" -> "abc"). `ToyEnv` is single-turn: the answer
is the whole assistant message, or, with `use_tool=True`, the `answer` argument of a `submit` call
(one tool, to train the call format). Reward 1 for an exact match, else 0.
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


class ToyEnv:
    def __init__(self, fmt: ToolFormat, use_tool: bool = False):
        self.fmt, self.use_tool = fmt, use_tool
        self.tools = (SUBMIT,) if use_tool else ()
        self.done = True

    @property
    def hint_context(self) -> HintContext:
        return HintContext(tuple(t.name for t in self.tools), self.fmt.render_call("submit", {"answer": "..."}))

    def demonstration(self, task: ToyTask) -> str:
        """The assistant message that solves `task` (a demonstration's answer: envs.demos.toy_demos)."""
        return self.fmt.render_call("submit", {"answer": task.answer}) if self.use_tool else task.answer

    def reset(self, task: ToyTask) -> list[dict]:
        self.task, self.done = task, False
        messages = [self.fmt.tools_message(self.tools)] if self.use_tool else []
        return messages + [{"role": "user", "content": task.prompt}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool, dict]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(task) first")
        self.done = True
        flags, failed = [], 0
        if self.use_tool:
            parsed = parse_turn(assistant_text, self.fmt, self.tools)
            flags, failed = flags_for_errors(parsed.errors), len(parsed.errors)
            answer = parsed.calls[0].arguments["answer"] if parsed.calls else None
        else:
            answer = assistant_text.strip() or None
        if answer is None and not flags:
            flags.append(Flag(NO_ACTION, "no answer"))
        reward = float(answer is not None and answer.strip() == self.task.answer)
        return [], True, {"turn": 1, "flags": flags, "task_reward": reward, "turns": 1,
                          "tool_calls": int(self.use_tool and answer is not None), "invalid_calls": failed,
                          "failed_calls": failed, "malformed_turns": int(bool(failed)),
                          **dict.fromkeys(SIGNAL_COUNTS.values(), 0)}
