"""Which definitions of a repository are worth deleting: those that specific passing tests run.

A definition is credited with a test when code that starts inside its lines ran during the test (so a
class is credited through its methods, a function through the closures and comprehensions inside it).
It is a candidate if it did not run at import or collection (deleting it would break the import, and
every test with it), passing tests ran it, no more than `max_target_fraction` of the passing tests
ran it (a feature, not the core everything needs), and its deletion removes at least `min_lines`
lines of code (measured on its body deletion at every level, so that all levels draw from one pool;
at the `feature` level, a candidate whose deleted set an earlier one has already is `same_feature`, and
a module whose top-level definitions only its own targets run is one more candidate, deleted whole).
Definitions that are not candidates are counted by reason (NOT_CANDIDATE; for
`syntax_error` and `not_utf8`, whole files are counted).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter, defaultdict

from composer_jax.tasks.features import (Definition, Deletion, find_definitions, module_name, plan_deletion,
                                         word_counts)
from composer_jax.tasks.format import ID_PATTERN
from composer_jax.tasks.levels import RepoIndex, plan_level
from composer_jax.tasks.tracing import Baseline, CodeKey
from composer_jax.tasks.workspace import is_test_file

NOT_CANDIDATE = ("untested", "runs_at_import", "not_specific", "too_small", "no_body", "inline_body",
                 "abstract_or_overload", "syntax_error", "not_utf8",
                 "same_feature", "edit_breaks_syntax")   # levels definition and feature (levels.py)


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
    id: str                       # the task id: dotted module path and qualname
    deletion: Deletion
    tests: frozenset[str]         # the passing tests that ran it


def task_id(path: str, qualname: str | None) -> str:
    """'src/pkg/mod.py', 'Stats.mean' -> 'pkg.mod.Stats.mean' (None: 'pkg.mod'), made a valid task id."""
    name = module_name(path) + (f".{qualname}" if qualname else "")
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-")
    return name if ID_PATTERN.fullmatch(name) else f"t{name}"


def _credit(definitions: dict[str, list[Definition]], baseline: Baseline) -> tuple[dict, set]:
    """{definition: passing tests that ran it}, and the definitions that ran outside any test."""
    def containing(key: CodeKey) -> list[Definition]:
        path, line, name = key
        return [] if name == "<module>" else [d for d in definitions.get(path, ()) if d.contains(line)]

    def is_class_body(d: Definition, key: CodeKey) -> bool:  # runs at import by nature: not a use of the class
        return d.kind == "class" and key[1] == d.start and key[2] == d.name

    tests_of: dict[Definition, set[str]] = defaultdict(set)
    found: dict[CodeKey, list[Definition]] = {}
    for test in baseline.passed:
        for key in baseline.calls[test]:
            if key not in found:
                found[key] = containing(key)
            for d in found[key]:
                tests_of[d].add(test)
    at_import = {d for key in baseline.at_import for d in containing(key) if not is_class_body(d, key)}
    return tests_of, at_import


def traced_definitions(texts: dict[str, str], baseline: Baseline
                       ) -> tuple[dict[str, list[Definition]], dict[Definition, set[str]], set[Definition], Counter]:
    """The definitions of the repository's non-test Python files (`texts`: scrub.repo_texts), the passing
    tests that ran each, those that ran at import, and {reason: count} of the files left out
    (`not_utf8`, `syntax_error`)."""
    skipped: Counter = Counter()
    definitions: dict[str, list[Definition]] = {}
    for path, text in sorted(texts.items()):
        if path.endswith(".py") and not is_test_file(path):
            if "\ufffd" in text:  # not UTF-8 (scrub.repo_texts replaced bytes): it could not be rewritten as it was
                skipped["not_utf8"] += 1
                continue
            try:
                definitions[path] = find_definitions(path, text)
            except SyntaxError:
                skipped["syntax_error"] += 1
    tests_of, at_import = _credit(definitions, baseline)
    return definitions, tests_of, at_import, skipped


def _deleted_set(deletion: Deletion) -> frozenset[tuple[str, str]]:
    return frozenset((h.path, h.qualname) for h in deletion.helpers)


def select_candidates(texts: dict[str, str], baseline: Baseline, *, min_lines: int, max_target_fraction: float,
                      seed: int, level: str = "body") -> tuple[list[Candidate], Counter]:
    """Candidates from the repository's non-test Python files (`texts`: scrub.repo_texts), their
    deletions at `level` (levels.py), in the order `seed` shuffles them to; and {reason: count} of the
    definitions that are not candidates."""
    definitions, tests_of, at_import, skipped = traced_definitions(texts, baseline)
    counts = word_counts(texts.values())
    most = max(1, int(max_target_fraction * len(baseline.passed)))
    index = RepoIndex.build(texts, definitions, tests_of, at_import, counts) if level != "body" else None
    candidates, ids, deleted_sets = [], set(), set()

    def add(base: str, deletion: Deletion, tests: set[str]) -> None:
        name = base
        while name in ids:
            name = f"{base}-{len(ids)}"
        ids.add(name)
        candidates.append(Candidate(name, deletion, frozenset(tests)))

    for path, defs in definitions.items():
        for d in defs:
            tests = tests_of.get(d, set())
            if d in at_import:
                skipped["runs_at_import"] += 1
            elif not tests:
                skipped["untested"] += 1
            elif len(tests) > most:
                skipped["not_specific"] += 1
            elif isinstance(deletion := plan_deletion(d, defs, texts[path], counts), str):
                skipped[deletion] += 1
            elif deletion.code_lines < min_lines:
                skipped["too_small"] += 1
            elif index and isinstance(deletion := plan_level(level, d, index), str):
                skipped[deletion] += 1
            elif level == "feature" and _deleted_set(deletion) in deleted_sets:
                skipped["same_feature"] += 1
            else:
                deleted_sets.add(_deleted_set(deletion))
                add(task_id(path, d.qualname), deletion, tests)
    if level == "feature":
        # a whole module as the feature: the tests of its top-level definitions are the targets, so a module
        # that only they test goes as a whole
        for path, defs in definitions.items():
            ran = [d for d in defs if d.owner is None and d not in at_import and tests_of.get(d)]
            tests = set().union(*(tests_of[d] for d in ran))
            if len(ran) < 2 or len(tests) > most or path.endswith("__init__.py"):
                continue   # one definition is a candidate of its own already
            deletion = plan_level(level, ran[0], index, targets=tests)
            if not isinstance(deletion, str) and deletion.deleted_files and _deleted_set(deletion) not in deleted_sets:
                deleted_sets.add(_deleted_set(deletion))
                add(task_id(path, None), deletion, tests)
    random.Random(seed).shuffle(candidates)
    return candidates, skipped
