#!/usr/bin/env python
"""Benchmark `composer-jax convert` (and optionally `export`) on a synthetic multi-shard checkpoint.

Writes a random HF checkpoint of at least --size-gb (bf16, K2.5-style INT4 experts or FP8 blocks),
converts it with the CLI in a child process under `/usr/bin/time -v` (falling back to
`resource.getrusage` of the child when GNU time is absent), and reports throughput and peak RSS.
With --max-rss-mb it exits 1 when the peak exceeds that bound.

    python tools/bench_convert.py --size-gb 2.2 --workers 2 --max-rss-mb 1200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composer_jax import config as config_lib
from composer_jax.checkpoint.hf import plan_leaves
from composer_jax.checkpoint.synthetic import write_synthetic_hf
from composer_jax.config import ModelConfig
from composer_jax.model import abstract_params

BASE = dict(vocab_size=32768, hidden_size=1024, num_layers=8, num_dense_layers=1, intermediate_size=2816,
            mla=dict(num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                     v_head_dim=64),
            rope=dict(theta=50000.0), moe=dict(n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=512),
            dtype="bfloat16", param_dtype="bfloat16")


def bench_config(size_gb: float) -> ModelConfig:
    """The BASE model with the fewest experts (a multiple of 8) whose bf16 weights reach `size_gb`."""
    def build(experts):
        raw = json.loads(json.dumps(BASE))
        raw["moe"]["n_routed_experts"] = experts
        return config_lib.from_dict(ModelConfig, raw)

    per_expert = 3 * BASE["hidden_size"] * BASE["moe"]["moe_intermediate_size"] * (BASE["num_layers"] - 1) * 2
    base_bytes = sum(2 * math.prod(leaf.shape) for leaf in plan_leaves(abstract_params(build(8)), build(8)))
    return build(8 * max(1, math.ceil(max(0.0, size_gb * 1e9 - base_bytes) / per_expert / 8) + 1))


def measured_run(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    start = time.monotonic()
    if shutil.which("time") and Path("/usr/bin/time").exists():
        out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
        peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1))
    else:
        subprocess.run(cmd, check=True)
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return time.monotonic() - start, peak_kb / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.2, help="checkpoint size to reach (default 2.2)")
    p.add_argument("--format", choices=("bf16", "int4", "fp8"), default="bf16")
    p.add_argument("--shard-gb", type=float, default=0.5, help="source shard size (default 0.5)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chunk-mb", type=int, default=64)
    p.add_argument("--export", action="store_true", help="also time export of the converted checkpoint")
    p.add_argument("--max-rss-mb", type=float, default=None, help="fail when convert's peak RSS exceeds this")
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed afterwards)")
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        cfg = bench_config(args.size_gb)
        t0 = time.monotonic()
        size = write_synthetic_hf(work / "hf", cfg, args.format, shard_bytes=int(args.shard_gb * 1e9), params_of=abstract_params)
        shards = len(list((work / "hf").glob("*.safetensors")))
        print(f"synthetic {args.format} checkpoint: {size / 1e9:.2f} GB in {shards} shards "
              f"({cfg.moe.n_routed_experts} experts x {cfg.num_moe_layers} MoE layers), "
              f"written in {time.monotonic() - t0:.1f} s")
        cli = [sys.executable, "-m", "composer_jax.cli"]
        common = ["--workers", str(args.workers), "--chunk-mb", str(args.chunk_mb), "--quiet"]
        seconds, rss = measured_run(cli + ["convert", str(work / "hf"), str(work / "orbax"), *common])
        written = sum(f.stat().st_size for f in (work / "orbax").rglob("*") if f.is_file())
        print(f"convert: {seconds:.1f} s, {size / 1e6 / seconds:.0f} MB/s read, {written / 1e6 / seconds:.0f} MB/s "
              f"written ({written / 1e9:.2f} GB), peak RSS {rss:.0f} MB (workers {args.workers}, "
              f"chunk {args.chunk_mb} MiB)")
        if args.export:
            seconds, erss = measured_run(cli + ["export", str(work / "orbax"), str(work / "out"), *common])
            print(f"export: {seconds:.1f} s, peak RSS {erss:.0f} MB")
        if args.max_rss_mb is not None and rss > args.max_rss_mb:
            print(f"FAIL: peak RSS {rss:.0f} MB exceeds the bound {args.max_rss_mb:.0f} MB")
            return 1
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
