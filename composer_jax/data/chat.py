"""The chat renderer: conversations (with tool calls) -> text -> tokens, in one of two chat formats.

One renderer serves every phase: SFT data (`tokenize_conversation`, loss on assistant tokens only), the
agent environments (composer_jax.envs renders prompts, tool results and hints with these methods),
evaluation, `composer-jax generate --chat`, and the chat template an export writes
(`ChatFormat.chat_template()`: transformers' `apply_chat_template` renders the same text).

- `plain`: ChatML, `<|im_start|>{role}\\n{content}<|im_end|>\\n`, tool calls written
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes / Qwen style); for tokenizers without
  Kimi's markers (byte-level, small BPE).
- `kimi`: Kimi K2's format, `<|im_user|>user<|im_middle|>...<|im_end|>`, tools declared as JSON in a
  `tool_declare` system message, calls as `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>` (IDX counts the calls of
  the conversation), results as `## Return of functions.NAME:IDX`. Every marker is one special token of a
  Kimi tokenizer (`format_for` picks kimi only then).

A conversation is what chat datasets hold (OpenAI's shape): `{"role", "content"}` messages, assistant
messages with optional `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments"}}]`,
arguments a JSON object or its text) and `weight` (0: not trained), tool messages with `tool_call_id`;
the declared tools (OpenAI function schemas) come beside the messages and are rendered first.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_CHARS = 2 * len("<|im_start|>assistant\n<|im_end|>\n")  # template text around one user + assistant turn


class ConversationError(ValueError):
    """A record is not a usable conversation; the message says why."""


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: dict | str       # a JSON object, or its text as written
    id: str = ""                # the record's id for the call (tool results name it)

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str
    calls: tuple[Call, ...] = ()
    name: str = ""              # tool results: the id of the call answered; system: an optional label
    trained: bool = False       # assistant messages with a weight other than 0


def signature(schema: dict) -> str:
    """'read_file(path: string, start_line?: integer)' of an OpenAI function schema."""
    f = schema.get("function", schema)
    params = f.get("parameters") or {}
    required = params.get("required") or []
    args = ", ".join(f"{n}{'' if n in required else '?'}: {p.get('type', '')}"
                     for n, p in (params.get("properties") or {}).items())
    return f"{f['name']}({args})"


class ChatFormat:
    """A chat template and its tool-call syntax (see the module docstring)."""

    name: str
    end_of_turn: str            # the marker that ends a message (sampling stops on it)
    turn_suffix: str            # template text after an assistant message's end marker
    markers: tuple[str, ...] = ()   # strings a tokenizer must make single tokens for this format

    def message(self, role: str, content: str, name: str | None = None) -> str:
        """One rendered message; `name`: the call id a tool result answers, or a system message's label."""
        raise NotImplementedError

    def generation_prompt(self) -> str:
        """The text after which the model writes its turn."""
        raise NotImplementedError

    def calls_text(self, calls: Sequence[Call]) -> str:
        """The tool calls of an assistant turn as the model writes them (ids already in this format)."""
        raise NotImplementedError

    def call_id(self, name: str, index: int) -> str:
        """The id this format gives the `index`-th call of a conversation."""
        raise NotImplementedError

    def tools_message(self, schemas: Sequence[dict]) -> dict:
        """The message that declares the tools (first in the conversation)."""
        raise NotImplementedError

    def chat_template(self) -> str:
        """A Jinja chat template (transformers' `apply_chat_template`) that renders as this class does."""
        raise NotImplementedError

    def assistant_text(self, content: str, calls: Sequence[Call] = ()) -> str:
        """An assistant turn's text before the end marker: its content, then its calls."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict, index: int = 0) -> str:
        """One call as the model should write it (scripted policies, demonstrations)."""
        return self.assistant_text("", [Call(name, arguments, self.call_id(name, index))])

    def hint_insert(self, hint: str) -> str:
        """The text a teacher sees right before a flagged turn (after the assistant header): the empty
        assistant message closed, the hint as a system message, a fresh assistant header."""
        return self.end_of_turn + self.turn_suffix + self.message("system", hint) + self.generation_prompt()


class PlainChat(ChatFormat):
    name, end_of_turn, turn_suffix = "plain", "<|im_end|>", "\n"

    def message(self, role, content, name=None):
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    def generation_prompt(self):
        return "<|im_start|>assistant\n"

    def call_id(self, name, index):
        return f"call_{index}"

    def calls_text(self, calls):
        return "\n".join(f'<tool_call>{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": '
                         f'{c.arguments_json()}}}</tool_call>' for c in calls)

    def assistant_text(self, content, calls=()):
        return "\n".join(part for part in (content, self.calls_text(calls)) if part)

    def tools_message(self, schemas):
        lines = [f"- {signature(s)}: {s.get('function', s).get('description', '')}" for s in schemas]
        return {"role": "system", "content": "Tools (call one as <tool_call>{\"name\": ..., \"arguments\": {...}}"
                                             "</tool_call>):\n" + "\n".join(lines)}

    def chat_template(self):
        return _PLAIN_TEMPLATE


class KimiChat(ChatFormat):
    name, end_of_turn, turn_suffix = "kimi", "<|im_end|>", ""
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    ROLE_TOKEN = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
                  "tool": "<|im_system|>"}
    markers = (SECTION_BEGIN, CALL_BEGIN, ARG_BEGIN, CALL_END, SECTION_END, "<|im_end|>", "<|im_middle|>",
               "<|im_system|>", "<|im_user|>", "<|im_assistant|>")

    def message(self, role, content, name=None):
        if role == "tool":  # tool results: a system message named `tool`, headed by the call id
            return f"<|im_system|>tool<|im_middle|>## Return of {name}\n{content}<|im_end|>"
        label = name if role == "system" and name else role   # e.g. the `tool_declare` system message
        return f"{self.ROLE_TOKEN[role]}{label}<|im_middle|>{content}<|im_end|>"

    def generation_prompt(self):
        return "<|im_assistant|>assistant<|im_middle|>"

    def call_id(self, name, index):
        return f"functions.{name}:{index}"

    def calls_text(self, calls):
        if not calls:
            return ""
        body = "".join(f"{self.CALL_BEGIN}{c.id}{self.ARG_BEGIN}{c.arguments_json()}{self.CALL_END}" for c in calls)
        return self.SECTION_BEGIN + body + self.SECTION_END

    def assistant_text(self, content, calls=()):
        return content + self.calls_text(calls)

    def tools_message(self, schemas):
        return {"role": "system", "name": "tool_declare",
                "content": json.dumps(list(schemas), separators=(",", ":"), ensure_ascii=False)}

    def chat_template(self):
        return _KIMI_TEMPLATE


FORMATS: dict[str, type[ChatFormat]] = {"plain": PlainChat, "kimi": KimiChat}


def get_chat_format(name: str) -> ChatFormat:
    if name not in FORMATS:
        raise ValueError(f"chat format {name!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def single_token_markers(tokenizer, fmt: ChatFormat) -> list[str]:
    """The markers of `fmt` that `tokenizer` does not encode as one id (empty: it can express `fmt`)."""
    return [m for m in fmt.markers if len(tokenizer.encode(m)) != 1]


def format_for(tokenizer, choice: str = "") -> str:
    """The chat format `choice` names, or kimi when every Kimi marker is one token of `tokenizer` (a Kimi
    checkpoint's), else plain. A choice of kimi for a tokenizer without its markers is a ValueError."""
    if choice:
        missing = single_token_markers(tokenizer, get_chat_format(choice))
        if missing:
            raise ValueError(f"chat format {choice!r} needs {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                             f"as single tokens, and tokenizer {tokenizer.name} splits them: use the plain format")
        return choice
    return "kimi" if not single_token_markers(tokenizer, KimiChat()) else "plain"


# -- conversations ---------------------------------------------------------------------------------------


def _call(raw, where: str, index: int) -> Call:
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ConversationError(f"{where}: a tool call is {{\"function\": {{\"name\", \"arguments\"}}}} or "
                                "{\"name\", \"arguments\"}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise ConversationError(f"{where}: arguments are not valid JSON ({e.msg})") from None
    elif not isinstance(args, dict):
        raise ConversationError(f"{where}: arguments must be a JSON object, got {type(args).__name__}")
    call_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else f"call_{index}"
    return Call(fn["name"], args, call_id)


def parse_messages(messages) -> list[Message]:
    """Chat-dataset messages as Messages; ConversationError says what is wrong. Tool results without a
    `tool_call_id` answer the calls before them in order."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("'messages' must be a non-empty list")
    out, calls, unanswered = [], 0, []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is not an object")
        if m.get("role") not in ROLES:
            raise ConversationError(f"message {i} has role {m.get('role')!r}, not one of {', '.join(ROLES)}")
        content = m.get("content")
        raw_calls = (m.get("tool_calls") or []) if m["role"] == "assistant" else []
        if content is None and raw_calls:
            content = ""
        if not isinstance(content, str):
            raise ConversationError(f"message {i} needs a string 'content'")
        if not isinstance(raw_calls, list):
            raise ConversationError(f"message {i}: 'tool_calls' must be a list")
        parsed = tuple(_call(c, f"message {i} tool call {k}", calls + k) for k, c in enumerate(raw_calls))
        calls += len(parsed)
        name = ""
        if m["role"] == "tool":
            name = m.get("tool_call_id") or (unanswered[0] if unanswered else "")
            unanswered = [c for c in unanswered if c != name]
        elif m["role"] == "system" and isinstance(m.get("name"), str):
            name = m["name"]
        unanswered += [c.id for c in parsed]
        trained = m["role"] == "assistant" and m.get("weight", 1) != 0
        out.append(Message(m["role"], content, parsed, name, trained))
    return out


def validate(messages) -> list[Message]:
    """`parse_messages`, and a ConversationError when no assistant turn is trained."""
    out = parse_messages(messages)
    if not any(m.trained and (m.content or m.calls) for m in out):
        raise ConversationError("no assistant message to train on")
    return out


def _format_ids(messages: Sequence[Message], fmt: ChatFormat) -> list[Message]:
    """The messages with every call id (and the tool results naming it) in the format's own form."""
    ids, k, out = {}, 0, []
    for m in messages:
        calls = []
        for c in m.calls:
            ids.setdefault(c.id, fmt.call_id(c.name, k))
            calls.append(dataclasses.replace(c, id=fmt.call_id(c.name, k)))
            k += 1
        name = ids.get(m.name, m.name) if m.role == "tool" else m.name
        out.append(dataclasses.replace(m, calls=tuple(calls), name=name))
    return out


def render(messages, fmt: ChatFormat | None = None, tools: Sequence[dict] = (),
           generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) pieces in `fmt` (default plain): the tool declaration, each
    message (an assistant turn's text and end marker trained when its weight is not 0), and optionally
    the generation prompt. The pieces joined are `fmt.chat_template()`'s rendering."""
    fmt = fmt or PlainChat()
    pieces = []
    if tools:
        declared = fmt.tools_message(tools)
        pieces.append((fmt.message(declared["role"], declared["content"], declared.get("name")), False))
    parsed = messages if messages and isinstance(messages[0], Message) else parse_messages(messages)
    for m in _format_ids(parsed, fmt):
        if m.role == "assistant":
            pieces += [(fmt.generation_prompt(), False),
                       (fmt.assistant_text(m.content, m.calls) + fmt.end_of_turn, m.trained),
                       (fmt.turn_suffix, False)]
        else:
            pieces.append((fmt.message(m.role, m.content, m.name or None), False))
    if generation_prompt:
        pieces.append((fmt.generation_prompt(), False))
    merged = []   # consecutive pieces of one kind are one span: each span is encoded whole
    for text, trained in pieces:
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        elif text:
            merged.append((text, trained))
    return merged


def tokenize_conversation(messages, encode: Callable[[str], np.ndarray], fmt: ChatFormat | None = None,
                          tools: Sequence[dict] = ()) -> tuple[np.ndarray, np.ndarray]:
    """messages -> (tokens int32[n], loss_mask int32[n]): 1 on trained assistant turns and their end marker.

    Each span of trained or untrained text is encoded on its own (so the mask is exact whatever the
    tokenizer), as an episode encodes its context and the model writes its turn. The mask marks tokens
    that are *targets* of training (the step predicts token i from tokens < i where loss_mask[i] is 1).
    """
    tokens, mask = [], []
    for text, trained in render(validate(messages), fmt, tools):
        ids = np.asarray(encode(text), np.int32)
        tokens.append(ids)
        mask.append(np.full(ids.shape, int(trained), np.int32))
    return np.concatenate(tokens), np.concatenate(mask)


# -- the same rendering as Jinja chat templates (written by `export` into tokenizer_config.json) -----------
# Tool results name the id the format gives their call (plain: none shown; kimi: functions.NAME:IDX, found
# by walking the earlier calls). `{% generation %}` marks the trained text (transformers' assistant mask).

_CALL_LOOKUP = """\
{%- set ns = namespace(k=0, found='') -%}
{%- for prev in messages[:loop.index0] -%}{%- if prev.role == 'assistant' and prev.tool_calls -%}
{%- for tc in prev.tool_calls -%}{%- if tc.id == message.tool_call_id and not ns.found -%}
{%- set ns.found = FORMAT_ID -%}{%- endif -%}{%- set ns.k = ns.k + 1 -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"""

_ARGS = "((f.arguments if f.arguments is string else (f.arguments | tojson)) if f.arguments is defined else '{}')"

_PLAIN_TEMPLATE = ("""\
{%- if tools -%}
{{- '<|im_start|>system\\nTools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>):' -}}
{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}
{%- set p = f.parameters if f.parameters is defined and f.parameters else {} -%}
{%- set req = p.required if p.required is defined and p.required else [] -%}
{%- set ns = namespace(sig='') -%}
{%- for n, prop in (p.properties.items() if p.properties is defined and p.properties else []) -%}
{%- set ns.sig = ns.sig ~ (', ' if not loop.first else '') ~ n ~ ('' if n in req else '?') ~ ': ' ~ (prop.type if prop.type is defined else '') -%}
{%- endfor -%}
{{- '\\n- ' ~ f.name ~ '(' ~ ns.sig ~ '): ' ~ (f.description if f.description is defined else '') -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- set ns = namespace(text=(message.content if message.content else '')) -%}
{%- for tc in (message.tool_calls if message.tool_calls else []) -%}{%- set f = tc.function if tc.function is defined else tc -%}
{%- set ns.text = ns.text ~ ('\\n' if ns.text else '') ~ '<tool_call>{"name": ' ~ (f.name | tojson) ~ ', "arguments": ' ~ ARGS ~ '}</tool_call>' -%}
{%- endfor -%}
{%- if message.weight is defined and message.weight == 0 -%}{{- ns.text ~ '<|im_end|>' -}}
{%- else -%}{% generation %}{{- ns.text ~ '<|im_end|>' -}}{% endgeneration %}{%- endif -%}
{{- '\\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}""").replace("ARGS", _ARGS)

_KIMI_TEMPLATE = ("""\
{%- if tools -%}
{{- '<|im_system|>tool_declare<|im_middle|>' ~ (tools | tojson(separators=(',', ':'))) ~ '<|im_end|>' -}}
{%- endif -%}
{%- set calls = namespace(k=0) -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- set ns = namespace(text=(message.content if message.content else '')) -%}
{%- if message.tool_calls -%}
{%- set ns.text = ns.text ~ '<|tool_calls_section_begin|>' -%}
{%- for tc in message.tool_calls -%}{%- set f = tc.function if tc.function is defined else tc -%}
{%- set ns.text = ns.text ~ '<|tool_call_begin|>functions.' ~ f.name ~ ':' ~ calls.k ~ '<|tool_call_argument_begin|>' ~ ARGS ~ '<|tool_call_end|>' -%}
{%- set calls.k = calls.k + 1 -%}
{%- endfor -%}
{%- set ns.text = ns.text ~ '<|tool_calls_section_end|>' -%}
{%- endif -%}
{%- if message.weight is defined and message.weight == 0 -%}{{- ns.text ~ '<|im_end|>' -}}
{%- else -%}{% generation %}{{- ns.text ~ '<|im_end|>' -}}{% endgeneration %}{%- endif -%}
{%- elif message.role == 'tool' -%}
LOOKUP
{{- '<|im_system|>tool<|im_middle|>## Return of ' ~ (ns.found if ns.found else (message.tool_call_id if message.tool_call_id is defined else '')) ~ '\\n' ~ message.content ~ '<|im_end|>' -}}
{%- else -%}
{%- set label = message.name if message.role == 'system' and message.name is defined and message.name else message.role -%}
{{- ('<|im_system|>' if message.role == 'system' else '<|im_user|>') ~ label ~ '<|im_middle|>' ~ message.content ~ '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}""").replace(
    "ARGS", _ARGS).replace("LOOKUP", _CALL_LOOKUP.replace(
        "FORMAT_ID", "'functions.' ~ (tc.function.name if tc.function is defined else tc.name) ~ ':' ~ ns.k"))
