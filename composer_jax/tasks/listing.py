"""`composer-jax tasks list OUT_DIR`: a table of the tasks in a directory."""

from __future__ import annotations

from pathlib import Path

from composer_jax.tasks.format import Task, TaskError, load_task

COLUMNS = ("id", "target tests", "deleted lines", "pass rate")


def find_tasks(root: str | Path) -> list[Task]:
    """Every task directory directly under `root` (those holding a task.json), validated, by id."""
    root = Path(root)
    if not root.is_dir():
        raise TaskError(str(root), "directory", "does not exist or is not a directory")
    return sorted((load_task(d) for d in root.iterdir() if (d / "task.json").is_file()), key=lambda t: t.id)


def task_table(tasks: list[Task]) -> str:
    """One row per task: id, number of target tests, deleted lines and pass rate ('-' when not known)."""
    rows = [COLUMNS] + [(t.id, str(len(t.target_tests)), str(t.difficulty.get("deleted_lines", "-")),
                         "-" if t.pass_rate is None else f"{t.pass_rate:.2f}") for t in tasks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(line.rstrip() for line in lines) + f"\n{len(tasks)} tasks"
