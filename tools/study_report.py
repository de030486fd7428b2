"""The coding study's report (tools/experiment_coding.py writes the runs): OUT/study.json with every number
and OUT/study.md with the tables, plus three plots in OUT/plots/:

- held-out pass@1 and pass@k of the SFT run and of each RL seed, with the paired bootstrap interval of
  RL - SFT (composer_jax.eval.compare);
- pass@1 by difficulty level: the bug injections by mutation kind, the body deletions by deleted lines;
- per RL step and arm (self-distillation on the selected flag kinds, and off): the reward, and every flag
  kind's share of turns, with the targeted kinds' slopes (per step, least squares) side by side.

    python tools/study_report.py OUT --seeds 3 --flags redundant_call,wrong_tool
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from composer_jax.envs.feedback import FLAG_KINDS
from composer_jax.eval.compare import compare_runs
from composer_jax.eval.scores import summarize, task_table
from composer_jax.eval.store import read_attempts
from composer_jax.train.metrics import read_metrics

ARMS = ("sd", "nosd")


def level_of(task_dir: Path) -> str:
    """A gym task's difficulty level: 'bug: KIND' (the mutation) or 'body: N lines' (deleted lines, in bands)."""
    spec = json.loads((task_dir / "task.json").read_text())
    d = spec.get("difficulty", {})
    if spec.get("family") == "bug_injection":
        return f"bug: {d.get('mutation')}"
    lines = d.get("deleted_lines", 0)
    return "body: 1-3 lines" if lines <= 3 else "body: 4-5 lines" if lines <= 5 else "body: 6+ lines"


def pass_at_1_by_level(eval_dir: Path, tasks_dir: Path) -> dict[str, dict]:
    """{level: {"tasks": n, "pass@1": value, "ci": [lo, hi]}} of an eval run."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in read_attempts(eval_dir):
        groups[level_of(tasks_dir / record["task"])].append(record)
    out = {}
    for level, records in sorted(groups.items()):
        table = task_table(records)
        est = summarize(table)["pass@1"]
        out[level] = {"tasks": len(table.tasks), "pass@1": est.value, "ci": est.ci}
    return out


def eval_scores(eval_dir: Path) -> dict:
    summary = json.loads((eval_dir / "summary.json").read_text())
    return {"tasks": summary["tasks"], "samples": summary["samples"],
            **{k: v for k, v in summary["scores"].items() if k.startswith("pass@") or k == "mean_reward"}}


def paired(sft: Path, rl: Path) -> dict:
    """RL - SFT per pass@k with its paired 95% bootstrap interval over tasks."""
    c = compare_runs(sft, rl)
    return {row.score.name: {"diff": row.diff.value, "ci": row.diff.ci} for row in c.rows
            if row.score.name.startswith("pass@")} | {"solved_only_by_sft": len(c.solved_only_by[0]),
                                                       "solved_only_by_rl": len(c.solved_only_by[1])}


def rl_curves(run_dir: Path) -> dict[str, list]:
    """Per step of an RL run: step, reward_mean and flag_<kind> (the share of turns flagged)."""
    keys = ["reward_mean", "pass_rate", *(f"flag_{k}" for k in FLAG_KINDS)]
    curves: dict[str, list] = {"step": [], **{k: [] for k in keys}}
    for record in read_metrics(run_dir):
        if "reward_mean" not in record:
            continue
        curves["step"].append(record["step"])
        for k in keys:
            curves[k].append(record.get(k))
    return curves


def slope(steps: list, values: list) -> float | None:
    """The least-squares change per step (None: fewer than two points)."""
    pts = [(s, v) for s, v in zip(steps, values) if v is not None]
    if len(pts) < 2:
        return None
    x, y = np.array(pts, dtype=float).T
    return float(np.polyfit(x, y, 1)[0])


def collect(out: Path, seeds: int, targeted: list[str]) -> dict:
    gym, evals, runs = out / "gym", out / "evals", out / "runs"
    study: dict = {"targeted_flags": targeted, "phases": [
        json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]}
    study["pretrain"] = _last(runs / "pretrain", ("eval_loss", "eval_bpb", "ce"))
    study["sft"] = _last(runs / "sft", ("ce", "eval_loss"))
    probe = out / "copy_probe.json"           # tools/copy_probe.py: random tokens read twice
    study["copy"] = json.loads(probe.read_text()) if probe.is_file() else []
    # sft-train: the SFT run on as many training tasks as there are held-out ones (what it was trained on)
    study["eval"] = {"sft-train": eval_scores(evals / "sft-train"), "sft": eval_scores(evals / "sft")}
    study["by_level"] = {"sft-train": pass_at_1_by_level(evals / "sft-train", gym),
                         "sft": pass_at_1_by_level(evals / "sft", gym / "held-out")}
    study["paired"], study["curves"], study["slopes"] = {}, {}, {}
    for seed in range(seeds):
        name = f"rl-{seed}"
        study["eval"][name] = eval_scores(evals / name)
        study["by_level"][name] = pass_at_1_by_level(evals / name, gym / "held-out")
        study["paired"][name] = paired(evals / "sft", evals / name)
        for arm in ARMS:
            curves = rl_curves(runs / f"{name}-{arm}")
            study["curves"][f"{name}-{arm}"] = curves
            study["slopes"][f"{name}-{arm}"] = {k: slope(curves["step"], curves[f"flag_{k}"]) for k in targeted} | {
                "reward_final": curves["reward_mean"][-1] if curves["reward_mean"] else None}
    return study


def _last(run_dir: Path, keys: tuple[str, ...]) -> dict:
    """The last value of each key in a training run's metrics, with its step."""
    found = {}
    for record in read_metrics(run_dir):
        for k in keys:
            if k in record:
                found[k] = {"step": record["step"], "value": record[k]}
    return found


