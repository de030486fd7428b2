"""The directory transport between the RL learner and a rollout engine in another process
(`rollout.transport=directory`; the engine: `composer-jax rl-engine`, `rl.remote_engine`).

The exchange directory (`rollout.exchange_dir`, default RUN_DIR/exchange) lies on a filesystem both
hosts see:

    session.json                      the learner's running session: id, first batch index, each engine's
                                      sampler and group state
    engine-heartbeat[-<k>]            a counter engine k (0: no suffix) rewrites every HEARTBEAT_S while it runs
    <session>/weights/<version>.npz   the policy's parameters at a version (parameter path -> array);
                                      the newest KEEP_VERSIONS kept (weight_transfer=device: weight_transfer.py)
    <session>/batches/<index>.npz     one ProducedBatch for policy version `index`, by engine index % rollout.engines;
                                      removed at the learner's next publish
    <session>/stop                    the learner is done: the engine exits
    <session>/engine-failed           the engine's one-line failure: the learner stops with it

Every file is written under a hidden temporary name in its directory, then renamed (atomic on POSIX):
a reader sees a whole file or none. Files are npz (arrays) with one JSON member (`__meta__`) for the
rest; nothing is pickled. A restarted learner starts a new session (and removes the previous one), so
an engine never mixes weights or batches of two runs; a running engine follows the new session.

A learner that has seen the engine's heartbeat change and then sees it stand still for
HEARTBEAT_GRACE_S (or rollout.engine_timeout_s, if shorter) stops with one line naming the engine's
host and process: a killed engine is noticed in seconds, not at the batch timeout. (The learner's own
clock times the silence, so the hosts' clocks need not agree.)

Weights go through the directory as versioned snapshots (`rollout.weight_transfer=file`: works wherever
both processes see one filesystem, at the cost of a host round trip and a write per version), or device
to device (`weight_transfer=device`, rl/weight_transfer.py: JAX's transfer server; the directory then
carries only small JSON files: the engine's layout, version announcements, pull requests).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import to_dict
from composer_jax.envs.monitor import Finding, Report
from composer_jax.parallel.distributed import agree, to_host
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.rollout import ProducedBatch
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.sampler import Prompt
from composer_jax.tree_paths import path_str

# What the engine's batches depend on: these settings must be the learner's (paths may differ by host).
ENGINE_SECTIONS = ("model", "rollout", "env", "rewards", "sampler", "monitor", "seed", "rl.group_size",
                   "rl.max_staleness")
HOST_LOCAL = {"rollout.exchange_dir", "rollout.engine_timeout_s", "rollout.devices", "env.tasks_dir", "env.eval_dir",
              "env.repo"}
KEEP_VERSIONS = 3           # weight versions kept in the directory (an engine may still be reading an older one)
POLL_S = 0.1
SESSION_FILE = "session.json"
HEARTBEAT_FILE = "engine-heartbeat"
HEARTBEAT_S = 2.0           # how often the engine beats
HEARTBEAT_GRACE_S = 30.0    # a heartbeat that stood still this long: the engine is gone
META = "__meta__"


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


def pack(arrays: list[np.ndarray], meta: dict) -> bytes:
    """npz bytes: arrays a0, a1, ... and the JSON `meta`. Dtypes numpy cannot store (bfloat16, float8:
    kind 'V') travel as unsigned integers of their width, their names in meta['dtypes']."""
    stored, dtypes = {}, {}
    for i, array in enumerate(arrays):
        array = np.ascontiguousarray(array)
        if array.dtype.kind == "V":
            dtypes[str(i)] = array.dtype.name
            array = array.view(f"u{array.dtype.itemsize}")
        stored[f"a{i}"] = array
    buffer = io.BytesIO()
    np.savez(buffer, **stored, **{META: np.frombuffer(json.dumps({**meta, "dtypes": dtypes}).encode(), np.uint8)})
    return buffer.getvalue()


def unpack(path: Path) -> tuple[list[np.ndarray], dict]:
    """(arrays, meta) of a file `pack` wrote."""
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(npz[META].tobytes().decode())
        count = len(npz.files) - 1
        arrays = [npz[f"a{i}"] for i in range(count)]
    for i, name in meta.pop("dtypes").items():
        arrays[int(i)] = arrays[int(i)].view(jnp.dtype(name))
    return arrays, meta


# -- weights -----------------------------------------------------------------------------------------


def write_weights(path: Path, state, version: int) -> None:
    """The parameters `state` (an nnx.State or any pytree of arrays) as a flat parameter path -> array file.
    In a process group every process calls it (the arrays are gathered) and process 0 writes."""
    flat = jax.tree_util.tree_flatten_with_path(to_host(state))[0]
    if jax.process_index() == 0:
        atomic_write(path, pack([np.asarray(x) for _, x in flat], {"version": version,
                                                                     "paths": [path_str(p) for p, _ in flat]}))


def read_weights(path: Path, like):
    """(a pytree shaped like `like` holding the file's arrays, version): every parameter of `like` by its
    path; shapes and dtypes are checked where the weights are installed (`Engine.place_weights`)."""
    arrays, meta = unpack(path)
    by_path = dict(zip(meta["paths"], arrays))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    missing = [path_str(p) for p, _ in leaves if path_str(p) not in by_path]
    if missing:
        raise ExchangeError(f"{path}: no parameter '{missing[0]}' ({len(missing)} of the engine's model missing)")
    return jax.tree_util.tree_unflatten(treedef, [by_path[path_str(p)] for p, _ in leaves]), meta["version"]


# -- batches -----------------------------------------------------------------------------------------


def write_batch(path: Path, produced: ProducedBatch) -> None:
    fields = [k for k in RolloutBatch._fields if getattr(produced.batch, k) is not None]
    meta = {"index": produced.index, "fields": fields, "draws": produced.draws,
            "trained": [list(p) for p in produced.trained], "feedback_only": produced.feedback_only,
            "metrics": produced.metrics,
            "reports": [[key, [dataclasses.asdict(f) for f in report.findings]] for key, report in produced.reports],
            "sampler_state": produced.sampler_state, "group_counts": produced.group_counts,
            "busy": list(produced.busy)}
    atomic_write(path, pack([*(getattr(produced.batch, k) for k in fields), produced.row_versions], meta))


def read_batch(path: Path) -> ProducedBatch:
    arrays, meta = unpack(path)
    batch = RolloutBatch(**dict(zip(meta["fields"], arrays)))
    return ProducedBatch(meta["index"], batch, meta["draws"], [Prompt(*p) for p in meta["trained"]],
                         meta["feedback_only"], arrays[-1], meta["metrics"], [(key, Report(tuple(Finding(**f) for f in findings)))
                                           for key, findings in meta["reports"]],
                         meta["sampler_state"], meta["group_counts"], tuple(meta["busy"]))


# -- the settings both sides must share ---------------------------------------------------------------


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()} if tree else {}


def engine_settings(cfg: RLRunConfig) -> dict:
    """The dotted settings the engine's batches depend on (ENGINE_SECTIONS, host-local paths left out), in
    their JSON form (as the session file carries them)."""
    flat = {k.rstrip("."): v for k, v in _flatten(to_dict(cfg)).items()}
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in HOST_LOCAL
                                  and any(k == s or k.startswith(s + ".") for s in ENGINE_SECTIONS)}))


def check_same_settings(learner: dict, engine: dict) -> None:
    """ExchangeError naming the first setting where the engine's config differs from the learner's."""
    for key in sorted(learner.keys() | engine.keys()):
        if learner.get(key) != engine.get(key):
            raise ExchangeError(f"the engine's config differs from the learner's at '{key}' ({engine.get(key)!r}, "
                                f"the learner's {learner.get(key)!r}): start both with the same config and overrides")


# -- the directory ------------------------------------------------------------------------------------


def numbered(directory: Path, suffix: str = ".npz") -> list[int]:
    """The numbers of the whole files `<n><suffix>` in `directory`, ascending (temporary files skipped)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name[:-len(suffix)]) for p in directory.glob(f"[0-9]*{suffix}"))


