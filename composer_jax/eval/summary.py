"""The summary of a run: scores with confidence intervals and per-task counts, all computed from the
attempt records (so a restarted run's summary is the uninterrupted run's), plus timing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from composer_jax.eval.scores import DEFAULT_LEVEL, DEFAULT_RESAMPLES, Estimate, score_defs, summarize, task_table


@dataclasses.dataclass(frozen=True)
class Summary:
    agent: str
    tasks: int
    samples: int                      # attempts per task
    level: float                      # of the confidence intervals
    scores: dict[str, Estimate]
    per_task: dict[str, dict]         # task -> {"solved": c, "attempts": n, "mean_reward": r}
    timing: dict[str, float]          # seconds; the one part that differs between reruns

    def to_json(self) -> dict:
        return {"agent": self.agent, "tasks": self.tasks, "samples": self.samples, "level": self.level,
                "scores": {name: e.to_json() for name, e in self.scores.items()}, "per_task": self.per_task,
                "timing": self.timing}


def build_summary(agent: str, records: Sequence[Mapping], *, level: float = DEFAULT_LEVEL,
                  resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Summary:
    table = task_table(records)
    per_task = {t: {"solved": int(c), "attempts": table.samples, "mean_reward": float(m)}
                for t, c, m in zip(table.tasks, table.solved, table.num["mean_reward"])}
    seconds = [r["wall_s"] for r in records]
    timing = {"attempt_seconds_total": round(sum(seconds), 3),
              "attempt_seconds_mean": round(sum(seconds) / len(seconds), 3)}
    return Summary(agent, len(table.tasks), table.samples, level,
                   summarize(table, level=level, resamples=resamples, seed=seed), per_task, timing)


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 1000 else f"{x:.0f}"


def summary_table(summary: Summary) -> str:
    """score | value | CI | meaning, one row per score."""
    rows = [("score", "value", f"{round(100 * summary.level)}% CI", "meaning")]
    for d in score_defs(summary.samples):
        e = summary.scores[d.name]
        ci = "-" if e.ci is None else f"[{_number(e.ci[0])}, {_number(e.ci[1])}]"
        rows.append((d.name, _number(e.value), ci, d.meaning))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
    solved = sum(1 for t in summary.per_task.values() if t["solved"])
    return "\n".join(lines) + (f"\n{summary.tasks} tasks x {summary.samples} samples; {solved} tasks solved at least "
                               f"once; {summary.timing['attempt_seconds_total']:.1f} s in attempts")
