"""The engine side of tests/test_rl_remote.py's device-to-device weight test: the rl-tiny model laid out on
this process's devices pulls the learner's versions through `EngineExchange` (weight_transfer=device):
version >= 0 at once, version >= 1 once OUT/go exists; each pulled version's arrays are written to
OUT/<version>.npz in leaf order (the exchange's `npz.pack`), after checking that they have the engine's
shardings.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.weight_pull_process ROOT OUT key=value ...
"""

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    import jax
    import numpy as np
    from flax import nnx

    from composer_jax.infer.generate import engine_grids
    from composer_jax.model import CausalLM
    from composer_jax.parallel import shard_model
    from composer_jax.rl.exchange.directory import atomic_write
    from composer_jax.rl.exchange.engine_end import EngineExchange
    from composer_jax.rl.exchange.npz import pack
    from composer_jax.rl.run_config import load_rl_config

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = load_rl_config("rl-tiny", sys.argv[3:])
    model = CausalLM(cfg.model, rngs=nnx.Rngs(1))
    shard_model(model, engine_grids(cfg.model, jax.devices()))
    like = nnx.state(model)
    exchange = EngineExchange(root, EngineExchange.wait_session(root, 60), like, 60, "device")
    for min_version in (0, 1):
        while min_version and not (out / "go").exists():
            time.sleep(0.05)
        weights, version = exchange.wait_weights(min_version)
        for want, got in zip(jax.tree.leaves(like), jax.tree.leaves(weights)):
            assert got.sharding == want.sharding, (got.sharding, want.sharding)
        atomic_write(out / f"{version}.npz", pack([np.asarray(x) for x in jax.tree.leaves(weights)], {"version": version}))
    print(exchange.versions, flush=True)
