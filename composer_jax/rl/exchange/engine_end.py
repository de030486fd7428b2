"""The engine's end of the exchange (`EngineExchange`): it waits for the learner's session, takes weight
versions through the configured transport, writes its batches and its one-line failure, and sees the
session end (the learner's stop marker, or a new session of a restarted learner)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from composer_jax.rl.exchange.directory import POLL_S, ExchangeError, atomic_write, numbered_file, read_session
from composer_jax.rl.exchange.npz import write_batch
from composer_jax.rl.exchange.transport_device import DeviceWeightClient
from composer_jax.rl.exchange.transport_files import FileWeightClient
from composer_jax.rl.rollout import ProducedBatch


class EngineExchange:
    """The engine's side of one learner session: waits for weight versions (`wait_weights`), writes
    batches (`deliver`), sees the session end (`ended`). `like`: the engine's parameters, abstract
    (`Engine.held_like`: the structure and the layout versions are read into); `release()`: drops the
    weights the engine serves, called before a new version is read; `engine`: this engine's number (of
    rollout.engines)."""

    def __init__(self, root: str | Path, session: dict, like, timeout_s: float, weight_transfer: str = "file",
                 release: Callable[[], None] = lambda: None, engine: int = 0):
        self.root, self.session, self.timeout_s, self.release = Path(root), session, timeout_s, release
        self.dir = self.root / session["session"]
        self.loaded: int | None = None      # the version installed from this session
        self.versions: list[int] = []       # every version loaded, in order
        self.weights = (DeviceWeightClient(self.dir, like, lambda: not self.ended(), timeout_s, engine)
                        if weight_transfer == "device" else FileWeightClient(self.dir, like))

    @staticmethod
    def wait_session(root: str | Path, timeout_s: float, after: str | None = None) -> dict:
        """The learner's session (one other than `after`); ExchangeError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            session = read_session(Path(root))
            if session is not None and session["session"] != after:
                return session
            if time.monotonic() > deadline:
                raise ExchangeError(f"no {'new ' if after else ''}learner session in {root} in {timeout_s:g} s "
                                    "(rollout.engine_timeout_s): is `composer-jax rl` running with the same config?")
            time.sleep(POLL_S)

    def ended(self) -> bool:
        """The learner stopped, or a new learner session replaced this one."""
        current = read_session(self.root)
        return (self.dir / "stop").exists() or current is None or current["session"] != self.session["session"]

    def wait_weights(self, min_version: int) -> tuple[object, int] | None:
        """The newest weights once their version is >= min_version ((None, version) when that version is
        already loaded); None once the session ended; ExchangeError after timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while not self.ended():
            versions = self.weights.versions()
            if versions and versions[-1] >= min_version:
                version = versions[-1]
                if version == self.loaded:
                    return None, version
                self.release()              # the version served is dropped before the next one lands
                self.loaded = None
                weights = self.weights.pull(version)
                if weights is None:         # pruned meanwhile (a newer one is there), or the session ended
                    continue
                self.loaded = version
                self.versions.append(version)
                return weights, version
            if time.monotonic() > deadline:
                raise ExchangeError(f"no weights version >= {min_version} from the learner in {self.timeout_s:g} s "
                                    f"(rollout.engine_timeout_s) in {self.dir}")
            time.sleep(POLL_S)
        return None

    def deliver(self, produced: ProducedBatch) -> None:
        try:
            write_batch(numbered_file(self.dir / "batches", produced.index), produced)
        except FileNotFoundError:       # a new learner session removed this one's directory
            if not self.ended():
                raise

    def fail(self, reason: str) -> None:
        """Tell the learner why the engine stops (one line)."""
        if self.dir.is_dir():
            atomic_write(self.dir / "engine-failed", reason.encode())
