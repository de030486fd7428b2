"""The targeted-feedback experiment: does self-distillation from a hint fix a local behaviour faster than the
reward alone? A toy tool-use task (answers go through a `submit` tool call; a bad call gets its error back
and the agent may retry, so a mistake costs a turn, not the reward) starts from an SFT run on
demonstrations of which a share first call a tool that does not exist (`answer`), then recover. RL then
runs in arms sd_coef=0 and sd_coef=C (default 1), each with several seeds, from that one SFT run.

Per step it records the targeted error rate (the share of turns flagged unknown_tool), the reward, and
every other flag's rate (self-distillation must not buy one behaviour with another). It writes
OUT/feedback.json (every series, and per run the rate's least-squares slope over the steps and its means
over the first and last fifths) and OUT/feedback.png (each arm's mean with the seeds' range).

    python tools/experiment_feedback.py OUT [--sd-coef C] [--seeds 3] [--wrong-tool-share 0.33] [key=value ...]

The SFT run is made once (OUT/sft) and reused; each RL run is `composer-jax rl rl-tiny env.use_tool=true
init_from=OUT/sft ...` in OUT/sd<C>-seed<S>; key=value overrides go to every RL run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

# A submit call is ~80 bytes after a ~210-byte prompt; a hint with its frame up to ~330 bytes. Plain
# RoPE: the random tiny model learns the call's local structure far faster than under YaRN's stretch.
SFT = ["model.rope.max_position_embeddings=1024", "model.rope.factor=1", "model.rope.original_max_position_embeddings=1024",
       "train.steps=150", "train.batch_size=16", "train.seq_len=640", "optimizer.lr=1e-2", "data.eval_fraction=0",
       "train.progress=false"]
TOOL_USE = ["env.use_tool=true", "env.max_turns=2", "env.tasks=16", "rollout.max_new_tokens=96",
            "rollout.max_len=512", "rl.max_tokens=96", "rollout.feedback_window=448", "rollout.batch_size=16",
            "rl.group_size=4", "rl.steps=40", "eval.every=0", "progress=false"]
TARGET = "flag_unknown_tool"
OTHERS = ("flag_malformed_call", "flag_invalid_arguments", "flag_no_action", "flag_repeated_call")
SERIES = (TARGET, *OTHERS, "reward_mean", "tool_turn_error_rate", "loss_sd", "sd_windows")


def cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "composer_jax.cli", *argv], check=True)


def sft(out: Path, wrong_tool_share: float, hinted_share: float) -> Path:
    """The SFT run every RL run starts from (made once: a rerun reuses it)."""
    demos, run_dir = out / "toy-add-demos.jsonl", out / "sft"
    if not (run_dir / "chat.json").is_file():
        cli("tasks", "demos", "toy:add", str(demos), "--use-tool", "--count", "256", "--seed", "2",
            "--hinted-share", str(hinted_share), "--wrong-tool-share", str(wrong_tool_share))
        cli("sft", "sft-toy-tiny", *SFT, f"data.path={demos}", f"run_dir={run_dir}")
    return run_dir


def rl_run(out: Path, sd_coef: float, seed: int, source: Path, overrides: list[str]) -> dict[str, list]:
    """One RL run's per-step series (made once: a rerun reuses a finished run's metrics)."""
    run_dir, settings = out / f"sd{sd_coef:g}-seed{seed}", [*TOOL_USE, *overrides]
    steps = int([o for o in settings if o.startswith("rl.steps=")][-1].split("=")[1])
    metrics = run_dir / "metrics.jsonl"
    done = metrics.is_file() and [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    if not done or done[-1]["step"] < steps:
        cli("rl", "rl-tiny", *settings, f"init_from={source}", f"rl.sd_coef={sd_coef}", f"seed={seed}",
            f"sampler.seed={seed}", f"run_dir={run_dir}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    return {key: [r.get(key) for r in records] for key in ("step", *SERIES)}


def trend(values: list[float]) -> dict[str, float]:
    """Least-squares slope per step, and the means over the first and last fifths of the steps."""
    xs = np.asarray(values, float)
    fifth = max(1, len(xs) // 5)
    return {"slope": float(np.polyfit(np.arange(len(xs)), xs, 1)[0]), "first_fifth": float(xs[:fifth].mean()),
            "last_fifth": float(xs[-fifth:].mean())}


def plot(arms: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (TARGET, "reward_mean", *OTHERS)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, key in zip(axes.flat, keys):
        for name, runs in arms.items():
            values = np.asarray([r[key] for r in runs], float)         # [seeds, steps]
            steps = runs[0]["step"]
            ax.plot(steps, values.mean(0), label=f"{name} (mean of {len(runs)} seeds)")
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
        ax.set(xlabel="step", title=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--sd-coef", type=float, default=1.0, help="rl.sd_coef of the self-distillation arm")
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds per arm (default 3)")
    parser.add_argument("--wrong-tool-share", type=float, default=0.5,
                        help="share of the SFT demonstrations that first call a tool that does not exist")
    parser.add_argument("--hinted-share", type=float, default=0.25,
                        help="share of the SFT demonstrations that show a hint before the correct turn")
    args = parser.parse_intermixed_args()       # the options may come between overrides
    if args.seeds < 1 or args.sd_coef <= 0:
        parser.error("--seeds must be >= 1 and --sd-coef > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    source = sft(args.out, args.wrong_tool_share, args.hinted_share)
    arms = {f"sd_coef={c:g}": [rl_run(args.out, c, seed, source, args.overrides) for seed in range(args.seeds)]
            for c in (0.0, args.sd_coef)}
    summary = {name: [{key: trend(r[key]) for key in (TARGET, *OTHERS, "reward_mean")} for r in runs]
               for name, runs in arms.items()}
    (args.out / "feedback.json").write_text(json.dumps(
        {"sft": SFT, "wrong_tool_share": args.wrong_tool_share, "hinted_share": args.hinted_share, "rl": TOOL_USE + args.overrides,
         "summary": summary, "runs": arms}, indent=1))
    plot(arms, args.out / "feedback.png")
    for name, runs in summary.items():
        for seed, s in enumerate(runs):
            t, r = s[TARGET], s["reward_mean"]
            print(f"{name} seed {seed}: {TARGET} {t['first_fifth']:.3f} -> {t['last_fifth']:.3f} "
                  f"(slope {t['slope']:+.4f}/step), reward {r['first_fifth']:.3f} -> {r['last_fifth']:.3f}")
    print(f"wrote {args.out / 'feedback.json'} and {args.out / 'feedback.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
