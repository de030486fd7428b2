"""One process of a 2-process group that sums across both in a loop until a peer goes (started by
tests/test_distributed.py):

    python -m tests.collective_loop PROCESS_ID PORT PEER_TIMEOUT_S VICTIM

Process VICTIM exits (status 9, no goodbye) after the first sum; the other keeps summing.
"""

import os
import sys
import time


def main(argv: list[str]) -> int:
    process_id, port, peer_timeout, victim = int(argv[0]), int(argv[1]), float(argv[2]), int(argv[3])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(2)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.distributed import ProcessGroup, initialize

    initialize(ProcessGroup(f"localhost:{port}", 2, process_id, "flags"), peer_timeout_s=peer_timeout,
               init_timeout_s=120, label="collective_loop")
    mesh = jax.make_mesh((4,), ("x",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), jnp.arange(2.0) + 2 * process_id)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    print(f"sum {float(total(x))}", flush=True)
    if process_id == victim:
        os._exit(9)
    while True:
        float(total(x))
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
