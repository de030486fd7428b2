"""Flags (what went wrong in a turn) and hints (the short text a teacher sees before that turn).

Targeted feedback (Composer 2.5): for a flagged assistant turn, a hint describing the desired
improvement is inserted into the context before the turn; the policy with the hint is the teacher,
the policy without it the student (shared/reference/rl.md section 1.4). Each flag kind has one hint
builder; `hint_for(flags, ...)` joins the hints of a turn's flags into one text. The kinds:

    unknown_tool        a call of a tool the episode does not declare
    malformed_call      malformed JSON or call syntax
    invalid_arguments   missing, unexpected or mistyped arguments
    repeated_call       the same call with the same result several times running
    test_file_edit      a call that wrote to a test file
    output_limit        a tool output cut at the limit
    no_action           no tool call and no answer
    style               lint findings the turn's own edits added (envs.signals)
    communication       a final message that claims what did not happen, says nothing of the change, or
                        runs long
    redundant_call      a read, listing or search whose result the agent already had
    wrong_tool          `run` doing what a declared tool does (sed -i, echo > file, cat, ls, grep)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from composer_jax.envs import protocol

UNKNOWN_TOOL = "unknown_tool"
MALFORMED_CALL = "malformed_call"
INVALID_ARGUMENTS = "invalid_arguments"
REPEATED_CALL = "repeated_call"
TEST_FILE_EDIT = "test_file_edit"
OUTPUT_LIMIT = "output_limit"
NO_ACTION = "no_action"
STYLE = "style"
COMMUNICATION = "communication"
REDUNDANT_CALL = "redundant_call"
WRONG_TOOL = "wrong_tool"
FLAG_KINDS = (UNKNOWN_TOOL, MALFORMED_CALL, INVALID_ARGUMENTS, REPEATED_CALL, TEST_FILE_EDIT, OUTPUT_LIMIT,
              NO_ACTION, STYLE, COMMUNICATION, REDUNDANT_CALL, WRONG_TOOL)


@dataclasses.dataclass(frozen=True)
class Flag:
    kind: str          # one of FLAG_KINDS
    detail: str        # what happened, e.g. the parser's error message or the file edited

    def to_json(self) -> dict:
        return {"kind": self.kind, "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class HintContext:
    tool_names: Sequence[str]      # the tools of the environment (empty: it expects a plain answer)
    call_example: str              # one well-formed call in the episode's format
    max_output_chars: int = 0


def _tools(ctx: HintContext) -> str:
    return ", ".join(ctx.tool_names)


HINT_BUILDERS: dict[str, Callable[[Flag, HintContext], str]] = {
    UNKNOWN_TOOL: lambda f, c: f"Reminder: the available tools are {_tools(c)}; call only these.",
    MALFORMED_CALL: lambda f, c: f"Reminder: write each tool call exactly like {c.call_example} (valid JSON).",
    INVALID_ARGUMENTS: lambda f, c: f"Reminder: check the tool's arguments ({f.detail}).",
    REPEATED_CALL: lambda f, c: (f"Your last calls repeated one another with the same result ({f.detail}); "
                                 f"repeating it will not change that: try something different."),
    TEST_FILE_EDIT: lambda f, c: f"Do not edit the tests ({f.detail}); change the code so that they pass.",
    OUTPUT_LIMIT: lambda f, c: (f"Tool output is cut after {c.max_output_chars} characters: read line ranges or "
                                "narrow the command."),
    NO_ACTION: lambda f, c: (f"Reminder: answer with a tool call, e.g. {c.call_example}, and submit when done."
                             if c.tool_names else "Reminder: reply with the answer only."),
    # the details of these four are written to complete the sentence (envs.signals)
    STYLE: lambda f, c: f"Your edit added lint findings: {f.detail}; fix them.",
    COMMUNICATION: lambda f, c: f"Your final message {f.detail}.",
    REDUNDANT_CALL: lambda f, c: f"You already {f.detail}: use what you have instead of asking again.",
    WRONG_TOOL: lambda f, c: f"Use {f.detail} in run.",
}


def hint_for(flags: Sequence[Flag], ctx: HintContext) -> str:
    """The teacher's hint for a turn with these flags (one line per distinct flag kind); '' if none."""
    lines, seen = [], set()
    for flag in flags:
        if flag.kind not in seen:
            seen.add(flag.kind)
            lines.append(HINT_BUILDERS[flag.kind](flag, ctx))
    return "\n".join(lines)


_ERROR_FLAGS = {protocol.UNKNOWN_TOOL: UNKNOWN_TOOL, protocol.MALFORMED_JSON: MALFORMED_CALL,
                protocol.MALFORMED_CALL: MALFORMED_CALL, protocol.MISSING_ARGUMENT: INVALID_ARGUMENTS,
                protocol.UNEXPECTED_ARGUMENT: INVALID_ARGUMENTS, protocol.WRONG_TYPE: INVALID_ARGUMENTS}


def flags_for_errors(errors) -> list[Flag]:
    """One flag per parser error (envs.protocol.CallError), by kind."""
    return [Flag(_ERROR_FLAGS[e.kind], e.message) for e in errors]
