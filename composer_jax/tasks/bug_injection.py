"""Synthetic coding tasks by bug injection: `generate_bug_tasks(REPO_DIR, OUT_DIR, config)`.

The same pipeline as feature deletion (generation.py: the clean copy, the traced baseline without
the tests that do not pass or have unstable ids, staged checks in the sandbox `workers` at a time,
the leak scrub and scan, the hold-out, report.json), with another kind of change:

1. Sites: the functions and methods that specific passing tests run (not at import, by at most
   `max_target_fraction` of the passing tests) and, in their bodies, every mutation of `kinds`
   (mutations.py: an operator, a bound, swapped arguments, a dropped condition or early return, a
   constant), each a minimal text edit. Ordered by `seed`: kinds take turns (in a seeded order), each
   kind's sites shuffled.
2. A mutation is kept only if some tests now fail, all of them tests that ran the mutated definition
   (the targets), every other passing test still passes, solution.patch (one small hunk) makes them
   all pass again and no original line it changed is left anywhere in the task directory.
3. The instruction reads like an issue report: the failing tests, what pytest says of each failure,
   and the source of a few of them; never the mutated definition, line or code (a failure message or
   test source that holds the original or the mutated line is left out). The task id names only the
   package.
4. task.json: `family` "bug_injection" and `difficulty`: `mutation` (the kind), `changed_lines`,
   `target_tests`, `definitions` (how many of the repository's functions the target tests run: where
   the defect may hide) and `pass_rate` (null). report.json adds the mutated definition and line of
   each task, and sites and kept tasks per kind.

REPO_DIR is only ever read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import textwrap
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks.candidates import traced_definitions
from composer_jax.tasks.features import FileEdit, module_name
from composer_jax.tasks.format import ID_PATTERN, MUTATIONS
from composer_jax.tasks.generation import (REJECTED, Context, GenerationConfig, Outcome, Plan, counts, evaluate,
                                           generate)
from composer_jax.tasks.generation import summary as _summary
from composer_jax.tasks.levels import shown_tests, target_list
from composer_jax.tasks.mutations import Mutation, find_mutations
from composer_jax.tasks.scrub import kept_code, line_needles
from composer_jax.tasks.tracing import Baseline, FeatureDeletionError

__all__ = ["BugInjectionConfig", "generate_bug_tasks", "summary"]
FAMILY = "bug_injection"
NOT_CANDIDATE = ("untested", "runs_at_import", "not_specific", "syntax_error", "not_utf8", "edit_mismatch")
MAX_MESSAGES = 5             # failure messages an instruction quotes
MAX_MESSAGE_CHARS = 300


@dataclasses.dataclass(frozen=True)
class BugInjectionConfig(GenerationConfig):
    kinds: tuple[str, ...] = MUTATIONS     # the mutations made (mutations.py)

    def __post_init__(self):
        super().__post_init__()
        unknown = [k for k in self.kinds if k not in MUTATIONS]
        if not self.kinds or unknown:
            raise FeatureDeletionError(f"bug injection setting 'kinds' must be some of {', '.join(MUTATIONS)}, "
                                       f"got {', '.join(self.kinds) or 'none'}")


@dataclasses.dataclass(frozen=True, eq=False)
class BugCandidate:
    id: str
    mutation: Mutation
    tests: frozenset[str]         # the passing tests that ran the mutated definition

    @property
    def files(self) -> tuple[FileEdit, ...]:
        return (FileEdit(self.mutation.path, self.mutation.original, self.mutation.modified),)


def _bug_id(m: Mutation) -> str:
    """'<package>.bug-<hash>': the package, never the definition or the line (the agent sees the id)."""
    digest = hashlib.sha1(f"{m.path}\0{m.kind}\0{m.modified}".encode()).hexdigest()[:10]
    name = f"{module_name(m.path).split('.')[0]}.bug-{digest}".lstrip("._-")
    return name if ID_PATTERN.fullmatch(name) else f"t{digest}"


def select_mutations(texts: dict[str, str], baseline: Baseline, *, max_target_fraction: float, seed: int,
                     kinds: tuple[str, ...]) -> tuple[list[BugCandidate], Counter, Counter, dict]:
    """The mutation candidates (module docstring, step 1) in the order `seed` gives; {reason: count} of
    the functions (and files, sites) that give none; sites per kind; {definition: passing tests that
    ran it}."""
    definitions, tests_of, at_import, skipped = traced_definitions(texts, baseline)
    most = max(1, int(max_target_fraction * len(baseline.passed)))
    by_kind: dict[str, list[BugCandidate]] = defaultdict(list)
    for path, defs in definitions.items():
        eligible = []
        for d in (d for d in defs if d.kind != "class"):
            tests = tests_of.get(d, set())
            reason = ("runs_at_import" if d in at_import else "untested" if not tests else
                      "not_specific" if len(tests) > most else None)
            if reason:
                skipped[reason] += 1
            else:
                eligible.append(d)
        mutations, mismatched = find_mutations(texts[path], eligible, kinds)
        if mismatched:
            skipped["edit_mismatch"] += mismatched
        for m in mutations:
            by_kind[m.kind].append(BugCandidate(_bug_id(m), m, frozenset(tests_of[m.definition])))
    rng = random.Random(seed)
    order = [k for k in kinds if by_kind[k]]
    rng.shuffle(order)
    for kind in order:
        rng.shuffle(by_kind[kind])
    candidates, ids = [], set()
    for i in range(max((len(v) for v in by_kind.values()), default=0)):
        for kind in order:
            if i < len(by_kind[kind]) and by_kind[kind][i].id not in ids:
                ids.add(by_kind[kind][i].id)
                candidates.append(by_kind[kind][i])
    return candidates, skipped, Counter({k: len(v) for k, v in by_kind.items()}), tests_of


def _message(text: str) -> str:
    said = "\n".join([line.rstrip() for line in text.strip().splitlines() if line.strip()][:3])
    return said if len(said) <= MAX_MESSAGE_CHARS else said[:MAX_MESSAGE_CHARS] + " ..."


def bug_instruction(targets: list[str], messages: dict[str, str], command: str, texts: dict[str, str],
                    hide: tuple[str, ...]) -> str:
    """An issue report of the failing `targets`: pytest's `messages` and their source; nothing that
    holds one of `hide` (the changed lines, before and after)."""
    fail = "1 test fails" if len(targets) == 1 else f"{len(targets)} tests fail"
    parts = [(f"Bug report: {fail}. The code of this repository (not its tests) has a defect: behaviour the "
              "tests check is wrong. Find it and fix it; do not edit the tests.")]
    parts.append(target_list(targets))
    said = [f"- {t}:\n{textwrap.indent(_message(messages[t]), '    ')}" for t in targets
            if t in messages and messages[t].strip() and not any(h in messages[t] for h in hide)]
    if said:
        parts.append("What pytest reports:\n" + "\n".join(said[:MAX_MESSAGES]))
    shown = shown_tests(texts, targets, hide)
    if shown:
        parts.append(shown)
    parts.append(f"Run the tests with: {command}")
    return "\n\n".join(parts)


def _check(candidate: BugCandidate, ctx: Context, tests_of: dict) -> Outcome:
    m = candidate.mutation
    before, after = m.changed()
    hide = tuple(sorted({line.strip() for line in before + after if line.strip()}))
    kept = kept_code(ctx.texts, candidate.files)

    def describe(targets: list[str], messages: dict[str, str]) -> tuple[str, dict]:
        failing = set(targets)
        involved = sum(1 for ran in tests_of.values() if ran & failing)
        return (bug_instruction(targets, messages, ctx.command, ctx.texts, hide),
                {"family": FAMILY, "difficulty": {"mutation": m.kind, "changed_lines": m.changed_lines,
                                                  "target_tests": len(targets), "definitions": involved,
                                                  "pass_rate": None}})

    return evaluate(candidate, candidate.files, line_needles(before, kept), describe, ctx)


def generate_bug_tasks(repo_dir: str | Path, out_dir: str | Path, config: BugInjectionConfig = BugInjectionConfig(),
                       *, sandbox: Sandbox | None = None, log: Callable[[str], None] = lambda line: None,
                       prepared=None) -> dict:
    """Write bug-injection tasks of the repository REPO_DIR into OUT_DIR (see the module docstring);
    returns the report (also OUT_DIR/report.json). FeatureDeletionError: unusable input, one line.
    `prepared`: generation.prepare's clean copy and baseline of REPO_DIR, when another family shares them."""

    def plan(texts: dict[str, str], baseline: Baseline) -> Plan:
        candidates, skipped, sites, tests_of = select_mutations(
            texts, baseline, max_target_fraction=config.max_target_fraction, seed=config.seed, kinds=config.kinds)
        log(f"{len(candidates)} mutations ({counts(sites)}); not mutated: {counts(skipped)}")

        def kept_line(outcome: Outcome) -> str:
            m = outcome.candidate.mutation
            return f"{m.kind} in {m.definition.qualname} ({m.path}:{m.line})"

        def report(outcomes: list[Outcome]) -> dict:
            tried = Counter(o.candidate.mutation.kind for o in outcomes)
            kept = Counter(o.candidate.mutation.kind for o in outcomes if o.reason is None)
            rejected = Counter((o.candidate.mutation.kind, o.reason) for o in outcomes if o.reason)
            return {"family": FAMILY, "candidates": len(candidates),
                    "not_candidates": {r: skipped[r] for r in NOT_CANDIDATE if skipped[r]},
                    "kinds": {k: {"sites": sites[k], "tried": tried[k], "kept": kept[k],
                                  "rejected": {r: rejected[k, r] for r in REJECTED if rejected[k, r]}}
                              for k in config.kinds},
                    "tasks": [{"id": o.candidate.id, "path": o.candidate.mutation.path,
                               "definition": o.candidate.mutation.definition.qualname,
                               "line": o.candidate.mutation.line, "mutation": o.candidate.mutation.kind,
                               "target_tests": o.targets, "changed_lines": o.candidate.mutation.changed_lines,
                               "removed_files": list(o.removed_files)} for o in outcomes if o.reason is None]}

        return Plan(candidates, lambda c, ctx: _check(c, ctx, tests_of), kept_line, report)

    return generate(repo_dir, out_dir, config, sandbox, log, plan, prepared)


def summary(report: dict) -> str:
    """The report in a few lines, for the command line: feature deletion's, and kept of tried per kind."""
    kinds = ", ".join(f"{k} {v['kept']}/{v['tried']}" for k, v in report["kinds"].items() if v["tried"])
    return _summary(report, "mutations") + f"\nkept/tried per kind: {kinds or 'none tried'}"
