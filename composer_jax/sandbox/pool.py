"""Many sandboxes at once: a thread pool (each sandboxed command is its own process tree, so threads
only wait on pipes) that returns results in input order."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
MOST_WORKERS = 8


def default_workers() -> int:
    """Sandboxes at once when a command is not told: one per core this process may use, at most
    MOST_WORKERS (a sandboxed test run spends much of its time starting processes and waiting on them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MOST_WORKERS, cores))


def run_parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """[fn(item) for item in items] with up to `workers` calls in flight; an exception propagates."""
    items = list(items)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(fn, items))
