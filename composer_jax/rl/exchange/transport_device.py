"""Weight versions device to device (`rollout.weight_transfer=device`, with rollout.transport=directory):
every learner process serves its own shards of each version from its devices through JAX's transfer
server (`jax.experimental.transfer`), and every engine pulls, from every learner process, the pieces its
parameters are made of straight into its own devices' memory, then assembles them into its own layout;
only small JSON files go through the exchange directory.

    <session>/servers/<p>.json              learner process p's transfer server address
    <session>/engines/<k>.json              engine k's parameters: path, shape, dtype (what it pulls)
    <session>/weights/<version>.json        a version the learner holds, and how many processes serve it
    <session>/pulls/<k>/<n>.json            engine k asks for a version
    <session>/pulls/<k>/<n>.<p>.json        process p's answer: the pull's id and the pieces it sends (each a
                                            parameter's index and its block of that parameter); or "gone" (a
                                            newer version replaced it: the engine asks for the newest); or an
                                            error (the engine's parameters are not the learner's)

Pieces: a process sends each parameter's shards on its devices that are the first replica of their block
(`Shard.replica_id == 0`), so the processes' pieces of a parameter are disjoint and cover it once. No
process gathers anything: the learner keeps a copy of its own pieces of the newest KEEP_VERSIONS versions
(the next step donates the parameters), on its devices. That copy is the whole buffer a version needs on
the learner's side: its own unique shards per version held (on a CPU learner, host memory).

An engine lands each piece on the device of its own layout whose block holds it (or overlaps it most),
then builds each of its devices' blocks from the pieces that overlap it, a device-to-device copy where a
piece landed elsewhere; so an engine may have more or fewer devices than the learner, and a layout of
its own. The learner schedules a version for an engine only when that engine asks for it: a pull of one
never scheduled hangs, and the transfer server holds a scheduled version's arrays until they are pulled.

The learner's servers listen on their hosts' default route addresses (COMPOSER_JAX_TRANSFER_HOST
overrides it): the engines' hosts must reach them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from composer_jax.rl.exchange.directory import ExchangeError, numbered, numbered_file, prune, write_json
from composer_jax.tree_paths import path_str

KEEP_VERSIONS = 2           # versions the learner holds (an engine may be asking for the one before the newest)
POLL_S = 0.05

Block = tuple[tuple[int, int], ...]     # [start, stop) along each axis of a parameter


def _server(host: str):
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


def _host_address() -> str:
    """The address an engine on another host connects to: COMPOSER_JAX_TRANSFER_HOST if set, else the
    address of the interface of this host's default route (a host name may resolve to loopback), else
    the host name's address."""
    if os.environ.get("COMPOSER_JAX_TRANSFER_HOST"):
        return os.environ["COMPOSER_JAX_TRANSFER_HOST"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))          # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def flat_parameters(tree) -> dict:
    """{dotted parameter name: leaf}: the names both transports give a version's arrays."""
    return {path_str(p, "."): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _block(index: tuple, shape: tuple[int, ...]) -> Block:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _overlap(a: Block, b: Block) -> Block | None:
    both = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return both if all(lo < hi for lo, hi in both) else None


def _size(block: Block) -> int:
    return math.prod(hi - lo for lo, hi in block)


def _within(block: Block, outer: Block) -> tuple[slice, ...]:
    """`block`'s position inside `outer`, as slices."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(block, outer))


class DeviceWeightServer:
    """A learner process's side (every process of a group runs one). `offer(state, version)` keeps a copy
    of this process's pieces of the version and announces it (process 0); a thread answers each engine's
    pull of a held version with the pieces of that engine's parameters, scheduled under a fresh id."""

    def __init__(self, session_dir: Path):
        self.dir = session_dir
        self._server = _server(_host_address())
        self._held: dict[int, dict[str, tuple]] = {}    # version -> parameter -> (shape, dtype, [(block, array)])
        self._engines: dict[int, list[str]] = {}        # engine -> its parameters, in its order
        self._ids = itertools.count(1)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self.error: Exception | None = None             # the serving thread's failure
        self.process = jax.process_index()
        for sub in ("pulls", "weights", "servers"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        write_json(self.dir / "servers" / f"{self.process}.json", {"address": self._server.address()})
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    def offer(self, state, version: int) -> None:
        """Hold a copy of this process's pieces of `state` at `version` and (process 0) announce it."""
        if self.error is not None:
            raise ExchangeError(f"the learner's weight server failed: {type(self.error).__name__}: {self.error}")
        pieces = {}
        for name, x in flat_parameters(state).items():
            # A real copy on the shard's device: the next step donates the parameters.
            pieces[name] = (list(x.shape), np.dtype(x.dtype).name,
                            [(_block(s.index, x.shape), jax.device_put(s.data, s.device, may_alias=False))
                             for s in x.addressable_shards if s.replica_id == 0])
        jax.block_until_ready([a for _, _, p in pieces.values() for _, a in p])
        with self._lock:
            self._held[version] = pieces
            for old in sorted(self._held)[:-KEEP_VERSIONS]:
                del self._held[old]
        if self.process == 0:
            write_json(numbered_file(self.dir / "weights", version, ".json"),
                       {"version": version, "processes": jax.process_count()})
            prune(self.dir / "weights", KEEP_VERSIONS, ".json")

    def _serve(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                for request in sorted(self.dir.glob("pulls/*/[0-9]*.json")):
                    answer = request.with_suffix(f".{self.process}.json")
                    if request.stem.isdigit() and not answer.exists():
                        try:
                            self._answer(int(request.parent.name), request, answer)
                        except FileNotFoundError:   # the engine gave the request up (its session ended)
                            pass
        except Exception as e:  # noqa: BLE001 - reported by the learner's next offer
            self.error = e

    def _answer(self, engine: int, request: Path, answer_path: Path) -> None:
        """Schedule the asked version's pieces of the engine's parameters for one pull (its id and the pieces
        in the answer), answer that it is gone, or wait (a version this process has not offered yet)."""
        version = json.loads(request.read_text())["version"]
        with self._lock:
            if version not in self._held:
                if not self._held or version > max(self._held):
                    return          # this process is behind the one that announced it: answered once offered
                answer = {"gone": True}
            else:
                try:
                    names = self._parameters(engine, self._held[version])
                except ExchangeError as e:
                    write_json(answer_path, {"error": str(e)})
                    raise
                pieces = [(i, block, array) for i, name in enumerate(names)
                          for block, array in self._held[version][name][2]]
                answer = {"version": version, "uuid": next(self._ids),
                          "pieces": [[i, [list(b) for b in block]] for i, block, _ in pieces]}
                self._server.await_pull(answer["uuid"], [array for _, _, array in pieces])
        write_json(answer_path, answer)

    def _parameters(self, engine: int, held: dict) -> list[str]:
        """Engine `engine`'s parameters (engines/<k>.json), checked against a version's: names, shapes, dtypes."""
        if engine not in self._engines:
            wanted = json.loads((self.dir / "engines" / f"{engine}.json").read_text())["params"]
            for p in wanted:
                if p["path"] not in held:
                    raise ExchangeError(f"engine {engine}'s parameter '{p['path']}' is not among the learner's")
                shape, dtype, _ = held[p["path"]]
                if (shape, dtype) != (p["shape"], p["dtype"]):
                    raise ExchangeError(f"parameter '{p['path']}' is {dtype}{shape} in the learner, "
                                        f"{p['dtype']}{p['shape']} in engine {engine}")
            self._engines[engine] = [p["path"] for p in wanted]
        return self._engines[engine]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class DeviceWeightClient:
    """Engine `engine`'s side: names its parameters (`like`: its parameters, their shardings the layout a
    version is assembled in) in the session, and pulls a version from every learner process (`pull`).
    `alive()` is False once the session ended; waits end after timeout_s."""

    def __init__(self, session_dir: Path, like, alive: Callable[[], bool], timeout_s: float, engine: int = 0):
        self.dir, self.alive, self.timeout_s, self.engine = session_dir, alive, timeout_s, engine
        flat = flat_parameters(like)
        self._names, self._like = list(flat), list(flat.values())
        self._treedef = jax.tree_util.tree_structure(like)
        self._targets = [x.sharding.devices_indices_map(x.shape) for x in self._like]  # device -> its block's index
        self._server = _server(_host_address())   # to connect from (reachable, should the transport connect back)
        self._connections: dict[str, object] = {}
        self._requests = itertools.count(1)
        (self.dir / "pulls" / str(engine)).mkdir(parents=True, exist_ok=True)
        (self.dir / "engines").mkdir(parents=True, exist_ok=True)
        write_json(self.dir / "engines" / f"{engine}.json",
                   {"params": [{"path": n, "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
                               for n, x in zip(self._names, self._like)]})

    def versions(self) -> list[int]:
        return numbered(self.dir / "weights", ".json")

    def pull(self, version: int):
        """The parameters at `version`, in the engine's layout; None if the learner no longer holds it
        (or the session ended)."""
        try:
            announced = json.loads(numbered_file(self.dir / "weights", version, ".json").read_text())
        except FileNotFoundError:
            return None
        request = numbered_file(self.dir / "pulls" / str(self.engine), next(self._requests), ".json")
        write_json(request, {"version": version})
        answers = [self._answer(request, p, version) for p in range(announced["processes"])]
        scheduled = {p: a for p, a in enumerate(answers) if a is not None and not a.get("gone")}
        ready, keep = [], []
        for process, answer in scheduled.items():
            address = json.loads((self.dir / "servers" / f"{process}.json").read_text())["address"]
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            pieces = [(i, tuple(map(tuple, block))) for i, block in answer["pieces"]]
            structs = [jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in block), self._like[i].dtype,
                                            sharding=SingleDeviceSharding(self._landing(i, block)))
                       for i, block in pieces]
            ready.append((self._connections[address], answer["uuid"], structs))
            keep.append(pieces)
        # Every scheduled pull runs, even where another process answered "gone": its server holds the arrays
        # until they are pulled.
        arrays = self._within_timeout(lambda: jax.block_until_ready(
            [c.pull(uuid, structs) for c, uuid, structs in ready]), f"the pull of version {version}")
        for path in request.parent.glob(f"{request.stem}.*"):      # the request and its answers
            path.unlink(missing_ok=True)
        if len(scheduled) < len(answers):       # the session ended, or a newer version replaced this one
            return None
        pulled = [[] for _ in self._names]
        for pieces, got in zip(keep, arrays):
            for (i, block), array in zip(pieces, got):
                pulled[i].append((block, array))
        del arrays
        out = []
        for i in range(len(pulled)):        # each parameter's pieces dropped once it is assembled
            out.append(self._assemble(i, pulled[i]))
            pulled[i] = None
        return jax.tree_util.tree_unflatten(self._treedef, out)

    def _answer(self, request: Path, process: int, version: int) -> dict | None:
        """Learner process `process`'s answer to `request` (None: the session ended first)."""
        path, deadline = request.with_suffix(f".{process}.json"), time.monotonic() + self.timeout_s
        while not path.exists():
            if not self.alive():
                return None
            if time.monotonic() > deadline:
                raise ExchangeError(f"learner process {process} did not answer the pull of version {version} in "
                                    f"{self.timeout_s:g} s (rollout.engine_timeout_s) in {self.dir}")
            time.sleep(POLL_S)
        answer = json.loads(path.read_text())
        if "error" in answer:
            raise ExchangeError(answer["error"])
        return answer

    def _landing(self, i: int, block: Block):
        """The engine device a piece of parameter i lands on: the first whose block holds it, else the one
        whose block overlaps it most."""
        shape = self._like[i].shape
        overlaps = []
        for device, index in self._targets[i].items():
            both = _overlap(block, _block(index, shape))
            overlaps.append((0 if both is None else _size(both), device))
        return max(overlaps, key=lambda o: o[0])[1]

    def _assemble(self, i: int, pieces: list[tuple[Block, jax.Array]]) -> jax.Array:
        """Parameter i in the engine's sharding, from the pieces pulled (disjoint blocks covering it)."""
        like, built = self._like[i], {}
        if sum(_size(b) for b, _ in pieces) != math.prod(like.shape):
            raise ExchangeError(f"the learner's pieces of '{self._names[i]}' do not cover its shape {list(like.shape)}")
        per_device = []
        for device, index in self._targets[i].items():
            block = _block(index, like.shape)
            if block not in built:
                built[block] = self._block(block, pieces, like.dtype, device)
            per_device.append(jax.device_put(built[block], device))
        return jax.make_array_from_single_device_arrays(like.shape, like.sharding, per_device)

    @staticmethod
    def _block(block: Block, pieces, dtype, device) -> jax.Array:
        """One block of a parameter on `device`, from the pieces that overlap it."""
        parts = [(_overlap(block, b), b, a) for b, a in pieces]
        parts = [(o, b, a) for o, b, a in parts if o is not None]
        if len(parts) == 1 and parts[0][0] == block == parts[0][1]:
            return jax.device_put(parts[0][2], device)
        axis = _tiling_axis(block, parts)
        if axis is not None:        # whole pieces side by side along one axis (the usual FSDP rows): one op
            ordered = sorted(parts, key=lambda p: p[1][axis][0])
            return jnp.concatenate([jax.device_put(a, device) for _, _, a in ordered], axis=axis)
        out = jnp.zeros(tuple(hi - lo for lo, hi in block), dtype, device=device)
        for both, b, a in parts:
            out = out.at[_within(both, block)].set(jax.device_put(a[_within(both, b)], device))
        return out

    def _within_timeout(self, fn, what: str):
        """fn() on a helper thread, or ExchangeError after timeout_s (a pull from a learner that died
        mid-transfer never returns)."""
        out: list = []
        thread = threading.Thread(target=lambda: out.append(_result(fn)), name="weight-pull", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not out:
            raise ExchangeError(f"{what} from the learner did not finish in {self.timeout_s:g} s "
                                "(rollout.engine_timeout_s)")
        ok, value = out[0]
        if not ok:
            raise value
        return value


def _tiling_axis(block: Block, parts: list) -> int | None:
    """The axis along which the parts' pieces, each whole, lie side by side to make up `block`, or None."""
    if not parts or any(overlap != piece for overlap, piece, _ in parts):
        return None
    spans = [[a for a, (lo, hi) in enumerate(piece) if (lo, hi) != block[a]] for _, piece, _ in parts]
    axes = {a for s in spans for a in s}
    if len(axes) != 1 or any(len(s) != 1 for s in spans):
        return None
    axis = axes.pop()
    covered = sum(piece[axis][1] - piece[axis][0] for _, piece, _ in parts)
    return axis if covered == block[axis][1] - block[axis][0] else None


def _result(fn) -> tuple[bool, object]:
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - re-raised on the calling thread
        return False, e
