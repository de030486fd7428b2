"""The RL learner's weight versions to a rollout engine in another process, both ways side by side in one
run: `rollout.weight_transfer=file` (an orbax version in the exchange directory, written shard by shard)
against `device` (JAX's transfer server, rl/exchange/transport_device.py).

    PYTHONPATH=$PWD python tools/bench_weight_transfer.py [--mb 256] [--versions 5] [--json PATH]

The learner (this process, 8 CPU devices, FSDP-sharded parameters) publishes `--versions` versions of
a synthetic parameter set of `--mb` MiB in float32 matrices through the real exchange
(`LearnerExchange.publish`); an engine process (2 devices, its own layout) waits for each and installs it
(`EngineExchange.wait_weights`). Per version: the learner's blocking time in `publish` (what its step
loop pays), and the time from the start of `publish` to the engine holding the weights. Medians over
the versions after the first (the first includes start-up and the engine's layout handshake).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _state(mb: int, devices: list, version: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("fsdp",))
    rows = 1024
    count = max(1, mb * 2**20 // (rows * 1024 * 4))
    return {f"layer{i}": jax.device_put(np.full((rows, 1024), i + version, np.float32),
                                        NamedSharding(mesh, PartitionSpec("fsdp"))) for i in range(count)}


def engine_main(root: str, mode: str, mb: int, versions: int) -> None:
    """The engine process: its layout is the same parameters sharded over its own 2 devices."""
    import jax

    from composer_jax.rl.exchange.engine_end import EngineExchange

    like = _state(mb, jax.devices(), 0)
    exchange = EngineExchange(root, EngineExchange.wait_session(root, 120), like, 120, mode)
    for version in range(versions):
        weights, got = exchange.wait_weights(version)
        assert got == version and float(weights["layer0"][0, 0]) == version, (got, version)
        Path(root, f"installed-{version}").write_text(str(time.time()))


def learner_side(mode: str, mb: int, versions: int) -> dict:
    import jax

    from composer_jax.cpu_devices import without_device_count
    from composer_jax.rl.exchange.learner_end import LearnerExchange

    root = tempfile.mkdtemp(prefix=f"bench-weights-{mode}-")
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"{without_device_count(os.environ.get('XLA_FLAGS', ''))} "
                        "--xla_force_host_platform_device_count=2".strip()}
    engine = subprocess.Popen([sys.executable, __file__, "--engine", root, mode, str(mb), str(versions)], env=env)
    learner = LearnerExchange(root, start_index=0, engine_states=[{}], timeout_s=120,
                              weight_transfer=mode)
    learner.start()
    publish_s, delivered_s = [], []
    try:
        for version in range(versions):
            state = jax.block_until_ready(_state(mb, jax.devices(), version))
            began = time.time()
            learner.publish(state, version)
            publish_s.append(time.time() - began)
            marker = Path(root, f"installed-{version}")
            while not marker.exists():
                if engine.poll() is not None:
                    raise SystemExit(f"the engine process exited with {engine.returncode}")
                time.sleep(0.01)
            delivered_s.append(float(marker.read_text()) - began)
        engine.wait(timeout=120)
    finally:
        learner.stop()
        if engine.poll() is None:
            engine.kill()
    return {"publish_s": statistics.median(publish_s[1:]), "delivered_s": statistics.median(delivered_s[1:]),
            "first_delivered_s": delivered_s[0]}


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        engine_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="parameter MiB per version (float32)")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.versions < 2 or args.mb < 1:
        parser.error("--versions must be >= 2 (the first is left out of the medians) and --mb >= 1")
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(8)
    results = {mode: learner_side(mode, args.mb, args.versions) for mode in ("file", "device")}
    print(f"{args.mb} MiB a version, median of {args.versions - 1} versions (the first left out)")
    print(f"{'':28s}{'file':>10s}{'device':>10s}{'file/device':>14s}")
    for key, label in (("publish_s", "learner blocked in publish"), ("delivered_s", "publish -> engine holds it")):
        file_s, device_s = results["file"][key], results["device"][key]
        print(f"{label:28s}{file_s:9.3f}s{device_s:9.3f}s{file_s / device_s:13.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "versions": args.versions, **results}, indent=1))


if __name__ == "__main__":
    main()
