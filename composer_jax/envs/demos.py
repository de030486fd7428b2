"""Agent demonstrations for SFT: `write_demos(TASKS_DIR, OUT.jsonl, DemoConfig())`.

For every task with a solution.patch, a scripted agent solves it in a CodingEnv, one call per turn:
run the tests (they fail), read the files the solution changes, apply it with `edit` calls (or
`write_file` where no unique `old` text exists), run the tests again (they pass), submit with a short
honest summary ("I implemented word_count in textkit.py; the tests pass.": the functions the solution
writes, and the tests only when they were run). The tool outputs are what the env really returned, and
a conversation is written only if the episode's task reward is 1 and no turn was flagged (but for
output cut at the limit, which a test run's output can be). Records are OpenAI-style chat (`tools`,
`messages` with `tool_calls`).

A share of the conversations (`hinted_share`) is "hinted": before one correct assistant turn they show
what targeted feedback's teacher sees there after a flagged mistake (no tool call, or an unknown tool):
an untrained empty assistant message (`"weight": 0`) and the hint as a system message. The mistake
itself is not in the conversation, so the tool outputs are the solve trajectory's.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import os
import random
import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path

from composer_jax import python_ast
from composer_jax.envs.coding import CodingEnv, CodingEnvConfig
from composer_jax.envs.feedback import NO_ACTION, OUTPUT_LIMIT, UNKNOWN_TOOL, Flag, flags_for_errors, hint_for
from composer_jax.envs.protocol import FORMATS, ToolCall, get_format, parse_turn
from composer_jax.envs.tools import TOOL_NAMES, WorkspaceTools
from composer_jax.envs.toy import FAMILIES, ToyEnv, toy_tasks
from composer_jax.sandbox import Sandbox, SandboxError, make_sandbox, run_parallel
from composer_jax.tasks import Task, copy_repo, is_test_file, load_task
from composer_jax.tasks.check import limits_for, tail
from composer_jax.tasks.workspace import apply_patch, repo_files, same_file

MISTAKES = (NO_ACTION, UNKNOWN_TOOL)   # hinted conversations alternate between these, in task order
UNKNOWN_TOOL_NAME = "open_file"
MAX_EDIT_CONTEXT = 10     # lines each side of a change; an `old` text not unique by then: write_file instead
MERGE_GAP = 2             # changes this few unchanged lines apart make one edit
READ_MARGIN = 5           # lines around a change read when the whole file does not fit in one output


class DemoError(ValueError):
    """Bad input to write_demos (tasks, settings, output path); the message names the culprit."""


class DemoSkip(Exception):
    """One task cannot be demonstrated; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    tools: tuple[str, ...] = TOOL_NAMES   # declared tools, as CodingEnvConfig.tools
    format: str = "plain"                 # tool-call format the env parses (envs.protocol.FORMATS)
    max_output_chars: int = 4000
    hinted_share: float = 0.25
    seed: int = 0
    workers: int = 1
    backend: str = "bwrap"

    def __post_init__(self):
        unknown = [t for t in self.tools if t not in TOOL_NAMES]
        problem = (f"unknown tool {', '.join(map(repr, unknown))}; the tools are {', '.join(TOOL_NAMES)}" if unknown
                   else "a tool is listed twice" if len(set(self.tools)) != len(self.tools)
                   else "must include submit (the agent ends its episode with it)" if "submit" not in self.tools
                   else "cannot express a solution: declare edit or write_file"
                   if not {"edit", "write_file"} & set(self.tools) else "")
        if problem:
            raise DemoError(f"--tools {','.join(self.tools)}: {problem}")
        if self.format not in FORMATS:
            raise DemoError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        for name, value, ok in (("max-output-chars", self.max_output_chars, self.max_output_chars >= 1),
                                ("workers", self.workers, self.workers >= 1),
                                ("hinted-share", self.hinted_share, 0 <= self.hinted_share <= 1)):
            if not ok:
                raise DemoError(f"--{name} {value!r} is out of range")

    def env_config(self, task: Task | None = None, turns: int = 0) -> CodingEnvConfig:
        """The env a demonstration is played in: room for every turn, and a `run` of the tests gets the
        task's own time limit."""
        base = CodingEnvConfig(max_output_chars=self.max_output_chars, tools=self.tools)
        wall = max(base.run_wall_s, task.timeout_s if task else 0)
        return dataclasses.replace(base, max_turns=max(base.max_turns, turns + 1), run_wall_s=wall,
                                   run_cpu_s=max(base.run_cpu_s, math.ceil(wall)))


