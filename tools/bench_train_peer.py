"""`composer-jax pretrain`'s training step against a PyTorch loop over transformers' DeepseekV3ForCausalLM
on the same checkpoint, side by side per shape (composer_jax/bench/train_peer.py), in one run:

    python tools/bench_train_peer.py --json train_peer.json [--shapes held_out,tiny_recipe]
        [--settings train.num_devices=1 --settings "train.num_devices=1 model.moe.dispatch=dense"] [--reps 5]

Our side runs on the recipe's fake CPU devices (train.cpu_devices of configs/pretrain-tiny.yaml: by default one per core), as
`composer-jax pretrain` does. Prints one line per row: tokens/s of ours and of torch, the ratio, the
first two steps' losses of both; and per shape the compiled over model FLOPs per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.cpu_devices import collect_garbage_less_often, restart_with_huge_pages, use_cpu_devices  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, metavar="PATH", help="write the results here")
    parser.add_argument("--shapes", default="held_out,tiny_recipe", help="shapes (default: held_out,tiny_recipe)")
    parser.add_argument("--settings", action="append", default=[], metavar="'K=V ...'",
                        help="an extra row of ours with these dotted settings (repeatable)")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per side and shape (default 5)")
    parser.add_argument("--looped-flops", action="store_true",
                        help="count the compiled FLOPs of the program that ran (loop bodies once; no extra "
                             "compilation) instead of the unrolled step")
    args = parser.parse_args(argv)
    from composer_jax.bench.train_peer import RECIPE, SHAPES
    from composer_jax.train.config import load_run_config

    shapes = tuple(s for s in args.shapes.split(",") if s)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown[0]!r} (expected some of {', '.join(SHAPES)})")
    use_cpu_devices(load_run_config(RECIPE).train.host_cpu_devices)
    from composer_jax.bench.train_peer import train_peer_section

    settings = tuple(tuple(row.split()) for row in args.settings)
    results = train_peer_section(shapes, settings, args.reps, unrolled_flops=not args.looped_flops)
    results["command"] = " ".join(["python tools/bench_train_peer.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"load average {results['load_average_before']} -> {results['load_average_after']}; "
          f"{results['cpus']} cpus")
    for shape, r in results["shapes"].items():
        t = r["torch"]
        for row in r["rows"]:
            print(f"{shape:>12} {row['name']:<50} {row['tokens_per_s']:9.1f} tok/s, torch {t['tokens_per_s']:9.1f} "
                  f"tok/s ({t['threads']} threads): x{row['over_torch']:.2f}; losses {row['first_loss']:.6f}, "
                  f"{row['second_loss']:.6f} vs {t['first_loss']:.6f}, {t['second_loss']:.6f}")
        print(f"{shape:>12} FLOPs/token: compiled {r['compiled_flops_per_token']:.4g} ({r['compiled_flops_counted']}), "
              f"model {r['model_flops_per_token']:.4g}: x{r['compiled_over_model_flops']:.2f}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    restart_with_huge_pages()   # as `composer-jax` runs
    collect_garbage_less_often()
    sys.exit(main())
