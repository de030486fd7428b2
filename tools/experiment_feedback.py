"""The targeted-feedback experiment: does self-distillation from a hint fix a local behaviour faster than the
reward alone? RL runs in arms sd_coef=0 and sd_coef=C (default 1), each with several seeds, from one warm
start, in one of two cases:

- `toy` (the default): additions answered through a `submit` tool call; a bad call gets its error back and
  the agent may retry, so a mistake costs a turn, not the reward. The warm start is an SFT run (made once,
  OUT/sft) on demonstrations of which a share first call a tool that does not exist (`answer`), then
  recover, and a share show the hint a flagged turn gets before the correct call (the teacher must be
  able to read a hint: a model the size of Kimi K2.5 can, a tiny one must be shown). Target:
  `flag_unknown_tool`.
- `coding`: `composer-jax rl rl-coding-tiny` from the recipe's SFT run (its `init_from`, or pass
  init_from=RUN with env.tasks_dir=... env.eval_dir=...). Target: `flag_malformed_call`, the tiny
  model's most frequent mistake.

Per step it records the targeted error rate (the share of turns with the flag), the reward, and every
other flag's rate (self-distillation must not buy one behaviour with another). It writes OUT/feedback.json
(every series, and per run each rate's least-squares slope over the steps and its means over the first
and last fifths) and OUT/feedback.png (each arm's mean with the seeds' range).

    python tools/experiment_feedback.py OUT [--case toy|coding] [--sd-coef C] [--seeds 3]
        [--wrong-tool-share 0.5] [--hinted-share 0.25] [key=value ...]

Each RL run goes to OUT/sd<C>-seed<S>; key=value overrides go to every RL run. A rerun reuses the SFT run
and every finished RL run.
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
       "train.steps=300", "train.batch_size=16", "train.seq_len=640", "optimizer.lr=1e-2", "data.eval_fraction=0",
       "train.progress=false"]
# Temperature 0.7: at 1 the byte-level warm start mistypes the call's markup in about half its turns.
CASES = {
    "toy": ("rl-tiny", "flag_unknown_tool",
            ["env.use_tool=true", "env.max_turns=2", "env.tasks=16", "rollout.max_new_tokens=96",
             "rollout.max_len=512", "rollout.temperature=0.7", "rl.max_tokens=96", "rollout.feedback_window=448",
             "rollout.batch_size=16", "rl.group_size=4", "rl.steps=40", "eval.every=0", "progress=false"]),
    "coding": ("rl-coding-tiny", "flag_malformed_call", ["rl.steps=24", "eval.every=0", "progress=false"]),
}
SERIES = ("reward_mean", "tool_turn_error_rate", "loss_sd", "sd_windows")


def cli(*argv: str) -> None:
    """`composer-jax ARGV`; on failure the experiment stops with one line (the command printed its error)."""
    rc = subprocess.run([sys.executable, "-m", "composer_jax.cli", *argv], check=False).returncode
    if rc:
        sys.exit(f"experiment_feedback: `composer-jax {' '.join(argv[:2])} ...` failed (exit {rc}); finished runs "
                 "are kept and a rerun reuses them")


def sft(out: Path, wrong_tool_share: float, hinted_share: float) -> Path:
    """The SFT run every RL run starts from (made once: a rerun reuses it)."""
    demos, run_dir = out / "toy-add-demos.jsonl", out / "sft"
    if not (run_dir / "chat.json").is_file():
        cli("tasks", "demos", "toy:add", str(demos), "--use-tool", "--count", "256", "--seed", "2",
            "--hinted-share", str(hinted_share), "--wrong-tool-share", str(wrong_tool_share))
        cli("sft", "sft-toy-tiny", *SFT, f"data.path={demos}", f"run_dir={run_dir}")
    return run_dir


def rl_run(out: Path, case: str, sd_coef: float, seed: int, overrides: list[str]) -> dict[str, list]:
    """One RL run's per-step series: SERIES and every flag's rate (made once: a rerun reuses a finished
    run's metrics)."""
    config, _, settings = CASES[case]
    run_dir, settings = out / f"sd{sd_coef:g}-seed{seed}", [*settings, *overrides]
    steps = int([o for o in settings if o.startswith("rl.steps=")][-1].split("=")[1])
    metrics = run_dir / "metrics.jsonl"
    done = metrics.is_file() and [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    if not done or done[-1]["step"] < steps:
        cli("rl", config, *settings, f"rl.sd_coef={sd_coef}", f"seed={seed}", f"sampler.seed={seed}",
            f"run_dir={run_dir}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    flags = sorted({k for r in records for k in r if k.startswith("flag_")})
    return {key: [r.get(key, 0.0) for r in records] for key in ("step", *flags, *SERIES)}


def trend(values: list[float]) -> dict[str, float]:
    """Least-squares slope per step, and the means over the first and last fifths of the steps."""
    xs = np.asarray(values, float)
    fifth = max(1, len(xs) // 5)
    return {"slope": float(np.polyfit(np.arange(len(xs)), xs, 1)[0]), "first_fifth": float(xs[:fifth].mean()),
            "last_fifth": float(xs[-fifth:].mean())}


def verdict(summary: dict, target: str) -> list[dict]:
    """Per seed, the sd arm against the sd_coef=0 arm over the first and last fifths: the targeted rate's
    fall (first - last) in each, whether it fell at least twice as much with self-distillation, the
    other flags whose last-fifth rate is higher with it (by more than 0.05), and the last-fifth rewards."""
    (_, plain), (_, hinted) = summary.items()
    out = []
    for p, h in zip(plain, hinted):
        fall = {arm: s[target]["first_fifth"] - s[target]["last_fifth"] for arm, s in (("plain", p), ("sd", h))}
        worse = {k: [p[k]["last_fifth"], h[k]["last_fifth"]] for k in h
                 if k.startswith("flag_") and k != target and h[k]["last_fifth"] > p[k]["last_fifth"] + 0.05}
        out.append({"target_fall": fall, "target_falls_2x_faster": fall["sd"] > 0 and fall["sd"] >= 2 * max(fall["plain"], 0),
                    "other_flags_worse": worse, "reward_last_fifth": [p["reward_mean"]["last_fifth"],
                                                                      h["reward_mean"]["last_fifth"]],
                    "reward_not_lower": h["reward_mean"]["last_fifth"] >= p["reward_mean"]["last_fifth"]})
    return out


def plot(arms: dict[str, list[dict]], target: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for rs in arms.values() for r in rs]
    others = sorted({k for r in runs for k in r if k.startswith("flag_") and k != target and any(r[k])})
    keys = (target, "reward_mean", *others)
    cols = 3
    fig, axes = plt.subplots(-(-len(keys) // cols), cols, figsize=(16, 4 * -(-len(keys) // cols)), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        for name, runs in arms.items():
            values = np.asarray([r.get(key, [0.0] * len(r["step"])) for r in runs], float)   # [seeds, steps]
            steps = runs[0]["step"]
            ax.plot(steps, values.mean(0), label=f"{name} (mean of {len(runs)} seeds)")
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
        ax.set(xlabel="step", title=key + (" (targeted)" if key == target else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--case", choices=tuple(CASES), default="toy", help="the environment (default toy)")
    parser.add_argument("--sd-coef", type=float, default=1.0, help="rl.sd_coef of the self-distillation arm")
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds per arm (default 3)")
    parser.add_argument("--wrong-tool-share", type=float, default=0.5,
                        help="toy: share of the SFT demonstrations that first call a tool that does not exist")
    parser.add_argument("--hinted-share", type=float, default=0.25,
                        help="toy: share of the SFT demonstrations that show a hint before the correct turn")
    args = parser.parse_intermixed_args()       # the options may come between overrides
    if args.seeds < 1 or args.sd_coef <= 0:
        parser.error("--seeds must be >= 1 and --sd-coef > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = args.overrides
    if args.case == "toy":
        overrides = [f"init_from={sft(args.out, args.wrong_tool_share, args.hinted_share)}", *overrides]
    target = CASES[args.case][1]
    arms = {f"sd_coef={c:g}": [rl_run(args.out, args.case, c, seed, overrides) for seed in range(args.seeds)]
            for c in (0.0, args.sd_coef)}
    summary = {name: [{key: trend(r[key]) for key in r if key.startswith("flag_") or key == "reward_mean"}
                      for r in runs] for name, runs in arms.items()}
    verdicts = verdict(summary, target)
    (args.out / "feedback.json").write_text(json.dumps(
        {"case": args.case, "target": target, "sd_coef": args.sd_coef, "rl": [*CASES[args.case][2], *overrides],
         **({"sft": SFT, "wrong_tool_share": args.wrong_tool_share, "hinted_share": args.hinted_share}
            if args.case == "toy" else {}),
         "verdict": verdicts, "summary": summary, "runs": arms}, indent=1))
    plot(arms, target, args.out / "feedback.png")
    for name, runs in summary.items():
        for seed, s in enumerate(runs):
            t, r = s[target], s["reward_mean"]
            print(f"{name} seed {seed}: {target} {t['first_fifth']:.3f} -> {t['last_fifth']:.3f} "
                  f"(slope {t['slope']:+.4f}/step), reward {r['first_fifth']:.3f} -> {r['last_fifth']:.3f}")
    for seed, v in enumerate(verdicts):
        print(f"seed {seed}: {target} fell {v['target_fall']['plain']:+.3f} without, {v['target_fall']['sd']:+.3f} "
              f"with self-distillation (2x faster: {'yes' if v['target_falls_2x_faster'] else 'no'}); other flags "
              f"worse with it: {', '.join(v['other_flags_worse']) or 'none'}; reward in the last fifth "
              f"{v['reward_last_fifth'][0]:.3f} without, {v['reward_last_fifth'][1]:.3f} with")
    print(f"wrote {args.out / 'feedback.json'} and {args.out / 'feedback.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
