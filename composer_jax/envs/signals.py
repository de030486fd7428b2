"""The signals Composer names, read from a coding episode as it is played (CodingEnv.step). Each is a
flag kind (envs.feedback; the details here complete its hint's sentence) and a count in the env's
stats that a reward weight can penalise (envs.rewards):

    style          lint findings a turn's own `edit` / `write_file` calls added to Python files: the files
                   as they were before the turn and after it, linted in one sandboxed ruff run (envs.lint);
                   counted per finding (`style_findings`)
    communication  the final message (the text beside `submit`) against what the environment saw: it says
                   the tests pass while the last test run failed or none ran, it says nothing of a change
                   the agent made, or it is longer than the limit; counted per issue
                   (`communication_issues`)
    effort         `redundant_call`: a read_file, list_dir or search the agent already made with the same
                   result (same path and range, directory, or search, and nothing it shows changed since),
                   from its second occurrence on, running or not (`redundant_calls`)
    wrong_tool     `run` doing what a declared tool does: editing in place (sed -i, perl -i) or writing a
                   file (echo / printf / cat > FILE, tee FILE) with edit or write_file declared, reading
                   files (cat / head / tail FILE) with read_file, listing (ls) with list_dir, searching
                   files (grep / rg) with search; reading a pipe (`pytest | tail`) is fine
                   (`wrong_tool_calls`)

Edits made through `run` are not linted: wrong_tool asks for the tools that are.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from composer_jax.envs.feedback import COMMUNICATION, REDUNDANT_CALL, STYLE, WRONG_TOOL
from composer_jax.envs.lint import Finding, added, lint
from composer_jax.envs.protocol import ToolCall
from composer_jax.envs.shell import operands, pipelines, program_of, redirections
from composer_jax.envs.tools import TOOLS, ToolOutcome
from composer_jax.sandbox import Sandbox

# signal name (CodingEnvConfig.signals, the reward weights' names) -> its flag kind
SIGNALS = {"style": STYLE, "communication": COMMUNICATION, "effort": REDUNDANT_CALL, "wrong_tool": WRONG_TOOL}
SIGNAL_COUNTS = {STYLE: "style_findings", COMMUNICATION: "communication_issues", REDUNDANT_CALL: "redundant_calls",
                 WRONG_TOOL: "wrong_tool_calls"}    # flag kind -> the stats key counting it

# ------------------------------------------------------------------------------------------------
# style

MAX_FINDINGS_SHOWN = 5


def _real(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):     # a symlink loop (RuntimeError before Python 3.13)
        return None


def _inside(root: Path, rel: str) -> str | None:
    """`rel` as a path relative to the (resolved) workspace root, None when it resolves outside it."""
    path = _real(root / rel)
    return path.relative_to(root).as_posix() if path is not None and root in path.parents else None


def python_edit_paths(root: Path, calls: Iterable[ToolCall]) -> list[str]:
    """The Python files (workspace-relative) that a turn's edit / write_file calls name, in call order."""
    paths = [_inside(root, c.arguments["path"]) for c in calls if c.name in ("edit", "write_file")]
    return list(dict.fromkeys(p for p in paths if p is not None and p.endswith(".py")))


def file_contents(root: Path, paths: Iterable[str]) -> dict[str, bytes | None]:
    """Each path's bytes; None where it is not a regular file reached without a symlink (absent, a
    directory, a fifo, a link: the workspace is the agent's, and a link could point anywhere on the host)."""
    return {rel: (root / rel).read_bytes() if _unlinked_file(root / rel) else None for rel in paths}


def _unlinked_file(path: Path) -> bool:
    """Whether `path` names a regular file with no symlink on the way."""
    return _real(path) == path and path.is_file()


def added_findings(sandbox: Sandbox, root: Path, before: dict[str, bytes | None]) -> list[Finding]:
    """The lint findings that the files of `before` (their contents before the turn) gained since."""
    after = file_contents(root, before)
    changed = [rel for rel in before if after[rel] is not None and after[rel] != before[rel]]
    if not changed:
        return []
    found = lint(sandbox, {"before": {rel: before[rel] for rel in changed if before[rel] is not None},
                           "after": {rel: after[rel] for rel in changed}})
    return added(found["before"], found["after"])


def style_detail(findings: Sequence[Finding]) -> str:
    """The findings as the hint names them ('mathops.py:7 F841 Local variable ...'), the first few."""
    shown = "; ".join(map(str, findings[:MAX_FINDINGS_SHOWN]))
    more = len(findings) - MAX_FINDINGS_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


# ------------------------------------------------------------------------------------------------
# communication

# "the tests pass", "all tests now pass", "tests are passing", "3 passed"; not "the tests do not pass"
CLAIMS_TESTS_PASS = re.compile(r"\btests?(?:\s+(?!not\b|never\b|no\b)\w+){0,2}\s+pass(?:es|ed|ing)?\b"
                               r"|\b\d+ passed\b", re.IGNORECASE)
MIN_SUMMARY_CHARS = 20      # shorter than this ("Done.") says nothing of a change


def communication_issues(text: str, last_test_run: ToolOutcome | None, changed: bool, max_chars: int) -> list[str]:
    """What is wrong with the final message `text`, each as the rest of 'Your final message ...'; `changed`:
    the agent changed files of the repository."""
    text, issues = text.strip(), []
    if CLAIMS_TESTS_PASS.search(text):
        if last_test_run is None:
            issues.append("says the tests pass, but no test was run: run them, or do not claim it")
        elif last_test_run.exit_code != 0:
            how = ("was stopped before it finished" if last_test_run.exit_code is None
                   else f"failed (exit code {last_test_run.exit_code})")
            issues.append(f"says the tests pass, but the last test run {how}: report what you saw")
    if changed and len(text) < MIN_SUMMARY_CHARS:
        issues.append("does not say what you changed: sum up the change in a sentence or two")
    if len(text) > max_chars:
        issues.append(f"is {len(text)} characters long: keep it under {max_chars}")
    return issues


