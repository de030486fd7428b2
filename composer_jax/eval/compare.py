"""`composer-jax eval compare RUN_A RUN_B`: two evaluations on the same tasks, paired.

For every score both runs report, the difference B - A on the tasks both ran, with a paired bootstrap
interval (each replicate draws the same tasks for both runs, so task difficulty cancels), and the
tasks that flipped: solved (in at least one attempt) by one run and never by the other. Read from the
runs' attempts.jsonl, not their summaries, so runs with different K compare on their common scores.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from composer_jax.eval.errors import EvalError
from composer_jax.eval.scores import (DEFAULT_LEVEL, DEFAULT_RESAMPLES, Estimate, ScoreDef, TaskTable, bootstrap,
                                      paired_difference, resample_rows, score_defs, task_table)
from composer_jax.eval.store import RUN, read_attempts


@dataclasses.dataclass(frozen=True)
class Row:
    score: ScoreDef
    a: Estimate
    b: Estimate
    diff: Estimate               # B - A

    @property
    def verdict(self) -> str:
        """'B better' / 'A better' when the interval of B - A excludes 0, else ''."""
        if self.diff.ci is None or self.diff.ci[0] <= 0 <= self.diff.ci[1]:
            return ""
        return "B better" if (self.diff.ci[0] > 0) == (self.score.better > 0) else "A better"


@dataclasses.dataclass(frozen=True)
class Comparison:
    names: tuple[str, str]               # 'RUN (agent)' of A and B
    level: float
    tasks: tuple[str, ...]               # in both runs
    only: tuple[tuple[str, ...], tuple[str, ...]]   # tasks in A only, in B only
    rows: list[Row]
    solved_only_by: tuple[tuple[str, ...], tuple[str, ...]]   # flipped: solved by A only, by B only
    pass1: tuple[np.ndarray, np.ndarray]  # per-task pass@1 of A and B over `tasks`


def _load(run_dir: Path) -> tuple[str, TaskTable]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvalError(f"{run_dir}: not a directory (expected an evaluation run directory)")
    records = read_attempts(run_dir)
    try:
        agent = json.loads((run_dir / RUN).read_text(encoding="utf-8"))["agent"]
    except (OSError, ValueError, KeyError, TypeError):
        raise EvalError(f"{run_dir}: no readable {RUN} naming the agent (not an evaluation run directory)") from None
    try:
        return f"{run_dir} ({agent})", task_table(records)
    except EvalError as e:
        raise EvalError(f"{run_dir}: {e}") from None


def compare_runs(run_a: str | Path, run_b: str | Path, *, level: float = DEFAULT_LEVEL,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Comparison:
    (name_a, full_a), (name_b, full_b) = _load(Path(run_a)), _load(Path(run_b))
    common = sorted(set(full_a.tasks) & set(full_b.tasks))
    if not common:
        raise EvalError(f"{run_a} and {run_b} have no task in common: nothing to compare")
    a, b = full_a.take(common), full_b.take(common)
    rows_idx = resample_rows(len(common), resamples, seed)
    defs = [d for d in score_defs(max(a.samples, b.samples)) if d.name in a.num and d.name in b.num]
    rows = [Row(d, bootstrap(a.num[d.name], a.den[d.name], rows_idx, level),
                bootstrap(b.num[d.name], b.den[d.name], rows_idx, level),
                paired_difference((a.num[d.name], a.den[d.name]), (b.num[d.name], b.den[d.name]), rows_idx, level))
            for d in defs]
    solved_a, solved_b = a.solved > 0, b.solved > 0
    flipped = tuple(tuple(t for t, x, y in zip(common, first, second) if x and not y)
                    for first, second in ((solved_a, solved_b), (solved_b, solved_a)))
    only = (tuple(sorted(set(full_a.tasks) - set(common))), tuple(sorted(set(full_b.tasks) - set(common))))
    return Comparison((name_a, name_b), level, tuple(common), only, rows, flipped, (a.num["pass@1"], b.num["pass@1"]))


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}" if abs(x) < 1000 else f"{x:+.0f}"


def _plain(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 1000 else f"{x:.0f}"


def _listing(tasks: tuple[str, ...], limit: int = 20) -> str:
    shown = ", ".join(tasks[:limit])
    return shown + (f", ... ({len(tasks) - limit} more)" if len(tasks) > limit else "") if tasks else "none"


def comparison_table(c: Comparison) -> str:
    head = ("score", "A", "B", "B - A", f"{round(100 * c.level)}% CI of B - A", "")
    body = [(r.score.name, _plain(r.a.value), _plain(r.b.value), _signed(r.diff.value),
             "-" if r.diff.ci is None else f"[{_signed(r.diff.ci[0])}, {_signed(r.diff.ci[1])}]", r.verdict)
            for r in c.rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(5)]
    lines = [f"A: {c.names[0]}", f"B: {c.names[1]}"]
    for row in [head, *body]:
        lines.append("  ".join([row[0].ljust(widths[0]), *(x.rjust(w) for x, w in zip(row[1:4], widths[1:4])),
                                row[4].ljust(widths[4]), row[5]]).rstrip())
    lines.append(f"{len(c.tasks)} tasks in both runs (only in A: {len(c.only[0])}, only in B: {len(c.only[1])})")
    lines.append(f"flipped: solved only by B ({len(c.solved_only_by[1])}): {_listing(c.solved_only_by[1])}")
    lines.append(f"         solved only by A ({len(c.solved_only_by[0])}): {_listing(c.solved_only_by[0])}")
    return "\n".join(lines)


def comparison_plot(c: Comparison, path: str | Path) -> Path:
    """A PNG: per score, B - A with its interval (each on its own scale, 0 marked); beside them,
    per-task pass@1 of B against A with the flipped tasks marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(c.rows)
    fig = plt.figure(figsize=(11, max(4.0, 0.9 * n + 1.5)))
    grid = fig.add_gridspec(n, 2, width_ratios=(1.3, 1), hspace=1.4, wspace=0.3)
    for i, row in enumerate(c.rows):
        ax = fig.add_subplot(grid[i, 0])
        ax.axvline(0.0, color="0.6", lw=1)
        if row.diff.value is not None:
            lo, hi = row.diff.ci if row.diff.ci is not None else (row.diff.value, row.diff.value)
            color = {"B better": "tab:green", "A better": "tab:red"}.get(row.verdict, "tab:blue")
            ax.errorbar([row.diff.value], [0], xerr=[[row.diff.value - lo], [hi - row.diff.value]], fmt="o",
                        color=color, capsize=4)
            span = max(abs(lo), abs(hi)) * 1.3
            ax.set_xlim(-span or -1, span or 1)   # no difference at all: a unit scale
        ax.set_yticks([])
        ax.set_title(f"{row.score.name}: B - A = {_signed(row.diff.value)}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.locator_params(axis="x", nbins=5)
    ax = fig.add_subplot(grid[:, 1])
    pa, pb = c.pass1
    ax.plot([0, 1], [0, 1], color="0.6", lw=1)
    flipped = set(c.solved_only_by[0]) | set(c.solved_only_by[1])
    mark = np.array([t in flipped for t in c.tasks])
    ax.scatter(pa[~mark], pb[~mark], s=18, alpha=0.6, label="tasks")
    if mark.any():
        ax.scatter(pa[mark], pb[mark], s=30, color="tab:orange", label="flipped")
    ax.set(xlim=(-0.05, 1.05), ylim=(-0.05, 1.05), xlabel="pass@1 of A", ylabel="pass@1 of B",
           title=f"per task ({len(c.tasks)} tasks)")
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"B - A with {round(100 * c.level)}% paired bootstrap intervals\nA: {c.names[0]}\nB: {c.names[1]}",
                 fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
