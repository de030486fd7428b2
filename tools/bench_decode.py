"""Decode benchmark on the tiny model after the default pretraining run: plain vs MTP-speculative
decoding (greedy and sampled), prefill throughput and the latent cache's size per token.

    python tools/bench_decode.py --json bench_decode.json [--run-dir runs/pretrain-tiny]

Without a trained run in --run-dir it first trains the default one (`composer-jax pretrain`, ~3 min on
a laptop CPU), so a fresh clone can run it. Plain and speculative engines decode the same prompts
(snippets of this Python's standard library, the training data) in alternating repetitions; decode
tokens/s is the median over repetitions of tokens emitted / time in decode calls (compilation excluded:
every engine is warmed up first), the speedup the median of the paired per-repetition ratios. Greedy
speculative output must equal plain greedy output (reported as `same_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

STDLIB_FILES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py", "glob.py",
                "colorsys.py", "copy.py", "keyword.py", "queue.py", "sched.py", "this.py", "tty.py", "uu.py",
                "wave.py")


def ensure_run(run_dir: Path) -> None:
    """Train the default tiny pretraining run into `run_dir` unless it holds a checkpoint."""
    if (run_dir / "checkpoints").is_dir() and any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir()):
        return
    print(f"no trained run in {run_dir}: training the default one (composer-jax pretrain)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "composer_jax.cli", "pretrain", f"run_dir={run_dir.resolve()}",
                    "train.progress=false"], check=True, cwd=Path(__file__).resolve().parent.parent)


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the start of a function or class in standard-library files."""
    out, root = [], Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        start = max(text.find("\ndef "), 0)
        ids = [int(i) for i in tokenizer.encode(text[start:start + 4 * length])][:length]
        if len(ids) == length:
            out.append(ids)
        if len(out) == count:
            return out
    raise SystemExit(f"found only {len(out)} of {count} prompt files under {root}")


def decode_run(engine, batch, new_tokens: int, sampling, warmup: bool = False) -> tuple[dict, list[list[int]]]:
    """One repetition: the batch through the engine; (throughput figures, generated tokens)."""
    engine.stats.clear()
    ids = [engine.submit(p, max_new_tokens=new_tokens, sampling=sampling(i)) for i, p in enumerate(batch)]
    done = engine.run()
    s = engine.stats
    if s["compile_s"] and not warmup:
        raise RuntimeError("a measured repetition compiled a program")
    figures = {"decode_tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
               "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"],
               "drafted": s["drafted"], "accepted": s["accepted"]}
    return figures, [done[i].tokens for i in ids]


def compare(model, batch, new_tokens: int, sampling, reps: int, **engine_args) -> dict:
    from composer_jax.infer import Engine

    engines = {mode: Engine(model, speculative=mode == "speculative", **engine_args)
               for mode in ("plain", "speculative")}
    outputs = {}
    for mode, engine in engines.items():  # warm-up: compile every program used
        outputs[mode] = decode_run(engine, batch, new_tokens, sampling, warmup=True)[1]
    runs = {mode: [] for mode in engines}
    for _ in range(reps):
        for mode, engine in engines.items():
            runs[mode].append(decode_run(engine, batch, new_tokens, sampling)[0])
    median = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    drafted = sum(r["drafted"] for r in runs["speculative"])
    accepted = sum(r["accepted"] for r in runs["speculative"])
    plain, spec = median("plain", "decode_tokens_per_s"), median("speculative", "decode_tokens_per_s")
    # Repetitions alternate between the engines: the median of the paired ratios cancels slow drifts in
    # the machine's load.
    speedup = statistics.median(s["decode_tokens_per_s"] / p["decode_tokens_per_s"]
                                for p, s in zip(runs["plain"], runs["speculative"]))
    accepted_length = (drafted + accepted) / drafted
    return {"plain_tokens_per_s": round(plain, 1), "speculative_tokens_per_s": round(spec, 1),
            "speedup": round(speedup, 3), "acceptance_rate": round(accepted / drafted, 4),
            "mean_accepted_length": round(accepted_length, 4),
            # time of one speculative step (verify 2 positions + the MTP layer + sampling) / a plain step
            "step_cost_ratio": round(accepted_length / speedup, 3),
            "same_tokens": outputs["plain"] == outputs["speculative"],  # expected for greedy only
            "plain_runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in runs["plain"]],
            "speculative_runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in runs["speculative"]]}


def prefill_figures(model, tokenizer, batch: int, length: int, chunk: int, reps: int) -> dict:
    """Prompt throughput: `batch` prompts of `length` tokens prefilled in chunks of `chunk` (one new
    token each), median over repetitions."""
    from composer_jax.infer import Engine, SamplingParams

    engine = Engine(model, max_slots=batch, max_len=length + 1, chunk_sizes=(chunk,))
    batch_prompts = prompts(tokenizer, batch, length)
    rates = []
    for rep in range(reps + 1):
        figures, _ = decode_run(engine, batch_prompts, 1, lambda i: SamplingParams(temperature=0.0), warmup=rep == 0)
        if rep:
            rates.append(figures["prefill_tokens_per_s"])
    return {"prefill_tokens_per_s": round(statistics.median(rates), 1), "batch": batch, "prompt_len": length,
            "chunk": chunk}


def cache_figures(cfg) -> dict:
    from composer_jax.infer.cache import latent_bytes_per_token, per_head_kv_bytes_per_token

    latent, kv = latent_bytes_per_token(cfg), per_head_kv_bytes_per_token(cfg)
    return {"latent_bytes_per_token": latent, "per_head_kv_bytes_per_token": kv, "ratio": round(kv / latent, 2),
            "dtype": cfg.dtype, "layers": cfg.num_layers,
            "latent_values_per_layer": cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim}


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
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    ensure_run(run_dir)
    use_cpu_devices(1)
    from composer_jax import load_config
    from composer_jax.infer import SamplingParams
    from composer_jax.model_dirs import open_model

    opened = open_model(run_dir, [f"moe.dispatch={args.dispatch}"] if args.dispatch else [])
    model, cfg = opened.model, opened.model.cfg
    batch = prompts(opened.tokenizer, args.batch, args.prompt_len)
    max_len = min(cfg.rope.max_position_embeddings, args.prompt_len + args.new_tokens + 1)
    engine_args = dict(max_slots=args.batch, max_len=max_len, steps_per_call=args.steps_per_call or args.new_tokens,
                       chunk_sizes=(args.prompt_len,))
    results = {"model": opened.description, "dispatch": cfg.moe.dispatch, "batch": args.batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
               "greedy": compare(model, batch, args.new_tokens, lambda i: SamplingParams(temperature=0.0),
                                 args.reps, **engine_args),
               "sampled_t1": compare(model, batch, args.new_tokens, lambda i: SamplingParams(seed=i),
                                     args.reps, **engine_args),
               "prefill": prefill_figures(model, opened.tokenizer, 8, max_len - 1, 32, args.reps),
               "cache": {"tiny": cache_figures(cfg), "kimi-k2.5": cache_figures(load_config("kimi-k2.5"))},
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
