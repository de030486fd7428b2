"""The coding environment: the agent edits a copy of a task's repo with tools and is graded by tests.

    env = CodingEnv(Sandbox(), get_format("plain"))
    messages = env.reset(task)                       # tool declaration, instructions, the task
    observation, done, info = env.step(assistant_text)  # tool results as messages; flags; reward when done

A turn's tool calls are carried out in order (up to `submit`); parse errors become error results;
`info["calls"]` records each call carried out (`CallRecord`: name, arguments, output, ok, and the files a
`run` command opened, with `record_file_access`: the reward-hacking monitor reads them). A call
that cannot be carried out counts in `failed_calls` (envs.tools says which); a test run that reports
failures is a successful call, counted in `tests_failed_runs`. The same call with the same result
`repeat_limit` times running (parse errors included) is flagged once, as a loop. The signals
Composer names (envs.signals: style, communication, effort, wrong_tool) are counted in `stats` and,
those in `config.signals`, flagged; a turn flagged as a loop is not also flagged as redundant. The
episode ends at `submit` or after `max_turns`; the workspace is then graded with the task's tests
(restored first), `info["task_reward"]` holds the check's reward, and the workspace is deleted (after
`inspect(task, workspace)`, when given, has looked at it: what it returns is `info["inspection"]`, e.g.
lint findings of the agent's changes, composer_jax.agents.lint). An episode abandoned before its end
keeps its workspace until `close()`, the next `reset()`, or the end of a `with CodingEnv(...) as env:`
block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from composer_jax.envs.feedback import (COMMUNICATION, NO_ACTION, OUTPUT_LIMIT, REDUNDANT_CALL, REPEATED_CALL, STYLE,
                                     TEST_FILE_EDIT, WRONG_TOOL, Flag, HintContext, flags_for_errors)
from composer_jax.envs.lint import changed_files
from composer_jax.envs.protocol import ToolFormat, parse_turn
from composer_jax.envs.shell import runs_tests
from composer_jax.envs.signals import (SIGNAL_COUNTS, SIGNALS, SeenResults, added_findings, communication_issues,
                                       file_contents, python_edit_paths, style_detail, wrong_tool)
from composer_jax.envs.tools import TOOL_NAMES, TOOLS, CallRecord, WorkspaceTools
from composer_jax.sandbox import Sandbox
from composer_jax.sandbox.file_access import find_strace
from composer_jax.tasks import Task, check_task, copy_repo, is_test_file
from composer_jax.tasks.scrub import top_level_names

SYSTEM_PROMPT = ("You are a coding agent working in a repository. Use the tools to read and change the code so "
                 "that the task is done and its tests pass, then call submit.")
NO_ACTION_MESSAGE = "No tool call found. Call a tool (or submit when you are done)."
DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|sec|seconds)\b")   # timings: the same result, timed anew


# One well-formed call per tool that needs no knowledge of the repository: the hints' example, in this
# order of preference among the tools the episode declares (submit is always declared).
_EXAMPLE_CALLS = (("read_file", {"path": "README.md"}), ("list_dir", {}), ("run", {"command": "ls"}), ("submit", {}))


@dataclasses.dataclass(frozen=True)
class CodingEnvConfig:
    max_turns: int = 30
    max_output_chars: int = 4000        # per tool result
    run_wall_s: float = 30.0            # limits of one `run` command
    run_cpu_s: int = 30
    tools: tuple[str, ...] = TOOL_NAMES  # the tools declared and accepted (a shorter prompt for small models)
    repeat_limit: int = 3               # the same call with the same result this many times running: a loop
    signals: tuple[str, ...] = tuple(SIGNALS)   # the signals that flag turns (all are counted in stats)
    max_final_chars: int = 1500         # a longer final message is a communication issue
    lint_edits: bool = True             # lint each turn's edits (one sandboxed ruff run); off: no style signal
    record_file_access: bool = False    # `run` calls record the files their commands open (strace): the monitor's

    def __post_init__(self):
        for name in ("max_turns", "max_output_chars", "run_wall_s", "run_cpu_s", "max_final_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"coding env setting '{name}' must be > 0, got {getattr(self, name)}")
        if not self.repeat_limit >= 2:
            raise ValueError(f"coding env setting 'repeat_limit' must be >= 2, got {self.repeat_limit}")
        unknown = [t for t in self.tools if t not in TOOL_NAMES]
        problem = (f"unknown tool {', '.join(map(repr, unknown))}; the tools are {', '.join(TOOL_NAMES)}" if unknown
                   else "a tool is listed twice" if len(set(self.tools)) != len(self.tools)
                   else "must include submit (the agent ends its episode with it)" if "submit" not in self.tools
                   else "")
        if problem:
            raise ValueError(f"coding env setting 'tools': {problem}")
        unknown = [s for s in self.signals if s not in SIGNALS]
        if unknown:
            raise ValueError(f"coding env setting 'signals': unknown signal {', '.join(map(repr, unknown))}; the "
                             f"signals are {', '.join(SIGNALS)}")


class CodingEnv:
    def __init__(self, sandbox: Sandbox, fmt: ToolFormat, config: CodingEnvConfig = CodingEnvConfig(), *,
                 inspect: Callable[[Task, Path], dict] | None = None):
        self.sandbox, self.fmt, self.config, self.inspect = sandbox, fmt, config, inspect
        if config.record_file_access:
            find_strace()       # fails now, naming what is missing, rather than at the first `run`
        self.tools = tuple(t for t in TOOLS if t.name in config.tools)
        self._tmp: Path | None = None
        self.done = True

    @property
    def hint_context(self) -> HintContext:
        example = next((name, args) for name, args in _EXAMPLE_CALLS if name in self.config.tools)
        return HintContext(tuple(t.name for t in self.tools), self.fmt.render_call(*example),
                           self.config.max_output_chars)

    def reset(self, task: Task) -> list[dict]:
        self.close()
        self._tmp = Path(tempfile.mkdtemp(prefix=f"composer_jax-env-{task.id}-"))
        self.workspace = copy_repo(task.repo, self._tmp / "repo")
        limits = dataclasses.replace(self.sandbox.limits, wall_s=self.config.run_wall_s, cpu_s=self.config.run_cpu_s)
        self._tools = WorkspaceTools(self.workspace, self.sandbox, max_output_chars=self.config.max_output_chars,
                                     run_limits=limits, record_file_access=self.config.record_file_access)
        self.task, self.turn, self.done = task, 0, False
        self.packages = top_level_names(task.repo)   # the monitor flags commands opening installed copies of them
        self._last_call, self._repeats = None, 0
        self._seen, self._last_test_run = SeenResults(), None
        # tool_calls: valid calls carried out; invalid_calls: calls that did not parse or validate;
        # failed_calls: those plus the valid calls that could not be carried out; tests_failed_runs: test
        # runs that reported failures (successful calls); then each signal's count (envs.signals)
        self.stats = {"tool_calls": 0, "invalid_calls": 0, "failed_calls": 0, "malformed_turns": 0,
                      "tests_failed_runs": 0, **dict.fromkeys(SIGNAL_COUNTS.values(), 0)}
        return [self.fmt.tools_message(self.tools), {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task.instruction}]

    def _test_digest(self) -> dict[str, str]:
        return {p.relative_to(self.workspace).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
                for p in self.workspace.rglob("*")
                if p.is_file() and not p.is_symlink() and is_test_file(p.relative_to(self.workspace).as_posix())}

    def _repeat(self, call: str, shown: str, result: str, flags: list[Flag]) -> None:
        """Count the same call (`call`: its identity) with the same result running (timings aside); flag
        the loop once, when the count reaches the limit. `shown`: the call as the hint names it."""
        key = (call, DURATION.sub("", result))
        self._repeats = self._repeats + 1 if key == self._last_call else 1
        self._last_call = key
        if self._repeats == self.config.repeat_limit:
            first_line = result.strip().splitlines()[0] if result.strip() else "no output"
            flags.append(Flag(REPEATED_CALL, f"{shown} {self._repeats} times, each: {first_line[:120]}"))

    def _signal(self, kind: str, detail: str, flags: list[Flag], count: int = 1) -> None:
        """Count a signal (its flag kind) in stats; flag the turn when the signal is one of config.signals."""
        self.stats[SIGNAL_COUNTS[kind]] += count
        if kind in (SIGNALS[s] for s in self.config.signals):
            flags.append(Flag(kind, detail))

    def step(self, assistant_text: str) -> tuple[list[dict], bool, dict]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(task) first")
        self.turn += 1
        parsed = parse_turn(assistant_text, self.fmt, self.tools)
        flags = flags_for_errors(parsed.errors)
        observation = []
        for error in parsed.errors:
            self.stats["failed_calls"] += 1
            self._repeat(f"{error.kind}:{error.message}", "a call failing the same way", error.message, flags)
            observation.append({"role": "tool", "name": error.call_id, "content": f"error: {error.message}"})
        if parsed.errors:
            self.stats["malformed_turns"] += 1
            self.stats["invalid_calls"] += len(parsed.errors)
        submitted, calls = False, []
        root = self.workspace.resolve()
        python_before = (file_contents(root, python_edit_paths(root, parsed.calls)) if self.config.lint_edits
                         else {})   # the turn's edits are linted against these
        for call in parsed.calls:
            self.stats["tool_calls"] += 1
            if call.name == "submit":
                submitted = True
                observation.append({"role": "tool", "name": call.call_id, "content": "submitted"})
                calls.append(CallRecord(call.name, call.arguments, "submitted"))
                break
            before = self._test_digest() if call.name == "run" else None
            outcome = self._tools.call(call)
            self.stats["failed_calls"] += not outcome.ok
            self._repeat(call.key(), f"{call.name} {call.arguments}", outcome.output, flags)
            if call.name == "run":
                command = call.arguments["command"]
                if runs_tests(command):
                    self._last_test_run = outcome
                    self.stats["tests_failed_runs"] += bool(outcome.ok and outcome.exit_code)
                if (detail := wrong_tool(command, self.config.tools)) is not None:
                    self._signal(WRONG_TOOL, detail, flags)
            elif outcome.ok and (detail := self._seen.redundant(call, outcome.output, self.turn)) is not None:
                self._signal(REDUNDANT_CALL, detail, flags)
            if outcome.truncated:
                flags.append(Flag(OUTPUT_LIMIT, f"{call.name} output cut at {self.config.max_output_chars} characters"))
            edited = list(outcome.test_files)
            if before is not None:
                after = self._test_digest()
                edited += sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
            if edited:
                flags.append(Flag(TEST_FILE_EDIT, ", ".join(edited)))
            observation.append({"role": "tool", "name": call.call_id, "content": outcome.output})
            calls.append(CallRecord(call.name, call.arguments, outcome.output, outcome.ok, outcome.file_accesses))
        if not parsed.attempted:
            flags.append(Flag(NO_ACTION, "the message has no tool call"))
            observation.append({"role": "user", "content": NO_ACTION_MESSAGE})
        if findings := added_findings(self.sandbox, root, python_before):
            self._signal(STYLE, style_detail(findings), flags, len(findings))
        if submitted and (issues := communication_issues(parsed.text, self._last_test_run,
                                                         bool(changed_files(self.task.repo, self.workspace)),
                                                         self.config.max_final_chars)):
            self._signal(COMMUNICATION, "; it ".join(issues), flags, len(issues))
        if any(f.kind == REPEATED_CALL for f in flags):
            flags = [f for f in flags if f.kind != REDUNDANT_CALL]
        self.done = submitted or self.turn >= self.config.max_turns
        info = {"turn": self.turn, "flags": flags, "submitted": submitted, "calls": tuple(calls)}
        if self.done:
            check = check_task(self.task, self.sandbox, workspace=self.workspace)
            info.update(task_reward=check.reward, check=check.to_json(), **self.stats, turns=self.turn)
            if self.inspect is not None:
                info["inspection"] = self.inspect(self.task, self.workspace)
            self.close()
        return observation, self.done, info

    def __enter__(self) -> CodingEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete the episode's workspace (also done by the next reset)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.done = True
