"""Synthetic coding tasks by feature deletion: `generate_tasks(REPO_DIR, OUT_DIR, config)`.

1. A clean copy of the repository (scrub.clean_copy); its packages must not be importable from an
   installed copy in the sandbox (scrub.installed_copies).
2. The baseline: the tests run once in the sandbox with tracing (tracing.run_baseline); tests that do
   not pass then, and tests whose node ids a second collection under another hash seed does not name
   (unstable ids), are left out of every task, and reported.
3. Candidates: functions, methods and classes that specific passing tests run (candidates.py), and
   what deleting each takes away at the `level` (levels.py: body, definition or feature).
4. In seed order, `workers` at a time, each candidate is deleted in a staged copy, leaks are scrubbed
   (scrub.py) and the tests run in the sandbox (check.check_task). A task is kept only if some tests
   now fail, all of them tests that ran the feature (the targets), every other passing test still
   passes (pass_to_pass), the task validates (format.load_task), solution.patch makes every test pass
   again (check_task with the solution) and no leak is left anywhere in its directory; until
   `max_tasks` are kept. The outcome does not depend on `workers`.
5. OUT_DIR/<id>/{repo/, task.json, solution.patch} per task, and OUT_DIR/report.json.

REPO_DIR is only ever read.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks.candidates import NOT_CANDIDATE, Candidate, select_candidates
from composer_jax.tasks.features import Deletion, docstring, signature, word_counts
from composer_jax.tasks.generation import (DEFAULT_TEST_COMMAND, Context, GenerationConfig, Outcome, Plan, counts,
                                           evaluate, generate)
from composer_jax.tasks.generation import summary as _summary
from composer_jax.tasks.levels import CONTINUE_ON_COLLECTION_ERRORS, LEVELS, level_instruction, target_list
from composer_jax.tasks.scrub import kept_code, leak_needles
from composer_jax.tasks.tracing import Baseline, FeatureDeletionError

__all__ = ["DEFAULT_TEST_COMMAND", "FeatureDeletionConfig", "FeatureDeletionError", "generate_tasks", "summary"]
FAMILY = "feature_deletion"


@dataclasses.dataclass(frozen=True)
class FeatureDeletionConfig(GenerationConfig):
    min_lines: int = 3                   # lines of code a deletion removes, at least
    level: str = "body"                  # how much of a feature a task deletes: one of LEVELS (levels.py)

    def __post_init__(self):
        super().__post_init__()
        if self.level not in LEVELS:
            raise FeatureDeletionError(f"--level must be one of {', '.join(LEVELS)}, "
                                       f"got {self.level!r}")
        if not self.min_lines > 0:
            raise FeatureDeletionError(f"task generation setting 'min_lines' must be > 0, got {self.min_lines}")


def instruction(deletion: Deletion, targets: list[str], command: str) -> str:
    """What is missing, from the feature's signature, docstring and tests (never its code)."""
    f = deletion.feature
    if f.kind == "class":
        methods = ", ".join(f"`{d.name}`" for d in deletion.stubbed)
        parts = [(f"The methods {methods} of the class `{f.qualname}` in `{deletion.path}` have lost their "
                  "implementation: their bodies now raise NotImplementedError. Implement them.")]
    else:
        parts = [(f"The {f.kind} `{f.qualname}` in `{deletion.path}` has lost its implementation: its body now "
                  "raises NotImplementedError. Implement it.")]
    if deletion.helpers:
        parts.append("Private helpers that only it used were removed too; write whatever helpers you need.")
    for d in ([f, *deletion.stubbed] if f.kind == "class" else [f]):
        doc = docstring(d)
        about = f"Its docstring:\n{textwrap.indent(doc, '    ')}" if doc else "It has no docstring."
        parts.append(f"{textwrap.indent(signature(d), '    ')}\n{about}")
    parts.append(target_list(targets))
    parts.append(f"Run the tests with: {command}")
    return "\n\n".join(parts)


def _check(candidate: Candidate, ctx: Context) -> Outcome:
    """Stage the deletion and check it (module docstring, step 4)."""
    d = candidate.deletion
    kept = kept_code(ctx.texts, d.files)

    def describe(targets: list[str], messages: dict[str, str]) -> tuple[str, dict]:
        text = (instruction(d, targets, ctx.command) if d.level == "body" else
                level_instruction(d, targets, ctx.command, ctx.texts, word_counts(kept)))
        return text, {"family": FAMILY, "level": d.level,
                      "difficulty": {"deleted_lines": d.deleted_lines, "deleted_definitions": d.definitions,
                                     "deleted_files": len(d.deleted_files), "target_tests": len(targets),
                                     "pass_rate": None}}

    return evaluate(candidate, d.files, leak_needles(d, kept), describe, ctx)


def generate_tasks(repo_dir: str | Path, out_dir: str | Path, config: FeatureDeletionConfig = FeatureDeletionConfig(),
                   *, sandbox: Sandbox | None = None, log: Callable[[str], None] = lambda line: None,
                   prepared=None) -> dict:
    """Write feature-deletion tasks of the repository REPO_DIR into OUT_DIR (see the module docstring);
    returns the report (also OUT_DIR/report.json). FeatureDeletionError: unusable input, one line.
    `prepared`: generation.prepare's clean copy and baseline of REPO_DIR, when another family shares them."""

    def plan(texts: dict[str, str], baseline: Baseline) -> Plan:
        candidates, skipped = select_candidates(texts, baseline, min_lines=config.min_lines,
                                                max_target_fraction=config.max_target_fraction, seed=config.seed,
                                                level=config.level)
        log(f"{len(candidates)} candidates ({sum(skipped.values())} definitions are not: {counts(skipped)})")

        def kept_line(outcome: Outcome) -> str:
            d = outcome.candidate.deletion
            return f"{d.definitions} definitions and {len(d.deleted_files)} files deleted"

        def report(outcomes: list[Outcome]) -> dict:
            return {"family": FAMILY, "level": config.level, "candidates": len(candidates),
                    "not_candidates": {r: skipped[r] for r in NOT_CANDIDATE if skipped[r]},
                    "tasks": [{"id": o.candidate.id, "path": o.candidate.deletion.path,
                               "definition": o.candidate.deletion.feature.qualname,
                               "kind": o.candidate.deletion.feature.kind, "target_tests": o.targets,
                               "deleted_lines": o.candidate.deletion.deleted_lines,
                               "deleted_definitions": o.candidate.deletion.definitions,
                               "deleted_files": list(o.candidate.deletion.deleted_files),
                               "removed_files": list(o.removed_files)} for o in outcomes if o.reason is None]}

        # at the levels that delete whole definitions, a test module may not import: the others still run
        return Plan(candidates, _check, kept_line, report,
                    "" if config.level == "body" else CONTINUE_ON_COLLECTION_ERRORS)

    return generate(repo_dir, out_dir, config, sandbox, log, plan, prepared)


def summary(report: dict) -> str:
    """The report in a few lines, for the command line."""
    level = report.get("level", "body")
    return _summary(report, "candidates" if level == "body" else f"candidates (level {level})")