# ------------------------------------------------------------------------------------------------
# effort


class SeenResults:
    """What the agent already has: each read_file, list_dir and search it made (arguments normalised),
    with a digest of the result and the turn it first got that result."""

    def __init__(self):
        self._seen: dict[tuple, tuple[int, str]] = {}

    def redundant(self, call: ToolCall, output: str, turn: int) -> str | None:
        """A redundant_call detail when this call's result is the one the agent got the last time it made
        the call; else None, and the result is remembered."""
        if call.name not in ("read_file", "list_dir", "search"):
            return None
        args = call.arguments
        path = posixpath.normpath(args.get("path", "."))
        key = (call.name, path, args.get("start_line", 1), args.get("end_line"), args.get("pattern"))
        digest = hashlib.sha1(output.encode()).hexdigest()
        seen = self._seen.get(key)
        if seen is None or seen[1] != digest:
            self._seen[key] = (turn, digest)
            return None
        when = "earlier in this turn" if seen[0] == turn else f"in turn {seen[0]}"
        if call.name == "read_file":
            lines = ("" if key[2:4] == (1, None) else
                     f" lines {key[2]}-{'end' if key[3] is None else key[3]}")
            return f"read {path}{lines} {when} and it has not changed since"
        where = "the repository root" if path == "." else path
        if call.name == "list_dir":
            return f"listed {where} {when} and it has not changed since"
        return f"searched {where} for {args['pattern']!r} {when} and the results have not changed since"


# ------------------------------------------------------------------------------------------------
# wrong tool for the job

# what `run` does that a tool does better: the tools for the job in order of preference, and what for
JOBS = {"edit": (("edit", "write_file"), "to change files"), "write": (("write_file", "edit"), "to write files"),
        "read": (("read_file",), "to read files"), "list": (("list_dir",), "to list directories"),
        "search": (("search",), "to search files")}
IN_PLACE = {"sed": re.compile(r"-[nrsuzE]*i.*|--in-place.*"),            # option clusters holding -i
            "perl": re.compile(r"-[pnaslwtTuUWX0-9]*i.*")}
WRITERS = {"echo", "printf", "cat"}
STDOUT_TO_FILE = {">", ">>", ">|", "1>", "1>>", "1>|", "&>", "&>>"}
READERS = {"cat": frozenset(), "head": frozenset({"-n", "-c", "--lines", "--bytes"}),
           "tail": frozenset({"-n", "-c", "--lines", "--bytes"})}      # program -> its options taking a value
GREP_VALUED = frozenset({"-e", "-f", "-m", "-A", "-B", "-C", "--regexp", "--file", "--max-count", "--context",
                         "--after-context", "--before-context", "--include", "--exclude", "--exclude-dir", "--label"})
SEARCHERS = {"grep": GREP_VALUED, "egrep": GREP_VALUED, "fgrep": GREP_VALUED,
             "rg": frozenset({"-e", "-f", "-g", "-t", "-T", "-m", "-A", "-B", "-C", "-r", "-j", "-M", "--regexp",
                              "--file", "--glob", "--type", "--type-not", "--max-count", "--replace"})}
RECURSIVE = re.compile(r"-[a-zA-Z]*[rR][a-zA-Z]*|--recursive|--dereference-recursive")
PATTERN_OPTIONS = ("-e", "-f", "--regexp", "--file")


def _files(targets: Iterable[str]) -> list[str]:
    """The targets that are files (not standard input or output, nor a device)."""
    return [t for t in targets if t and t != "-" and not t.startswith("/dev/")]


def _job(words: list[str], position: int, head: str) -> tuple[str, str] | None:
    """(job, how the command does it) when a simple command does a tool's job; `position`: its place in
    its pipeline, `head`: the pipeline's first program."""
    words, redirects = redirections(words)
    program, args = program_of(words)
    written = _files(t for op, t in redirects if op in STDOUT_TO_FILE)
    heredoc = any(op.startswith("<<") for op, _ in redirects)
    if program in IN_PLACE and any(IN_PLACE[program].fullmatch(a) for a in args):
        return "edit", f"{program} -i"
    if program in WRITERS and written:
        return "write", f"{program} ... > {written[0]}"
    if program == "tee" and (files := _files(operands(args))) and (heredoc or position and head in WRITERS):
        return "write", f"tee {files[0]}"
    if program in READERS and not written and (files := _files(operands(args, READERS[program]))):
        return "read", f"{program} {files[0]}"
    if program == "ls":
        return "list", "ls"
    if program in SEARCHERS:
        found = operands(args, SEARCHERS[program])
        files = found if any(a.startswith(PATTERN_OPTIONS) for a in args) else found[1:]
        recursive = program != "rg" and any(RECURSIVE.fullmatch(a) for a in args)
        if _files(files) or recursive or (program == "rg" and not position):
            return "search", program
    return None


def wrong_tool(command: str, declared: Collection[str]) -> str | None:
    """A wrong_tool detail when a `run` command does the job of a declared tool (the first such job)."""
    for pipeline in pipelines(command):
        head = program_of(redirections(pipeline[0])[0])[0]
        for position, words in enumerate(pipeline):
            job = _job(words, position, head)
            if job is None:
                continue
            tools, purpose = JOBS[job[0]]
            tool = next((t for t in tools if t in declared), None)
            if tool is not None:
                spec = next(t for t in TOOLS if t.name == tool)
                return f"{tool}({', '.join(spec.params)}) {purpose} instead of `{job[1]}`"
    return None
