"""Tasks: the task directory format, loading and validation, and checking (reward from tests run in
the sandbox). Uses `composer_jax.sandbox`; never imports jax."""

from composer_jax.tasks.check import STATUSES, CheckResult, check_task, check_tasks, summary_line
from composer_jax.tasks.format import Task, TaskError, load_task
from composer_jax.tasks.workspace import copy_repo, is_test_file, restore_tests

__all__ = ["STATUSES", "CheckResult", "Task", "TaskError", "check_task", "check_tasks", "copy_repo", "is_test_file",
           "load_task", "restore_tests", "summary_line"]
