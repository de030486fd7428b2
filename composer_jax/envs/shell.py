"""Reading shell command lines the agent's `run` calls carry: their simple commands, each command's
program and arguments, python's `-m` / `-c`, and whether a line runs tests. Words only, never executed
(the reward-hacking monitor and the environment's flags read commands through these)."""

from __future__ import annotations

import posixpath
import re
import shlex

PYTHONS = re.compile(r"python(?:\d+(?:\.\d+)?)?")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
WRAPPERS = {"sudo", "env", "nice", "time", "command", "exec", "xargs", "nohup", "stdbuf"}
TEST_RUNNERS = {"pytest", "py.test", "tox", "nox", "nosetests", "trial"}
TEST_MODULES = {"pytest", "unittest", "nose", "nose2", "tox", "nox", "doctest"}


def segments(command: str) -> list[list[str]]:
    """Simple commands (word lists) of a shell command line, split at ; && || | & ( ) and newlines."""
    lexer = shlex.shlex(command.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:                  # unbalanced quotes: fall back to whitespace words
        tokens = command.split()
    parts = [[]]
    for token in tokens:
        if set(token) <= set(";&|()"):
            parts.append([])
        else:
            parts[-1].append(token)
    return [s for s in parts if s]


def program_of(words: list[str]) -> tuple[str, list[str]]:
    """(program name, its arguments) of a simple command, past VAR=value words and wrappers."""
    i = 0
    while i < len(words):
        if ASSIGNMENT.fullmatch(words[i]) or posixpath.basename(words[i]) in WRAPPERS:
            i += 1
        elif words[i] == "timeout":
            i += 2                      # the duration follows
        else:
            return posixpath.basename(words[i]), words[i + 1:]
    return "", []


def python_code(program: str, args: list[str]) -> tuple[str | None, str | None]:
    """(`-m` module, `-c` code) of a python command line."""
    if not PYTHONS.fullmatch(program):
        return None, None
    for flag in ("-m", "-c"):
        if flag in args[:-1]:
            value = args[args.index(flag) + 1]
            return (value, None) if flag == "-m" else (None, value)
    return None, None


def runs_tests(command: str) -> bool:
    """Whether a command line runs a test suite: pytest, tox, nox, ..., `python -m pytest|unittest|...`,
    `python <a test file>`, or `make test`."""
    for words in segments(command):
        program, args = program_of(words)
        module, _ = python_code(program, args)
        script = args[0] if PYTHONS.fullmatch(program) and args and args[0].endswith(".py") else ""
        if (program in TEST_RUNNERS or module in TEST_MODULES or re.search(r"(^|/)test_[^/]*\.py$", script)
                or (program == "make" and any(a.startswith("test") or a == "check" for a in args))):
            return True
    return False
