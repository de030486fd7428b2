"""Attention implementations side by side, in one run: compiled memory of the training step against
sequence length, training-step time, and the attention kernel alone (forward + backward).

    PYTHONPATH=$PWD python tools/bench_attention.py [--json PATH] [--quick]

Sections (each measured for every implementation in the same process, alternating runs):
- memory: `temp_size_in_bytes` of the compiled training step (tiny model, one device, batch 1) per
  sequence length, with the growth ratio between consecutive lengths (2 = linear, 4 = quadratic), and
  per-layer remat policies at one length;
- step_time: median wall time of the training step at 512 and 2048 tokens, and blockwise / reference;
- kernel: median wall time of one attention call's forward + backward (tiny and K2.5-like head dims)
  per key length: where blockwise overtakes the dense reference on this machine (`auto`'s threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax import load_config  # noqa: E402
from composer_jax.config import MeshConfig  # noqa: E402
from composer_jax.model import attention_ops  # noqa: E402
from composer_jax.model.attention_mask import causal_mask  # noqa: E402
from composer_jax.parallel import DualMesh  # noqa: E402
from composer_jax.train import step as step_lib  # noqa: E402
from composer_jax.train.config import RunConfig, TrainConfig  # noqa: E402
from composer_jax.train.state import StateLayout  # noqa: E402

IMPLEMENTATIONS = ("reference", "blockwise")


def run_config(seq: int, attention: str, remat: str = "none") -> RunConfig:
    """The tiny model at `seq` tokens, batch 1, on one device."""
    model = load_config("tiny", [f"attention={attention}", f"rope.max_position_embeddings={max(seq, 64)}"])
    return RunConfig(model=model, mesh=MeshConfig(fsdp=1, ep=1),
                     train=TrainConfig(batch_size=1, seq_len=seq, remat=remat, progress=False))


def one_device() -> DualMesh:
    return DualMesh(MeshConfig(fsdp=1, ep=1), jax.devices()[:1])


def temp_bytes(cfg: RunConfig) -> int:
    return int(step_lib.lower_train_step(cfg, one_device()).compile().memory_analysis().temp_size_in_bytes)


def memory_section(lengths, remat_length: int) -> dict:
    rows = []
    for seq in lengths:
        rows.append({"seq": seq, **{impl: temp_bytes(run_config(seq, impl)) for impl in IMPLEMENTATIONS}})
    for impl in IMPLEMENTATIONS:
        for before, after in zip(rows, rows[1:]):
            after[f"{impl}_growth"] = round(after[impl] / before[impl], 3)
    remat = {policy: temp_bytes(run_config(remat_length, "blockwise", policy)) for policy in ("none", "dots", "full")}
    return {"train_step_temp_bytes": rows, "remat_temp_bytes": {"seq": remat_length, **remat}}


def _batch(seq: int, rng) -> dict:
    tokens = rng.integers(0, 256, (1, 1, seq)).astype(np.int32)
    segments = (np.arange(seq) >= seq // 3).astype(np.int32)[None, None] + 1   # two packed documents
    starts = np.where(segments[0, 0] == 1, 0, seq // 3)
    positions = (np.arange(seq) - starts).astype(np.int32)[None, None]
    return {"tokens": tokens, "segment_ids": segments, "positions": positions,
            "loss_mask": np.ones_like(tokens)}


def step_time_section(lengths, repeats: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for seq in lengths:
        dual = one_device()
        steps, states = {}, {}
        for impl in IMPLEMENTATIONS:
            cfg = run_config(seq, impl)
            layout = StateLayout(cfg, dual)
            with dual:
                steps[impl] = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt))
            states[impl] = layout.fresh()
        batch = _batch(seq, rng)
        times = {impl: [] for impl in IMPLEMENTATIONS}
        for i in range(repeats + 1):            # the first round compiles
            for impl in IMPLEMENTATIONS:
                start = time.perf_counter()
                with dual:
                    _, metrics = steps[impl](states[impl], batch)
                jax.block_until_ready(metrics["loss"])
                if i:
                    times[impl].append(time.perf_counter() - start)
        row = {"seq": seq, **{f"{impl}_s": statistics.median(times[impl]) for impl in IMPLEMENTATIONS}}
        row["blockwise_over_reference"] = round(row["blockwise_s"] / row["reference_s"], 3)
        rows.append(row)
    return rows


def kernel_section(lengths, shapes: dict, repeats: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(1)
    for name, (heads, dk, dv) in shapes.items():
        for seq in lengths:
            q, k = (jnp.asarray(rng.normal(size=(1, seq, heads, dk)), jnp.float32) for _ in range(2))
            v = jnp.asarray(rng.normal(size=(1, seq, heads, dv)), jnp.float32)
            order = jnp.arange(seq, dtype=jnp.int32)[None]
            segments = (order >= seq // 3).astype(jnp.int32)
            mask = causal_mask(segments, order, segments, order)
            fns = {}
            for impl in IMPLEMENTATIONS:
                def loss(q, k, v, impl=impl):
                    return jnp.sum(attention_ops.attention(impl, q, k, v, mask, dk ** -0.5)[0] ** 2)
                fns[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            times = {impl: [] for impl in IMPLEMENTATIONS}
            for i in range(repeats + 1):
                for impl in IMPLEMENTATIONS:
                    start = time.perf_counter()
                    jax.block_until_ready(fns[impl](q, k, v))
                    if i:
                        times[impl].append(time.perf_counter() - start)
            row = {"shape": name, "heads": heads, "dk": dk, "dv": dv, "seq": seq,
                   **{f"{impl}_s": statistics.median(times[impl]) for impl in IMPLEMENTATIONS}}
            row["blockwise_over_reference"] = round(row["blockwise_s"] / row["reference_s"], 3)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats")
    args = parser.parse_args()
    quick = args.quick
    results = {
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")},
        "memory": memory_section([1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192], 4096),
        "step_time": step_time_section([512, 2048], 2 if quick else 5),
        "kernel": kernel_section([256, 512, 1024, 2048] if quick else [256, 512, 1024, 2048, 4096],
                                 {"tiny": (4, 24, 24), "k25_8heads": (8, 192, 128)}, 2 if quick else 5),
    }
    mib = lambda b: f"{b / 2**20:9.1f}"  # noqa: E731
    print("training-step temp MiB   seq  reference (growth)   blockwise (growth)")
    for row in results["memory"]["train_step_temp_bytes"]:
        print(f"{row['seq']:>29} {mib(row['reference'])} ({row.get('reference_growth', '-'):>5}) "
              f"{mib(row['blockwise'])} ({row.get('blockwise_growth', '-'):>5})")
    remat = results["memory"]["remat_temp_bytes"]
    print(f"remat at {remat['seq']} tokens (blockwise), temp MiB: " +
          ", ".join(f"{p} {mib(remat[p]).strip()}" for p in ("none", "dots", "full")))
    print("training step s           seq  reference  blockwise  ratio")
    for row in results["step_time"]:
        print(f"{row['seq']:>29} {row['reference_s']:10.3f} {row['blockwise_s']:10.3f}  "
              f"{row['blockwise_over_reference']:.2f}")
    print("attention fwd+bwd s  shape  seq  reference  blockwise  ratio")
    for row in results["kernel"]:
        print(f"{row['shape']:>26} {row['seq']:>5} {row['reference_s']:10.4f} {row['blockwise_s']:10.4f}  "
              f"{row['blockwise_over_reference']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