@dataclasses.dataclass(frozen=True)
class DemoSummary:
    path: str
    written: int
    hinted: int
    skipped: tuple[tuple[str, str], ...]   # (task, reason)


@dataclasses.dataclass(frozen=True)
class FileChange:
    path: str                 # relative to repo/
    before: str | None        # None: the solution creates the file
    after: str | None         # None: the solution deletes it


# ------------------------------------------------------------------------------------------------
# the solution as tool calls


def _change_groups(before: str, after: str) -> list[tuple[int, int, int, int]]:
    """Line ranges (i1, i2, j1, j2) of before/after that differ, nearby changes merged."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    groups: list[tuple[int, int, int, int]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if groups and i1 - groups[-1][1] <= MERGE_GAP:
            groups[-1] = (groups[-1][0], i2, groups[-1][2], j2)
        else:
            groups.append((i1, i2, j1, j2))
    return groups


def edit_steps(before: str, after: str) -> list[tuple[str, str]] | None:
    """(old, new) pairs that, applied in order by the `edit` tool, turn `before` into `after`; each `old`
    occurs exactly once in the text at its step. None when some change needs more than MAX_EDIT_CONTEXT
    lines of context to be unique (or the file starts empty)."""
    current, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    steps, shift = [], 0
    for i1, i2, j1, j2 in _change_groups(before, after):
        start, end, text = i1 + shift, i2 + shift, "".join(current)
        for k in range(MAX_EDIT_CONTEXT + 1):
            lo, hi = max(start - k, 0), min(end + k, len(current))
            old = "".join(current[lo:hi])
            # count as the tool does, and the one occurrence must be this one (not an overlapping twin)
            if old and text.count(old) == 1 and text.find(old) == len("".join(current[:lo])):
                break
        else:
            return None
        steps.append((old, "".join(current[lo:start] + b[j1:j2] + current[end:hi])))
        current[start:end] = b[j1:j2]
        shift += (j2 - j1) - (i2 - i1)
    return steps


def _read_calls(tools: WorkspaceTools, change: FileChange) -> list[dict]:
    """read_file the whole file, or, when that output would be cut, the line ranges around each change."""
    if not tools.call(ToolCall("read_file", {"path": change.path}, "")).truncated:
        return [{"path": change.path}]
    windows: list[list[int]] = []
    lines = len(change.before.splitlines())
    for i1, i2, _, _ in _change_groups(change.before, change.after):
        start, end = max(1, i1 + 1 - READ_MARGIN), min(i2 + READ_MARGIN, lines)
        if windows and start <= windows[-1][1] + 1:
            windows[-1][1] = end
        else:
            windows.append([start, end])
    return [{"path": change.path, "start_line": s, "end_line": e} for s, e in windows]


def _change_calls(change: FileChange, tools: tuple[str, ...]) -> list[tuple[str, dict]]:
    if change.after is None:
        if "run" not in tools:
            raise DemoSkip(f"the solution deletes {change.path}: needs the run tool, not in --tools")
        return [("run", {"command": f"rm -- {shlex.quote(change.path)}"})]
    steps = edit_steps(change.before, change.after) if change.before and "edit" in tools else None
    if steps is not None:
        return [("edit", {"path": change.path, "old": old, "new": new}) for old, new in steps]
    if "write_file" not in tools:
        raise DemoSkip(f"{change.path}: no unique edit expresses the change, and write_file is not in --tools")
    return [("write_file", {"path": change.path, "content": change.after})]


def _written_functions(before: str, after: str) -> list[str]:
    """The functions (methods included) of `after` whose source is not in `before`, in source order."""
    def sources(text: str) -> list[tuple[str, str]]:
        nodes = [n for n in ast.walk(python_ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return [(n.name, ast.get_source_segment(text, n)) for n in sorted(nodes, key=lambda n: n.lineno)]
    try:
        old = {source for _, source in sources(before)}
        return list(dict.fromkeys(name for name, source in sources(after) if source not in old))
    except SyntaxError:
        return []


def summary_text(changes: list[FileChange], tested: bool) -> str:
    """The final message: what the solution does to each file, and that the tests pass when they were run."""
    parts = []
    for c in changes:
        functions = (_written_functions(c.before, c.after)
                     if c.path.endswith(".py") and c.before is not None and c.after is not None else [])
        parts.append(f"deleted {c.path}" if c.after is None else f"created {c.path}" if c.before is None
                     else f"implemented {', '.join(functions)} in {c.path}" if functions else f"changed {c.path}")
    return f"I {', '.join(parts)}" + ("; the tests pass." if tested else ".")


def solution_calls(task: Task, sandbox: Sandbox, config: DemoConfig) -> tuple[list[tuple[str, dict]], str]:
    """The solve trajectory's calls (tests, reads, the solution's edits, tests, submit) and the summary
    the submit turn carries."""
    tools = config.tools
    with tempfile.TemporaryDirectory(prefix=f"composer_jax-demo-{task.id}-") as tmp:
        before, after = copy_repo(task.repo, Path(tmp) / "before"), copy_repo(task.repo, Path(tmp) / "after")
        applied = apply_patch(sandbox, after, task.solution_patch, limits_for(task.timeout_s, sandbox))
        if not applied.ok:
            raise DemoSkip(f"solution.patch does not apply: {tail(applied.stderr)}")
        changes = _changes(task, before, after)
        reader = WorkspaceTools(before, sandbox, max_output_chars=config.max_output_chars)
        reads = [args for c in changes if c.before is not None and c.after is not None
                 for args in _read_calls(reader, c)] if "read_file" in tools else []
    tests = [("run", {"command": task.test_command})] if "run" in tools else []
    edits = [call for c in changes for call in _change_calls(c, tools)]
    calls = [*tests, *(("read_file", r) for r in reads), *edits, *tests, ("submit", {})]
    return calls, summary_text(changes, bool(tests))


def _changes(task: Task, before: Path, after: Path) -> list[FileChange]:
    """The non-test files the solution changes (grading restores the tests, so edits there count for nothing)."""
    changes = []
    for rel in sorted(repo_files(before) | repo_files(after)):
        old, new = before / rel, after / rel
        if is_test_file(rel, task.test_paths) or (old.is_symlink() or old.exists()) and same_file(old, new):
            continue
        if old.is_symlink() or new.is_symlink():
            raise DemoSkip(f"the solution changes the symlink {rel}")
        try:
            texts = [p.read_text(encoding="utf-8") if p.exists() else None for p in (old, new)]
        except UnicodeDecodeError:
            raise DemoSkip(f"the solution changes {rel}, which is not UTF-8 text") from None
        changes.append(FileChange(rel, *texts))
    return changes


# ------------------------------------------------------------------------------------------------
# playing and recording


def assistant_call(name: str, arguments: dict, index: int, text: str = "") -> dict:
    call = {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": text, "tool_calls": [call]}


def play(task: Task, calls: list[tuple[str, dict]], summary: str, sandbox: Sandbox, config: DemoConfig) -> dict:
    """Carry out `calls` in a CodingEnv, one per turn, the `submit` turn with the text `summary`; the solve
    record, if the episode earns reward 1 and no turn is flagged (but for output cut at the limit)."""
    fmt = get_format(config.format)
    with CodingEnv(sandbox, fmt, config.env_config(task, len(calls))) as env:
        messages = env.reset(task)[1:]   # the tools message becomes the record's `tools`
        info: dict = {}
        flagged = []            # (turn, name, flag): a demonstration must not show what a hint corrects
        for k, (name, arguments) in enumerate(calls):
            if env.done:
                raise DemoSkip(f"the episode ended after {k} of {len(calls)} calls")
            text = summary if name == "submit" else ""
            observation, done, info = env.step(text + fmt.render_call(name, arguments, k))
            flagged += [(k + 1, name, f) for f in info["flags"] if f.kind != OUTPUT_LIMIT]
            messages.append(assistant_call(name, arguments, k, text))
            if not done:
                if [m["role"] for m in observation] != ["tool"]:
                    raise DemoSkip(f"turn {k + 1} ({name}) did not get one tool result: {observation!r:.200}")
                messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": observation[0]["content"]})
        reward = info.get("task_reward")
        if reward != 1.0:
            check = info.get("check", {})
            why = check.get("detail") or f"failed {', '.join(check.get('failed', [])[:3]) or 'nothing'}"
            raise DemoSkip(f"the solve trajectory earns reward {reward} ({why})")
        if flagged:
            turn, name, flag = flagged[0]
            raise DemoSkip(f"turn {turn} ({name}) is flagged: {flag.kind}: {flag.detail}")
        return {"task": task.id, "kind": "solve", "tools": [t.schema() for t in env.tools], "messages": messages}


def mistake_hint(mistake: str, config: DemoConfig, index: int, sandbox: Sandbox) -> str:
    """The hint the env gives for a turn that makes `mistake` as call number `index`: the flags come from
    the same parser and feedback functions CodingEnv.step uses (neither mistake depends on earlier turns)."""
    fmt = get_format(config.format)
    env = CodingEnv(sandbox, fmt, config.env_config())   # never reset: only its tools and hint context
    text = mistake_text(mistake, config, index)
    parsed = parse_turn(text, fmt, env.tools)
    flags = flags_for_errors(parsed.errors) + ([] if parsed.attempted else [Flag(NO_ACTION, "no tool call")])
    return hint_for(flags, env.hint_context)


def mistake_text(mistake: str, config: DemoConfig, index: int) -> str:
    """The assistant text of a mistake: no tool call at all, or a call of a tool that does not exist."""
    if mistake == NO_ACTION:
        return ""
    return get_format(config.format).render_call(UNKNOWN_TOOL_NAME, {"path": "README.md"}, index)


def with_hint(record: dict, turn: int, hint: str) -> dict:
    """The record with the teacher's view inserted before assistant turn `turn` (0-based)."""
    messages = record["messages"]
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"][turn]
    inserted = [{"role": "assistant", "content": "", "weight": 0}, {"role": "system", "content": hint}]
    return {**record, "kind": "hinted", "messages": messages[:at] + inserted + messages[at:]}


