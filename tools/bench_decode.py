"""Decode benchmark on the tiny model after the default pretraining run: plain vs MTP-speculative
decoding (greedy and sampled), prefill throughput and the latent cache's size per token; and plain vs
speculative at batch 1 per model size (`--sizes`: tiny, weight_bound) and draft count (`--drafts`) on
self-drafting models (every draft accepted: bench/decode.py `self_drafting`).

    python tools/bench_decode.py --json bench_decode.json [--run-dir runs/pretrain-tiny] [--sizes tiny weight_bound]

Without a trained run in --run-dir it first trains the default one (`composer-jax pretrain`, ~3 min on
a laptop CPU), so a fresh clone can run it. The prompts are snippets of this Python's standard library
(the training data); how the engines are compared: composer_jax/bench/decode.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.bench.decode import cache_figures, compare, prefill_figures, prompts, speculative_sizes  # noqa: E402
from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402


def ensure_run(run_dir: Path) -> None:
    """Train the default tiny pretraining run into `run_dir` unless it holds a checkpoint."""
    if (run_dir / "checkpoints").is_dir() and any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir()):
        return
    print(f"no trained run in {run_dir}: training the default one (composer-jax pretrain)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "composer_jax.cli", "pretrain", f"run_dir={run_dir.resolve()}",
                    "train.progress=false"], check=True, cwd=Path(__file__).resolve().parent.parent)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, metavar="PATH", help="write the results here")
    parser.add_argument("--run-dir", default="runs/pretrain-tiny", help="trained run (trained first if absent)")
    parser.add_argument("--batch", type=int, default=1, help="requests decoded at once (default 1)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=7, help="measured repetitions per engine (default 7)")
    parser.add_argument("--steps-per-call", type=int, default=0,
                        help="decode steps per engine call (default 0: all of a generation in one call)")
    parser.add_argument("--dispatch", default=None, help="override model.moe.dispatch (default: the run's)")
    parser.add_argument("--draft-tokens", type=int, default=0,
                        help="drafts per step on the trained run (0: the default)")
    parser.add_argument("--sizes", nargs="*", default=["tiny", "weight_bound"],
                        help="model sizes of the self-drafting rows (bench/decode_peer.py MODEL_SIZES)")
    parser.add_argument("--drafts", nargs="+", type=int, default=[1, 2, 3], help="draft counts of those rows")
    parser.add_argument("--sizes-batch", type=int, default=1, help="requests decoded at once in those rows")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    ensure_run(run_dir)
    use_cpu_devices(1)
    from composer_jax import load_config
    from composer_jax.infer import SamplingParams
    from composer_jax.source_weights import open_model

    opened = open_model(run_dir, [f"moe.dispatch={args.dispatch}"] if args.dispatch else [])
    model, cfg = opened.model, opened.model.cfg
    batch = prompts(opened.tokenizer, args.batch, args.prompt_len)
    max_len = min(cfg.rope.max_position_embeddings, args.prompt_len + args.new_tokens + 1)
    engine_args = dict(max_slots=args.batch, max_len=max_len, steps_per_call=args.steps_per_call or args.new_tokens,
                       chunk_sizes=(args.prompt_len,))
    results = {"model": opened.description, "dispatch": cfg.moe.dispatch, "batch": args.batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
               "greedy": compare(model, batch, args.new_tokens, lambda i: SamplingParams(temperature=0.0),
                                 args.reps, args.draft_tokens, **engine_args),
               "sampled_t1": compare(model, batch, args.new_tokens, lambda i: SamplingParams(seed=i),
                                     args.reps, args.draft_tokens, **engine_args),
               "prefill": prefill_figures(model, opened.tokenizer, 8, max_len - 1, 32, args.reps),
               "cache": {"tiny": cache_figures(cfg), "kimi-k2.5": cache_figures(load_config("kimi-k2.5"))},
               "sizes": speculative_sizes(tuple(args.sizes), tuple(args.drafts), args.prompt_len, args.new_tokens,
                                          args.reps, args.sizes_batch),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "load_average": [round(x, 2) for x in os.getloadavg()]},
               "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    for mode in ("greedy", "sampled_t1"):
        r = results[mode]
        print(f"{mode:>10}: plain {r['plain_tokens_per_s']:8.1f} tok/s, speculative {r['speculative_tokens_per_s']:8.1f} "
              f"tok/s ({r['speedup']:.2f}x), acceptance {100 * r['acceptance_rate']:.1f}%, mean accepted length "
              f"{r['mean_accepted_length']:.2f}, speculative step {r['step_cost_ratio']:.2f}x a plain one"
              + (f", same tokens: {r['same_tokens']}" if mode == "greedy" else ""))
    for size, sized in results["sizes"].items():
        for r in sized["rows"]:
            print(f"{size:>12} self-drafting, {r['draft_tokens']} drafts: plain {r['plain_tokens_per_s']:8.1f} tok/s, "
                  f"speculative {r['speculative_tokens_per_s']:8.1f} tok/s ({r['speedup']:.2f}x), acceptance "
                  f"{100 * r['acceptance_rate']:.1f}%, step {r['step_cost_ratio']:.2f}x a plain one")
    p = results["prefill"]
    print(f"   prefill: {p['prefill_tokens_per_s']:.1f} tok/s ({p['batch']} prompts of {p['prompt_len']} tokens, "
          f"chunks of {p['chunk']})")
    for name, c in results["cache"].items():
        print(f"     cache: {name}: {c['latent_bytes_per_token']} B/token latent vs {c['per_head_kv_bytes_per_token']} "
              f"per-head K/V ({c['ratio']}x smaller)")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
