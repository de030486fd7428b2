"""Profile `composer-jax pretrain`'s training step with `jax.profiler`: XLA operations by self time,
grouped into model components (composer_jax/bench/profile.py), as markdown tables:

    python tools/profile_train_step.py [--shape held_out|tiny_recipe|tiny_quick] [--steps 3] [--top 15]
        [--json out.json] [key=value ...]

The step is built as bench/train_peer.py builds ours (the loop's Trainer on the recipe's run config at
the shape, fresh weights: the program does not depend on them); `key=value` overrides its run config
(e.g. train.num_devices=1 model.moe.dispatch=dense). Op time is summed over every device's thread, so
with 8 fake CPU devices it exceeds the step's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.cpu_devices import collect_garbage_less_often, restart_with_huge_pages, use_cpu_devices  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted run-config overrides")
    parser.add_argument("--shape", default="tiny_recipe", help="held_out, tiny_recipe (default) or tiny_quick")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps, after a compiling one (default 3)")
    parser.add_argument("--top", type=int, default=15, help="ops listed (default 15)")
    parser.add_argument("--json", metavar="PATH", help="also write the breakdown here")
    args = parser.parse_args(argv)
    from composer_jax.bench.train_peer import RECIPE, SHAPES
    from composer_jax.train.config import load_run_config

    if args.shape not in SHAPES:
        parser.error(f"--shape: unknown shape {args.shape!r} (expected one of {', '.join(SHAPES)})")
    use_cpu_devices(load_run_config(RECIPE).train.host_cpu_devices)
    from composer_jax.bench.profile import markdown, profile
    from composer_jax.bench.train_peer import Ours, one_document_rows, shape_config

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = shape_config(shape, Path(tmp), settings=tuple(args.overrides))
        ours = Ours(cfg, one_document_rows(shape.batch_size, shape.seq_len, cfg.model.vocab_size))
        try:
            ours()                                  # compiles
            result = profile(ours, ours.compiled().as_text(), args.steps, Path(tmp) / "trace")
        finally:
            ours.close()
    result.update(shape=args.shape, overrides=args.overrides, devices=ours.trainer.dual.dense.devices.size,
                  dispatch=cfg.model.moe.dispatch)
    print(f"{args.shape} ({shape.batch_size} x {shape.seq_len} tokens), {result['devices']} devices, dispatch "
          f"{result['dispatch']}: wall {result['wall_ms_per_step']:.1f} ms/step, XLA op self time "
          f"{result['total_ms_per_step']:.1f} ms/step (summed over devices)\n")
    print(markdown(result, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    restart_with_huge_pages()   # as `composer-jax` runs
    collect_garbage_less_often()
    sys.exit(main())