def hinted_records(records: list[dict], config: DemoConfig, sandbox: Sandbox) -> list[dict]:
    """`hinted_share` of the records (chosen with the seed) made hinted, at a seeded turn each."""
    chosen = sorted(random.Random(config.seed).sample(range(len(records)), round(config.hinted_share * len(records))))
    out = list(records)
    for rank, i in enumerate(chosen):
        turns = sum(m["role"] == "assistant" for m in records[i]["messages"])
        turn = random.Random(f"{config.seed}:{records[i]['task']}").randrange(turns)
        hint = mistake_hint(MISTAKES[rank % len(MISTAKES)], config, turn, sandbox)
        out[i] = with_hint(records[i], turn, hint)
    return out


# ------------------------------------------------------------------------------------------------
# the command


def load_demo_tasks(tasks_dir: str | Path) -> tuple[list[Task], list[tuple[str, str]]]:
    """The tasks of TASKS_DIR (a directory of task dirs, or one task dir) that have a solution.patch, by id,
    and (name, reason) of those that have none."""
    root = Path(tasks_dir)
    if (root / "task.json").is_file():
        dirs = [root]
    elif root.is_dir():
        dirs = sorted(d for d in root.iterdir() if (d / "task.json").is_file())
    else:
        raise DemoError(f"TASKS_DIR {root}: does not exist or is not a directory")
    if not dirs:
        raise DemoError(f"TASKS_DIR {root}: no tasks in it (subdirectories holding a task.json)")
    missing = [(d.name, "no solution.patch") for d in dirs if not (d / "solution.patch").is_file()]
    tasks = sorted((load_task(d) for d in dirs if (d / "solution.patch").is_file()), key=lambda t: t.id)
    if not tasks:
        raise DemoError(f"TASKS_DIR {root}: none of its {len(dirs)} tasks has a solution.patch")
    return tasks, missing


