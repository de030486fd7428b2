"""A run directory: what an evaluation writes, and how an interrupted one picks up where it stopped.

    OUT/
      run.json           what is evaluated (agent, settings, task ids, samples, ...): a restart must match
      attempts.jsonl     one JSON object per finished attempt (AttemptRecord), appended as it finishes
      transcripts/TASK/SAMPLE.json   the episode: token ids, turns, decoded text, grading, lint, diff
      summary.json       the scores, recomputed from attempts.jsonl whenever a run completes

Each record is appended with a single write() of the whole line to a file opened O_APPEND (and
fsync'd), after its transcript was renamed into place; a kill can only leave a torn last line, which
the next run cuts off (and redoes that attempt). So attempts.jsonl always lists exactly the finished
attempts, and a restarted run skips them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

from composer_jax.eval.errors import EvalError

RUN, ATTEMPTS, SUMMARY, TRANSCRIPTS = "run.json", "attempts.jsonl", "summary.json", "transcripts"


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    task: str
    sample: int                # 0 .. samples-1
    seed: int                  # the attempt's sampling seed (from the run seed, task and sample)
    reward: float              # the task reward: share of target tests passing (toy tasks: exact match)
    solved: bool               # reward == 1
    turns: int                 # assistant turns
    generated_tokens: int      # tokens the agent produced
    tool_calls: int            # tool calls attempted (valid or not)
    tool_errors: int           # calls that did not parse or validate, or failed when carried out
    lint_added: int | None     # lint findings the agent's changes added (None: no workspace to lint)
    status: str                # the grading status ('ok', 'timeout', 'error', ...)
    wall_s: float              # seconds the attempt took
    transcript: str            # its transcript, relative to the run directory

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(AttemptRecord))


def write_json(path: Path, obj, indent: int | None = 1) -> None:
    """Write JSON to `path` atomically (a reader sees the old file or the whole new one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(obj, indent=indent) + "\n", encoding="utf-8")
    os.replace(partial, path)


def transcript_path(task: str, sample: int) -> str:
    return f"{TRANSCRIPTS}/{task}/{sample}.json"


def read_attempts(run_dir: Path, *, repair: bool = False) -> list[dict]:
    """The records of RUN_DIR/attempts.jsonl. A torn last line (no newline: the writer was killed) is
    ignored, and with `repair` cut off the file. Anything else unreadable is an EvalError naming the line."""
    path = Path(run_dir) / ATTEMPTS
    if not path.is_file():
        raise EvalError(f"{run_dir}: no {ATTEMPTS} (not an evaluation run directory)")
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    records, seen = [], set()
    for number, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), 1):
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{where}: not a JSON object ({e.msg})") from None
        missing = [f for f in FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise EvalError(f"{where}: not an attempt record (missing {', '.join(missing)})")
        key = (record["task"], record["sample"])
        if key in seen:
            raise EvalError(f"{where}: task {key[0]} sample {key[1]} is recorded twice")
        seen.add(key)
        records.append(record)
    return records


class AttemptLog:
    """Appends records to RUN_DIR/attempts.jsonl; safe to share between worker threads."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ATTEMPTS
        self._lock = threading.Lock()

    def append(self, record: AttemptRecord) -> None:
        line = (json.dumps(record.to_json()) + "\n").encode("utf-8")
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                if written != len(line):  # a regular file takes it whole unless the disk is full
                    raise OSError(f"{self.path}: wrote {written} of {len(line)} bytes")
                os.fsync(fd)
            finally:
                os.close(fd)


def open_run(run_dir: Path, spec: dict) -> list[dict]:
    """Create RUN_DIR for an evaluation described by `spec`, or reopen one made with the same spec;
    returns the attempts already finished (a torn last record cut off)."""
    run_dir = Path(run_dir)
    run_file = run_dir / RUN
    if run_file.is_file():
        try:
            old = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EvalError(f"{run_file}: unreadable ({e})") from None
        for key in sorted(set(old) | set(spec)):
            if old.get(key) != spec.get(key):
                raise EvalError(f"{run_dir} holds an evaluation with a different '{key}' ({_short(old.get(key))} "
                                f"in {RUN}, now {_short(spec.get(key))}): rerun with the same settings or use "
                                "another output directory")
        if not (run_dir / ATTEMPTS).exists():
            (run_dir / ATTEMPTS).touch()
        return read_attempts(run_dir, repair=True)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise EvalError(f"{run_dir} exists and is not an evaluation run directory (no {RUN}): choose another "
                        "output directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_file, spec)
    (run_dir / ATTEMPTS).touch()
    return []


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
