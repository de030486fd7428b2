"""Tasks: the task directory format, loading and validation, checking (reward from tests run in the
sandbox), and generating tasks from a repository: by feature deletion or bug injection, one
signature for both (`generate(repo_dir, out_dir, config, *, sandbox, log) -> report`; families.py
names them). Uses `composer_jax.sandbox`; never imports jax."""

from composer_jax.tasks.bug_injection import BugInjectionConfig, generate_bug_tasks
from composer_jax.tasks.check import STATUSES, CheckResult, check_task, check_tasks, summary_line
from composer_jax.tasks.feature_deletion import FeatureDeletionConfig, FeatureDeletionError, generate_tasks
from composer_jax.tasks.format import Task, TaskError, load_task, write_pass_rate
from composer_jax.tasks.workspace import copy_repo, is_test_file, restore_tests

__all__ = ["STATUSES", "BugInjectionConfig", "CheckResult", "FeatureDeletionConfig",
           "FeatureDeletionError", "Task", "TaskError", "check_task", "check_tasks", "copy_repo", "generate_bug_tasks",
           "generate_tasks", "is_test_file", "load_task", "restore_tests", "summary_line", "write_pass_rate"]