def _output_path(out_path: str | Path) -> Path:
    """OUT, checked: a file path whose directory exists or can be made (it is made when writing)."""
    out = Path(out_path)
    if out.is_dir():
        raise DemoError(f"OUT {out}: is a directory (expected a .jsonl file path)")
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DemoError(f"OUT {out}: {existing} is not a writable directory")
    return out


def write_demos(tasks_dir: str | Path, out_path: str | Path, config: DemoConfig = DemoConfig(), *,
                sandbox: Sandbox | None = None, log: Callable[[str], None] | None = None) -> DemoSummary:
    """Play every task's solve trajectory (`workers` at once), keep those with reward 1, make a share of
    them hinted and write them to `out_path` (JSON lines, replaced atomically). `log`: one line per task
    skipped. DemoError when there is nothing to write."""
    out = _output_path(out_path)
    tasks, skipped = load_demo_tasks(tasks_dir)
    sandbox = sandbox or make_sandbox(config.backend)

    def solve(task: Task) -> dict | str:
        try:
            return play(task, *solution_calls(task, sandbox, config), sandbox, config)
        except (DemoSkip, SandboxError, OSError) as e:
            return str(e) or type(e).__name__

    records = []
    for task, result in zip(tasks, run_parallel(solve, tasks, config.workers), strict=True):
        if isinstance(result, dict):
            records.append(result)
        else:
            skipped.append((task.id, result))
            if log is not None:
                log(f"{task.id}: skipped: {result}")
    if not records:
        raise DemoError(f"TASKS_DIR {tasks_dir}: no task's solve trajectory earned reward 1 "
                        f"({'; '.join(f'{t}: {r}' for t, r in skipped[:3])})")
    records = hinted_records(records, config, sandbox)
    return _write_records(records, out, tuple(skipped))


