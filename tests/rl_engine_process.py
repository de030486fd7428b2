"""The rollout engine process of tests/test_rl_remote.py and tests/test_distributed.py:
`rl.exchange.engine_process.serve` on the parity tasks (tests/rl_parity.py), the run config `rl-tiny` with
the overrides given; prints its summary as JSON. `--dump PREFIX`: every weight version V the engine takes is
written to PREFIX-V.npz (parameter name -> array), so a test can compare what the engine held with the
learner's weights. SIGUSR1 prints every thread's Python stack to stderr (a test that gives up on the engine
asks for it before killing it).

    python -m tests.rl_engine_process [--engine K] [--dump PREFIX] key=value ... cpu_devices=2
"""

import faulthandler
import json
import signal
import sys

from composer_jax.cpu_devices import use_cpu_devices
from composer_jax.rl.run_config import load_rl_config


def _options(args: list[str]) -> tuple[dict, list[str]]:
    options = {}
    while args[:1] in (["--engine"], ["--dump"]):
        options[args[0][2:]], args = args[1], args[2:]
    return options, args


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    options, overrides = _options(sys.argv[1:])
    cfg = load_rl_config("rl-tiny", overrides)
    use_cpu_devices(cfg.cpu_devices)       # the run's count wins over one in XLA_FLAGS

    from composer_jax.rl.exchange.engine_end import EngineExchange
    from composer_jax.rl.exchange.engine_process import serve
    from tests.rl_parity import parity_tasks

    if "dump" in options:
        import os

        import numpy as np

        from composer_jax.rl.exchange.transport_device import flat_parameters

        wait_weights = EngineExchange.wait_weights

        def dumping(self, min_version):
            got = wait_weights(self, min_version)
            if got is not None and got[0] is not None:
                path = f"{options['dump']}-{got[1]}.npz"
                with open(path + ".tmp", "wb") as f:
                    np.savez(f, **{k: np.asarray(x) for k, x in flat_parameters(got[0]).items()})
                os.replace(path + ".tmp", path)
            return got

        EngineExchange.wait_weights = dumping
    print(json.dumps(serve(cfg, parity_tasks(), engine=int(options.get("engine", 0)))), flush=True)
