#!/usr/bin/env python
"""Benchmark starting a run from a model source against building the model fresh, side by side.

Writes a synthetic Hugging Face checkpoint of at least --size-gb (bf16; the model of
tools/bench_convert.py, or --config's), converts it, and saves it as a run's checkpoint; then, in one
child process on --devices fake CPU devices (dual grid fsdp / ep over all of them), times each way of
getting the training state's parameters placed on the grid: a fresh random initialisation (the jitted
init of `train.state.StateLayout.fresh`), and `source_weights.load_state` from the Hugging Face directory,
the converted directory and the run directory. It also times reading the source's files at the disk's
speed (the page cache dropped first when this process may, else as they are), and resuming the run (its whole
checkpoint: parameters, optimizer state, step, router biases). The ratio reported is load time / (fresh time
+ bytes read / read speed): at most 1 is the goal (a phase starting from the one before, or resuming,
costs no more than building the model fresh plus reading its bytes).

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
from composer_jax.train.checkpoints import RunCheckpoints
from composer_jax.train.config import RunConfig, TrainConfig
from composer_jax.train.state import StateLayout

mode, sources = sys.argv[2], sys.argv[3:]
resume = RunCheckpoints(sources[2] + "/checkpoints")
cfg = open_source(sources[0]).model
run = RunConfig(model=cfg, mesh=MeshConfig(), train=TrainConfig(seq_len=64))
layout = StateLayout(run, DualMesh(run.mesh, jax.devices(), model=cfg))
out = {}
ways = [("fresh", None)] if mode == "fresh" else [*zip(("hf", "converted", "run"), sources), ("resume", "resume")]
for name, how in ways:
    for attempt in range(2):          # the second is timed: the first compiles what it runs
        began = time.perf_counter()
        if how is None:
            placed = layout.fresh()
        elif how == "resume":
            placed = resume.restore(layout.abstract)[0]
        else:
            placed = load_state(open_source(how), cfg, layout.abstract.params, layout.abstract.biases)
        jax.block_until_ready(placed)
        out[name] = time.perf_counter() - began
        del placed
out["peak_rss_mb"] = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
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
    from composer_jax.model import abstract_params

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
        size = write_synthetic_hf(work / "hf", cfg, params_of=abstract_params)
        subprocess.run([*cli, "convert", str(work / "hf"), str(work / "converted"), "--quiet"], check=True)
        _save_run(work)
        files = sorted((work / "hf").glob("*.safetensors"))
        speed, dropped = read_speed(files)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        times, rss = {}, {}
        for mode in ("fresh", "load"):      # each in a process of its own: its peak memory apart
            _drop_caches()
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.devices), mode, str(work / "hf"),
                                  str(work / "converted"), str(work / "run")], capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"the timed {mode} process failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rss[mode] = result.pop("peak_rss_mb")
            times.update(result)
        step = next(p for p in (work / "run" / "checkpoints").iterdir() if p.name.isdigit())
        checkpoint = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
        read = {"hf": size, "converted": size, "run": size, "resume": checkpoint}
        rows = {name: {"seconds": times[name], "bytes": read[name], "ratio": times[name] / (times["fresh"] + read[name] / speed)}
                for name in read}
        print(f"model {size / 1e9:.2f} GB bf16 on {args.devices} CPU devices; reading it: {speed / 1e6:.0f} MB/s "
              f"({'page cache dropped' if dropped else 'page cache as it was'}); fresh init {times['fresh']:.2f} s; "
              f"peak RSS of the fresh init {rss['fresh']:.0f} MB, of the loads {rss['load']:.0f} MB")
        print(f"{'source':<10} {'load s':>8} {'GB':>6} {'MB/s':>8} {'vs fresh + read':>16}")
        for name, row in rows.items():
            print(f"{name:<10} {row['seconds']:8.2f} {row['bytes'] / 1e9:6.2f} {row['bytes'] / 1e6 / row['seconds']:8.0f} "
                  f"{row['ratio']:15.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({"bytes": size, "read_bytes_per_s": speed, "cache_dropped": dropped,
                                                   "fresh_s": times["fresh"], "peak_rss_mb": rss, "sources": rows},
                                                  indent=2))
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
