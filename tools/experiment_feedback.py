"""The targeted-feedback experiment: the toy tool-use task (answers go through a `submit` tool call)
trained twice with the same seeds, without (sd_coef=0) and with (sd_coef=1, or --sd-coef) self-distillation
on the flagged turns; writes OUT/feedback.json and OUT/feedback.png with the tool errors and the reward per
step of both runs. Tool errors are measured per turn (`tool_turn_error_rate`: a call that does not
parse or validate, or no call at all) and per attempted call (`tool_error_rate`); only the first counts
a policy that stops calling the tool, which then fails no call.

    python tools/experiment_feedback.py OUT [--sd-coef C] [--hinted-share S] [key=value ...]   # overrides of both RL runs

Both RL runs start from one SFT run (OUT/sft: `composer-jax sft sft-toy-tiny` on `composer-jax tasks demos
toy:add --use-tool` demonstrations, a share of them hinted as the teacher sees them); each RL run is
`composer-jax rl rl-tiny env.use_tool=true init_from=OUT/sft ...` in its own run directory under OUT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

# A submit call is ~80 bytes after a ~210-byte prompt; a hint with its frame up to ~330 bytes. Plain
# RoPE: the random tiny model learns the call's local structure far faster than under YaRN's stretched
# positions. 150 SFT steps leave it writing the call mostly right, so tool errors are common but not
# universal when RL starts.
SFT = ["model.rope.max_position_embeddings=1024", "model.rope.factor=1", "model.rope.original_max_position_embeddings=1024",
       "train.steps=150", "train.batch_size=16", "train.seq_len=640", "optimizer.lr=1e-2", "data.eval_fraction=0",
       "train.progress=false"]
TOOL_USE = ["env.use_tool=true", "env.tasks=16", "rollout.max_new_tokens=96", "rollout.max_len=320",
            "rl.max_tokens=96", "rollout.feedback_window=448", "rollout.batch_size=16", "rl.group_size=4",
            "rl.steps=40"]
SERIES = ("tool_turn_error_rate", "tool_error_rate", "tool_calls_mean", "reward_mean", "loss_sd", "flagged_turns")
SUMMARISED = ("tool_turn_error_rate", "tool_error_rate", "reward_mean")


def cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "composer_jax.cli", *argv], check=True)


def sft(out: Path, hinted_share: float, seed: str) -> Path:
    """The SFT run both RL runs start from (made once: a rerun reuses it)."""
    demos, run_dir = out / "toy-add-demos.jsonl", out / "sft"
    if not (run_dir / "chat.json").is_file():
        cli("tasks", "demos", "toy:add", str(demos), "--use-tool", "--count", "256", "--seed", "2",
            "--hinted-share", str(hinted_share))
        cli("sft", "sft-toy-tiny", *SFT, f"data.path={demos}", f"run_dir={run_dir}", f"train.seed={seed}")
    return run_dir


def run(out: Path, sd_coef: float, source: Path, overrides: list[str]) -> list[dict]:
    run_dir = out / f"sd{sd_coef:g}"
    cli("rl", "rl-tiny", *TOOL_USE, f"init_from={source}", f"rl.sd_coef={sd_coef}", f"run_dir={run_dir}",
        "progress=false", "eval.every=0", *overrides)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--sd-coef", type=float, default=1.0, help="rl.sd_coef of the run with self-distillation")
    parser.add_argument("--hinted-share", type=float, default=0.0,
                        help="share of the SFT demonstrations shown after a mistake's hint (tasks demos)")
    args = parser.parse_intermixed_args()       # the options may come between overrides
    args.out.mkdir(parents=True, exist_ok=True)
    seed = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("seed=")), "0")
    source = sft(args.out, args.hinted_share, seed)
    results = {}
    for sd_coef in (0.0, args.sd_coef):
        records = run(args.out, sd_coef, source, args.overrides)
        results[f"sd_coef={sd_coef:g}"] = {key: [r.get(key) for r in records] for key in ("step", *SERIES)}
    fifth = lambda xs: max(1, len(xs) // 5)  # noqa: E731
    summary = {name: {f"{key}_{part}": float(np.mean(xs[:fifth(xs)] if part == "first_fifth" else xs[-fifth(xs):]))
                      for key in SUMMARISED for xs in [r[key]]
                      for part in ("first_fifth", "last_fifth")} for name, r in results.items()}
    (args.out / "feedback.json").write_text(json.dumps({"sft": SFT, "hinted_share": args.hinted_share,
                                                        "overrides": TOOL_USE + args.overrides, "summary": summary,
                                                        "runs": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    labels = ("turns with a tool error (bad or no call)", "failed / attempted calls", "mean reward")
    for ax, key, label in zip(axes, SUMMARISED, labels):
        for name, r in results.items():
            ax.plot(r["step"], r[key], label=name)
        ax.set(xlabel="step", ylabel=label, title=f"{label}: toy tool-use task")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "feedback.png", dpi=100)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'feedback.json'} and {args.out / 'feedback.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
