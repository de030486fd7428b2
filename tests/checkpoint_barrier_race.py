"""One process of a 2-process group (tests/test_distributed.py) whose main thread runs collectives
while a second thread runs orbax's multi-process barriers, as an async checkpoint save's commit does
beside the training steps; prints "ok" when both are done:

    python -m tests.checkpoint_barrier_race PROCESS_ID PORT
"""

import os
import sys
import threading


def main(argv: list[str]) -> int:
    process_id, port = int(argv[0]), int(argv[1])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(2)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from orbax.checkpoint import multihost

    from composer_jax.parallel.distributed import ProcessGroup, initialize

    initialize(ProcessGroup(f"localhost:{port}", 2, process_id, "flags"), peer_timeout_s=60, init_timeout_s=120,
               label="checkpoint_barrier_race")
    mesh = jax.make_mesh((4,), ("x",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((2, 320), np.float32))
    total = jax.jit(lambda a: jnp.sum(a, 0), out_shardings=NamedSharding(mesh, P()))
    barriers = threading.Thread(target=lambda: [multihost.sync_global_processes(f"race-{i}") for i in range(200)])
    barriers.start()
    for _ in range(400):
        np.asarray(total(x))
    barriers.join()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
