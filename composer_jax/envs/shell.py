"""Reading shell command lines the agent's `run` calls carry: their pipelines and simple commands, each
command's program, arguments, operands and redirections, python's `-m` / `-c`, and whether a line runs
tests. Words only, never executed (the reward-hacking monitor and the environment's flags read commands
through these)."""

from __future__ import annotations

import posixpath
import re
import shlex

PYTHONS = re.compile(r"python(?:\d+(?:\.\d+)?)?")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
WRAPPERS = {"sudo", "env", "nice", "time", "command", "exec", "xargs", "nohup", "stdbuf"}
TEST_RUNNERS = {"pytest", "py.test", "tox", "nox", "nosetests", "trial"}
TEST_MODULES = {"pytest", "unittest", "nose", "nose2", "tox", "nox", "doctest"}
REDIRECTION = re.compile(r"(\d*|&)(<<<|<<-?|<>|<&|<|>>|>&|>\||>)(.*)")   # [descriptor] operator [target]


def pipelines(command: str) -> list[list[list[str]]]:
    """The pipelines of a shell command line, split at ; && || & ( ) and newlines, each a list of its simple
    commands (word lists), split at | and |&. A redirection to a descriptor (`2>&1`) stays one word."""
    lexer = shlex.shlex(command.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:                  # unbalanced quotes: fall back to whitespace words
        tokens = command.split()
    words, i = [], 0
    while i < len(tokens):              # the lexer cuts `2>&1` and `&>file` at their '&': join them again
        token, following = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        if token == "&" and following and words and words[-1].endswith((">", "<")):    # 2>&1
            words[-1] += token + following
            i += 2
        elif token == "&" and following.startswith(">"):                               # &>file
            words.append(token + following)
            i += 2
        else:
            words.append(token)
            i += 1
    lines, pipeline, current = [], [], []
    for word in words:
        if set(word) <= set(";&|()"):
            pipeline.append(current)
            current = []
            if word not in ("|", "|&"):
                lines.append(pipeline)
                pipeline = []
        else:
            current.append(word)
    lines.append(pipeline + [current])
    return [p for p in ([s for s in pipeline if s] for pipeline in lines) if p]


def segments(command: str) -> list[list[str]]:
    """Simple commands (word lists) of a shell command line, split at ; && || | & ( ) and newlines."""
    return [words for pipeline in pipelines(command) for words in pipeline]


def redirections(words: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """A simple command's words without its redirections, and the redirections as (operator with its
    descriptor, e.g. '>', '2>', '>>', '&>', '<<', '2>&'; target: a file, a descriptor, a here-document's
    delimiter)."""
    rest, found = [], []
    i = 0
    while i < len(words):
        match = REDIRECTION.fullmatch(words[i])
        if match is None:
            rest.append(words[i])
        elif match[3]:
            found.append((match[1] + match[2], match[3]))
        else:                           # the target is the next word
            found.append((match[1] + match[2], words[i + 1] if i + 1 < len(words) else ""))
            i += 1
        i += 1
    return rest, found


def operands(args: list[str], valued: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The operands among a command's arguments: not options, nor the values of the options in `valued`
    (`-n 5`); everything after `--`; a lone `-` (standard input) is an operand."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--":
            return out + args[i + 1:]
        if args[i].startswith("-") and args[i] != "-":
            i += 1 + (args[i] in valued)
        else:
            out.append(args[i])
            i += 1
    return out


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
