"""The rollout engine process of tests/test_rl_remote.py: `rl.exchange.engine_process.serve` on the parity
tasks (tests/rl_parity.py), the run config `rl-tiny` with the overrides given; prints its summary as JSON.

    python -m tests.rl_engine_process [--engine K] key=value ... cpu_devices=2
"""

import json
import sys

from composer_jax.cpu_devices import use_cpu_devices
from composer_jax.rl.run_config import load_rl_config

if __name__ == "__main__":
    args = sys.argv[1:]
    engine = int(args[1]) if args[:1] == ["--engine"] else 0
    cfg = load_rl_config("rl-tiny", args[2:] if args[:1] == ["--engine"] else args)
    use_cpu_devices(cfg.cpu_devices)       # the run's count wins over one in XLA_FLAGS

    from composer_jax.rl.exchange.engine_process import serve
    from tests.rl_parity import parity_tasks

    print(json.dumps(serve(cfg, parity_tasks(), engine=engine)), flush=True)
