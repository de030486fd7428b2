"""Streaming conversion jobs: atomic, resumable output and a bounded worker pool with progress.

`Staging(dst, fingerprint)` builds the output in `<dst>.partial/` and renames it to `dst` only once
complete, so nothing half-written ever sits at `dst`. Each finished work item is appended to a journal
there; re-running the same job (same fingerprint: source files, options) skips finished items, a
different job refuses to touch the partial output unless told to restart.
`run_items` runs work items on a thread pool (numpy, file IO and tensorstore release the GIL), with at
most `workers` items in memory at once, a byte-count progress bar, and the first error re-raised.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from composer_jax.checkpoint.safetensors_io import CheckpointError

log = logging.getLogger(__name__)

JOB_FILE = ".job.json"
JOURNAL = ".done"


def file_fingerprint(files) -> list:
    """[(name, size, mtime_ns)] of input files: a resumed job must see the same inputs."""
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(f) for f in files)]


class Staging:
    """Output directory under construction (see module docstring). Use as a context manager."""

    def __init__(self, dst: str | Path, fingerprint: dict, *, overwrite: bool = False, restart: bool = False):
        self.dst = Path(dst).absolute()
        self.tmp = self.dst.with_name(self.dst.name + ".partial")
        if self.dst.exists() and not overwrite:
            raise CheckpointError(f"{self.dst} already exists (pass --overwrite to replace it)")
        job = json.loads(json.dumps(fingerprint))  # normalized, as it reads back from disk
        self.done: set[str] = set()
        if self.tmp.exists():
            try:
                same = json.loads((self.tmp / JOB_FILE).read_text()) == job
            except (OSError, json.JSONDecodeError):
                same = False
            if same and not restart:
                journal = self.tmp / JOURNAL
                self.done = set(journal.read_text().split("\n")) - {""} if journal.exists() else set()
                log.info("resuming %s: %d work items already done", self.tmp, len(self.done))
            elif restart:
                shutil.rmtree(self.tmp)
            else:
                raise CheckpointError(f"{self.tmp} holds a partial output of a different job (other inputs or "
                                      "options); pass --restart to discard it")
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.tmp / JOB_FILE).write_text(json.dumps(job))
        self._journal = open(self.tmp / JOURNAL, "a")
        self._lock = threading.Lock()
        self._last_sync = time.monotonic()

    def mark(self, item: str) -> None:
        """Record a finished work item (after its data is written)."""
        with self._lock:
            self._journal.write(item + "\n")
            self._journal.flush()
            if time.monotonic() - self._last_sync > 5:
                os.fsync(self._journal.fileno())
                self._last_sync = time.monotonic()

    def commit(self) -> Path:
        """Atomically publish the finished output at `dst` (replacing an old one if allowed)."""
        self._journal.close()
        for name in (JOURNAL, JOB_FILE):
            (self.tmp / name).unlink()
        _fsync_tree(self.tmp)
        old = None
        if self.dst.exists():
            old = self.dst.with_name(f"{self.dst.name}.old-{os.getpid()}")
            os.rename(self.dst, old)
        os.rename(self.tmp, self.dst)
        if old is not None:
            shutil.rmtree(old)
        return self.dst

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        if not self._journal.closed:  # failed or interrupted: keep the partial output for a resume
            self._journal.close()
            log.warning("partial output kept in %s; re-run the same command to resume", self.tmp)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass(frozen=True)
class Item:
    """One unit of streaming work: `run()` reads, converts and writes `nbytes` of source data."""

    id: str
    nbytes: int
    run: Callable[[], None]


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def run_items(items: list[Item], stage: Staging, *, workers: int, desc: str, progress: bool) -> None:
    """Run the items not yet done in `stage`, `workers` at a time; journal each one as it finishes."""
    from tqdm import tqdm

    todo = [it for it in items if it.id not in stage.done]
    total = sum(it.nbytes for it in items)
    bar = tqdm(total=total, initial=total - sum(it.nbytes for it in todo), unit="B", unit_scale=True,
               unit_divisor=1024, desc=desc, disable=not progress, dynamic_ncols=True)

    def run(it: Item) -> Item:
        it.run()
        stage.mark(it.id)
        return it

    pending, queue = set(), iter(todo)
    with bar, cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
        try:
            while True:
                while len(pending) < workers and (it := next(queue, None)) is not None:
                    pending.add(pool.submit(run, it))
                if not pending:
                    break
                finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    bar.update(f.result().nbytes)
        except BaseException:
            for f in pending:
                f.cancel()
            raise


def block_size(extent: int, bytes_per_index: int, budget: int) -> int:
    """The largest divisor of `extent` whose block (`size * bytes_per_index` bytes) fits `budget` (>= 1)."""
    best = 1
    for d in range(1, int(extent ** 0.5) + 1):
        if extent % d == 0:
            for c in (d, extent // d):
                if c * bytes_per_index <= budget and c > best:
                    best = c
    return best
