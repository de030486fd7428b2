"""The learner's end of the exchange (`LearnerExchange`): it opens a session, publishes weight versions
through the configured transport, and reads the engines' batches in order, stopping with one line when an
engine failed, fell silent (its heartbeat) or sent nothing within rollout.engine_timeout_s."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import jax

from composer_jax.parallel.distributed import agree
from composer_jax.rl.exchange import heartbeat
from composer_jax.rl.exchange.directory import (POLL_S, SESSION_FILE, ExchangeError, atomic_write, numbered_file,
                                                read_session, write_json)
from composer_jax.rl.exchange.heartbeat import HeartbeatWatch
from composer_jax.rl.exchange.npz import read_batch
from composer_jax.rl.exchange.transport_device import DeviceWeightServer
from composer_jax.rl.exchange.transport_files import FileWeightServer
from composer_jax.rl.rollout import ProducedBatch


class LearnerExchange:
    """The learner's side, with the calls of RolloutProducer's learner side (start, publish, next_batch,
    stop). `start_index`: the first batch's policy version; `engine_states`: per engine ({"sampler",
    "groups"}), the sampler and group state it starts from (the checkpoint's on a resumed run); batch i
    comes from engine i % len(engine_states); `timeout_s`: how long next_batch waits; `settings`: the
    learner's `engine_settings`, which each engine checks its own against; `weight_transfer`: 'file' or
    'device' (the transport of weight versions).

    A learner of several processes (a process group) calls every method in every process: process 0
    writes the session, the weights and the stop marker; each process reads every batch. A batch file is
    removed at the next `publish`, a collective every process reaches only after reading it."""

    def __init__(self, root: str | Path, *, start_index: int, engine_states: list[dict], timeout_s: float,
                 settings: dict | None = None, weight_transfer: str = "file"):
        self.root, self.index, self.timeout_s = Path(root), start_index, timeout_s
        self.weight_transfer = weight_transfer
        self.weights: FileWeightServer | DeviceWeightServer | None = None    # from `start`
        n = len(engine_states)
        self.heartbeats = [HeartbeatWatch(self.root, min(heartbeat.HEARTBEAT_GRACE_S, timeout_s), k,
                                          "the rollout engine" if n == 1 else f"rollout engine {k} of {n}")
                           for k in range(n)]
        self.session = {"session": uuid.uuid4().hex[:12], "start": start_index, "engines": engine_states,
                        "settings": settings or {}}
        self.dir = self.root / self.session["session"]
        self._read: list[Path] = []         # batch files read, removed at the next publish

    def start(self) -> None:
        """Open a new session (the previous run's removed: only the one session.json names, since the
        directory may hold other files)."""
        self.session["session"] = agree(self.session["session"])    # process 0's, in a group
        self.dir = self.root / self.session["session"]
        if jax.process_index() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            previous = read_session(self.root)
            if previous is not None:
                shutil.rmtree(self.root / previous["session"], ignore_errors=True)
            (self.dir / "weights").mkdir(parents=True, exist_ok=True)   # another process's server may be first
            (self.dir / "batches").mkdir(exist_ok=True)
        # Every process serves its own shards (device) or writes them (file).
        self.weights = DeviceWeightServer(self.dir) if self.weight_transfer == "device" else FileWeightServer(self.dir)
        if jax.process_index() == 0:
            write_json(self.root / SESSION_FILE, self.session)

    def publish(self, state, version: int) -> None:
        """Policy parameters at `version`, copied now (the next step may donate them): to the host and the
        directory, or (weight_transfer=device) a copy of this process's shards on its devices, for the engines
        to pull."""
        self.weights.offer(state, version)
        if jax.process_index() == 0:
            for path in self._read:
                path.unlink(missing_ok=True)
        self._read.clear()

    def _wait_for(self, path: Path, what: str, engine: int = 0) -> None:
        """Until `path` exists (`engine` writes it); ExchangeError once an engine failed, that engine's heartbeat
        stood still or timeout_s passed."""
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            failed = self.dir / "engine-failed"
            if failed.exists():
                raise ExchangeError(f"the rollout engine failed: {failed.read_text().strip()}")
            self.heartbeats[engine].check()
            if time.monotonic() > deadline:
                raise ExchangeError(f"no {what} from the rollout engine (composer-jax rl-engine) in "
                                    f"{self.timeout_s:g} s (rollout.engine_timeout_s) in {self.dir.parent}: "
                                    "is it running with the same config?")
            time.sleep(POLL_S)

    def next_batch(self) -> ProducedBatch:
        """The batch for the next index (waits up to timeout_s; ExchangeError if the engine failed or is silent)."""
        path = numbered_file(self.dir / "batches", self.index)
        engine = self.index % len(self.heartbeats)
        self._wait_for(path, f"batch {self.index}" + (f" (engine {engine})" if len(self.heartbeats) > 1 else ""),
                       engine)
        produced = read_batch(path)
        self._read.append(path)
        self.index += 1
        return produced

    def stop(self) -> None:
        if self.weights is not None:
            self.weights.close()
        if self.dir.is_dir() and jax.process_index() == 0:
            atomic_write(self.dir / "stop", b"")