def numbered_file(directory: Path, n: int, suffix: str = ".npz") -> Path:
    return directory / f"{n:08d}{suffix}"


def prune(directory: Path, keep: int, suffix: str = ".npz") -> None:
    """Remove all but the newest `keep` numbered files."""
    for old in numbered(directory, suffix)[:-keep]:
        numbered_file(directory, old, suffix).unlink(missing_ok=True)


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


def read_session(root: Path) -> dict | None:
    try:
        return json.loads((root / SESSION_FILE).read_text())
    except FileNotFoundError:
        return None


class LearnerExchange:
    """The learner's side, with the calls of RolloutProducer's learner side (start, publish, next_batch,
    stop). `start_index`: the first batch's policy version; `engine_states`: per engine ({"sampler",
    "groups"}), the sampler and group state it starts from (the checkpoint's on a resumed run); batch i
    comes from engine i % len(engine_states); `timeout_s`: how long next_batch waits; `settings`: the
    learner's `engine_settings`, which each engine checks its own against.

    A learner of several processes (a process group) calls every method in every process: process 0
    writes the session, the weights and the stop marker; each process reads every batch. A batch file is
    removed at the next `publish`, a collective every process reaches only after reading it."""

    def __init__(self, root: str | Path, *, start_index: int, engine_states: list[dict], timeout_s: float,
                 settings: dict | None = None, weight_transfer: str = "file"):
        self.root, self.index, self.timeout_s = Path(root), start_index, timeout_s
        self.weight_transfer, self.weights = weight_transfer, None   # WeightServer: weight_transfer=device
        n = len(engine_states)
        self.heartbeats = [HeartbeatWatch(self.root, min(HEARTBEAT_GRACE_S, timeout_s), k,
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
        if jax.process_index() != 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        previous = read_session(self.root)
        if previous is not None:
            shutil.rmtree(self.root / previous["session"], ignore_errors=True)
        (self.dir / "weights").mkdir(parents=True)
        (self.dir / "batches").mkdir()
        if self.weight_transfer == "device":
            from composer_jax.rl.weight_transfer import WeightServer

            self.weights = WeightServer(self.dir, self._wait_for)
        atomic_write(self.root / SESSION_FILE, json.dumps(self.session).encode())

    def publish(self, state, version: int) -> None:
        """Policy parameters at `version`, copied now (the next step may donate them): to the host and the
        directory, or (weight_transfer=device) into the engine's layout on this learner's devices."""
        if self.weights is not None:
            self.weights.offer(state, version)
        else:
            write_weights(numbered_file(self.dir / "weights", version), state, version)
        if jax.process_index() == 0:
            if self.weights is None:
                prune(self.dir / "weights", KEEP_VERSIONS)
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


class EngineExchange:
    """The engine's side of one learner session: waits for weight versions (`wait_weights`), writes
    batches (`deliver`), sees the session end (`ended`)."""

    def __init__(self, root: str | Path, session: dict, like, timeout_s: float, weight_transfer: str = "file"):
        self.root, self.session, self.like, self.timeout_s = Path(root), session, like, timeout_s
        self.dir = self.root / session["session"]
        self.loaded: int | None = None      # the version installed from this session
        self.versions: list[int] = []       # every version loaded, in order
        self.weights = None                 # WeightClient: weight_transfer=device
        if weight_transfer == "device":
            from composer_jax.rl.weight_transfer import WeightClient

            self.weights = WeightClient(self.dir, like, lambda: not self.ended(), timeout_s)

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
            versions = self.weights.versions() if self.weights is not None else numbered(self.dir / "weights")
            if versions and versions[-1] >= min_version:
                version = versions[-1]
                if version == self.loaded:
                    return None, version
                weights = self._load(version)
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

    def _load(self, version: int):
        if self.weights is not None:
            return self.weights.pull(version)
        try:
            return read_weights(numbered_file(self.dir / "weights", version), self.like)[0]
        except FileNotFoundError:
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