def _ci(ci) -> str:
    return "-" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _v(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(study: dict) -> str:
    evals = study["eval"]
    ks = sorted({k for e in evals.values() for k in e if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    lines = ["# The coding study", "", "| run | tasks x samples | " + " | ".join(ks) + " | mean reward |",
             "|---|---|" + "---|" * (len(ks) + 1)]
    for name, e in evals.items():
        lines.append(f"| {name} | {e['tasks']} x {e['samples']} | " + " | ".join(
            f"{_v(e[k]['value'])} {_ci(e[k]['ci'])}" if k in e else "-" for k in ks)
            + f" | {_v(e['mean_reward']['value'])} |")
    lines += ["", "RL - SFT, paired bootstrap 95% interval over held-out tasks:", "",
              "| seed | " + " | ".join(ks) + " | solved only by SFT / by RL |", "|---|" + "---|" * (len(ks) + 1)]
    for name, p in study["paired"].items():
        lines.append(f"| {name} | " + " | ".join(f"{p[k]['diff']:+.3f} {_ci(p[k]['ci'])}" if k in p else "-"
                                                for k in ks) + f" | {p['solved_only_by_sft']} / {p['solved_only_by_rl']} |")
    runs = list(study["by_level"])
    levels = sorted({lv for by in study["by_level"].values() for lv in by})
    lines += ["", "Held-out pass@1 by difficulty level:", "", "| level | tasks | " + " | ".join(runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    for lv in levels:
        n = next(by[lv]["tasks"] for by in study["by_level"].values() if lv in by)
        lines.append(f"| {lv} | {n} | " + " | ".join(_v(study["by_level"][r].get(lv, {}).get("pass@1"))
                                                    for r in runs) + " |")
    lines += ["", f"Targeted flags ({', '.join(study['targeted_flags'])}): change of each one's share of turns per "
              "RL step (least squares), and the last step's reward:", "",
              "| run | " + " | ".join(study["targeted_flags"]) + " | final reward |",
              "|---|" + "---|" * (len(study["targeted_flags"]) + 1)]
    for name, s in study["slopes"].items():
        lines.append(f"| {name} | " + " | ".join("-" if s[k] is None else f"{s[k]:+.4f}"
                                                for k in study["targeted_flags"]) + f" | {_v(s['reward_final'])} |")
    lines += ["", "Copying from context (`tools/copy_probe.py`: random tokens read twice; NLL in nats per token):", "",
              "| model | first reading | second reading | second reading greedy |", "|---|---|---|---|"]
    lines += [f"| {c['model']} | {c['first_nll']:.3f} | {c['second_nll']:.3f} | {c['second_greedy']:.1%} |"
              for c in study["copy"]]
    lines += ["", "| phase | wall s |", "|---|---|"] + [f"| {p['phase']} | {p['wall_s']:.0f} |" for p in study["phases"]]
    return "\n".join(lines) + "\n"


def plots(study: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(study["by_level"])
    levels = sorted({lv for by in study["by_level"].values() for lv in by})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(np.arange(len(levels)) + i * width, [study["by_level"][name].get(lv, {}).get("pass@1") or 0
                                                    for lv in levels], width, label=name)
    ax.set_xticks(np.arange(len(levels)) + 0.4 - width / 2, levels, rotation=45, ha="right")
    ax.set_ylabel("held-out pass@1"), ax.legend(), fig.tight_layout()
    fig.savefig(out / "pass_by_level.png", dpi=120), plt.close(fig)
    kinds = ["reward_mean", *(f"flag_{k}" for k in FLAG_KINDS)]
    kinds = ["reward_mean"] + [k for k in kinds[1:] if any(any(c[k]) for c in study["curves"].values())]
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds), 3), squeeze=False)
    for ax, key in zip(axes[0], kinds):
        for arm, color in zip(ARMS, ("C0", "C1")):
            runs = [c for n, c in study["curves"].items() if n.endswith(f"-{arm}") and c["step"]]
            if not runs:
                continue
            steps = min((c["step"] for c in runs), key=len)
            values = np.array([[v or 0.0 for v in c[key][:len(steps)]] for c in runs])
            ax.plot(steps, values.mean(0), "o-", color=color, label=arm, markersize=3)
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
        ax.set_title(key, fontsize=9), ax.set_xlabel("RL step")
    axes[0][0].legend(), fig.tight_layout()
    fig.savefig(out / "rl_flags.png", dpi=120), plt.close(fig)


def write_report(out: Path, seeds: int, targeted: list[str]) -> dict:
    study = collect(out, seeds, targeted)
    (out / "study.json").write_text(json.dumps(study, indent=1))
    (out / "study.md").write_text(markdown(study))
    plots(study, out / "plots")
    return study


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--flags", default="redundant_call,wrong_tool", help="the targeted flag kinds (rl.sd_flags)")
    args = p.parse_args()
    write_report(args.out, args.seeds, args.flags.split(","))
    print((args.out / "study.md").read_text())


if __name__ == "__main__":
    main()
