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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(1)

import jax  # noqa: E402

from composer_jax import load_config  # noqa: E402
from composer_jax.bench.attention import kernel_section, memory_section, step_time_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats")
    args = parser.parse_args()
    quick, tiny = args.quick, load_config("tiny")
    results = {
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")},
        "memory": memory_section(tiny, [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192], 4096),
        "step_time": step_time_section(tiny, [512, 2048], 2 if quick else 5),
        "kernel": kernel_section([256, 512, 1024, 2048] if quick else [256, 512, 1024, 2048, 4096],
                                 {"tiny": (4, 24, 24), "k25_8heads": (8, 192, 128)}, 2 if quick else 5),
    }
    mib = lambda b: f"{b / 2**20:9.1f}"  # noqa: E731
    growth = lambda row, impl: f"{row[impl + '_growth']:5.2f}" if impl + "_growth" in row else "    -"  # noqa: E731
    print("training-step temp MiB   seq  reference (growth)   blockwise (growth)")
    for row in results["memory"]["train_step_temp_bytes"]:
        print(f"{row['seq']:>29} {mib(row['reference'])} ({growth(row, 'reference')}) "
              f"{mib(row['blockwise'])} ({growth(row, 'blockwise')})")
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
