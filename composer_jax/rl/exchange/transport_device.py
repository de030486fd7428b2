"""Weight versions device to device (`rollout.weight_transfer=device`, with rollout.transport=directory):
the learner serves each version from its devices through JAX's transfer server (`jax.experimental.transfer`)
and the engine pulls it straight into its own devices' memory, shard for shard; only small JSON files go
through the exchange directory.

    <session>/engine.json                  the engine's layout: its meshes (axis names, shape, the position of
                                           each device in its device list) and each parameter's path, shape,
                                           dtype, mesh and PartitionSpec
    <session>/learner.json                 the learner's layout, when versions travel in it (below)
    <session>/weights/<version>.json       a version the learner holds, the address of its transfer server, and
                                           the layout it travels in ("engine" or "learner")
    <session>/pulls/<n>.json               the engine asks for a version
    <session>/pulls/<n>.ready.json         the learner's answer: the pull's id, scheduled; or "gone" (a newer
                                           version replaced it: the engine asks for the newest)

A transfer moves shard i of the sender's array to shard i of the receiver's, so both ends must hold a
version in one layout. Where the engine's layout fits on the learner's devices, the learner copies each
parameter (device to device, `jax.device_put`) into it on its own first devices: the engine's meshes
rebuilt with the learner's devices at the same positions, and the engine pulls straight into its own
arrays. Where it does not (an engine with more devices than the learner), the learner holds a copy in its
own layout and describes it (learner.json); the engine rebuilds that layout on its own first devices,
pulls into it, and reshards into its own layout on its devices. Either copy keeps the version safe from
the next step, which donates the parameters. The learner schedules a version only when
the engine asks for it: a pull of one never scheduled hangs, and the transfer server holds a scheduled
version's arrays until they are pulled, so scheduling every version would hold each one the engine skips
forever. The learner itself holds the newest KEEP_VERSIONS copies.

Limits: the learner is one process (its transfer server serves its own devices). The learner's server
listens on its default route's address (COMPOSER_JAX_TRANSFER_HOST overrides it): the engine's host must
reach it.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from composer_jax.rl.exchange.directory import ExchangeError, numbered, numbered_file, prune, write_json
from composer_jax.tree_paths import path_str

KEEP_VERSIONS = 2           # versions the learner holds (the engine may be asking for the one before the newest)
POLL_S = 0.05
ENGINE_FILE = "engine.json"
LEARNER_FILE = "learner.json"    # the learner's layout, when versions travel in it


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


def describe_layout(state, devices: list | None = None) -> dict:
    """The layout of `state` (parameters: arrays with NamedShardings; positions in `devices`, default
    jax.devices()), for engine.json or learner.json."""
    devices = {d.id: i for i, d in enumerate(jax.devices() if devices is None else devices)}
    meshes, params = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        sharding = leaf.sharding
        if not isinstance(sharding, NamedSharding):
            raise ExchangeError(f"parameter '{path_str(path)}' has a {type(sharding).__name__}: weight_transfer=device "
                                "needs NamedShardings")
        mesh = {"axes": list(sharding.mesh.axis_names), "shape": list(sharding.mesh.devices.shape),
                "positions": [devices[d.id] for d in sharding.mesh.devices.flat]}
        if mesh not in meshes:
            meshes.append(mesh)
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        params.append({"path": path_str(path), "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name,
                       "mesh": meshes.index(mesh), "spec": spec})
    return {"devices": len(devices), "meshes": meshes, "params": params}


def devices_used(layout: dict) -> int:
    """How many devices of its side's list a layout's meshes reach into (the highest position + 1)."""
    return 1 + max(max(m["positions"]) for m in layout["meshes"])


def rebuilt_shardings(layout: dict, devices: list) -> dict[str, NamedSharding]:
    """parameter path -> the layout's sharding rebuilt on `devices` (the other side's, at the same positions)."""
    if devices_used(layout) > len(devices):
        raise ExchangeError(f"rollout.weight_transfer=device: a layout over {devices_used(layout)} devices cannot be "
                            f"rebuilt on {len(devices)}")
    meshes = [Mesh(np.array([devices[i] for i in m["positions"]]).reshape(m["shape"]), tuple(m["axes"]))
              for m in layout["meshes"]]
    return {p["path"]: NamedSharding(meshes[p["mesh"]], PartitionSpec(*[tuple(s) if isinstance(s, list) else s
                                                                       for s in p["spec"]]))
            for p in layout["params"]}


class DeviceWeightServer:
    """The learner's side. `offer(state, version)` copies the parameters the engine's layout names into
    that layout and announces the version; a thread schedules a held version for the engine's pull
    when the engine asks. `wait(path, what)`: the exchange's bounded wait for a file (it checks the
    engine's failure and heartbeat)."""

    def __init__(self, session_dir: Path, wait: Callable[[Path, str], None], devices: list | None = None):
        self.dir, self._wait = session_dir, wait
        self.devices = jax.local_devices() if devices is None else devices   # the learner's, in order
        self._server = _server(_host_address())
        self._held: dict[int, list] = {}        # version -> its arrays in the layout sent
        self._paths: list[str] | None = None    # the engine's parameters, in its order
        self._shardings: list | None = None     # the engine's layout on the learner's devices (None: the learner's own)
        self._ids = itertools.count(1)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self.error: Exception | None = None     # the serving thread's failure
        (self.dir / "pulls").mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    def _layout(self, flat: dict) -> None:
        """The engine's parameters and the layout a version travels in: the engine's, rebuilt on the
        learner's devices, where it fits on them; else the learner's own (learner.json), which the engine
        rebuilds on its own first devices and reshards from."""
        self._wait(self.dir / ENGINE_FILE, "the engine's layout (engine.json)")
        layout = json.loads((self.dir / ENGINE_FILE).read_text())
        for p in layout["params"]:
            have = flat.get(p["path"])
            if have is None:
                raise ExchangeError(f"the engine's parameter '{p['path']}' is not among the learner's")
            if (list(have.shape), np.dtype(have.dtype).name) != (p["shape"], p["dtype"]):
                raise ExchangeError(f"parameter '{p['path']}' is {np.dtype(have.dtype).name}{list(have.shape)} in the "
                                    f"learner, {p['dtype']}{p['shape']} in the engine")
        self._paths = [p["path"] for p in layout["params"]]
        if devices_used(layout) <= len(self.devices):
            shardings = rebuilt_shardings(layout, self.devices)
            self._shardings = [shardings[path] for path in self._paths]
        else:
            write_json(self.dir / LEARNER_FILE, describe_layout({p: flat[p] for p in self._paths}, self.devices))

    def offer(self, state, version: int) -> None:
        """Hold `state`'s parameters at `version` (a copy in the engine's layout) and announce them."""
        if self.error is not None:
            raise ExchangeError(f"the learner's weight server failed: {type(self.error).__name__}: {self.error}")
        flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        if self._paths is None:
            self._layout(flat)
        # A copy in the learner's layout first (device_put may reuse a replicated array's shards on a subset of
        # its devices, may_alias=False or not, and the next step donates the parameters), then the engine's.
        arrays = [jnp.copy(flat[p]) for p in self._paths]
        arrays = jax.block_until_ready(arrays if self._shardings is None else jax.device_put(arrays, self._shardings))
        with self._lock:
            self._held[version] = arrays
            for old in sorted(self._held)[:-KEEP_VERSIONS]:
                del self._held[old]
        write_json(numbered_file(self.dir / "weights", version, ".json"),
                   {"version": version, "address": self._server.address(),
                    "layout": "engine" if self._shardings is not None else "learner"})
        prune(self.dir / "weights", KEEP_VERSIONS, ".json")

    def _serve(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                for request in sorted(self.dir.glob("pulls/[0-9]*.json")):
                    if not request.name.endswith(".ready.json") and not request.with_suffix(".ready.json").exists():
                        self._answer(request)
        except Exception as e:  # noqa: BLE001 - reported by the learner's next offer
            self.error = e

    def _answer(self, request: Path) -> None:
        """Schedule the asked version for one pull (its id in the answer), or answer that it is gone."""
        version = json.loads(request.read_text())["version"]
        answer = {"gone": True}
        with self._lock:
            if version in self._held:
                answer = {"version": version, "uuid": next(self._ids)}
                self._server.await_pull(answer["uuid"], self._held[version])
        write_json(request.with_suffix(".ready.json"), answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class DeviceWeightClient:
    """The engine's side: describes its layout (`like`: its parameters) in the session, and pulls a
    version into it (`pull`). `alive()` is False once the session ended; waits end after timeout_s."""

    def __init__(self, session_dir: Path, like, alive: Callable[[], bool], timeout_s: float,
                 devices: list | None = None):
        self.dir, self.like, self.alive, self.timeout_s = session_dir, like, alive, timeout_s
        self.devices = jax.devices() if devices is None else devices   # the engine's, in order
        leaves, self._treedef = jax.tree_util.tree_flatten(like)
        self._structs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        self._server = _server(_host_address())   # to connect from (reachable, should the transport connect back)
        self._connections: dict[str, object] = {}
        self._requests = itertools.count(1)
        layout = describe_layout(like, self.devices)
        self._paths = [p["path"] for p in layout["params"]]
        self._landing: list | None = None      # the learner's layout on this engine's first devices
        write_json(self.dir / ENGINE_FILE, layout)

    def _structs_for(self, layout: str) -> list:
        """What a pull lands in: the engine's layout, or the learner's rebuilt on this engine's devices
        (learner.json; the engine has more devices than the learner, or another shape of grid)."""
        if layout == "engine":
            return self._structs
        if self._landing is None:
            shardings = rebuilt_shardings(json.loads((self.dir / LEARNER_FILE).read_text()), self.devices)
            self._landing = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[path])
                             for x, path in zip(self._structs, self._paths)]
        return self._landing

    def versions(self) -> list[int]:
        return numbered(self.dir / "weights", ".json")

    def pull(self, version: int):
        """The parameters at `version`, in the engine's layout; None if the learner no longer holds it
        (or the session ended)."""
        try:
            announced = json.loads(numbered_file(self.dir / "weights", version, ".json").read_text())
        except FileNotFoundError:
            return None
        address, structs = announced["address"], self._structs_for(announced["layout"])
        request = numbered_file(self.dir / "pulls", next(self._requests), ".json")
        write_json(request, {"version": version})
        ready, deadline = request.with_suffix(".ready.json"), time.monotonic() + self.timeout_s
        while not ready.exists():
            if not self.alive():
                return None
            if time.monotonic() > deadline:
                raise ExchangeError(f"the learner did not answer the pull of version {version} in {self.timeout_s:g} s "
                                    f"(rollout.engine_timeout_s) in {self.dir}")
            time.sleep(POLL_S)
        answer = json.loads(ready.read_text())
        if answer.get("gone"):
            request.unlink()
            ready.unlink()
            return None
        if address not in self._connections:
            self._connections[address] = self._server.connect(address)
        arrays = self._within_timeout(lambda: jax.block_until_ready(
            self._connections[address].pull(answer["uuid"], structs)), f"the pull of version {version}")
        request.unlink()
        ready.unlink()
        if structs is not self._structs:        # resharded into the engine's own layout, on its devices
            arrays = jax.device_put(arrays, [x.sharding for x in self._structs])
        return jax.tree_util.tree_unflatten(self._treedef, arrays)

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


def _result(fn) -> tuple[bool, object]:
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - re-raised on the calling thread
        return False, e
