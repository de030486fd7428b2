"""One process of a learner group of 2 x 4 devices publishing a weight version (started by
tests/test_distributed.py): a parameter tree of 8 float32 [1024, 2048] arrays (64 MiB), each sharded over
all 8 devices of both processes (32 MiB of shards a process), built shard by shard; then, each measured by
a thread sampling this process's resident memory every 2 ms:

1. `FileWeightServer.offer` of the tree as version 1 (the exchange's file transport);
2. `parallel.distributed.to_host` of the tree (the whole model gathered onto every host: the measurement's
   reference, it must see about 64 MiB; after the offer, so memory the offer freed can only lower it).

    python -m tests.transfer_memory_process PROCESS_ID PORT WORK_DIR

Prints one JSON line: {"process", "own_bytes", "model_bytes", "gather_peak", "offer_peak"} (peaks above the
resident memory before each).
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


def main(argv: list[str]) -> int:
    process_id, port, work_dir = int(argv[0]), int(argv[1]), Path(argv[2])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(4)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.distributed import ProcessGroup, initialize, to_host
    from composer_jax.rl.exchange.transport_files import FileWeightServer

    watchdog = initialize(ProcessGroup(f"localhost:{port}", 2, process_id, "flags"),
                          peer_timeout_s=240, init_timeout_s=240, label="transfer_memory_process")
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))

    def leaf(k):
        return jax.make_array_from_callback(
            SHAPE, sharding, lambda index: np.full(SHAPE, float(k), np.float32)[index])

    tree = {f"layer{k}": leaf(k) for k in range(LEAVES)}
    server = FileWeightServer(work_dir)
    server.offer({"warm": leaf(0)[:8]}, 0)          # orbax's and tensorstore's own first-use allocations
    _, offer_peak = peak_above_start(lambda: server.offer(tree, 1))
    server.close()
    _, gather_peak = peak_above_start(lambda: to_host(tree))
    own = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    print(json.dumps({"process": process_id, "own_bytes": own, "model_bytes": LEAVES * int(np.prod(SHAPE)) * 4,
                      "gather_peak": gather_peak, "offer_peak": offer_peak}), flush=True)
    watchdog.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
