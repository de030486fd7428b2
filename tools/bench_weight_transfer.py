"""The RL learner's weight versions to a rollout engine in another process, both ways side by side in one
run, from a learner of 1, 2 and 4 processes: `rollout.weight_transfer=device` (every learner process's
transfer server sends its own shards, rl/exchange/transport_device.py) and `file` (an orbax version in the
exchange directory, every process writing its own shards), against the single-process device transport.

    PYTHONPATH=$PWD python tools/bench_weight_transfer.py [--mb 256] [--versions 5] [--processes 1,2,4] [--json PATH]

The learner (8 CPU devices: this process, or `--processes` P processes of 8/P devices each in a process
group; FSDP-sharded parameters over all 8) publishes `--versions` versions of a synthetic parameter set of
`--mb` MiB in float32 matrices through the real exchange (`LearnerExchange.publish`, every process writing
its own shards); an engine process (2 devices, its own layout) waits for each and installs it
(`EngineExchange.wait_weights`). Per version: the learner's blocking time in `publish` (what its step
loop pays; process 0's), and the time from the start of `publish` to the engine holding the weights.
Medians over the versions after the first (the first includes start-up and the engine's layout handshake).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def engine_main(root: str, mode: str, mb: int, versions: int) -> None:
    """The engine process: its layout is the same parameters sharded over its own 2 devices."""
    from composer_jax.rl.exchange.directory import atomic_write
    from composer_jax.rl.exchange.engine_end import EngineExchange

    like = _state(mb, 0)
    exchange = EngineExchange(root, EngineExchange.wait_session(root, 120), like, 120, mode)
    for version in range(versions):
        weights, got = exchange.wait_weights(version)
        assert got == version and float(weights["layer0"][0, 0]) == version, (got, version)
        atomic_write(Path(root, f"installed-{version}"), str(time.time()).encode())   # never read half-written


def _env(devices: int) -> dict:
    from composer_jax.cpu_devices import without_device_count

    return {**os.environ, "PYTHONPATH": str(ROOT),
            "XLA_FLAGS": f"{without_device_count(os.environ.get('XLA_FLAGS', ''))} "
                         f"--xla_force_host_platform_device_count={devices}".strip()}


def learner_process_main(process: int, processes: int, port: int, root: str, mode: str, mb: int, versions: int) -> None:
    """One of `processes` learner processes (8 / processes devices each): process 0 reports its timings."""
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(8 // processes)
    from composer_jax.parallel.distributed import ProcessGroup, initialize

    watchdog = initialize(ProcessGroup(f"localhost:{port}", processes, process, "flags"), peer_timeout_s=240,
                          init_timeout_s=240, label="bench_weight_transfer")
    results = publish_versions(root, mode, mb, versions, engine=None)
    if process == 0:
        Path(root, "learner.json").write_text(json.dumps(results))
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("bench_weight_transfer done")   # none leaves while a peer still works
    watchdog.finish()


def _state(mb: int, version: int):
    """`mb` MiB of float32 [1024, 1024] matrices (values `i + version`), FSDP-sharded over every device
    (of every process in a group), each process building only its own shards."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), PartitionSpec("fsdp"))
    count = max(1, mb * 2**20 // (1024 * 1024 * 4))
    return {f"layer{i}": jax.make_array_from_callback((1024, 1024), sharding,
                                                      lambda index, i=i: np.full((1024, 1024), i + version,
                                                                                 np.float32)[index])
            for i in range(count)}


def publish_versions(root: str, mode: str, mb: int, versions: int, engine) -> dict:
    """Publish `versions` versions into `root` (every process of a group calls this), each once the engine
    installed the one before; process 0's timings. `engine`: the engine process to watch, or None."""
    import jax

    from composer_jax.rl.exchange.learner_end import LearnerExchange

    learner = LearnerExchange(root, start_index=0, engine_states=[{}], timeout_s=120, weight_transfer=mode)
    learner.start()
    publish_s, delivered_s = [], []
    try:
        for version in range(versions):
            state = jax.block_until_ready(_state(mb, version))
            began = time.time()
            learner.publish(state, version)
            publish_s.append(time.time() - began)
            marker = Path(root, f"installed-{version}")
            while not marker.exists():
                if engine is not None and engine.poll() is not None:
                    raise SystemExit(f"the engine process exited with {engine.returncode}")
                time.sleep(0.01)
            delivered_s.append(float(marker.read_text()) - began)
    finally:
        learner.stop()
    return {"publish_s": statistics.median(publish_s[1:]), "delivered_s": statistics.median(delivered_s[1:]),
            "first_delivered_s": delivered_s[0]}


def learner_side(mode: str, mb: int, versions: int, processes: int = 1) -> dict:
    """The engine process and the learner: this process (processes=1), or a group of learner processes."""
    root = tempfile.mkdtemp(prefix=f"bench-weights-{mode}-{processes}-")
    engine = subprocess.Popen([sys.executable, __file__, "--engine", root, mode, str(mb), str(versions)], env=_env(2))
    learners = []
    try:
        if processes == 1:
            results = publish_versions(root, mode, mb, versions, engine)
        else:
            with socket.socket() as probe:
                probe.bind(("localhost", 0))
                port = probe.getsockname()[1]
            learners = [subprocess.Popen([sys.executable, __file__, "--learner", str(k), str(processes), str(port), root,
                                          mode, str(mb), str(versions)], env=_env(8 // processes))
                        for k in range(processes)]
            for k, learner in enumerate(learners):
                if learner.wait(timeout=600):
                    raise SystemExit(f"learner process {k} exited with {learner.returncode}")
            results = json.loads(Path(root, "learner.json").read_text())
        engine.wait(timeout=120)
    finally:
        for process in (engine, *learners):
            if process.poll() is None:
                process.kill()
    own = mb * 2**20 // processes
    return {**results, "processes": processes, "bytes_per_version": mb * 2**20, "bytes_per_process": own}


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        engine_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    if sys.argv[1:2] == ["--learner"]:
        learner_process_main(*map(int, sys.argv[2:5]), *sys.argv[5:7], int(sys.argv[7]), int(sys.argv[8]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="parameter MiB per version (float32)")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--processes", default="1,2,4", help="learner process counts (dividing 8; default 1,2,4); "
                                                             "the anchor, device from 1 process, always runs")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.versions < 2 or args.mb < 1:
        parser.error("--versions must be >= 2 (the first is left out of the medians) and --mb >= 1")
    try:
        processes = [int(p) for p in args.processes.split(",")]
    except ValueError:
        processes = [0]
    if not processes or any(p < 1 or 8 % p for p in processes):
        parser.error(f"--processes: expected counts dividing 8 such as 1,2,4, got {args.processes!r}")
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(8)
    runs = [("device", 1), *((mode, p) for p in processes for mode in ("device", "file") if (mode, p) != ("device", 1))]
    rows = {f"{mode}, {p} process{'es' * (p > 1)}": learner_side(mode, args.mb, args.versions, p) for mode, p in runs}
    anchor = rows["device, 1 process"]
    print(f"{args.mb} MiB a version, median of {args.versions - 1} versions (the first left out); against the "
          "single-process device transport")
    print(f"{'':24s}{'bytes/process':>14s}{'blocked in publish':>20s}{'publish -> engine':>20s}")
    for name, r in rows.items():
        print(f"{name:24s}{r['bytes_per_process'] / 2**20:11.0f} MiB{r['publish_s']:9.3f}s ({r['publish_s'] / anchor['publish_s']:4.2f}x)"
              f"{r['delivered_s']:9.3f}s ({r['delivered_s'] / anchor['delivered_s']:4.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "versions": args.versions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
