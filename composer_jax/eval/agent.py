"""Agents: what writes the assistant turns of an evaluated episode.

An `Agent` is called once per assistant turn with the episode's token ids so far and returns the
turn's token ids (as a model would sample them, ending with the format's end-of-turn marker when it
stopped there). It owns the tokenizer and the tool-call format its turns are written in; the
environment renders prompts and observations with the same format and tokenizer (token-in,
token-out: composer_jax.envs.episode). Episodes of one evaluation run concurrently in worker threads,
so `turn` must be thread-safe; `end_episode` is called once per episode, however it ended.

`load_agent(spec, ...)` makes one from the MODEL argument of `composer-jax eval`: `scripted:PATH`,
fixed tool-call scripts per task (a JSON file, see `ScriptedAgent`) that test the evaluation itself,
or a model directory (Hugging Face, converted, or a training run) sampled by the inference engine
(`composer_jax.eval.engine_agent.EngineAgent`, imported only then: composer_jax.eval stays free of jax).

An agent whose context is used up raises `ContextFull` from `turn`: the attempt ends there, unsolved.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from composer_jax.data.tokenizer import ByteTokenizer, Tokenizer
from composer_jax.envs.protocol import FORMATS, ToolFormat, get_format
from composer_jax.eval.errors import EvalError

SCRIPTED = "scripted:"


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


def _turn_text(fmt: ToolFormat, turn, where: str) -> str:
    """A script turn -> assistant text: a string as is, a list of calls rendered in the format."""
    if isinstance(turn, str):
        return turn
    if not isinstance(turn, list):
        raise EvalError(f"{where}: a turn is a string (the assistant's text) or a list of tool calls, got "
                        f"{type(turn).__name__}")
    parts = []
    for i, call in enumerate(turn):
        if (not isinstance(call, dict) or set(call) - {"name", "arguments"} or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments", {}), dict)):
            raise EvalError(f'{where}[{i}]: a tool call is {{"name": "<tool>", "arguments": {{...}}}}, got '
                            f"{json.dumps(call)[:80]}")
        parts.append(fmt.render_call(call["name"], call.get("arguments", {}), i))
    return "".join(parts)


class ScriptedAgent:
    """Replays fixed turns per task from a JSON file:

        {"format": "plain",                       # optional: plain (default) or kimi
         "scripts": {"TASK_ID": [SCRIPT, ...]}}   # sample s plays SCRIPT number s % len(scripts)

    A SCRIPT is a list of turns; a turn is a list of tool calls {"name": ..., "arguments": {...}}
    (rendered in the format) or a string (the assistant's text as is, e.g. a toy task's answer or a
    malformed call). Token ids are bytes (a byte tokenizer). Deterministic, thread-safe.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.name, self.settings = f"{SCRIPTED}{path}", {}
        where = f"scripted agent file {path}"
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise EvalError(f"{where}: does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EvalError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("scripts"), dict) or set(spec) - {"format", "scripts"}:
            raise EvalError(f'{where}: expected {{"format": ..., "scripts": {{"TASK_ID": [SCRIPT, ...]}}}}')
        fmt = spec.get("format", "plain")
        if fmt not in FORMATS:
            raise EvalError(f"{where}: format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt, self.tokenizer = get_format(fmt), ByteTokenizer()
        self.scripts: dict[str, list[list[str]]] = {}
        for task, scripts in spec["scripts"].items():
            if not isinstance(scripts, list) or not scripts or not all(isinstance(s, list) for s in scripts):
                raise EvalError(f"{where}: scripts.{task} must be a non-empty list of scripts (lists of turns)")
            self.scripts[task] = [[_turn_text(self.fmt, turn, f"{where}: scripts.{task}[{s}][{t}]")
                                   for t, turn in enumerate(script)] for s, script in enumerate(scripts)]

    def turn(self, request: TurnRequest) -> AgentTurn:
        scripts = self.scripts.get(request.task)
        if scripts is None:
            raise EvalError(f"{self.name}: no script for task {request.task}")
        script = scripts[request.sample % len(scripts)]
        if request.turn >= len(script):
            raise EvalError(f"{self.name}: the script of task {request.task} sample {request.sample} has "
                            f"{len(script)} turns and the episode asks for turn {request.turn + 1} (end scripts "
                            "with a submit call)")
        return AgentTurn(self.tokenizer.encode(script[request.turn] + self.fmt.end_of_turn).tolist())

    def end_episode(self, episode: str) -> None:
        """Nothing to release: a script keeps no per-episode state."""


def load_agent(spec: str, *, temperature: float | None = None, overrides: Sequence[str] = ()) -> Agent:
    """The agent a MODEL argument names; `temperature` None: the agent's default.

    `scripted:PATH`: a ScriptedAgent (it does not sample: a temperature or settings are an error).
    Anything else is a model directory (a Hugging Face directory, a converted directory or a training
    run) sampled by the inference engine: an EngineAgent, configured by `overrides` (`key=value`:
    EngineAgentConfig fields, `model.KEY=VALUE` model config changes). Call its `close()` when done."""
    if spec.startswith(SCRIPTED):
        if temperature is not None:
            raise EvalError(f"MODEL {spec!r}: a scripted agent does not sample; --temperature does not apply")
        if overrides:
            raise EvalError(f"MODEL {spec!r}: a scripted agent takes no settings, got {' '.join(overrides)}")
        return ScriptedAgent(spec[len(SCRIPTED):])
    from composer_jax.eval.engine_agent import open_engine_agent   # jax: only for a model

    return open_engine_agent(spec, temperature=temperature, overrides=overrides)
