"""The exchange directory's building blocks: its error, whole-or-nothing writes, numbered files and the
learner's session file (layout: the package docstring)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

POLL_S = 0.1                # how often a side looks for the other's next file
SESSION_FILE = "session.json"


class ExchangeError(RuntimeError):
    """The other side of the exchange failed or is silent (one line, naming it)."""


def atomic_write(path: Path, data: bytes) -> None:
    """`data` to `path`, whole or not at all: written to a hidden temporary name beside it, then renamed."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, value) -> None:
    atomic_write(path, json.dumps(value).encode())


def numbered(directory: Path, suffix: str = ".npz") -> list[int]:
    """The numbers of the whole files `<n><suffix>` in `directory`, ascending (temporary files skipped)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name[:-len(suffix)]) for p in directory.glob(f"[0-9]*{suffix}"))


def numbered_file(directory: Path, n: int, suffix: str = ".npz") -> Path:
    return directory / f"{n:08d}{suffix}"


def prune(directory: Path, keep: int, suffix: str = ".npz") -> None:
    """Remove all but the newest `keep` numbered files (or directories: a weight version)."""
    for old in numbered(directory, suffix)[:-keep]:
        path = numbered_file(directory, old, suffix)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def read_session(root: Path) -> dict | None:
    """The learner's running session (session.json in the exchange directory `root`), None before the first."""
    try:
        return json.loads((Path(root) / SESSION_FILE).read_text())
    except FileNotFoundError:
        return None
