"""The coding study (docs/coding-study.md): does the recipe teach a small model to code? One command runs
every phase with the project's own commands, each phase skipped once its output is complete, so the same
command again resumes an interrupted study:

    python tools/experiment_coding.py OUT [--scale full|smoke] [--seeds 3] [--until PHASE]

    gym        composer-jax tasks gym OUT/gym                 training tasks and held-out templates' tasks
    pretrain   composer-jax pretrain pretrain-small           the small model on the stdlib and site-packages
    demos      composer-jax tasks demos OUT/gym ...           solving conversations, a share hinted
    sft        composer-jax sft sft-small                     from the pretrained run
    copy-probe tools/copy_probe.py of the pretrained and SFT runs: do they copy from their context?
    eval-sft   composer-jax eval RUN OUT/gym/held-out --samples K
    eval-sft-train   the same on as many training tasks (OUT/train-sample): held-out against seen
    rl-S-ARM   composer-jax rl rl-coding-small seed=S         ARM: sd (self-distillation on the selected
                                                              flags, rl.sd_flags) or nosd (rl.sd_coef=0)
    eval-rl-S  composer-jax eval of each sd run
    report     OUT/study.json and OUT/study.md: pass@1 and pass@k of SFT and RL with the paired bootstrap
               interval, pass@1 by difficulty level, per-step flag rates and reward of both arms; plots

Every phase's command and wall time go to OUT/phases.jsonl; its output to OUT/logs/PHASE.log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path


TOOLS = "read_file,edit,run,submit"
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Scale:
    """The study's size. full: the documented study (about 90 minutes on 2 cores is the target);
    smoke: every phase at the smallest size that runs (the suite's end-to-end check)."""
    tasks: int
    held_out: int
    samples: int                 # eval attempts per held-out task
    pretrain: tuple[str, ...]    # overrides of pretrain-small
    sft: tuple[str, ...]         # overrides of sft-small
    rl: tuple[str, ...]          # overrides of rl-coding-small
    sd_flags: str = "redundant_call,wrong_tool"   # the flag kinds that get teacher windows (sd arm: rl.sd_flags)


SCALES = {
    "full": Scale(tasks=1000, held_out=64, samples=8, pretrain=(), sft=(), rl=()),
    "smoke": Scale(tasks=4, held_out=1, samples=1,
                   pretrain=("model=tiny", "model.vocab_size=4096", "model.rope.max_position_embeddings=2048",
                             "model.rope.factor=128", "model.rope.original_max_position_embeddings=16",
                             "train.steps=2", "train.batch_size=2", "train.seq_len=64",
                             "train.eval_every=2", "train.eval_batches=1",
                             "checkpoint.every=2"),
                   sft=("train.steps=2", "train.batch_size=2", "data.eval_fraction=0",
                        "agent.max_turns=2", "agent.max_new_tokens=32", "checkpoint.every=2"),
                   rl=("rl.steps=1", "rl.group_size=2", "rollout.batch_size=2", "rollout.max_new_tokens=32",
                       "rollout.max_slots=2", "env.max_turns=2", "checkpoint.every=1")),
}


class Study:
    def __init__(self, out: Path, scale: Scale, seeds: int, quiet: bool):
        # Absolute: the training sample links its tasks by path (a relative OUT made links that did not resolve).
        self.out, self.scale, self.seeds, self.quiet = out.resolve(), scale, seeds, quiet
        self.gym, self.runs, self.evals = self.out / "gym", self.out / "runs", self.out / "evals"
        self.done = self.out / "done"

    def phase(self, name: str, *argv) -> None:
        """Run `composer-jax ARGV` (or the script ARGV[0] with its arguments) as phase `name` unless it
        finished before; a failure stops the study with the phase's log named."""
        if (self.done / name).exists():
            return
        log = self.out / "logs" / f"{name}.log"
        script = str(argv[0]).endswith(".py")
        self.say(f"{name}: {'' if script else 'composer-jax '}{' '.join(map(str, argv))}")
        t0 = time.perf_counter()
        with open(log, "w") as f:
            program = [] if script else ["-m", "composer_jax.cli"]
            code = subprocess.call([sys.executable, *program, *map(str, argv)], stdout=f,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        if code:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            sys.exit(f"experiment_coding: phase {name} failed (exit {code}); its log: {log}\n{tail}")
        with open(self.out / "phases.jsonl", "a") as f:
            f.write(json.dumps({"phase": name, "argv": [str(a) for a in argv], "wall_s": round(wall, 1)}) + "\n")
        (self.done / name).touch()
        self.say(f"{name}: done in {wall:.0f} s")

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    def phases(self) -> list[tuple[str, object]]:
        """(name, argv) in order; an argv that needs an earlier phase's output is a function of none."""
        s, runs, gym = self.scale, self.runs, self.gym
        steps = [
            ("gym", ("tasks", "gym", gym, "--tasks", s.tasks, "--held-out", s.held_out, "--seed", 0)),
            ("pretrain", ("pretrain", "pretrain-small", f"run_dir={runs / 'pretrain'}", "train.progress=false",
                          *s.pretrain)),
            ("demos", ("tasks", "demos", gym, self.out / "demos.jsonl", "--tools", TOOLS,
                       "--max-output-chars", 1000)),
            ("sft", ("sft", "sft-small", f"run_dir={runs / 'sft'}", f"train.init_from={runs / 'pretrain'}",
                     f"data.path={self.out / 'demos.jsonl'}", "train.progress=false", *s.sft)),
            ("copy-probe", (HERE / "copy_probe.py", runs / "pretrain", runs / "sft",
                            "--json", self.out / "copy_probe.json")),
            ("eval-sft", self.eval_argv(runs / "sft", "sft")),
            ("eval-sft-train", lambda: self.eval_argv(runs / "sft", "sft-train", self.train_sample())),
        ]
        for seed in range(self.seeds):
            for arm in ("sd", "nosd"):
                steps.append((f"rl-{seed}-{arm}", self.rl_argv(seed, arm)))
            steps.append((f"eval-rl-{seed}", self.eval_argv(runs / f"rl-{seed}-sd", f"rl-{seed}")))
        return steps

    def run(self, until: str | None) -> None:
        for d in (self.done, self.out / "logs"):
            d.mkdir(parents=True, exist_ok=True)
        for name, argv in self.phases():
            self.phase(name, *(argv() if callable(argv) else argv))
            if name == until:
                return
        self.report()

    def train_sample(self) -> Path:
        """As many training tasks as there are held-out ones (the first, in id order), linked into one
        directory: SFT's pass@1 on tasks like those it was trained on, beside the held-out one."""
        sample = self.out / "train-sample"
        if not sample.is_dir():
            held_out = sum(1 for p in (self.gym / "held-out").iterdir() if (p / "task.json").is_file())
            tasks = sorted(p for p in self.gym.iterdir() if (p / "task.json").is_file())[:held_out]
            partial = sample.with_name(sample.name + ".partial")
            partial.mkdir(exist_ok=True)
            for task in tasks:
                if not (partial / task.name).exists():
                    (partial / task.name).symlink_to(task)
            partial.rename(sample)
        return sample

    def eval_argv(self, model: Path, name: str, tasks: Path | None = None) -> tuple:
        return ("eval", model, tasks or self.gym / "held-out", "--samples", self.scale.samples, "--out", self.evals / name,
                "--workers", 8, "--quiet")

    def rl_argv(self, seed: int, arm: str) -> tuple:
        sd = (f"rl.sd_flags=[{self.scale.sd_flags}]",) if arm == "sd" else ("rl.sd_coef=0",)
        return ("rl", "rl-coding-small", f"run_dir={self.runs / f'rl-{seed}-{arm}'}",
                f"init_from={self.runs / 'sft'}", f"env.tasks_dir={self.gym}", f"env.eval_dir={self.gym / 'held-out'}",
                f"seed={seed}", "progress=false", *sd, *self.scale.rl)

    def report(self) -> None:
        from study_report import write_report       # tools/study_report.py: numbers, table, plots
        write_report(self.out, self.seeds, self.scale.sd_flags.split(","))
        self.say(f"report: {self.out / 'study.md'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the study's directory (resumed when it exists)")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--seeds", type=int, default=3, help="RL seeds per arm (default 3)")
    p.add_argument("--until", help="stop after this phase (gym, pretrain, demos, sft, eval-sft, rl-S-ARM, ...)")
    p.add_argument("--quiet", action="store_true", help="no line per phase on stderr")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    study = Study(args.out, SCALES[args.scale], args.seeds, args.quiet)
    names = [name for name, _ in study.phases()]
    if args.until is not None and args.until not in names:
        p.error(f"--until: no phase {args.until!r} (the phases: {', '.join(names)})")
    try:
        study.run(args.until)
    except KeyboardInterrupt:
        sys.exit(f"experiment_coding: interrupted; the same command resumes {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
