"""One process of a learner group of 2 x 4 devices publishing weight versions (started by
tests/test_distributed.py), or the engine pulling them: a parameter tree of 8 float32 [1024, 2048] arrays
(64 MiB), each sharded over all 8 devices of both processes (32 MiB of shards a process), built shard by
shard; then, each measured by a thread sampling this process's resident memory every 2 ms:

1. the device transport: `DeviceWeightServer.offer` of the tree as version 1, until the engine pulled it;
2. the same for version 2, the tree's INT4 words and scales (`model.quant.quantize_experts`, as the learner
   quantizes the routed experts for INT4 engines), quantizing included;
3. `FileWeightServer.offer` of the tree as version 1 (the exchange's file transport), in WORK_DIR/files;
4. `parallel.distributed.to_host` of the tree (the whole model gathered onto every host: the measurement's
   reference, it must see about 64 MiB; after the offers, so memory they freed can only lower it).

    python -m tests.transfer_memory_process PROCESS_ID PORT WORK_DIR     # PROCESS_ID "engine": the engine

A learner process prints one JSON line: {"process", "own_bytes", "model_bytes", "gather_peak", "offer_peak",
"device_peak", "int4_peak"} (peaks above the resident memory before each). The engine (2 devices) pulls
versions 1 and 2 through `DeviceWeightClient`, checks them against the tree and the reference quantizer,
and writes WORK_DIR/pulled-<version> after each.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

LEAVES, SHAPE = 8, (1024, 2048)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_above_start(fn) -> tuple[object, int]:
    """(fn(), the largest resident memory while it ran less the resident memory before it)."""
    start, peak, done = _resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], _resident_bytes()) - start


def _int4(tree):
    from flax import nnx

    from composer_jax.model.quant import quantize_experts

    return quantize_experts([((name,), nnx.Param(x)) for name, x in tree.items()], frozenset((n,) for n in tree))


def _wait_for(path: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} in {timeout_s} s")
        time.sleep(0.01)


def engine(work_dir: Path) -> int:
    """Pull versions 1 (float) and 2 (INT4) onto 2 devices, each checked bit for bit."""
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(2)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.rl.exchange.transport_device import DeviceWeightClient, flat_parameters

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P(None, "x"))
    like = {f"layer{k}": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding) for k in range(LEAVES)}
    want = {1: {f"layer{k}": np.full(SHAPE, float(k), np.float32) for k in range(LEAVES)}}
    want[2] = {n: np.asarray(x) for n, x in flat_parameters(_int4(jax.device_put(want[1]))).items()}
    for version in (1, 2):
        abstract = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for n, x in want[version].items()}
        client = DeviceWeightClient(work_dir, like if version == 1 else abstract, alive=lambda: True,
                                    timeout_s=240, engine=version - 1)
        _wait_for(work_dir / "weights" / f"{version:08d}.json")
        pulled = client.pull(version)
        for name, x in want[version].items():
            assert np.asarray(pulled[name]).tobytes() == x.tobytes(), (version, name)
        (work_dir / f"pulled-{version}").write_text("")
    return 0


def main(argv: list[str]) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if argv[0] == "engine":
        return engine(Path(argv[2]))
    process_id, port, work_dir = int(argv[0]), int(argv[1]), Path(argv[2])
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(4)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.distributed import ProcessGroup, initialize, to_host
    from composer_jax.rl.exchange.transport_device import DeviceWeightServer
    from composer_jax.rl.exchange.transport_files import FileWeightServer

    watchdog = initialize(ProcessGroup(f"localhost:{port}", 2, process_id, "flags"),
                          peer_timeout_s=240, init_timeout_s=240, label="transfer_memory_process")
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))

    def leaf(k):
        return jax.make_array_from_callback(
            SHAPE, sharding, lambda index: np.full(SHAPE, float(k), np.float32)[index])

    tree = {f"layer{k}": leaf(k) for k in range(LEAVES)}
    _int4({"warm": leaf(0)})                        # compiled before it is measured
    server = DeviceWeightServer(work_dir)
    _, device_peak = peak_above_start(lambda: (server.offer(tree, 1), _wait_for(work_dir / "pulled-1")))
    _, int4_peak = peak_above_start(lambda: (server.offer(_int4(tree), 2), _wait_for(work_dir / "pulled-2")))
    server.close()
    server = FileWeightServer(work_dir / "files")
    server.offer({"warm": leaf(0)[:8]}, 0)          # orbax's and tensorstore's own first-use allocations
    _, offer_peak = peak_above_start(lambda: server.offer(tree, 1))
    server.close()
    _, gather_peak = peak_above_start(lambda: to_host(tree))
    own = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    print(json.dumps({"process": process_id, "own_bytes": own, "model_bytes": LEAVES * int(np.prod(SHAPE)) * 4,
                      "gather_peak": gather_peak, "offer_peak": offer_peak, "device_peak": device_peak,
                      "int4_peak": int4_peak}), flush=True)
    watchdog.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
