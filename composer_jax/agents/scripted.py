"""The scripted agent: fixed tool-call scripts per task (a JSON file), which test an evaluation or a
rollout without a model. Deterministic and free of jax."""

from __future__ import annotations

import json
from pathlib import Path

from composer_jax.agents.errors import AgentError
from composer_jax.agents.protocol import AgentTurn, TurnRequest
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs.protocol import FORMATS, ToolFormat, get_format

SCRIPTED = "scripted:"   # the MODEL prefix that names a scripts file


def _turn_text(fmt: ToolFormat, turn, where: str) -> str:
    """A script turn -> assistant text: a string as is, a list of calls rendered in the format."""
    if isinstance(turn, str):
        return turn
    if not isinstance(turn, list):
        raise AgentError(f"{where}: a turn is a string (the assistant's text) or a list of tool calls, got "
                        f"{type(turn).__name__}")
    parts = []
    for i, call in enumerate(turn):
        if (not isinstance(call, dict) or set(call) - {"name", "arguments"} or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments", {}), dict)):
            raise AgentError(f'{where}[{i}]: a tool call is {{"name": "<tool>", "arguments": {{...}}}}, got '
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
            raise AgentError(f"{where}: does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AgentError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("scripts"), dict) or set(spec) - {"format", "scripts"}:
            raise AgentError(f'{where}: expected {{"format": ..., "scripts": {{"TASK_ID": [SCRIPT, ...]}}}}')
        fmt = spec.get("format", "plain")
        if fmt not in FORMATS:
            raise AgentError(f"{where}: format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt, self.tokenizer = get_format(fmt), ByteTokenizer()
        self.scripts: dict[str, list[list[str]]] = {}
        for task, scripts in spec["scripts"].items():
            if not isinstance(scripts, list) or not scripts or not all(isinstance(s, list) for s in scripts):
                raise AgentError(f"{where}: scripts.{task} must be a non-empty list of scripts (lists of turns)")
            self.scripts[task] = [[_turn_text(self.fmt, turn, f"{where}: scripts.{task}[{s}][{t}]")
                                   for t, turn in enumerate(script)] for s, script in enumerate(scripts)]

    def turn(self, request: TurnRequest) -> AgentTurn:
        scripts = self.scripts.get(request.task)
        if scripts is None:
            raise AgentError(f"{self.name}: no script for task {request.task}")
        script = scripts[request.sample % len(scripts)]
        if request.turn >= len(script):
            raise AgentError(f"{self.name}: the script of task {request.task} sample {request.sample} has "
                            f"{len(script)} turns and the episode asks for turn {request.turn + 1} (end scripts "
                            "with a submit call)")
        return AgentTurn(self.tokenizer.encode(script[request.turn] + self.fmt.end_of_turn).tolist())

    def end_episode(self, episode: str) -> None:
        """Nothing to release: a script keeps no per-episode state."""


