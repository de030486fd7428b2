"""The engine's sign of life: a thread rewrites a small file every HEARTBEAT_S; the learner, having seen it
change, stops with one line naming the engine's host and process once it stands still for the grace
period, so a killed engine is noticed in seconds, not at the batch timeout. (The learner's own clock
times the silence, so the hosts' clocks need not agree.)"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from composer_jax.rl.exchange.directory import ExchangeError, atomic_write

HEARTBEAT_FILE = "engine-heartbeat"
HEARTBEAT_S = 2.0           # how often the engine beats
HEARTBEAT_GRACE_S = 30.0    # a heartbeat that stood still this long: the engine is gone


def heartbeat_path(root: str | Path, engine: int = 0) -> Path:
    return Path(root) / (HEARTBEAT_FILE if engine == 0 else f"{HEARTBEAT_FILE}-{engine}")


class Heartbeat:
    """Engine `engine`'s side: a thread rewriting its heartbeat file (a counter, host and pid) every
    `every` seconds until `stop()`."""

    def __init__(self, root: str | Path, every: float = HEARTBEAT_S, engine: int = 0):
        self.path, self.every, self._done = heartbeat_path(root, engine), every, threading.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._beat, name="engine-heartbeat", daemon=True)

    def _beat(self) -> None:
        count = 0
        while True:
            count += 1
            self.path.parent.mkdir(parents=True, exist_ok=True)    # the directory may have been removed meanwhile
            atomic_write(self.path, json.dumps({"beat": count, "host": socket.gethostname(),
                                                "pid": os.getpid()}).encode())
            if self._done.wait(self.every):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


class HeartbeatWatch:
    """The learner's side: `check()` raises ExchangeError once a heartbeat seen changing has stood
    still for `grace_s` seconds of this process's clock (a heartbeat never seen changing proves nothing:
    it may be a dead engine's file from before a restart)."""

    def __init__(self, root: str | Path, grace_s: float, engine: int = 0, name: str = "the rollout engine"):
        self.path, self.grace_s, self.name = heartbeat_path(root, engine), grace_s, name
        self.last: str | None = None
        self.read_once = False
        self.changed_at: float | None = None    # monotonic time it was last seen to change (None: not yet)

    def check(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            text = None
        now = time.monotonic()
        if not self.read_once or text != self.last:
            self.changed_at = now if self.read_once else None
            self.last, self.read_once = text, True
            return
        if self.changed_at is not None and now - self.changed_at > self.grace_s:
            try:
                who = json.loads(text)
                who = f"pid {who['pid']} on {who['host']}"
            except (TypeError, ValueError, KeyError):
                who = "its process"
            raise ExchangeError(f"{self.name} ({who}) stopped: its heartbeat in {self.path} has not changed "
                                f"in {now - self.changed_at:.0f} s")