def _write_records(records: list[dict], out: Path, skipped: tuple = ()) -> DemoSummary:
    """Write `records` as JSON lines to `out` (its directory made), replacing it atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with partial.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return DemoSummary(str(out), len(records), sum(r["kind"] == "hinted" for r in records), skipped)


WRONG_TOOL = "answer"    # the tool a toy recovery calls first: not declared (the env answers with the error)


def toy_demos(tasks, env: ToyEnv, hinted_share: float = 0.0, seed: int = 0, wrong_tool_share: float = 0.0) -> list[dict]:
    """One conversation per toy task answering it as `env` expects (a `submit` call with `use_tool`, else
    the answer alone); `hinted_share` of them show the teacher's view before the answer after a mistake
    the env flags (no answer; with the tool, also a call cut short), the mistakes taken in turn. With the
    tool, `wrong_tool_share` of the others first call a tool that does not exist (`answer`), get the
    env's error back and then submit (kind 'recovery'): a warm start that often makes this one mistake,
    which a retry repairs (the targeted-feedback experiment's behaviour). The hinted ones then take that
    call as a third mistake, so the hinted policy (the teacher) has learnt to read its hint."""
    tools = [t.schema() for t in env.tools]
    records = []
    for task in tasks:
        if env.use_tool:
            answer = assistant_call("submit", {"answer": task.answer}, 0)
        else:
            answer = {"role": "assistant", "content": task.answer}
        records.append({"task": task.id, "kind": "solve", "tools": tools,
                        "messages": [{"role": "user", "content": task.prompt}, answer]})
    chosen = sorted(random.Random(seed).sample(range(len(records)), round(hinted_share * len(records))))
    for rank, i in enumerate(chosen):
        demonstration = env.demonstration(tasks[i])
        mistakes = ["", demonstration[:len(demonstration) // 2]] if env.use_tool else [""]
        if wrong_tool_share:        # the teacher has seen the hint for the mistake the warm start makes
            mistakes.append(env.fmt.render_call(WRONG_TOOL, {"answer": tasks[i].answer}))
        mistake = mistakes[rank % len(mistakes)]
        env.reset(tasks[i])
        flags = env.step(mistake)[2]["flags"]
        records[i] = with_hint(records[i], 0, hint_for(flags, env.hint_context))
    if not 0 <= wrong_tool_share <= 1:
        raise DemoError(f"--wrong-tool-share must be in [0, 1], got {wrong_tool_share}")
    if wrong_tool_share and not env.use_tool:
        raise DemoError("--wrong-tool-share needs --use-tool (the mistake is a call to a tool that does not exist)")
    others = sorted(set(range(len(records))) - set(chosen))
    for i in sorted(random.Random(seed + 1).sample(others, min(round(wrong_tool_share * len(records)), len(others)))):
        wrong = assistant_call(WRONG_TOOL, {"answer": tasks[i].answer}, 0)
        env.reset(tasks[i])
        error = env.step(env.fmt.render_call(WRONG_TOOL, {"answer": tasks[i].answer}))[0][0]["content"]
        records[i] = {**records[i], "kind": "recovery",
                      "messages": [records[i]["messages"][0], wrong, {"role": "tool", "tool_call_id": "call_0",
                                                                     "content": error},
                                   assistant_call("submit", {"answer": tasks[i].answer}, 1)]}
    return records


def write_toy_demos(spec: str, out_path: str | Path, config: DemoConfig, *, count: int, length: int,
                    use_tool: bool, wrong_tool_share: float = 0.0) -> DemoSummary:
    """`toy_demos` of `count` tasks of the family `spec` names (`toy:add`), drawn with `config.seed`, to
    `out_path` (JSON lines, replaced atomically)."""
    family = spec.removeprefix("toy:")
    if family not in FAMILIES:
        raise DemoError(f"TASKS {spec!r}: toy tasks are toy:FAMILY, FAMILY one of {', '.join(FAMILIES)}")
    out = _output_path(out_path)
    tasks = toy_tasks(family, count, seed=config.seed, length=length)
    env = ToyEnv(get_format(config.format), use_tool, max_turns=2 if use_tool else 1)
    records = toy_demos(tasks, env, config.hinted_share, config.seed, wrong_tool_share)
    return _write_records(records, out)


def summary_line(summary: DemoSummary) -> str:
    skipped = "; ".join(f"{task} ({reason})" for task, reason in summary.skipped)
    return (f"{summary.written} conversations written ({summary.hinted} hinted), {len(summary.skipped)} tasks "
            f"skipped{': ' + skipped if skipped else ''}")
