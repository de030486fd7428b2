"""The memory planner against the compiled training step at scale: `plan_train`'s per-device total
against the compiled program's `memory_analysis()` (arguments + outputs - aliased + temporaries) on a
DualMesh over every device JAX sees, for both ways ragged_dot may run (XLA's expansion, a grouped
kernel); passes when the closer one is within 15%.

    python tools/plan_check.py --mock-gpu-topology 1x2x8 proxy-moe train.seq_len=4096 train.batch_size=16
        one GPU compiles (never runs) the program of 16 H200s (2 mocked hosts of 8): tools/device_check.sh
    python tools/plan_check.py --cpu-devices 8 tiny train.seq_len=256 train.batch_size=8
        the same on 8 fake CPU devices (the dry run)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOLERANCE = 0.15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a model or run config (bundled name or YAML path)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides, e.g. mesh.cp=2")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--mock-gpu-topology", metavar="SLICESxHOSTSxDEVICES",
                       help="JAX's jax_mock_gpu_topology: one GPU compiles for the whole mocked topology")
    where.add_argument("--cpu-devices", type=int, help="fake CPU devices instead (no GPU)")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        from composer_jax.cpu_devices import use_cpu_devices

        use_cpu_devices(args.cpu_devices)
    import jax

    if args.mock_gpu_topology:
        jax.config.update("jax_mock_gpu_topology", args.mock_gpu_topology)
    from composer_jax.plan.memory import plan_train
    from composer_jax.plan.report import load_plan_config
    from composer_jax.train import step as step_lib
    from composer_jax.train.loop import make_mesh

    cfg = load_plan_config(args.config, args.overrides)
    dual = make_mesh(cfg)
    devices = dual.dense.devices.size
    memory = step_lib.lower_train_step(cfg, dual).compile().memory_analysis()
    compiled = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes)
    platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
    ratios = {how: plan_train(cfg, devices, grouped_matmul=how, platform=platform).total / compiled
              for how in ("expanded", "kernel")}
    best = min(ratios, key=lambda how: abs(ratios[how] - 1))
    ok = abs(ratios[best] - 1) <= TOLERANCE
    print(f"{args.config} on {devices} {platform} devices ({' '.join(f'{a}={n}' for a, n in dual.sizes.items())}): "
          f"compiled {compiled / 1e9:.3f} GB per device (temp {memory.temp_size_in_bytes / 1e9:.3f} GB); plan / "
          f"compiled " + ", ".join(f"{how} {r:.3f}" for how, r in ratios.items())
          + f": {'within' if ok else 'OUTSIDE'} {TOLERANCE:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
