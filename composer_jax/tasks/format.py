"""The task format: a directory with the workspace, the instruction, the tests and a reference fix.

    TASK_DIR/
      repo/            the workspace the agent edits (copied before anything runs in it)
      task.json        {"id", "instruction", "test_command", "target_tests", ["pass_to_pass"], ["timeout_s"],
                        ["family"], ["level"], ["difficulty"]}
      solution.patch   a unified diff, -p1 relative to repo/ (kept outside repo/ so the agent never sees it)

`test_command` runs from the root of repo/ (e.g. "python -m pytest -q tests"); `target_tests` are pytest
node ids (`path/to/test_file.py::[Class::]name[param]`, relative to repo/) the work must make pass
(may be empty: then the command's exit code decides); `pass_to_pass` are node ids that must keep
passing. `family` (optional, one of FAMILIES) is the generator that made the task; `level` (optional,
one of LEVELS) is how much of a feature feature deletion deleted (tasks/levels.py). `difficulty`
(optional) describes how hard the task is: counts set by the generator (DIFFICULTY_COUNTS: for
feature deletion `deleted_lines`, `deleted_definitions`, `deleted_files`; for bug injection
`changed_lines` and `definitions`, those the target tests run; `target_tests` for both), bug
injection's `mutation` (one of MUTATIONS) and `pass_rate` (null until the RL loop records the share
of its samples that solved the task, `write_pass_rate`).
`load_task` validates everything and raises TaskError naming the task and the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path, PurePosixPath

REQUIRED = ("id", "instruction", "test_command", "target_tests")
OPTIONAL = ("pass_to_pass", "timeout_s", "family", "level", "difficulty")
DIFFICULTY_COUNTS = ("deleted_lines", "deleted_definitions", "deleted_files", "changed_lines", "definitions",
                     "target_tests")
FAMILIES = ("feature_deletion", "bug_injection")
LEVELS = ("body", "definition", "feature")
MUTATIONS = ("comparison", "arithmetic", "off_by_one", "swapped_arguments", "dropped_condition", "dropped_return",
             "wrong_constant")
DEFAULT_TIMEOUT_S = 60.0
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class TaskError(ValueError):
    """A task directory is malformed; `task` and `field` name the culprit."""

    def __init__(self, task: str, field: str, message: str):
        self.task, self.field = task, field
        super().__init__(f"task {task}: field '{field}': {message}")


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    instruction: str
    test_command: str
    target_tests: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    timeout_s: float
    root: Path          # the task directory
    difficulty: dict = dataclasses.field(default_factory=dict)   # DIFFICULTY_COUNTS and pass_rate, when given
    level: str | None = None     # one of LEVELS, when given
    family: str | None = None    # one of FAMILIES, when given

    @property
    def pass_rate(self) -> float | None:
        return self.difficulty.get("pass_rate")

    @property
    def repo(self) -> Path:
        return self.root / "repo"

    @property
    def solution_patch(self) -> Path:
        return self.root / "solution.patch"

    @property
    def test_paths(self) -> set[str]:
        """Files (relative to repo/) that hold the target and pass-to-pass tests."""
        return {node_path(n) for n in (*self.target_tests, *self.pass_to_pass)}


def node_path(node_id: str) -> str:
    """The file part of a pytest node id: 'tests/test_a.py::TestX::test_y[1]' -> 'tests/test_a.py'."""
    return node_id.split("::", 1)[0]


def safe_relative(path: str) -> bool:
    """A relative path that stays inside its root (no '..', not absolute, not empty)."""
    p = PurePosixPath(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and "\\" not in path


def _node_ids(name: str, field: str, value) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise TaskError(name, field, f"must be a list of pytest node ids, got {type(value).__name__}")
    for i, node in enumerate(value):
        if not isinstance(node, str) or "::" not in node or not node.split("::", 1)[1]:
            raise TaskError(name, field, f"entry {i} ({node!r}) is not a pytest node id 'path.py::test_name'")
        if not safe_relative(node_path(node)):
            raise TaskError(name, field, f"entry {i} ({node!r}): the file must be a relative path inside repo/")
    duplicates = sorted({n for n in value if value.count(n) > 1})
    if duplicates:
        raise TaskError(name, field, f"lists {duplicates[0]!r} more than once")
    return tuple(value)


def _text(name: str, field: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TaskError(name, field, f"must be a non-empty string, got {value!r}")
    return value


def _one_of(name: str, field: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TaskError(name, field, f"must be one of {', '.join(allowed)}, got {value!r}")


def _difficulty(name: str, value) -> dict:
    field = "difficulty"
    if not isinstance(value, dict):
        raise TaskError(name, field, f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(DIFFICULTY_COUNTS) - {"mutation", "pass_rate"})
    if unknown:
        raise TaskError(name, f"{field}.{unknown[0]}",
                        f"unknown (known: {', '.join(DIFFICULTY_COUNTS)}, mutation, pass_rate)")
    if "mutation" in value:
        _one_of(name, f"{field}.mutation", value["mutation"], MUTATIONS)
    for key in DIFFICULTY_COUNTS:
        count = value.get(key, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TaskError(name, f"{field}.{key}", f"must be a count (an integer >= 0), got {count!r}")
    rate = value.get("pass_rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1):
        raise TaskError(name, f"{field}.pass_rate", f"must be null or a number in [0, 1], got {rate!r}")
    return dict(value)


def patch_paths(text: str) -> list[str]:
    """The file paths a unified diff touches, with their a/ b/ prefixes (from '---' / '+++' headers)."""
    paths = []
    for line in text.splitlines():
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t", 1)[0].strip()
            if path != "/dev/null":
                paths.append(path)
    return paths


def _check_patch(name: str, path: Path) -> None:
    field = "solution.patch"
    if not path.is_file():
        raise TaskError(name, field, f"missing: {path} (a unified diff, -p1 relative to repo/)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(name, field, f"cannot be read as UTF-8 text: {e}") from None
    paths = patch_paths(text)
    if not paths or not re.search(r"^@@ ", text, re.MULTILINE):
        raise TaskError(name, field, "is not a unified diff (no '--- a/...', '+++ b/...' and '@@' lines)")
    for p in paths:
        stripped = p.split("/", 1)[1] if "/" in p else ""
        if not safe_relative(stripped):
            raise TaskError(name, field, f"path {p!r} is not a -p1 path inside repo/ (expected a/... or b/...)")


def load_task(path: str | Path) -> Task:
    """Read and validate TASK_DIR; TaskError names the task directory and the field at fault."""
    root = Path(path)
    name = str(path)
    if not root.is_dir():
        raise TaskError(name, "directory", "does not exist or is not a directory")
    meta_path = root / "task.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskError(name, "task.json", "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TaskError(name, "task.json", f"is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise TaskError(name, "task.json", f"must hold a JSON object, got {type(meta).__name__}")
    for key in REQUIRED:
        if key not in meta:
            raise TaskError(name, key, "missing (required: " + ", ".join(REQUIRED) + ")")
    unknown = sorted(set(meta) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise TaskError(name, unknown[0], "unknown field (known: " + ", ".join(REQUIRED + OPTIONAL) + ")")
    task_id = meta["id"]
    if not isinstance(task_id, str) or not ID_PATTERN.fullmatch(task_id):
        raise TaskError(name, "id", f"must match {ID_PATTERN.pattern}, got {task_id!r}")
    targets = _node_ids(name, "target_tests", meta["target_tests"])
    keep = _node_ids(name, "pass_to_pass", meta.get("pass_to_pass", []))
    both = sorted(set(targets) & set(keep))
    if both:
        raise TaskError(name, "pass_to_pass", f"{both[0]!r} is also a target test")
    timeout = meta.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise TaskError(name, "timeout_s", f"must be a positive number of seconds, got {timeout!r}")
    if not (root / "repo").is_dir():
        raise TaskError(name, "repo", f"missing: {root / 'repo'} must be a directory (the workspace)")
    level, family = meta.get("level"), meta.get("family")
    if level is not None:
        _one_of(name, "level", level, LEVELS)
    if family is not None:
        _one_of(name, "family", family, FAMILIES)
    _check_patch(name, root / "solution.patch")
    return Task(id=task_id, instruction=_text(name, "instruction", meta["instruction"]),
                test_command=_text(name, "test_command", meta["test_command"]), target_tests=targets,
                pass_to_pass=keep, timeout_s=float(timeout), root=root.resolve(),
                difficulty=_difficulty(name, meta.get("difficulty", {})), level=level, family=family)


def write_pass_rate(path: str | Path, pass_rate: float) -> Task:
    """Record the share of sampled attempts that solved the task in task.json's `difficulty.pass_rate`
    (replacing the file atomically, so a reader never sees half of it); returns the reloaded task."""
    load_task(path)
    if isinstance(pass_rate, bool) or not isinstance(pass_rate, (int, float)) or not 0 <= pass_rate <= 1:
        raise TaskError(str(path), "difficulty.pass_rate", f"must be a number in [0, 1], got {pass_rate!r}")
    meta_path = Path(path) / "task.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta.setdefault("difficulty", {})["pass_rate"] = float(pass_rate)
    partial = meta_path.with_name("task.json.partial")
    partial.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, meta_path)
    return load_task(path)
