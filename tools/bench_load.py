#!/usr/bin/env python
"""Benchmark starting a run from a model source against building the model fresh, side by side.

Writes a synthetic Hugging Face checkpoint of at least --size-gb (bf16; the model of
tools/bench_convert.py, or --config's), converts it, and saves it as a run's checkpoint; then, in one
child process on --devices fake CPU devices (dual grid fsdp / ep over all of them), times each way of
getting the training state's parameters placed on the grid: a fresh random initialisation (the jitted
init of `train.state.StateLayout.fresh`), and `source_weights.load_state` from the Hugging Face directory,
the converted directory and the run directory. It also times reading the source's files at the disk's
speed (the page cache dropped first when this process may, else as they are). The ratio reported per source
is load time / (fresh time + bytes / read speed): at most 1 is the goal (a phase starting from the one
before costs no more than building the model fresh plus reading its bytes).

    python tools/bench_load.py --size-gb 1 --json bench_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = """
import json, sys, time
from composer_jax.cpu_devices import use_cpu_devices
use_cpu_devices(int(sys.argv[1]))
import jax
from composer_jax.config import MeshConfig, load_config
from composer_jax.model_dirs import open_source
from composer_jax.parallel import DualMesh
from composer_jax.source_weights import load_state
from composer_jax.train.config import RunConfig, TrainConfig
from composer_jax.train.state import StateLayout

sources = sys.argv[2:]
cfg = open_source(sources[0]).model
run = RunConfig(model=cfg, mesh=MeshConfig(), train=TrainConfig(seq_len=64))
layout = StateLayout(run, DualMesh(run.mesh, jax.devices(), model=cfg))
out = {}
for name, how in [("fresh", None), *zip(("hf", "converted", "run"), sources)]:
    for attempt in range(2):          # the second is timed: the first compiles what it runs
        began = time.perf_counter()
        if how is None:
            placed = layout.fresh().params
        else:
            placed = load_state(open_source(how), cfg, layout.abstract.params, layout.abstract.biases)
        jax.block_until_ready(placed)
        out[name] = time.perf_counter() - began
        del placed
print(json.dumps(out))
"""


def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_speed(files: list[Path]) -> tuple[float, bool]:
    """(bytes/s reading `files` once, whether the page cache was dropped first)."""
    dropped = _drop_caches()
    total, began = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - began), dropped


def main() -> int:
    from bench_convert import bench_config

    from composer_jax import config as config_lib
    from composer_jax.checkpoint.synthetic import write_synthetic_hf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size to reach (default 1)")
    p.add_argument("--config", default=None, help="a model config instead (e.g. proxy-moe), bf16")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices of the grid (default 8)")
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed afterwards)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    cfg = (config_lib.load_config(args.config, ["dtype=bfloat16", "param_dtype=bfloat16"]) if args.config
           else bench_config(args.size_gb))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_load_"))
    cli = [sys.executable, "-m", "composer_jax.cli"]
    try:
        size = write_synthetic_hf(work / "hf", cfg)
        subprocess.run([*cli, "convert", str(work / "hf"), str(work / "converted"), "--quiet"], check=True)
        _save_run(work)
        files = sorted((work / "hf").glob("*.safetensors"))
        speed, dropped = read_speed(files)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        _drop_caches()
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.devices), str(work / "hf"),
                              str(work / "converted"), str(work / "run")], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        times = json.loads(out.stdout.strip().splitlines()[-1])
        budget = times["fresh"] + size / speed
        rows = {name: {"seconds": times[name], "ratio": times[name] / budget} for name in ("hf", "converted", "run")}
        print(f"model {size / 1e9:.2f} GB bf16 on {args.devices} CPU devices; reading it: {speed / 1e6:.0f} MB/s "
              f"({'page cache dropped' if dropped else 'page cache as it was'}); fresh init {times['fresh']:.2f} s")
        print(f"{'source':<10} {'load s':>8} {'MB/s':>8} {'vs fresh + read':>16}")
        for name, row in rows.items():
            print(f"{name:<10} {row['seconds']:8.2f} {size / 1e6 / row['seconds']:8.0f} {row['ratio']:15.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({"bytes": size, "read_bytes_per_s": speed, "cache_dropped": dropped,
                                                   "fresh_s": times["fresh"], "sources": rows}, indent=2))
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _save_run(work: Path) -> None:
    """A run directory holding the converted weights as its checkpoint (what a finished phase leaves)."""
    child = """
import sys
from pathlib import Path
from composer_jax.cpu_devices import use_cpu_devices
use_cpu_devices(1)
import jax
from composer_jax.config import MeshConfig
from composer_jax.model_dirs import open_source
from composer_jax.parallel import DualMesh
from composer_jax.source_weights import load_state
from composer_jax.train.checkpoints import RunCheckpoints
from composer_jax.train.config import RunConfig, TrainConfig, to_dict
from composer_jax.train.state import StateLayout
work = Path(sys.argv[1])
source = open_source(work / "converted")
run = RunConfig(model=source.model, mesh=MeshConfig(), train=TrainConfig(seq_len=64), run_dir=str(work / "run"))
layout = StateLayout(run, DualMesh(run.mesh, jax.devices(), model=source.model))
params, biases = load_state(source, source.model, layout.abstract.params, layout.abstract.biases)
checkpoints = RunCheckpoints(work / "run" / "checkpoints", run.checkpoint)
checkpoints.save(1, layout.from_params(params, biases), {}, to_dict(run))
checkpoints.close()
"""
    subprocess.run([sys.executable, "-c", child, str(work)], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
