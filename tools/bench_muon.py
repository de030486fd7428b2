"""Benchmark: composer_jax's sharded Muon against optax.contrib.muon on 8 fake CPU devices
(the measuring code and what it measures: composer_jax/bench/muon.py).

    python tools/bench_muon.py --json /tmp/muon.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(8)  # before jax starts its backend

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

from composer_jax.bench.muon import compare, kimi_tree, print_planned_shares  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed runs of each")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--plan-only", action="store_true",
                        help="print the planned NS shares (this tree on 8 devices, Kimi K2.5 on 64 and 256) and exit")
    args = parser.parse_args(argv)
    if args.ns_steps < 2:
        parser.error(f"--ns-steps {args.ns_steps}: at least 2 (the NS FLOPs are the difference of two step counts)")
    if len(jax.devices()) != 8:
        raise SystemExit(f"needs 8 devices, found {len(jax.devices())}")
    if args.plan_only:
        print_planned_shares(kimi_tree(experts=args.experts, moe_layers=args.moe_layers), args.ns_steps, args.chunks)
        return
    out = compare(args.experts, args.moe_layers, args.ns_steps, args.chunks, args.repeats)
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("times")}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
