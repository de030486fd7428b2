"""Tool calls: the tool specs, the two chat formats with their call parsers, and structured errors.

The formats render through composer_jax.data.chat (the one renderer: SFT data, environments, evaluation
and exported chat templates write the same text):
- `kimi`: Kimi K2's special-token format (for real checkpoints and their tokenizer, where each marker
  is one token id), as documented in moonshotai/Kimi-K2-Instruct docs/tool_call_guidance.md and parsed
  by vLLM's `KimiK2ToolParser` / sglang's `KimiK2Detector`:
      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
      <|tool_call_end|><|tool_calls_section_end|>
- `plain`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes / Qwen style) in ChatML, for
  tokenizers without Kimi's markers.

`parse_turn(text, fmt, tools)` returns the calls that validate against the tool specs and one
`CallError` per call that does not: unknown tool, malformed JSON or call syntax, missing or unexpected
arguments, wrong types. The parser only reads text: episode history stays token ids (envs/episode.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from composer_jax.data.chat import ChatFormat, KimiChat, PlainChat

UNKNOWN_TOOL, MALFORMED_JSON, MALFORMED_CALL = "unknown_tool", "malformed_json", "malformed_call"
MISSING_ARGUMENT, UNEXPECTED_ARGUMENT, WRONG_TYPE = "missing_argument", "unexpected_argument", "wrong_type"
JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}


@dataclasses.dataclass(frozen=True)
class Param:
    type: str                   # a JSON_TYPES key
    description: str
    required: bool = True


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, Param] = dataclasses.field(default_factory=dict)

    def signature(self) -> str:
        """'read_file(path: string, start_line?: integer)'."""
        args = ", ".join(f"{n}{'' if p.required else '?'}: {p.type}" for n, p in self.params.items())
        return f"{self.name}({args})"

    def schema(self) -> dict:
        """The OpenAI-style function schema (what Kimi's `tool_declare` message lists)."""
        properties = {n: {"type": p.type, "description": p.description} for n, p in self.params.items()}
        required = [n for n, p in self.params.items() if p.required]
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    call_id: str                # the format's id for this call (Kimi: functions.NAME:IDX)

    def key(self) -> str:
        """Canonical identity of the call (name + sorted arguments), to spot repeats."""
        return self.name + json.dumps(self.arguments, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class CallError:
    kind: str                   # UNKNOWN_TOOL, MALFORMED_JSON, MALFORMED_CALL, MISSING/UNEXPECTED_ARGUMENT, WRONG_TYPE
    message: str
    name: str | None = None     # the tool name, when it could be read
    call_id: str = ""


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    text: str                               # the message outside the tool calls
    calls: tuple[ToolCall, ...]
    errors: tuple[CallError, ...]

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


@dataclasses.dataclass(frozen=True)
class RawCall:
    name: str | None
    arguments: str              # JSON text as the model wrote it
    call_id: str
    error: CallError | None = None


class ToolFormat(ChatFormat):
    """A chat format (composer_jax.data.chat: the one renderer) plus the parser of its tool calls."""

    def tools_message(self, tools: Sequence[ToolSpec | dict]) -> dict:
        """The message that declares the tools (ToolSpecs or their schemas), first in the conversation."""
        return super().tools_message([t.schema() if isinstance(t, ToolSpec) else t for t in tools])

    def extract(self, text: str) -> tuple[str, list[RawCall]]:
        """(text outside the calls, the calls as written) of an assistant message."""
        raise NotImplementedError


class PlainFormat(ToolFormat, PlainChat):
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text):
        calls = []
        for i, m in enumerate(self._CALL.finditer(text)):
            body, call_id = m.group(1).strip(), f"call_{i}"
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                calls.append(RawCall(None, body, call_id, CallError(MALFORMED_JSON, f"tool call is not valid JSON: "
                                                                                  f"{e.msg} at char {e.pos}")))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or set(obj) - {"name", "arguments"}:
                calls.append(RawCall(None, body, call_id, CallError(
                    MALFORMED_CALL, 'a tool call is {"name": "<tool>", "arguments": {...}} and nothing else')))
                continue
            calls.append(RawCall(obj["name"], json.dumps(obj.get("arguments", {})), call_id))
        return self._CALL.sub("", text).strip(), calls


class KimiFormat(ToolFormat, KimiChat):
    # The singular `tool_call_section` spelling appears in the wild; a truncated turn may lack the end.
    _SECTION = re.compile(r"<\|tool_calls?_section_begin\|>(.*?)(?:<\|tool_calls?_section_end\|>|$)", re.DOTALL)
    _CALL = re.compile(r"<\|tool_call_begin\|>(.*?)(?:<\|tool_call_end\|>|(?=<\|tool_call_begin\|>)|$)", re.DOTALL)
    _ID = re.compile(r"(?:functions\.)?([A-Za-z_][\w.-]*):(\d+)")

    def extract(self, text):
        calls = []
        for section in self._SECTION.finditer(text):
            for m in self._CALL.finditer(section.group(1)):
                header, sep, args = m.group(1).partition(self.ARG_BEGIN)
                header = header.strip()
                ident = self._ID.fullmatch(header)
                if not sep or not ident:
                    calls.append(RawCall(None, args, header, CallError(
                        MALFORMED_CALL, f"a tool call is {self.CALL_BEGIN}functions.NAME:INDEX{self.ARG_BEGIN}"
                                        f"{{json}}{self.CALL_END}; got header {header[:40]!r}")))
                    continue
                calls.append(RawCall(ident.group(1), args.strip(), header))
        return self._SECTION.sub("", text).strip(), calls


FORMATS = {"plain": PlainFormat, "kimi": KimiFormat}


def get_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"tool-call format {name!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def _check_arguments(spec: ToolSpec, raw: RawCall) -> tuple[dict | None, CallError | None]:
    fail = lambda kind, msg: (None, CallError(kind, f"{spec.name}: {msg}", spec.name, raw.call_id))  # noqa: E731
    try:
        args = json.loads(raw.arguments) if raw.arguments.strip() else {}
    except json.JSONDecodeError as e:
        return fail(MALFORMED_JSON, f"arguments are not valid JSON: {e.msg} at char {e.pos}")
    if not isinstance(args, dict):
        return fail(MALFORMED_JSON, f"arguments must be a JSON object, got {type(args).__name__}")
    missing = [n for n, p in spec.params.items() if p.required and n not in args]
    if missing:
        return fail(MISSING_ARGUMENT, f"missing argument(s) {', '.join(missing)}; signature {spec.signature()}")
    unexpected = sorted(set(args) - set(spec.params))
    if unexpected:
        return fail(UNEXPECTED_ARGUMENT, f"unexpected argument(s) {', '.join(unexpected)}; signature "
                                         f"{spec.signature()}")
    for n, value in args.items():
        want = spec.params[n].type
        if not isinstance(value, JSON_TYPES[want]) or (want != "boolean" and isinstance(value, bool)):
            return fail(WRONG_TYPE, f"argument {n} must be of type {want}, got {type(value).__name__} {value!r:.40}")
    return args, None


def parse_turn(text: str, fmt: ToolFormat, tools: Sequence[ToolSpec]) -> ParsedTurn:
    """Split an assistant message into its text, the valid tool calls and the errors (in call order)."""
    by_name = {t.name: t for t in tools}
    rest, raws = fmt.extract(text)
    calls, errors = [], []
    for raw in raws:
        if raw.error is not None:
            errors.append(raw.error)
        elif raw.name not in by_name:
            errors.append(CallError(UNKNOWN_TOOL, f"unknown tool {raw.name!r}; available: {', '.join(by_name)}",
                                    raw.name, raw.call_id))
        else:
            args, error = _check_arguments(by_name[raw.name], raw)
            if error:
                errors.append(error)
            else:
                calls.append(ToolCall(raw.name, args, raw.call_id))
    return ParsedTurn(rest, tuple(calls), tuple(errors))
